"""CPU and I/O priority of ftrun's background threads, so that they use only what the trainers leave idle.

Linux schedules threads, and ``sched_setscheduler``/``setpriority`` on a thread id set one thread's policy and
nice value. An unprivileged thread can lower its own priority but never raise it back, so each thread is lowered
once, for good, by the work it is made for:

* :func:`lower_to_background`: checksums of new snapshots, parity encoding and the peers' side of it,
  allocating slots ahead. :func:`lower_priority`: writing steps to disk (also in the idle I/O class).
  :func:`spawn_lowered`: a child process (the DCP copy), lowered from its first instruction.

Both run in the ``SCHED_IDLE`` policy: a thread in it weighs 3 against a default thread's 1024, so it runs
on cores that no other thread wants, and a thread that wakes preempts it at once. A nice value (10, 19) alone
is not enough: the scheduler lets a low-nice thread finish its turn before a woken trainer runs. Three
processes that compute 20 ms and sleep 70 ms, beside three loopback TCP streams of 8 MiB requests, took
1.27-1.40 times their CPU time with the streams at nice 10, 1.19-1.41 at nice 19, 1.04-1.14 in ``SCHED_IDLE``
and 1.02-1.05 with no streams, which moved 2.7-2.9 GB/s in ``SCHED_IDLE`` and 3.0 at nice 10
(``benchmarks/priority.py``, 3 runs, 2 cores, Linux 6.18). In jobs on that host, trainers that compute 20 ms
and then wait 70 ms (a GPU step) beside three keepers encoding: steps per second with parity over without 0.907
at nice 10, 0.944 in ``SCHED_IDLE`` (3 jobs each, the zygote's import left out); with the trainers using every
core both give the same pace (parity then waits for the trainers' ``save()`` either way). The nice values stay
as the fallback where the policy cannot be set.
"""

from __future__ import annotations

import os
import subprocess
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import psutil

PERSIST_NICE = 19
BACKGROUND_NICE = 10
_lowered = threading.local()


def lower_priority(nice: int = PERSIST_NICE, idle_io: bool = True) -> None:
    """Run the calling thread in ``SCHED_IDLE`` at nice value ``nice`` (and in the idle I/O class); best effort,
    once per thread."""
    if getattr(_lowered, "done", False):
        return
    _lowered.done = True
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, max(nice, os.getpriority(os.PRIO_PROCESS, tid)))
    except OSError:
        pass
    try:
        os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
    except OSError:
        pass
    if idle_io:
        try:
            psutil.Process(tid).ionice(psutil.IOPRIO_CLASS_IDLE)
        except (OSError, psutil.Error):
            pass


def lower_to_background() -> None:
    """:func:`lower_priority` for checksums and parity work (nice 10, I/O class unchanged)."""
    lower_priority(BACKGROUND_NICE, idle_io=False)


def spawn_lowered(argv: list[str], nice: int = PERSIST_NICE, idle_io: bool = True,
                  **popen: Any) -> subprocess.Popen[str]:
    """``subprocess.Popen(argv, **popen)`` run in ``SCHED_IDLE`` at ``nice`` (and in the idle I/O class) from its
    start: it is forked by a thread of its own lowered first, and a child inherits the forking thread's policy,
    nice value and I/O class (lowering it after ``Popen`` returned would race with the threads it starts)."""
    def spawn() -> subprocess.Popen[str]:
        lower_priority(nice, idle_io)
        return subprocess.Popen(argv, **popen)

    with ThreadPoolExecutor(1, thread_name_prefix="ftrun-spawn") as pool:  # its thread ends before this returns
        return pool.submit(spawn).result()
