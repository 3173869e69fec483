"""``ftrun clean``: remove what jobs that no longer run left in shared memory (and their supervisors' run
directories in the temp dir).

A job removes its files when it ends, but ``kill -9`` of the top-level ``ftrun`` cannot: its supervisors,
keepers and trainers die with it (``PR_SET_PDEATHSIG``), and its files stay in the shm dir (``/dev/shm`` or
``$FTRUN_SHM_DIR``) until the same ``--rdzv-id`` runs again. A job's files there, all named ``ftrun-<job>-...``:
snapshot slots, parity and the heartbeat table (``-node<N>-...``), the launcher's announce file (``-launcher``),
the job secret (``-secret``), SLURM host claims (``-host-<node>``) and hot spares' reserves (``-reserve-<spare>-...``).
Only the current user's files count.

A job is live when its launcher's announce file names a running ftrun process (one that started before the
file was written, so a reused pid does not count), or when any process carries the job in its environment:
supervisors and keepers in ``FTRUN_NODE_SPEC``, zygotes and trainers in ``FTRUN_JOB_ID``. Processes of other
users are not visible and do not count. A live job's files are never removed.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import socket
import stat
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, field

import psutil

from ftrun.control.spec import ENV_NODE_SPEC, announce_path, foreign_file, safe_job_id, shm_dir
from ftrun.launch.env import ENV_JOB_ID
from ftrun.launch.handoff import SUPERVISOR_MODULE
from ftrun.launch.processes import LAUNCHER_NAME, READY_NAME, SUPERVISOR_NAME, ZYGOTE_NAME
from ftrun.snapshot.protocol import socket_name

_NAMES = [re.compile(pattern) for pattern in (
    r"ftrun-(?P<job>.+)-launcher",
    r"ftrun-(?P<job>.+)-secret(\.\d+)?",
    r"ftrun-(?P<job>.+)-node\d+-[A-Za-z0-9_.-]+",
    r"ftrun-(?P<job>.+)-host-[A-Za-z0-9_.-]+",
    r"ftrun-(?P<job>.+)-reserve-[A-Za-z0-9_.-]+",
)]
_RUN_DIR = re.compile(r"ftrun-.+-node\d+-[A-Za-z0-9_]{8}")  # a supervisor's run directory (tempfile.mkdtemp)


@dataclass
class JobFiles:
    """One job's files in the shm dir and, when it is live, what shows it."""

    job: str
    paths: list[str] = field(default_factory=list)
    nbytes: int = 0
    live: list[str] = field(default_factory=list)


def job_of(name: str) -> str | None:
    """The job a file name of the shm dir belongs to (None: not an ftrun file)."""
    for pattern in _NAMES:
        found = pattern.fullmatch(name)
        if found:
            return found["job"]
    return None


def job_files(job: str | None = None) -> list[JobFiles]:
    """The jobs that have files of this user in the shm dir (only ``job`` when given), with their liveness."""
    jobs: dict[str, JobFiles] = {}
    wanted = safe_job_id(job) if job is not None else None
    for directory, run_dirs in ((shm_dir(), False), (tempfile.gettempdir(), True)):
        try:
            names = sorted(os.listdir(directory))
        except OSError:
            names = []
        for name in names:
            owner = job_of(name)
            if owner is None or (wanted is not None and owner != wanted) or (run_dirs and not _RUN_DIR.fullmatch(name)):
                continue
            path = os.path.join(directory, name)
            try:
                info = os.lstat(path)
            except FileNotFoundError:
                continue
            if info.st_uid != os.getuid() or stat.S_ISDIR(info.st_mode) != run_dirs:
                continue
            entry = jobs.setdefault(owner, JobFiles(owner))
            entry.paths.append(path)
            entry.nbytes += 0 if run_dirs else info.st_size
    processes = _job_processes(set(jobs))
    for entry in jobs.values():
        launcher = _live_launcher(announce_path(entry.job))
        others = [what for what in processes.get(entry.job, []) if what != f"pid {launcher} (launcher)"]
        entry.live = ([f"launcher pid {launcher}"] if launcher else []) + others
    return list(jobs.values())


def remove(entry: JobFiles) -> list[str]:
    """Unlink a job's files (never a live job's); returns the ones that could not be removed, with why."""
    assert not entry.live, f"job {entry.job} is live"
    failed = []
    for path in entry.paths:
        try:
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as err:
            failed.append(f"{path}: {err.strerror}")
    return failed


def running_here(job: str, nodes: Iterable[int], local: bool) -> str | None:
    """Why a new launcher of ``job`` that runs ``nodes`` must not start on this host, or None. A keeper of one of
    those nodes holds its socket (its snapshots are that node's files, which a second start would unlink), or,
    in local mode (every node on this host), the job's launcher runs."""
    for node in nodes:
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.bind("\0" + socket_name(job, node))
        except OSError as err:
            if err.errno == errno.EADDRINUSE:
                return f"job {job} already runs node {node} on this host (its keeper holds the node's snapshots)"
        finally:
            probe.close()
    launcher = _live_launcher(announce_path(job)) if local else None
    return f"job {job} already runs on this host (launcher pid {launcher})" if launcher else None


def planted_files(job: str) -> str | None:
    """Why ``job`` must not start on this host for what lies at the names of its files in the shm dir, or None:
    anything there but a regular file of this user (a symbolic link, a FIFO, another user's file). The shm dir is
    every user's, so someone else may have put it there for ftrun to write through, fill or load; ftrun never
    opens such a thing (:func:`~ftrun.control.spec.open_shm_file`), and says so here, before it starts."""
    try:
        names = sorted(os.listdir(shm_dir()))
    except OSError:
        return None
    for name in names:
        path = os.path.join(shm_dir(), name)
        if job_of(name) != safe_job_id(job):
            continue
        try:
            what = foreign_file(os.lstat(path))
        except FileNotFoundError:
            continue
        if what is None:
            continue
        return (f"{path} is {what}, not a file of this user's ftrun (planted by someone else?): ftrun will not "
                "write through it nor load it; remove it, or choose another --rdzv-id")
    return None


def claim_nodes(job: str, nodes: Iterable[int]) -> tuple[list[socket.socket], str | None]:
    """This host's claim on ``job``'s ``nodes``, held while the returned sockets are open (abstract Unix sockets,
    released when the process ends, whatever ends it): a second launcher of the job for one of those nodes on this
    host fails here, also one that passed :func:`running_here` at the same moment (it probes and lets go), before
    it touches the job's files (``--no-resume`` moves the steps aside). ``(sockets, None)``, or ``([], why)`` with
    nothing held."""
    held: list[socket.socket] = []
    for node in nodes:
        claim = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            claim.bind(f"\0ftrun-launcher-{job}-node{node}")
        except OSError as err:
            claim.close()
            for other in held:
                other.close()
            if err.errno != errno.EADDRINUSE:
                raise
            return [], f"job {job} already runs node {node} on this host (another launcher claimed it)"
        held.append(claim)
    return held, None


def _live_launcher(path: str) -> int | None:
    """The pid in a launcher's announce file when it is a running ftrun started before the file was written."""
    try:
        with open(path) as f:
            pid = int(json.load(f)["pid"])
        written = os.stat(path).st_mtime
        proc = psutil.Process(pid)
        alive = proc.status() != psutil.STATUS_ZOMBIE and proc.create_time() <= written + 1
        return pid if alive and any("ftrun" in part for part in proc.cmdline()) else None
    except (OSError, ValueError, KeyError, TypeError, psutil.Error):
        return None


def _job_processes(jobs: set[str]) -> dict[str, list[str]]:
    """job -> "pid N (what)" for every process of this user that carries one of ``jobs`` in its environment."""
    found: dict[str, list[str]] = {}
    if not jobs:
        return found
    for proc in psutil.process_iter():
        try:
            env = proc.environ()
            if proc.status() == psutil.STATUS_ZOMBIE:
                continue
            job = env.get(ENV_JOB_ID)
            if job not in jobs and ENV_NODE_SPEC in env:
                job = json.loads(env[ENV_NODE_SPEC]).get("job_id")
            if job in jobs:
                found.setdefault(job, []).append(f"pid {proc.pid} ({_label(proc)})")
        except (psutil.Error, OSError, ValueError, AttributeError):
            continue
    return found


def _label(proc: psutil.Process) -> str:
    """``launcher``, ``supervisor``, ``keeper``, ``zygote``, ``ready trainer``, ``trainer``, or the process name.
    Supervisors, zygotes and trainers are forks of the launcher, with its argv: they are told by their process
    names (a trainer's parent is its supervisor); a supervisor or trainer started as a new interpreter by its
    module."""
    names = {LAUNCHER_NAME: "launcher", SUPERVISOR_NAME: "supervisor", ZYGOTE_NAME: "zygote",
             READY_NAME: "ready trainer"}
    if proc.name() in names:
        return names[proc.name()]
    argv = proc.cmdline()
    module = argv[argv.index("-m") + 1] if "-m" in argv[:-1] else ""
    if module in ("ftrun.snapshot.keeper", SUPERVISOR_MODULE):
        return module.rpartition(".")[2]
    parent = proc.parent()
    if module == "ftrun.launch.bootstrap" or (parent is not None and parent.name() == SUPERVISOR_NAME):
        return "trainer"
    return proc.name()
