"""The local launcher's hot spares (``--spares K``): keeps K spare supervisors running, and hands over the
process of the one that claimed a lost node's rank (:mod:`ftrun.launch.spare`) so the launcher waits for it as
that node's supervisor; a new spare then starts in the background to keep K."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Callable

from ftrun.events import EventLog
from ftrun.launch.processes import RESTART_WINDOW, RestartLimit


class SparePool:
    """``count`` spares named spare-0, spare-1, ...; ``spawn(name)`` starts one."""

    def __init__(self, count: int, spawn: Callable[[str], subprocess.Popen[bytes]], events: EventLog) -> None:
        self.count = count
        self._spawn = spawn
        self._events = events
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        self._started = 0
        self._exits = RestartLimit()  # of spares that died while they waited
        self.closed = False

    def fill(self) -> None:
        """Start spares until ``count`` run (a spare that died is replaced too), unless spares died too often
        (:class:`RestartLimit`): then none more (a lost node gets a replacement supervisor, as without spares)."""
        for name, proc in list(self._procs.items()):
            if proc.poll() is not None:
                del self._procs[name]
                self.closed = self._exits.reached() or self.closed
                then = (f"spares exited {len(self._exits)} times within {RESTART_WINDOW:g}s: starting no more (a lost "
                        "node gets a replacement supervisor instead)" if self.closed else "starting another")
                self._events.emit("spare_gone", f"spare {name} exited ({proc.returncode}); {then}",
                                  spare=name, exit_code=proc.returncode)
        while not self.closed and len(self._procs) < self.count:
            name = f"spare-{self._started}"
            self._started += 1
            self._procs[name] = self._spawn(name)

    def alive(self) -> bool:
        """Whether a spare runs that could still take a rank."""
        return any(proc.poll() is None for proc in self._procs.values())

    def adopt(self, name: str) -> subprocess.Popen[bytes] | None:
        """The process of spare ``name`` (it took a node rank), no longer counted as a spare."""
        return self._procs.pop(name, None)

    def processes(self) -> list[subprocess.Popen[bytes]]:
        """The spares' processes (those that took a rank are no longer here)."""
        return list(self._procs.values())

    def signal(self, signum: int) -> None:
        for proc in self._procs.values():
            if proc.poll() is None:
                proc.send_signal(signum)

    def stop(self, grace: float) -> None:
        """Stop every spare (SIGTERM, then SIGKILL after ``grace``) and start no more."""
        self.closed = True
        self.signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for proc in self._procs.values():
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._procs.clear()
