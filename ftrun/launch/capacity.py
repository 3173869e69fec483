"""Does a local-mode job (every node simulated on this host), or this host's node of a multi-node job, fit this
host? Checked before anything starts.

Without ``--node-rank`` ftrun starts all ``--nnodes`` nodes on this host: a supervisor, a keeper and a zygote per
node and ``--nproc-per-node`` trainers each. A torchrun command moved over without ``--node-rank`` (or a typo in
``--nnodes``) would otherwise start hundreds of processes before any of them fails. The check refuses a job that
cannot run here, with one line saying what it would start, what the host has, and how to run on several hosts:

- **cores**: at most :data:`OVERSUBSCRIPTION` trainers per core (the cores this process may run on). Trainers
  get ``OMP_NUM_THREADS = cores / trainers`` (at least 1), so up to 4 per core they time-share single-threaded,
  each at a quarter of a core or more: slow but sound for rehearsals and tests (the test suite runs 4 trainers on
  2 cores). Beyond that heartbeats and collectives slow down past their timeouts, and a real training job of that
  shape was meant for several hosts.
- **memory**: the least each process of the job takes, measured on this project's machine (torch 2.13, CPU):
  a trainer at least :data:`TRAINER_BYTES` (the RSS of a process right after ``import torch``: 218 MiB), each
  node :data:`NODE_BYTES` more (supervisor 224 MiB, zygote 290 MiB, keeper 29 MiB RSS), and so does each hot
  spare (``--spares``: the same three processes, forked before anything else starts). A real model needs more;
  this is a floor, so a job refused here could not have run. Compared with the memory available now (and the
  cgroup v2 limits of this process's cgroup and those above it, when any is set: a SLURM step's --mem).
- **one node of a multi-node job** (``--node-rank``, a node whose rank the control store gives, ``--standby``,
  a SLURM step's task): memory only, the same floor for one node and its ``--nproc-per-node`` trainers
  (:func:`node_fit_problem`). Not cores: an srun task often has one CPU for eight GPU trainers, which wait on
  their devices, not on that CPU.
- **/dev/shm** is not checked here: a snapshot's size is unknown before the first ``save()``, and the lower
  bound (two 4 KiB slot headers per trainer) is far below the memory floor above. The keeper stops the job
  with one line saying how much is needed and how much is free when /dev/shm cannot hold the slots.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import psutil

OVERSUBSCRIPTION = 4  # trainers per core
MIB = 1 << 20
TRAINER_BYTES = 220 * MIB
NODE_BYTES = 545 * MIB
_CGROUP = "/sys/fs/cgroup"


@dataclass(frozen=True)
class Host:
    """What this host offers a local job."""

    cores: int
    memory: int  # bytes available now


def this_host() -> Host:
    """Cores this process may run on; memory available now (within the cgroup v2 limits, when any is set)."""
    memory = psutil.virtual_memory().available
    try:
        with open("/proc/self/cgroup") as f:
            own = next((line[3:].strip() for line in f if line.startswith("0::")), "/")
    except OSError:
        own = "/"
    left = cgroup_memory_left(_CGROUP, own)
    return Host(len(os.sched_getaffinity(0)), max(0, memory if left is None else min(memory, left)))


def cgroup_memory_left(root: str, own: str) -> int | None:
    """The least memory any cgroup v2 from ``own`` (a path under ``root``, as ``/proc/self/cgroup`` names it) up to
    ``root`` may still take (its ``memory.max`` less its ``memory.current``): a SLURM step's limit (``--mem``) is
    on the step's or job's cgroup, below the root (whose own file a container sees); None when none is set."""
    root = os.path.normpath(root)
    levels = [part for part in os.path.normpath("/" + own).split("/") if part]
    left = None
    for depth in range(len(levels), -1, -1):
        path = os.path.join(root, *levels[:depth])
        try:
            with open(os.path.join(path, "memory.max")) as f:
                limit = f.read().strip()
            if limit == "max":
                continue
            with open(os.path.join(path, "memory.current")) as f:
                room = int(limit) - int(f.read())
        except (OSError, ValueError):
            continue
        left = room if left is None else min(left, room)
    return left


def needed_memory(nnodes: int, nproc_per_node: int, spares: int = 0) -> int:
    """The least memory, in bytes, that ``nnodes`` simulated nodes of ``nproc_per_node`` trainers take, with
    ``spares`` hot spare nodes (a supervisor, zygote and keeper each, no trainer)."""
    return nnodes * (NODE_BYTES + nproc_per_node * TRAINER_BYTES) + spares * NODE_BYTES


def local_fit_problem(nnodes: int, nproc_per_node: int, host: Host, spares: int = 0) -> str | None:
    """Why ``nnodes`` x ``nproc_per_node`` and ``spares`` spare nodes cannot all run on ``host`` (one line), or
    None when they fit."""
    trainers = nnodes * nproc_per_node
    memory = needed_memory(nnodes, nproc_per_node, spares)
    max_trainers = OVERSUBSCRIPTION * host.cores
    if trainers <= max_trainers and memory <= host.memory:
        return None
    if spares and trainers <= max_trainers and needed_memory(nnodes, nproc_per_node) <= host.memory:
        what, how = f"--spares {spares}", "give fewer spares with --spares"
    elif nnodes > 1:
        what = f"--nnodes {nnodes} x --nproc-per-node {nproc_per_node} without --node-rank simulates every node here"
        how = (f"to run on {nnodes} hosts, start ftrun on each with --node-rank N (0..{nnodes - 1}) and "
               "--rdzv-endpoint HOST:PORT of node 0, or under SLURM: srun --ntasks-per-node 1 ftrun ...")
    else:
        what, how = f"--nproc-per-node {nproc_per_node}", "give fewer trainers with --nproc-per-node"
    nodes = f"{nnodes} node(s)" + (f", {spares} spare(s)" if spares else "")
    return (f"{what}: {nodes} and {trainers} trainer(s) on this host, at least {_size(memory)} of "
            f"memory; it has {host.cores} core(s) (at most {max_trainers} trainers, {OVERSUBSCRIPTION} per core) "
            f"and {_size(host.memory)} available; {how}")


def node_fit_problem(nproc_per_node: int, host: Host) -> str | None:
    """Why one node of a multi-node job with ``nproc_per_node`` trainers cannot run on ``host`` (one line), or None
    when its memory floor fits (cores are not counted: see the module doc)."""
    memory = needed_memory(1, nproc_per_node)
    if memory <= host.memory:
        return None
    return (f"--nproc-per-node {nproc_per_node}: this node and its {nproc_per_node} trainer(s) need at least "
            f"{_size(memory)} of memory; this host has {_size(host.memory)} available; give fewer trainers with "
            "--nproc-per-node")


def _size(nbytes: int) -> str:
    value, unit = nbytes / (1 << 30), "GiB"
    for bigger in ("TiB", "PiB", "EiB"):
        if value < 1024:
            break
        value, unit = value / 1024, bigger
    return f"{value:.1f} {unit}"
