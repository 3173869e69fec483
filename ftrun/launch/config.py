"""Job configuration: one dataclass, filled from defaults, then a YAML file, then command-line flags.

Every field can be set in YAML under the same name as its flag (dashes become underscores);
``configs/default.yaml`` documents each one with its default, and a test keeps the two in step.
"""

from __future__ import annotations

import os
import re
import signal
import types
import typing
from dataclasses import dataclass, field
from collections.abc import Mapping
from typing import Any

import yaml

from ftrun.errors import SHORT, UsageError, natural
from ftrun.control.faults import parse_faults
from ftrun.control.spec import DEFAULT_SIGNALS, ETCD_PORT, split_endpoint, with_port
from ftrun.launch.output import OutputSettings
from ftrun.launch.slurm import slurm_step
from ftrun.snapshot.ec_groups import DEFAULT_BACKEND, default_group, group_problem
from ftrun.snapshot.persist import open_regular

# torchrun's static rendezvous: where the store is when only --node-rank (and --master-*) is given
DEFAULT_MASTER_ADDR = "127.0.0.1"
DEFAULT_MASTER_PORT = 29500
DEFAULT_RDZV_PORT = 29400  # torchrun's port of a c10d --rdzv-endpoint given without one
LOCAL_STORE_HOST = "127.0.0.1"
START_METHODS = ("spawn", "fork", "forkserver")
CKPT_FORMATS = ("ftrun", "dcp")
MAX_CONFIG_BYTES = 1 << 20  # a config file is a few lines; a larger one is refused before it is parsed
MAX_SECONDS = 1e7  # the most any duration setting may be (115 days); NaN and infinity are refused too
# The most any count setting may be (--max-restarts, --persist-every, --keep): far beyond any job's restarts or
# snapshots (a larger one is a typo), and what a 32-bit integer holds for whatever reads the job's documents.
MAX_COUNT = (1 << 31) - 1
# The most nodes a job may have: every launcher keeps a few values per node in the control store and node 0 reads
# every node's documents on each poll, so a count far beyond any cluster (a typo) spun in O(nnodes) loops or ended in
# a MemoryError before any timeout; 65536 nodes is above the largest training jobs run (tens of thousands of GPUs).
MAX_NNODES = 1 << 16
# The most trainers per node: more than the largest hosts have cores (``--nproc-per-node cpu``) or accelerators.
MAX_NPROC_PER_NODE = 1024
EVENT_LOG_HANDLERS = ("null", "console", "dynamic_rendezvous")  # torchelastic's registered handlers
# torchrun's --rdzv-conf keys for c10d and static. join_timeout (timeout: static's) sets --rdzv-timeout;
# keep_alive_interval x keep_alive_max_attempt sets --node-timeout; store_type must be tcp; is_host must not name
# a node other than 0. The others tune torchelastic's rendezvous protocol, which ftrun replaces: accepted, no-ops.
C10D_NUMBER_KEYS = ("join_timeout", "timeout", "keep_alive_interval", "keep_alive_max_attempt", "read_timeout",
                    "last_call_timeout", "close_timeout", "heartbeat_timeout")
C10D_CONF_KEYS = (*C10D_NUMBER_KEYS, "is_host", "use_libuv", "store_type")
ETCD_ONLY_KEYS = ("protocol", "cacert", "cert", "key", "user", "password")  # ftrun.control.etcd.CONF_KEYS


@dataclass
class JobConfig:
    """Everything a job needs besides the script and its arguments."""

    nnodes: int | str = 1  # N or torchrun's "MIN:MAX"; validate() makes it MAX (an int) and min_nnodes MIN
    min_nnodes: int | None = None
    nproc_per_node: int | str = 1  # N, or auto, cpu, gpu, xpu (resolved to a number by validate())
    node_rank: int | None = None
    master_addr: str | None = None
    master_port: int | None = None
    local_addr: str | None = None
    rdzv_endpoint: str | None = None
    rdzv_id: str | None = None
    rdzv_timeout: float = 600.0
    rdzv_bind: str | None = None
    rdzv_backend: str = "c10d"
    rdzv_conf: str | None = None
    spares: int = 0
    standby: bool = False
    max_restarts: int = 10
    standalone: bool = False
    module: bool = False
    no_python: bool = False
    run_path: bool = False
    role: str = "default"
    log_dir: str | None = None
    redirects: int | str = "0"  # torchrun's stream values: 0-3, or "LOCAL_RANK:VALUE,..."
    tee: int | str = "0"
    local_ranks_filter: int | str | None = None  # "0,1" (an int in YAML: one rank)
    duplicate_stdout_filters: list[str] = field(default_factory=list)
    duplicate_stderr_filters: list[str] = field(default_factory=list)
    label_output: bool = False
    monitor_interval: float = 0.02
    start_method: str | None = None
    event_log_handler: str = "null"
    signals_to_handle: str = DEFAULT_SIGNALS
    virtual_local_rank: bool = False
    hang_timeout: float = 30.0
    hang_timeout_initial: float = 300.0
    hang_step_factor: float = 5.0
    node_timeout: float = 5.0
    stop_grace: float = 3.0
    zygote: bool = True
    tui: bool = False
    ec_group: int | None = None
    ec_parity: int | None = None
    ec_backend: str = DEFAULT_BACKEND
    secret_file: str | None = None
    ckpt_dir: str | None = None
    persist_every: int = 10
    keep: int = 2
    ckpt_format: str = "ftrun"
    resume: bool = True
    persist_grace: float = 60.0
    inject: list[str] = field(default_factory=list)

    @property
    def erasure(self) -> tuple[int, int]:
        """(G, m) of the EC groups: as given, else :func:`default_group`'s; (1, 0) when m is 0 (no redundancy).

        A group size given without parity gets m = 1 (none for a group of one)."""
        default_size, default_parity = default_group(self.nnodes)
        group = default_size if self.ec_group is None else self.ec_group
        if self.ec_parity is not None:
            parity = self.ec_parity
        else:
            parity = default_parity if self.ec_group is None else min(1, max(group - 1, 0))
        return (1, 0) if parity == 0 and group >= 1 else (group, parity)

    _rank_by_store = False  # not a setting: validate() sets it (see rank_by_store)
    endpoint_flag = "--rdzv-endpoint"  # not a setting: the flag that chose the store's port (named when it is taken)

    @property
    def rank_by_store(self) -> bool:
        """torchrun's multi-node form without ``--node-rank``: ``--rdzv-endpoint`` given (not derived from
        ``--master-port``), ``--nnodes`` above 1, not ``--standalone`` or ``--standby``, no rank from a SLURM step.
        One node of a multi-node job whose rank the launchers agree over the control store, first come, first
        served (a launcher finding every rank taken joins as a hot spare, as ``--standby``)."""
        return self._rank_by_store

    @property
    def local_mode(self) -> bool:
        """All nodes simulated on this host: no node rank given (under SLURM, the step gives one), not a standby,
        and not a node whose rank the control store gives (:attr:`rank_by_store`)."""
        return self.node_rank is None and not self.standby and not self.rank_by_store

    @property
    def store_conf(self) -> dict[str, str]:
        """``--rdzv-conf key=value,...`` as a mapping (checked by :meth:`validate`)."""
        return parse_rdzv_conf(self.rdzv_conf)

    def validate(self) -> None:
        """Raise :class:`UsageError` for the first inconsistent setting. torchrun's spellings become ftrun's
        settings first (``--nnodes MIN:MAX``, ``--nproc-per-node gpu``, ``--master-addr``/``--master-port``,
        ``--start-method``, ``--run-path``, c10d's ``--rdzv-conf`` keys)."""
        self.min_nnodes, self.nnodes = parse_nnodes(self.nnodes, self.min_nnodes)
        # ~ as --secret-file's: YAML has no shell to expand it, nor has bash in --log-dir=~/x ("./~" was made)
        self.log_dir, self.ckpt_dir = (None if path is None else os.path.expanduser(path)
                                       for path in (self.log_dir, self.ckpt_dir))
        self.nproc_per_node = resolve_nproc(self.nproc_per_node)
        if not 1 <= self.nproc_per_node <= MAX_NPROC_PER_NODE:
            raise UsageError(f"--nproc-per-node must be at least 1 and at most {MAX_NPROC_PER_NODE}, got "
                             f"{self.nproc_per_node}")
        if self.node_rank is not None and not 0 <= self.node_rank < self.nnodes:
            raise UsageError(f"--node-rank {self.node_rank} is out of range for --nnodes {self.nnodes}")
        self._validate_backend()
        self._rank_by_store = (self.rdzv_endpoint is not None and self.nnodes > 1 and self.node_rank is None
                               and not self.standby and not self.standalone)
        self._static_endpoint()
        self._validate_torchrun()
        if not 0 <= self.spares <= MAX_NNODES:
            raise UsageError(f"--spares must be at least 0 and at most {MAX_NNODES} (as --nnodes), got {self.spares}")
        if self.spares and not self.local_mode:
            raise UsageError("--spares is for jobs simulated on one host; on another host of a multi-node job "
                             "start a spare with: ftrun --standby --rdzv-endpoint ... --nproc-per-node P SCRIPT")
        if self.standby and self.node_rank is not None:
            raise UsageError("--standby joins a job as a spare without a node rank: drop --node-rank")
        if self.standby and self.rdzv_endpoint is None:
            raise UsageError("--standby needs --rdzv-endpoint (the control store of the job it joins)")
        if self.rdzv_bind is not None and self.local_mode:
            raise UsageError("--rdzv-bind is for multi-node jobs (--node-rank): local jobs listen on 127.0.0.1 only")
        if self.standalone and self.node_rank is not None:
            raise UsageError("--standalone cannot be combined with --node-rank")
        _check_count("--max-restarts", self.max_restarts, 0)
        if self.ckpt_format not in CKPT_FORMATS:
            raise UsageError(f"--ckpt-format must be one of {', '.join(CKPT_FORMATS)}, not {self.ckpt_format!r}")
        if self.ckpt_format != "ftrun" and self.ckpt_dir is None:
            raise UsageError(f"--ckpt-format {self.ckpt_format} needs --ckpt-dir (the directory to persist to)")
        _check_count("--persist-every", self.persist_every, 1)
        _check_count("--keep", self.keep, 1)
        for name in ("rdzv_timeout", "hang_timeout", "hang_timeout_initial", "hang_step_factor",
                     "node_timeout", "stop_grace", "persist_grace"):
            _check_seconds(f"--{name.replace('_', '-')}", getattr(self, name))
        if self.module and self.no_python:
            raise UsageError("-m and --no-python cannot be combined")
        if (self.rdzv_endpoint is not None and self.rdzv_backend == "c10d" and not self.local_mode
                and split_endpoint(self.rdzv_endpoint, any_port=True)[1] == 0):
            raise UsageError(f"--rdzv-endpoint {self.rdzv_endpoint}: port 0 (any free port) is for a job of this "
                             "host alone; the nodes of a multi-node job meet at a port they all know")
        problem = None if self.standby else group_problem(self.nnodes, *self.erasure, self.ec_backend)
        if problem is not None:  # a standby takes the job's groups (its own flags may be the nodes' command line)
            raise UsageError(problem)
        shape = () if self.standby else (self.nnodes, self.nproc_per_node)  # a standby takes the job's shape
        faults = parse_faults(self.inject, *shape)  # raises UsageError on a bad spec, or a rank or node the job lacks
        late = [(spec, fault.gen) for fault, spec in zip(faults, self.inject) if fault.gen > self.max_restarts]
        if late and not self.standby:  # a standby takes the job's --max-restarts
            raise UsageError(f"--inject {late[0][0]!r}: the job restarts at most {self.max_restarts} time(s) "
                             f"(--max-restarts), so generation {late[0][1]} never runs")

    def _validate_backend(self) -> None:
        if self.rdzv_endpoint is not None and not self.rdzv_endpoint.strip():
            self.rdzv_endpoint = None  # as torchrun: an empty endpoint is none (its default is "")
        if self.standalone:  # as torchrun: a local c10d store on a free port, whatever the rendezvous flags say
            self.rdzv_backend, self.rdzv_endpoint = "c10d", None
        if self.rdzv_backend == "static":  # torchrun's name for a store at a fixed endpoint: what c10d is here
            self.rdzv_backend = "c10d"
        if self.rdzv_backend == "etcd-v2":
            raise UsageError("--rdzv-backend etcd-v2 (etcd's v2 API) is not supported: use --rdzv-backend etcd "
                             "(etcd v3)")
        if self.rdzv_backend not in ("c10d", "etcd"):
            raise UsageError(f"--rdzv-backend must be c10d, static or etcd, got {self.rdzv_backend!r}")
        conf = self.store_conf
        if self.rdzv_endpoint is not None:  # a host alone: torchrun's default port
            self.rdzv_endpoint = with_port(self.rdzv_endpoint, ETCD_PORT if self.rdzv_backend == "etcd"
                                           else DEFAULT_RDZV_PORT)
            if self.rdzv_backend == "c10d":
                split_endpoint(self.rdzv_endpoint, any_port=True)
        if self.rdzv_backend == "etcd":
            if self.rdzv_endpoint is None:
                raise UsageError("--rdzv-backend etcd needs --rdzv-endpoint HOST:PORT[,HOST:PORT...] (etcd members)")
            for member in self.rdzv_endpoint.split(","):  # the keys of --rdzv-conf are checked on connecting
                split_endpoint(member.strip())
        else:
            self._apply_c10d_conf(conf)

    def _apply_c10d_conf(self, conf: dict[str, str]) -> None:
        """torchrun's c10d (and static) rendezvous keys: those with an ftrun meaning set it; the others are about
        torchelastic's own rendezvous protocol, which ftrun does not run, and are accepted as no-ops."""
        for key in conf:
            if key in ETCD_ONLY_KEYS:
                raise UsageError(f"--rdzv-conf {key}=...: settings are for --rdzv-backend etcd")
            if key not in C10D_CONF_KEYS:
                raise UsageError(f"unknown --rdzv-conf key {key!r} for --rdzv-backend c10d/static (known: "
                                 f"{', '.join(C10D_CONF_KEYS)})")
        seconds = {key: _conf_number(key, conf[key]) for key in C10D_NUMBER_KEYS if key in conf}
        flags = {key: _conf_bool(key, conf[key]) for key in ("is_host", "use_libuv") if key in conf}
        if "join_timeout" in seconds or "timeout" in seconds:  # join_timeout wins: it is the rendezvous's own
            self.rdzv_timeout = seconds.get("join_timeout", seconds.get("timeout", self.rdzv_timeout))
        if "keep_alive_interval" in seconds or "keep_alive_max_attempt" in seconds:  # torchrun's defaults: 5 s, 3
            self.node_timeout = seconds.get("keep_alive_interval", 5.0) * seconds.get("keep_alive_max_attempt", 3.0)
        if conf.get("store_type", "tcp").strip().lower() != "tcp":
            raise UsageError(f"--rdzv-conf store_type={conf['store_type']}: ftrun's control store is a TCP store "
                             "(or etcd: --rdzv-backend etcd); drop the key")
        if flags.get("is_host") and self.node_rank not in (None, 0):
            raise UsageError(f"--rdzv-conf is_host=true on node rank {self.node_rank}: node 0 hosts the control "
                             "store (or an `ftrun store` at --rdzv-endpoint); drop the key")

    def _static_endpoint(self) -> None:
        """torchrun's static rendezvous: with --node-rank and no --rdzv-endpoint the control store is at
        --master-addr:--master-port (127.0.0.1:29500), hosted by node 0; a single node without --master-port runs
        as --standalone does. In local mode --master-port is the port of the local control store."""
        if self.master_port is not None and not 0 < self.master_port < 65536:
            raise UsageError(f"--master-port must be a port (1 to 65535), got {self.master_port}")
        if self.rdzv_endpoint is not None or self.rdzv_backend != "c10d" or self.standalone:
            return
        static = f"{self.master_addr or DEFAULT_MASTER_ADDR}:{self.master_port or DEFAULT_MASTER_PORT}"
        if self.node_rank is not None:
            if self.master_port is None and self.nnodes == 1:
                self.node_rank = None  # as torchrun: a local store on a free port
            else:
                self.rdzv_endpoint = static
        elif self.standby:
            if self.master_addr is not None or self.master_port is not None:
                self.rdzv_endpoint = static
        elif self.master_port is not None:
            self.rdzv_endpoint = f"{LOCAL_STORE_HOST}:{self.master_port}"
        if self.rdzv_endpoint is not None:
            self.endpoint_flag = "--master-port"

    def _validate_torchrun(self) -> None:
        """The rest of torchrun's flags."""
        if self.start_method is not None:
            if self.start_method not in START_METHODS:
                raise UsageError(f"--start-method must be one of {', '.join(START_METHODS)}, got "
                                 f"{self.start_method!r}")
            self.zygote = self.start_method != "spawn"  # spawn: new processes; fork, forkserver: the zygote
        if self.run_path:  # as torchrun: runpy.run_path in a Python interpreter, over -m and --no-python
            self.module = self.no_python = False
        if self.event_log_handler not in EVENT_LOG_HANDLERS:
            raise UsageError(f"--event-log-handler {self.event_log_handler!r}: torchelastic's handlers are "
                             f"{', '.join(EVENT_LOG_HANDLERS)}; ftrun reports its own events on the console and "
                             "in --log-dir/events.jsonl whichever is given")
        if not self.role.strip():
            raise UsageError("--role must not be empty")
        _check_seconds("--monitor-interval", self.monitor_interval)
        parse_signals(self.signals_to_handle)
        self.redirects, self.tee = str(self.redirects), str(self.tee)
        if self.local_ranks_filter is not None:
            self.local_ranks_filter = str(self.local_ranks_filter)
        self.output.validate()

    @property
    def output(self) -> OutputSettings:
        """The settings of the trainers' stdout/stderr (:mod:`ftrun.launch.output`)."""
        return OutputSettings(self.redirects, self.tee, self.local_ranks_filter,
                              tuple(self.duplicate_stdout_filters), tuple(self.duplicate_stderr_filters),
                              self.label_output)

    @property
    def signals(self) -> list[signal.Signals]:
        """--signals-to-handle as signals."""
        return parse_signals(self.signals_to_handle)


def parse_nnodes(value: int | str, min_nnodes: int | None = None) -> tuple[int, int]:
    """``--nnodes N`` or ``MIN:MAX`` -> (MIN, MAX); ``min_nnodes`` is MIN when only N is given (N otherwise)."""
    text = str(value).strip()
    parts = text.split(":")
    try:
        if len(parts) == 1:
            high = int(parts[0])
            low = high if min_nnodes is None else min_nnodes
        elif len(parts) == 2:
            low, high = int(parts[0]), int(parts[1])
        else:
            raise ValueError(text)
    except ValueError:
        raise UsageError(f"Invalid value for '--nnodes': {text!r} is not N or MIN:MAX") from None
    if not 1 <= high <= MAX_NNODES:
        raise UsageError(f"--nnodes must be at least 1 and at most {MAX_NNODES}, got {high}")
    if not 1 <= low <= high:
        raise UsageError(f"--nnodes {low}:{high}: MIN must be at least 1 and at most MAX")
    return low, high


def resolve_nproc(value: int | str) -> int:
    """``--nproc-per-node``: a number, or as torchrun: cpu (the cores), gpu (CUDA devices), xpu, auto (the
    accelerators, else the cores). Only the words import torch."""
    if isinstance(value, int):
        return value
    text = str(value).strip()
    number = natural(text.removeprefix("-"))
    if number is not None:
        return -number if text.startswith("-") else number
    if text not in ("auto", "cpu", "gpu", "xpu"):
        raise UsageError(f"--nproc-per-node must be a number or auto, cpu, gpu, xpu; got {text!r}")
    import torch

    if text == "gpu":
        if not torch.cuda.is_available():
            raise UsageError("--nproc-per-node gpu: CUDA is not available on this host")
        return torch.cuda.device_count()
    if text == "xpu":
        if not torch.xpu.is_available():
            raise UsageError("--nproc-per-node xpu: XPU is not available on this host")
        return torch.xpu.device_count()
    if text == "auto" and torch.accelerator.is_available():
        return torch.accelerator.device_count()
    return len(os.sched_getaffinity(0))  # torchrun's count: the cores this process may run on


def parse_signals(text: str) -> list[signal.Signals]:
    """``--signals-to-handle SIGTERM,SIGUSR1`` -> signals; unknown or uncatchable names are a UsageError."""
    found = []
    for name in (item.strip() for item in text.split(",")):
        if not name:
            continue
        try:
            sig = signal.Signals[name]
        except KeyError:
            raise UsageError(f"--signals-to-handle: unknown signal {name!r} (e.g. SIGTERM,SIGINT,SIGHUP,SIGQUIT,"
                             "SIGUSR1,SIGUSR2)") from None
        if sig in (signal.SIGKILL, signal.SIGSTOP, signal.SIGCHLD):
            raise UsageError(f"--signals-to-handle: {name} cannot stop a job (it cannot be caught, or is how "
                             "processes report their exit)")
        found.append(sig)
    return found


def _conf_number(key: str, value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        number = -1.0
    _check_seconds(f"--rdzv-conf {key}", number, shown=repr(value))
    return number


def _check_seconds(setting: str, seconds: float, shown: str | None = None) -> None:
    """A duration ``setting`` is a positive number of at most :data:`MAX_SECONDS` (NaN and infinity are not);
    else a :class:`UsageError` that shows ``shown`` (default: the number)."""
    if not 0 < seconds <= MAX_SECONDS:
        raise UsageError(f"{setting} must be a positive number of at most {MAX_SECONDS:g}, got "
                         f"{seconds if shown is None else shown}")


def _check_count(setting: str, count: int, least: int) -> None:
    """A count ``setting`` is an integer from ``least`` to :data:`MAX_COUNT`; else a :class:`UsageError`."""
    if not least <= count <= MAX_COUNT:
        raise UsageError(f"{setting} must be an integer from {least} to {MAX_COUNT}, got {count}")


def _conf_bool(key: str, value: str) -> bool:
    text = value.strip().lower()
    if text in ("1", "true", "t", "yes", "y"):
        return True
    if text in ("0", "false", "f", "no", "n"):
        return False
    raise UsageError(f"--rdzv-conf {key} must be true or false, got {value!r}")


def parse_rdzv_conf(text: str | None) -> dict[str, str]:
    """``key=value,key=value`` -> mapping; anything else is a :class:`UsageError`."""
    conf: dict[str, str] = {}
    for item in (text or "").split(","):
        if not item.strip():
            continue
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise UsageError(f"--rdzv-conf must be KEY=VALUE[,KEY=VALUE...], got {item!r}")
        conf[key.strip()] = value.strip()
    return conf


def _field_types() -> dict[str, Any]:
    return typing.get_type_hints(JobConfig)


def _check_value(name: str, value: Any, annotation: Any, source: str) -> Any:
    """Return ``value`` if it fits ``annotation`` (ints accepted for floats), else raise naming the key."""
    allowed = typing.get_args(annotation) if isinstance(annotation, types.UnionType) else (annotation,)
    for kind in allowed:
        if kind is type(None) and value is None:
            return None
        if kind is bool and isinstance(value, bool):
            return value
        if kind is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if kind is str and isinstance(value, str):
            return value
        if typing.get_origin(kind) is list and isinstance(value, list) and all(isinstance(v, str) for v in value):
            return list(value)
    names = " or ".join("null" if k is type(None) else getattr(k, "__name__", str(k)) for k in allowed)
    raise UsageError(f"{source}: key '{name}' must be {names}, got {SHORT.repr(value)}")


class _DuplicateKey(yaml.constructor.ConstructorError):
    """A mapping key given twice (:class:`_UniqueKeyLoader`): its message is shown to the user."""


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key given twice in one mapping (YAML says keys are unique; PyYAML
    would keep the last one silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)  # type: ignore[no-untyped-call]
            if isinstance(key, typing.Hashable) and key in seen:
                raise _DuplicateKey(None, None, f"key '{key}' is given twice", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load_yaml(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a YAML config file into checked overrides; unknown or ill-typed keys name the key and the file."""
    source = str(path)
    try:
        with open_regular(source) as f:  # a FIFO would block the start forever
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as err:
        raise UsageError(f"cannot read config file {source or repr(source)}: {err.strerror}") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise UsageError(f"{source}: a config file of more than {MAX_CONFIG_BYTES >> 10} KiB is not a config file")
    try:
        text = raw.decode()
    except UnicodeDecodeError as err:
        raise UsageError(f"{source}: not UTF-8 text (byte {err.start})") from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # a safe loader: no tags that run or build objects
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        why = f": {err.problem}" if isinstance(err, _DuplicateKey) else ""
        raise UsageError(f"{source}: not valid YAML{where}{why}") from None
    except RecursionError:
        raise UsageError(f"{source}: not a config file (its YAML is nested too deep)") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UsageError(f"{source}: the top level must be a mapping of settings")
    hints = _field_types()
    checked: dict[str, Any] = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name not in hints:
            raise UsageError(f"{source}: unknown key '{key}'")
        checked[name] = _check_value(str(key), value, hints[name], source)
        words = {"nnodes": ('"MIN:MAX"', r"\d+(:\d+)?"), "nproc_per_node": ("auto, cpu, gpu, xpu", r"auto|cpu|gpu|xpu")}
        if name in words and isinstance(value, str) and not re.fullmatch(words[name][1], value.strip()):
            raise UsageError(f"{source}: key '{key}' must be int or {words[name][0]}, got {value!r}")
    return checked


def build_config(yaml_path: str | None, overrides: dict[str, Any],
                 env: Mapping[str, str] = os.environ) -> JobConfig:
    """Defaults, then what a SLURM step says (:mod:`ftrun.launch.slurm`), then the YAML file, then the flags the
    user gave (``None`` means not given). ``--standalone`` is a job of this host alone, as under torchrun, also
    inside a SLURM step (an interactive ``srun --pty bash``): the step is not read then. A ``--standby`` in a step
    takes only the job id from it: its node rank and the job's shape come from the job it joins, whose control
    store is on another step's first node (``--rdzv-endpoint``)."""
    given = load_yaml(yaml_path) if yaml_path is not None else {}
    given.update({k: v for k, v in overrides.items() if v is not None})
    values: dict[str, Any] = {}
    step = None if given.get("standalone") else slurm_step(env)
    if step is not None and given.get("standby"):  # a spare in a step of its own: the job's id, not its shape
        values.update(rdzv_id=step.run_id)
        if all(given.get(key) is None for key in ("rdzv_endpoint", "master_addr", "master_port")):
            raise UsageError("--standby under srun needs --rdzv-endpoint: the control store of the job it joins, "
                             f"on the first node of the job's training step, port {step.endpoint.rpartition(':')[2]}")
    elif step is not None:
        values.update(nnodes=step.nnodes, node_rank=step.node_id, rdzv_id=step.run_id,
                      rdzv_endpoint=step.endpoint)
    values.update(given)
    cfg = JobConfig(**values)
    cfg.validate()
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if cfg.virtual_local_rank and visible is not None and cfg.nproc_per_node > len(visible.split(",")):
        raise UsageError(f"--virtual-local-rank: {cfg.nproc_per_node} trainers per node, but CUDA_VISIBLE_DEVICES="
                         f"{visible} names {len(visible.split(','))} device(s)")
    return cfg
