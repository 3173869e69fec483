"""Ranks at uneven paces, no collectives: rank 1 takes --slow seconds per step (beating all the while), so the
keeper holds rank 0's third snapshot back until rank 1 has committed rank 0's newest step."""

import argparse
import os
import time

import torch

import ftrun

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=4)
parser.add_argument("--slow", type=float, default=3.0)
args = parser.parse_args()
rank = int(os.environ["RANK"])
state = {"weights": torch.zeros(1024)}
snap = ftrun.Snapshotter(state, every=1)
for step in range(snap.restore(), args.steps):
    state["weights"] += 1
    end = time.monotonic() + (args.slow if rank == 1 else 0.05)
    while time.monotonic() < end:
        ftrun.heartbeat(step)
        time.sleep(0.1)
    snap.save(step + 1)
snap.wait()
print(f"rank {rank} done at step {args.steps}", flush=True)
