"""What the launcher hands to each supervisor it starts: one JSON document in :data:`ENV_NODE_SPEC`."""

from __future__ import annotations

import contextlib
import errno
import glob
import hashlib
import json
import os
import re
import shutil
import signal
import stat
import tempfile
from dataclasses import asdict, dataclass, field

from ftrun.errors import UsageError, natural

ENV_NODE_SPEC = "FTRUN_NODE_SPEC"
ENV_SHM_DIR = "FTRUN_SHM_DIR"
DEFAULT_SHM_DIR = "/dev/shm"
ETCD_PORT = 2379  # an etcd member's port when its endpoint names none

# Exit codes of a supervisor; any other code means the supervisor itself crashed.
EXIT_DONE = 0
EXIT_JOB_FAILED = 3
EXIT_STOPPED = 4
EXIT_STOPPED_UNSAVED = 5  # stopped, but the final persist to the checkpoint directory did not complete
EXIT_REPLACED = 6  # this node was seen as lost and a spare took its node rank: it left the job
# Under srun: the step cannot go on (a lost node that nothing replaces, or node 0's c10d control store gone); the
# node's snapshots stay in its RAM for the next step of the job, which adopts them
EXIT_STEP_ENDED = 7
# The kind of a generation that stops the whole job: a supervisor was told to stop (SIGTERM, SIGINT), and every
# node follows. Its ``detected_by`` is the signal's name (SIGTERM: the job exits 143 like a signalled launcher).
STOP_KIND = "stop"
# The kind of a generation that ends a SLURM step whose lost node nothing replaces: no ftrun joins a running step,
# and no spare waits; every node exits with EXIT_STEP_ENDED, keeping its snapshots for the next step
STEP_END_KIND = "step-end"
# torchrun's --signals-to-handle default: each stops the job gracefully, as SIGTERM does
DEFAULT_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
# --signals-to-handle SIGUSR1/SIGUSR2 (SLURM's pre-emption warnings) reach every trainer: the launcher passes them
# to the supervisors as these (a supervisor's own SIGUSR1/2 may come from SLURM too), the supervisors to the trainers
FORWARDED_SIGNALS = {signal.SIGUSR1: signal.SIGRTMIN + 1, signal.SIGUSR2: signal.SIGRTMIN + 2}


@dataclass(frozen=True)
class NodeSpec:
    """Everything one supervisor needs: its place in the job, the command to run, and the tunables."""

    job_id: str
    node_rank: int
    nnodes: int
    nproc_per_node: int
    store_host: str
    store_port: int
    master_addr: str  # the address of this node as peers reach it (its trainer store, its keeper)
    target: str
    args: list[str]
    module: bool
    no_python: bool
    cwd: str
    omp_threads: int
    max_restarts: int
    rdzv_timeout: float
    hang_timeout: float
    hang_timeout_initial: float
    hang_step_factor: float
    node_timeout: float
    stop_grace: float
    zygote: bool
    ec_group: int = 1  # EC group size G (1: no redundancy)
    ec_parity: int = 0  # parity per group m
    ec_backend: str = "isa_l_rs_vand"
    ckpt_dir: str | None = None  # durable tier (absolute path); None: off
    persist_every: int = 10  # persist every N globally committed steps
    keep: int = 2  # complete persisted steps kept
    ckpt_format: str = "ftrun"  # "dcp": node 0 also writes each persisted step in DCP's format (step-N/dcp)
    persist_grace: float = 60.0  # seconds allowed for the final persist when stopping
    log_dir: str | None = None
    faults: list[str] = field(default_factory=list)
    bind_addr: str = "127.0.0.1"  # the address this node's listening sockets bind (local mode: loopback)
    run: int = 0  # the job's run (incarnation) whose control-store keys this node uses
    rdzv_backend: str = "c10d"  # the control store: "c10d" (a TCPStore at store_host:store_port) or "etcd"
    rdzv_endpoint: str = ""  # etcd: the members' host:port, comma-separated
    rdzv_conf: dict[str, str] = field(default_factory=dict)  # etcd: TLS and authentication settings
    spare: str = ""  # a hot spare's name: no node rank yet (node_rank -1) until it claims a lost one
    # a replacement its launcher started for a lost supervisor of a multi-node job: the incarnation that was lost
    # (0: it never took the rank), from which alone it takes the rank, as a spare claims it (None: whoever holds it)
    replaces: int | None = None
    # a node of a SLURM step (srun): nothing but a spare can take a lost node's rank (see STEP_END_KIND)
    slurm_step: bool = False
    monitor_interval: float = 0.02  # seconds between two looks at the trainers (--monitor-interval)
    role: str = "default"  # the trainers' ROLE_NAME (--role)
    signals_to_handle: str = DEFAULT_SIGNALS  # the trainers' TORCHELASTIC_SIGNALS_TO_HANDLE
    virtual_local_rank: bool = False  # LOCAL_RANK 0 and CUDA_VISIBLE_DEVICES of its own device per trainer
    # where the trainers' stdout/stderr go (ftrun.launch.output): torchrun's stream values and filters
    redirects: str = "0"
    tee: str = "0"
    local_ranks_filter: str | None = None
    duplicate_stdout_filters: list[str] = field(default_factory=list)
    duplicate_stderr_filters: list[str] = field(default_factory=list)
    label_output: bool = False

    def encode(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_env(cls) -> NodeSpec:
        return cls(**json.loads(os.environ[ENV_NODE_SPEC]))


def split_endpoint(endpoint: str, any_port: bool = False) -> tuple[str, int]:
    """``host:port`` (``--rdzv-endpoint``, an etcd member) -> (host, port); a bad one is a :class:`UsageError`
    (also a host that is no host name, which resolving it would raise as a UnicodeError). ``any_port``: port 0 (any
    free one) is one too."""
    host, sep, text = endpoint.rpartition(":")
    port = natural(text)
    if not sep or not host or port is None or not (0 if any_port else 1) <= port < 65536:
        raise UsageError(f"--rdzv-endpoint must be HOST:PORT, got {endpoint!r}")
    if "," in host:  # a node would try to resolve it until --rdzv-timeout
        raise UsageError(f"--rdzv-endpoint must be one HOST:PORT for a c10d control store, got {endpoint!r} (a list "
                         "of members is for --rdzv-backend etcd)")
    try:
        host.strip("[]").encode("idna")  # as the socket module encodes a host name to resolve it
    except UnicodeError:
        raise UsageError(f"--rdzv-endpoint host {host!r} is not a host name (a label of it is empty or longer than "
                         "63 characters)") from None
    return host.strip("[]"), port


def with_port(endpoints: str, default: int) -> str:
    """``endpoints`` (comma-separated) with ``:default`` added to each that names a host only (``node0``,
    ``[::1]``), as torchrun reads a rendezvous endpoint."""
    members = [member.strip() for member in endpoints.split(",")]
    return ",".join(f"{member}:{default}" if member and (member.endswith("]") or ":" not in member) else member
                    for member in members)


def safe_job_id(job_id: str) -> str:
    """The job id as used in file and directory names: letters, digits, '.', '_' and '-' only, at most 64 of them.
    An id that is not one already (or is ``.`` or ``..``) gets a hash of the whole id after its cleaned start, so
    that two ids never share a name (``a/b`` and ``a_b``, two long ids with the same first 64 characters) and none
    names a directory above the checkpoint directory. Idempotent."""
    if re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", job_id) and job_id not in (".", ".."):
        return job_id
    digest = hashlib.sha256(job_id.encode(errors="surrogateescape")).hexdigest()[:12]
    return f"{re.sub(r'[^A-Za-z0-9_-]', '_', job_id)[:51]}-{digest}"


def shm_dir() -> str:
    """Where ftrun's shared-memory files live: ``$FTRUN_SHM_DIR`` (any tmpfs), else /dev/shm."""
    return os.environ.get(ENV_SHM_DIR) or DEFAULT_SHM_DIR


def foreign_file(info: os.stat_result) -> str | None:
    """What ``info`` (of ``os.lstat`` or ``os.fstat``) shows at a name of ftrun's in the shared-memory directory
    when it is not a regular file of this user ("a symbolic link", "not a regular file", "a file of user N"), else
    None: nothing ftrun made, so nothing it may write through, fill, load or block on."""
    if stat.S_ISLNK(info.st_mode):
        return "a symbolic link"
    if not stat.S_ISREG(info.st_mode):
        return "not a regular file"
    return f"a file of user {info.st_uid}" if info.st_uid != os.geteuid() else None


def open_shm_file(path: str, flags: int) -> int:
    """``os.open(path, flags)`` for a file of ftrun's in the shared-memory directory, which every user may write
    (/dev/shm): never through a symbolic link, and only a regular file of this user (a new one gets mode 0600).
    So nobody else can plant a link there that makes ftrun overwrite or truncate another file, nor a file of theirs
    (or a FIFO) that ftrun would fill with training state, load as a snapshot, or block on. Anything else at
    ``path`` is a :class:`PermissionError` naming it and its owner."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o600)
    except OSError as err:
        if err.errno in (errno.ELOOP, errno.ENXIO):  # a link; a FIFO with no reader (O_WRONLY)
            raise PermissionError(err.errno, "a symbolic link or FIFO, not a file of ftrun's: left alone", path)
        raise
    what = foreign_file(os.fstat(fd))
    if what is not None:
        os.close(fd)
        raise PermissionError(errno.EPERM, f"{what}, not a file of ftrun's of this user ({os.geteuid()}): left "
                              "alone", path)
    return fd


def write_shm_file(path: str, text: str) -> None:
    """Write ``text`` to ``path`` in the shared-memory directory, mode 0600, atomically (through a new file of this
    process's own, removed when it fails: see :func:`open_shm_file`). A full or unwritable directory, or a file of
    another user in the way, is a :class:`UsageError` saying so."""
    temporary = f"{path}.{os.getpid()}"
    try:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)  # one this pid left in an earlier life (another user's: PermissionError)
        fd = open_shm_file(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(temporary, path)
    except OSError as err:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        free = shutil.disk_usage(os.path.dirname(path)).free if os.path.isdir(os.path.dirname(path)) else 0
        raise UsageError(f"cannot write {path}: {err.strerror or err} ({free / 2**20:.1f} MiB free there; ftrun "
                         f"keeps its snapshots in this directory too: {ENV_SHM_DIR} names another tmpfs)") from None


def boot_id() -> str:
    """This boot of this machine's kernel (``/proc/sys/kernel/random/boot_id``); "" when it cannot be read."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def shm_place() -> str:
    """Which shared-memory directory this process's files go to, as a name equal for two processes exactly when
    they share it: this boot's id and the directory's device and inode (a host name can be shared by hosts, and
    one host's containers can each have a /dev/shm of their own); "" when it cannot be told."""
    boot = boot_id()
    try:
        found = os.stat(shm_dir())
    except OSError:
        return ""
    return f"{boot}/{found.st_dev}/{found.st_ino}" if boot else ""


def shm_path(job_id: str, node_rank: int, what: str) -> str:
    """Path of a shared-memory file of this job and node (every segment of ftrun is named this way)."""
    return os.path.join(shm_dir(), f"ftrun-{safe_job_id(job_id)}-node{node_rank}-{what}")


def announce_path(job_id: str) -> str:
    """The launcher's announce file of this job on this host (see ``ftrun.launch.launcher.announce_job``)."""
    return os.path.join(shm_dir(), f"ftrun-{safe_job_id(job_id)}-launcher")


def run_dir_prefix(job_id: str, node_rank: int) -> str:
    """How the name of a supervisor's run directory starts (in the temp dir: its trainers' error files, without
    ``--log-dir``)."""
    return f"ftrun-{safe_job_id(job_id)}-node{node_rank}-"


def nodes_with_files(job_id: str) -> set[int]:
    """The node ranks of this job that have shared-memory files on this host."""
    prefix = f"ftrun-{safe_job_id(job_id)}-node"
    found = (re.match(r"(\d+)-", name[len(prefix):]) for name in os.listdir(shm_dir()) if name.startswith(prefix))
    return {int(match.group(1)) for match in found if match}


def unlink_node_files(job_id: str, node_rank: int) -> None:
    """Unlink every shared-memory file and run directory of this job and node (what a killed supervisor or
    keeper left)."""
    for path in glob.glob(shm_path(job_id, node_rank, "*")):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    for path in glob.glob(os.path.join(tempfile.gettempdir(), glob.escape(run_dir_prefix(job_id, node_rank)) + "*")):
        shutil.rmtree(path, ignore_errors=True)
