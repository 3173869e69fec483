"""``torch.distributed.checkpoint`` (DCP) on ftrun's RAM tier: :class:`MemoryWriter` and :class:`MemoryReader`.

    dcp.save(state, storage_writer=ftrun.dcp.MemoryWriter(step))      # or dcp.async_save(...), thread mode
    try:
        dcp.load(state, storage_reader=ftrun.dcp.MemoryReader())     # at start: the step every rank holds
        start = ftrun.dcp.restored_step()
    except ftrun.dcp.NoSnapshot:                                     # a FileNotFoundError: nothing in RAM yet
        start = 0

Protocol. Both delegate to one :class:`~ftrun.snapshot.client.Snapshotter` per process (``every=1``,
``rng=False``), made on first use, whose state holds the rank's items of the save
(:mod:`ftrun.snapshot.dcp_items`): each tensor chunk with where it sits in its global tensor, and every other
item's value itself (``planner.lookup_object``), kept in the snapshot's JSON skeleton
(:mod:`ftrun.snapshot.layout`): nothing is pickled, and a value JSON cannot hold (an
instance of a custom class) is refused in one line. ``MemoryWriter.write_data`` on the main thread (``dcp.save``)
takes a parameter or the state of an optimizer that has stepped by reference and clones every other tensor, then
returns while the keeper's copy runs in the background: the Snapshotter's step pre-hook on every optimizer
(``register_optimizer_step_pre_hook``) waits for the copy, so a snapshot is exactly the state at ``step``.
Elsewhere (``dcp.async_save``'s thread, over tensors DCP staged) it returns once the copy is committed.
``MemoryReader()`` asks the keeper for the step every rank holds (``Snapshotter.restore``; it raises
:class:`NoSnapshot` itself, before DCP runs, since DCP would wrap an error of ``read_metadata`` in a
``CheckpointException``) and DCP copies from it into the live state in place (``planner.resolve_tensor`` /
``commit_tensor``; an object reaches ``planner.load_bytes`` as a ``torch.save`` made here of the JSON-restored
value). The resume window (the DDP warm-up: :mod:`ftrun.snapshot.client`) opens once ``read_data`` has copied, not
at ``MemoryReader()``: before reading, ``dcp.load`` calls the ``Stateful`` objects' ``state_dict()``, where
``get_state_dict`` makes a fresh optimizer's state with an optimizer step, which would close it.

Invariants:

* Each rank stores every item of its *local* plan, not only those DCP's global dedup leaves to it (a replicated
  tensor, an RNG state, the optimizer's ``step``, the ``param_groups``): a load reads nothing but this rank's own
  slot, and ``read_metadata`` describes that slot alone.
* A RAM snapshot loads only into the world size and sharding that saved it: another world size is refused when
  the reader is made, a plan that asks for other chunks at ``prepare_local_plan`` / ``read_data`` (DCP reports
  it as a ``CheckpointException``), one line each (:class:`ReshardRequired`), unless a durable copy in DCP's
  format exists (``--ckpt-format dcp``): then ``MemoryReader`` reads the newest one every rank sees, through
  DCP's ``FileSystemReader``, which reshards. Not seen: a live chunk no stored chunk overlaps at the same world size
  (a restarted job runs the same command: its sharding changes with its world size only).
* A tensor is taken by reference only when only an optimizer step changes it: its memory is that of a parameter
  or a state tensor of an optimizer seen stepping. The first save before any optimizer step clones everything.
* A job uses either a Snapshotter of its own or this module, never both: the keeper holds one snapshot stream per
  rank, and ``restore`` answers once per process (the second Snapshotter of a process raises).
* The snapshot restored at start is held in this process's memory (one copy of the rank's state) until the
  first ``MemoryWriter`` save; a ``MemoryReader`` made after that save is refused.
* Like the Snapshotter, a write the keeper refuses turns RAM snapshots off for the process with one line on
  stderr, and ``dcp.save`` returns; the job goes on training.
* Outside ftrun (no keeper) making either class raises :class:`RuntimeError` at once.
"""

from __future__ import annotations

import io
import os
import threading
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import (BytesStorageMetadata, ChunkStorageMetadata, FileSystemReader, LoadPlan,
                                          LoadPlanner, Metadata, ReadItem, SavePlan, SavePlanner, StorageReader,
                                          StorageWriter, TensorStorageMetadata, WriteItem)
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import LoadItemType, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from ftrun.snapshot import dcp_items
from ftrun.snapshot.client import Snapshotter, stepped_memory
from ftrun.snapshot.dcp_copy import ENV_DCP_ROOT, dcp_path, newest_dcp
from ftrun.snapshot.dcp_items import FORMAT
from ftrun.snapshot.layout import UnsupportedState
from ftrun.snapshot.protocol import ENV_KEEPER_SOCKET

__all__ = ["MemoryReader", "MemoryWriter", "NoSnapshot", "ReshardRequired", "restored_step", "wait"]

_RESHARD = ("resharding goes through a durable checkpoint in DCP format (ftrun --ckpt-dir DIR --ckpt-format dcp: "
            "MemoryReader then loads it)")
# at the same world size: MemoryReader reads a durable copy only where the world size changed
_SAME_WORLD = ("the world size is the same, so the sharding changed (another device mesh or parallelism): a RAM "
               "snapshot, and a step persisted in ftrun's format, load only into the sharding that saved them; load "
               "a DCP copy of the job (--ckpt-format dcp: <ckpt-dir>/<job id>/step-N/dcp) with dcp.load and "
               "FileSystemReader, or start over (--no-resume)")


class NoSnapshot(FileNotFoundError):
    """No step is held in RAM by every rank: start from scratch."""


class ReshardRequired(ValueError):
    """The live state asks for chunks this rank's RAM snapshot does not hold (another world size or sharding)."""


_lock = threading.Lock()
_snap: Snapshotter | None = None
_restored: int | None = None  # None: not asked yet
_loaded: dict[str, Any] | None = None  # the restored snapshot, until the first save
_saved = False  # a MemoryWriter of this process has saved


def restored_step() -> int:
    """The step a :class:`MemoryReader` of this process restored; 0 when none did."""
    return _restored or 0


def wait() -> None:
    """Block until the copy of this process's newest ``MemoryWriter`` save is committed. ``dcp.save`` returns
    before the parameters and optimizer state are copied, and only an optimizer step waits for the copy: call this
    before changing them in place otherwise (EMA weights swapped in for a validation pass, a manual edit), which
    would change the snapshot being taken."""
    with _lock:
        if _snap is not None:
            _snap.wait()


def _require_keeper(what: str) -> None:
    if not os.environ.get(ENV_KEEPER_SOCKET):
        raise RuntimeError(f"ftrun.dcp.{what} needs ftrun's RAM tier: run the script under ftrun ({ENV_KEEPER_SOCKET} "
                           "is not set); elsewhere use dcp.FileSystemWriter / FileSystemReader")


def _snapshotter() -> Snapshotter:
    global _snap
    if _snap is None:
        _snap = Snapshotter(dcp_items.stored(0, None, {}), every=1, rng=False, skip=False)  # dcp.save() must save
    return _snap


def _durable_step() -> tuple[int, str] | None:
    """(step, path) of the newest durable DCP copy of the job that every rank sees, or None (agreed by all ranks:
    every rank calls this together, as the keeper's agreement on the RAM step is the same on every rank)."""
    root = os.environ.get(ENV_DCP_ROOT)
    found = newest_dcp(root) if root else None
    step = found[0] if found else 0
    if _world() > 1:
        steps: list[Any] = [None] * _world()
        dist.all_gather_object(steps, step)
        step = min(steps)
    return (step, dcp_path(root, step)) if root and step > 0 and os.path.isdir(dcp_path(root, step)) else None


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _no_checkpoint_id(what: str, checkpoint_id: str | os.PathLike | None) -> None:
    if checkpoint_id is not None:
        raise ValueError(f"ftrun.dcp.{what} takes no checkpoint_id ({checkpoint_id!r}): the RAM tier keeps one "
                         "snapshot stream per rank, named by its step")


def _at(item: ReadItem) -> list[int]:
    """Where the live chunk an item reads into starts in the global tensor."""
    return list(item.dest_index.offset or [])


def _done(value: Any) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future


class MemoryWriter(StorageWriter):
    """Saves this rank's items of ``dcp.save`` as one RAM snapshot of ``step`` (> 0), kept by ftrun's keeper."""

    def __init__(self, step: int) -> None:
        _require_keeper("MemoryWriter")
        if type(step) is not int or step < 1:
            raise ValueError(f"ftrun.dcp.MemoryWriter: step must be an int >= 1, got {step!r}")
        self.step = step
        self._local: SavePlan | None = None
        self._pid = os.getpid()  # a copy in another process (async_save's process mode) is refused: see reset()

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        """DCP's first call of a save given a ``checkpoint_id``. In another process than the one that made the
        writer (``dcp.async_save`` with ``AsyncCheckpointerType.PROCESS`` saves in a process it spawns) it, and
        every later call, raises: the keeper holds one snapshot stream per trainer, written by its own process."""
        self._check_process()
        _no_checkpoint_id("MemoryWriter", checkpoint_id)
        self._local = None

    def _check_process(self) -> None:
        if os.getpid() != self._pid:
            raise RuntimeError("ftrun.dcp.MemoryWriter saves in the trainer's process only: use dcp.async_save's "
                               "thread mode (the default), not AsyncCheckpointerType.PROCESS")

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._check_process()  # DCP calls reset() only for a save given a checkpoint_id

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        self._local = plan  # every item of this rank, before the coordinator's dedup
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        self._check_process()
        local = self._local if self._local is not None else plan
        background = threading.current_thread() is threading.main_thread()
        stepped = stepped_memory() if background else set()
        items = {}
        for item in local.items:
            key = dcp_items.key(item.index.fqn, item.index.offset)
            if key in items:
                raise ValueError(f"ftrun.dcp.MemoryWriter: two items of this rank have the key {key!r}")
            items[key] = d = _describe(item, planner)
            if background and "t" in d and d["t"].untyped_storage().data_ptr() not in stepped:
                d["t"] = d["t"].clone()  # a buffer, a staged or computed tensor: the next forward may change it
        global _loaded, _saved
        with _lock:
            snap = _snapshotter()
            snap.state.update(dcp_items.stored(_world(), local.planner_data, items))
            _loaded, _saved = None, True
            try:
                snap.save(self.step)
                if not background:
                    snap.wait()
            except UnsupportedState as err:
                raise UnsupportedState(f"ftrun.dcp.MemoryWriter keeps non-tensor values as JSON, never pickled: "
                                       f"{err}") from None
            finally:
                snap.state.update(dcp_items.stored(0, None, {}))  # the copy thread holds its own references
        return _done([])  # DCP hands the results to finish() alone, which needs none: nothing to gather

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        pass  # each rank's snapshot is self-describing; the keeper agrees on the step

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return False  # never picked from a checkpoint_id: pass storage_writer=MemoryWriter(step)


def _describe(item: WriteItem, planner: SavePlanner) -> dict[str, Any]:
    fqn, key = item.index.fqn, dcp_items.key(item.index.fqn, item.index.offset)
    if item.type == WriteItemType.BYTE_IO:
        lookup = getattr(planner, "lookup_object", None)
        if not callable(lookup):
            raise TypeError(f"ftrun.dcp.MemoryWriter: cannot store {fqn} without pickle: the planner "
                            f"{type(planner).__qualname__} has no lookup_object(index) (DefaultSavePlanner has)")
        return {"fqn": fqn, "obj": lookup(item.index)}
    data = item.tensor_data
    tensor = planner.resolve_data(item)
    if data is None or not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != tuple(data.chunk.sizes):
        raise TypeError(f"ftrun.dcp.MemoryWriter: the planner resolved tensor item {key} to "
                        f"{type(tensor).__qualname__} {tuple(getattr(tensor, 'shape', ()))}, not its chunk")
    return {"fqn": fqn, "at": list(data.chunk.offsets), "sizes": list(data.chunk.sizes), "size": list(data.size),
            "dtype": str(data.properties.dtype).removeprefix("torch."), "t": tensor.detach()}


class MemoryReader(StorageReader):
    """Loads, through ``dcp.load``, the RAM snapshot of the step every rank holds (:attr:`step`).

    Made once at the start of a generation: it asks the keeper for that step. Where RAM holds none, or holds one
    saved at another world size, it reads the newest durable copy in DCP's format every rank sees (``--ckpt-dir``
    with ``--ckpt-format dcp``) through DCP's ``FileSystemReader``, which reshards; without one it raises
    :class:`NoSnapshot`, or :class:`ReshardRequired` for another world size.
    """

    def __init__(self) -> None:
        _require_keeper("MemoryReader")
        global _restored, _loaded
        with _lock:
            if _restored is None and not _saved:
                snap = _snapshotter()
                _restored = snap.restore(open_window=False)  # read_data opens it (module docstring)
                if _restored:
                    _loaded = {key: snap.state[key] for key in ("format", "world", "planner")}
                    if _loaded["format"] == FORMAT:
                        _loaded["items"] = dcp_items.items(snap.state)
                    snap.state.update(dcp_items.stored(0, None, {}))
            step, loaded = _restored or 0, _loaded
        if loaded is None and _saved:
            raise RuntimeError("ftrun.dcp.MemoryReader: made after a MemoryWriter save; a MemoryReader loads at the "
                               "start, before the first save (which releases the restored snapshot)")
        if loaded is not None and loaded["format"] != FORMAT:
            raise ValueError(f"ftrun.dcp.MemoryReader: the RAM snapshot of step {step} is not a MemoryWriter's "
                             f"(format {loaded['format']!r}); a job uses either a Snapshotter or ftrun.dcp")
        self.step: int = step
        self._disk: FileSystemReader | None = None
        if loaded is None or loaded["world"] != _world():
            durable = _durable_step()
            if durable is not None:
                _restored = self.step = durable[0]
                self._disk = FileSystemReader(durable[1])
                return
        if loaded is None:
            raise NoSnapshot("ftrun.dcp.MemoryReader: no snapshot in RAM to load, nor a durable one in DCP format "
                             "(start from scratch)")
        if loaded["world"] != _world():
            raise ReshardRequired(f"ftrun.dcp.MemoryReader: the RAM snapshot of step {step} was saved at world size "
                                  f"{loaded['world']}, this job runs {_world()}; {_RESHARD}")
        self._items: dict[str, dict[str, Any]] = loaded["items"]
        self._planner_data: Any = loaded["planner"]

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        _no_checkpoint_id("MemoryReader", checkpoint_id)
        if self._disk is not None:
            self._disk.reset()

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """DCP's metadata of this rank's own snapshot: its chunks of each tensor, its objects."""
        if self._disk is not None:
            return self._disk.read_metadata(*args, **kwargs)
        described: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
        where: dict[MetadataIndex, str] = {}
        for key, d in self._items.items():
            if "t" not in d:
                described[d["fqn"]] = BytesStorageMetadata()
                where[MetadataIndex(d["fqn"])] = key
                continue
            meta = described.setdefault(d["fqn"], TensorStorageMetadata(
                TensorProperties(dtype=getattr(torch, d["dtype"])), torch.Size(d["size"]), []))
            assert isinstance(meta, TensorStorageMetadata)
            meta.chunks.append(ChunkStorageMetadata(torch.Size(d["at"]), torch.Size(d["sizes"])))
            where[MetadataIndex(d["fqn"], d["at"])] = key
        return Metadata(described, planner_data=self._planner_data, storage_data=where)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if self._disk is not None:
            return self._disk.set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self._where: dict[MetadataIndex, str] = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        if self._disk is not None:
            return self._disk.prepare_local_plan(plan)
        for item in plan.items:
            if item.type != LoadItemType.BYTE_IO:
                stored = self._items[self._where[item.storage_index]]
                if any(item.storage_offsets) or any(item.dest_offsets) or list(item.lengths) != stored["sizes"]:
                    self._refuse(item, stored, f"reads {list(item.lengths)} of it into its chunk at {_at(item)}")
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans if self._disk is None else self._disk.prepare_global_plan(plans)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        if self._disk is not None:
            return self._disk.read_data(plan, planner)
        lookup = getattr(planner, "lookup_tensor", None)  # DefaultLoadPlanner's: the whole live chunk
        if callable(lookup):
            for item in plan.items:
                if item.type != LoadItemType.BYTE_IO:
                    stored = self._items[self._where[item.storage_index]]
                    shape = list(lookup(item.dest_index).shape)
                    if shape != stored["sizes"]:
                        self._refuse(item, stored, f"has the chunk {shape} at {_at(item)}")
        for item in plan.items:
            stored = self._items[self._where[item.storage_index]]
            if item.type == LoadItemType.BYTE_IO:
                buffer = io.BytesIO()
                torch.save(stored["obj"], buffer)
                buffer.seek(0)
                planner.load_bytes(item, buffer)
                continue
            target = planner.resolve_tensor(item).detach()
            if target.shape != stored["t"].shape:
                self._refuse(item, stored, f"reads {list(target.shape)} of it into its chunk at {_at(item)}")
            target.copy_(stored["t"])
            planner.commit_tensor(item, target)
        _snapshotter().open_resume_window()
        return _done(None)

    def _refuse(self, item: ReadItem, stored: dict[str, Any], live: str) -> None:
        raise ReshardRequired(f"ftrun.dcp.MemoryReader: {stored['fqn']}: this rank's RAM snapshot of step {self.step} "
                              f"holds the chunk {stored['sizes']} at {stored['at']}, the live state {live}; "
                              f"{_SAME_WORLD}")

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return False  # never picked from a checkpoint_id: pass storage_reader=MemoryReader()
