"""Worker of benchmarks/snapshot.py's persistence runs (method there): the only trainer of a 1-node ftrun job,
started alternately with and without ``--ckpt-dir``.

It builds the state of :mod:`snapshot_worker` and trains on a fixed ``--batch`` with ``--threads`` torch
threads and ``save(step)`` after every step. A warm-up allocates the two slots and, when the keeper persists,
the spare one (allocated the first time a slot being persisted is in the way); then ``--blocks`` blocks of
``--steps`` steps are timed, each ending when its last snapshot is committed and sealed. With
``--ckpt-dir`` (the job's, which persists every committed step) it then takes ``--persists`` + 1 snapshots with
the trainer idle, waiting after each until its step is complete on disk; the first one's persist also cleans up
after the training's (it is reported apart). Steps/s and the steps of those snapshots go to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import torch

from ftrun.snapshot.client import Snapshotter
from ftrun.snapshot.keeper import find_segments
from ftrun.snapshot.persist import job_dir, step_name
from snapshot_worker import build, sealed, train_step  # ftrun puts the script's directory on sys.path

WARM_UP_MAX = 8  # training steps at most to wait for the spare slot


def slots() -> int:
    """The slot files this job's keeper has allocated."""
    return len(find_segments(os.environ["TORCHELASTIC_RUN_ID"], 0))


def on_disk(root: str, step: int, timeout: float = 120.0) -> None:
    """Wait until ``step`` is complete in ``root``."""
    deadline = time.monotonic() + timeout
    while not os.path.isdir(os.path.join(root, step_name(step))):
        if time.monotonic() > deadline:
            raise TimeoutError(f"step {step} was not persisted to {root} within {timeout:.0f} s")
        time.sleep(0.01)


class Trainer:
    """The state of :mod:`snapshot_worker` about ``size`` bytes, snapshotted after every step on a fixed batch."""

    def __init__(self, size: int, batch: int) -> None:
        self.model, self.optimizer = build(size)
        self.snap = Snapshotter({"model": self.model, "optim": self.optimizer}, every=1, rng=False, skip=False)
        self.step = self.snap.restore()
        self.batch = torch.randn(batch, self.model[0].in_features)

    def train(self, steps: int) -> None:
        for _ in range(steps):
            train_step(self.model, self.optimizer, self.batch)
            self.step += 1
            self.snap.save(self.step)

    def warm_up(self, persisting: bool) -> None:
        """Train until the keeper has allocated the slots of a timed block (the spare one too if it persists)."""
        self.train(2)
        self.snap.wait()
        while persisting and slots() < 3 and self.step < WARM_UP_MAX:
            self.train(1)
            self.snap.wait()

    def blocks(self, blocks: int, steps: int) -> list[float]:
        """Steps/s of each block; a block ends when its last snapshot is committed and sealed."""
        rates = []
        for _ in range(blocks):
            t0 = time.perf_counter()
            self.train(steps)
            self.snap.wait()
            sealed(self.step)
            rates.append(steps / (time.perf_counter() - t0))
        return rates

    def persist_idle(self, root: str, count: int) -> list[int]:
        """Take ``count`` snapshots without training, each waited for until complete in ``root``; their steps."""
        steps = []
        for _ in range(count):
            self.step += 1
            self.snap.save(self.step)
            self.snap.wait()
            on_disk(root, self.step)
            steps.append(self.step)
        return steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag in ("--size-mib", "--batch", "--threads", "--blocks", "--steps", "--persists"):
        parser.add_argument(flag, type=int, required=True)
    parser.add_argument("--ckpt-dir", help="the job's --ckpt-dir; none: the job does not persist")
    parser.add_argument("--out", required=True, help="JSON results file")
    args = parser.parse_args()
    torch.set_flush_denormal(True)
    torch.set_num_threads(args.threads)
    trainer = Trainer(args.size_mib << 20, args.batch)
    trainer.warm_up(args.ckpt_dir is not None)
    results: dict[str, Any] = {"warm_up": trainer.step, "slots": slots()}
    results.update(rate=trainer.blocks(args.blocks, args.steps), trained=trainer.step)
    idle = (trainer.persist_idle(job_dir(args.ckpt_dir, os.environ["TORCHELASTIC_RUN_ID"]), args.persists + 1)
            if args.ckpt_dir else [])
    results.update(first_idle=idle[:1], idle=idle[1:])
    Path(args.out).write_text(json.dumps(results))


if __name__ == "__main__":
    main()
