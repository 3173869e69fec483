"""A real SLURM cluster of simulated nodes on this host, for the tests: munge, slurmctld and one slurmd per node.

Every node is this host (``NodeAddr=127.0.0.1``, one slurmd port each), so the nodes share one /dev/shm and one
host name, as ../shared/DESIGN.md describes; ftrun tells them apart by ``SLURMD_NODENAME``/``SLURM_NODEID``.
The daemons run as root from a private directory (configuration, state, spool, logs, munge key and socket), in
their own process groups; :meth:`SlurmCluster.stop` kills them all. Clients reach the cluster through the
environment of :meth:`SlurmCluster.env` (``SLURM_CONF``). The Debian packages are installed when missing.

Run ``python tests/slurm_cluster.py`` to start one by hand (it prints the ``SLURM_CONF`` to export) and stop it
with Ctrl-C.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager

from debian_packages import apt_install

PACKAGES = ["munge", "slurm-wlm", "slurm-client"]
DAEMONS = ["munged", "slurmctld", "slurmd", "srun", "sbatch", "scontrol"]
START_TIMEOUT = 60.0
PORT_BASES = range(17000, 29000, 97)  # where a cluster's slurmctld and slurmd ports start: the first free one
# Each cluster numbers its jobs from its own block (FirstJobId): clusters of two checkouts testing side by side on
# this host would otherwise both run a job 1, whose ftrun job id ``slurm-1`` names files in the one /dev/shm (the
# tests' cleanup removes them) and whose control store port (20000 + job id % 20000) would be the same
JOBS_PER_CLUSTER = 100


class SlurmUnavailable(RuntimeError):
    """SLURM cannot be installed or started here (not root, no package registry)."""


def install() -> None:
    """Install munge and SLURM with apt when a daemon or client is missing (as in CI's fresh machine)."""
    if all(shutil.which(name) or os.path.exists(f"/usr/sbin/{name}") for name in DAEMONS):
        return
    problem = apt_install(*PACKAGES)
    if problem is not None:
        raise SlurmUnavailable(f"SLURM is not installed and {problem}")


def _free_base(count: int) -> int:
    """A port base with ``count`` consecutive free ports on 127.0.0.1."""
    for base in PORT_BASES:
        try:
            for port in range(base, base + count):
                with socket.socket() as probe:
                    probe.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
    raise SlurmUnavailable("no free ports for slurmctld and the slurmd daemons")


class SlurmCluster:
    """``nodes`` simulated nodes ``n1..nN`` in one partition ``debug``, all on this host."""

    def __init__(self, root: str, nodes: int = 4) -> None:
        self.root = root
        self.nodes = [f"n{i}" for i in range(1, nodes + 1)]
        self.procs: list[subprocess.Popen[bytes]] = []
        self.conf = os.path.join(root, "slurm.conf")
        self.munge_socket = os.path.join(root, "munge", "munge.socket")

    def env(self) -> dict[str, str]:
        """The environment for SLURM clients (srun, sbatch, scontrol, squeue) talking to this cluster."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        env["SLURM_CONF"] = self.conf
        return env

    def start(self) -> None:
        install()
        for sub in ("munge", "state", "spool", "log"):
            os.makedirs(os.path.join(self.root, sub), mode=0o700, exist_ok=True)
        self._start_munge()
        base = _free_base(len(self.nodes) + 1)
        self._write_conf(base)
        log = os.path.join(self.root, "log")
        self._daemon(["slurmctld", "-D", "-c", "-i", "-f", self.conf, "-L", f"{log}/slurmctld.log"])
        for node in self.nodes:
            self._daemon(["slurmd", "-D", "-N", node, "-f", self.conf, "-L", f"{log}/slurmd.{node}.log"])
        self.wait_idle(self.nodes)

    def _start_munge(self) -> None:
        key = os.path.join(self.root, "munge", "munge.key")
        with open(os.open(key, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
            f.write(os.urandom(1024))
        munge = os.path.join(self.root, "munge")
        self._daemon(["munged", "--foreground", "--force", f"--key-file={key}", f"--socket={self.munge_socket}",
                      f"--pid-file={munge}/munged.pid", f"--log-file={munge}/munged.log",
                      f"--seed-file={munge}/munged.seed"])
        deadline = time.monotonic() + START_TIMEOUT
        while not os.path.exists(self.munge_socket):
            if time.monotonic() > deadline or self.procs[-1].poll() is not None:
                raise SlurmUnavailable("munged did not start")
            time.sleep(0.02)

    def _write_conf(self, base: int) -> None:
        root, host = self.root, socket.gethostname().split(".")[0]
        last = base + len(self.nodes)
        lines = [
            "ClusterName=ftruntest", f"SlurmctldHost={host}(127.0.0.1)", f"SlurmctldPort={base}",
            "SlurmUser=root", "SlurmdUser=root", "AuthType=auth/munge", "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket}", f"StateSaveLocation={root}/state",
            f"SlurmdSpoolDir={root}/spool/%n", f"SlurmctldPidFile={root}/slurmctld.pid",
            f"SlurmdPidFile={root}/slurmd.%n.pid", "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
            "SchedulerType=sched/builtin", "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core",
            "ReturnToService=2", "MpiDefault=none", "JobCompType=jobcomp/none",
            "AccountingStorageType=accounting_storage/none", "JobAcctGatherType=jobacct_gather/none",
            "KillWait=30", "SlurmdTimeout=30", "MinJobAge=60",
            f"FirstJobId={1 + PORT_BASES.index(base) * JOBS_PER_CLUSTER}",
            f"NodeName={_hostlist(self.nodes)} NodeHostname={host} NodeAddr=127.0.0.1 "
            f"Port=[{base + 1}-{last}] CPUs=2 State=UNKNOWN",
            f"PartitionName=debug Nodes={_hostlist(self.nodes)} Default=YES MaxTime=INFINITE State=UP "
            "OverSubscribe=FORCE:4",
        ]
        with open(os.open(self.conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), "w") as f:
            f.write("\n".join(lines) + "\n")

    def _daemon(self, command: list[str]) -> None:
        out = open(os.path.join(self.root, "log", f"{os.path.basename(command[0])}.out"), "ab")
        with out:
            self.procs.append(subprocess.Popen(command, stdout=out, stderr=out, start_new_session=True,
                                               env=self.env()))

    def scontrol(self, *args: str) -> str:
        done = subprocess.run(["scontrol", *args], env=self.env(), capture_output=True, text=True, timeout=30)
        if done.returncode != 0:
            raise RuntimeError(f"scontrol {' '.join(args)}: {done.stderr.strip()}")
        return done.stdout

    def node_states(self) -> dict[str, str]:
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], env=self.env(), capture_output=True,
                             text=True, timeout=30).stdout
        return dict(line.split() for line in out.splitlines() if line.strip())

    def wait_idle(self, nodes: list[str], timeout: float = START_TIMEOUT) -> None:
        """Wait until every node in ``nodes`` is idle (slurmd registered, no job)."""
        deadline = time.monotonic() + timeout
        while True:
            states = {}
            try:
                states = self.node_states()
            except (OSError, subprocess.SubprocessError):
                pass
            if all(states.get(node, "").rstrip("*") == "idle" for node in nodes):
                return
            if time.monotonic() > deadline:
                raise SlurmUnavailable(f"SLURM nodes not idle after {timeout:.0f} s: {states} "
                                       f"(logs in {self.root}/log)")
            time.sleep(0.2)

    def resume(self, node: str) -> None:
        """Bring a node set down back into service (``state=resume``) and wait until it is idle."""
        if self.node_states().get(node, "").rstrip("*") != "idle":
            self.scontrol("update", f"nodename={node}", "state=resume")
        self.wait_idle([node])

    def stop(self) -> None:
        if os.path.exists(self.conf):
            subprocess.run(["scancel", "--full", "--quiet", "-u", "root"], env=self.env(), capture_output=True,
                           timeout=30)
        for proc in reversed(self.procs):
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    proc.wait(timeout=5)
                    break
                except subprocess.TimeoutExpired:
                    continue
        self.procs.clear()


def _hostlist(nodes: list[str]) -> str:
    return f"n[1-{len(nodes)}]"


@contextmanager
def slurm_cluster(root: str, nodes: int = 4) -> Iterator[SlurmCluster]:
    cluster = SlurmCluster(root, nodes)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


if __name__ == "__main__":
    import tempfile

    with slurm_cluster(tempfile.mkdtemp(prefix="ftrun-slurm-")) as running:
        print(f"export SLURM_CONF={running.conf}", flush=True)
        try:
            signal.pause()
        except KeyboardInterrupt:
            pass
