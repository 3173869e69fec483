"""Lost-node detection: each supervisor watches the beat counters of the few nodes after it on a ring.

Node r watches nodes r+1 .. r+:data:`WATCHED_PEERS` (mod N), so every node is watched by that many others and
each check reads a constant number of keys whatever the size of the job (one round trip). A watched count that
does not change for ``node_timeout`` seconds means that node is lost. Time during which this supervisor could
not look (the control store paused it, the host stalled it) is never counted against a peer: after a check
that comes later than half the timeout, every peer's clock starts again.

A loss is declared once. A peer whose owner (:mod:`ftrun.control.ownership`) a node-lost generation already
named (``node/<r>/lost`` holds that owner's incarnation) is not declared lost again while the job waits for its
replacement, however long that takes to start (``--rdzv-timeout`` bounds the wait; a hot spare claims the rank
from the first declaration); declaring it again would only burn restarts. A new owner of the rank restarts the
peer's clock: it has ``node_timeout`` from taking the rank to beat.

The same round trip reads this node's own owner key (:mod:`ftrun.control.ownership`), so a supervisor learns
that a spare took its rank over at no extra cost.

A supervisor's own beats come from a :class:`Beater` thread, on a store connection of its own, every
:data:`BEAT_INTERVAL` seconds.

Hot spares are watched the same way where a node counts on one (:class:`SpareWatch`): a spare whose beat count
does not change for ``node_timeout`` is dead, whatever its record in the store still says.
"""

from __future__ import annotations

import threading
import time

from torch.distributed import DistError

from ftrun.control.backend import OutageReport, reopen_store, spec_address
from ftrun.control.coordination import Coordinator
from ftrun.control.ownership import Owner, waiting_spares
from ftrun.control.spec import NodeSpec

WATCHED_PEERS = 3  # nodes each node watches; a loss goes unseen only if all of its watchers are lost too
SPARE_LOOKS = 4  # looks of a SpareWatch per timeout kept up (SpareWatch.keep_up)
BEAT_INTERVAL = 0.25  # seconds between a supervisor's beats (Beater)


class Beater(threading.Thread):
    """Adds to this node's beat counter every :data:`BEAT_INTERVAL` on its own store connection."""

    def __init__(self, spec: NodeSpec, report: OutageReport) -> None:
        super().__init__(name="ftrun-beat", daemon=True)
        store = reopen_store(spec_address(spec), spec.rdzv_timeout, report)  # the supervisor reached it before
        self._coord = Coordinator(store, spec.job_id, spec.node_rank, spec.nnodes)
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.is_set():
            try:
                self._coord.beat()
            except DistError:
                return
            self._stop_event.wait(BEAT_INTERVAL)

    def stop(self) -> None:
        self._stop_event.set()


def watched(node: int, nnodes: int) -> list[int]:
    """The nodes ``node`` watches."""
    return [(node + i) % nnodes for i in range(1, min(WATCHED_PEERS, nnodes - 1) + 1)]


class PeerWatch:
    """The beats of this node's watched peers, and its own ownership; :meth:`check` every few hundred ms."""

    def __init__(self, coord: Coordinator, node: int, nnodes: int, timeout: float, me: Owner) -> None:
        self.coord = coord
        self.peers = watched(node, nnodes)
        self.timeout = timeout
        self.me = me
        # what :meth:`check` reads (a caller may read them with other keys and pass the values)
        self.keys = [coord.key("node", n, what) for what in ("beat", "owner", "lost") for n in self.peers]
        self.keys.append(coord.key("node", node, "owner"))
        self._counts: dict[int, int | None] = {n: None for n in self.peers}
        self._owners: dict[int, int | None] = {n: None for n in self.peers}  # incarnation of each peer's owner
        self._changed = dict.fromkeys(self.peers, time.monotonic())
        self._last_check = time.monotonic()
        self.replaced_by: Owner | None = None  # set once another supervisor owns this node rank

    def check(self, values: list[bytes | None] | None = None) -> tuple[int, float] | None:
        """(a lost peer, seconds its count has not changed), or None; sets :attr:`replaced_by` when fenced.
        ``values``: the authentic values of :attr:`keys` just read (default: read them now)."""
        if values is None:
            values = self.coord.store.multi_get(self.keys)
        now = time.monotonic()
        if now - self._last_check > self.timeout / 2:  # this process could not look: nobody is to blame
            self._changed = dict.fromkeys(self.peers, now)
        self._last_check = now
        mine = values[-1]  # a newer owner took the rank (an older one is a replay: ignored)
        if mine is not None and (current := Owner.decode(mine)).incarnation > self.me.incarnation:
            self.replaced_by = current
        n = len(self.peers)
        for node, beat, held, lost in zip(self.peers, values[:n], values[n:2 * n], values[2 * n:3 * n]):
            count = int(beat) if beat is not None else None
            # a new supervisor took the rank (an older owner is a replay: ignored): its clock starts now
            incarnation = Owner.decode(held).incarnation if held is not None else None
            if incarnation is not None and incarnation > (self._owners[node] or 0):
                self._owners[node], self._changed[node] = incarnation, now
            owner = self._owners[node]
            declared = owner is not None and lost == str(owner).encode()  # its loss is known already
            if count != self._counts[node]:
                self._counts[node], self._changed[node] = count, now
            elif count and not declared and now - self._changed[node] > self.timeout:  # 0/None: not started
                return node, now - self._changed[node]
        return None


class SpareWatch:
    """Whether a hot spare still waits to take a rank: its record says so (:func:`~ftrun.control.ownership.
    waiting_spares`) and its beat count (``spares/<i>/beat``, written every :data:`~ftrun.launch.spare.SPARE_BEAT`)
    changed within ``timeout`` seconds of this watcher's looks. A spare killed while it waited (its ftrun, its
    host) leaves its record "waiting" for good; its count stops. A spare first seen has ``timeout`` from then,
    and time during which this process could not look is not counted against any spare (as :class:`PeerWatch`)."""

    def __init__(self, coord: Coordinator, timeout: float) -> None:
        self.coord = coord
        self.timeout = timeout
        self._counts: dict[int, bytes | None] = {}  # by spare index: the beat count last read
        self._changed: dict[int, float] = {}  # by spare index: when that count was first read
        self._last_look = time.monotonic()

    def waiting(self) -> bool:
        """One look (two round trips): whether a spare waits that has beaten within ``timeout``."""
        beats = waiting_spares(self.coord)
        now = time.monotonic()
        if now - self._last_look > self.timeout / 2:  # this process could not look: nobody is to blame
            self._changed = dict.fromkeys(self._changed, now)
        self._last_look = now
        for index, count in beats.items():
            if index not in self._counts or count != self._counts[index]:
                self._counts[index], self._changed[index] = count, now
        return any(now - self._changed[index] <= self.timeout for index in beats)

    def keep_up(self) -> None:
        """A look (:meth:`waiting`) when the last one is :data:`SPARE_LOOKS`-th of ``timeout`` old, else nothing:
        for a caller that asks :meth:`waiting` only now and then (every ``timeout``) and calls this at each of its
        polls. Looked at that often, no gap between two looks exceeds ``timeout / 2`` (which would restart every
        spare's clock, so that a dead one would never be seen), for two round trips per interval, not per poll."""
        if time.monotonic() - self._last_look >= self.timeout / SPARE_LOOKS:
            self.waiting()
