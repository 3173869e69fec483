"""Running under SLURM (``srun ftrun ...``): the job's shape from ``SLURM_*`` variables, and hostlist expansion.

Under ``srun`` (``SLURM_JOB_ID`` and ``SLURM_STEP_ID`` set) each node runs one ftrun, which takes its node rank
from ``SLURM_NODEID``, ``--nnodes`` from ``SLURM_NNODES``, the run id from the job id (so every step of a batch
script is the same ftrun job, and a new step finds what the last one left in RAM and on disk), and the control
store's endpoint from the first host of the step's node list, on a port derived from the job id. Flags given
on the command line win. One ftrun per node: more tasks per node is an error.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from ftrun.errors import UsageError

PORT_BASE = 20000
PORT_SPAN = 20000  # store port = PORT_BASE + job id % PORT_SPAN
_GROUP = re.compile(r"\[([^\[\]]*)\]")


def expand_hostlist(hostlist: str) -> list[str]:
    """The host names of a SLURM hostlist, in order: ``n[1-3,7]``, ``gpu-[01-04]-ib``, ``a[1-2]b[1-2]``, and
    comma-separated lists of those; ranges keep their zero padding. A malformed list is a :class:`UsageError`."""
    hosts: list[str] = []
    for item in _split_top(hostlist):
        hosts.extend(_expand_one(item, hostlist))
    return hosts


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
    return [head + value + rest for value in _ranges(match.group(1), hostlist) for rest in _expand_one(tail, hostlist)]


def _ranges(spec: str, hostlist: str) -> list[str]:
    values = []
    for part in spec.split(","):
        low, dash, high = part.strip().partition("-")
        if not low.isdigit() or (dash and not high.isdigit()):
            raise UsageError(f"malformed SLURM hostlist {hostlist!r} (range {part!r})")
        if not dash:
            values.append(low)
            continue
        width = len(low) if low.startswith("0") else 0
        if int(high) < int(low):
            raise UsageError(f"malformed SLURM hostlist {hostlist!r} (range {part!r})")
        values.extend(str(n).zfill(width) for n in range(int(low), int(high) + 1))
    return values


@dataclass(frozen=True)
class SlurmStep:
    """What a SLURM step tells one ftrun process about the job."""

    job_id: str
    node_rank: int
    nnodes: int
    hosts: list[str]
    tasks_per_node: int

    @property
    def run_id(self) -> str:
        return f"slurm-{self.job_id}"

    @property
    def endpoint(self) -> str:
        return f"{self.hosts[0]}:{PORT_BASE + int(self.job_id) % PORT_SPAN}"


def slurm_step(env: Mapping[str, str]) -> SlurmStep | None:
    """The SLURM step this process runs in, or None outside ``srun`` (no job or no step id)."""
    if "SLURM_JOB_ID" not in env or "SLURM_STEP_ID" not in env:
        return None
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST", "")
    tasks = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or "1"
    try:
        per_node = max(int(re.match(r"\d+", part)[0]) for part in tasks.split(","))  # type: ignore[index]
        step = SlurmStep(env["SLURM_JOB_ID"], int(env.get("SLURM_NODEID", "0")),
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
