"""Process plumbing shared by the launcher, supervisors and zygotes: Linux prctl, process groups, reaping.

Invariant kept with these: no process of a job outlives it, but for the programs its trainers started and left
running when the job succeeded (a last upload not waited for), which outlive it as under torchrun. Every
long-lived ftrun process is a child subreaper, so orphaned descendants come back to it; every child dies with
its parent (PR_SET_PDEATHSIG); every trainer leads its own process group, so stopping it reaches whatever it
forked.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterable

import psutil

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15
# Process names (what top and `ps -o comm` show; ftrun clean tells the processes of a job by them): the launcher
# forks the supervisors, which fork their zygotes, so all share the launcher's argv.
LAUNCHER_NAME = "ftrun"
SUPERVISOR_NAME = "ftrun-node"
ZYGOTE_NAME = "ftrun-zygote"
READY_NAME = "ftrun-ready"  # a trainer forked ahead by the zygote, waiting for its request
_PR_SET_CHILD_SUBREAPER = 36
# A helper process that is restarted after each exit (a keeper, a spare) and exits this often within RESTART_WINDOW
# seconds fails the same way each time (a bug, a resource it cannot get, the OOM killer's pick as it allocates):
# restarting it again would loop for ever
RESTART_LIMIT = 5
RESTART_WINDOW = 120.0
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


def reap_orphans(children: Iterable[subprocess.Popen[bytes] | ForkedChild]) -> None:
    """Collect every exited child of this process, a child subreaper, without blocking. One of ``children`` is
    collected by its own ``poll()``, which keeps its exit code for its owner; any other child is a descendant
    orphaned when its parent died (a lost supervisor's zygote, keeper and trainers, killed with it), re-parented
    here: it is reaped and forgotten. Invariant: no exited child stays a zombie, so a long job that loses nodes
    again and again holds no more processes than a young one."""
    known = {child.pid: child for child in children}
    while True:
        try:  # the next exited child, left waitable (WNOWAIT): its owner's poll() may still reap it
            exited = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return
        if exited is None:
            return
        child = known.pop(exited.si_pid, None)
        if child is None:  # an orphan, or seen again: a poll() that returned a code without reaping
            with contextlib.suppress(ChildProcessError):
                os.waitpid(exited.si_pid, 0)
        elif child.poll() is None:  # its owner's wait holds it now (another thread): the next call takes it
            return


class ExitWatch:
    """Descriptors that become readable when a watched child exits (``pidfd_open``), so that a ``select`` on
    :meth:`fds` ends the moment one does, instead of at the next poll. Invariant: a child is forgotten when it
    is reaped (its descriptor would stay readable). Where the kernel has no pidfds (before Linux 5.3) nothing is
    watched and the caller's poll alone sees exits."""

    def __init__(self) -> None:
        self._fds: dict[int, int] = {}

    def watch(self, pid: int) -> None:
        try:
            self._fds[pid] = os.pidfd_open(pid)
        except (OSError, AttributeError):
            pass

    def forget(self, pid: int) -> None:
        fd = self._fds.pop(pid, None)
        if fd is not None:
            os.close(fd)

    def fds(self) -> list[int]:
        return list(self._fds.values())

    def watch_only(self, pids: set[int]) -> bool:
        """Watch exactly ``pids`` (the others forgotten); whether every one of them is watched (it has a pidfd)."""
        for pid in set(self._fds) - pids:
            self.forget(pid)
        for pid in pids - set(self._fds):
            self.watch(pid)
        return pids <= set(self._fds)


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


def oom_kills() -> int | None:
    """How many processes the kernel's OOM killer has killed on this host since boot (``oom_kill`` of
    /proc/vmstat, a cgroup's memory limit included); None where the kernel does not count them."""
    try:
        with open("/proc/vmstat") as f:
            return next((int(line.split()[1]) for line in f if line.startswith("oom_kill ")), None)
    except (OSError, ValueError, IndexError):
        return None


def kill_descendants(timeout: float = 5.0, spare: Callable[[psutil.Process], bool] | None = None
                     ) -> list[tuple[int, str]]:
    """SIGKILL every descendant of this process, then reap them, bounded by ``timeout``; but a descendant for
    which ``spare`` is true, and its own descendants, are left running: their (pid, name) are returned."""
    spared: dict[int, str] = {}
    if spare is not None:
        for proc in psutil.Process().children(recursive=True):
            with contextlib.suppress(psutil.Error):
                if proc.pid not in spared and spare(proc):
                    for each in (proc, *proc.children(recursive=True)):
                        spared[each.pid] = each.name()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        children = [child for child in psutil.Process().children(recursive=True) if child.pid not in spared]
        if not children:
            break
        for child in children:
            try:
                child.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(children, timeout=0.5)
        reap()
    return list(spared.items())


def left_by_user(proc: psutil.Process) -> bool:
    """Whether ``proc`` is a program the trainers started, not a process of ftrun's: one named ``ftrun...``
    (launcher, supervisor, zygote, ready trainer) or running ftrun's command line (a fork of the launcher, a
    trainer's included; a keeper, started ahead or not)."""
    if proc.name().startswith(LAUNCHER_NAME):
        return False
    return not any(arg.startswith("ftrun.") for arg in proc.cmdline())


def kill_left_by_user() -> list[tuple[int, str]]:
    """SIGKILL every descendant of this process that the trainers started and left running (:func:`left_by_user`:
    re-parented here, a process in a session of its own, a daemon); returns their (pid, name). Not waited for:
    the caller's own reaping collects them (a reap here could take the exit of a child it watches)."""
    killed = []
    for proc in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if left_by_user(proc):
                name = proc.name()
                proc.kill()
                killed.append((proc.pid, name))
    return killed


class RestartLimit:
    """The exits of a helper process restarted after each one (see :data:`RESTART_LIMIT`)."""

    def __init__(self) -> None:
        self._exits: list[float] = []  # time.monotonic() of each exit within the last RESTART_WINDOW seconds

    def reached(self) -> bool:
        """Count an exit now; True when it is the :data:`RESTART_LIMIT`-th within :data:`RESTART_WINDOW` seconds:
        restart the process no more."""
        now = time.monotonic()
        self._exits = [t for t in self._exits if now - t < RESTART_WINDOW] + [now]
        return len(self._exits) >= RESTART_LIMIT

    def __len__(self) -> int:
        return len(self._exits)


class ForkedChild:
    """A forked child process, with the part of :class:`subprocess.Popen`'s interface the launcher uses."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere (kill_descendants): its code is lost
                self.returncode = -signal.SIGKILL
                return self.returncode
            if pid == self.pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout or 0.0)
            time.sleep(0.005)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)
