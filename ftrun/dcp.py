"""``torch.distributed.checkpoint`` (DCP) on ftrun's RAM tier: :class:`MemoryWriter` and :class:`MemoryReader`.

    dcp.save(state, storage_writer=ftrun.dcp.MemoryWriter(step))      # or dcp.async_save(...), thread mode
    try:
        dcp.load(state, storage_reader=ftrun.dcp.MemoryReader())     # at start: the step every rank holds
        start = ftrun.dcp.restored_step()
    except ftrun.dcp.NoSnapshot:                                     # a FileNotFoundError: nothing in RAM yet
        start = 0

Protocol. Both delegate to one :class:`~ftrun.snapshot.client.Snapshotter` per process (``every=1``,
``rng=False``), made on first use, whose state is a dict this module fills: ``"format"`` (:data:`FORMAT`),
``"world"`` (the world size that saved), ``"planner"`` (the save plan's ``planner_data``: DCP's flattening map)
and ``"items"``: the items, keyed by a string of each one's ``MetadataIndex`` (``fqn`` for an object,
``fqn@o0,o1`` for a tensor chunk), each described by ``{"fqn", "at", "sizes", "size", "dtype", "t"}`` for a
tensor chunk (``t`` the chunk, a plain local tensor; ``at``/``sizes`` where it sits in the global tensor of
``size``) or ``{"fqn", "obj"}`` for anything else, the object itself (``planner.lookup_object``), stored in the
snapshot's JSON skeleton (:mod:`ftrun.snapshot.layout`): nothing is pickled, and a value JSON cannot hold (an
instance of a custom class) is refused in one line. ``MemoryWriter.write_data`` snapshots the items and returns
once the copy is committed; ``MemoryReader()`` asks the keeper for the step every rank holds
(``Snapshotter.restore``; it raises :class:`NoSnapshot` itself, before DCP runs, since DCP would wrap an error of
``read_metadata`` in a ``CheckpointException``) and DCP copies from it into the live state in place
(``planner.resolve_tensor`` / ``commit_tensor``; an object reaches ``planner.load_bytes`` as a ``torch.save``
made here of the JSON-restored value).

Invariants:

* Each rank stores every item of its *local* plan, not only those DCP's global dedup leaves to it (a replicated
  tensor, an RNG state, the optimizer's ``step``, the ``param_groups``): a load reads nothing but this rank's own
  slot, and ``read_metadata`` describes that slot alone.
* A RAM snapshot loads only into the world size and sharding that saved it: another world size is refused when
  the reader is made, a plan that asks for other chunks at ``prepare_local_plan`` / ``read_data`` (DCP reports
  it as a ``CheckpointException``), one line each (:class:`ReshardRequired`). Resharding goes through a durable
  checkpoint (DCP's ``FileSystemWriter``). Not seen: a live chunk no stored chunk overlaps at the same world size
  (a restarted job runs the same command: its sharding changes with its world size only).
* A job uses either a Snapshotter of its own or this module, never both: the keeper holds one snapshot stream per
  rank, and ``restore`` answers once per process.
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
from torch.distributed.checkpoint import (BytesStorageMetadata, ChunkStorageMetadata, LoadPlan, LoadPlanner,
                                          Metadata, ReadItem, SavePlan, SavePlanner, StorageReader, StorageWriter,
                                          TensorStorageMetadata, WriteItem)
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import LoadItemType, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from ftrun.snapshot.client import Snapshotter
from ftrun.snapshot.layout import Borrowed, UnsupportedState
from ftrun.snapshot.protocol import ENV_KEEPER_SOCKET

__all__ = ["MemoryReader", "MemoryWriter", "NoSnapshot", "ReshardRequired", "restored_step"]

FORMAT = "ftrun.dcp/1"
_RESHARD = "resharding goes through a durable checkpoint (dcp.save to a FileSystemWriter)"


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


def _require_keeper(what: str) -> None:
    if not os.environ.get(ENV_KEEPER_SOCKET):
        raise RuntimeError(f"ftrun.dcp.{what} needs ftrun's RAM tier: run the script under ftrun ({ENV_KEEPER_SOCKET} "
                           "is not set); elsewhere use dcp.FileSystemWriter / FileSystemReader")


def _snapshotter() -> Snapshotter:
    global _snap
    if _snap is None:
        _snap = Snapshotter({"format": FORMAT, "world": 0, "planner": None, "items": Borrowed()}, every=1, rng=False)
    return _snap


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _key(index: MetadataIndex) -> str:
    return index.fqn if index.offset is None else f"{index.fqn}@{','.join(map(str, index.offset))}"


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

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        _no_checkpoint_id("MemoryWriter", checkpoint_id)
        self._local = None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        pass

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        self._local = plan  # every item of this rank, before the coordinator's dedup
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        local = self._local if self._local is not None else plan
        items = {}
        for item in local.items:
            key = _key(item.index)
            if key in items:
                raise ValueError(f"ftrun.dcp.MemoryWriter: two items of this rank have the key {key!r}")
            items[key] = _describe(item, planner)
        global _loaded, _saved
        with _lock:
            snap = _snapshotter()
            snap.state.update(world=_world(), planner=local.planner_data)
            snap.state["items"] = Borrowed(items)  # copied straight into the slot: save() waits for it
            _loaded, _saved = None, True
            try:
                snap.save(self.step)
                snap.wait()
            except UnsupportedState as err:
                raise UnsupportedState(f"ftrun.dcp.MemoryWriter keeps non-tensor values as JSON, never pickled: "
                                       f"{err}") from None
            finally:
                snap.state["items"] = Borrowed()  # the live tensors are not kept here
        sizes = {key: d["t"].numel() * d["t"].element_size() for key, d in items.items() if "t" in d}
        return _done([WriteResult(index=item.index, size_in_bytes=sizes.get(_key(item.index), 0),
                                  storage_data=_key(item.index)) for item in plan.items])

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        pass  # each rank's snapshot is self-describing; the keeper agrees on the step

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return False  # never picked from a checkpoint_id: pass storage_writer=MemoryWriter(step)


def _describe(item: WriteItem, planner: SavePlanner) -> dict[str, Any]:
    fqn = item.index.fqn
    if item.type == WriteItemType.BYTE_IO:
        lookup = getattr(planner, "lookup_object", None)
        if not callable(lookup):
            raise TypeError(f"ftrun.dcp.MemoryWriter: cannot store {fqn} without pickle: the planner "
                            f"{type(planner).__qualname__} has no lookup_object(index) (DefaultSavePlanner has)")
        return {"fqn": fqn, "obj": lookup(item.index)}
    data = item.tensor_data
    tensor = planner.resolve_data(item)
    if data is None or not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != tuple(data.chunk.sizes):
        raise TypeError(f"ftrun.dcp.MemoryWriter: the planner resolved tensor item {_key(item.index)} to "
                        f"{type(tensor).__qualname__} {tuple(getattr(tensor, 'shape', ()))}, not its chunk")
    return {"fqn": fqn, "at": list(data.chunk.offsets), "sizes": list(data.chunk.sizes), "size": list(data.size),
            "dtype": str(data.properties.dtype).removeprefix("torch."), "t": tensor.detach()}


class MemoryReader(StorageReader):
    """Loads, through ``dcp.load``, the RAM snapshot of the step every rank holds (:attr:`step`).

    Made once at the start of a generation: it asks the keeper for that step and raises :class:`NoSnapshot` when
    there is none, :class:`ReshardRequired` when it was saved at another world size.
    """

    def __init__(self) -> None:
        _require_keeper("MemoryReader")
        global _restored, _loaded
        with _lock:
            if _restored is None and not _saved:
                snap = _snapshotter()
                _restored = snap.restore()
                if _restored:
                    _loaded = {key: snap.state[key] for key in ("format", "world", "planner")}
                    _loaded["items"], snap.state["items"] = snap.state["items"], Borrowed()
            step, loaded = _restored or 0, _loaded
        if loaded is None and _saved:
            raise RuntimeError("ftrun.dcp.MemoryReader: made after a MemoryWriter save; a MemoryReader loads at the "
                               "start, before the first save (which releases the restored snapshot)")
        if loaded is None:
            raise NoSnapshot("ftrun.dcp.MemoryReader: no snapshot in RAM to load (start from scratch)")
        if loaded["format"] != FORMAT:
            raise ValueError(f"ftrun.dcp.MemoryReader: the RAM snapshot of step {step} is not a MemoryWriter's "
                             f"(format {loaded['format']!r}); a job uses either a Snapshotter or ftrun.dcp")
        if loaded["world"] != _world():
            raise ReshardRequired(f"ftrun.dcp.MemoryReader: the RAM snapshot of step {step} was saved at world size "
                                  f"{loaded['world']}, this job runs {_world()}; {_RESHARD}")
        self.step: int = step
        self._items: dict[str, dict[str, Any]] = loaded["items"]
        self._planner_data: Any = loaded["planner"]

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        _no_checkpoint_id("MemoryReader", checkpoint_id)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """DCP's metadata of this rank's own snapshot: its chunks of each tensor, its objects."""
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
        self._where: dict[MetadataIndex, str] = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        for item in plan.items:
            if item.type != LoadItemType.BYTE_IO:
                stored = self._items[self._where[item.storage_index]]
                if any(item.storage_offsets) or any(item.dest_offsets) or list(item.lengths) != stored["sizes"]:
                    self._refuse(item, stored, f"reads {list(item.lengths)} of it into its chunk at {_at(item)}")
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
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
        return _done(None)

    def _refuse(self, item: ReadItem, stored: dict[str, Any], live: str) -> None:
        raise ReshardRequired(f"ftrun.dcp.MemoryReader: {stored['fqn']}: this rank's RAM snapshot of step {self.step} "
                              f"holds the chunk {stored['sizes']} at {stored['at']}, the live state {live}; {_RESHARD}")

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return False  # never picked from a checkpoint_id: pass storage_reader=MemoryReader()
