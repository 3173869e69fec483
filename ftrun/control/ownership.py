"""Who runs each node rank, and the hot spares waiting to take one (keys under the run's prefix).

- ``node/<r>/owner``: JSON :class:`Owner`, the supervisor that runs node rank r and the count of supervisors
  that ever ran it (its *incarnation*). A supervisor started for rank r (by a local launcher, or ``--node-rank
  r``) *takes* it whatever is there. A spare only *claims* it from the owner a node-lost generation names as
  lost (its incarnation is in that generation's document): one compare-and-set from exactly those bytes, so of
  several spares racing for it one wins and the others stay spares, and a rank already taken again (by a
  replacement, or by another spare) is not claimed. So does the replacement that a multi-node launcher starts
  for its own supervisor that died: of it and the spares, one gets the rank.
- Fencing: an owner that finds another id in its owner key was replaced (it was seen as lost, and a spare took
  its rank): it stops its trainers and exits instead of training beside its replacement.
- ``node/<r>/claim``: JSON ``{"id", "host"}`` of the launcher that got node rank r in torchrun's multi-node form
  without ``--node-rank`` (:func:`claim_free_rank`): created once by compare-and-set from absent, never replaced,
  so each rank of a run goes to exactly one launcher, first come, first served.
- ``spares/count`` and ``spares/<i>``: JSON :class:`SpareDoc` of spare i (for ``ftrun status`` and the
  summary); ``spares/<i>/beat``: its beat counter, like a node's.

Cost: taking or claiming a rank is one read and one compare-and-set (a few more under contention), whatever
the number of nodes; a spare's wait reads two keys per poll.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

from torch.distributed import DistError

from ftrun.control.coordination import CAS_TRIES, Coordinator


@dataclass(frozen=True)
class Owner:
    """The supervisor that runs a node rank."""

    incarnation: int  # 1 for the first supervisor of the rank, +1 for each that took it over
    id: str  # unique per supervisor process
    spare: str | None = None  # the spare's name when a spare claimed the rank
    host: str = ""
    shm: str = ""  # its shared-memory directory (:func:`~ftrun.control.spec.shm_place`): same name, same files

    def encode(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def decode(cls, raw: bytes | str) -> Owner:
        return cls(**json.loads(raw))


def owner(coord: Coordinator, node: int) -> tuple[bytes, Owner | None]:
    """The exact bytes of ``node``'s owner key (b"": not set) and the owner they name (None: none authentic)."""
    key = coord.key("node", node, "owner")
    raw = coord.store.get_raw(key) or b""
    payload = coord.store.open(key, raw) if raw else None
    return raw, Owner.decode(payload) if payload is not None else None


def _advance(coord: Coordinator, key: str, after: Callable[[bytes | None], str]) -> str:
    """Replace ``key``'s value by ``after(its authentic payload, None when absent)`` by compare-and-set, again
    while others change it meanwhile; returns the value stored. ``after`` must make a value no other writer could
    make at the same time: the store tells a success by the bytes it holds afterwards (signing is
    deterministic), so two writers storing equal bytes would both believe they won."""
    for _ in range(CAS_TRIES):
        raw = coord.store.get_raw(key) or b""
        value = after(coord.store.open(key, raw) if raw else None)
        if coord.store.compare_set(key, raw, value)[0]:
            return value
    raise DistError(f"the control store's {key} keeps changing; giving up")


def take(coord: Coordinator, node: int, me: str, host: str, shm: str = "") -> int:
    """Take ``node``'s rank whoever holds it (a supervisor started for that rank); returns this incarnation."""

    def after(payload: bytes | None) -> str:
        incarnation = Owner.decode(payload).incarnation + 1 if payload is not None else 1
        return Owner(incarnation, me, None, host, shm).encode()

    return Owner.decode(_advance(coord, coord.key("node", node, "owner"), after)).incarnation


def claim(coord: Coordinator, node: int, lost: int, me: str, spare: str | None, host: str,
          shm: str = "") -> int | None:
    """Claim ``node``'s rank for spare ``spare`` (None: for the replacement that the lost owner's launcher
    started) if it is still held by incarnation ``lost`` (the one a node-lost generation named; 0: no owner
    yet); returns the new incarnation, or None when another spare or a replacement was first."""
    raw, current = owner(coord, node)
    if (current.incarnation if current is not None else 0) != lost:
        return None
    won, _ = coord.store.compare_set(coord.key("node", node, "owner"), raw,
                                     Owner(lost + 1, me, spare, host, shm).encode())
    return lost + 1 if won else None


def claim_free_rank(coord: Coordinator, me: str, host: str) -> int | None:
    """The lowest node rank of the run that no launcher claimed yet, claimed for ``me`` (on ``host``); None when
    every rank is taken. One read of all claim keys, then a compare-and-set from absent on each rank seen free,
    in order, until one wins: of launchers racing for a rank exactly one gets it, the others try the next."""
    keys = [coord.key("node", node, "claim") for node in range(coord.nnodes)]
    seen = coord.store.raw.get_many(keys)  # raw: a claim that is not authentic still holds its rank
    doc = json.dumps({"id": me, "host": host})
    for node, (key, value) in enumerate(zip(keys, seen)):
        if value is None and coord.store.compare_set(key, b"", doc)[0]:
            return node
    return None


@dataclass(frozen=True)
class SpareDoc:
    """A spare as ``ftrun status`` and the summary show it."""

    name: str
    host: str
    pid: int
    state: str  # waiting | took | gone
    node: int | None = None  # the node rank it took
    generation: int | None = None  # the generation in which it took it
    time: float = 0.0  # when it started, or took a rank

    def encode(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def decode(cls, raw: bytes | str) -> SpareDoc:
        return cls(**json.loads(raw))


def enlist(coord: Coordinator, doc: SpareDoc) -> int:
    """Add a spare to the registry; returns its index (its keys are ``spares/<index>``)."""
    token = secrets.token_hex(8)  # two spares enlisting at once must not store equal bytes (see _advance)
    count = _count(_advance(coord, coord.key("spares", "count"), lambda payload: f"{_count(payload) + 1} {token}"))
    coord.store.set(coord.key("spares", count - 1), doc.encode())
    return count - 1


def _count(payload: bytes | str | None) -> int:
    """The number of spares in a ``spares/count`` value (``"<count> <token of its writer>"``)."""
    if payload is None:
        return 0
    text = payload.decode() if isinstance(payload, bytes) else payload
    return int(text.split()[0])


def update_spare(coord: Coordinator, index: int, doc: SpareDoc) -> None:
    coord.store.set(coord.key("spares", index), doc.encode())


def retire_spare(coord: Coordinator, name: str, pid: int) -> bool:
    """Mark spare ``name``'s record (its process ``pid``, which died) "gone" if it says the spare waits; False when
    no such record waits (the spare died before it enlisted, or after it took a rank)."""
    count = _count(coord.get("spares", "count"))
    docs = coord.store.multi_get([coord.key("spares", i) for i in range(count)])
    for index, raw in enumerate(docs):
        doc = SpareDoc.decode(raw) if raw is not None else None
        if doc is not None and (doc.name, doc.pid, doc.state) == (name, pid, "waiting"):
            update_spare(coord, index, replace(doc, state="gone", time=time.time()))
            return True
    return False


def spares(coord: Coordinator) -> list[SpareDoc]:
    """Every spare that ever enlisted in this run, oldest first."""
    count = _count(coord.get("spares", "count"))
    docs = coord.store.multi_get([coord.key("spares", i) for i in range(count)])
    return [SpareDoc.decode(doc) for doc in docs if doc is not None]


def waiting_spares(coord: Coordinator) -> dict[int, bytes | None]:
    """The beat count (None: not beaten yet) of each spare whose record says it waits, by index: two round trips
    whatever the number of spares. A record says nothing of whether its spare still lives (one killed while it
    waits never updates it): its beats do (:class:`~ftrun.launch.peers.SpareWatch`)."""
    count = _count(coord.get("spares", "count"))
    values = coord.store.multi_get([coord.key("spares", i, *what) for what in ((), ("beat",)) for i in range(count)])
    return {i: beat for i, (doc, beat) in enumerate(zip(values[:count], values[count:]))
            if doc is not None and SpareDoc.decode(doc).state == "waiting"}


def spare_doc(name: str, host: str, pid: int) -> SpareDoc:
    return SpareDoc(name, host, pid, "waiting", time=time.time())
