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
slot is loaded only after its checksum matches. The checksum is a CRC-32 over 64 MiB chunks (computed in
parallel threads: zlib releases the GIL) folded with the header fields, so it covers bytes and identity.

Only this module knows the byte format; it works on raw memory and never imports torch.
"""

from __future__ import annotations

import mmap
import os
import struct
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

MAGIC = b"FTRUNSN1"
VERSION = 1
HEADER_SIZE = 4096
EMPTY, WRITING, COMMITTED = 0, 1, 2
STATE_NAMES = {EMPTY: "empty", WRITING: "writing", COMMITTED: "committed"}
SLOTS_PER_RANK = 2
SPARE_SLOT = 2  # a third slot, allocated only when persistence pins a slot a trainer would need
RESTORED = -1  # the generation a keeper records for a slot loaded from disk or rebuilt: older than any
CHUNK = 64 << 20
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


def checksum(buf: memoryview | mmap.mmap, header: Header, threads: int | None = None) -> int:
    """CRC-32 of the payload (in parallel 64 MiB chunks) folded with the header's identity fields."""
    view = memoryview(buf)[HEADER_SIZE:HEADER_SIZE + header.payload_len]
    starts = range(0, len(view), CHUNK)
    workers = threads or min(4, os.cpu_count() or 1)
    if len(starts) > 1 and workers > 1:
        with ThreadPoolExecutor(workers) as pool:
            crcs = list(pool.map(lambda s: zlib.crc32(view[s:s + CHUNK]), starts))
    else:
        crcs = [zlib.crc32(view[s:s + CHUNK]) for s in starts]
    identity = _IDENTITY.pack(header.step, header.generation, header.digest, header.data_len, header.meta_len)
    view.release()
    return zlib.crc32(struct.pack(f"<{len(crcs)}I", *crcs), zlib.crc32(identity))


class SlotFile:
    """One slot file mapped read-write. The keeper creates and owns it; trainers map it for copying."""

    def __init__(self, path: str, size: int | None = None, *, populate: bool = False) -> None:
        """Map ``path``; with ``size``, create it (or grow it) with every page allocated up front.

        Allocation uses ``posix_fallocate``, so a full tmpfs is an ``OSError(ENOSPC)`` here, never a
        SIGBUS later; ``populate`` pre-faults the mapping (trainers about to copy the whole slot).
        """
        flags = os.O_RDWR | (os.O_CREAT if size is not None else 0)
        fd = os.open(path, flags, 0o600)
        try:
            fresh = False
            if size is not None:
                os.fchmod(fd, 0o600)
                fresh = os.fstat(fd).st_size == 0
                if os.fstat(fd).st_size < size:
                    os.posix_fallocate(fd, 0, size)
            self.size = os.fstat(fd).st_size
            if self.size < HEADER_SIZE:
                raise ValueError(f"{path}: {self.size} bytes, smaller than a slot header")
            map_flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0)
            self.map = mmap.mmap(fd, self.size, flags=map_flags)
        finally:
            os.close(fd)
        self.path = path
        if fresh:
            _HEADER.pack_into(self.map, 0, MAGIC, VERSION, EMPTY, 0, 0, 0, 0, 0, 0, 0, 0)

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
        crc = checksum(self.map, h)
        if not h.sealed:
            self.seal(crc)
        elif crc != h.checksum:
            return f"checksum mismatch (stored {h.checksum:08x}, computed {crc:08x})"
        return None

    def payload(self) -> memoryview:
        return memoryview(self.map)[HEADER_SIZE:]

    def close(self) -> None:
        try:
            self.map.close()
        except BufferError:  # a view is still exported (a trainer's tensor); the mapping goes with the process
            pass
