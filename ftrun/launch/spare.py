"""A hot spare: a supervisor process with its zygote warm (torch imported), enlisted in the control store,
beating, not training, until a node is lost; then it claims that node's rank (:func:`ftrun.control.ownership.
claim`) and becomes its supervisor: its keeper rebuilds the node's snapshots from the group's parity and its
trainers fork from the warm zygote.

A spare reads the generation and the run's end state every :data:`SPARE_POLL` seconds. Every generation of kind
"node-lost" (read from ``history/`` too, so none is missed, also those from before the spare started) names
the lost node rank and its owner's incarnation; the spare claims that rank unless it was taken again since,
or its owner came back (it marked itself ready in the current generation). It stops, unused, when the run
ends or is told to stop.

While it waits it allocates the memory of the slots it would rebuild (:mod:`ftrun.snapshot.reserve`), sized from
the status documents of up to :data:`RESERVE_SAMPLE` nodes, read every :data:`RESERVE_REFRESH` seconds; a
reserve too small for the node it takes is grown by that node's keeper.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from dataclasses import dataclass, replace

from ftrun.control.coordination import Coordinator, Generation
from ftrun.control.ownership import SpareDoc, claim, enlist, owner, spare_doc, update_spare
from ftrun.control.spec import STOP_KIND, NodeSpec, shm_place
from ftrun.events import EventLog
from ftrun.launch.zygote import ZygoteClient
from ftrun.snapshot.keeper import human
from ftrun.snapshot.reserve import SlotReserve
from ftrun.snapshot.slot import HEADER_SIZE, slot_capacity
from ftrun.ui.status import NodeStatus

SPARE_POLL = 0.02
SPARE_BEAT = 0.25
RESERVE_REFRESH = 1.0
RESERVE_SAMPLE = 16


@dataclass(frozen=True)
class Claimed:
    """The node rank a spare took, as whose incarnation, in which generation."""

    node: int
    incarnation: int
    generation: int


class Spare:
    """Waits for a node rank to claim; see the module doc."""

    def __init__(self, spec: NodeSpec, coord: Coordinator, events: EventLog, me: str) -> None:
        self.spec = spec
        self.coord = coord
        self.events = events
        self.me = me
        self.host = socket.gethostname()
        self.stopping = False
        self.index = -1
        self._beats = 0
        self.reserve = SlotReserve(spec.job_id, spec.spare, spec.nproc_per_node)

    def wait(self, zygote: ZygoteClient | None) -> Claimed | None:
        """Enlist and wait; the rank claimed, or None when the run ended without needing this spare."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: setattr(self, "stopping", True))
        doc = spare_doc(self.spec.spare, self.host, os.getpid())
        self.index = enlist(self.coord, doc)
        self.events.emit("spare_up", f"spare {self.spec.spare} up (pid {os.getpid()}, zygote "
                         f"{'pid ' + str(zygote.pid) if zygote else 'off'}): waiting for a lost node",
                         spare=self.spec.spare, pid=os.getpid())
        try:
            return self._wait(doc)
        finally:
            self.reserve.release()  # unless handed over to the node claimed

    def _wait(self, doc: SpareDoc) -> Claimed | None:
        pending: dict[int, int] = {}  # lost node rank -> the incarnation that was lost
        seen = -1
        next_beat = next_reserve = 0.0
        while not self.stopping:
            current = self.coord.current()
            if self.coord.get("state") is not None or current.kind == STOP_KIND:
                break
            for gen in self._since(seen, current):
                if gen.kind == "node-lost" and gen.node is not None and gen.incarnation is not None:
                    pending[gen.node] = gen.incarnation
            seen = current.gen
            for node, lost in sorted(pending.items()):
                took = self._claim(node, lost, current)
                if took is not None:
                    update_spare(self.coord, self.index, replace(doc, state="took", node=node,
                                                                 generation=current.gen, time=time.time()))
                    return took
                if not self._vacant(node, lost, current):
                    del pending[node]
            if time.monotonic() >= next_beat:
                next_beat = time.monotonic() + SPARE_BEAT
                self._beats += 1
                self.coord.store.set(self.coord.key("spares", self.index, "beat"), str(self._beats))
            if time.monotonic() >= next_reserve:
                next_reserve = time.monotonic() + RESERVE_REFRESH
                self._grow_reserve()
            time.sleep(max(SPARE_POLL, self.coord.store.poll_interval))
        update_spare(self.coord, self.index, replace(doc, state="gone", time=time.time()))
        return None

    def _since(self, seen: int, current: Generation) -> list[Generation]:
        """The generations after ``seen`` up to ``current`` (from ``history/``; the current one as read)."""
        found = []
        for g in range(seen + 1, current.gen):
            raw = self.coord.get("history", g)
            if raw is not None:
                found.append(Generation.decode(raw))
        return found + ([current] if current.gen > seen else [])

    def _vacant(self, node: int, lost: int, current: Generation) -> bool:
        """Whether ``node`` is still held by incarnation ``lost`` and that owner has not rejoined the job."""
        held = owner(self.coord, node)[1]
        rejoined = self.coord.get("gen", current.gen, "ready", node)
        return held is not None and held.incarnation == lost and rejoined != str(lost).encode()

    def _claim(self, node: int, lost: int, current: Generation) -> Claimed | None:
        if not self._vacant(node, lost, current):
            return None
        incarnation = claim(self.coord, node, lost, self.me, self.spec.spare, self.host, shm_place())
        if incarnation is None:
            return None
        took = time.time() - current.time
        handed = self.reserve.hand_over(node)  # before the node's keeper starts: it adopts them
        self.events.emit("spare_claimed", f"spare {self.spec.spare} took node rank {node} (generation "
                         f"{current.gen}: {current.reason}) {took:.2f}s after the failure was seen"
                         f"{f'; {human(handed)} of its slots allocated before' if handed else ''}",
                         spare=self.spec.spare, node=node, generation=current.gen, incarnation=incarnation,
                         seconds=took, reserve_bytes=handed)
        return Claimed(node, incarnation, current.gen)

    def _grow_reserve(self) -> None:
        """Size the reserve from the nodes' status: per local rank, the largest snapshot of the sampled nodes'
        ranks, in a slot with the trainers' headroom; no growth until each of them published one of every rank
        (the reserve is still given back if room runs short)."""
        nproc, nnodes = self.spec.nproc_per_node, self.spec.nnodes
        sizes = [0] * nproc
        for node in range(0, nnodes, max(1, nnodes // RESERVE_SAMPLE)):
            raw = self.coord.get("status", "node", node)
            ranks = NodeStatus.decode(raw).ranks if raw is not None else []
            if len(ranks) != nproc or not all(rank.snapshot_bytes for rank in ranks):
                sizes = [0] * nproc
                break
            sizes = [max(size, HEADER_SIZE + slot_capacity(rank.snapshot_bytes)) for size, rank in zip(sizes, ranks)]
        if self.reserve.want(sizes):
            self.events.emit("spare_reserve", f"spare {self.spec.spare} allocates {human(sum(self.reserve.sizes))} "
                             f"of shared memory for the slots of a node it may take", console=False,
                             spare=self.spec.spare, bytes=sum(self.reserve.sizes))
