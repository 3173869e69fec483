"""Worker of benchmarks/restart_latency.py: a plain gloo script that runs unchanged under torchrun and ftrun.

Every step is a small all_reduce, a guarded ``ftrun.heartbeat`` and a short sleep. Right after its first
all_reduce each process appends ``"<TORCHELASTIC_RESTART_COUNT> <RANK> <time.time()> <pid>"`` to the file
named by ``LATENCY_MARK_FILE`` (one O_APPEND write, so lines of concurrent writers never mix). The step counter
starts again at 0 after a restart; the script exits 0 after ``--steps`` steps.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

try:
    from ftrun import heartbeat
except ImportError:  # ftrun not installed
    def heartbeat(step: int | None = None) -> None:
        pass


def mark_first_all_reduce(path: str) -> None:
    line = f"{os.environ['TORCHELASTIC_RESTART_COUNT']} {os.environ['RANK']} {time.time():.6f} {os.getpid()}\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--step-time", type=float, default=0.05, help="seconds of sleep per step")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    for step in range(args.steps):
        dist.all_reduce(torch.ones(16))
        if step == 0:
            mark_first_all_reduce(os.environ["LATENCY_MARK_FILE"])
        heartbeat(step + 1)
        time.sleep(args.step_time)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
