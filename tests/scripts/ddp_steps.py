"""A deterministic DDP script with only the README's three ftrun lines: the hash-matrix tests' trainer.

A small MLP with dropout, AdamW (``--optim lbfgs``: LBFGS, whose ``step(closure)`` runs the forward and backward)
and a step LR schedule, wrapped in a default DistributedDataParallel (no warm-up, nothing else for ftrun).
Batches come from one of three sources (``--data``):

* ``loop``: drawn from a generator seeded by (step, rank), no loader;
* ``stateful``: torchdata's StatefulDataLoader over a shuffling DistributedSampler, epoch by epoch, in the
  snapshot as ``"data"`` (``--workers`` loader processes);
* ``plain``: a plain torch DataLoader in the snapshot (its position is not captured: ftrun warns).

``--dcp`` (with ``--data loop``) checkpoints through :mod:`ftrun.dcp` instead of a Snapshotter, the state as DCP's
``AppState`` recipe (:class:`AppState`: ``get_state_dict`` / ``set_state_dict``), this rank's RNG state included.

Every rank appends ``step id id ...`` per step to ``--ids``/rank<R>.txt; rank 0 writes the SHA-256 of the final
model, optimizer and scheduler state to ``--out``.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import ftrun
import ftrun.dcp


class Numbered(Dataset):
    """Sample ``i`` is (i, x_i, y_i), x_i drawn from a generator seeded by i."""

    def __len__(self) -> int:
        return 96

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        x = torch.randn(24, generator=torch.Generator().manual_seed(i))
        return i, x, x.sum(dim=0, keepdim=True).sin()


class AppState(Stateful):
    """Model and optimizer through ``get_state_dict`` / ``set_state_dict`` (a fresh optimizer's state is made there by
    a step with a zero learning rate), the scheduler, the progress and this rank's torch RNG state (dropout)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 scheduler: torch.optim.lr_scheduler.LRScheduler, progress: dict) -> None:
        self.model, self.optimizer, self.scheduler, self.progress = model, optimizer, scheduler, progress

    def state_dict(self) -> dict:
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        return {"model": model_state, "optim": optim_state, "sched": self.scheduler.state_dict(),
                "progress": dict(self.progress), "rng": torch.get_rng_state()}

    def load_state_dict(self, state: dict) -> None:
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        self.scheduler.load_state_dict(state["sched"])
        self.progress.update(state["progress"])
        torch.set_rng_state(state["rng"])


def state_hash(*objects: object) -> str:
    digest = hashlib.sha256()

    def add(value: object) -> None:
        if isinstance(value, dict):
            for key in sorted(value, key=repr):
                digest.update(repr(key).encode())
                add(value[key])
        elif isinstance(value, (list, tuple)):
            for item in value:
                add(item)
        elif torch.is_tensor(value):
            digest.update(value.detach().cpu().contiguous().numpy().tobytes())
        else:
            digest.update(repr(value).encode())

    for obj in objects:
        add(obj.state_dict())  # type: ignore[attr-defined]
    return digest.hexdigest()


def batches(loader: DataLoader | None, sampler: DistributedSampler | None, progress: dict, rank: int, step: int):
    """(ids, x, y) per step from ``step`` on, forever; with a loader, epoch by epoch from ``progress["epoch"]``
    (in the snapshot: a snapshot at the end of an epoch holds that epoch and its loader at its end)."""
    if loader is None:
        while True:
            generator = torch.Generator().manual_seed(step * 1000 + rank)
            x = torch.randn(8, 24, generator=generator)
            yield torch.arange(step * 8, step * 8 + 8), x, x.sum(dim=1, keepdim=True).sin()
            step += 1
    while True:
        sampler.set_epoch(progress["epoch"])  # type: ignore[union-attr]
        yield from loader
        progress["epoch"] += 1


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--data", choices=("loop", "stateful", "plain"), default="loop")
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--optim", choices=("adamw", "lbfgs"), default="adamw")
    parser.add_argument("--dcp", action="store_true", help="checkpoint through ftrun.dcp (--data loop)")
    parser.add_argument("--compile-step", action="store_true", help="torch.compile the optimizer step (eager backend)")
    parser.add_argument("--ids", help="directory for the sample ids of every step, one file per rank")
    parser.add_argument("--out", help="file for the final state hash (rank 0)")
    parser.add_argument("--step-time", type=float, default=0.0)
    parser.add_argument("--resume-pause", type=float, default=0.0,
                        help="seconds the first step after a restore takes more (a torch.compile in the new process)")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(24, 48), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                torch.nn.Linear(48, 48), torch.nn.Tanh(), torch.nn.Linear(48, 1))
    if args.optim == "lbfgs":
        optimizer: torch.optim.Optimizer = torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=3)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=7, gamma=0.7)
    torch.manual_seed(100 + rank)  # per-rank dropout

    loader = sampler = None
    if args.data != "loop":
        sampler = DistributedSampler(Numbered(), shuffle=True, seed=3)
        if args.data == "stateful":
            from torchdata.stateful_dataloader import StatefulDataLoader
            loader = StatefulDataLoader(Numbered(), batch_size=4, sampler=sampler, num_workers=args.workers)
        else:
            loader = DataLoader(Numbered(), batch_size=4, sampler=sampler, num_workers=args.workers)
    state = {"model": model, "optim": optimizer, "sched": scheduler, "progress": {"epoch": 0}}
    if loader is not None:
        state["data"] = loader

    optimizer_step = torch.compile(optimizer.step, backend="eager") if args.compile_step else optimizer.step
    if args.dcp:
        app = {"app": AppState(model, optimizer, scheduler, state["progress"])}
        try:
            dcp.load(app, storage_reader=ftrun.dcp.MemoryReader())
        except ftrun.dcp.NoSnapshot:
            pass
        step, finish = ftrun.dcp.restored_step(), ftrun.dcp.wait

        def save(step: int) -> None:
            ftrun.heartbeat(step)
            if step % args.every == 0:
                dcp.save(app, storage_writer=ftrun.dcp.MemoryWriter(step))
    else:
        snap = ftrun.Snapshotter(state, every=args.every)
        step, save, finish = snap.restore(), snap.save, snap.wait
    if step:
        time.sleep(args.resume_pause)
    ddp = DistributedDataParallel(model)
    ids_file = open(os.path.join(args.ids, f"rank{rank}.txt"), "a") if args.ids else None
    source = batches(loader, sampler, state["progress"], rank, step)
    while step < args.steps:
        ids, x, y = next(source)

        def closure() -> torch.Tensor:
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(ddp(x), y)  # noqa: F821 (called in the loop; ddp is deleted after it)
            loss.backward()
            return loss

        if args.optim == "lbfgs":
            optimizer.step(closure)
        else:
            closure()
            optimizer_step()
        scheduler.step()
        step += 1
        if ids_file:
            ids_file.write(f"{step} {' '.join(map(str, ids.tolist()))}\n")
            ids_file.flush()
        if args.step_time:
            time.sleep(args.step_time)
        save(step)
    finish()
    if rank == 0 and args.out:
        with open(args.out, "w") as f:
            f.write(state_hash(model, optimizer, scheduler) + "\n")
    del ddp
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
