"""The control-plane protocol between the supervisors of a job, over the control store.

Key layout. ``ftrun/<job>/incarnation`` holds the job's current *run* ``{"run": N, "token": ...}``; every other
key of the run lives under ``ftrun/<job>/<N>/`` (:meth:`Coordinator.key`), so a long-lived ``ftrun store``
reused by a later run of the same job id never shows it the earlier run's keys. The first launcher of a new run
takes N + 1 by compare-and-set (:func:`open_run`) when run N ended (``<N>/state`` set by its launchers), looks
dead (its supervisors' beats do not move for :data:`RUN_STALE_AFTER` seconds) or belongs to another SLURM
step (``token``); later nodes and replacement supervisors of a running job join N. SLURM's node-rank
agreement (``ftrun/<job>/slurm-step/<step>/...``, before a run is chosen) is keyed by its step instead.

Signing. Every value is written and read through :class:`~ftrun.control.signed.SignedStore`: it carries an
HMAC-SHA256 with the job secret over its key and payload, and a value that does not verify (garbage, forged,
truncated, copied from another key) reads as absent with one warning per key and process. There are no
unsigned counters: beats are signed values of one writer each, and a node rank's owner document moves by
compare-and-set on its exact bytes (torch's ``add`` is not used: on a value that is not a number the store
drops the caller's connection, which would end a supervisor). What is left to a writer without the secret:
replaying an older authentic value of the same key, and overwriting or deleting values. A replayed ``gen``
never moves the generation backwards (a coordinator ignores a generation lower than one it knows, and a fresh
one also consults ``history/``); a replayed beat makes a dead node look alive as long as the replays go on (the
job waits instead of restarting), and so does a replayed ``node/<r>/lost`` naming the rank's current owner
(its peers stop counting its silence until it rejoins: its death then shows as the other trainers' hang, and a
rendezvous waits for it up to --rdzv-timeout); a replayed incarnation document makes a new launcher start a new run;
a replayed older ``progress`` (:mod:`ftrun.snapshot.link`) changes nothing, since a reader keeps the newest steps.
Overwriting or deleting a value the protocol waits for (a ready mark, a claim) stalls the job until a timeout
ends it: a denial of service that signing cannot prevent (local jobs listen on loopback only; see
:mod:`ftrun.control.store`).

Protocol of a run, in the order a generation goes through it:

1. ``gen`` holds the current :class:`Generation` as JSON. Whoever first sees a failure moves it from
   generation g to g+1 by compare-and-set on the exact bytes it read (authentic or not), with the cause;
   exactly one writer wins, everyone else reads the winner's document (each proposal carries a random nonce:
   the store tells the winner by the bytes it holds, and two nodes may propose the same cause at once).
   ``history/<g>`` keeps every generation's document; its appearance wakes the supervisors
   (:mod:`ftrun.control.generation_watch`), which then read ``gen``.
2. Every supervisor watching ``gen`` stops its trainers when it changes, then marks ``gen/<g>/ready/<node>``
   with its incarnation (``node/<r>/owner`` names the supervisor that runs node rank r and counts those that
   ever did; see :mod:`ftrun.control.ownership`, which also has the hot spares' claims). Node 0
   publishes the generation's fresh trainer store in ``gen/<g>/master`` before it marks itself ready.
3. When all nodes are ready (node 0 sees every mark and sets ``gen/<g>/go``, which the others wait for: one
   key each) every supervisor starts its trainers with ``TORCHELASTIC_RESTART_COUNT=g``, and
   notes ``gen/<g>/started/<node>`` and, once each local trainer has beaten, ``gen/<g>/up/<node>`` (wall time).
   Meanwhile the nodes agree on the snapshot step the trainers restore (:mod:`ftrun.snapshot.link`) and note
   it in ``gen/<g>/restore``.
4. A node whose trainers all exited 0 marks ``gen/<g>/done/<node>``; the job is done when every node has.

Liveness: every supervisor writes a growing count to ``node/<r>/beat`` four times a second; each node watches
the values (never clocks) of the few nodes after it on a ring (:mod:`ftrun.launch.peers`), and a value that
stops changing for ``node_timeout`` means the node is lost. A node-lost generation also writes
``node/<r>/lost`` (the lost owner's incarnation): that owner is not declared lost again, by its peers or by its
launcher when it finds it dead (:meth:`Coordinator.declared_lost`), while the job waits for its replacement
(which may take minutes on a real cluster; ``--rdzv-timeout`` bounds the wait), and a supervisor declared lost
while alive clears it when it rejoins (:meth:`Coordinator.rejoin`). Under srun each launcher also counts in
``node/<r>/launcher`` (:meth:`Coordinator.beat_launcher`): a lost node whose count still moves has an ftrun that
lives, which may replace its supervisor, so the others wait for it instead of ending the step. A supervisor
that starts as a replacement (incarnation > 1) whose predecessor was part of the current generation bumps the
generation. Bumping past ``max_restarts`` ends the job: supervisors stop instead of starting the next generation.
"""

from __future__ import annotations

import json
import random
import secrets
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, fields

from torch.distributed import DistError

from ftrun.control.signed import SignedStore
from ftrun.control.store import Store
from ftrun.errors import UsageError, same_failure

RUN_STALE_AFTER = 1.5  # seconds without any beat of a run that did not end before a new launcher starts a new run
_LIVENESS_POLL = 0.05
CAS_TRIES = 200  # compare-and-set attempts on a key someone keeps rewriting before giving up (a store under attack)
_RUN_PROBE = 8  # runs looked ahead for newer ones (a launcher that died before creating its run leaves a gap)


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
    incarnation: int | None = None  # node-lost: the lost owner's incarnation (:mod:`ftrun.control.ownership`)
    # crash: what failed ("Type: message" of the trainer's error file, "killed by SIGSEGV", "exited with code 2")
    # and whether before any trainer of the generation had sent its first heartbeat (crash loops)
    signature: str = ""
    early: bool = False
    # random, per proposal: a compare-and-set tells success by the bytes stored, so two nodes proposing the same
    # failure at the same instant (a hang's culprit is agreed job-wide) must not write equal bytes
    nonce: str = ""

    def encode(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def decode(cls, raw: bytes | str) -> Generation:
        doc = json.loads(raw)
        if not isinstance(doc, dict):
            raise TypeError("a generation document is a JSON object")
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in doc.items() if k in known})  # a newer ftrun's fields are ignored

    def repeated_by(self, failure: Failure) -> bool:
        """Whether ``failure``, seen in this generation, is a crash loop: it and the crash that started this
        generation happened the same way (same signature, numbers aside: :func:`~ftrun.errors.same_failure`),
        both before the first heartbeat, or both at the same reported step (a restore replays the steps bit for
        bit: a crash at the step it restored, or after the last snapshot, comes back at every restart). A hang
        repeats one when the same rank hung at the same reported step (a deadlock at step N, or a step slower than
        the hang timeout, comes back at every restart; a hang before the first heartbeat has no step to compare)."""
        if self.kind == failure.kind == "hang":
            return self.step is not None and (failure.rank, failure.step) == (self.rank, self.step)
        return (self.kind == failure.kind == "crash" and same_failure(failure.signature, self.signature)
                and ((self.early and failure.early) or (self.step is not None and failure.step == self.step)))


GENESIS = Generation(0, "start", "job started")  # generation 0 as read when the store holds no authentic one


@dataclass(frozen=True)
class Failure:
    """A failure as seen by one observer, before it becomes (or fails to become) the next generation."""

    kind: str
    reason: str
    node: int | None = None
    rank: int | None = None
    detected_by: str = ""
    step: int | None = None
    incarnation: int | None = None  # node-lost: the lost owner's incarnation
    signature: str = ""  # crash: what failed (see :class:`Generation`)
    early: bool = False  # crash: before any trainer of the generation had sent its first heartbeat


@dataclass
class _Trust:
    """What this process uses for one job's control store: the secret, where warnings go, which keys it already
    warned about, and the run it belongs to (None: the store's current run)."""

    secret: str
    warn: Callable[[str], None] | None
    run: int | None
    warned: set[str] = field(default_factory=set)


_JOBS: dict[str, _Trust] = {}


def use_job(job_id: str, secret: str, warn: Callable[[str], None] | None = None, run: int | None = None) -> None:
    """Register this process's secret (and warning sink, and run) of ``job_id``: every :class:`Coordinator` of
    the job made afterwards from a plain store uses them (as the keeper link's and the beat thread's do, which
    open their own store connections)."""
    _JOBS[job_id] = _Trust(secret, warn, run)


def signed(store: Store | SignedStore, job_id: str) -> SignedStore:
    """``store`` wrapped with the secret :func:`use_job` registered for ``job_id`` (as is when already signed)."""
    if isinstance(store, SignedStore):
        return store
    trust = _JOBS.get(job_id)
    if trust is None:
        raise RuntimeError(f"no secret for job {job_id} in this process (ftrun.control.coordination.use_job)")
    return SignedStore(store, trust.secret, trust.warn, trust.warned)


def incarnation_key(job_id: str) -> str:
    """The key naming the job's current run (it exists once any launcher of the job started)."""
    return f"ftrun/{job_id}/incarnation"


def _run_doc(store: SignedStore, raw: bytes | None, job_id: str) -> tuple[int, str | None] | None:
    """(run, token) of the incarnation document ``raw``; None when absent or not authentic."""
    payload = store.open(incarnation_key(job_id), raw) if raw else None
    if payload is None:
        return None
    doc = json.loads(payload)
    return int(doc["run"]), doc.get("token")


def _newest_run(store: SignedStore, job_id: str, start: int) -> int:
    """The newest run >= ``start`` that has a generation key, looking up to :data:`_RUN_PROBE` runs past each
    one found (a newer one than the incarnation document says means the document is a replay)."""
    newest, probe = start, start + 1
    while probe <= newest + _RUN_PROBE:
        if store.check([f"ftrun/{job_id}/{probe}/gen"]):
            newest = probe
        probe += 1
    return newest


def current_run(store: SignedStore, job_id: str) -> int | None:
    """The job's current run in the store (None: no run yet)."""
    doc = _run_doc(store, store.get_raw(incarnation_key(job_id)), job_id)
    newest = _newest_run(store, job_id, doc[0] if doc else 0)
    return newest or None


def open_run(store: SignedStore, job_id: str, token: str | None, stale_after: float = RUN_STALE_AFTER) -> int:
    """The run this launcher belongs to: the current one if it is joinable (same ``token``; without tokens:
    not ended and not dead), else a new one, taken by compare-and-set so that concurrent launchers agree."""
    key = incarnation_key(job_id)
    for _ in range(CAS_TRIES):
        raw = store.get_raw(key) or b""
        if store.signed_otherwise(key, raw) and _newest_run(store, job_id, 0):
            raise UsageError(f"the control store holds runs of job {job_id} signed with another secret: every node "
                             "of a job needs the same secret file (--secret-file, default ~/.ftrun/secret: copy "
                             "one node's to the others), and a job id run before with another one needs a new "
                             "--rdzv-id")
        doc = _run_doc(store, raw, job_id)
        newest = _newest_run(store, job_id, doc[0] if doc else 0)
        if doc is not None and newest > doc[0]:
            store.warn_once(key, f"names run {doc[0]}, but run {newest} exists (a replay)")
        elif doc is not None and _joinable(store, job_id, doc, token, stale_after):
            return doc[0]
        won, _ = store.compare_set(key, raw, json.dumps({"run": newest + 1, "token": token}))
        if won:
            return newest + 1
    raise DistError(f"the control store's {key} keeps changing; giving up")


def _joinable(store: SignedStore, job_id: str, doc: tuple[int, str | None], token: str | None,
              stale_after: float) -> bool:
    run, theirs = doc
    if token is not None or theirs is not None:
        return token == theirs
    prefix = f"ftrun/{job_id}/{run}/"
    if store.get(prefix + "state") is not None:
        return False  # ended
    job = store.get(prefix + "job")
    if job is None:
        return True  # being set up by the launcher that took it
    keys = [f"{prefix}node/{node}/beat" for node in range(int(json.loads(job)["nnodes"]))]
    before = store.multi_get(keys)
    if all(value is None for value in before):
        return True  # no supervisor up yet
    deadline = time.monotonic() + stale_after
    while time.monotonic() < deadline:  # a live run beats within a beat interval: join it then, not after stale_after
        time.sleep(_LIVENESS_POLL)
        if store.multi_get(keys) != before:
            return True
    return False


class Coordinator:
    """One process's view of the protocol above; every call is a short, non-blocking store round trip.

    ``store`` is a :class:`SignedStore`, or a plain store signed with the secret :func:`use_job` registered.
    ``run``: the job's run (default: the one :func:`use_job` registered, else the store's current run)."""

    def __init__(self, store: Store | SignedStore, job_id: str, node_rank: int, nnodes: int,
                 run: int | None = None) -> None:
        self.store = signed(store, job_id)
        self.job_id = job_id
        self.node_rank = node_rank
        self.nnodes = nnodes
        trust = _JOBS.get(job_id)
        if run is None and trust is not None:
            run = trust.run
        self.run = run if run is not None else current_run(self.store, job_id) or 0
        self._prefix = f"ftrun/{job_id}/{self.run}/"
        self._newest: tuple[Generation, bytes] | None = None  # the newest authentic generation read
        self._beats: list[int] = [0] * nnodes  # the last authentic beat count read of each node
        self._beat: int | None = None  # this node's last beat count written
        self._launcher_beat = 0  # the last launcher beat count written (beat_launcher)
        self._history: list[Generation] = []  # history() read so far: the documents of generations < _history_next
        self._history_next = 0

    def key(self, *parts: object) -> str:
        return self._prefix + "/".join(str(p) for p in parts)

    def get(self, *parts: object) -> bytes | None:
        """The authentic value of the key made of ``parts``, or None when it is not set or not authentic (never
        blocks)."""
        return self.store.get(self.key(*parts))

    # -- generations ------------------------------------------------------------------------------------
    def init_job(self, doc: dict[str, object]) -> None:
        """Create generation 0 unless the job already exists (a node or launcher that starts late)."""
        start = Generation(0, "start", "job started", time=time.time()).encode()
        if self.store.compare_set(self.key("gen"), b"", start)[0]:
            self.store.set(self.key("history", 0), start)
        self.store.compare_set(self.key("job"), b"", json.dumps(doc))

    def job_doc(self) -> dict[str, object] | None:
        raw = self.get("job")
        return None if raw is None else json.loads(raw)

    def _generation(self, key: str, payload: bytes | None) -> tuple[Generation, bytes] | None:
        if payload is None:
            return None
        try:
            return Generation.decode(payload), payload
        except (ValueError, TypeError):
            self.store.warn_once(key, "not a generation document")
            return None

    def _from_history(self, found: tuple[Generation, bytes] | None) -> tuple[Generation, bytes]:
        """The newest generation in ``history/`` from ``found`` on (a fresh reader cannot be fooled by a
        replayed older ``gen``)."""
        gen = found[0].gen + 1 if found else 0
        while (newer := self._generation(self.key("history", gen), self.get("history", gen))) is not None:
            found, gen = newer, gen + 1
        return found or (GENESIS, GENESIS.encode().encode())

    def current_raw(self) -> bytes:
        """The current generation's document (authentic JSON; equal documents are equal bytes).

        A ``gen`` value that is not authentic, or an authentic one of a lower generation than this coordinator
        already returned (a replay), is ignored with a warning: the newest authentic one is returned again."""
        return self._follow(self.get("gen"))

    def look(self, keys: Sequence[str]) -> tuple[bytes, bytes | None, list[bytes | None]]:
        """What a watching supervisor reads four times a second, in one round trip: :meth:`current_raw`, the hang
        vote (for :meth:`hang_vote_open`) and the authentic values of ``keys`` (its peers')."""
        current, vote, *values = self.store.multi_get([self.key("gen"), self.key("hang"), *keys])
        return self._follow(current), vote, values

    def _follow(self, payload: bytes | None) -> bytes:
        """:meth:`current_raw` from ``payload``, the authentic value of ``gen`` just read (None: not set or not
        authentic)."""
        key = self.key("gen")
        found = self._generation(key, payload)
        known = self._newest
        if known is None:
            self._newest = self._from_history(found)
        elif found is not None and found[0].gen >= known[0].gen:
            self._newest = found
        elif found is not None:
            self.store.warn_once(key, f"generation {found[0].gen} is older than generation {known[0].gen} "
                                 "(a replay)")
        assert self._newest is not None
        return self._newest[1]

    def current(self) -> Generation:
        return Generation.decode(self.current_raw())

    def bump(self, seen: bytes, failure: Failure) -> tuple[bytes, bool]:
        """Move from the generation whose document is ``seen`` to the next one.

        Returns the document now current and whether this call's failure made it. The compare-and-set starts
        from the exact bytes ``gen`` holds, so a garbage or replayed value there is replaced, never followed."""
        old = Generation.decode(seen)
        key = self.key("gen")
        for _ in range(CAS_TRIES):
            stored = self.store.get_raw(key) or b""
            found = self._generation(key, self.store.open(key, stored) if stored else None)
            if found is not None and found[0].gen > old.gen:
                self._newest = found
                return found[1], False
            new = Generation(old.gen + 1, failure.kind, failure.reason, failure.node, failure.rank,
                             failure.detected_by, time.time(), failure.step, failure.incarnation,
                             failure.signature, failure.early, secrets.token_hex(8))
            encoded = new.encode()
            if self.store.compare_set(key, stored, encoded)[0]:
                self.store.set(self.key("history", new.gen), encoded)
                if new.kind == "node-lost" and new.node is not None and new.incarnation is not None:
                    self.store.set(self.key("node", new.node, "lost"), str(new.incarnation))
                self._newest = (new, encoded.encode())
                return encoded.encode(), True
            time.sleep(random.uniform(0.001, 0.01))
        raise DistError(f"the control store's {key} keeps changing; giving up")

    def declared_lost(self, seen: bytes, node: int, incarnation: int) -> bool:
        """Whether ``node``'s supervisor ``incarnation`` was declared lost already, so that its loss seen again (its
        launcher finds it dead after a peer found it silent) is no new failure: ``seen``, the current generation's
        document, names it (a node-lost generation of this node and incarnation), or ``node/<r>/lost`` does (a
        node-lost generation since its last :meth:`rejoin`). Read ``seen`` before calling: a generation made
        after it fails a :meth:`bump` from it, and one made before it is in it, although its ``node/<r>/lost`` is
        written a moment after the generation."""
        gen = Generation.decode(seen)
        return ((gen.kind, gen.node, gen.incarnation) == ("node-lost", node, incarnation)
                or self.get("node", node, "lost") == str(incarnation).encode())

    def history(self) -> list[Generation]:
        """Every generation's document, oldest first (one whose ``history/<g>`` is not authentic left out). Each
        is written once, by the bump that made it, so those read before are kept: a call reads only the
        generations made since the last (a live view of a job that restarted a thousand times reads one or
        two keys per refresh, not a thousand)."""
        current = self.current().gen
        for g in range(self._history_next, current + 1):
            found = self._generation(self.key("history", g), self.get("history", g))
            if found is not None:
                self._history.append(found[0])
            elif g == current:  # the bump that made it writes it next: read it again next time
                break
            self._history_next = g + 1
        return list(self._history)

    # -- membership and barriers ----------------------------------------------------------------------------
    def note_exit(self, gen: int, rank: int, step: int | None) -> None:
        """Record that ``rank`` exited 0 at ``step`` in generation ``gen``, unless a trainer did before: a rank
        that leaves early (its data ran out) makes its peers fail with a connection error that names no rank."""
        self.store.compare_set(self.key("gen", gen, "first_exit"), b"", json.dumps({"rank": rank, "step": step}))

    def first_exit(self, gen: int) -> tuple[int, int | None] | None:
        """(rank, step) of the first trainer of generation ``gen`` that exited 0 (None: none did)."""
        raw = self.store.get(self.key("gen", gen, "first_exit"))
        try:
            doc = json.loads(raw) if raw is not None else None
            return (int(doc["rank"]), None if doc["step"] is None else int(doc["step"])) if doc else None
        except (ValueError, TypeError, KeyError):
            return None

    def mark(self, gen: int, what: str, value: object = 1) -> None:
        self.store.set(self.key("gen", gen, what, self.node_rank), str(value))

    def marks(self, gen: int, what: str) -> dict[int, str]:
        """node -> value for every node that set ``gen/<gen>/<what>/<node>`` (authentic values only), in one
        round trip where the store allows."""
        values = self.store.multi_get([self.key("gen", gen, what, node) for node in range(self.nnodes)])
        return {node: raw.decode() for node, raw in enumerate(values) if raw is not None}

    def marked(self, gen: int, what: str, nodes: Iterable[int] | None = None) -> dict[int, str] | None:
        """:meth:`marks` of ``nodes`` (default: every node) once every one of them has set its key (authentic
        values), else None.

        For waits on every node: while a key is missing this costs one round trip (``check``), where
        :meth:`marks` reads a c10d store's keys one by one: N nodes waiting on N keys would cost N^2 round trips
        per poll."""
        wanted = list(range(self.nnodes) if nodes is None else nodes)
        values = self.all_set([self.key("gen", gen, what, node) for node in wanted])
        return None if values is None else {node: raw.decode() for node, raw in zip(wanted, values)}

    def all_set(self, keys: Sequence[str]) -> list[bytes] | None:
        """The authentic value of every key, or None while any is missing or not authentic: one round trip
        (``check``) while one is missing, three once all are set."""
        if not self.store.check(keys):
            return None
        values = self.store.multi_get(keys)
        return None if None in values else [value for value in values if value is not None]

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

    def publish_master(self, gen: int, addr: str, port: int) -> None:
        self.store.set(self.key("gen", gen, "master"), f"{addr}:{port}")

    def master(self, gen: int) -> tuple[str, int] | None:
        """The trainer store of ``gen`` node 0 published (None: not, or not authentically)."""
        raw = self.get("gen", gen, "master")
        if raw is None:
            return None
        addr, _, port = raw.decode().rpartition(":")
        return addr, int(port)

    # -- liveness -------------------------------------------------------------------------------------------
    def beat(self) -> None:
        """Write this node's next beat count (going on from the count in the store, so it keeps changing across
        replacements)."""
        key = self.key("node", self.node_rank, "beat")
        if self._beat is None:
            payload = self.get("node", self.node_rank, "beat")
            self._beat = int(payload) if payload is not None else 0
        self._beat += 1
        self.store.set(key, str(self._beat))

    def beat_launcher(self, node: int) -> None:
        """Under srun: add to ``node/<r>/launcher``, the beat of ``node``'s ftrun (its launcher): the other nodes
        wait for a lost supervisor whose ftrun beats, which may come back or be replaced by that ftrun."""
        self._launcher_beat += 1
        self.store.set(self.key("node", node, "launcher"), str(self._launcher_beat))

    def launcher_beats(self, nodes: list[int]) -> dict[int, bytes | None]:
        """The launcher beats of ``nodes`` (None: none, or not authentic), in one round trip."""
        if not nodes:
            return {}
        return dict(zip(nodes, self.store.multi_get([self.key("node", n, "launcher") for n in nodes])))

    def rejoin(self, incarnation: int) -> None:
        """This node's supervisor (``incarnation``) joins a generation: if it was declared lost while alive (its
        ``node/<r>/lost`` names it), clear that, so that its peers watch its beats again."""
        if self.get("node", self.node_rank, "lost") == str(incarnation).encode():
            self.store.set(self.key("node", self.node_rank, "lost"), "")

    def beats(self, nodes: list[int] | None = None) -> list[int]:
        """The beat counts of ``nodes`` (default: every node), in one round trip; a value that is not authentic
        leaves the last authentic one in place."""
        nodes = list(range(self.nnodes)) if nodes is None else nodes
        values = self.store.multi_get([self.key("node", n, "beat") for n in nodes])
        for node, value in zip(nodes, values):
            if value is not None:
                self._beats[node] = int(value)
        return [self._beats[node] for node in nodes]

    def touch_watched_keys(self) -> None:
        """Make every node's beat and lost keys and the hang vote exist, so that :meth:`beats` and a supervisor's
        look (``gen``, the hang vote and its peers' keys, :mod:`ftrun.launch.peers`) read them in one round trip
        (a c10d store reads absent keys one by one)."""
        self.store.compare_set(self.key("hang"), b"", "")
        for node in range(self.nnodes):
            for what, empty in (("beat", "0"), ("lost", "")):
                self.store.compare_set(self.key("node", node, what), b"", empty)

    def open_hang_vote(self, gen: int) -> None:
        """Ask every node to report its silent trainers of generation ``gen`` (``hang`` holds the newest
        generation with a hang to attribute; read with :meth:`hang_vote_open`)."""
        self.store.set(self.key("hang"), str(gen))

    @staticmethod
    def hang_vote_open(payload: bytes | None, gen: int) -> bool:
        """Whether ``payload``, the value of ``hang`` just read, asks for generation ``gen``'s silent trainers."""
        return payload == str(gen).encode()
