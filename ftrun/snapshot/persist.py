"""The durable tier: committed snapshots written to a checkpoint directory, one directory per step.

Layout of ``<ckpt-dir>`` (every file is created with mode 0600, every directory 0700). Each job has its own
directory, named by its job id (``--rdzv-id``), so jobs that share a ``--ckpt-dir`` never write, prune or
resume each other's steps::

    <ckpt-dir>/<job>/                the job's directory (:func:`job_dir`); below it, ``<dir>`` for short
    <dir>/.owner                    the run that holds it while it runs (:mod:`ftrun.snapshot.dir_owner`)
    <dir>/step-00000030/             a complete step, renamed atomically from <dir>/.step-00000030.partial/
        manifest.json               {"format": 1, "job": "<job id>", "step": 30, "world": 4, "nnodes": 2,
                                     "nproc_per_node": 2, "time": <unix seconds>,
                                     "ranks": {"0": {"file": "rank-00000.snap", "bytes": <file size>,
                                                     "checksum": <slot header checksum>,
                                                     "digest": <layout digest>}, ...}}
        rank-00000.snap             the slot image of global rank 0: exactly the first HEADER_SIZE + payload_len
        rank-00001.snap ...         bytes of its keeper's slot file (header, tensor data, JSON meta; see
                                    :mod:`ftrun.snapshot.slot` and :mod:`ftrun.snapshot.layout`)
        dcp/                        with --ckpt-format dcp: the step as a torch.distributed.checkpoint, added by
                                    node 0 once the step is complete (:mod:`ftrun.snapshot.dcp_copy`)

Invariants:

* ``step-N`` (N zero-padded to 8 digits) with a readable manifest is complete: every rank file was fsynced
  before the manifest was written, the manifest and its directory before the rename, the rename before the
  parent's fsync. A step is deleted by renaming it back to its partial name first: no reader sees half of one.
* A rank file verifies itself: its header is sealed (committed, with the CRC-32 of
  :func:`ftrun.snapshot.slot.checksum` over the payload and the header's identity), and the manifest repeats
  its size, checksum and layout digest. Nothing that fails either check is loaded.

Bytes only, never torch (the keeper uses this module); :mod:`ftrun.snapshot.export` reads steps with torch.
"""

from __future__ import annotations

import contextlib
import errno
import json
import mmap
import os
import re
import shutil
import stat
import time
from typing import BinaryIO

from ftrun.control.spec import safe_job_id
from ftrun.snapshot.slot import CHUNK, EMPTY, HEADER_SIZE, SlotFile

FORMAT = 1
MANIFEST = "manifest.json"
MAX_MANIFEST_BYTES = 64 << 20  # about 400,000 ranks; a larger manifest.json is not one finalize() wrote
MAX_TIME = 1e11  # seconds since the epoch (year 5138): a manifest's time beyond it is not one
_COMPLETE = re.compile(r"step-(\d{8,})")
_PARTIAL = re.compile(r"\.step-(\d{8,})\.partial")


class CorruptStep(ValueError):
    """A rank file of a step is missing or fails verification; the one-line message says which and why."""


def job_dir(ckpt_dir: str, job: str) -> str:
    """The directory of ``job``'s steps in ``ckpt_dir`` (absolute)."""
    return os.path.join(os.path.abspath(ckpt_dir), safe_job_id(job))


def job_dirs(ckpt_dir: str) -> list[str]:
    """The job directories in ``ckpt_dir`` (those holding step directories), sorted; ``[ckpt_dir]`` itself when
    it holds steps (a job's own directory)."""
    if step_dirs(ckpt_dir) or step_dirs(ckpt_dir, partial=True):
        return [ckpt_dir]
    try:
        with os.scandir(ckpt_dir) as found:
            subdirs = sorted(e.path for e in found if _is_dir(e) and not e.name.startswith("."))
    except (FileNotFoundError, NotADirectoryError):
        return []
    return [d for d in subdirs if step_dirs(d) or step_dirs(d, partial=True)]


def step_name(step: int) -> str:
    return f"step-{step:08d}"


def partial_dir(root: str, step: int) -> str:
    return os.path.join(root, f".{step_name(step)}.partial")


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.snap"


def private(path: str, flags: int) -> int:
    """An ``opener`` for :func:`open` that creates files with mode 0600."""
    return os.open(path, flags, 0o600)


def mkdir_private(path: str) -> None:
    """Create ``path`` and its missing parents, each with mode 0700."""
    if not os.path.isdir(path):
        mkdir_private(os.path.dirname(os.path.abspath(path)))
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o700)


def open_image(path: str) -> SlotFile:
    """A rank file mapped copy-on-write as a :class:`SlotFile`: needs read permission only, never writes it."""
    with open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        if size < HEADER_SIZE:
            raise CorruptStep(f"{path}: {size} bytes, smaller than a slot header")
        image = SlotFile.__new__(SlotFile)  # SlotFile() maps read-write
        image.map = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
    image.size, image.path = size, path
    return image


def write_rank(directory: str, rank: int, slot: SlotFile) -> dict[str, int | str]:
    """Write the committed, sealed ``slot``'s image to ``directory/rank-R.snap`` (fsynced); returns its manifest
    entry ``{"file", "bytes", "checksum", "digest"}``. Creates ``directory`` (0700) if missing.

    The caller keeps the slot from being rewritten meanwhile (a header that changed is a ValueError). OSError
    (ENOSPC, EACCES...) propagates, naming the rank file. On any failure the rank file is removed.
    """
    header = slot.header()
    problem = slot.problem() or (None if header.sealed else "not sealed")
    if problem is not None:
        raise ValueError(f"cannot persist {slot.path}: {problem}")
    mkdir_private(directory)
    path, size, done = os.path.join(directory, rank_file(rank)), HEADER_SIZE + header.payload_len, 0
    try:
        with open(path, "wb", buffering=0, opener=private) as out, open(slot.path, "rb") as src:
            try:
                while done < size:
                    sent = os.sendfile(out.fileno(), src.fileno(), done, min(size - done, CHUNK))
                    if not sent:
                        raise OSError(errno.EIO, f"{slot.path}: shorter than its header says")
                    done += sent
            except OSError as err:  # a filesystem without sendfile: write() from the mapping
                if err.errno not in (errno.EINVAL, errno.ENOSYS):
                    raise
            with memoryview(slot.map) as view:
                while done < size:
                    done += out.write(view[done:min(size, done + CHUNK)])
            os.fsync(out.fileno())
        if slot.header() != header:
            raise ValueError(f"{slot.path} was rewritten while it was persisted")
    except BaseException as err:
        with contextlib.suppress(OSError):
            os.unlink(path)
        if isinstance(err, OSError) and err.filename is None:  # from a write or fsync: name the file
            raise OSError(err.errno, err.strerror, path) from err
        raise
    return {"file": rank_file(rank), "bytes": size, "checksum": header.checksum, "digest": header.digest}


def finalize(root: str, step: int, job: str, nnodes: int, nproc_per_node: int, entries: dict[int, dict]) -> str:
    """Write the manifest of the ranks' ``entries`` (from :func:`write_rank`) into the partial directory and
    rename it to the complete step, durably (see the module docstring); returns the final path.

    A complete step N already there (an earlier run's: this one resumed from an older step) is renamed to
    :func:`replaced_dir` only once the new manifest is on disk, and put back if the last rename fails: a full or
    read-only disk never leaves step N without a complete copy (a kill between the two renames is repaired by
    :func:`put_back_replaced`). The caller removes the replaced copy.

    ValueError if ``entries`` are not exactly ranks 0..world-1.
    """
    world = nnodes * nproc_per_node
    if sorted(entries) != list(range(world)):
        raise ValueError(f"step {step}: entries for ranks {sorted(entries)}, expected 0..{world - 1}")
    doc = {"format": FORMAT, "job": job, "step": step, "world": world, "nnodes": nnodes,
           "nproc_per_node": nproc_per_node, "time": time.time(), "ranks": {str(r): entries[r] for r in range(world)}}
    partial, final = partial_dir(root, step), os.path.join(root, step_name(step))
    with open(os.path.join(partial, MANIFEST), "w", opener=private) as f:
        f.write(json.dumps(doc, indent=1))
        f.flush()
        os.fsync(f.fileno())
    _fsync(partial)
    if os.path.lexists(final) and not os.path.isdir(final):  # ftrun's own steps are directories: never touched
        raise OSError(errno.EEXIST, "not a step directory, in the way (move it away)", final)
    if os.path.isdir(final):
        shutil.rmtree(replaced_dir(root, step), ignore_errors=True)  # a stale one, left beside a complete step
        os.rename(final, replaced_dir(root, step))
    try:
        os.rename(partial, final)
    except OSError:
        put_back_replaced(root)
        raise
    _fsync(root)
    return final


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def steps_text(steps: list[int]) -> str:
    """Sorted steps for a console line: all of a few, else how many and their range (events keep them all)."""
    return f"steps {steps}" if len(steps) <= 8 else f"{len(steps)} steps, {steps[0]} to {steps[-1]}"


def step_dirs(root: str, partial: bool = False) -> list[int]:
    """Steps of the directories in ``root`` named as complete (or partial) steps, whatever they hold; sorted."""
    pattern = _PARTIAL if partial else _COMPLETE
    try:
        with os.scandir(root) as found:
            return sorted(int(m[1]) for e in found if (m := pattern.fullmatch(e.name)) and _is_dir(e))
    except (FileNotFoundError, NotADirectoryError):
        return []


def _is_dir(entry: os.DirEntry) -> bool:
    """Whether ``entry`` is a directory or a link to one; not a link that cannot be followed (a loop: ELOOP)."""
    try:
        return entry.is_dir()
    except OSError:
        return False


def manifest(root: str, step: int) -> dict:
    """The manifest of complete ``step``; ValueError (naming the file) when it is not one :func:`finalize` wrote."""
    path = os.path.join(root, step_name(step), MANIFEST)
    with open_regular(path) as f:
        raw = f.read(MAX_MANIFEST_BYTES + 1)
    try:
        doc = json.loads(raw)
        world, ranks, made = doc["world"], doc["ranks"], doc["time"]
        ok = (doc["format"], doc["step"], type(doc["job"]), type(world)) == (FORMAT, step, str, int)
        ok = ok and len(raw) <= MAX_MANIFEST_BYTES and type(ranks) is dict and 0 < world == len(ranks)
        ok = ok and type(made) in (int, float) and 0 <= made < MAX_TIME  # a time.time(): not NaN, not 1e300
        ok = ok and sorted(ranks) == sorted(map(str, range(world))) and all(
            e["file"] == rank_file(r) and all(type(e[k]) is int for k in ("bytes", "checksum", "digest"))
            and e["bytes"] >= HEADER_SIZE for r, e in ((r, ranks[str(r)]) for r in range(world)))
    except (ValueError, KeyError, TypeError, RecursionError):  # RecursionError: JSON nested too deep
        ok = False
    if not ok or not world:
        raise ValueError(f"{path}: not an ftrun format-{FORMAT} manifest of step {step}")
    return doc


def open_regular(path: str) -> BinaryIO:
    """``path`` opened for reading if it is a regular file; else OSError: a FIFO planted in a step (or a device)
    would block the reader forever."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", path)
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def complete_steps(root: str, job: str | None = None) -> list[int]:
    """Steps with a complete directory and a readable manifest (of ``job`` when given), oldest first."""
    steps = []
    for step in step_dirs(root):
        with contextlib.suppress(OSError, ValueError):
            if manifest(root, step)["job"] == job or job is None:
                steps.append(step)
    return steps


def move_aside(root: str, paths: list[str], into: str = "") -> str:
    """Move step directories of ``root`` into ``into``, default a new ``<root>/previous-<time>/`` (created 0700),
    under their step names (``step-00000030``, whatever suffix they had): kept, but never resumed from. Returns
    that directory."""
    aside = into or os.path.join(root, time.strftime("previous-%Y%m%d-%H%M%S"))
    os.makedirs(aside, mode=0o700, exist_ok=True)
    for path in paths:
        name = _COMPLETE.search(os.path.basename(path))
        os.rename(path, os.path.join(aside, name.group(0) if name else os.path.basename(path)))
    return aside


def remove_partial(root: str, step: int) -> None:
    """Best effort: a partial step that cannot be removed (the disk went read-only) is never loaded, and is
    removed or replaced by a later round."""
    with contextlib.suppress(OSError):
        shutil.rmtree(partial_dir(root, step))


def replaced_dir(root: str, step: int) -> str:
    """Where a complete step waits while the same step is persisted again (see :func:`put_back_replaced`)."""
    return os.path.join(root, step_name(step)) + ".replaced"


def put_back_replaced(root: str) -> list[int]:
    """Rename every ``step-N.replaced`` whose ``step-N`` is missing back to ``step-N``: it is a complete step that
    a failed (or killed) second persist of step N moved aside; without this it would be lost to resume. Returns
    those steps; best effort (a read-only disk keeps them for the next run)."""
    try:
        with os.scandir(root) as found:
            names = [e.name for e in found if e.name.endswith(".replaced") and _is_dir(e)]
    except OSError:
        return []
    restored = []
    for name in names:
        complete = _COMPLETE.fullmatch(name.removesuffix(".replaced"))
        if complete and not os.path.exists(os.path.join(root, complete.group(0))):
            with contextlib.suppress(OSError):
                os.rename(os.path.join(root, name), os.path.join(root, complete.group(0)))
                restored.append(int(complete.group(1)))
    return sorted(restored)


def set_aside_other_worlds(root: str, persisted: int, job: str, world: int,
                           spare: frozenset[int] = frozenset(), into: str = "") -> tuple[str, list[int]]:
    """Move the complete steps of ``job`` up to ``persisted`` that an earlier run wrote at another world size (but
    those in ``spare``) into ``into`` or a new ``<root>/previous-<time>/``: this run cannot resume from them, and
    pruning would delete the other world's newest state, which a run at that world size resumes from (move it
    back). So they never count toward ``--keep``. Returns that directory ("" when none) and the steps moved."""
    other = []
    for step in complete_steps(root, job):
        if step <= persisted and step not in spare:
            with contextlib.suppress(OSError, ValueError):
                if manifest(root, step)["world"] != world:
                    other.append(step)
    if not other:
        return "", []
    return move_aside(root, [os.path.join(root, step_name(step)) for step in other], into), other


def prune(root: str, keep: int, persisted: int, job: str | None = None,
          spare: frozenset[int] = frozenset()) -> list[int]:
    """After step ``persisted`` was finalized: delete the complete steps (of ``job`` when given) up to it beyond
    the newest ``keep`` of them (never ``persisted`` itself, nor a step in ``spare``) and every partial directory
    of an older step; returns the steps deleted, oldest first. Steps newer than ``persisted`` are left alone and
    not counted: they are not this run's (one it could not resume from, a step that failed its checks, another
    run's), and counting them deleted the step just written. A step that vanishes meanwhile (another process
    pruned it) is skipped."""
    complete = [step for step in complete_steps(root, job) if step <= persisted]
    doomed = [step for step in complete[:-max(keep, 1)] if step not in spare]
    for step in doomed:
        remove_partial(root, step)
        with contextlib.suppress(FileNotFoundError):
            os.rename(os.path.join(root, step_name(step)), partial_dir(root, step))
        remove_partial(root, step)
    stale = [step for step in step_dirs(root, partial=True) if step < persisted]
    for step in stale:
        remove_partial(root, step)
    return sorted(set(doomed) | set(stale))


def _problem(slot: SlotFile, step: int, entry: dict, size: int) -> str | None:
    """Why ``slot``, holding the ``size`` bytes of a rank file, is not ``step``'s manifest ``entry``, or None."""
    header = slot.header()
    problem = slot.problem() or (None if header.sealed else "not sealed")
    if problem is None and not size == HEADER_SIZE + header.payload_len == entry["bytes"]:
        problem = f"{size} bytes; its header says {HEADER_SIZE + header.payload_len}, the manifest {entry['bytes']}"
    if problem is None and (header.step, header.checksum, header.digest) != (step, entry["checksum"], entry["digest"]):
        problem = f"header of step {header.step} does not match the manifest of step {step}"
    return problem or slot.verify()


def _rank_entry(root: str, step: int, rank: int) -> tuple[str, dict]:
    """The path of ``rank``'s file of complete ``step`` and its manifest entry; CorruptStep if it has none."""
    entry = manifest(root, step)["ranks"].get(str(rank))
    if entry is None:
        raise CorruptStep(f"step {step} has no rank {rank}")
    return os.path.join(root, step_name(step), entry["file"]), entry


def image_size(root: str, step: int, rank: int) -> int:
    """The bytes of ``rank``'s file of complete ``step`` (the slot to load it into is sized by them), as its
    manifest records them; CorruptStep when the file has another size (a disk that garbled it, even to a sparse
    terabyte, makes a step that does not load, not a slot that does not fit)."""
    path, entry = _rank_entry(root, step, rank)
    size = os.stat(path).st_size
    if size != entry["bytes"]:
        raise CorruptStep(f"{path}: {size} bytes, the manifest says {entry['bytes']}")
    return size


def load_rank(root: str, step: int, rank: int, slot: SlotFile) -> None:
    """Copy ``rank``'s file of complete ``step`` into ``slot`` and verify it there (checksum, step, manifest).

    The slot is EMPTY while the bytes arrive and stays so unless they verify, else CorruptStep says why.
    ValueError if the slot is too small; OSError reading the file propagates.
    """
    path, entry = _rank_entry(root, step, rank)
    slot.set_state(EMPTY)
    try:
        with open_regular(path) as f, memoryview(slot.map) as view:
            size = os.fstat(f.fileno()).st_size
            if size != entry["bytes"]:  # before reading: a file cut short (or replaced) reads as a bad header
                raise CorruptStep(f"{path}: {size} bytes, the manifest says {entry['bytes']}")
            if size > slot.size:
                raise ValueError(f"{path}: {size} bytes do not fit in {slot.path} ({slot.size} bytes)")
            for at in [*range(HEADER_SIZE, size, CHUNK), 0]:  # the header last: committed once complete
                end = min(size, at + CHUNK) if at else HEADER_SIZE
                if os.preadv(f.fileno(), [view[at:end]], at) != end - at:
                    raise CorruptStep(f"{path}: changed while it was read")
        problem = _problem(slot, step, entry, size)
        if problem is not None:
            raise CorruptStep(f"{path}: {problem}")
    except BaseException:
        slot.set_state(EMPTY)
        raise


def verify_step(root: str, step: int) -> dict[int, str | None]:
    """Each rank of complete ``step`` mapped to why its file fails verification, or None (reads every byte)."""
    result: dict[int, str | None] = {}
    for key, entry in manifest(root, step)["ranks"].items():
        try:
            image = open_image(os.path.join(root, step_name(step), entry["file"]))
            try:
                result[int(key)] = _problem(image, step, entry, image.size)
            finally:
                image.close()
        except (OSError, CorruptStep) as err:
            result[int(key)] = str(err)
    return result
