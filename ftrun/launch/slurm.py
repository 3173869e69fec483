"""Running under SLURM (``srun ftrun ...``): the job's shape from ``SLURM_*`` variables, hostlist expansion,
and the node ranks of a new job step.

Under ``srun`` (``SLURM_JOB_ID`` and ``SLURM_STEP_ID`` set) each node runs one ftrun, which takes ``--nnodes``
from ``SLURM_NNODES``, the run id from the job id (so every step of a batch script is the same ftrun job, and a
new step finds what the last one left in RAM and on disk), and the control store's endpoint from the first
host of the step's node list (its ``NodeAddr`` when the name does not resolve), on a port derived from the job
id. Flags given on the command line win. One ftrun per node: more tasks per node is an error.

Node ranks across steps: a node that lost a step (another node died and SLURM killed the step) still holds its
ranks' snapshots in shared memory, and must get the same node rank in the next step, whatever its
``SLURM_NODEID`` there. So each node keeps a claim file ``ftrun-<job>-host-<node name>`` (its node rank) beside
its segments, in the same shared memory, and at the start of a step the nodes agree over the control store
(:func:`agree_node_rank`): a node keeps the rank it claims unless a node with a lower ``SLURM_NODEID`` claims it
too, and nodes without a claim (a spare replacing a lost node) take the free ranks in ``SLURM_NODEID`` order.
``SLURMD_NODENAME`` names the node, which also tells apart simulated nodes that share one host.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ftrun.errors import UsageError, natural
from ftrun.control.spec import open_shm_file, safe_job_id, shm_dir

if TYPE_CHECKING:
    from ftrun.control.signed import SignedStore

PORT_BASE = 20000
PORT_SPAN = 20000  # store port = PORT_BASE + job id % PORT_SPAN
_GROUP = re.compile(r"\[([^\[\]]*)\]")
MAX_HOSTS = 64 * 1024  # hosts a hostlist may name, as SLURM's own MAX_RANGE bounds one range


def expand_hostlist(hostlist: str) -> list[str]:
    """The host names of a SLURM hostlist, in order: ``n[1-3,7]``, ``gpu-[01-04]-ib``, ``a[1-2]b[1-2]``, and
    comma-separated lists of those; ranges keep their zero padding. A malformed list, or one of more than
    :data:`MAX_HOSTS` hosts (``n[1-99999999999]`` would fill the memory), is a :class:`UsageError`."""
    hosts: list[str] = []
    for item in _split_top(hostlist):
        hosts.extend(_expand_one(item, hostlist))
        _check_count(len(hosts), hostlist)
    return hosts


def _check_count(count: int, hostlist: str) -> None:
    if count > MAX_HOSTS:
        raise UsageError(f"malformed SLURM hostlist {hostlist!r} (more than {MAX_HOSTS} hosts)")


def _split_top(hostlist: str) -> list[str]:
    """Split at the commas outside brackets."""
    items, depth, start = [], 0, 0
    for i, char in enumerate(hostlist):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if depth not in (0, 1):
            raise UsageError(f"malformed SLURM hostlist {hostlist!r}")
        if char == "," and depth == 0:
            items.append(hostlist[start:i])
            start = i + 1
    if depth:
        raise UsageError(f"malformed SLURM hostlist {hostlist!r}")
    items.append(hostlist[start:])
    return [item.strip() for item in items if item.strip()]


def _expand_one(item: str, hostlist: str) -> list[str]:
    match = _GROUP.search(item)
    if match is None:
        return [item]
    head, tail = item[:match.start()], item[match.end():]
    values, rests = _ranges(match.group(1), hostlist), _expand_one(tail, hostlist)
    _check_count(len(values) * len(rests), hostlist)
    return [head + value + rest for value in values for rest in rests]


def _ranges(spec: str, hostlist: str) -> list[str]:
    values = []
    for part in spec.split(","):
        low, dash, high = part.strip().partition("-")
        first, last = natural(low), natural(high) if dash else natural(low)
        if first is None or last is None or last < first:
            raise UsageError(f"malformed SLURM hostlist {hostlist!r} (range {part!r})")
        _check_count(len(values) + last - first + 1, hostlist)
        if not dash:
            values.append(low)
            continue
        width = len(low) if low.startswith("0") else 0
        values.extend(str(n).zfill(width) for n in range(first, last + 1))
    return values


def node_address(host: str) -> str:
    """How to reach SLURM node ``host``: its name when that resolves, else the ``NodeAddr`` scontrol shows for it
    (node names that are not host names, as with several simulated nodes on one host)."""
    try:
        socket.getaddrinfo(host, None)
        return host
    except (socket.gaierror, UnicodeError):  # UnicodeError: no host name (an empty label, or one over 63 characters)
        pass
    try:
        shown = subprocess.run(["scontrol", "show", "node", "-o", host], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return host
    match = re.search(r"\bNodeAddr=(\S+)", shown.stdout)
    return match.group(1) if match else host


@dataclass(frozen=True)
class SlurmStep:
    """What a SLURM step tells one ftrun process about the job."""

    job_id: str
    step_id: str
    node_id: int  # SLURM_NODEID: this node's index in the step (not always its ftrun node rank, see above)
    node_name: str  # SLURMD_NODENAME
    nnodes: int
    hosts: list[str]
    tasks_per_node: int

    @property
    def run_id(self) -> str:
        return run_id(self.job_id)

    @property
    def endpoint(self) -> str:
        return f"{node_address(self.hosts[0])}:{PORT_BASE + int(self.job_id) % PORT_SPAN}"


def run_id(slurm_job_id: str) -> str:
    """ftrun's job id under ``srun`` in SLURM job ``slurm_job_id`` (every step of it, and after a requeue)."""
    return f"slurm-{slurm_job_id}"


def own_run_id(env: Mapping[str, str]) -> str | None:
    """The ftrun job id of the SLURM job this process runs in (a step, or its batch script), None outside one."""
    return run_id(env["SLURM_JOB_ID"]) if env.get("SLURM_JOB_ID") else None


def slurm_step(env: Mapping[str, str]) -> SlurmStep | None:
    """The SLURM step this process runs in, or None outside ``srun`` (no job or no step id). A job id that is not
    a number (it names the control store's port) is a :class:`UsageError`."""
    if "SLURM_JOB_ID" not in env or "SLURM_STEP_ID" not in env:
        return None
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST", "")
    tasks = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or "1"
    if natural(env["SLURM_JOB_ID"]) is None:  # it names the store's port
        raise UsageError(f"SLURM_JOB_ID={env['SLURM_JOB_ID']!r} is not a SLURM job id (a number): unset the SLURM_* "
                         "variables outside a SLURM job")
    try:
        per_node = max(int(re.match(r"\d+", part)[0]) for part in tasks.split(","))  # type: ignore[index]
        node_id = int(env.get("SLURM_NODEID", "0"))
        step = SlurmStep(env["SLURM_JOB_ID"], env["SLURM_STEP_ID"], node_id,
                         env.get("SLURMD_NODENAME") or f"{socket.gethostname()}-{node_id}",
                         int(env.get("SLURM_STEP_NUM_NODES") or env.get("SLURM_NNODES", "1")),
                         expand_hostlist(nodelist), per_node)
    except (TypeError, ValueError) as err:
        raise UsageError(f"cannot read the SLURM environment: {err}") from None
    if not step.hosts:
        raise UsageError("SLURM_STEP_NODELIST and SLURM_JOB_NODELIST are empty")
    if step.tasks_per_node > 1:
        raise UsageError(f"srun started {step.tasks_per_node} ftrun tasks per node; ftrun starts the trainers of "
                         "its node itself: use --ntasks-per-node 1 (and --nproc-per-node for the trainers)")
    return step


def claim_path(job_id: str, node_name: str) -> str:
    """The file in which node ``node_name`` claims the node rank whose snapshots it holds (mode 0600)."""
    return os.path.join(shm_dir(), f"ftrun-{safe_job_id(job_id)}-host-{safe_job_id(node_name)}")


def read_claim(job_id: str, node_name: str) -> int | None:
    try:
        with open(claim_path(job_id, node_name)) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def write_claim(job_id: str, node_name: str, node_rank: int) -> None:
    fd = open_shm_file(claim_path(job_id, node_name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    with os.fdopen(fd, "w") as f:
        f.write(f"{node_rank}\n")


def assign_node_ranks(claims: list[int | None], nnodes: int) -> list[int]:
    """Node ranks by ``SLURM_NODEID`` (the index into ``claims``): a valid claim is kept unless a lower node id
    claimed the same rank; the others get the free ranks in node id order."""
    ranks: list[int | None] = [None] * len(claims)
    taken: set[int] = set()
    for node_id, claim in enumerate(claims):
        if claim is not None and 0 <= claim < nnodes and claim not in taken:
            ranks[node_id] = claim
            taken.add(claim)
    free = iter(rank for rank in range(nnodes) if rank not in taken)
    return [rank if rank is not None else next(free) for rank in ranks]


def agree_node_rank(store: SignedStore, job_id: str, step: SlurmStep, claim: int | None, timeout: float) -> int:
    """This node's rank in the step, agreed with the step's other nodes over the control store given what this
    node claims (:func:`read_claim`), and then claimed (see above). A claim that is not authentic counts as not
    made yet (its node's own claim replaces it)."""
    prefix = f"ftrun/{job_id}/slurm-step/{step.step_id}/claim/"
    store.set(prefix + str(step.node_id), json.dumps(claim))
    keys = [prefix + str(node_id) for node_id in range(step.nnodes)]
    deadline = time.monotonic() + timeout
    while None in (claims := store.multi_get(keys)):
        if time.monotonic() > deadline:
            raise UsageError(f"not every node of SLURM step {step.job_id}.{step.step_id} started ftrun within "
                             f"{timeout:g}s")
        time.sleep(0.05)
    rank = assign_node_ranks([json.loads(value) for value in claims if value is not None],
                             step.nnodes)[step.node_id]
    write_claim(job_id, step.node_name, rank)
    return rank
