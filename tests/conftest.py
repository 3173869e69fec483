"""Shared fixtures: run real ftrun jobs, bounded in time, and leave no process or /dev/shm file behind."""

from __future__ import annotations

import fcntl
import glob
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

pytest_plugins = ("etcd_cluster",)  # the etcd_module and etcd fixtures (a real 3-member cluster)

ROOT = Path(__file__).resolve().parent.parent
TRAIN_PLAIN = ROOT / "examples" / "train_plain.py"
SCRIPTS = Path(__file__).resolve().parent / "scripts"
TRAIN_STEPS = 40
TRAIN_GPT = ROOT / "examples" / "train_gpt.py"
NODES = ("--nnodes", "2", "--nproc-per-node", "2")
STEPS = 60
EVERY = 10


def gpt_args(tmp_path: Path, name: str, *extra: str) -> tuple[list[str], Path]:
    out = tmp_path / f"{name}.hash"
    return [str(TRAIN_GPT), "--steps", str(STEPS), "--snapshot-every", str(EVERY), "--out", str(out), *extra], out


def computed_once(tmp_path_factory, name: str, compute: Callable[[Path], str]) -> str:
    """``compute(a new temp dir)``, run once per test session: pytest-xdist's workers share its result through a
    file in the session's temp root, under a lock (a worker that asks while another computes it waits for it)."""
    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    result = root / f"{name}.result"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not result.exists():
            result.write_text(compute(tmp_path_factory.mktemp(name)))
        return result.read_text()


@pytest.fixture(scope="session")
def gpt_baselines(tmp_path_factory):
    """``baseline(nnodes, nproc)``: the final state hash of a failure-free train_gpt run of that shape. It depends
    on the world size only (4 x 1 ends like 2 x 2), so one run per world size in the whole session."""

    def run(nnodes: int, nproc: int, tmp: Path) -> str:
        args, out = gpt_args(tmp, "baseline")
        result = subprocess.run([sys.executable, "-m", "ftrun", "--rdzv-id", f"t{uuid.uuid4().hex[:10]}",
                                 "--nnodes", str(nnodes), "--nproc-per-node", str(nproc), *args],
                                capture_output=True, text=True, timeout=180)
        assert result.returncode == 0, result.stderr
        return out.read_text().strip()

    def baseline(nnodes: int, nproc: int) -> str:
        return computed_once(tmp_path_factory, f"gpt-baseline-{nnodes * nproc}",
                             lambda tmp: run(nnodes, nproc, tmp))

    return baseline


@pytest.fixture
def gpt_baseline(gpt_baselines) -> str:
    """Final state hash of the failure-free train_gpt run (2 nodes x 2 trainers)."""
    return gpt_baselines(2, 2)


def primary_failures(job) -> list[dict]:
    return [e for e in job.events() if e["event"] == "failure" and e.get("primary", True)]


def restores(job) -> dict[int, dict]:
    """The restore decision of every generation (node 0's copy of it)."""
    return {e["generation"]: e for e in job.events() if e["event"] == "restore" and e["source"] == "node 0"}


def run_bitwise(start_job, tmp_path, expected: str, name: str, *flags: str, nodes: tuple[str, ...] = NODES,
                script: tuple[str, ...] = (), **start: object):
    """Run train_gpt with ``flags`` (and ``script``, its own): it succeeds, ends with the ``expected`` state hash and
    leaves nothing."""
    args, out = gpt_args(tmp_path, name, *script)
    job = start_job(*nodes, *flags, *args, **start)
    assert job.wait(180) == 0, job.output
    assert out.read_text().strip() == expected, job.output
    assert_job_left_nothing(job)
    return job


@pytest.fixture
def small_tmpfs(tmp_path):
    """``mount(megabytes, options)``: a fresh tmpfs of that size, with more mount ``options`` if given (skips the
    test where mounting is not allowed); unmounted after the test."""
    mounted: list[Path] = []

    def mount(megabytes: int, options: str = "") -> Path:
        path = tmp_path / f"tmpfs-{len(mounted)}"
        path.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={megabytes}m,mode=0700{options and ',' + options}",
                               "tmpfs", str(path)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a small tmpfs here: {done.stderr.strip()}")
        mounted.append(path)
        return path

    yield mount
    for path in mounted:
        subprocess.run(["umount", "-l", str(path)], check=False)


def job_processes(job_id: str) -> list[psutil.Process]:
    """Every live process of a job: supervisors, zygotes and trainers carry the job id in their environment."""
    found = []
    for proc in psutil.process_iter():
        try:
            env = proc.environ()
        except (psutil.Error, OSError):
            continue
        if env.get("FTRUN_JOB_ID") == job_id or f'"job_id": "{job_id}"' in env.get("FTRUN_NODE_SPEC", ""):
            if proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
    return found


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def job_segments(job_id: str) -> list[str]:
    return glob.glob(f"/dev/shm/ftrun-{job_id}-*")


def events_of(log_dir: Path) -> list[dict]:
    """The events written so far: every complete line (one being written has no newline yet)."""
    path = log_dir / "events.jsonl"
    return [json.loads(line) for line in path.read_text().split("\n")[:-1]] if path.exists() else []


@dataclass
class Job:
    """One `ftrun` launcher process started by a test."""

    job_id: str
    log_dir: Path
    proc: subprocess.Popen
    output_path: Path
    started: float = field(default_factory=time.monotonic)

    def wait(self, timeout: float = 120) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_job(self)
            pytest.fail(f"job {self.job_id} did not finish within {timeout}s:\n{self.output}")

    @property
    def output(self) -> str:
        return self.output_path.read_text(errors="replace")

    def events(self) -> list[dict]:
        return events_of(self.log_dir)

    def wait_for_event(self, predicate, timeout: float = 60) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for event in self.events():
                if predicate(event):
                    return event
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        pytest.fail(f"event not seen within {timeout}s; output:\n{self.output}")

    def trainer(self, rank: int, generation: int = 0, timeout: float = 60) -> psutil.Process:
        """The trainer process of ``rank`` in ``generation``, from the supervisors' trainers_started events.

        (Trainers forked by a zygote keep the zygote's /proc/PID/environ, so the environment cannot tell.)
        """
        started = self.wait_for_event(lambda e: e["event"] == "trainers_started" and e["generation"] == generation
                                      and str(rank) in e["pids"], timeout)
        return psutil.Process(started["pids"][str(rank)])


def kill_job(job: Job) -> None:
    try:
        os.killpg(job.proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for proc in job_processes(job.job_id):
        try:
            proc.kill()
        except psutil.Error:
            pass
    try:
        job.proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


@pytest.fixture
def start_job(tmp_path):
    """Start `ftrun ARGS...` with a unique job id and a log dir; cleans up processes and segments after the test."""
    jobs: list[Job] = []

    def start(*args: str, job_id: str | None = None, log_dir: Path | None = None, env: dict | None = None,
              prefix: tuple[str, ...] = (), pass_fds: tuple[int, ...] = ()) -> Job:
        """``prefix``: the command that runs ftrun (``ip netns exec HOST``: in another host); ``pass_fds``:
        descriptors ftrun inherits besides stdin, stdout and stderr."""
        job_id = job_id or f"t{uuid.uuid4().hex[:10]}"
        log_dir = log_dir or tmp_path / f"logs-{job_id}"
        output = tmp_path / f"output-{job_id}-{len(jobs)}.txt"
        with open(output, "wb") as out:
            proc = subprocess.Popen([*prefix, sys.executable, "-m", "ftrun", "--rdzv-id", job_id, "--log-dir",
                                     str(log_dir), *args], stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True, cwd=tmp_path, env={**os.environ, **(env or {})},
                                    pass_fds=pass_fds)
        job = Job(job_id, log_dir, proc, output)
        jobs.append(job)
        return job

    yield start
    for job in jobs:
        kill_job(job)
        for path in job_segments(job.job_id):
            os.unlink(path)


def assert_job_left_nothing(job: Job) -> None:
    """No process and no /dev/shm file of the job survives it."""
    deadline = time.monotonic() + 3
    while job_processes(job.job_id) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = [(p.pid, " ".join(p.cmdline())) for p in job_processes(job.job_id)]
    assert not left, f"processes of job {job.job_id} survived it: {left}"
    assert not job_segments(job.job_id), f"segments left: {job_segments(job.job_id)}"


def train_args(tmp_path: Path, name: str, *extra: str, steps: int = TRAIN_STEPS) -> tuple[list[str], Path]:
    out = tmp_path / f"{name}.hash"
    return [str(TRAIN_PLAIN), "--steps", str(steps), "--ckpt-dir", str(tmp_path / f"{name}-ckpt"),
            "--out", str(out), *extra], out


@pytest.fixture(scope="session")
def baseline_hash(tmp_path_factory) -> str:
    """Final state hash of the failure-free example run (2 nodes x 2 trainers), computed once."""

    def run(tmp: Path) -> str:
        args, out = train_args(tmp, "baseline")
        job_id = f"t{uuid.uuid4().hex[:10]}"
        result = subprocess.run([sys.executable, "-m", "ftrun", "--rdzv-id", job_id, "--nnodes", "2",
                                 "--nproc-per-node", "2", *args], capture_output=True, text=True, timeout=180)
        assert result.returncode == 0, result.stderr
        return out.read_text().strip()

    return computed_once(tmp_path_factory, "plain-baseline", run)


@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
    """A real SLURM cluster of 4 simulated nodes n1..n4 on this host (:mod:`tests.slurm_cluster`), started once
    for the session (installed with apt when missing) and torn down after it. Failing to start it fails the
    tests that need it: CI must run them, never skip them."""
    from slurm_cluster import SlurmCluster, SlurmUnavailable

    cluster = SlurmCluster(str(tmp_path_factory.mktemp("slurm")))
    try:
        cluster.start()
    except SlurmUnavailable as err:
        cluster.stop()
        pytest.fail(f"cannot start the local SLURM cluster: {err}")
    yield cluster
    cluster.stop()
