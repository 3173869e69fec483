"""The node's snapshot keeper process (:mod:`ftrun.snapshot.keeper`) as its supervisor runs it.

The keeper is started before the first trainer and kept across generations (:class:`KeeperProcess`): the one
started ahead the first time (:mod:`ftrun.launch.keeper_ahead`), else a new process, which re-adopts what a
previous one left. A keeper that dies is restarted at once and the trainers keep running; one that lives but
answers nothing is killed (:mod:`ftrun.launch.keeper_watch`) and so restarted. Once it failed too often
(:class:`~ftrun.launch.processes.RestartLimit`) it is not restarted: :attr:`KeeperProcess.given_up` says why, and
the job ends. Its peer socket (erasure coding) is opened once, so a restarted keeper keeps its address; its
:class:`~ftrun.snapshot.link.KeeperLink` is started with the first keeper and lives as long as the supervisor.
The process is reaped by its supervisor's ``reap()``, never by ``Popen``; a start that does not answer "ready"
within :data:`KEEPER_START_TIMEOUT` ends the job (:class:`~ftrun.launch.supervisor_ends.JobFailed`).
"""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import time

from ftrun.control.backend import OutageReport
from ftrun.control.spec import ENV_NODE_SPEC, NodeSpec, safe_job_id
from ftrun.events import EventLog
from ftrun.launch.keeper_ahead import KEEPER_COMMAND, KeeperAhead
from ftrun.launch.keeper_watch import KeeperWatch
from ftrun.launch.processes import RESTART_WINDOW, ExitWatch, RestartLimit, describe_exit, die_with_parent, signal_group
from ftrun.launch.supervisor_ends import JobFailed
from ftrun.snapshot.keeper import (ENV_EARLIER_RUN, ENV_JOB_SECRET, ENV_KEEPER_FAULTS, ENV_PEER_FD,
                                  STOP_SIGNAL as KEEPER_STOP_SIGNAL, unlink_segments)
from ftrun.snapshot.link import KeeperLink
from ftrun.snapshot.protocol import socket_name

KEEPER_START_TIMEOUT = 30.0


class KeeperProcess:
    """Node ``spec.node_rank``'s keeper: started, restarted after an exit, stopped; ``exits`` is the supervisor's
    watch of its children (a look follows the keeper's exit at once); ``ahead``: a keeper started ahead, used by
    the first start."""

    def __init__(self, spec: NodeSpec, secret: str, events: EventLog, report: OutageReport, exits: ExitWatch,
                 ahead: KeeperAhead | None) -> None:
        self.spec = spec
        self.node = spec.node_rank
        self.secret = secret  # for the keeper only, never for trainers
        self.events = events
        self.report = report
        self.exits = exits
        self.ahead = ahead
        self.proc: subprocess.Popen[bytes] | None = None
        self.watch: KeeperWatch | None = None  # kills a keeper that lives but answers nothing
        self.starts = 0
        self._failures = RestartLimit()  # the keeper's exits of itself
        self.given_up: str | None = None  # why the keeper is not restarted again (ends the job)
        self.link: KeeperLink | None = None
        self.peer_socket: socket.socket | None = None

    def owns(self, pid: int) -> bool:
        """Whether ``pid`` is the running keeper's."""
        return self.proc is not None and pid == self.proc.pid

    def _peer_address(self) -> str:
        """Open the keeper's peer socket (erasure coding) once; its address as peers reach it ('' when off)."""
        if self.spec.ec_parity == 0:
            return ""
        if self.peer_socket is None:
            bind = self.spec.bind_addr
            self.peer_socket = socket.create_server((bind, 0), backlog=128,
                                                    family=socket.AF_INET6 if ":" in bind else socket.AF_INET)
        return f"{self.spec.master_addr}:{self.peer_socket.getsockname()[1]}"

    def start(self) -> None:
        """Start the node's keeper (it re-adopts what a previous one left) and wait until it serves: the one
        started ahead the first time (:mod:`ftrun.launch.keeper_ahead`), else a new process."""
        t0 = time.monotonic()
        env = dict(os.environ)
        env[ENV_NODE_SPEC] = self.spec.encode()
        env[ENV_KEEPER_FAULTS] = ";".join(self.spec.faults) if self.starts == 0 else ""
        env[ENV_EARLIER_RUN] = "1" if self.starts == 0 else ""
        address = self._peer_address()
        if self.peer_socket is not None:
            env[ENV_JOB_SECRET] = self.secret
            env[ENV_PEER_FD] = str(self.peer_socket.fileno())
        ahead, self.ahead = self.ahead, None
        proc = ahead.start(env, self.peer_socket) if ahead is not None else None
        if proc is None:
            supervisor = os.getpid()
            proc = subprocess.Popen(KEEPER_COMMAND, env=env, stdout=subprocess.PIPE, start_new_session=True,
                                    pass_fds=[self.peer_socket.fileno()] if self.peer_socket is not None else [],
                                    preexec_fn=lambda: die_with_parent(supervisor))
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], KEEPER_START_TIMEOUT)
        line = proc.stdout.readline() if ready else b""
        proc.stdout.close()
        if line.strip() != b"ready":
            proc.kill()
            raise JobFailed(f"snapshot keeper of node {self.node} did not start")
        proc.returncode = 0  # reaped by this supervisor's reap(), never by Popen
        self.proc = proc
        self.exits.watch(proc.pid)
        self.watch = KeeperWatch(socket_name(safe_job_id(self.spec.job_id), self.node), proc.pid,
                                 3 * self.spec.node_timeout,
                                 lambda line: self.events.emit("keeper_unresponsive", line, node=self.node))
        self.starts += 1
        took = time.monotonic() - t0
        self.events.emit("keeper_start", f"keeper up (pid {proc.pid}) in {took * 1000:.0f} ms", console=False,
                         node=self.node, pid=proc.pid, seconds=took, incarnation=self.starts,
                         peer_address=address)
        if self.link is None:
            self.link = KeeperLink(self.spec, safe_job_id(self.spec.job_id), self.events, address, self.report)
            self.link.start()

    def exited(self, code: int) -> None:
        """The keeper died while the job runs: restart it; trainers keep running and reconnect. Once it failed
        too often (:class:`RestartLimit`) it is not restarted: the job ends (:attr:`given_up`)."""
        self._unwatch()
        self.proc = None
        if self._failures.reached():
            self.given_up = (f"node {self.node}'s snapshot keeper failed {len(self._failures)} times "
                             f"within {RESTART_WINDOW:g}s (last: {describe_exit(code)}); not "
                             "restarting it again")
            return
        self.events.emit("keeper_failed", f"keeper {describe_exit(code)}; restarting it (trainers keep "
                         "running)", node=self.node, exit_code=code)
        self.start()

    def _unwatch(self) -> None:
        if self.watch is not None:
            self.watch.stop()
            self.watch = None

    def kill(self) -> None:
        """SIGKILL the running keeper (an injected node loss), leaving everything else as it is."""
        if self.proc is not None:
            os.kill(self.proc.pid, signal.SIGKILL)

    def stop(self, unlink: bool = True) -> None:
        """Stop the keeper (it unlinks the node's snapshot segments) and make sure none are left; without
        ``unlink`` kill it, leaving them (they are a replacement's on this host)."""
        if self.ahead is not None:  # never started
            self.ahead.close()
        self._unwatch()
        if self.link is not None:
            self.link.stop()
        if self.proc is not None:
            # os.kill, not Popen.send_signal: that does nothing once returncode is set, as it is here (reap())
            os.kill(self.proc.pid, KEEPER_STOP_SIGNAL if unlink else signal.SIGKILL)
            deadline = time.monotonic() + self.spec.stop_grace
            while not _reaped(self.proc.pid):
                if time.monotonic() > deadline:
                    signal_group(self.proc.pid, signal.SIGKILL)
                time.sleep(0.01)
            self.exits.forget(self.proc.pid)
            self.proc = None
        if unlink:
            unlink_segments(self.spec.job_id, self.node)


def _reaped(pid: int) -> bool:
    """Reap ``pid`` if it has exited; True when it is gone."""
    try:
        return os.waitpid(pid, os.WNOHANG)[0] == pid
    except ChildProcessError:
        return True
