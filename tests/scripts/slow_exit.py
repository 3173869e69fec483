"""Trains a few steps with a Snapshotter, then rank 1 takes --seconds to finish as real scripts do after their
loop: in an atexit handler (a last upload, ``wandb.finish()``), in a non-daemon thread still running, or in the
script's own code (a final evaluation) after ``snap.wait()``."""

import argparse
import atexit
import os
import threading
import time

import torch

import ftrun

parser = argparse.ArgumentParser()
parser.add_argument("--how", choices=["atexit", "thread", "body"], required=True)
parser.add_argument("--seconds", type=float, default=4.0)
args = parser.parse_args()
weights = torch.zeros(8)
snap = ftrun.Snapshotter({"weights": weights}, every=5)
for step in range(snap.restore(), 40):
    weights += 1
    time.sleep(0.02)
    snap.save(step + 1)
snap.wait()
if os.environ["RANK"] == "1":
    if args.how == "atexit":
        atexit.register(time.sleep, args.seconds)
    elif args.how == "thread":
        threading.Thread(target=time.sleep, args=(args.seconds,)).start()
    else:
        time.sleep(args.seconds)
