"""The status model of a running job: what supervisors publish to the control store, and what a viewer gathers.

Every supervisor publishes a :class:`NodeStatus` twice a second under ``ftrun/<job>/status/node/<n>`` (small
JSON, one ``set``; nothing else of training waits for it). :func:`gather` reads them with the job-wide keys
(generation history, EC groups' protected steps, the durable tier's keys) into one :class:`JobStatus`, which
the views render (:mod:`ftrun.ui.view`) or print as JSON. A node whose document is older than
:data:`STALE_AFTER` seconds is shown as lost.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from ftrun.control.coordination import Coordinator
from ftrun.control.ownership import SpareDoc, spares
from ftrun.ui.durable import disk_state
from ftrun.ui.summary import Recovery, recoveries, restart_count

PUBLISH_INTERVAL = 0.5
STALE_AFTER = 3.0


@dataclass
class RankStatus:
    """One trainer, as its supervisor and keeper see it."""

    rank: int
    pid: int | None = None
    step: int | None = None  # its last heartbeat's step
    beat_age: float | None = None  # seconds since its last heartbeat (None before the first)
    timeout: float | None = None  # the hang timeout in force for it
    steps_per_s: float | None = None
    snapshot_step: int | None = None  # newest snapshot the keeper holds for it
    snapshot_age: float | None = None  # seconds since that snapshot was committed
    snapshot_bytes: int = 0
    copy_gbs: float | None = None  # bandwidth of its last snapshot copy


@dataclass
class NodeStatus:
    """The document a supervisor publishes."""

    node: int
    time: float  # wall clock when published
    state: str  # starting | running | restarting | rebuilding | done | stopped
    generation: int
    incarnation: int = 1
    group: int | None = None  # its EC group (None: no redundancy)
    shm_bytes: int = 0  # bytes the keeper holds in shared memory (slots and parity)
    committed: int = 0  # newest globally committed snapshot step the node knows
    ranks: list[RankStatus] = field(default_factory=list)

    def encode(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def decode(cls, raw: str | bytes) -> NodeStatus:
        doc = json.loads(raw)
        doc["ranks"] = [RankStatus(**rank) for rank in doc["ranks"]]
        return cls(**doc)


@dataclass
class Tier:
    """One place a restorable step lives: RAM, EC parity, disk."""

    name: str
    step: int | None  # None: not in use for this job
    age: float | None = None  # seconds since that step was committed or written
    detail: str = ""
    degraded: bool = False


@dataclass
class JobStatus:
    """Everything a view shows."""

    job: str
    nnodes: int
    nproc_per_node: int
    state: str  # running | restarting | done | failed | stopped
    generation: int
    uptime: float
    restarts: int
    goodput: float | None  # share of wall time spent making new progress (None: too early to say)
    nodes: dict[int, NodeStatus]  # node -> its latest document (missing: never published)
    lost: list[int]  # nodes whose document is stale or missing
    protected: dict[int, int]  # EC group -> protected step
    tiers: list[Tier]
    events: list[Recovery]  # every failure and its recovery, oldest first
    spares: list[SpareDoc] = field(default_factory=list)  # hot spares: waiting, or the node rank each took

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def publish(coord: Coordinator, status: NodeStatus) -> None:
    coord.store.set(coord.key("status", "node", status.node), status.encode())


def gather(coord: Coordinator, now: float | None = None, settled: dict[int, Recovery] | None = None) -> JobStatus:
    """The job's status from the control store (``coord`` needs the job's id and node count). A view that
    gathers again and again passes the same ``coord`` and ``settled`` (see :func:`~ftrun.ui.summary.recoveries`):
    each call then reads the store O(1) times however many generations the job has had."""
    now = time.time() if now is None else now
    job = coord.job_doc() or {}
    history = coord.history()
    current = history[-1] if history else coord.current()
    started = history[0].time if history else now
    nodes = {}
    for node in range(coord.nnodes):
        raw = coord.get(f"status/node/{node}")
        if raw is not None:
            nodes[node] = NodeStatus.decode(raw)
    lost = [n for n in range(coord.nnodes) if n not in nodes or now - nodes[n].time > STALE_AFTER]
    protected = {}
    for group in {s.group for s in nodes.values() if s.group is not None}:
        raw = coord.get(f"group/{group}/protected")
        protected[group] = int(raw) if raw else 0
    events = recoveries(coord, history, settled)  # the same reading of the history as the generation's
    ended = coord.get("state")
    if ended:
        state = ended.decode()
    elif len(coord.marks(current.gen, "done")) == coord.nnodes:
        state = "done"  # every node's trainers finished; the launcher sets the state as its store goes away
    elif any(s.state in ("restarting", "rebuilding") for s in nodes.values()):
        state = "restarting"
    else:
        state = "running"
    return JobStatus(
        job=coord.job_id, nnodes=coord.nnodes, nproc_per_node=int(job.get("nproc_per_node", 0)), state=state,
        generation=current.gen, uptime=now - started, restarts=restart_count(events, job.get("max_restarts")),
        goodput=_goodput(events, nodes, now - started),
        nodes=nodes, lost=lost, protected=protected, tiers=_tiers(coord, nodes, protected, now), events=events,
        spares=spares(coord))


def _tiers(coord: Coordinator, nodes: dict[int, NodeStatus], protected: dict[int, int], now: float) -> list[Tier]:
    committed = max((s.committed for s in nodes.values()), default=0)
    ages = [r.snapshot_age for s in nodes.values() for r in s.ranks
            if r.snapshot_step == committed and r.snapshot_age is not None]
    tiers = [Tier("RAM", committed or None, max(ages) if ages else None, "newest step every rank holds")]
    if protected:
        step = min(protected.values())
        tiers.append(Tier("EC parity", step or None, None, f"{len(protected)} group(s), the least protected"))
    disk = disk_state(coord, committed, now)
    if disk is not None:
        detail = disk.describe() if disk.degraded else f"{disk.where()}; {disk.rounds} persist(s)"
        tiers.append(Tier("disk", disk.step, disk.age, detail, disk.degraded))
    return tiers


def _goodput(events: list[Recovery], nodes: dict[int, NodeStatus], uptime: float) -> float | None:
    """1 - (time spent recovering + time spent recomputing lost steps) / uptime."""
    if uptime <= 0:
        return None
    rates = [r.steps_per_s for s in nodes.values() for r in s.ranks if r.steps_per_s]
    step_time = 1 / min(rates) if rates else 0.0
    lost = sum(e.seconds or 0.0 for e in events)
    lost += sum(max(0, (e.failed_step or 0) - e.restored[0]) * step_time for e in events if e.restored)
    return max(0.0, 1 - lost / uptime)
