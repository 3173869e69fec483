"""What a launcher tells the job: each supervisor's :class:`NodeSpec` (:func:`node_spec`), built from the command
line, and the job's document in the control store (:func:`job_doc`), which every node and a spare that joins read.

Invariants: a spec and the document are built from the command line alone (a standby uses the job's document
instead, :mod:`ftrun.launch.standby`); the script is named by its content (:func:`script_digest`), so a spare on
another host, where paths may differ, runs the same one.
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
import secrets
import socket

from ftrun.control.spec import NodeSpec
from ftrun.control.store import LOOPBACK, WILDCARDS
from ftrun.launch.config import JobConfig
from ftrun.launch.env import default_omp_threads
from ftrun.snapshot.persist import job_dir


def script_digest(cfg: JobConfig, target: str) -> str:
    """What the script is, by content: a spare that joins must run the same one (paths may differ by host)."""
    if cfg.module:
        return f"module {target}"
    with open(os.path.join(target, "__main__.py") if os.path.isdir(target) else target, "rb") as f:
        return "sha256 " + hashlib.file_digest(f, "sha256").hexdigest()


def omp_threads(cfg: JobConfig) -> int:
    """The trainers' OMP_NUM_THREADS unless the user set one: this host's cores shared by its trainers."""
    return default_omp_threads(cfg.nproc_per_node * (cfg.nnodes if cfg.local_mode else 1))


def master_addr(cfg: JobConfig, bind: str, store_host: str) -> str:
    """This node's address as peers reach it: ``--local-addr``, else the ``bind`` address, else (bound to every
    interface) the host. A job of this host alone listens on loopback only, whatever --local-addr says."""
    if cfg.local_addr is not None and not cfg.local_mode:
        return cfg.local_addr
    if bind not in WILDCARDS:
        return bind
    if ipaddress.ip_address(socket.gethostbyname(store_host)).is_loopback:
        return LOOPBACK
    return socket.gethostname()


def node_spec(cfg: JobConfig, job_id: str, target: str, args: list[str], node: int, store_host: str,
              store_port: int, bind: str, run: int, slurm_step: bool) -> NodeSpec:
    """The spec of ``node``'s supervisor (-1: a spare's) in run ``run`` of job ``job_id``, which runs ``target``
    with ``args``; its listening sockets bind ``bind``; ``slurm_step``: the launcher runs in a SLURM step."""
    return NodeSpec(
        job_id=job_id, node_rank=node, nnodes=cfg.nnodes, nproc_per_node=cfg.nproc_per_node,
        store_host=store_host, store_port=store_port, master_addr=master_addr(cfg, bind, store_host),
        target=target, args=args, module=cfg.module, no_python=cfg.no_python, cwd=os.getcwd(),
        omp_threads=omp_threads(cfg), max_restarts=cfg.max_restarts,
        rdzv_timeout=cfg.rdzv_timeout, hang_timeout=cfg.hang_timeout,
        hang_timeout_initial=cfg.hang_timeout_initial, hang_step_factor=cfg.hang_step_factor,
        node_timeout=cfg.node_timeout, stop_grace=cfg.stop_grace, zygote=cfg.zygote,
        ec_group=cfg.erasure[0], ec_parity=cfg.erasure[1], ec_backend=cfg.ec_backend,
        ckpt_dir=job_dir(cfg.ckpt_dir, job_id) if cfg.ckpt_dir else None, persist_every=cfg.persist_every,
        keep=cfg.keep, ckpt_format=cfg.ckpt_format, persist_grace=cfg.persist_grace,
        log_dir=os.path.abspath(cfg.log_dir) if cfg.log_dir else None, faults=cfg.inject,
        bind_addr=bind, run=run, rdzv_backend=cfg.rdzv_backend,
        rdzv_endpoint=cfg.rdzv_endpoint or "" if cfg.rdzv_backend == "etcd" else "", rdzv_conf=cfg.store_conf,
        monitor_interval=cfg.monitor_interval, role=cfg.role, signals_to_handle=cfg.signals_to_handle,
        virtual_local_rank=cfg.virtual_local_rank, redirects=cfg.redirects, tee=cfg.tee,
        local_ranks_filter=cfg.local_ranks_filter, duplicate_stdout_filters=cfg.duplicate_stdout_filters,
        duplicate_stderr_filters=cfg.duplicate_stderr_filters, label_output=cfg.label_output,
        slurm_step=slurm_step)


def job_doc(cfg: JobConfig, job_id: str, target: str, args: list[str]) -> dict[str, object]:
    """What every node, and a spare that joins, learns of the job from the control store."""
    return {"nnodes": cfg.nnodes, "nproc_per_node": cfg.nproc_per_node, "max_restarts": cfg.max_restarts,
            "target": target, "script": script_digest(cfg, target), "args": args,
            "module": cfg.module, "no_python": cfg.no_python,
            "ec": [*cfg.erasure, cfg.ec_backend], "persist": [cfg.persist_every, cfg.keep, cfg.ckpt_format],
            "ckpt_dir": job_dir(cfg.ckpt_dir, job_id) if cfg.ckpt_dir else None,
            "run_id": secrets.token_hex(8)}  # the run's, whichever launcher wrote it: see dir_owner
