"""Worker of benchmarks/node_loss.py: deterministic training of ``--size-mib`` MiB of float32 state per rank.

A step rewrites a chunk of the state from the step, the rank and a gloo all_reduce of the chunk's sum, and sleeps.
After its first step following ``restore()`` a process appends ``"<generation> <rank> <time> <step>"`` to
``--marks``; at the end each rank writes the SHA-256 of its state to ``<--out>.<rank>``.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import time

import torch
import torch.distributed as dist

import ftrun

CHUNKS = 16  # a step rewrites one of this many chunks of the state


def train_step(weights: torch.Tensor, step: int, rank: int) -> None:
    chunk = weights.view(CHUNKS, -1)[step % CHUNKS]
    total = chunk.sum(dtype=torch.float64).reshape(1)
    dist.all_reduce(total)
    chunk.mul_(0.5).add_(float(step + rank) + float(total) * 1e-9)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag, kind in (("--steps", int), ("--every", int), ("--step-time", float), ("--size-mib", int),
                       ("--marks", str), ("--out", str)):
        parser.add_argument(flag, type=kind, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)  # deterministic sums, and the host has few cores
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    weights = torch.full(((args.size_mib << 20) // 4,), float(rank), dtype=torch.float32)
    snap = ftrun.Snapshotter({"weights": weights}, every=args.every, rng=False, skip=False)  # each one measured
    start = snap.restore()
    for step in range(start, args.steps):
        train_step(weights, step, rank)
        if step == start:
            with open(args.marks, "a") as f:  # O_APPEND, one write: lines of concurrent writers never mix
                f.write(f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')} {rank} {time.time():.6f} {step + 1}\n")
        time.sleep(args.step_time)
        snap.save(step + 1)
    snap.wait()
    with open(f"{args.out}.{rank}", "w") as f:
        f.write(hashlib.sha256(weights.numpy().tobytes()).hexdigest() + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
