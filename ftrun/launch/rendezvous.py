"""The reads of a generation's rendezvous (:meth:`Supervisor._rendezvous <ftrun.launch.supervisor.Supervisor>`):
who is ready, who is missing, and under srun which missing node nothing will replace.

Each node marks itself ready in ``gen/<g>/ready``; node 0 waits for every mark and then sets ``gen/<g>/go``,
which the others wait for: a poll reads N keys on node 0 and one key elsewhere, so the job's rendezvous costs the
store O(N) keys per poll, not O(N^2). The missing nodes are read one round trip per node, only when they are told.
"""

from __future__ import annotations

from ftrun.control.coordination import Coordinator
from ftrun.control.ownership import owner


def everyone_ready(coord: Coordinator, gen: int) -> bool:
    """Whether every node is ready for generation ``gen``: node 0 reads every mark (and then says go), the others
    read node 0's go."""
    if coord.node_rank != 0:
        return coord.get("gen", gen, "go") is not None
    if coord.marked(gen, "ready") is None:
        return False
    coord.store.set(coord.key("gen", gen, "go"), "1")
    return True


def not_ready(coord: Coordinator, gen: int) -> list[int]:
    """The nodes that have not joined generation ``gen`` (one round trip per node: only when it is told)."""
    return sorted(set(range(coord.nnodes)) - set(coord.marks(gen, "ready")))


def nothing_replaces(coord: Coordinator, missing: list[int], launchers: dict[int, bytes | None]) -> int | None:
    """Under srun: the first of the ``missing`` nodes that nothing will replace: declared lost, its rank still
    held by the lost supervisor, its launcher started no replacement (the launcher of a live node marks
    ``node/<r>/replacing`` as it starts one) and has not beaten since ``launchers`` was read (its ftrun is gone:
    it beats while it lives, :meth:`Coordinator.beat_launcher`; ``launchers`` becomes what is read now), while no
    spare waits to take it (the caller asks :class:`~ftrun.launch.peers.SpareWatch` first). No new ftrun can join
    a running step, so waiting for one (``--rdzv-timeout``) would only idle the job; a supervisor whose ftrun
    lives was only stalled, and may come back or be replaced by it."""
    if not missing:
        return None
    beats = coord.launcher_beats(missing)
    seen = {node: launchers.get(node) for node in missing}
    launchers.update(beats)
    for node in missing:
        held = owner(coord, node)[1]
        if held is None or beats[node] != seen[node]:
            continue
        lost = str(held.incarnation).encode()  # the owner that a node-lost generation named, if not replaced
        if coord.get("node", node, "lost") == lost and coord.get("node", node, "replacing") != lost:
            return node
    return None
