"""The control-plane protocol between the supervisors of a job, over the control store.

All keys live under ``ftrun/<job>/``. Protocol, in the order a generation goes through it:

1. ``gen`` holds the current :class:`Generation` as JSON. Whoever first sees a failure moves it from
   generation g to g+1 by compare-and-set on the exact bytes it read, with the cause; exactly one writer wins,
   everyone else reads the winner's document. ``history/<g>`` keeps every generation's document.
2. Every supervisor watching ``gen`` stops its trainers when it changes, then marks ``gen/<g>/ready/<node>``
   with its incarnation (``node/<r>/incarnation`` counts the supervisors that ever ran as node r). Node 0
   publishes the generation's fresh trainer store in ``gen/<g>/master`` before it marks itself ready.
3. When all nodes are ready every supervisor starts its trainers with ``TORCHELASTIC_RESTART_COUNT=g``, and
   notes ``gen/<g>/started/<node>`` and, once each local trainer has beaten, ``gen/<g>/up/<node>`` (wall time).
   Meanwhile the nodes agree on the snapshot step the trainers restore (:mod:`ftrun.snapshot.link`) and note
   it in ``gen/<g>/restore``.
4. A node whose trainers all exited 0 marks ``gen/<g>/done/<node>``; the job is done when every node has.

Liveness: every supervisor adds to ``node/<r>/beat`` twice a second; peers watch the counters (never clocks),
and a counter that stops moving for ``node_timeout`` means the node is lost. A supervisor that starts as a
replacement (incarnation > 1) whose predecessor was part of the current generation bumps the generation.
Bumping past ``max_restarts`` ends the job: supervisors stop instead of starting the next generation.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass

from torch.distributed import TCPStore


@dataclass(frozen=True)
class Generation:
    """The contents of the ``gen`` key: which generation runs now and why it started."""

    gen: int
    kind: str  # "start", or the failure kind: "crash", "hang", "node-lost", "node-replaced", "fatal", ...
    reason: str
    node: int | None = None
    rank: int | None = None
    detected_by: str = ""
    time: float = 0.0
    step: int | None = None  # the failed rank's last reported step

    def encode(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def decode(cls, raw: bytes | str) -> Generation:
        return cls(**json.loads(raw))


@dataclass(frozen=True)
class Failure:
    """A failure as seen by one observer, before it becomes (or fails to become) the next generation."""

    kind: str
    reason: str
    node: int | None = None
    rank: int | None = None
    detected_by: str = ""
    step: int | None = None


class Coordinator:
    """One process's view of the protocol above; every call is a short, non-blocking store round trip."""

    def __init__(self, store: TCPStore, job_id: str, node_rank: int, nnodes: int) -> None:
        self.store = store
        self.job_id = job_id
        self.node_rank = node_rank
        self.nnodes = nnodes
        self._prefix = f"ftrun/{job_id}/"

    def key(self, *parts: object) -> str:
        return self._prefix + "/".join(str(p) for p in parts)

    def get(self, *parts: object) -> bytes | None:
        """The value of the key made of ``parts``, or None when it is not set (never blocks)."""
        full = self.key(*parts)
        return self.store.get(full) if self.store.check([full]) else None

    # -- generations ------------------------------------------------------------------------------------
    def init_job(self, doc: dict[str, object]) -> None:
        """Create generation 0 unless the job already exists (a node or launcher that starts late)."""
        start = Generation(0, "start", "job started", time=time.time()).encode()
        if self.store.compare_set(self.key("gen"), "", start).decode() == start:
            self.store.set(self.key("history", 0), start)
        self.store.compare_set(self.key("job"), "", json.dumps(doc))

    def job_doc(self) -> dict[str, object] | None:
        raw = self.get("job")
        return None if raw is None else json.loads(raw)

    def current_raw(self) -> bytes:
        return self.store.get(self.key("gen"))

    def current(self) -> Generation:
        return Generation.decode(self.current_raw())

    def bump(self, seen: bytes, failure: Failure) -> tuple[bytes, bool]:
        """Move from the generation whose raw document is ``seen`` to the next one.

        Returns the raw document now current and whether this call's failure made it.
        """
        old = Generation.decode(seen)
        new = Generation(old.gen + 1, failure.kind, failure.reason, failure.node, failure.rank,
                         failure.detected_by, time.time(), failure.step)
        encoded = new.encode()
        now = self.store.compare_set(self.key("gen"), seen.decode(), encoded)
        won = now.decode() == encoded
        if won:
            self.store.set(self.key("history", new.gen), encoded)
        return now, won

    def history(self) -> list[Generation]:
        gens = []
        for g in range(self.current().gen + 1):
            raw = self.get(f"history/{g}")
            if raw is not None:
                gens.append(Generation.decode(raw))
        return gens

    # -- membership and barriers ----------------------------------------------------------------------------
    def register(self) -> int:
        """Count this supervisor as an incarnation of its node rank; returns 1 for the first."""
        return self.store.add(self.key("node", self.node_rank, "incarnation"), 1)

    def mark(self, gen: int, what: str, value: object = 1) -> None:
        self.store.set(self.key("gen", gen, what, self.node_rank), str(value))

    def marks(self, gen: int, what: str) -> dict[int, str]:
        """node -> value for every node that set ``gen/<gen>/<what>/<node>``."""
        found = {}
        for node in range(self.nnodes):
            raw = self.get(f"gen/{gen}/{what}/{node}")
            if raw is not None:
                found[node] = raw.decode()
        return found

    def publish_restore(self, gen: int, step: int, source: str) -> None:
        """The agreed snapshot step of ``gen`` (0: none) and where it comes from ("RAM", "RAM + parity")."""
        self.store.set(self.key("gen", gen, "restore"), json.dumps({"step": step, "source": source}))

    def restore_step(self, gen: int) -> tuple[int, str] | None:
        """(step, source) agreed for ``gen``, or None when it was not agreed."""
        raw = self.get(f"gen/{gen}/restore")
        if raw is None:
            return None
        doc = json.loads(raw)
        return int(doc["step"]), str(doc["source"])

    def durability(self) -> str | None:
        """The durable tier in a few words ("step 60 on disk", "DEGRADED: ..."); None when nothing was persisted
        or tried (keys of :mod:`ftrun.snapshot.durability`)."""
        degraded, done = self.get("persist/degraded"), self.get("persist/done")
        if degraded:
            return f"DEGRADED: {degraded.decode()}" + (f" (newest step on disk: {int(done)})" if done else "")
        return f"ok: newest step on disk {int(done)}" if done else None

    def publish_master(self, gen: int, addr: str, port: int) -> None:
        self.store.set(self.key("gen", gen, "master"), f"{addr}:{port}")

    def master(self, gen: int) -> tuple[str, int]:
        addr, _, port = self.store.get(self.key("gen", gen, "master")).decode().rpartition(":")
        return addr, int(port)

    # -- liveness -------------------------------------------------------------------------------------------
    def beat(self) -> None:
        self.store.add(self.key("node", self.node_rank, "beat"), 1)

    def beats(self) -> list[int]:
        return [int(v) for v in self.store.multi_get([self.key("node", n, "beat") for n in range(self.nnodes)])]

    def touch_beats(self) -> None:
        """Make every node's beat key exist, so :meth:`beats` never blocks."""
        for node in range(self.nnodes):
            self.store.add(self.key("node", node, "beat"), 0)
