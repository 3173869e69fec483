"""Ranks at uneven paces, no collectives: rank 1 takes --slow seconds per step (beating all the while), the
others 0.05 s. A fast rank skips its snapshots while its newest one is not held by rank 1 yet, and waits for rank
1 once it is far enough ahead. After a restore each rank checks that its state is the restored step's; at the
end it prints it."""

import argparse
import os
import time

import torch

import ftrun

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=4)
parser.add_argument("--slow", type=float, default=3.0)
parser.add_argument("--no-wait", action="store_true", help="end without Snapshotter.wait() (it runs at exit)")
args = parser.parse_args()
rank = int(os.environ["RANK"])
state = {"weights": torch.zeros(1024)}
snap = ftrun.Snapshotter(state, every=1)
start = snap.restore()
assert torch.equal(state["weights"], torch.full((1024,), float(start))), (start, state["weights"][:4])
for step in range(start, args.steps):
    state["weights"] += 1
    end = time.monotonic() + (args.slow if rank == 1 else 0.05)
    while time.monotonic() < end:
        ftrun.heartbeat(step)
        time.sleep(0.05)
    snap.save(step + 1)
if not args.no_wait:
    snap.wait()
print(f"rank {rank} done at step {args.steps} with weights {int(state['weights'][0])}, restored from step {start}, "
      f"{snap.skipped} snapshots skipped", flush=True)
