"""Reading a checkpoint directory of the durable tier (:mod:`ftrun.snapshot.persist`) without a running job.

:func:`inventory` lists its steps (``ftrun inspect``); :func:`export_step` turns each rank file of a step into a
standard file (``ftrun export``) that loads without ftrun:

* ``torch``: ``rank-RRRRR.pt``, the rank's state as plain values (modules, optimizers and other stateful
  objects as their ``state_dict()``; numpy arrays as tensors, numpy scalars as Python numbers; the RNG states
  under ``"__rng__"``), loadable with ``torch.load(path, weights_only=True)``.
* ``safetensors``: ``rank-RRRRR.safetensors``, every tensor keyed by its layout path (``model/0.weight``,
  ``optim/state/0/exp_avg``, ``__rng__/torch``...); the metadata keeps everything else as JSON:
  ``ftrun_skeleton`` and ``ftrun_layout`` (:mod:`ftrun.snapshot.layout`), ``ftrun_job``, ``ftrun_step``,
  ``ftrun_rank``. A tensor is stored at ``entries[i]`` of the layout where the skeleton says ``{"T": i}``.
* ``dcp``: one checkpoint of ``torch.distributed.checkpoint`` in ``out`` (``.metadata`` and ``*.distcp``), which
  ``dcp.load(state_dict, checkpoint_id=out)`` reads with torch alone, into any world size and sharding. A
  DTensor (FSDP2, tensor parallel) is written as every rank's shard, a chunk of its global tensor, as DCP itself
  writes one (never assembled in memory: the shards are read from the mapped rank files); every other value is
  global rank 0's (the state as DCP sees it: keys joined by dots, ``model.0.weight``). RNG states are left out.
  A step saved through ``ftrun.dcp.MemoryWriter`` exports to what ``dcp.save`` to a directory would have written:
  the same keys, each tensor as the chunks the ranks saved.

Errors a user can fix (no such directory or step, a corrupt rank, an unwritable output) are
:class:`~ftrun.errors.UsageError`. torch is imported only to export, so ``ftrun inspect`` starts at once.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from ftrun.errors import UsageError
from ftrun.snapshot import persist
from ftrun.snapshot.slot import HEADER_SIZE

if TYPE_CHECKING:
    import torch

    from ftrun.snapshot.layout import Entry, Layout

FORMATS = {"torch": "pt", "safetensors": "safetensors", "dcp": "distcp"}


@dataclass(frozen=True)
class StepInfo:
    """One step directory of a checkpoint directory, as :func:`inventory` found it."""

    step: int
    path: str
    state: str  # "complete", "partial" (being written, or abandoned) or "invalid" (unreadable manifest)
    job: str | None
    world: int | None  # ranks of the job (None unless complete)
    ranks: int  # rank files listed (complete) or present (partial)
    bytes: int
    time: float  # manifest time (complete), else the directory's modification time
    corrupt: dict[int, str] | None  # rank -> problem; {} all verified; None not verified
    error: str | None = None  # why an invalid step's manifest cannot be read


def _check_root(root: str) -> None:
    if not os.path.isdir(root):
        raise UsageError(f"{root}: no such checkpoint directory")


def inventory(root: str, verify: bool = True) -> list[StepInfo]:
    """Every step directory of every job in ``root`` (a ``--ckpt-dir``, or one job's directory in it), by job and
    step; ``verify`` reads every byte of complete steps (CRC-32)."""
    _check_root(root)
    rows = [row for directory in persist.job_dirs(root) for row in _job_inventory(directory, verify)]
    if not rows:
        raise UsageError(f"{root}: no checkpoint steps in it (<job>/step-NNNNNNNN directories)")
    return rows


def failed(rows: list[StepInfo]) -> list[StepInfo]:
    """The rows of steps that fail verification (a corrupt rank, an unreadable manifest)."""
    return [row for row in rows if row.corrupt or row.state == "invalid"]


def _job_inventory(root: str, verify: bool) -> list[StepInfo]:
    rows = []
    for step in persist.step_dirs(root):
        path = os.path.join(root, persist.step_name(step))
        try:
            doc = persist.manifest(root, step)
        except (OSError, ValueError) as err:
            rows.append(StepInfo(step, path, "invalid", None, None, 0, 0, os.stat(path).st_mtime, None, str(err)))
            continue
        corrupt = {r: p for r, p in persist.verify_step(root, step).items() if p} if verify else None
        rows.append(StepInfo(step, path, "complete", doc["job"], doc["world"], len(doc["ranks"]),
                             sum(e["bytes"] for e in doc["ranks"].values()), doc["time"], corrupt))
    for step in persist.step_dirs(root, partial=True):
        path = persist.partial_dir(root, step)
        with os.scandir(path) as found:
            files = [e.stat(follow_symlinks=False).st_size for e in found  # links are not ftrun's (a loop: ELOOP)
                     if e.name.startswith("rank-") and e.is_file(follow_symlinks=False)]
        rows.append(StepInfo(step, path, "partial", os.path.basename(root), None, len(files), sum(files),
                             os.stat(path).st_mtime, None))
    return sorted(rows, key=lambda row: (row.step, row.state != "complete"))


def inventory_json(root: str, rows: list[StepInfo]) -> str:
    return json.dumps({"dir": root, "steps": [asdict(row) for row in rows]}, indent=1)


def print_inventory(rows: list[StepInfo], tty: bool | None = None) -> None:
    """The steps as a table: rich on a terminal, plain aligned columns otherwise."""
    header = ("step", "job", "state", "ranks", "size", "created", "check")
    table = [header] + [(str(r.step), r.job or "-", r.state, str(r.ranks), _size(r.bytes),
                         time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r.time)), _check(r)) for r in rows]
    if sys.stdout.isatty() if tty is None else tty:
        from rich.console import Console
        from rich.table import Table

        rich_table = Table(*header)
        for row in table[1:]:
            rich_table.add_row(*row)
        Console(highlight=False).print(rich_table)
        return
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for row in table:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())


def _size(n: int) -> str:
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    i = min(len(units) - 1, max(0, (n.bit_length() - 1) // 10))
    return f"{n} B" if i == 0 else f"{n / 1024 ** i:.1f} {units[i]}"


def _check(row: StepInfo) -> str:
    if row.error is not None:
        return row.error
    if row.corrupt is None:
        return "-"
    return "; ".join(f"rank {r} corrupt: {p}" for r, p in sorted(row.corrupt.items())) or "ok"


def job_root(ckpt_dir: str, job: str | None) -> str:
    """The directory of ``job``'s steps in ``ckpt_dir``; without ``job``, of its only job (or ``ckpt_dir`` itself
    when it is one job's directory). A missing or ambiguous job is a :class:`UsageError`."""
    _check_root(ckpt_dir)
    dirs = persist.job_dirs(ckpt_dir)
    if job is not None:
        wanted = persist.job_dir(ckpt_dir, job)
        if wanted not in [os.path.abspath(d) for d in dirs]:
            raise UsageError(f"{ckpt_dir}: no steps of job {job!r} (jobs: {', '.join(_jobs(dirs)) or 'none'})")
        return wanted
    if len(dirs) != 1:
        raise UsageError(f"{ckpt_dir}: {'no job with steps' if not dirs else 'steps of several jobs'} in it"
                         f"{' (' + ', '.join(_jobs(dirs)) + '); choose one with --job' if dirs else ''}")
    return dirs[0]


def _jobs(dirs: list[str]) -> list[str]:
    return [os.path.basename(os.path.normpath(d)) for d in dirs]


def export_step(ckpt_dir: str, out: str, fmt: str, step: int | None = None, job: str | None = None) -> Iterator[str]:
    """Write every rank of complete ``step`` (default: the newest) of ``job`` (default: the only one) in
    ``ckpt_dir`` to ``out`` in format ``fmt``, yielding each file's path once written. Every rank is verified
    before anything is written; files are written under a temporary name and renamed, mode 0600, in ``out``
    (created 0700). A file the export would write that ``out`` already has is a :class:`UsageError`, before
    anything is written."""
    if fmt not in FORMATS:
        raise UsageError(f"--format must be one of {', '.join(FORMATS)}, not {fmt!r}")
    root = job_root(ckpt_dir, job)
    steps = persist.complete_steps(root)
    if not steps:
        raise UsageError(f"{root}: no complete step to export")
    step = steps[-1] if step is None else step
    if step not in steps:
        raise UsageError(f"{root}: no complete step {step} (complete: {', '.join(map(str, steps))})")
    corrupt = {r: p for r, p in persist.verify_step(root, step).items() if p}
    if corrupt:
        ranks = "; ".join(f"rank {r}: {p}" for r, p in sorted(corrupt.items()))
        raise UsageError(f"step {step} is corrupt ({ranks}); export another with --step")
    doc = persist.manifest(root, step)
    made = not os.path.lexists(out)
    try:
        persist.mkdir_private(out)
    except OSError as err:
        raise UsageError(f"cannot create {out}: {err.strerror or err}") from None
    try:
        yield from _write_step(out, fmt, root, step, doc)
    except UsageError:
        if made:  # an export that failed leaves no directory it made (an earlier one's files stay)
            with contextlib.suppress(OSError):
                os.rmdir(out)
        raise


def _write_step(out: str, fmt: str, root: str, step: int, doc: dict) -> Iterator[str]:
    sources = [os.path.join(root, persist.step_name(step), doc["ranks"][str(rank)]["file"])
               for rank in range(doc["world"])]
    targets = [".metadata"] if fmt == "dcp" else [f"rank-{rank:05d}.{FORMATS[fmt]}" for rank in range(doc["world"])]
    present = [name for name in targets if os.path.lexists(os.path.join(out, name))]
    if present:  # an earlier export, maybe of another step or job: never replaced
        raise UsageError(f"{os.path.join(out, present[0])} exists (and {len(present) - 1} more file(s) this export "
                         "would write): remove them, or export to another directory")
    if fmt == "dcp":
        yield from _write_dcp(out, sources)
        return
    written: list[str] = []
    for rank, source in enumerate(sources):
        target = os.path.join(out, f"rank-{rank:05d}.{FORMATS[fmt]}")
        try:
            with _opened(source) as (layout, skeleton, stored):
                if fmt == "torch":
                    _write_torch(target, layout, skeleton, stored)
                else:
                    _write_safetensors(target, layout, skeleton, stored, {"ftrun_job": doc["job"],
                                       "ftrun_step": str(step), "ftrun_rank": str(rank)})
        except OSError as err:
            free = _free_space(out)
            for path in written:  # a step exported in part is no export
                with contextlib.suppress(OSError):
                    os.unlink(path)
            raise UsageError(f"cannot write {target}: {_write_error(err)} ({free})") from None
        written.append(target)
        yield target


@contextlib.contextmanager
def _opened(path: str) -> Iterator[tuple[Layout, dict, Callable[[Entry], torch.Tensor]]]:
    """Layout, skeleton and the stored tensors (views of the mapped file) of a verified rank file."""
    import torch

    from ftrun.snapshot.layout import decode_meta

    image = persist.open_image(path)
    data = torch.empty(0, dtype=torch.uint8)
    try:
        header = image.header()
        with image.payload() as payload:
            layout, skeleton = decode_meta(bytes(payload[header.data_len:header.payload_len]))
        if header.data_len:
            data = torch.frombuffer(image.map, dtype=torch.uint8, count=header.data_len, offset=HEADER_SIZE)
        yield layout, skeleton, lambda e: data[e.offset:e.offset + e.nbytes].view(getattr(torch, e.dtype)).reshape(
            e.shape)
    finally:
        data = torch.empty(0, dtype=torch.uint8)  # drops the last view of the mapping (``stored`` may outlive it)
        image.close()


@contextlib.contextmanager
def _replacing(path: str) -> Iterator[str]:
    """A temporary path (created empty, 0600) to write ``path``'s new content to; renamed over it on success."""
    temporary = f"{path}.partial"
    os.close(persist.private(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC))
    try:
        yield temporary
        os.rename(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


def _write_torch(path: str, layout: Layout, skeleton: dict, stored: Callable[[Entry], torch.Tensor]) -> None:
    import torch

    from ftrun.snapshot.layout import to_plain

    with _replacing(path) as temporary, open(temporary, "wb") as f:
        try:
            torch.save(_torch_values(to_plain(layout, skeleton, stored)), f)
        except RuntimeError as err:  # its zip writer's, a full disk's ENOSPC included ("unexpected pos")
            raise OSError(str(err).strip().splitlines()[-1]) from None


def _torch_values(value: Any) -> Any:
    """``value`` with numpy arrays as tensors and numpy scalars as Python numbers (what weights_only loads)."""
    import numpy as np
    import torch

    if isinstance(value, np.ndarray):
        return torch.from_numpy(value)
    if isinstance(value, np.generic):
        return value.item()
    if type(value) in (dict, OrderedDict):
        out = type(value)((k, _torch_values(v)) for k, v in value.items())
        if hasattr(value, "_metadata"):
            out._metadata = value._metadata
        return out
    if type(value) in (list, tuple):
        return type(value)(map(_torch_values, value))
    return value


def _write_dcp(out: str, sources: list[str]) -> Iterator[str]:
    import torch.distributed.checkpoint as dcp

    from ftrun.snapshot.layout import RNG_KEY, to_plain

    before = set(os.listdir(out))
    with contextlib.ExitStack() as stack:
        ranks = []
        for source in sources:
            layout, skeleton, stored = stack.enter_context(_opened(source))
            plain = to_plain(layout, skeleton, stored, shards=True, copy=False)  # views of the mapped files
            plain.pop(RNG_KEY, None)
            ranks.append(plain)
        memory_writer = str(ranks[0].get("format", "")).startswith("ftrun.dcp/")
        state = _dcp_items(ranks) if memory_writer else _chunked(ranks)
        mask = os.umask(0o077)  # DCP writes its files with the process umask: 0600 as every ftrun file
        try:
            with warnings.catch_warnings():  # no_dist=True is what it says this process does
                warnings.filterwarnings("ignore", "torch.distributed is disabled, unavailable or uninitialized")
                dcp.save(state, checkpoint_id=out, planner=_chunk_planner(flatten=not memory_writer), no_dist=True)
            _check_dcp(out)
        except (OSError, RuntimeError, dcp.CheckpointException) as err:  # the last one is a BaseException
            free = _free_space(out)  # before the files are removed: a full disk says so
            for name in set(os.listdir(out)) - before:  # nothing half written stays
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(out, name))
            raise UsageError(f"cannot write {out}: {_write_error(err)} ({free})") from None
        finally:
            os.umask(mask)
            del state, ranks  # the views, before the files are unmapped
    for name in sorted(set(os.listdir(out)) - before):
        yield os.path.join(out, name)


def _check_dcp(out: str) -> None:
    """Raise OSError unless every file that DCP's metadata in ``out`` names holds the bytes it says (torch's zip
    writer can lose bytes to a full disk without an error)."""
    from torch.distributed.checkpoint import FileSystemReader

    ends: dict[str, int] = {}
    for info in FileSystemReader(out).read_metadata().storage_data.values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in ends.items():
        size = os.path.getsize(os.path.join(out, name))
        if size < end:
            raise OSError(f"{name} holds {size} bytes, its metadata says {end}")


def _write_error(err: BaseException) -> str:
    """What went wrong, in one line: the first rank's exception of a CheckpointException, else ``err``'s."""
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict) and failures:
        err = next(iter(failures.values()))[0]
    text = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
    line = (text.strip().splitlines() or [type(err).__name__])[-1]
    return "a write came up short (a full disk?)" if "unexpected pos" in line else line  # torch's zip writer


def _free_space(path: str) -> str:
    try:
        stat = os.statvfs(path)
    except OSError:
        return "free space unknown"
    return f"{stat.f_bavail * stat.f_frsize / 2**20:.1f} MiB free there"


@dataclass
class _Chunks:
    """A global tensor as the chunks the ranks hold: ``{offsets: local tensor}`` (a replicated one: one chunk)."""

    shape: tuple[int, ...]
    dtype: Any
    chunks: dict[tuple[int, ...], Any]

    def add(self, offsets: tuple[int, ...], local: Any, shape: tuple[int, ...]) -> None:
        if tuple(shape) != tuple(self.shape) or local.dtype != self.dtype:
            raise UsageError("the ranks' snapshots disagree on a DTensor's global shape or dtype: cannot export as "
                             "dcp")
        self.chunks.setdefault(tuple(offsets), local)


def _chunked(ranks: list[Any]) -> Any:
    """Rank 0's value, with every GlobalShard replaced by the :class:`_Chunks` of its shards on all ranks."""
    from ftrun.snapshot.layout import GlobalShard

    first = ranks[0]
    if isinstance(first, GlobalShard):
        whole = _Chunks(first.shape, first.local.dtype, {})
        for shard in ranks:
            if not isinstance(shard, GlobalShard):
                raise UsageError("the ranks' snapshots disagree on where a DTensor is: cannot export as dcp")
            whole.add(shard.offsets, shard.local, shard.shape)
        return whole
    if type(first) in (dict, OrderedDict):
        return type(first)((key, _chunked([r.get(key) if isinstance(r, dict) else None for r in ranks]))
                           for key in first)
    if type(first) in (list, tuple):
        return type(first)(_chunked([r[i] if isinstance(r, (list, tuple)) and i < len(r) else None
                                     for r in ranks]) for i in range(len(first)))
    return _torch_values(first)


def _dcp_items(ranks: list[Any]) -> dict[str, Any]:
    """A flat DCP state ``{fqn: value}`` of the ranks' ``ftrun.dcp`` snapshots: every rank's chunks of each tensor,
    every other value rank 0's."""
    import torch

    from ftrun.snapshot import dcp_items

    state: dict[str, Any] = {}
    for rank in ranks:  # in rank order: rank 0's object, and rank 0's chunk where ranks hold the same one, win
        for item in dcp_items.items(rank).values():
            if "t" not in item:
                state.setdefault(item["fqn"], _torch_values(item["obj"]))
                continue
            whole = state.setdefault(item["fqn"], _Chunks(tuple(item["size"]), getattr(torch, item["dtype"]), {}))
            whole.add(tuple(item["at"]), item["t"], tuple(item["size"]))
    return state


def _chunk_planner(flatten: bool) -> Any:
    """DCP's default save planner, writing each :class:`_Chunks` value as its chunks (DCP's own metadata of a
    sharded tensor, as if every rank had saved its shard), without assembling the global tensor."""
    import torch
    from torch.distributed.checkpoint import DefaultSavePlanner, SavePlan
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    def chunk(fqn: str, offsets: tuple[int, ...], local: Any, size: tuple[int, ...], kind: Any) -> Any:
        return WriteItem(index=MetadataIndex(fqn, offsets), type=kind, tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=local.shape),
            properties=TensorProperties.create_from_tensor(local), size=torch.Size(size)))

    class ChunkPlanner(DefaultSavePlanner):
        def create_local_plan(self) -> SavePlan:
            items = []
            for fqn, value in self.state_dict.items():
                if isinstance(value, _Chunks):
                    items += [chunk(fqn, at, t, value.shape, WriteItemType.SHARD) for at, t in value.chunks.items()]
                elif isinstance(value, torch.Tensor):
                    items.append(chunk(fqn, (0,) * value.dim(), value, tuple(value.shape), WriteItemType.TENSOR))
                else:
                    items.append(WriteItem(index=MetadataIndex(fqn), type=WriteItemType.BYTE_IO))
            self.plan = SavePlan(items, planner_data=self.mappings if self.flatten_state_dict else None)
            return self.plan

        def resolve_data(self, write_item: WriteItem) -> Any:
            value = self.state_dict[write_item.index.fqn]
            if isinstance(value, _Chunks):
                return value.chunks[tuple(write_item.index.offset)]
            return super().resolve_data(write_item)

    return ChunkPlanner(flatten_state_dict=flatten)


def _write_safetensors(path: str, layout: Layout, skeleton: dict, stored: Callable[[Entry], torch.Tensor],
                       metadata: dict[str, str]) -> None:
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    tensors = {}
    for entry in layout.entries:
        if entry.path in tensors:
            raise UsageError(f"two tensors at {entry.path} (a dict with keys k and str(k)): export with --format torch")
        tensors[entry.path] = stored(entry)
    metadata = {**metadata, "ftrun_skeleton": json.dumps(skeleton, separators=(",", ":")),
                "ftrun_layout": json.dumps(layout.to_json(), separators=(",", ":"))}
    with _replacing(path) as temporary:
        try:
            save_file(tensors, temporary, metadata=metadata)
        except KeyError as err:  # safetensors has no such dtype (complex128)
            raise UsageError(f"safetensors cannot hold {err.args[0]} tensors: export with --format torch") from None
        except SafetensorError as err:  # its I/O errors (a full disk) are not OSErrors
            raise OSError(str(err)) from None
