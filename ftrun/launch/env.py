"""The environment of a trainer: torchrun's contract plus ftrun's own ``FTRUN_*`` variables.

torchrun's variables (the contract scripts rely on) are set exactly as torchrun's local elastic agent sets
them, with one deliberate difference: ``TORCHELASTIC_RESTART_COUNT`` is the job-wide generation, the same on
every node. ``MASTER_ADDR``/``MASTER_PORT`` name the trainer store of the generation, hosted by node 0's
supervisor (hence ``TORCHELASTIC_USE_AGENT_STORE=True``). ``GLOO_SOCKET_IFNAME``, unless the user set it,
is the interface that holds the node's address as its peers reach it (``--local-addr``, the bound address), or
the loopback interface when that store is on loopback (every node on this host): gloo otherwise binds to what
the host name resolves to, which other hosts often cannot reach (:func:`gloo_interface`).

The rest is the environment ftrun was started with (:data:`ftrun.startup.STARTUP_ENVIRON`), as torchrun's
workers get the environment torchrun was started with: not what the imports of ftrun's own processes wrote
(threadpoolctl's ``KMP_DUPLICATE_LIB_OK``, torch inductor's ``TORCHINDUCTOR_CACHE_DIR``); a user's own value of
those reaches the trainers as it was. Of ftrun's own variables a trainer gets only the client's
(:data:`TRAINER_FTRUN_VARIABLES`) and the user's settings (:data:`USER_FTRUN_VARIABLES`): every other ``FTRUN_*``
variable is an internal of the launcher, supervisor or keeper (the node spec with the control store's address, the
job secret) and is removed.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from string import Template

import psutil

from ftrun.control.faults import ENV_TRAINER_FAULTS
from ftrun.control.spec import DEFAULT_SIGNALS, ENV_SHM_DIR
from ftrun.errors import natural
from ftrun.control.heartbeat import ENV_HEARTBEAT_FILE, ENV_HEARTBEAT_SLOT
from ftrun.snapshot.dcp_copy import ENV_DCP_ROOT
from ftrun.snapshot.protocol import ENV_KEEPER_SOCKET

ENV_JOB_ID = "FTRUN_JOB_ID"
ENV_NODE_RANK = "FTRUN_NODE_RANK"
ENV_ERROR_FILE = "TORCHELASTIC_ERROR_FILE"  # a trainer's error file; ftrun's own: a failed job's cause
TRAINER_FTRUN_VARIABLES = (ENV_JOB_ID, ENV_NODE_RANK, ENV_HEARTBEAT_FILE, ENV_HEARTBEAT_SLOT, ENV_KEEPER_SOCKET,
                           ENV_TRAINER_FAULTS, ENV_DCP_ROOT)
USER_FTRUN_VARIABLES = (ENV_SHM_DIR,)

TORCHRUN_VARIABLES = (
    "RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE", "WORLD_SIZE",
    "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE",
    "TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_SIGNALS_TO_HANDLE", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "OMP_NUM_THREADS",
)


@dataclass(frozen=True)
class TrainerPlace:
    """Where one trainer sits in the job and in which generation it runs."""

    job_id: str
    node_rank: int
    nnodes: int
    local_rank: int
    nproc_per_node: int
    generation: int
    max_restarts: int
    master_addr: str
    master_port: int

    @property
    def rank(self) -> int:
        return self.node_rank * self.nproc_per_node + self.local_rank

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node


# torch's C++ log level, which the launcher sets to ERROR for ftrun's own processes where the user did not set it:
# their store clients' warnings print a C++ stack (about 50 lines) before the one line ftrun says about the same
# fault. ENV_QUIET_CPP_LOG marks that ftrun set it, so that trainers get the user's environment without it.
CPP_LOG_LEVEL = "TORCH_CPP_LOG_LEVEL"
ENV_QUIET_CPP_LOG = "FTRUN_QUIET_CPP_LOG"
C_INT_MAX = 2**31 - 1  # the largest thread count a BLAS's set_num_threads(int) takes


def trainer_threads(base: Mapping[str, str], omp_threads: int) -> int | None:
    """The OMP_NUM_THREADS that :func:`trainer_env` gives a trainer, as a number (None: the user's value is not
    one, see :func:`thread_count`)."""
    return thread_count(base.get("OMP_NUM_THREADS", str(omp_threads)))


def thread_count(value: str) -> int | None:
    """``value`` of OMP_NUM_THREADS as the thread count OpenMP reads in it, or None when it reads none: ASCII
    digits only (:func:`~ftrun.errors.natural`), from 1 to what a C int holds (BLAS and torch take an int)."""
    count = natural(value)
    return count if count is not None and 0 < count <= C_INT_MAX else None


def default_omp_threads(trainers_on_host: int) -> int:
    """The cores this process may run on (its CPU affinity: a SLURM or container cpuset, ``taskset``; not all of
    the host's) shared fairly among the trainers of this host (oversubscribed OpenMP is 10x slower here)."""
    return max(1, len(os.sched_getaffinity(0)) // max(1, trainers_on_host))


def trainer_env(base: dict[str, str], place: TrainerPlace, *, omp_threads: int, heartbeat_file: str,
                keeper_socket: str, error_file: str, faults: str, role: str = "default",
                signals_to_handle: str = DEFAULT_SIGNALS, virtual_local_rank: bool = False,
                dcp_root: str | None = None, node_addr: str | None = None) -> dict[str, str]:
    """The environment of the trainer at ``place``, from ``base``: the environment ftrun started with (module
    doc). ``role`` is torchrun's --role, ``signals_to_handle`` its
    --signals-to-handle (set, as torchrun sets it); ``virtual_local_rank``: LOCAL_RANK 0 and CUDA_VISIBLE_DEVICES
    of the trainer's own device (picked from the inherited CUDA_VISIBLE_DEVICES, as torchrun does); ``dcp_root``:
    the job's durable directory (``ftrun.dcp.MemoryReader`` looks there for DCP copies of its steps); ``node_addr``:
    this node's address as its peers reach it (gloo's interface: :func:`gloo_interface`)."""
    env = {k: v for k, v in base.items() if not k.startswith("FTRUN_") or k in USER_FTRUN_VARIABLES}
    if base.get(ENV_QUIET_CPP_LOG):  # ftrun's own processes only (exec_launcher); the user's trainers as they were
        env.pop(CPP_LOG_LEVEL, None)
    env.update({
        "RANK": str(place.rank),
        "LOCAL_RANK": str(place.local_rank),
        "GROUP_RANK": str(place.node_rank),
        "ROLE_RANK": str(place.rank),
        "ROLE_NAME": role,
        "LOCAL_WORLD_SIZE": str(place.nproc_per_node),
        "WORLD_SIZE": str(place.world_size),
        "GROUP_WORLD_SIZE": str(place.nnodes),
        "ROLE_WORLD_SIZE": str(place.world_size),
        "MASTER_ADDR": place.master_addr,
        "MASTER_PORT": str(place.master_port),
        "TORCHELASTIC_RESTART_COUNT": str(place.generation),
        "TORCHELASTIC_MAX_RESTARTS": str(place.max_restarts),
        "TORCHELASTIC_RUN_ID": place.job_id,
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        ENV_ERROR_FILE: error_file,
        ENV_JOB_ID: place.job_id,
        ENV_NODE_RANK: str(place.node_rank),
        ENV_HEARTBEAT_FILE: heartbeat_file,
        ENV_HEARTBEAT_SLOT: str(place.local_rank),
        ENV_KEEPER_SOCKET: keeper_socket,
        ENV_TRAINER_FAULTS: faults,
    })
    if dcp_root is not None:
        env[ENV_DCP_ROOT] = dcp_root
    env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    env["TORCHELASTIC_SIGNALS_TO_HANDLE"] = signals_to_handle
    if virtual_local_rank:
        visible = base.get("CUDA_VISIBLE_DEVICES")
        devices = visible.split(",") if visible is not None else None
        env["LOCAL_RANK"] = "0"
        env["CUDA_VISIBLE_DEVICES"] = (devices[place.local_rank].strip() if devices is not None
                                       and place.local_rank < len(devices) else str(place.local_rank))
    env.setdefault("OMP_NUM_THREADS", str(omp_threads))
    interface = gloo_interface(node_addr or place.master_addr, place.master_addr)
    if interface is not None:
        env.setdefault("GLOO_SOCKET_IFNAME", interface)
    return env


def trainer_args(args: Sequence[str], local_rank: int) -> list[str]:
    """The script's arguments for the trainer of ``local_rank``: torchrun's ``${local_rank}`` macro replaced by its
    local rank (the node's, also with ``--virtual-local-rank``), as torchrun's agent replaces it
    (``string.Template.safe_substitute``: ``$$`` becomes ``$``, any other ``$`` text is kept), so that
    ``train.py --local_rank=${local_rank}`` gets each trainer's number, not the literal text."""
    return [Template(arg).safe_substitute(local_rank=str(local_rank)) for arg in args]


def gloo_interface(node_addr: str, master_addr: str) -> str | None:
    """The interface gloo's sockets should use: the one holding this node's address as its peers reach it (a
    non-loopback address of this host); the loopback interface when the job's master address is loopback (all
    on this host); else None, and gloo picks by the host name. Left to itself, gloo binds to what the host name
    resolves to: 127.0.1.1 on many distributions, or a host's other network, which the other nodes cannot reach
    ("Gloo connectFullMesh failed ... 127.0.0.1")."""
    own = _address(node_addr)
    if own is not None and not own.is_loopback:
        found = _interface_holding(str(own))
        if found is not None:
            return found
    return _interface_holding("127.0.0.1") if _is_loopback(master_addr) else None


def _address(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        pass
    try:
        return ipaddress.ip_address(socket.gethostbyname(host))
    except (OSError, ValueError):
        return None


def _is_loopback(host: str) -> bool:
    address = _address(host)
    return address is not None and address.is_loopback


def _interface_holding(address: str) -> str | None:
    """The name of the interface holding ``address`` ("lo" for 127.0.0.1 on Linux), or None."""
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.family in (socket.AF_INET, socket.AF_INET6) and a.address.split("%")[0] == address
               for a in addresses):
            return name
    return None
