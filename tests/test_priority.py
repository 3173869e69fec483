"""Background work runs in SCHED_IDLE, one thread at a time; what trainers run stays at the default priority."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

import pytest

from ftrun.snapshot.priority import lower_to_background, spawn_lowered

pytestmark = pytest.mark.timeout(60)


def _policy_and_nice(tid: int) -> tuple[int, int]:
    return os.sched_getscheduler(tid), os.getpriority(os.PRIO_PROCESS, tid)


def test_a_lowered_thread_runs_in_sched_idle_and_the_others_keep_their_priority():
    seen: list[tuple[int, int]] = []

    def work() -> None:
        lower_to_background()
        lower_to_background()  # once per thread: a second call changes nothing
        seen.append(_policy_and_nice(threading.get_native_id()))

    before = _policy_and_nice(threading.get_native_id())
    worker = threading.Thread(target=work)
    worker.start()
    worker.join()
    assert seen == [(os.SCHED_IDLE, max(10, before[1]))]
    assert _policy_and_nice(threading.get_native_id()) == before


def test_a_child_process_spawned_lowered_runs_in_sched_idle_from_its_start_and_so_do_its_threads():
    child = spawn_lowered([sys.executable, "-c", textwrap.dedent("""
        import os, threading
        first = os.sched_getscheduler(0), os.getpriority(os.PRIO_PROCESS, 0)
        out = []
        t = threading.Thread(target=lambda: out.append(os.sched_getscheduler(threading.get_native_id())))
        t.start(); t.join()
        print(*first, out[0])
        """)], idle_io=False, stdout=subprocess.PIPE, text=True)
    try:
        out, _ = child.communicate(timeout=30)
    finally:
        child.kill()
    assert out.split() == [str(os.SCHED_IDLE), "19", str(os.SCHED_IDLE)]
    assert os.sched_getscheduler(0) != os.SCHED_IDLE  # the caller keeps its priority
    with pytest.raises(FileNotFoundError):
        spawn_lowered(["/nonexistent/ftrun-test-binary"])
