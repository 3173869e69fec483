"""A real 3-member etcd cluster on this host, for the tests of :mod:`ftrun.control.etcd`.

Every member listens on loopback ports of its own (one client port, one peer port), keeps its data in a
directory of the cluster's temporary root and runs in a process group of its own, so :meth:`EtcdCluster.kill`
(SIGKILL to the group) is a crash, and :meth:`EtcdCluster.start` brings the member back with its data. Elections
are made fast for the tests (``--heartbeat-interval 50 --election-timeout 500``, etcd's defaults are 100/1000 ms):
a new leader is in place about half a second after the old one dies. The Debian package ``etcd-server`` is
installed with apt when ``etcd`` is missing (:func:`ensure_etcd`).

Run ``python tests/etcd_cluster.py`` to start one by hand (it prints the endpoints) and stop it with Ctrl-C.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import requests

from debian_packages import apt_install

PACKAGE = "etcd-server"
MEMBERS = 3
START_TIMEOUT = 30.0
HEARTBEAT_MS = 50
ELECTION_MS = 500


class EtcdUnavailable(RuntimeError):
    """etcd cannot be installed or started here (not root, no package registry)."""


def ensure_etcd() -> str:
    """The path of the ``etcd`` binary, installing the Debian package ``etcd-server`` with apt when missing."""
    found = shutil.which("etcd") or ("/usr/bin/etcd" if os.path.exists("/usr/bin/etcd") else None)
    if found:
        return found
    problem = apt_install(PACKAGE)
    found = shutil.which("etcd")
    if problem is not None or not found:
        raise EtcdUnavailable(f"etcd is not installed and {problem or f'apt-get install {PACKAGE} gave no etcd'}")
    return found


def free_ports(count: int) -> list[int]:
    """``count`` distinct ports that are free on 127.0.0.1 right now."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


class EtcdCluster:
    """``members`` etcd members ``m0..m{n-1}`` on loopback; :attr:`endpoints` is the ``host:port,...`` list."""

    def __init__(self, members: int = MEMBERS, binary: str | None = None) -> None:
        self.binary = binary or ensure_etcd()
        self.root = tempfile.mkdtemp(prefix="ftrun-etcd-")
        ports = free_ports(2 * members)
        self.client_ports, self.peer_ports = ports[:members], ports[members:]
        self.names = [f"m{i}" for i in range(members)]
        self.procs: list[subprocess.Popen[bytes] | None] = [None] * members
        self.endpoints = ",".join(self.endpoint(i) for i in range(members))

    def endpoint(self, i: int) -> str:
        """Member ``i``'s client endpoint, ``127.0.0.1:port``."""
        return f"127.0.0.1:{self.client_ports[i]}"

    def _command(self, i: int) -> list[str]:
        cluster = ",".join(f"{name}=http://127.0.0.1:{port}" for name, port in zip(self.names, self.peer_ports))
        client, peer = f"http://127.0.0.1:{self.client_ports[i]}", f"http://127.0.0.1:{self.peer_ports[i]}"
        return [self.binary, "--name", self.names[i], "--data-dir", os.path.join(self.root, self.names[i]),
                "--listen-client-urls", client, "--advertise-client-urls", client,
                "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                "--initial-cluster", cluster, "--initial-cluster-state", "new",
                "--initial-cluster-token", os.path.basename(self.root),
                "--heartbeat-interval", str(HEARTBEAT_MS), "--election-timeout", str(ELECTION_MS),
                "--logger", "zap", "--log-outputs", os.path.join(self.root, f"{self.names[i]}.log")]

    def start(self, i: int | None = None) -> None:
        """Start member ``i`` (again, with its data), or every member and wait until the cluster has a leader."""
        for index in range(len(self.names)) if i is None else [i]:
            if self.procs[index] is None:
                self.procs[index] = subprocess.Popen(self._command(index), stdin=subprocess.DEVNULL,
                                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                                     start_new_session=True)
        if i is None:
            try:
                self.wait_leader()
            except BaseException:
                for index in range(len(self.procs)):  # no member left behind; the logs stay until stop()
                    self.kill(index)
                raise

    def kill(self, i: int) -> None:
        """SIGKILL member ``i`` (its whole process group) and reap it."""
        proc = self.procs[i]
        if proc is None:
            return
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)
        self.procs[i] = None

    def status(self, i: int) -> dict | None:
        """Member ``i``'s ``/v3/maintenance/status`` answer, or None when it does not answer."""
        try:
            answer = requests.post(f"http://127.0.0.1:{self.client_ports[i]}/v3/maintenance/status", json={},
                                   timeout=1.0)
            return answer.json() if answer.ok else None
        except (requests.RequestException, ValueError):
            return None

    def leader(self) -> int | None:
        """The index of the member that leads now, as every running member sees it (None: no leader, or a running
        member does not answer yet: a restarted member serves clients only once it has rejoined)."""
        statuses = {i: self.status(i) for i, proc in enumerate(self.procs) if proc is not None}
        if not statuses or None in statuses.values():
            return None
        ids = {status["header"]["member_id"]: i for i, status in statuses.items() if status}
        leaders = {status.get("leader") for status in statuses.values() if status}
        return ids[leaders.pop()] if len(leaders) == 1 and next(iter(leaders)) in ids else None

    def wait_leader(self, timeout: float = START_TIMEOUT) -> int:
        """Wait until every running member answers and they agree on a leader (one of them); its index."""
        deadline = time.monotonic() + timeout
        while True:
            for i, proc in enumerate(self.procs):
                if proc is not None and proc.poll() is not None:
                    raise EtcdUnavailable(f"etcd member {self.names[i]} exited with {proc.returncode} "
                                          f"(log in {self.root}/{self.names[i]}.log)")
            leader = self.leader()
            if leader is not None:
                return leader
            if time.monotonic() > deadline:
                raise EtcdUnavailable(f"etcd has no leader after {timeout:.0f} s (logs in {self.root})")
            time.sleep(0.05)

    def stop(self) -> None:
        """Kill every member and remove the data."""
        for i in range(len(self.procs)):
            self.kill(i)
        shutil.rmtree(self.root, ignore_errors=True)


@contextmanager
def etcd_cluster(members: int = MEMBERS) -> Iterator[EtcdCluster]:
    """A started cluster, stopped and removed on the way out (also when the body fails)."""
    cluster = EtcdCluster(members)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()



@pytest.fixture(scope="module")
def etcd_module() -> Iterator[EtcdCluster]:
    try:
        cluster = EtcdCluster()
    except EtcdUnavailable as err:
        pytest.skip(f"no etcd: {err}")
    try:
        cluster.start()
    except EtcdUnavailable as err:
        cluster.stop()
        pytest.skip(f"cannot start a local etcd cluster: {err}")
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def etcd(etcd_module: EtcdCluster) -> EtcdCluster:
    """The module's cluster with every member running and a leader (a test before may have killed some)."""
    for i, proc in enumerate(etcd_module.procs):
        if proc is None:
            etcd_module.start(i)
    etcd_module.wait_leader()
    return etcd_module


if __name__ == "__main__":
    with etcd_cluster() as running:
        print(f"etcd endpoints: {running.endpoints} (leader m{running.leader()}); Ctrl-C stops", flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass
