"""The supervisor's thread between its node's keeper and the control store (the keeper has no store client).

Per generation g, keys under ``ftrun/<job>/gen/<g>/``:

- ``held/<node>``: JSON ``{rank: [steps]}``, the verified snapshot steps of every rank of the node, published
  once at the start of g. Every node computes the same restore step from all of them: the newest step that
  every rank of the job holds (0 if none), and tells its keeper (``plan``); trainers wait for it.
- ``commit/<node>``: JSON ``[steps]``, the steps every rank of the node holds now; the link publishes it
  whenever it changes and, while the node holds a step newer than the last known globally restorable one,
  reads the other nodes' to tell the keeper the newest step every rank holds (which frees a slot).
"""

from __future__ import annotations

import json
import threading
import time

from torch.distributed import DistError

from ftrun.events import EventLog
from ftrun.launch.coordination import Coordinator
from ftrun.launch.spec import NodeSpec
from ftrun.launch.store import connect_store
from ftrun.snapshot.protocol import KeeperClient, KeeperError, KeeperUnavailable, socket_name

LINK_INTERVAL = 0.01


def newest_common(sets: list[set[int]]) -> int:
    """The newest step in every set; 0 when there is none (or no sets)."""
    common = set.intersection(*sets) if sets else set()
    return max(common, default=0)


class KeeperLink(threading.Thread):
    """Agrees the restore step of each generation and relays what every rank holds; see the module doc."""

    def __init__(self, spec: NodeSpec, job: str, events: EventLog) -> None:
        super().__init__(name="ftrun-keeper-link", daemon=True)
        store = connect_store(spec.store_host, spec.store_port, spec.rdzv_timeout)
        self.coord = Coordinator(store, spec.job_id, spec.node_rank, spec.nnodes)
        self.node = spec.node_rank
        self.nnodes = spec.nnodes
        self.world = spec.nnodes * spec.nproc_per_node
        self.events = events
        self.keeper = KeeperClient(socket_name(job, spec.node_rank), patience=1.0)
        self.fatal: str | None = None
        self._generation = -1
        self._plans: dict[int, int] = {}
        self._restorable = 0
        self._published: list[int] | None = None
        self._stop = threading.Event()

    def begin(self, generation: int) -> None:
        """A new generation starts: agree its restore step before anything else."""
        self._generation = generation

    def stop(self) -> None:
        self._stop.set()

    def run(self) -> None:
        while not self._stop.is_set():
            gen = self._generation
            try:
                if gen < 0:
                    pass
                elif gen not in self._plans:
                    self._agree(gen)
                else:
                    self._relay(gen)
            except (KeeperUnavailable, KeeperError):
                pass  # the keeper is restarting; the supervisor sees its exit
            except DistError:
                return  # the control store is gone; the supervisor sees that too
            self._stop.wait(LINK_INTERVAL)

    def _agree(self, gen: int) -> None:
        held = self.keeper.request("held", generation=gen)["held"]
        self.coord.store.set(self.coord.key("gen", gen, "held", self.node), json.dumps(held))
        every: dict[int, set[int]] = {}
        while len(every) < self.world:
            if self._stop.is_set() or self._generation != gen:
                return
            for node, raw in self.coord.marks(gen, "held").items():
                every.update({int(rank): set(steps) for rank, steps in json.loads(raw).items()})
            if len(every) < self.world:
                time.sleep(LINK_INTERVAL)
        step = newest_common(list(every.values()))
        self.keeper.request("poll", generation=gen, plan=step, restorable=step)
        self._plans[gen] = self._restorable = step
        self._published = None
        self.coord.publish_restore(gen, step)
        self._report(gen, step, every)

    def _report(self, gen: int, step: int, every: dict[int, set[int]]) -> None:
        leader = self.node == 0
        if step:
            self.events.emit("restore", f"generation {gen}: trainers restore step {step} from RAM (held by all "
                             f"{self.world} ranks)", console=leader, generation=gen, step=step, restored_from="ram")
        elif any(every.values()):
            partial = {rank: sorted(steps) for rank, steps in every.items()}
            self.events.emit("restore", f"WARNING generation {gen}: no snapshot step is held by every rank "
                             f"({partial}); trainers start from step 0", console=leader, generation=gen, step=0,
                             restored_from="none", held=partial)
        elif gen > 0:
            self.events.emit("restore", f"generation {gen}: no RAM snapshot to restore", console=leader,
                             generation=gen, step=0, restored_from="none")

    def _relay(self, gen: int) -> None:
        reply = self.keeper.request("poll", generation=gen, plan=self._plans[gen], restorable=self._restorable)
        if reply.get("fatal") and self.fatal is None:
            self.fatal = reply["fatal"]
        local = [int(s) for s in reply["local"]]
        if local != self._published:
            self.coord.store.set(self.coord.key("gen", gen, "commit", self.node), json.dumps(local))
            self._published = local
        if max(local, default=0) > self._restorable:
            commits = self.coord.marks(gen, "commit")
            if len(commits) == self.nnodes:
                restorable = newest_common([set(json.loads(raw)) for raw in commits.values()])
                self._restorable = max(self._restorable, restorable)
