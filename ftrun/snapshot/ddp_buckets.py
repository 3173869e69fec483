"""Exact DDP resumption: a resumed generation's first step sums gradients in the failure-free run's order.

Why. ``DistributedDataParallel`` all-reduces gradients in flat buckets and lays them out twice. Its first
iteration uses an initial layout (with the default ``find_unused_parameters=False``: every parameter in one
bucket, in reverse registration order). That iteration's backward records the order in which gradients became
ready, and the next forward re-buckets them in that order (a 1 MiB first bucket, then ``bucket_cap_mb``). Where
a value sits in a bucket decides where each rank's share enters its sum in a ring all-reduce (gloo, NCCL), and
a floating-point sum of three or more terms depends on its order. So the first step of a DDP module sums in
another order than every later one. A failure-free run takes step ``s > 0`` with the rebuilt layout; a resumed
generation builds a new DDP whose first step, step ``s``, would use the initial layout, and from there the runs
differ in the last bits.

How. :class:`BucketWarmup`, armed by ``Snapshotter.restore()`` when it loaded a step > 0, makes the resumed
first step use the rebuilt layout, with public torch API only (no DDP internals, no patching):

* it finds the DDP modules through a global module registration hook, which sees DDP's ``self.module =
  module``: those built before the restore were recorded since the trainer started (:func:`track_ddp_modules`;
  a trainer started without it scans the heap instead), those built after it are hooked as they are built;
* on each one's first forward with gradients enabled (a forward pre-hook with kwargs) it first runs a warm-up:
  the same forward on copies of the same inputs, cut from the graph they carry (:func:`_copied`), then a
  backward of zero gradients. That is the iteration DDP re-buckets after, so the real forward re-buckets
  exactly as the failure-free run did after its step 0: the ready order depends on the graph, not on the values;
* the warm-up leaves no trace: RNG states (``torch.random.fork_rng``, Python's, numpy's), the module's buffers
  (BatchNorm statistics), every parameter's ``.grad``, the tensor of a parameter that the forward replaced
  (MoCo's and BYOL's momentum encoders: ``param_k.data = param_k.data * m + ...``) and the wrapped module's own
  ``forward`` attribute are put back; no optimizer steps. (Lightning's DDP strategy runs ``training_step``
  through DDP by setting the LightningModule's ``forward`` to a function that puts the class's back and calls
  ``training_step``: used up by the warm-up, the real forward reached the class's, which raises.)

Invariants: every rank of a DDP group warms up at the same forward, since all of them restored (restarts are
global) and run the same script. A module is left alone where the layout cannot matter: a group of two ranks
(a sum of two terms is the same in either order) and ``find_unused_parameters=True`` without a static graph
(DDP never re-buckets then). The hooks are gone after the warm-up, or at the end of the first optimizer step.

Cost: one forward and backward per DDP module per restore; without a restore, one Python call per submodule
assignment while models are built (the registration hook).
Limit: a forward whose outputs hold no tensor that requires grad cannot be warmed up; ftrun warns once then
(the fix: return the tensors the loss is computed from). A parameter that the forward changes in place
(``param_k.mul_(m)``) is not put back (that would take a copy of every parameter).
"""

from __future__ import annotations

import contextlib
import gc
import random
import sys
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.nn.modules.module import register_module_module_registration_hook
from torch.utils.hooks import RemovableHandle

if TYPE_CHECKING:
    from torch.nn.parallel import DistributedDataParallel

_built: weakref.WeakSet | None = None  # the DDP modules built in this process since track_ddp_modules()


def track_ddp_modules() -> None:
    """Record every DDP module built in this process from now on, so that a restore finds them without scanning
    the heap (``gc``: about 0.1 s with torch loaded). The trainer's bootstrap calls it before the user's code."""
    global _built
    if _built is None:
        _built = weakref.WeakSet()
        register_module_module_registration_hook(_record)


def _record(owner: torch.nn.Module, name: str, child: torch.nn.Module | None) -> None:
    if name == "module" and _is_ddp(owner):
        _built.add(owner)  # type: ignore[union-attr]


def _is_ddp(obj: object) -> bool:
    """Whether ``obj`` is a DDP module (none exists while its module is not imported). Not isinstance: that
    reads ``obj.__class__``, which warns on torch's deprecated ``reduce_op``."""
    module = sys.modules.get("torch.nn.parallel.distributed")
    kind = getattr(module, "DistributedDataParallel", None)
    return kind is not None and issubclass(type(obj), kind)


class BucketWarmup:
    """Warm-up of every DDP module's first forward after a restore; see the module docstring."""

    def __init__(self) -> None:
        self._registration: RemovableHandle | None = None
        self._pending: dict[int, RemovableHandle] = {}  # id(module) -> its forward pre-hook
        self._warned = False

    def arm(self) -> None:
        """Hook the DDP modules alive now and any built from now on."""
        alive = list(_built) if _built is not None else [obj for obj in gc.get_objects() if _is_ddp(obj)]
        for module in alive:
            self._hook(module)
        self._registration = register_module_module_registration_hook(self._registered)

    def disarm(self) -> None:
        """Remove every hook; modules not warmed up by now stay as they are."""
        if self._registration is not None:
            self._registration.remove()
            self._registration = None
        for handle in self._pending.values():
            handle.remove()
        self._pending.clear()

    def _registered(self, owner: torch.nn.Module, name: str, child: torch.nn.Module | None) -> None:
        if name == "module" and _is_ddp(owner):
            self._hook(owner)  # type: ignore[arg-type]

    def _hook(self, module: DistributedDataParallel) -> None:
        if id(module) not in self._pending:
            self._pending[id(module)] = module.register_forward_pre_hook(self._first_forward, with_kwargs=True,
                                                                         prepend=True)

    def _first_forward(self, module: DistributedDataParallel, args: tuple, kwargs: dict) -> None:
        if not torch.is_grad_enabled():
            return  # an evaluation pass: DDP does not re-bucket in it; wait for a training forward
        self._pending.pop(id(module)).remove()
        if not _rebuckets(module):
            return
        with _left_as_found(module):
            outputs = [t for t in _tensors(module(*_copied(args), **_copied(kwargs))) if t.requires_grad]
            if not outputs:
                self._warn("its forward returned no tensor that requires grad; return the tensors the loss is "
                           "computed from")
                return
            torch.autograd.backward(outputs, [torch.zeros_like(t) for t in outputs])

    def _warn(self, why: str) -> None:
        if not self._warned:
            self._warned = True
            print(f"ftrun: the first step after this restore may differ in the last bits from a run without "
                  f"failure: DDP's first step sums gradients in another order, and ftrun could not warm it up: "
                  f"{why}", file=sys.stderr, flush=True)


def _copied(value: Any) -> Any:
    """``value`` with a copy of each tensor in it (in tuples, lists and dicts), cut from the graph it carries: the
    warm-up's forward may change its inputs in place (``x /= 255``, ``ReLU(inplace=True)``), and its backward
    must stop there (a DDP head's input is a DDP backbone's output, whose graph the real backward needs). A copy
    of a tensor that requires grad does too, and is no leaf, as the real input (reentrant checkpointing needs
    one that requires grad; an in-place change refuses a leaf)."""
    if isinstance(value, torch.Tensor):
        return value.detach().requires_grad_().clone() if value.requires_grad else value.clone()
    if isinstance(value, (list, tuple)):
        return type(value)(_copied(item) for item in value) if type(value) in (list, tuple) else value
    if isinstance(value, dict):
        return {key: _copied(item) for key, item in value.items()} if type(value) is dict else value
    return value


def _rebuckets(module: DistributedDataParallel) -> bool:
    """Whether DDP re-buckets after its first backward and the layout changes any sum (3+ ranks)."""
    if module.find_unused_parameters and not module.static_graph:
        return False
    group = getattr(module, "process_group", None)
    return torch.distributed.get_world_size(group) > 2


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    """The tensors in a forward's output: tensors, sequences, mappings (HF ``ModelOutput`` is one)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


@contextlib.contextmanager
def _left_as_found(module: DistributedDataParallel) -> Iterator[None]:
    """Run the body with gradient sync on, then put back RNG states, buffers, ``.grad``, the sync flag, the tensor
    of every parameter that the forward replaced (``p.data = ...``: a momentum encoder's update) and the wrapped
    module's instance attribute ``forward`` (or its absence): a patch made for one call, which the call undoes."""
    inner = vars(module.module)
    forward = inner.get("forward")
    params = list(module.parameters())
    tensors = [p.data for p in params]  # held, so a replaced one's memory is not reused: never is_set_to again
    grads = [p.grad for p in params]
    for p in params:
        p.grad = None
    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    python_rng, numpy_rng = random.getstate(), np.random.get_state()
    sync, module.require_backward_grad_sync = module.require_backward_grad_sync, True
    devices = sorted({p.device.index or 0 for p in params if p.is_cuda})
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        module.require_backward_grad_sync = sync
        if forward is None:
            inner.pop("forward", None)
        else:
            inner["forward"] = forward
        random.setstate(python_rng)
        np.random.set_state(numpy_rng)
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)
        for p, tensor, grad in zip(params, tensors, grads):
            if not p.data.is_set_to(tensor):
                p.data = tensor
            p.grad = grad
