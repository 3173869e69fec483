"""One rank of the DDP re-bucketing check, without ftrun's launcher: ``rebucket.py RANK WORLD INIT_FILE OUT
[chained|redirected]``.

Three runs of the same 6 steps, each from the same initial state, written to OUT as JSON hashes:

* ``straight``: one DDP module for all 6 steps (a run without failure);
* ``resumed``: a new DDP module (and RNG states put back as a snapshot would) after step 3, nothing else;
* ``warmed``: the same, with :class:`ftrun.snapshot.ddp_buckets.BucketWarmup` armed before the new module is
  built, as ``Snapshotter.restore()`` arms it.

The model has dropout (RNG), BatchNorm (buffers) and a keyword argument in its forward. ``chained``: its first
layers (a backbone) and the rest (a head: :class:`Head`) are two DDP modules, the head's input the backbone's
output. ``redirected``: the model's training code is not the DDP module's forward; each step calls it through DDP
by a one-shot patch of the wrapped module's ``forward``, as Lightning's DDP strategy calls ``training_step``
(:class:`Stepper`).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint

from ftrun.snapshot.ddp_buckets import BucketWarmup


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.norm = torch.nn.Linear(16, 300), torch.nn.BatchNorm1d(300)
        self.hidden = torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(300, 300),
                                          torch.nn.Tanh(), torch.nn.Linear(300, 4))

    def forward(self, x: torch.Tensor, *, scale: float = 1.0) -> dict[str, torch.Tensor]:
        return {"out": self.hidden(self.norm(self.inp(x))) * scale}


def digest(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> str:
    h = hashlib.sha256()
    for tensor in [*model.state_dict().values(), torch.get_rng_state()]:
        h.update(tensor.detach().contiguous().numpy().tobytes())
    for state in optimizer.state_dict()["state"].values():
        h.update(state["exp_avg"].numpy().tobytes())
    return h.hexdigest()


def wrap(model: Net, shape: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The model's forward through DDP: one module, a backbone and a head chained, or redirected (:class:`Stepper`)."""
    if shape == "redirected":
        return Stepper(model).redirected()
    if shape != "chained":
        ddp = DistributedDataParallel(model)
        return lambda x: ddp(x, scale=0.5)["out"]
    backbone = DistributedDataParallel(torch.nn.Sequential(model.inp, model.norm))
    head = DistributedDataParallel(Head(model.hidden))
    return lambda x: head(backbone(x)) * 0.5


class Stepper(torch.nn.Module):
    """A module whose training code is ``training_step``, not its forward (a LightningModule), run through DDP as
    Lightning's forward redirection runs it: the module's ``forward`` is set, for one call, to a function that puts
    the class's back and calls ``training_step``."""

    def __init__(self, net: Net) -> None:
        super().__init__()
        self.net = net

    def forward(self, *args: object, **kwargs: object) -> dict[str, torch.Tensor]:
        raise NotImplementedError("called through the redirection only")

    def training_step(self, x: torch.Tensor, *, scale: float) -> dict[str, torch.Tensor]:
        return self.net(x, scale=scale)

    def redirected(self) -> Callable[[torch.Tensor], torch.Tensor]:
        ddp = DistributedDataParallel(self)

        def step(x: torch.Tensor) -> torch.Tensor:
            original = self.forward

            def once(*args: object, **kwargs: object) -> dict[str, torch.Tensor]:
                self.forward = original  # type: ignore[method-assign]
                return self.training_step(*args, **kwargs)  # type: ignore[arg-type]

            self.forward = once  # type: ignore[method-assign]
            return ddp(x, scale=0.5)["out"]

        return step


class Head(torch.nn.Module):
    """Changes its input in place (as ``ReLU(inplace=True)``), then runs ``layers`` under reentrant activation
    checkpointing."""

    def __init__(self, layers: torch.nn.Module) -> None:
        super().__init__()
        self.layers = layers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.layers, x.mul_(2.0), use_reentrant=True)


def train(rank: int, mode: str, shape: str) -> str:
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(10 + rank)
    forward = wrap(model, shape)
    for step in range(6):
        if step == 3 and mode != "straight":
            rng = torch.get_rng_state()
            del forward
            warmup = BucketWarmup()
            if mode == "warmed":
                warmup.arm()
            torch.set_rng_state(rng)
            forward = wrap(model, shape)
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step * 100 + rank))
        loss = forward(x).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step == 3 and mode == "warmed":
            warmup.disarm()
    return digest(model, optimizer)


def main() -> None:
    rank, world, init_file, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    torch.set_num_threads(1)  # CPU kernels then reduce in one order, whatever the load: only DDP's may change it
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    shape = sys.argv[5] if len(sys.argv) > 5 else "one"
    hashes = {mode: train(rank, mode, shape) for mode in ("straight", "resumed", "warmed")}
    dist.barrier()  # every rank is past its last collective
    with open(out, "w") as f:
        json.dump(hashes, f)
    # Out without gloo's teardown: with the results written, it sometimes aborted the process on this host
    # ("terminate called without an active exception", a C++ thread destroyed while joinable), which is torch's
    # exit path, not what this check is about.
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
