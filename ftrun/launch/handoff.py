"""How the processes of a job on this host start, with torch imported once per host, not once per process.

1. ``ftrun`` (:mod:`ftrun.cli`, no torch) parses the command line, and :func:`begin` checks what needs no
   torch (the script exists, the simulated nodes fit this host) and names the job.
2. :func:`exec_launcher` replaces that process (same pid) by ``python -P -m ftrun.launch.launcher`` with the job
   id in its environment (``FTRUN_JOB_ID``: every process of the job, forks included, shows it in
   ``/proc/PID/environ``, by which ``ftrun clean`` and the tests tell a job's processes) and the parsed settings
   in an anonymous memory file. That process imports torch (about 1.5 s here), the only import of it this host
   makes for the job.
3. Before it starts any thread or connection, the launcher forks the supervisors of this host (as
   :class:`PendingSupervisor`; each forks its zygote, which forks the trainers): none imports torch again.
   A fork waits on a pipe that only it and the launcher share until the launcher, its control store up, hands
   it its :class:`~ftrun.control.spec.NodeSpec` and the job secret (:meth:`PendingSupervisor.hand`), neither of
   which ever appears in a process environment. In local mode it forks m more (at least one) for the first lost
   nodes. A supervisor needed later (a replacement once those are used; the launcher runs threads by then) is a
   new interpreter instead (:func:`start`), handed its spec the same way.

A launcher that stops before handing over closes the pipe: the supervisor reads end-of-file and exits 0
having done nothing (:func:`receive` returns None).
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import signal
import stat
import subprocess
import sys
import uuid
from dataclasses import asdict, dataclass, field
from typing import IO, TYPE_CHECKING, NoReturn

from ftrun.control.spec import ENV_SHM_DIR, FORWARDED_SIGNALS, NodeSpec, safe_job_id, shm_dir
from ftrun.errors import UsageError
from ftrun.launch.capacity import local_fit_problem, node_fit_problem, this_host
from ftrun.launch.env import CPP_LOG_LEVEL, ENV_JOB_ID, ENV_QUIET_CPP_LOG
from ftrun.launch.import_settings import ImportSetting, import_time_settings
from ftrun.launch.processes import ForkedChild, die_with_parent
from ftrun.startup import STARTUP_ENVIRON

if TYPE_CHECKING:  # the supervisor imports this module for receive(): not the config's (yaml, ...)
    from ftrun.launch.config import JobConfig

ENV_HANDOFF_FD = "FTRUN_HANDOFF_FD"  # the read end of the pipe the spec comes on
ENV_LAUNCH_FD = "FTRUN_LAUNCH_FD"  # the memory file with the launcher's settings (exec_launcher -> resume)
SUPERVISOR_MODULE = "ftrun.launch.supervisor"
LAUNCHER_MODULE = "ftrun.launch.launcher"
STARTUP_SIGNALS = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}  # what stops a launcher that is starting
SHM_FLOOR = 1 << 20  # bytes free in the shm dir before a job starts


@dataclass
class PendingSupervisor:
    """A supervisor process waiting for its spec."""

    proc: subprocess.Popen[bytes] | ForkedChild
    pipe: int | None  # write end; None once handed over or cancelled

    def hand(self, spec: NodeSpec, secret: str) -> subprocess.Popen[bytes] | ForkedChild:
        """Give the supervisor its spec and the job secret; returns its process."""
        assert self.pipe is not None, "handed over already"
        data = (json.dumps({"spec": asdict(spec), "secret": secret}) + "\n").encode()
        try:
            with open(self.pipe, "wb", closefd=True) as pipe:
                pipe.write(data)
        except BrokenPipeError:
            pass  # it died while importing: the launcher sees its exit like any supervisor's
        self.pipe = None
        return self.proc

    def cancel(self) -> None:
        """Not needed after all: the supervisor exits 0 without starting anything."""
        if self.pipe is not None:
            os.close(self.pipe)
            self.pipe = None


def prepare_supervisor(launcher: int) -> None:
    """In a new supervisor process (forked, or before its exec): it dies with ``launcher``, and SIGUSR1/SIGUSR2
    (SLURM's warnings, sent to every process of a step) and the signals the launcher forwards them as are ignored
    until it handles them (one that comes before is lost, never fatal as it is by default): so are they in what
    it starts before (its zygote, a keeper started ahead)."""
    die_with_parent(launcher)
    for forwarded in (*FORWARDED_SIGNALS, *FORWARDED_SIGNALS.values()):
        signal.signal(forwarded, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STARTUP_SIGNALS)  # held by a launcher that is starting


def start(output: IO[bytes] | None = None) -> PendingSupervisor:
    """Start a supervisor as a new interpreter that waits for its spec (stdout and stderr to ``output``, or
    inherited); it dies with this process. It starts from the environment the launcher started with, which names
    the job (:func:`exec_launcher`), not what the launcher's imports wrote since (:mod:`ftrun.startup`)."""
    read, write = os.pipe()
    env = {name: value for name, value in STARTUP_ENVIRON.items() if name != ENV_LAUNCH_FD}
    env[ENV_HANDOFF_FD] = str(read)
    launcher = os.getpid()
    try:
        proc = subprocess.Popen([sys.executable, "-P", "-m", SUPERVISOR_MODULE], env=env, pass_fds=(read,),
                                stdout=output, stderr=output, start_new_session=True,
                                preexec_fn=lambda: prepare_supervisor(launcher))
    except BaseException:
        os.close(write)
        raise
    finally:
        os.close(read)
    return PendingSupervisor(proc, write)


def receive(fd: int | None = None) -> tuple[NodeSpec, str] | None:
    """In the supervisor: its spec and the job secret, once the launcher hands them over on ``fd`` (a started
    one: the descriptor in its environment); None: it never will."""
    if fd is None:
        fd = int(os.environ.pop(ENV_HANDOFF_FD))
    with open(fd, "rb") as pipe:
        line = pipe.readline()
    if not line:
        return None
    doc = json.loads(line)
    return NodeSpec(**doc["spec"]), str(doc["secret"])


@dataclass
class Begun:
    """What the launcher's first half found."""

    target: str  # the script's absolute path, the executable's (--no-python), or the module name (-m)
    job_id: str
    # why the trainers start as new interpreters though the zygote was not turned off (ftrun.launch.import_settings)
    no_zygote_because: list[ImportSetting] = field(default_factory=list)


def begin(cfg: JobConfig, script: str) -> Begun:
    """Check the script and this host, and name the job; raises :class:`UsageError` on bad input. A script
    that sets torch's import-time variables before it imports torch turns the zygote off."""
    target = resolve_target(cfg, script)
    check_directories(cfg)
    check_shm_dir()
    host = this_host()
    problem = (local_fit_problem(cfg.nnodes, cfg.nproc_per_node, host, cfg.spares) if cfg.local_mode
               else node_fit_problem(cfg.nproc_per_node, host))
    if problem:
        raise UsageError(problem)
    settings = import_time_settings(target, cfg.module, os.environ) if cfg.zygote and not cfg.no_python else []
    if settings:
        cfg.zygote = False
    return Begun(target, job_id_for(cfg), settings)


def exec_launcher(cfg: JobConfig, begun: Begun, args: list[str]) -> NoReturn:
    """Become the launcher process (see the module docstring); ``ps`` shows the command line after it."""
    fd = os.memfd_create("ftrun-launch", 0)
    os.set_inheritable(fd, True)  # the new program reads it
    with open(fd, "wb", closefd=False) as f:  # read back by resume() in this same process, after exec
        pickle.dump((cfg, begun, args), f)
    os.lseek(fd, 0, os.SEEK_SET)
    close_inherited(keep=fd)
    # held (blocked, not lost) until the launcher can stop cleanly: its interpreter's start and its imports (1-4 s)
    # would otherwise end in a traceback, or lose the signal in a fork's handlers
    signal.pthread_sigmask(signal.SIG_BLOCK, STARTUP_SIGNALS)
    # SLURM's warnings (--signal=USR1@90: to every process of a step) are ignored from the exec on, by the
    # launcher until it handles them and by every ftrun process it starts (prepare_supervisor); trainers get their
    # default action back (ftrun.launch.zygote, a new interpreter's exec)
    for warning in FORWARDED_SIGNALS:
        signal.signal(warning, signal.SIG_IGN)
    env = dict(STARTUP_ENVIRON)  # the user's: nothing this process's imports wrote (ftrun.startup)
    env[ENV_JOB_ID] = begun.job_id
    env[ENV_LAUNCH_FD] = str(fd)
    if CPP_LOG_LEVEL not in env:  # no C++ stacks before ftrun's own one-line reports (ftrun.launch.env)
        env[CPP_LOG_LEVEL], env[ENV_QUIET_CPP_LOG] = "ERROR", "1"
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-P", "-m", LAUNCHER_MODULE, *sys.argv[1:]], env)


def close_inherited(keep: int) -> None:
    """Let no descriptor this process inherited (beyond stdin, stdout and stderr) reach the launcher, and through
    it the trainers: torchrun starts its trainers with ``close_fds``, and a descriptor of the user's shell or
    build tool held open by every process of a job can keep a pipe from ever ending."""
    for name in os.listdir("/proc/self/fd"):
        descriptor = int(name)
        if descriptor > 2 and descriptor != keep:
            try:
                os.set_inheritable(descriptor, False)
            except OSError:  # the listing's own descriptor, closed since
                pass


def resume() -> tuple[JobConfig, Begun, list[str]]:
    """In the launcher: the settings :func:`exec_launcher` passed on."""
    with open(int(os.environ.pop(ENV_LAUNCH_FD)), "rb") as f:
        cfg, begun, args = pickle.load(f)  # written by this same process before its exec: never foreign bytes
    return cfg, begun, args


def resolve_target(cfg: JobConfig, target: str) -> str:
    """Check that the script (or executable) exists before anything starts; a script's path is kept as given
    (relative to the launcher's directory, where every trainer runs)."""
    if cfg.module:  # found when the trainers import it; what can never be a module's name is refused here
        if not target.strip() or os.sep in target:
            raise UsageError(f"-m {target!r} is not a module name (a dotted name such as pkg.train)"
                             + (": for a file, drop -m" if os.path.isfile(target) else ""))
        if target.endswith(".py") and os.path.isfile(target):
            raise UsageError(f"-m {target}: {target} is a file, not a module name (drop -m, or -m "
                             f"{target.removesuffix('.py')})")
        return target
    if cfg.no_python:
        found = shutil.which(target)
        if found is None:
            raise UsageError(_no_executable(target))
        return found
    if os.path.isdir(target):  # as python: a directory (or a zip file) runs its __main__.py
        if not os.path.isfile(os.path.join(target, "__main__.py")):
            raise UsageError(f"cannot run directory {target}: it has no __main__.py")
    elif not os.path.exists(target):
        raise UsageError(f"script not found: {target}")
    elif not os.path.isfile(target):  # a FIFO or a device reads once; every trainer and restart reads the script
        raise UsageError(f"script {target} is not a regular file (a pipe or device can be read only once)")
    return target  # as given, as python keeps it in sys.argv[0]: the trainers run in this directory


def _no_executable(target: str) -> str:
    """Why ``--no-python`` cannot run ``target`` (which :func:`shutil.which` did not find), in one line."""
    if os.sep not in target and os.path.isfile(target):  # as execvp, the trainers look only on PATH
        return f"executable not found: {target} is not on PATH; ./{target} runs the one in this directory"
    if os.sep in target and os.path.isdir(target):
        return f"--no-python: {target} is a directory, not an executable"
    if os.sep in target and os.path.exists(target):
        return (f"--no-python: {target} is not executable (chmod +x it, or drop --no-python to run it with "
                "Python)")
    return f"executable not found: {target}"


def check_directories(cfg: JobConfig) -> None:
    """--log-dir and --ckpt-dir are directories this process can write to (created, mode 0700, if missing), and no
    directory that every user may write (/tmp, say): there anyone could put a link at the name of a file or
    directory ftrun makes (``events.jsonl``, a rank's log, the job's checkpoint directory), and ftrun would write
    its logs through it, or its checkpoints where they could read and change them before a resume loads them."""
    for flag, path in (("--log-dir", cfg.log_dir), ("--ckpt-dir", cfg.ckpt_dir)):
        if path is None:
            continue
        if os.path.exists(path) and not os.path.isdir(path):
            raise UsageError(f"{flag} {path} is not a directory")
        mode = os.stat(path).st_mode if os.path.isdir(path) else 0
        if mode & stat.S_IWOTH:
            raise UsageError(f"{flag} {path} is writable by every user (mode {stat.S_IMODE(mode):o}): "
                             "others could plant links there that ftrun would write through; give a directory of "
                             "your own in it (ftrun makes it, mode 0700)")
        try:
            os.makedirs(path, mode=0o700, exist_ok=True)
        except OSError as err:
            raise UsageError(f"{flag} {path}: cannot create the directory ({err.strerror})") from None
        problem = file_problem(path)
        if problem is not None:
            raise UsageError(f"{flag} {path}: cannot write a file in the directory ({problem})")


def file_problem(directory: str) -> str | None:
    """Why no file can be made in ``directory`` (the error's text), or None: a real file is made and removed, not
    ``os.access``, which root passes where no file can be made (/proc, a full quota, no inode left)."""
    probe = os.path.join(directory, f".ftrun-probe-{os.getpid()}")
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        os.unlink(probe)
    except OSError as err:
        return err.strerror or str(err)
    return None


def check_shm_dir() -> None:
    """The shm dir (``/dev/shm``, or ``$FTRUN_SHM_DIR``) is a directory this process can write to, with room for
    a job's small files (:data:`SHM_FLOOR`: the launcher's, the heartbeat tables); the keepers check the room
    for snapshots once their size is known."""
    directory = shm_dir()
    where = f"{directory} ({ENV_SHM_DIR})" if os.environ.get(ENV_SHM_DIR) else directory
    if not os.path.isabs(directory) or not os.path.isdir(directory) or not os.access(directory, os.W_OK | os.X_OK):
        raise UsageError(f"the shared-memory directory {where} is not a writable directory (an absolute path "
                         "of a tmpfs)")
    stats = os.statvfs(directory)
    free = stats.f_bavail * stats.f_frsize
    if free < SHM_FLOOR:
        raise UsageError(f"the shared-memory directory {where} has {free >> 10} KiB free; ftrun needs at least "
                         f"{SHM_FLOOR >> 20} MiB there before any snapshot")
    problem = file_problem(directory)
    if problem is not None:  # no inode left (a tmpfs's nr_inodes), a security module's denial
        raise UsageError(f"the shared-memory directory {where}: cannot make a file there ({problem})")


def job_id_for(cfg: JobConfig) -> str:
    if cfg.rdzv_id:
        return safe_job_id(cfg.rdzv_id)
    if cfg.local_mode:
        return "job-" + uuid.uuid4().hex[:8]
    return "job-" + hashlib.sha1(str(cfg.rdzv_endpoint).encode()).hexdigest()[:8]
