"""The keeper's heap: keep the large blocks that pyeclib allocates and frees on every call inside the process.

pyeclib takes and returns ``bytes``: every call allocates fragments the size of what it codes and frees them.
glibc serves large blocks with ``mmap`` and returns them with ``munmap``, and gives every thread but the main
one an arena of at most 64 MiB that it unmaps once empty. With whole 8 MiB pieces each call faulted in fresh
zeroed pages, which took 3 to 6 times as long as the coding: 25 ms against 4 to 8 ms per piece of k = 4, m = 2
(measured; :mod:`benchmarks.erasure`'s rebuild of two lost nodes went from 1.8 to 0.8 s for 256 MiB). The
codec now codes parts of 128 KiB (:data:`ftrun.snapshot.erasure.CODE_PART`), and the setting still pays:
k = 4, m = 2, 256 MiB, codec alone, 1.87 against 1.43 GB/s encoding, 0.34 against 0.49 s rebuilding.

:func:`reuse_large_blocks` makes glibc keep them: one arena for every thread, blocks up to :data:`LARGEST_KEPT`
from the heap, and up to :data:`TRIM_ABOVE` of freed memory kept. What the keeper holds longer is therefore
the peak of its coding buffers, not its snapshots, which live in /dev/shm files.
"""

from __future__ import annotations

import ctypes

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
LARGEST_KEPT = 32 << 20  # glibc's ceiling for the mmap threshold on 64-bit
TRIM_ABOVE = 512 << 20


def reuse_large_blocks() -> bool:
    """Set the process's allocator as described above; call it before the process starts threads (an arena is
    made for a thread on its first allocation). False where the C library has no ``mallopt`` (not glibc)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return all(mallopt(param, value) == 1 for param, value in
               ((M_ARENA_MAX, 1), (M_MMAP_THRESHOLD, LARGEST_KEPT), (M_TRIM_THRESHOLD, TRIM_ABOVE)))
