"""How a launcher of a multi-node job leaves it: it says its node is gone (:func:`leave`), and the launcher that
hosts the c10d control store keeps it up while others still need it: until the other nodes said goodbye
(:func:`staying`), or, when a spare took its own node's rank, until the run ends (:func:`host_until_the_run_ends`).

Invariant: a host waits only for what can still answer: not for a node whose owner was declared lost and not
replaced, or that never had one, nor for a spare whose beats stopped for :data:`SPARE_SILENCE`.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from ftrun.control.coordination import Coordinator
from ftrun.control.ownership import owner
from ftrun.events import EventLog
from ftrun.launch.peers import SpareWatch
from ftrun.launch.spare import SPARE_BEAT

_ACK_TIMEOUT = 10.0
# a spare whose record says it waits but whose beats stopped this long, at the job's end, is gone (killed while it
# waited): a live one sees the end within its poll and says so
SPARE_SILENCE = 4 * SPARE_BEAT
_HOST_LOOK = 0.5  # seconds between two looks of a store host whose node left while the job goes on


def leave(coord: Coordinator, hosts_store: bool, holds_rank: bool = True) -> None:
    """Say this node is gone (as the incarnation of its rank that ends here; not when a spare took the rank,
    ``holds_rank`` False: the spare says it); the launcher hosting the control store (``hosts_store``: node 0's,
    or the one that bound the port first without --node-rank, even as a spare) keeps it up until the other nodes
    have left and no spare is still waiting (it notices the end and says so in the store), for at most
    :data:`_ACK_TIMEOUT` seconds. Invariant: it waits only for what can still answer: not for a node whose owner
    was declared lost and not replaced, or that never had one (nothing of it is left to say goodbye), nor for a
    spare whose record says "waiting" but whose beats stopped for :data:`SPARE_SILENCE` (killed while it
    waited)."""
    if coord.node_rank >= 0 and holds_rank:
        held = owner(coord, coord.node_rank)[1]
        coord.mark(0, "left", held.incarnation if held is not None else 0)
    if hosts_store:
        deadline = time.monotonic() + _ACK_TIMEOUT
        waiting, gone = SpareWatch(coord, SPARE_SILENCE), set[int]()
        while (staying(coord, gone) or waiting.waiting()) and time.monotonic() < deadline:
            time.sleep(0.05)


def staying(coord: Coordinator, gone: set[int]) -> list[int]:
    """The nodes whose rank's current owner has not said it left (:func:`leave`): not those that never had an
    owner (their launcher never came), nor those whose owner was declared lost. A goodbye of an earlier owner (a
    node's launcher whose rank a spare took) does not count for the spare. ``gone``: nodes seen gone by an earlier
    call, not read again (at the job's end no rank changes hands)."""
    left = coord.marks(0, "left")
    still = []
    for node in range(coord.nnodes):
        if node in gone:
            continue
        held = owner(coord, node)[1]
        if (held is None or left.get(node) == str(held.incarnation)
                or coord.get("node", node, "lost") == str(held.incarnation).encode()):
            gone.add(node)
        else:
            still.append(node)
    return still


def host_until_the_run_ends(coord: Coordinator, events: EventLog, node_timeout: float,
                            stopped: Callable[[], bool]) -> None:
    """This launcher hosts the c10d control store and a spare took its node's rank (its supervisor died or was
    cut off): the job goes on on this store, which must stay up until the run ends (the launchers that end it
    set ``state``), this launcher is told to stop (``stopped``), or no supervisor has beaten for
    3 x ``node_timeout`` (the others are gone without a word). Leaving at once took the store, and the job, with
    it."""
    events.emit("store_kept", f"node {coord.node_rank} left the job to a spare; this launcher keeps the control "
                "store up until the job ends", node=coord.node_rank)
    seen, moved = coord.beats(), time.monotonic()
    while coord.get("state") is None and not stopped():
        time.sleep(_HOST_LOOK)
        beats = coord.beats()
        if beats != seen:
            seen, moved = beats, time.monotonic()
        elif time.monotonic() - moved > 3 * node_timeout:
            return
