"""Ranks at uneven paces, no collectives: rank 1 takes --slow seconds per step (beating all the while), the
others 0.05 s. A fast rank skips its snapshots while its newest one is not held by rank 1 yet, and waits for rank
1 once it is far enough ahead. The weights are a module's parameter, updated by hand (no optimizer; the snapshot
clones them at save()) or with --optimizer by an SGD step (the snapshot copies them live); --after-loop changes
them once the loop is done, as a script that loads its best weights does. After a restore each rank checks that
its state is the restored step's; at the end it prints it."""

import argparse
import os
import time

import torch

import ftrun

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=4)
parser.add_argument("--slow", type=float, default=3.0)
parser.add_argument("--every", type=int, default=1, help="snapshot interval (save() is called every step)")
parser.add_argument("--optimizer", action="store_true", help="an SGD step adds 1 to the weights, not the loop")
parser.add_argument("--after-loop", type=float, default=0.0, help="added to the weights after the loop")
parser.add_argument("--no-wait", action="store_true", help="end without Snapshotter.wait() (it runs at exit)")
args = parser.parse_args()
rank = int(os.environ["RANK"])


class Weights(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.value = torch.nn.Parameter(torch.zeros(1024), requires_grad=False)


model = Weights()
weights = model.value
state = {"model": model}
optimizer = None
if args.optimizer:
    weights.requires_grad_(True)
    optimizer = torch.optim.SGD([weights], lr=1.0)
    (-weights.sum()).backward()  # a gradient of -1, kept for every step
snap = ftrun.Snapshotter(state, every=args.every)
start = snap.restore()
assert torch.equal(weights, torch.full((1024,), float(start))), (start, weights[:4])
for step in range(start, args.steps):
    if optimizer is not None:
        optimizer.step()
    else:
        weights += 1
    end = time.monotonic() + (args.slow if rank == 1 else 0.05)
    while time.monotonic() < end:
        ftrun.heartbeat(step)
        time.sleep(0.05)
    snap.save(step + 1)
if not args.no_wait:
    snap.wait()
print(f"rank {rank} done at step {args.steps} with weights {int(weights[0])}, restored from step {start}, "
      f"{snap.skipped} snapshots skipped", flush=True)
with torch.no_grad():
    weights += args.after_loop
