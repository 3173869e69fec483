"""A hot spare's reserve: the /dev/shm pages of the slots it would rebuild, allocated while it waits.

A replacement's rebuild writes its node's snapshots into new slot files whose pages must be allocated first,
which costs about as much as receiving the bytes (:mod:`benchmarks.erasure`: a TCP copy into new /dev/shm
memory takes 1.2-2.6 x as long as one into allocated memory), and a replacement's keeper starts allocating
(``prepare``) only a fraction of a second before its rebuild. A spare has nothing else to do: once it knows
how large the job's snapshots are (the spare reads the nodes' status), it allocates one file per local rank,
``ftrun-<job>-reserve-<spare>-rank<L>`` (mode 0600), each the size of slot 0 of the largest rank of that local
index in the job with the trainers' headroom, in a thread of its own (:class:`AheadAllocator`). When it
claims node N it links them to the names of slot 0 of N's ranks (never over a file there) before N's keeper
starts, which adopts them as empty slots: the rebuild, a load from disk or the first snapshot writes into
pages allocated before.

Room: the reserve grows only while the shared-memory directory has twice what it adds free, and is given
back whole when less than half of its size is left free: it never holds memory that the job's nodes on the
same host (local mode) are about to need.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Sequence

from ftrun.control.spec import safe_job_id, shm_dir
from ftrun.snapshot.keeper import free_bytes
from ftrun.snapshot.slot import AheadAllocator, SlotFile, slot_name


def reserve_path(job: str, spare: str, local: int) -> str:
    return os.path.join(shm_dir(), f"ftrun-{safe_job_id(job)}-reserve-{safe_job_id(spare)}-rank{local}")


def unlink_reserves(job: str) -> None:
    """Unlink every spare's reserve of ``job`` (what a killed spare left)."""
    for path in glob.glob(os.path.join(shm_dir(), f"ftrun-{safe_job_id(job)}-reserve-*")):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


class SlotReserve:
    """One spare's reserve; see the module doc. Used by the spare's thread only; :meth:`hand_over` or
    :meth:`release` ends it."""

    def __init__(self, job: str, spare: str, nproc: int) -> None:
        self.job = job
        self.paths = [reserve_path(job, spare, local) for local in range(nproc)]
        self.sizes = [0] * nproc  # bytes of each file
        self._allocator: AheadAllocator | None = None
        self._files: list[SlotFile] = []

    @property
    def allocated(self) -> int:
        """Bytes of the reserve allocated so far."""
        return self._allocator.allocated if self._allocator is not None else 0

    def want(self, sizes: Sequence[int]) -> bool:
        """Grow the files to ``sizes`` bytes (one per local rank; a file never shrinks) when there is room, and
        start allocating them; give the reserve back when room runs short. True when it began to grow."""
        free = free_bytes(shm_dir())
        if self._allocator is not None and free < sum(self.sizes) // 2:
            self.release()
            return False
        wanted = [max(have, want) for have, want in zip(self.sizes, sizes)]
        grow = sum(wanted) - sum(self.sizes)
        if grow <= 0 or free < 2 * grow:
            return False
        self._stop()
        try:
            self._files = [SlotFile(path, size, allocate=False) for path, size in zip(self.paths, wanted) if size]
        except OSError:
            self.release()
            return False
        self.sizes = wanted
        self._allocator = AheadAllocator([(file, file.size) for file in self._files])
        return True

    def hand_over(self, node: int) -> int:
        """The reserve becomes slot 0 of ``node``'s ranks where that slot has no file yet; bytes allocated
        handed over (what was not handed is unlinked)."""
        self._stop()
        handed = 0
        for local, path in enumerate(self.paths):
            if not os.path.exists(path):
                continue
            try:
                os.link(path, os.path.join(shm_dir(), slot_name(safe_job_id(self.job), node, local, 0)))
                handed += os.stat(path).st_blocks * 512
            except FileExistsError:
                pass
            os.unlink(path)
        self.sizes = [0] * len(self.paths)
        return handed

    def release(self) -> None:
        """Give the reserve back: the files unlinked."""
        self._stop()
        for path in self.paths:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        self.sizes = [0] * len(self.paths)

    def _stop(self) -> None:
        if self._allocator is not None:
            self._allocator.stop()
            self._allocator = None
        for file in self._files:
            file.close()
        self._files = []
