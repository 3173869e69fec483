"""Coordination of the durable tier over the control store, run by each supervisor's keeper link.

Keys under ``ftrun/<job>/persist/`` (job-wide, not per generation):

- ``request``: the step every keeper is asked to persist. Node 0 sets it every ``persist_every`` globally
  committed steps, and once more to the newest committed step when the job stops or ends (``final`` then
  holds that step too). One request at a time: while one is being written, a newer step waits (only the
  newest waiting one is kept), so a slow disk makes persists rarer, never piles up unfinished ones.
- ``<step>/<node>``: JSON outcome of a node's keeper for that step: ``{"entries": {rank: manifest entry}}`` or
  ``{"error": "..."}``, with ``bytes`` and ``seconds``.
- ``done``: the newest step complete on disk. Node 0, once every node has reported a step, writes the manifest
  and renames the step's directory into place (:func:`ftrun.snapshot.persist.finalize`), prunes old steps, and
  sets ``done``; if any node failed, it removes the partial directory and sets ``degraded`` to the reason
  (one warning; training goes on from RAM, and the next request tries again).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from typing import Any

from ftrun.events import EventLog
from ftrun.control.coordination import Coordinator
from ftrun.control.spec import NodeSpec
from ftrun.snapshot.persist import complete_steps, finalize, manifest, prune, remove_partial, step_name

REQUEST_INTERVAL = 0.2  # how often a node reads the job's persist request


class Durability:
    """One node's part of the protocol above; node 0 also decides and finalizes."""

    def __init__(self, spec: NodeSpec, coord: Coordinator, events: EventLog) -> None:
        assert spec.ckpt_dir is not None
        self.spec = spec
        self.root = spec.ckpt_dir
        self.coord = coord
        self.events = events
        self.leader = spec.node_rank == 0
        self.request = 0  # the newest request this node knows of
        self.done = 0
        self._commits = 0  # globally committed steps seen since the last request (node 0)
        self._queued = 0  # node 0: the newest step to ask for once the request being written is finished
        self._reported = 0  # the newest step whose outcome this node published
        self._degraded: str | None = None
        self._next_read = 0.0

    def disk_steps(self) -> set[int]:
        """Complete steps of this job, with as many ranks as it has now, on disk."""
        world = self.spec.nnodes * self.spec.nproc_per_node
        return {step for step in complete_steps(self.root, self.spec.job_id)
                if manifest(self.root, step)["world"] == world}

    def committed(self, step: int) -> None:
        """Node 0: a new globally committed step; ask for a persist every ``persist_every`` of them."""
        if not self.leader:
            return
        self._commits += 1
        if self._commits >= self.spec.persist_every:
            self.ask(step)

    def ask(self, step: int, final: bool = False) -> None:
        """Node 0: ask every keeper to persist ``step`` (``final``: the last one of this run), or queue it while
        the request before it is being written."""
        self._commits = 0
        if final:
            self.coord.store.set(self.coord.key("persist", "final"), str(step))
        if step <= max(self.request, self.done):
            return
        if self.request > self.done:
            self._queued = max(self._queued, step)
            return
        self.request = step
        self.coord.store.set(self.coord.key("persist", "request"), str(step))

    def tick(self, outcome: dict[str, Any]) -> int:
        """Publish this keeper's outcome, read the request, and (node 0) finalize; returns the step to ask the
        keeper to persist."""
        step = int(outcome.get("step", 0))
        if step > self._reported:
            self._reported = step
            self.coord.store.set(self.coord.key("persist", step, self.spec.node_rank), json.dumps(outcome))
        now = time.monotonic()
        if now >= self._next_read:
            self._next_read = now + REQUEST_INTERVAL
            raw = self._get("request")
            self.request = max(self.request, int(raw)) if raw else self.request
            if self.leader and self.request > self.done:
                self._finalize(self.request)
            if self.leader and self._queued and self.request <= self.done:
                queued, self._queued = self._queued, 0
                self.ask(queued)
        return self.request

    def _get(self, *key: object) -> bytes | None:
        return self.coord.get("persist", *key)

    def _finalize(self, step: int) -> None:
        outcomes = {}
        for node in range(self.spec.nnodes):
            raw = self._get(step, node)
            if raw is None:
                return  # not every node has reported yet
            outcomes[node] = json.loads(raw)
        self.done = step
        errors = [o["error"] for o in outcomes.values() if "error" in o]
        if errors:
            remove_partial(self.root, step)
            reason = "; ".join(errors)
            self.coord.store.set(self.coord.key("persist", "degraded"), reason)
            self.coord.store.set(self.coord.key("persist", "failed"), str(step))
            if reason != self._degraded:
                self._degraded = reason
                self.events.emit("durability", f"WARNING durability degraded: persisting step {step} to {self.root} "
                                 f"failed ({reason}); training goes on from RAM snapshots, retrying at the next "
                                 "persist", step=step, degraded=True, reason=reason)
            return
        entries = {int(r): e for o in outcomes.values() for r, e in o["entries"].items()}
        t0 = time.perf_counter()
        replaced = self.step_path(step) + ".replaced"
        try:
            if os.path.isdir(self.step_path(step)):  # left by an earlier run of the job (it resumed from older)
                os.rename(self.step_path(step), replaced)
            path = finalize(self.root, step, self.spec.job_id, self.spec.nnodes, self.spec.nproc_per_node, entries)
            pruned = prune(self.root, self.spec.keep)
            shutil.rmtree(replaced, ignore_errors=True)
        except (OSError, ValueError) as err:
            remove_partial(self.root, step)
            self.coord.store.set(self.coord.key("persist", "degraded"), str(err))
            self.coord.store.set(self.coord.key("persist", "failed"), str(step))
            self.events.emit("durability", f"WARNING durability degraded: finishing step {step} failed ({err})",
                             step=step, degraded=True, reason=str(err))
            return
        nbytes = sum(int(e["bytes"]) for e in entries.values())
        seconds = max(float(o["seconds"]) for o in outcomes.values())  # the keepers' writes, in parallel
        finishing = time.perf_counter() - t0  # manifest, rename, pruning
        self.coord.store.set(self.coord.key("persist", "done_time"), str(time.time()))
        self.coord.store.set(self.coord.key("persist", "done"), str(step))
        if self._degraded is not None:
            self._degraded = None
            self.coord.store.set(self.coord.key("persist", "degraded"), "")
        self.events.emit("persisted", f"persisted step {step} to {path} ({nbytes / 2**20:.1f} MiB written in "
                         f"{seconds:.2f}s, {nbytes / max(seconds, 1e-9) / 1e9:.2f} GB/s; finished in {finishing:.2f}s)"
                         f"{'; removed steps ' + str(pruned) if pruned else ''}", step=step, bytes=nbytes,
                         seconds=seconds, finish_seconds=finishing, path=path, pruned=pruned)

    def final_outcome(self) -> bool | None:
        """After the final request: True once its step is on disk, False if it failed, None while unknown."""
        final = self._get("final")
        if final is None:
            return None
        step = int(final)
        done, failed = self._get("done"), self._get("failed")
        if step == 0 or (done is not None and int(done) >= step):  # 0: nothing was ever committed
            return True
        if failed is not None and int(failed) >= step:
            return False
        return None

    def step_path(self, step: int) -> str:
        return os.path.join(self.root, step_name(step))
