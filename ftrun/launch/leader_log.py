"""Node 0's report of a generation's job-wide progress: trainers running on every node, every rank beating.

Each is said once per generation (:class:`LeaderLog`), read from the nodes' ``started`` and ``up`` marks in the
control store; the second carries the recovery time of a restart (from the failure being seen to every rank
beating again).
"""

from __future__ import annotations

from ftrun.control.coordination import Coordinator, Generation
from ftrun.events import EventLog


class LeaderLog:
    """Node 0 reports job-wide progress of a generation once: all trainers running, all ranks beating."""

    def __init__(self, coord: Coordinator, events: EventLog, gen: Generation) -> None:
        self.coord = coord
        self.events = events
        self.gen = gen
        self.running = self.recovered = False

    def poll(self) -> None:
        nnodes = self.coord.nnodes
        if not self.running and self.coord.marked(self.gen.gen, "started") is not None:
            self.running = True
            self.events.emit("all_running", f"generation {self.gen.gen}: trainers running on all {nnodes} nodes",
                             generation=self.gen.gen)
        if self.running and not self.recovered:
            ups = self.coord.marked(self.gen.gen, "up")
            if ups is not None:
                self.recovered = True
                first_beat = max(float(v) for v in ups.values())
                if self.gen.gen == 0:
                    self.events.emit("first_heartbeat", "generation 0: every rank has sent a heartbeat",
                                     generation=0)
                else:
                    took = first_beat - self.gen.time
                    self.events.emit("recovered", f"generation {self.gen.gen}: every rank beating again, "
                                     f"recovered in {took:.2f}s after the failure was seen",
                                     generation=self.gen.gen, seconds=took)

    def finish(self) -> None:
        self.poll()
