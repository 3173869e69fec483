"""Job configuration: one dataclass, filled from defaults, then a YAML file, then command-line flags.

Every field can be set in YAML under the same name as its flag (dashes become underscores);
``configs/default.yaml`` documents each one with its default, and a test keeps the two in step.
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from dataclasses import dataclass, field
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from ftrun.errors import UsageError
from ftrun.control.faults import Fault, parse_faults
from ftrun.launch.slurm import slurm_step
from ftrun.snapshot.erasure import DEFAULT_BACKEND, default_group, group_problem


@dataclass
class JobConfig:
    """Everything a job needs besides the script and its arguments."""

    nnodes: int = 1
    nproc_per_node: int = 1
    node_rank: int | None = None
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
    log_dir: str | None = None
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
    resume: bool = True
    persist_grace: float = 60.0
    inject: list[str] = field(default_factory=list)

    @property
    def faults(self) -> list[Fault]:
        return parse_faults(self.inject)

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

    @property
    def local_mode(self) -> bool:
        """All nodes simulated on this host: no node rank given (under SLURM, the step gives one), not a standby."""
        return self.node_rank is None and not self.standby

    @property
    def store_conf(self) -> dict[str, str]:
        """``--rdzv-conf key=value,...`` as a mapping (checked by :meth:`validate`)."""
        return parse_rdzv_conf(self.rdzv_conf)

    def validate(self) -> None:
        """Raise :class:`UsageError` for the first inconsistent setting."""
        if self.nnodes < 1:
            raise UsageError(f"--nnodes must be at least 1, got {self.nnodes}")
        if self.nproc_per_node < 1:
            raise UsageError(f"--nproc-per-node must be at least 1, got {self.nproc_per_node}")
        if self.node_rank is not None and not 0 <= self.node_rank < self.nnodes:
            raise UsageError(f"--node-rank {self.node_rank} is out of range for --nnodes {self.nnodes}")
        self._validate_backend()
        if self.node_rank is not None and self.rdzv_endpoint is None and self.nnodes > 1:
            raise UsageError("--node-rank needs --rdzv-endpoint HOST:PORT (the control store of the job)")
        if self.spares < 0:
            raise UsageError(f"--spares must be 0 or more, got {self.spares}")
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
        if self.max_restarts < 0:
            raise UsageError(f"--max-restarts must be 0 or more, got {self.max_restarts}")
        if self.persist_every < 1 or self.keep < 1:
            raise UsageError(f"--persist-every and --keep must be at least 1, got {self.persist_every} and {self.keep}")
        for name in ("rdzv_timeout", "hang_timeout", "hang_timeout_initial", "hang_step_factor",
                     "node_timeout", "stop_grace", "persist_grace"):
            if getattr(self, name) <= 0:
                raise UsageError(f"{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        if self.module and self.no_python:
            raise UsageError("-m and --no-python cannot be combined")
        if self.rdzv_endpoint is not None and self.rdzv_backend == "c10d":
            split_endpoint(self.rdzv_endpoint)
        problem = group_problem(self.nnodes, *self.erasure, self.ec_backend)
        if problem is not None:
            raise UsageError(problem)
        self.faults  # noqa: B018 - parsing raises UsageError on a bad spec


    def _validate_backend(self) -> None:
        if self.rdzv_backend == "static":  # torchrun's name for a store at a fixed endpoint: what c10d is here
            self.rdzv_backend = "c10d"
        if self.rdzv_backend == "etcd-v2":
            raise UsageError("--rdzv-backend etcd-v2 (etcd's v2 API) is not supported: use --rdzv-backend etcd "
                             "(etcd v3)")
        if self.rdzv_backend not in ("c10d", "etcd"):
            raise UsageError(f"--rdzv-backend must be c10d, static or etcd, got {self.rdzv_backend!r}")
        conf = self.store_conf
        if self.rdzv_backend == "etcd":
            if self.rdzv_endpoint is None:
                raise UsageError("--rdzv-backend etcd needs --rdzv-endpoint HOST:PORT[,HOST:PORT...] (etcd members)")
            for member in self.rdzv_endpoint.split(","):  # the keys of --rdzv-conf are checked on connecting
                split_endpoint(member.strip())
        elif conf:
            raise UsageError(f"--rdzv-conf {next(iter(conf))}=...: settings are for --rdzv-backend etcd")


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


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """``host:port`` -> (host, port); a bad endpoint is a :class:`UsageError`."""
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UsageError(f"--rdzv-endpoint must be HOST:PORT, got {endpoint!r}")
    return host.strip("[]"), int(port)


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
    raise UsageError(f"{source}: key '{name}' must be {names}, got {value!r}")


def load_yaml(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a YAML config file into checked overrides; unknown or ill-typed keys name the key and the file."""
    source = str(path)
    try:
        text = Path(path).read_text()
    except OSError as err:
        raise UsageError(f"cannot read config file {source}: {err.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise UsageError(f"{source}: not valid YAML{where}") from None
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
    return checked


def build_config(yaml_path: str | None, overrides: dict[str, Any],
                 env: Mapping[str, str] = os.environ) -> JobConfig:
    """Defaults, then what a SLURM step says (:mod:`ftrun.launch.slurm`), then the YAML file, then the flags the
    user gave (``None`` means not given)."""
    values: dict[str, Any] = {}
    step = slurm_step(env)
    if step is not None:
        values.update(nnodes=step.nnodes, node_rank=step.node_id, rdzv_id=step.run_id,
                      rdzv_endpoint=step.endpoint)
    if yaml_path is not None:
        values.update(load_yaml(yaml_path))
    values.update({k: v for k, v in overrides.items() if v is not None})
    cfg = JobConfig(**values)
    cfg.validate()
    return cfg


def config_to_dict(cfg: JobConfig) -> dict[str, Any]:
    return dataclasses.asdict(cfg)
