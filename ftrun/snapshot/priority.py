"""CPU and I/O priority of the keeper's background threads, so that they use what the trainers leave idle.

Linux schedules threads, and ``setpriority(PRIO_PROCESS, tid)`` sets one thread's nice value. An unprivileged
thread can lower its own priority but never raise it back, so each thread is lowered once, for good, by the
work it is made for:

* :data:`PERSIST_NICE` (19, and the idle I/O class): writing steps to disk, which never holds trainers up.
* :data:`BACKGROUND_NICE` (10): checksums of new snapshots, parity encoding and the peers' side of it. A
  trainer that needs the CPU gets about nine tenths of a core it shares with them; when snapshots come faster
  than this lets parity follow, ``save()`` waits for a protected slot, and the background work then has the
  CPU to itself.
"""

from __future__ import annotations

import os
import threading

import psutil

PERSIST_NICE = 19
BACKGROUND_NICE = 10
_lowered = threading.local()


def lower_priority(nice: int = PERSIST_NICE, idle_io: bool = True) -> None:
    """Run the calling thread at nice value ``nice`` (and in the idle I/O class); best effort, once per thread."""
    if getattr(_lowered, "done", False):
        return
    _lowered.done = True
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, max(nice, os.getpriority(os.PRIO_PROCESS, tid)))
        if idle_io:
            psutil.Process(tid).ionice(psutil.IOPRIO_CLASS_IDLE)
    except (OSError, psutil.Error):
        pass


def lower_to_background() -> None:
    """:func:`lower_priority` for checksums and parity work (nice 10, I/O class unchanged)."""
    lower_priority(BACKGROUND_NICE, idle_io=False)
