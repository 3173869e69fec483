"""Worker of benchmarks/overhead.py: one script that runs unchanged under torchrun and ftrun.

- ``trivial``: init_process_group (gloo), one all_reduce, destroy.
- ``train``: a small DDP MLP trained with AdamW for ``--steps`` steps; with ``--snapshot-every K`` (ftrun only) a
  :class:`ftrun.Snapshotter` of model and optimizer saves every K steps.

Each process writes one JSON line to ``<--out>/rank<R>.json``: ``first_step`` (time.time() at the end of its
first step, after the collective), ``steady`` (steps per second from ``--warmup`` to the end), ``end`` (right
before the interpreter exits, after destroy_process_group). It writes its pid to ``<--out>/pid<R>`` as it starts,
and rank 0 creates ``<--out>/steady`` at step ``--warmup``: the benchmark then measures the launcher's own CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("trivial", "train"))
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--snapshot-every", type=int, default=0)
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    with open(os.path.join(args.out, f"pid{rank}"), "w") as f:
        f.write(str(os.getpid()))
    dist.init_process_group("gloo")
    result: dict[str, float] = {}
    if args.mode == "trivial":
        tensor = torch.ones(1)
        dist.all_reduce(tensor)
        result["first_step"] = time.time()
    else:
        train(args, result)
    dist.destroy_process_group()
    result["end"] = time.time()
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


def train(args: argparse.Namespace, result: dict[str, float]) -> None:
    torch.manual_seed(0)
    width = args.width
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(
        torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, width), torch.nn.ReLU(),
        torch.nn.Linear(width, 1)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    snapshotter = None
    if args.snapshot_every:
        from ftrun import Snapshotter

        snapshotter = Snapshotter({"model": model, "optim": optimizer})
    generator = torch.Generator().manual_seed(int(os.environ["RANK"]))
    t_warm = 0.0
    for step in range(args.steps):
        batch = torch.randn(64, width, generator=generator)
        loss = model(batch).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step == 0:
            result["first_step"] = time.time()
        if step == args.warmup:
            t_warm = time.perf_counter()
            if os.environ["RANK"] == "0":
                open(os.path.join(args.out, "steady"), "w").close()
        if snapshotter is not None and (step + 1) % args.snapshot_every == 0:
            snapshotter.save(step + 1)
    result["steady"] = (args.steps - 1 - args.warmup) / (time.perf_counter() - t_warm)
    if snapshotter is not None:
        snapshotter.wait()


if __name__ == "__main__":
    main()
