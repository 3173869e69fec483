"""A deterministic FSDP2 training script (``fully_shard``, optionally with tensor parallelism on a 2-D mesh),
resumed bit-for-bit from ftrun RAM snapshots with the same three lines as any other script.

The model is a small MLP stack whose widths do not divide by the world size, so the shards are uneven; it has
dropout, AdamW and a cosine LR schedule. The Snapshotter holds each rank's local shards of the parameters and
of the optimizer state (DTensors) with their placements, and restores them in place into the live DTensors.
``--state`` picks what is given to it: the module and optimizer objects (default), or DCP's ``AppState`` recipe
(``dcp-app``: a ``Stateful`` whose state dict is ``get_state_dict``'s and that loads with ``set_state_dict``).
``--tp 2`` shards every block's two linears
column- then row-wise over a "tp" mesh dimension and the rest with FSDP over "dp" (world size 4: 2 x 2).
At the end rank 0 writes the SHA-256 of every rank's shards to ``--out``.

    ftrun --nnodes 2 --nproc-per-node 2 examples/train_fsdp.py --steps 40 --out /tmp/h
    ftrun --nnodes 2 --nproc-per-node 2 examples/train_fsdp.py --tp 2 --out /tmp/h
"""

from __future__ import annotations

import argparse
import hashlib
import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_state_dict)
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import ftrun

WIDTH, HIDDEN, BLOCKS = 33, 70, 3  # odd sizes: uneven shards


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(WIDTH, HIDDEN), nn.Linear(HIDDEN, WIDTH)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.down(torch.tanh(self.up(x))))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def shard(model: Net, tp: int) -> None:
    """FSDP2 over every block and the root; with ``tp`` > 1, tensor parallel inside each block first."""
    world = dist.get_world_size()
    if tp > 1:
        mesh = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp", "tp"))
        for block in model.blocks:
            parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        dp = mesh["dp"]
    else:
        dp = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    for block in model.blocks:
        fully_shard(block, mesh=dp)
    fully_shard(model, mesh=dp)


def build(steps: int, tp: int) -> tuple[Net, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """The sharded model (the same initial values on every rank), AdamW and a cosine LR schedule over ``steps``;
    then seeds dropout per data-parallel rank (the same within a tensor-parallel group)."""
    torch.manual_seed(0)
    model = Net()
    shard(model, tp)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5 * (1 + math.cos(math.pi * s / steps)))
    torch.manual_seed(100 + dist.get_rank() // tp)
    return model, optimizer, scheduler


def train_step(model: Net, optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler,
               step: int, data_rank: int) -> None:
    """One step on the batch of (``step``, ``data_rank``), drawn from a generator seeded by them."""
    x = torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(step * 1000 + data_rank))
    loss = nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True).sin())
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    scheduler.step()


class AppState(Stateful):
    """DCP's recipe for model and optimizer state: ``get_state_dict`` / ``set_state_dict`` (sharded DTensors)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict:
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        return {"model": model_state, "optim": optim_state}

    def load_state_dict(self, state: dict) -> None:
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def write_results(model: nn.Module, optimizer: torch.optim.Optimizer, out: str | None, full_out: str | None) -> None:
    """Rank 0 writes the hash of every rank's shards to ``out`` and the unsharded model to ``full_out`` (each
    when given); every rank takes part in gathering them."""
    rank = dist.get_rank()
    digest = shards_hash(model.state_dict(), optimizer.state_dict()["state"])
    if rank == 0 and out:
        with open(out, "w") as f:
            f.write(digest + "\n")
        print(f"final state hash {digest[:16]}", flush=True)
    if full_out:
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:
            torch.save(full, full_out)


def shards_hash(*states: dict) -> str:
    """SHA-256 over every rank's local shards of ``states`` (gathered to rank 0), in rank order."""
    digest = hashlib.sha256()

    def add(value: object) -> None:
        if isinstance(value, dict):
            for key in sorted(value, key=str):
                digest.update(str(key).encode())
                add(value[key])
        elif isinstance(value, (list, tuple)):
            for item in value:
                add(item)
        elif isinstance(value, DTensor):
            digest.update(value.to_local().detach().contiguous().numpy().tobytes())
        elif torch.is_tensor(value):
            digest.update(value.detach().contiguous().numpy().tobytes())
        else:
            digest.update(repr(value).encode())

    for state in states:
        add(state)
    hashes = [None] * dist.get_world_size()
    dist.all_gather_object(hashes, digest.hexdigest())
    return hashlib.sha256("".join(hashes).encode()).hexdigest()  # type: ignore[arg-type]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--snapshot-every", type=int, default=5)
    parser.add_argument("--state", choices=("objects", "dcp-app"), default="objects")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (divides the world size)")
    parser.add_argument("--out", help="file for the final state hash (rank 0)")
    parser.add_argument("--full-out", help="file for the final model state, unsharded (rank 0, torch.save)")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model, optimizer, scheduler = build(args.steps, args.tp)

    if args.state == "objects":
        state = {"model": model, "optim": optimizer, "sched": scheduler}
    else:
        state = {"app": AppState(model, optimizer), "sched": scheduler}
    snap = ftrun.Snapshotter(state, every=args.snapshot_every)
    start = snap.restore()
    if rank == 0:
        print(f"starting at step {start}", flush=True)
    for step in range(start, args.steps):
        train_step(model, optimizer, scheduler, step, rank // args.tp)
        snap.save(step + 1)
    snap.wait()
    write_results(model, optimizer, args.out, args.full_out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
