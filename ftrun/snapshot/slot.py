"""Snapshot slots: one shared-memory file per (local rank, slot index), a header and the snapshot bytes.

File ``ftrun-<job>-node<N>-rank<L>-slot<I>`` in the shared-memory directory, mode 0600::

    [0, 4096)                      header (below), the rest of the page zero
    [4096, 4096 + data_len)        tensor bytes at the offsets of the layout (:mod:`ftrun.snapshot.layout`)
    [.., .. + meta_len)            JSON: the layout table and the skeleton of non-tensor values
    [.., file size)                spare capacity

    header: magic b"FTRUNSN1", version u32, state u32, step i64, generation i64, layout digest u64,
            data_len u64, meta_len u64, checksum u64, sealed u32, pad u32

States: EMPTY (never written, or discarded), WRITING (reserved by the keeper for a trainer's copy; a crash
leaves it so, and it is never loaded), COMMITTED (the trainer finished the copy and wrote every other field
first). ``sealed`` is set by the keeper once it has computed ``checksum`` of a committed slot; a committed
slot is loaded only after its checksum matches. The checksum is a CRC-32 (zlib's) over 64 MiB chunks, computed
by ISA-L in parallel threads (it releases the GIL), folded with the header fields: it covers bytes and identity.

Only this module knows the byte format; it works on raw memory and never imports torch.
"""

from __future__ import annotations

import mmap
import os
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Sequence
from dataclasses import dataclass, replace

from isal.isal_zlib import crc32

from ftrun.control.spec import open_shm_file

MAGIC = b"FTRUNSN1"
VERSION = 1
HEADER_SIZE = 4096
EMPTY, WRITING, COMMITTED = 0, 1, 2
STATE_NAMES = {EMPTY: "empty", WRITING: "writing", COMMITTED: "committed"}
SLOTS_PER_RANK = 2
SPARE_SLOT = 2  # a third slot, allocated only when persistence pins a slot a trainer would need
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux 5.14; Python 3.11 lacks the name
ALLOCATE_STEP = 8 << 20  # AheadAllocator's unit
RESTORED = -1  # the generation a keeper records for a slot loaded from disk or rebuilt: older than any
CHUNK = 64 << 20
CHECKSUM_THREADS = 4  # the most threads one checksum runs on
# Spare room a slot is allocated with beyond its payload: the JSON section varies by a few bytes between saves
# (python's RNG state alone), so a slot sized for one save fits the next ones.
META_HEADROOM = 64 << 10

_HEADER = struct.Struct("<8sIIqqQQQQII")
_STATE_OFFSET = 12
_SEAL = struct.Struct("<QI")
_SEAL_OFFSET = 56
_IDENTITY = struct.Struct("<qqQQQ")


@dataclass(frozen=True)
class Header:
    """The header fields of one slot."""

    state: int = EMPTY
    step: int = 0
    generation: int = 0
    digest: int = 0
    data_len: int = 0
    meta_len: int = 0
    checksum: int = 0
    sealed: bool = False
    magic: bytes = MAGIC
    version: int = VERSION

    @property
    def payload_len(self) -> int:
        return self.data_len + self.meta_len

    def describe(self) -> str:
        return f"{STATE_NAMES.get(self.state, self.state)} step {self.step} gen {self.generation}"


def slot_name(job: str, node: int | str, local_rank: int | str, index: int | str) -> str:
    return f"ftrun-{job}-node{node}-rank{local_rank}-slot{index}"


def slot_capacity(payload_len: int) -> int:
    """The capacity a slot is made with for a snapshot of ``payload_len`` bytes: :data:`META_HEADROOM` more."""
    return payload_len + META_HEADROOM


def checksum_threads() -> int:
    """The threads one :func:`checksum` runs on: :data:`CHECKSUM_THREADS`, or fewer if this process may use fewer
    cores."""
    return min(CHECKSUM_THREADS, len(os.sched_getaffinity(0)))


def checksum(buf: memoryview | mmap.mmap, header: Header, threads: int | None = None) -> int:
    """CRC-32 of the payload (in parallel 64 MiB chunks) folded with the header's identity fields."""
    view = memoryview(buf)[HEADER_SIZE:HEADER_SIZE + header.payload_len]
    starts = range(0, len(view), CHUNK)
    workers = threads or checksum_threads()
    if len(starts) > 1 and workers > 1:
        with ThreadPoolExecutor(workers) as pool:
            crcs = list(pool.map(lambda s: crc32(view[s:s + CHUNK]), starts))
    else:
        crcs = [crc32(view[s:s + CHUNK]) for s in starts]
    identity = _IDENTITY.pack(header.step, header.generation, header.digest, header.data_len, header.meta_len)
    view.release()
    return crc32(struct.pack(f"<{len(crcs)}I", *crcs), crc32(identity))


def _allocated(fd: int) -> bool:
    """Whether every page of the open file is allocated (tmpfs counts allocated pages in ``st_blocks``)."""
    stat = os.fstat(fd)
    return stat.st_blocks * 512 >= stat.st_size


class SlotFile:
    """One slot file mapped read-write. The keeper creates and owns it; trainers map it for copying."""

    def __init__(self, path: str, size: int | None = None, *, populate: bool = False, allocate: bool = True) -> None:
        """Map ``path``; with ``size``, create it (or grow it) with every page allocated up front.

        Allocation uses ``posix_fallocate``, so a full tmpfs is an ``OSError(ENOSPC)`` here, never a
        SIGBUS later; ``populate`` pre-faults the mapping (trainers about to copy the whole slot). With
        ``allocate=False`` only the header page is allocated: the caller allocates the rest with
        :meth:`allocate` before it touches it, and :attr:`allocated` says whether every page is.
        """
        fd = open_shm_file(path, os.O_RDWR | (os.O_CREAT if size is not None else 0))
        try:
            fresh = False
            if size is not None:
                os.fchmod(fd, 0o600)
                fresh = os.fstat(fd).st_size == 0
                if os.fstat(fd).st_size < size:
                    if allocate:
                        os.posix_fallocate(fd, 0, size)
                    else:
                        os.ftruncate(fd, size)
                        os.posix_fallocate(fd, 0, HEADER_SIZE)
            self.size = os.fstat(fd).st_size
            self.allocated = _allocated(fd)
            if self.size < HEADER_SIZE:
                raise ValueError(f"{path}: {self.size} bytes, smaller than a slot header")
            map_flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0)
            self.map = mmap.mmap(fd, self.size, flags=map_flags)
        finally:
            os.close(fd)
        self.path = path
        if fresh:
            _HEADER.pack_into(self.map, 0, MAGIC, VERSION, EMPTY, 0, 0, 0, 0, 0, 0, 0, 0)

    def allocate(self, offset: int, length: int) -> None:
        """Allocate the pages of bytes ``[offset, offset + length)`` (``offset`` a multiple of the page size) and
        map them into this mapping: ``OSError(ENOSPC)`` when the shared-memory directory is full, never a SIGBUS."""
        fd = open_shm_file(self.path, os.O_RDWR)
        try:
            os.posix_fallocate(fd, offset, length)
            self.allocated = _allocated(fd)
        finally:
            os.close(fd)
        try:
            self.map.madvise(MADV_POPULATE_WRITE, offset, length)  # page tables in one go, not a fault per page
        except (OSError, ValueError):
            pass  # a kernel without it: the pages are faulted in as they are written

    @property
    def capacity(self) -> int:
        return self.size - HEADER_SIZE

    def header(self) -> Header:
        magic, version, state, step, gen, digest, data_len, meta_len, crc, sealed, _ = \
            _HEADER.unpack_from(self.map, 0)
        return Header(state, step, gen, digest, data_len, meta_len, crc, bool(sealed), magic, version)

    def problem(self) -> str | None:
        """Why this slot cannot hold a loadable snapshot by its header alone, or None."""
        h = self.header()
        if h.magic != MAGIC or h.version != VERSION:
            return f"bad magic/version {h.magic!r}/{h.version}"
        if h.state != COMMITTED:
            return f"state {STATE_NAMES.get(h.state, h.state)}"
        if h.payload_len > self.capacity:
            return f"length {h.payload_len} beyond capacity {self.capacity}"
        return None

    def set_state(self, state: int) -> None:
        struct.pack_into("<I", self.map, _STATE_OFFSET, state)

    def commit(self, header: Header) -> None:
        """Write every field, then the state COMMITTED last (x86 keeps stores in order)."""
        fields = replace(header, state=WRITING, sealed=False, checksum=0)
        _HEADER.pack_into(self.map, 0, fields.magic, fields.version, WRITING, fields.step, fields.generation,
                          fields.digest, fields.data_len, fields.meta_len, 0, 0, 0)
        self.set_state(COMMITTED)

    def seal(self, crc: int) -> None:
        _SEAL.pack_into(self.map, _SEAL_OFFSET, crc, 1)

    def verify(self) -> str | None:
        """None when the slot is committed and its checksum matches (sealing it first if it was not)."""
        problem = self.problem()
        if problem is not None:
            return problem
        h = self.header()
        return self.judge(h, checksum(self.map, h))

    def judge(self, read: Header, crc: int) -> str | None:
        """Judge ``crc``, computed over the payload that header ``read`` (read before) described: None when it
        matches the seal, sealing the slot with it first if it was not sealed; a problem when it does not, or when
        the header changed meanwhile (not by a seal: the sealer writes it beside bytes it does not change)."""
        now = self.header()
        if replace(now, checksum=0, sealed=False) != replace(read, checksum=0, sealed=False):
            return "changed while it was verified"
        if not now.sealed:
            self.seal(crc)
            return None
        return None if crc == now.checksum else f"checksum mismatch (stored {now.checksum:08x}, computed {crc:08x})"

    def payload(self) -> memoryview:
        return memoryview(self.map)[HEADER_SIZE:]

    def close(self) -> None:
        try:
            self.map.close()
        except BufferError:  # a view is still exported (a trainer's tensor); the mapping goes with the process
            pass


class AheadAllocator:
    """Allocates and maps the pages of slot files (made with ``allocate=False``) in order, in a thread of its
    own, ahead of a writer that fills them: allocating /dev/shm pages costs about as much as receiving their
    bytes over TCP, and this way the two overlap.

    ``files``: (file, bytes of it the writer fills from its start), in the order it fills them; positions count
    those bytes end to end. Each file is allocated whole (what follows its bytes too), :data:`ALLOCATE_STEP`
    at a time. Invariant: a writer touches a byte only after :meth:`ready` for a position past it returned.
    """

    def __init__(self, files: Sequence[tuple[SlotFile, int]]) -> None:
        self.files = list(files)
        self.total = sum(length for _, length in self.files)
        self.waited = 0.0  # seconds spent in ready()
        self._prepared = 0
        self._failure: Exception | None = None
        self._done = self._stopping = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="ftrun-allocate-ahead", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        begin = 0
        try:
            for file, length in self.files:
                for offset in range(0, file.size, ALLOCATE_STEP):
                    if self._stopping:
                        return
                    file.allocate(offset, min(ALLOCATE_STEP, file.size - offset))
                    with self._cond:
                        self._prepared = begin + min(offset + ALLOCATE_STEP, length)
                        self._cond.notify_all()
                begin += length
        except Exception as err:  # noqa: BLE001 - whatever it is, the writer must not write past what is allocated
            self._failure = err
        finally:
            with self._cond:
                self._done = True
                self._cond.notify_all()

    @property
    def allocated(self) -> int:
        """Positions ``[0, allocated)`` may be written now."""
        return self._prepared

    def ready(self, end: int) -> None:
        """Wait until positions ``[0, end)`` may be written (``end`` = :attr:`total`: every file is allocated
        whole); re-raises the error that stopped the allocation short of ``end`` (``OSError`` ENOSPC: the directory is
        full)."""
        t0 = time.perf_counter()
        with self._cond:
            self._cond.wait_for(lambda: self._done or self._covers(end))
        self.waited += time.perf_counter() - t0
        if self._failure is not None and not self._covers(end):
            raise self._failure

    def _covers(self, end: int) -> bool:
        return self._prepared >= end and end < self.total

    def stop(self) -> None:
        """Stop allocating (what is allocated stays); returns once the thread has ended."""
        self._stopping = True
        self._thread.join()
