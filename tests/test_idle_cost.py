"""What ftrun's own processes cost while nothing fails: they wait for events, they do not poll many times a second.

Each test counts how often a process's main thread went to sleep (its voluntary context switches) while the
trainers run, against the looks a poll every ``interval`` would take over the same window: a ratio, not a time.
"""

from __future__ import annotations

import time

import psutil
import pytest

from conftest import SCRIPTS, assert_job_left_nothing
from ftrun.launch.launcher import _POLL_INTERVAL, IDLE_LOOK
from ftrun.launch.processes import SUPERVISOR_NAME

WINDOW = 3.0  # seconds of steady running over which the wake-ups are counted


def main_thread_wakes(pid: int) -> int:
    """The voluntary context switches of ``pid``'s main thread so far."""
    with open(f"/proc/{pid}/task/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt_switches"))


def polls_per_look(pid: int, interval: float) -> float:
    """How many times ``pid``'s main thread slept over :data:`WINDOW`, per look of a poll every ``interval``."""
    before, t0 = main_thread_wakes(pid), time.monotonic()
    time.sleep(WINDOW)
    return (main_thread_wakes(pid) - before) / ((time.monotonic() - t0) / interval)


def supervisor_of(job) -> psutil.Process:
    return next(p for p in psutil.Process(job.proc.pid).children(recursive=True) if p.name() == SUPERVISOR_NAME)


@pytest.mark.extended  # make test: test_the_supervisor_looks_at_its_beating_trainers_...
@pytest.mark.timeout(120)
def test_the_launcher_waits_for_its_supervisors_exits(start_job):
    """The launcher's main thread sleeps until a supervisor exits (pidfds), not for 20 ms at a time; and once
    its last supervisor has exited it ends without a wait (a pause would make it IDLE_LOOK or more)."""
    job = start_job("--nproc-per-node", "1", str(SCRIPTS / "sleeper.py"), "--seconds", "12")
    supervisor = psutil.Process(job.wait_for_event(lambda e: e["event"] == "node_start")["pid"])
    job.wait_for_event(lambda e: e["event"] == "first_heartbeat")
    ratio = polls_per_look(job.proc.pid, _POLL_INTERVAL)
    supervisor.wait(timeout=60)
    gone = time.monotonic()
    assert job.wait() == 0, job.output
    tail = (time.monotonic() - gone) / IDLE_LOOK
    assert ratio < 0.25, f"the launcher woke {ratio:.2f} times per {_POLL_INTERVAL}s poll"
    assert tail < 1.0, f"the launcher ended {tail:.2f} x IDLE_LOOK after its supervisor"  # a last pause: over 1
    assert_job_left_nothing(job)


@pytest.mark.timeout(120)
def test_the_supervisor_looks_at_its_beating_trainers_when_something_is_due(start_job):
    """Once every trainer beats, the supervisor looks when a check is due (the store, its peers, a hang deadline)
    or something happens (an exit, a move of the generation, a signal), not at every --monitor-interval."""
    interval = 0.01
    job = start_job("--nproc-per-node", "2", "--monitor-interval", str(interval), str(SCRIPTS / "sleeper.py"),
                    "--seconds", "12")
    job.wait_for_event(lambda e: e["event"] == "first_heartbeat")
    ratio = polls_per_look(supervisor_of(job).pid, interval)
    assert job.wait() == 0, job.output
    assert ratio < 0.5, f"the supervisor woke {ratio:.2f} times per --monitor-interval {interval}"
    assert_job_left_nothing(job)


CRASH_ONCE_THEN_SLEEP = """import os, sys, time
if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    sys.exit(1)
time.sleep(10)
"""


@pytest.mark.extended  # make test: the two other idle-cost tests
@pytest.mark.timeout(120)
def test_a_script_that_never_beats_is_not_looked_at_eagerly_after_a_restart(start_job, tmp_path):
    """A restart's recovery time is when every trainer beats again: a script that never beats (an unmodified
    torchrun script) has none, so the supervisor does not look at every --monitor-interval waiting for it."""
    script = tmp_path / "crash_once.py"
    script.write_text(CRASH_ONCE_THEN_SLEEP)
    interval = 0.01
    job = start_job("--nproc-per-node", "1", "--monitor-interval", str(interval), str(script))
    job.trainer(0, generation=1)
    ratio = polls_per_look(supervisor_of(job).pid, interval)
    assert job.wait() == 0, job.output
    assert ratio < 0.5, f"the supervisor woke {ratio:.2f} times per --monitor-interval {interval}"
    assert_job_left_nothing(job)
