"""Process plumbing shared by the launcher, supervisors and zygotes: Linux prctl, process groups, reaping.

Invariant kept with these: no process of a job outlives it. Every long-lived ftrun process is a child
subreaper, so orphaned descendants come back to it; every child dies with its parent (PR_SET_PDEATHSIG);
every trainer leads its own process group, so stopping it reaches whatever it forked.
"""

from __future__ import annotations

import ctypes
import os
import signal
import time

import psutil

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15
_PR_SET_CHILD_SUBREAPER = 36
_libc = ctypes.CDLL(None, use_errno=True)


def become_subreaper() -> None:
    """Orphaned descendants of this process are re-parented to it instead of to init."""
    if _libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed")


def set_process_name(name: str) -> None:
    """The name ``top``, ``ps -o comm`` and ``psutil.Process.name`` show (15 bytes at most); argv stays."""
    _libc.prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)


def die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when its parent dies; exit now if ``parent_pid`` is already gone."""
    _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:
        os._exit(1)


def signal_group(pgid: int, sig: int) -> None:
    """Send ``sig`` to a process group; a group that no longer exists is not an error."""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def reap() -> dict[int, int]:
    """Collect every exited child without blocking: pid -> return code (negative: killed by that signal)."""
    done: dict[int, int] = {}
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return done
        if pid == 0:
            return done
        done[pid] = os.waitstatus_to_exitcode(status)


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


def kill_descendants(timeout: float = 5.0) -> None:
    """SIGKILL every descendant of this process (and their groups), then reap them, bounded by ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        children = psutil.Process().children(recursive=True)
        if not children:
            return
        for child in children:
            try:
                child.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(children, timeout=0.5)
        reap()
