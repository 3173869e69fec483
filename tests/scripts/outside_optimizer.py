"""A model whose optimizer is not in the Snapshotter's state (plain SGD keeps no state of its own) and a
parameter updated by nothing but that optimizer: the gradient of -sum(w), kept, and a learning rate of 1, so w ==
step after each step, and each step follows the save() before it at once. The copy of a snapshot reads the
parameter live, so that optimizer's step must wait for it as well; after a restore the script checks that every
element is the restored step's, and at the end that it is --steps."""

import argparse
import os

import torch

import ftrun

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=12)
parser.add_argument("--mib", type=int, default=64, help="size of the parameter (a copy long enough to overlap)")
args = parser.parse_args()
model = torch.nn.Linear(args.mib << 18, 1, bias=False)
with torch.no_grad():
    model.weight.zero_()
optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
snap = ftrun.Snapshotter({"model": model}, every=1)
start = snap.restore()
assert torch.equal(model.weight, torch.full_like(model.weight, start)), (start, model.weight.unique()[:4])
(-model.weight.sum()).backward()  # a gradient of -1 everywhere, for every step
for step in range(start, args.steps):
    optimizer.step()
    snap.save(step + 1)
snap.wait()
assert torch.equal(model.weight, torch.full_like(model.weight, args.steps))
print(f"rank {os.environ['RANK']} done at step {args.steps}, restored from step {start}", flush=True)
