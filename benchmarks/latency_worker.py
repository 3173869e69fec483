"""Worker of benchmarks/restart_latency.py: a plain gloo script that runs unchanged under torchrun and ftrun.

Every step is a small all_reduce, a guarded ``ftrun.heartbeat`` and a short sleep. Right after its first
all_reduce each process appends ``"<TORCHELASTIC_RESTART_COUNT> <RANK> <time.time()> <pid>"`` to the file
named by ``LATENCY_MARK_FILE`` (one O_APPEND write, so lines of concurrent writers never mix). The step counter
starts again at 0 after a restart; the script exits 0 after ``--steps`` steps.

With ``--state-mib N`` (ftrun only) each process also holds N MiB of parameters (64 MiB tensors) that an optimizer
changes every step, and a ``ftrun.Snapshotter`` of them: it restores them before its first all_reduce and saves
after every step (the step counter then resumes at the restored step).
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch import nn

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


CHUNK_MIB = 64  # the state's parameters are tensors of this size


class AddOne(torch.optim.Optimizer):
    """Adds 1 to every parameter: an optimizer step that changes the whole state and needs no gradients."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        super().__init__(params, {})

    @torch.no_grad()
    def step(self, closure: None = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for param in group["params"]:
                param.add_(1.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--step-time", type=float, default=0.05, help="seconds of sleep per step")
    parser.add_argument("--state-mib", type=int, default=0, help="MiB of state snapshotted every step (ftrun only)")
    args = parser.parse_args()

    optimizer, snap, start = None, None, 0
    if args.state_mib:
        import ftrun  # only under ftrun
        params = [nn.Parameter(torch.full(((CHUNK_MIB << 20) // 4,), float(i)))
                  for i in range(max(1, args.state_mib // CHUNK_MIB))]
        optimizer = AddOne(params)
        snap = ftrun.Snapshotter({"params": params, "optim": optimizer})
        start = snap.restore()
    dist.init_process_group("gloo")
    for step in range(start, args.steps):
        if optimizer is not None:
            optimizer.step()
        dist.all_reduce(torch.ones(16))
        if step == start:
            mark_first_all_reduce(os.environ["LATENCY_MARK_FILE"])
        if snap is not None:
            snap.save(step + 1)
        else:
            heartbeat(step + 1)
        time.sleep(args.step_time)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
