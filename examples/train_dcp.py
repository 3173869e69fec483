"""A deterministic FSDP2 training script checkpointed with plain ``torch.distributed.checkpoint`` calls into ftrun's
RAM tier (:mod:`ftrun.dcp`), resumed bit-for-bit after a failure.

The model, sharding and data are train_fsdp.py's (uneven shards, dropout, AdamW, a cosine LR schedule). At start
it loads the step every rank holds in RAM (none: it starts at step 0); every ``--every`` steps it saves the
model and optimizer (DCP's ``AppState`` recipe), the LR scheduler, this rank's RNG state and the step.
``--async-save`` uses ``dcp.async_save`` (thread mode, on a gloo group of its own) instead of ``dcp.save``.
At the end rank 0 writes the SHA-256 of every rank's shards to ``--out`` (and the unsharded model to ``--full-out``).
Started at another world size than the one that saved, it loads the newest durable copy in DCP's format
(``--ckpt-dir DIR --ckpt-format dcp``), resharded.

    ftrun --nnodes 2 --nproc-per-node 2 examples/train_dcp.py --steps 25 --out /tmp/h
"""

from __future__ import annotations

import argparse
import os
import sys
from concurrent.futures import Future

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.stateful import Stateful

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_fsdp import AppState, build, train_step, write_results  # noqa: E402

import ftrun  # noqa: E402
import ftrun.dcp  # noqa: E402


class RngState(Stateful):
    """This rank's torch RNG (dropout). Every rank's differs: ``MemoryWriter`` keeps each rank's own."""

    def state_dict(self) -> dict:
        return {"torch": torch.get_rng_state()}

    def load_state_dict(self, state: dict) -> None:
        torch.set_rng_state(state["torch"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--every", type=int, default=5, help="save every this many steps")
    parser.add_argument("--async-save", action="store_true", help="dcp.async_save instead of dcp.save")
    parser.add_argument("--out", help="file for the final state hash (rank 0)")
    parser.add_argument("--full-out", help="file for the final model state, unsharded (rank 0, torch.save)")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model, optimizer, scheduler = build(args.steps, 1)

    def state(step: int) -> dict:
        return {"app": AppState(model, optimizer), "sched": scheduler, "rng": RngState(), "step": step}

    loaded = state(0)
    try:
        dcp.load(loaded, storage_reader=ftrun.dcp.MemoryReader())
        start = loaded["step"]
        assert start == ftrun.dcp.restored_step(), (start, ftrun.dcp.restored_step())
    except ftrun.dcp.NoSnapshot:
        start = 0
    if rank == 0:
        print(f"starting at step {start}", flush=True)

    group = dist.new_group(backend="gloo") if args.async_save else None  # async saves talk on their own group
    pending: Future | None = None
    for step in range(start, args.steps):
        train_step(model, optimizer, scheduler, step, rank)
        ftrun.heartbeat(step + 1)
        if (step + 1) % args.every == 0:
            writer = ftrun.dcp.MemoryWriter(step + 1)
            if args.async_save:
                if pending is not None:
                    pending.result()
                pending = dcp.async_save(state(step + 1), storage_writer=writer,  # type: ignore[assignment]
                                         process_group=group)
            else:
                dcp.save(state(step + 1), storage_writer=writer)
    if pending is not None:
        pending.result()
    write_results(model, optimizer, args.out, args.full_out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
