"""A trainer's state as a table of tensors over one flat byte region plus a JSON skeleton, and back, bit-exactly.

:func:`capture` walks ``state`` (names mapped to stateful objects, tensors, numpy arrays, plain values) into a
:class:`Layout` of one :class:`Entry` per tensor, the tensors whose bytes the engine stores at the entries'
offsets, and a *skeleton*: JSON for everything else. :func:`restore` rebuilds the values and puts them back
into the live objects. No pickle, no ``torch.save``: :func:`encode_meta` writes layout and skeleton as JSON.

Skeleton: ``{"format": 1, "state": {key: node, ...}, "rng": node}`` ("rng" only when captured), where ::

    node := null | true | false | int | str | finite float     themselves (floats round-trip exactly via repr)
          | [node, ...] | {"t": [node, ...]}                   list | tuple
          | {"d": [[key, node], ...], "o": 1, "m": node}       dict in order; "o": OrderedDict, "m": its _metadata
          | {"F": "7ff8000000000000"}                          non-finite float: IEEE-754 bits (nan payload kept)
          | {"b": "<base64>"} | {"n": ["<f4", "<hex>"]}        bytes | numpy scalar (dtype.str, raw bytes)
          | {"B": ["<base64>", pos]}                           io.BytesIO: its bytes and position (torchtitan's
                                                               TrainState returns torch.save'd lists in them)
          | {"T": i, "g": 1} | {"N": i}                        tensor ("g": requires_grad) | numpy array: entry i
          | {"D": i, "mesh": [[rank, ...], ...], "names": [..] | null, "pl": ["Shard(dim=0)", ...],
             "shape": [...], "stride": [...], "at": [...], "g": 1}
                                                               DTensor: entry i holds this rank's local shard;
                                                               its mesh, placements, global shape and stride,
                                                               and where the shard starts in the global tensor
          | {"S": node}                                        stateful object: node is its state_dict() (a
                                                               ZeroRedundancyOptimizer's: its local optimizer's)
          | {"X": "DataLoader"}                                a value whose state is not captured (a plain
                                                               torch DataLoader: restore leaves it as it is)
    key  := node of a str, int, float, bool, None or bytes

Invariants:

* Entries are in walk order (dict order); each offset is the previous entry's end rounded up to :data:`ALIGN`;
  ``Layout.nbytes`` is the last end rounded up (0 without tensors). Entry ``i``, ``Capture.tensors[i]`` and the
  one ``{"T"|"N": i}`` node go together: restore finds entries by index, never by path.
* Paths join keys and list indices with "/" (a key's "%" and "/" are written %25 and %2F): unique unless a dict
  holds both ``k`` and ``str(k)``. ``Layout.digest`` is SHA-256 over every entry's (path, dtype, shape, offset),
  so equal layouts have equal digests in every process.
* Parameters of an ``nn.Module`` (the memory of one of ``module.parameters()``) and the tensors under ``state``
  of a ``torch.optim.Optimizer`` are returned by reference when ``live`` (the caller has seen an optimizer step,
  and every step waits for the engine's copy: parameters change in steps, or after them like an EMA's, or never
  like frozen ones), as are those in a :class:`Borrowed` dict, and, in the state dict of another object (DCP's
  ``Stateful`` app state of ``get_state_dict``), those whose memory is a parameter's or an optimizer state's of an
  optimizer seen stepping (``stepped``). Every other tensor (buffers, raw tensors, numpy arrays, tensors in plain
  values, other tensors of other objects' state dicts, RNG state; parameters too when not ``live``: a loop
  without an optimizer updates them by hand) is cloned at capture. ``Capture.by_reference`` says whether
  any tensor was not.
* RNG, under the reserved top-level key ``__rng__``: ``{"python": random.getstate(), "numpy":
  np.random.get_state(), "torch": torch.get_rng_state(), "cuda": [...] (if CUDA is initialized)}``. Python's
  state is inline (625 ints), numpy's uint32 key array is entry ``__rng__/numpy/1``. Restored last.
* A DTensor (FSDP2, tensor parallel, ``get_state_dict`` outputs) is stored as its local shard. Restore copies the
  shard into the live DTensor in place when the mesh (its ranks), the placements and the global and local
  shapes all match, else refuses it (:class:`LayoutChanged`, one line naming the entry and both layouts). Where
  no live DTensor stands at its place (the state of an optimizer that has not stepped), it is rebuilt with
  ``DTensor.from_local`` on the mesh of a live DTensor of the state with the same ranks and placements.
* A ``ZeroRedundancyOptimizer`` is stored as this rank's partition: the state dict of its local optimizer (its
  own ``state_dict()`` is rank 0's consolidation, a collective). Restore loads it into the local optimizer and
  copies its hyperparameters (``lr``, ...: a scheduler's changes) to the ZeRO optimizer's groups, which its next
  step copies back to the local one (the groups correspond one to one, in order, as ZeRO keeps them).
* Restore ``copy_``-s a stored tensor into the live tensor at the same place (same dtype and shape, any
  device; not a lazy module's uninitialized parameter, which ``load_state_dict`` materializes), else into a new
  tensor (on the live counterpart's device, else the CPU), then calls ``load_state_dict``, except on an
  ``nn.Module`` whose state tensors were all copied in place (so its load hooks do not run). Top-level dicts
  and lists are mutated in place; other plain values are assigned with ``state[key] = value``: they must live
  in the mapping the trainer passed, which must then be mutable.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import math
import random
import struct
import sys
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.nn.parameter import is_lazy

ALIGN = 64
FORMAT = 1
RNG_KEY = "__rng__"
_HINT = "give it state_dict()/load_state_dict(), or make it a tensor or plain value"
_KEYS = (type(None), bool, int, float, str, bytes)


class UnsupportedState(TypeError):
    """A value :func:`capture` cannot snapshot; the one-line message names its path and type."""


class Borrowed(dict):
    """A dict whose tensors :func:`capture` takes by reference instead of cloning them: its owner keeps them
    unchanged until the snapshot's copy is committed (:mod:`ftrun.dcp`, whose writes return only then). Restored
    as a plain dict."""


class LayoutChanged(ValueError):
    """A DTensor of the snapshot does not fit the live one (another mesh, placements or shape); the one-line
    message names the entry and both layouts."""


@dataclass(frozen=True)
class Entry:
    """One tensor of the snapshot: ``nbytes`` bytes at ``offset`` in the data region."""

    path: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class Layout:
    """The tensor table of a snapshot; build it with :func:`capture` or :meth:`from_json`."""

    entries: tuple[Entry, ...]
    nbytes: int
    digest: int

    def to_json(self) -> dict:
        rows = [[e.path, e.dtype, list(e.shape), e.offset, e.nbytes] for e in self.entries]
        return {"nbytes": self.nbytes, "digest": self.digest, "entries": rows}

    @classmethod
    def from_json(cls, doc: dict) -> Layout:
        layout = _layout([Entry(p, d, tuple(s), o, n) for p, d, s, o, n in doc["entries"]])
        if (layout.nbytes, layout.digest) != (doc["nbytes"], doc["digest"]):
            raise ValueError("snapshot layout: size or digest does not match its entries")
        return layout


@dataclass
class Capture:
    """What :func:`capture` returns: the layout, one tensor per entry (same order), the skeleton, and the paths
    of values whose state is not captured (plain DataLoaders); ``by_reference``: some tensor is the live one,
    not a clone (its owner must not change it until the copy is done)."""

    layout: Layout
    tensors: list[torch.Tensor]
    skeleton: dict
    uncaptured: list[str]
    by_reference: bool


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _layout(entries: list[Entry]) -> Layout:
    end = entries[-1].offset + entries[-1].nbytes if entries else 0
    rows = [[e.path, e.dtype, list(e.shape), e.offset] for e in entries]
    digest = hashlib.sha256(json.dumps(rows, separators=(",", ":")).encode()).digest()
    return Layout(tuple(entries), _align(end), int.from_bytes(digest[:8], "big") >> 1)


def _join(path: str, key: Any) -> str:
    segment = str(key).replace("%", "%25").replace("/", "%2F")
    return f"{path}/{segment}" if path else segment


def _is_stateful(v: Any) -> bool:
    return callable(getattr(v, "state_dict", None)) and callable(getattr(v, "load_state_dict", None))


_Live = Callable[[torch.Tensor, str], bool]
_DTYPE_NAMES: dict[torch.dtype, str] = {}  # "float32" for torch.float32, ...


def _never(t: torch.Tensor, path: str) -> bool:
    return False


def _always(t: torch.Tensor, path: str) -> bool:
    return True


def _live_tensors(obj: Any, path: str, stepped: Callable[[], set[int]]) -> _Live:
    """Which tensors of ``obj.state_dict()`` may be returned by reference (see the module docstring); of another
    object (DCP's ``Stateful`` app state, whose ``get_state_dict`` returns the parameters and optimizer states),
    those whose memory is in ``stepped()``."""
    if isinstance(obj, torch.nn.Module):
        params = {_identity(local_shard(p)) for p in obj.parameters()}
        return lambda t, _: _identity(t) in params
    if isinstance(obj, torch.optim.Optimizer):
        prefix = _join(path, "state") + "/"
        return lambda _, p: p.startswith(prefix)
    return lambda t, _: t.untyped_storage().data_ptr() in stepped()


def _zero_partition(v: Any) -> torch.optim.Optimizer | None:
    """The local optimizer of a ``ZeroRedundancyOptimizer`` (this rank's partition), else None (also while its
    module is not imported: then none exists)."""
    kind = getattr(sys.modules.get("torch.distributed.optim.zero_redundancy_optimizer"), "ZeroRedundancyOptimizer",
                   None)
    return v.optim if kind is not None and isinstance(v, kind) else None


def _uncaptured(v: Any) -> bool:
    """A plain ``torch.utils.data.DataLoader``: iterable, but without a state to capture (its position)."""
    return isinstance(v, torch.utils.data.DataLoader) and not _is_stateful(v)


_DTENSOR: list[type] = []  # the DTensor class, once found


def _dtensor_type() -> type | None:
    """The DTensor class, or None while ``torch.distributed.tensor`` is not imported (then none exists). Kept once
    found: the module's attribute lookup costs microseconds, and a save asks for every tensor."""
    if not _DTENSOR:
        kind = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
        if kind is None:
            return None
        _DTENSOR.append(kind)
    return _DTENSOR[0]


def _is_dtensor(v: Any) -> bool:
    kind = _dtensor_type()
    return kind is not None and isinstance(v, kind)


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose bytes a snapshot stores: a DTensor's local shard (same memory), else ``t``."""
    if not _is_dtensor(t):
        return t
    with torch.no_grad():  # no autograd view: 3 us a DTensor, against 15 us for detach() (DTensor dispatch)
        return t.to_local()


def _identity(t: torch.Tensor) -> tuple:
    return t.data_ptr(), t.dtype, t.shape, t.stride()


def _placement(t: Any) -> dict[str, Any]:
    """A DTensor's mesh (its ranks and dimension names), placements and global shape and stride, as JSON."""
    return _described(t)[0]


def _offsets(t: Any, path: str) -> list[int]:
    """Where a DTensor's local shard starts in the global tensor, from the chunk list DTensor gives DCP's
    planners (``__create_chunk_list__``, the protocol DCP saves DTensors with). One box per rank."""
    boxes = _described(t)[1]
    if len(boxes) != 1:
        raise UnsupportedState(f"cannot snapshot DTensor at {path}: its local shard is {len(boxes)} boxes of the "
                               "global tensor, not one")
    return boxes[0]


_DESCRIBED: dict[tuple, tuple[dict[str, Any], list[list[int]]]] = {}


def _described(t: Any) -> tuple[dict[str, Any], list[list[int]]]:
    """:func:`_placement` and the offsets of the local boxes of ``t``. Both depend on its mesh, placements and
    global shape and stride only, so they are cached: reading a mesh's ranks costs about a millisecond, and a
    save walks every DTensor of the state."""
    key = (t.device_mesh, tuple(t.placements), t.shape, t.stride())
    if key not in _DESCRIBED:
        mesh, placements, shape, stride = key
        place = {"mesh": mesh.mesh.tolist(), "names": list(mesh.mesh_dim_names) if mesh.mesh_dim_names else None,
                 "pl": [repr(p) for p in placements], "shape": list(shape), "stride": list(stride)}
        _DESCRIBED[key] = place, [list(chunk.offsets) for chunk in t.__create_chunk_list__()]
    return _DESCRIBED[key]


def _describe(place: dict[str, Any], local: tuple[int, ...]) -> str:
    return (f"mesh {place['mesh']} with ({', '.join(place['pl'])}), global {tuple(place['shape'])}, local "
            f"{tuple(local)}")


class _Walker:
    def __init__(self, live: bool, stepped: Callable[[], set[int]]) -> None:
        self.entries: list[Entry] = []
        self.tensors: list[torch.Tensor] = []
        self.uncaptured: list[str] = []
        self.live = live
        self._stepped_of = stepped
        self._stepped: set[int] | None = None  # stepped(), asked once per capture, when first needed
        self.by_reference = False
        self.end = 0  # where the last entry ends

    def add(self, t: torch.Tensor, path: str, live: _Live, copied: bool = False) -> int:
        """Entry for ``t``: the tensor itself if ``copied`` (made for this capture) or ``live``, else a clone."""
        if t.layout is not torch.strided or t.is_quantized or t.is_meta:
            kind = "sparse" if t.layout is not torch.strided else "quantized" if t.is_quantized else "meta"
            raise UnsupportedState(f"cannot snapshot {kind} tensor at {path}: only dense tensors with data can be")
        offset = _align(self.end)
        dtype = _DTYPE_NAMES.get(t.dtype) or _DTYPE_NAMES.setdefault(t.dtype, str(t.dtype).removeprefix("torch."))
        nbytes = t.nbytes
        self.entries.append(Entry(path, dtype, tuple(t.shape), offset, nbytes))
        self.end = offset + nbytes
        if copied:
            self.tensors.append(t)
        elif live(t, path):
            self.by_reference = True
            self.tensors.append(t)
        else:
            self.tensors.append(t.detach().clone(memory_format=torch.contiguous_format))
        return len(self.entries) - 1

    def node(self, v: Any, path: str, live: _Live) -> Any:
        kind = type(v)  # exact types first: the common nodes of a state dict cost one comparison each
        if v is None or kind is bool or kind is int or kind is str:
            return v
        if kind is float:
            return v if math.isfinite(v) else {"F": struct.pack(">d", v).hex()}
        if kind is dict or kind is OrderedDict:
            doc: dict[str, Any] = {"d": [[self.key(k, path), self.node(x, _join(path, k), live)] for k, x in v.items()]}
            if kind is OrderedDict:
                doc["o"] = 1
                if getattr(v, "_metadata", None) is not None:
                    doc["m"] = self.node(v._metadata, _join(path, "_metadata"), _never)
            return doc
        if kind is list:
            return [self.node(x, _join(path, i), live) for i, x in enumerate(v)]
        if isinstance(v, torch.Tensor):
            if _is_dtensor(v):
                doc = {"D": self.add(local_shard(v), path, live), **_placement(v), "at": _offsets(v, path)}
                return {**doc, "g": 1} if v.requires_grad else doc
            return {"T": self.add(v, path, live), "g": 1} if v.requires_grad else {"T": self.add(v, path, live)}
        if kind is np.ndarray:
            try:
                copy = torch.from_numpy(np.array(v, order="C"))
            except (TypeError, ValueError, RuntimeError):
                raise UnsupportedState(f"cannot snapshot numpy array of {v.dtype} at {path}: {_HINT}") from None
            return {"N": self.add(copy, path, _never, copied=True)}
        if isinstance(v, np.generic) and v.dtype.kind in "biufc":
            return {"n": [v.dtype.str, v.tobytes().hex()]}
        if kind is bytes:
            return {"b": base64.b64encode(v).decode("ascii")}
        if kind is io.BytesIO:
            return {"B": [base64.b64encode(v.getvalue()).decode("ascii"), v.tell()]}
        if kind is tuple:
            return {"t": [self.node(x, _join(path, i), live) for i, x in enumerate(v)]}
        if kind is Borrowed:
            return self.node(dict(v), path, _always)
        if _is_stateful(v):
            v = _zero_partition(v) or v
            return {"S": self.node(v.state_dict(), path, _live_tensors(v, path, self.stepped) if self.live else _never)}
        if _uncaptured(v):
            self.uncaptured.append(path)
            return {"X": kind.__qualname__}
        raise UnsupportedState(f"cannot snapshot {kind.__qualname__} at {path}: {_HINT}")

    def stepped(self) -> set[int]:
        if self._stepped is None:
            self._stepped = self._stepped_of()
        return self._stepped

    def key(self, k: Any, path: str) -> Any:
        kind = type(k)
        if kind is str or kind is int:
            return k
        if kind not in _KEYS:
            raise UnsupportedState(f"cannot snapshot a dict key of type {kind.__qualname__} at {path}: {_HINT}")
        return self.node(k, path, _never)


def capture(state: Mapping[str, Any], *, rng: bool = True, live: bool = True,
            stepped: Callable[[], set[int]] = set) -> Capture:
    """Flatten ``state`` (and the RNG states when ``rng``) into a layout, its tensors and a skeleton. ``live``:
    parameters and optimizer state are taken by reference (see the module docstring), also in the state dict of
    another object where their memory is in ``stepped()`` (storage addresses of every parameter and optimizer
    state tensor: ``ftrun.snapshot.client.stepped_memory``)."""
    walker = _Walker(live, stepped)
    nodes: dict[str, Any] = {}
    for key, value in state.items():
        if type(key) is not str or key == RNG_KEY:
            raise UnsupportedState(f"cannot snapshot top-level key {key!r}: keys are str and {RNG_KEY} is reserved")
        nodes[key] = walker.node(value, _join("", key), _never)
    skeleton: dict[str, Any] = {"format": FORMAT, "state": nodes}
    if rng:
        rngs = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            rngs["cuda"] = torch.cuda.get_rng_state_all()
        skeleton["rng"] = walker.node(rngs, RNG_KEY, _never)
    return Capture(_layout(walker.entries), walker.tensors, skeleton, walker.uncaptured, walker.by_reference)


def _live_dtensors(value: Any) -> Iterator[Any]:
    """The DTensors of a live state: module parameters and buffers, optimizer parameters, in containers."""
    if _is_dtensor(value):
        yield value
    elif isinstance(value, torch.nn.Module):
        yield from (t for t in (*value.parameters(), *value.buffers()) if _is_dtensor(t))
    elif isinstance(value, torch.optim.Optimizer):
        yield from (p for group in value.param_groups for p in group["params"] if _is_dtensor(p))
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from _live_dtensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _live_dtensors(item)


@dataclass(frozen=True)
class GlobalShard:
    """A DTensor of a snapshot read without live objects: this rank's ``local`` shard, which starts at ``offsets``
    in a global tensor of ``shape`` (:func:`to_plain` with ``shards=True``)."""

    local: torch.Tensor
    offsets: tuple[int, ...]
    shape: tuple[int, ...]


class _Builder:
    def __init__(self, layout: Layout, stored: Callable[[Entry], torch.Tensor], *, plain: bool = False,
                 state: Mapping[str, Any] | None = None, shards: bool = False, copy: bool = True) -> None:
        self.entries = layout.entries
        self.stored = stored
        self.plain = plain  # stateful objects become their state_dict() values instead of being loaded
        self.shards = shards  # plain DTensors become GlobalShard, not their local tensor
        self.copy = copy  # plain tensors are new tensors, not views of the stored ones
        self.state = state or {}
        self.meshes: dict[str, tuple[Any, tuple, torch.device]] | None = None  # see mesh_of()

    def value(self, node: Any, live: Any, path: str, inplace: bool) -> Any:
        """The value of ``node``, reusing ``live`` (the current value at the same place) where it can."""
        if type(node) is list:
            items = self.items(node, live, path, inplace)
            if inplace and type(live) is list:
                live[:] = items
                return live
            return items
        if type(node) is not dict:
            return node
        if "t" in node:
            return tuple(self.items(node["t"], live, path, inplace))
        if "d" in node:
            return self.mapping(node, live, path, inplace)
        if "F" in node:
            return struct.unpack(">d", bytes.fromhex(node["F"]))[0]
        if "b" in node:
            return base64.b64decode(node["b"])
        if "B" in node:
            buffer = io.BytesIO(base64.b64decode(node["B"][0]))
            buffer.seek(node["B"][1])
            return buffer
        if "n" in node:
            return np.frombuffer(bytes.fromhex(node["n"][1]), dtype=np.dtype(node["n"][0]))[0]
        if "T" in node:
            src = self.stored(self.entries[node["T"]])
            if (isinstance(live, torch.Tensor) and not is_lazy(live) and live.dtype == src.dtype
                    and live.shape == src.shape):
                with torch.no_grad():
                    live.copy_(src)
                return live
            if not self.copy:
                return src
            out = src.to(live.device if isinstance(live, torch.Tensor) else "cpu", copy=True)
            return out.requires_grad_() if node.get("g") else out
        if "N" in node:
            arr = self.stored(self.entries[node["N"]]).numpy()
            if type(live) is np.ndarray and (live.dtype, live.shape) == (arr.dtype, arr.shape) and live.flags.writeable:
                np.copyto(live, arr)
                return live
            return arr.copy() if self.copy else arr
        if "S" in node:
            return self.value(node["S"], None, path, False) if self.plain else self.load(node["S"], live, path)
        if "X" in node:
            return None if self.plain else live
        if "D" in node:
            return self.dtensor(node, live, path)
        raise ValueError(f"corrupt snapshot skeleton at {path}")

    def dtensor(self, node: dict, live: Any, path: str) -> Any:
        src = self.stored(self.entries[node["D"]])
        if self.plain:
            local = src.clone() if self.copy else src
            return GlobalShard(local, tuple(node["at"]), tuple(node["shape"])) if self.shards else local
        place = {key: node[key] for key in ("mesh", "names", "pl", "shape", "stride")}
        if _is_dtensor(live):
            local, mine = local_shard(live), _placement(live)
            if mine != place or (local.dtype, local.shape) != (src.dtype, src.shape):
                raise LayoutChanged(f"cannot restore {path}: the snapshot holds a DTensor on "
                                    f"{_describe(place, src.shape)}, the live one is on {_describe(mine, local.shape)}")
            with torch.no_grad():
                local.copy_(src)
            return live
        found = self.mesh_of(place)
        if found is None:
            raise LayoutChanged(f"cannot restore {path}: the snapshot holds a DTensor on {_describe(place, src.shape)}"
                                ", and no live DTensor of the state is on that mesh with those placements")
        mesh, placements, device = found
        out = _dtensor_type().from_local(src.to(device, copy=True), mesh, placements,  # type: ignore[union-attr]
                                         run_check=False, shape=torch.Size(node["shape"]),
                                         stride=tuple(node["stride"]))
        return out.requires_grad_() if node.get("g") else out

    def mesh_of(self, place: dict) -> tuple[Any, tuple, torch.device] | None:
        """(mesh, placements, device) of a live DTensor of the state on the same ranks with the same placements."""
        if self.meshes is None:
            self.meshes = {}
            for t in _live_dtensors(self.state):
                found = _placement(t)
                key = json.dumps([found["mesh"], found["names"], found["pl"]])
                self.meshes.setdefault(key, (t.device_mesh, tuple(t.placements), local_shard(t).device))
        return self.meshes.get(json.dumps([place["mesh"], place["names"], place["pl"]]))

    def items(self, nodes: list, live: Any, path: str, inplace: bool) -> list:
        old = live if type(live) in (list, tuple) else ()
        return [self.value(x, old[i] if i < len(old) else None, _join(path, i), inplace) for i, x in enumerate(nodes)]

    def mapping(self, node: dict, live: Any, path: str, inplace: bool) -> dict:
        old = live if isinstance(live, Mapping) else {}
        pairs = []
        for key_node, x in node["d"]:
            key = self.value(key_node, None, path, False)
            pairs.append((key, self.value(x, old.get(key), _join(path, key), inplace)))
        kind = OrderedDict if node.get("o") else dict
        out = live if inplace and type(live) is kind else kind()
        out.clear()
        out.update(pairs)
        if "m" in node:
            out._metadata = self.value(node["m"], None, path, False)
        return out

    def load(self, node: Any, obj: Any, path: str) -> Any:
        if obj is None:  # added to the state after the start (a module, an optimizer): nothing to load it into
            raise ValueError(f"cannot restore {path}: the snapshot holds a state_dict() (a module's, an "
                             "optimizer's) and the state has no object there: put one of its kind there before "
                             "restore()")
        if not _is_stateful(obj):
            raise ValueError(f"cannot restore {path}: the snapshot holds a state_dict(), the live value is a "
                             f"{type(obj).__qualname__}")
        if (local := _zero_partition(obj)) is not None:
            self.load(node, local, path)
            for group, loaded in zip(obj.param_groups, local.param_groups, strict=True):
                group.update((key, value) for key, value in loaded.items() if key != "params")
            return obj
        current = obj.state_dict()
        rebuilt = self.value(node, current, path, False)
        in_place = isinstance(rebuilt, Mapping) and rebuilt.keys() == current.keys() and all(
            isinstance(t, torch.Tensor) and rebuilt[k] is t for k, t in current.items())
        if not (isinstance(obj, torch.nn.Module) and in_place):
            obj.load_state_dict(rebuilt)
        return obj


def restore(state: Mapping[str, Any], layout: Layout, skeleton: dict,
            stored: Callable[[Entry], torch.Tensor]) -> None:
    """Put the snapshot back into the live objects of ``state`` (the keys given to :func:`capture`).

    A key the snapshot has and ``state`` lacks (added to the state after the script built it: an EMA copy from
    step N on), or whose live value is a plain one (a ``None`` placeholder), gets the snapshot's value (not a
    module's or an optimizer's state: there is no object to load it into). A live
    tensor of another dtype or shape at the top level is refused, as a key the snapshot lacks: the script may
    hold that tensor elsewhere, and a new one in its place would leave that reference behind, silently."""
    if skeleton.get("format") != FORMAT:
        raise ValueError(f"snapshot skeleton format {skeleton.get('format')!r}, expected {FORMAT}")
    nodes = skeleton["state"]
    if set(state) - set(nodes):
        raise ValueError(f"state keys not in the snapshot: {sorted(set(state) - set(nodes), key=str)} (it holds "
                         f"{sorted(nodes, key=str)})")
    builder = _Builder(layout, stored, state=state)
    for key, node in nodes.items():
        live, path = state.get(key), _join("", key)
        if type(node) is dict and "T" in node and isinstance(live, torch.Tensor):
            e = layout.entries[node["T"]]
            if str(live.dtype) != f"torch.{e.dtype}" or live.shape != e.shape:
                raise ValueError(f"cannot restore {path}: the snapshot holds {e.dtype} {list(e.shape)}, the live "
                                 f"value is {live.dtype} {list(live.shape)}")
        value = builder.value(node, live, path, True)
        if value is not live or key not in state:
            state[key] = value  # type: ignore[index]  # documented: plain values need a mutable mapping
    if "rng" in skeleton:
        rngs = builder.value(skeleton["rng"], None, RNG_KEY, False)
        random.setstate(rngs["python"])
        np.random.set_state(rngs["numpy"])
        torch.set_rng_state(rngs["torch"])
        if "cuda" in rngs and torch.cuda.is_available():
            for device, s in enumerate(rngs["cuda"][: torch.cuda.device_count()]):
                torch.cuda.set_rng_state(s, device)


def to_plain(layout: Layout, skeleton: dict, stored: Callable[[Entry], torch.Tensor], *,
             shards: bool = False, copy: bool = True) -> dict[str, Any]:
    """The snapshot as plain values, without live objects: ``{key: value, ..., RNG_KEY: rngs}`` (RNG states only
    when captured). A stateful object becomes its ``state_dict()`` value, a tensor a new CPU tensor (with
    ``requires_grad`` as captured), a DTensor its local shard (a :class:`GlobalShard` with ``shards``), a numpy
    array or scalar stays numpy; containers keep their types. With ``copy=False`` tensors
    and arrays are the stored ones themselves (views of the snapshot's memory, read-only use)."""
    if skeleton.get("format") != FORMAT:
        raise ValueError(f"snapshot skeleton format {skeleton.get('format')!r}, expected {FORMAT}")
    builder = _Builder(layout, stored, plain=True, shards=shards, copy=copy)
    plain = {key: builder.value(node, None, _join("", key), False) for key, node in skeleton["state"].items()}
    if "rng" in skeleton:
        plain[RNG_KEY] = builder.value(skeleton["rng"], None, RNG_KEY, False)
    return plain


def encode_meta(layout: Layout, skeleton: dict) -> bytes:
    """The layout and the skeleton as compact JSON bytes."""
    return json.dumps({"layout": layout.to_json(), "skeleton": skeleton}, separators=(",", ":")).encode()


def decode_meta(raw: bytes) -> tuple[Layout, dict]:
    """Inverse of :func:`encode_meta`; ValueError when the bytes are not a layout and skeleton."""
    try:
        doc = json.loads(raw)
        return Layout.from_json(doc["layout"]), doc["skeleton"]
    except (KeyError, TypeError) as e:
        raise ValueError(f"corrupt snapshot metadata: {e!r}") from None
