"""The supervisor's thread between its node's keeper and the control store (the keeper has no store client).

Per generation g, keys under ``ftrun/<job>/gen/<g>/``:

- ``held/<node>``: JSON :class:`Holdings`: the committed snapshot steps of every rank of the node (by their
  headers), the steps its keeper holds complete parity of, and the address its keeper serves peers on;
  published at the start of g. Every node computes the same :class:`RestorePlan` from all of them
  (:func:`plan_restore`): the restore chain: the newest step that every rank holds in RAM, else can get rebuilt
  from its EC group's parity, else loads from disk, else step 0. The nodes that hold a RAM or parity step first
  verify the checksums of its slots, of that step only (``verify/<step>.<try>/<node>``: "ok" or why not); if one
  fails (its keeper dropped the slot), every node publishes its holdings again (``held.<try>/<node>``) and plans
  anew. The nodes that lack a parity step rebuild it first (their keepers,
  from the group's nodes that hold the step and its parity; ``rebuild/<step>[.<try>]/<node>``: "ok" or why not); for a
  disk step every node's keeper loads and verifies it first (``load/<step>/<node>``). If any of them fails,
  every node excludes that source for that step and plans again within g: a failed source is never tried
  twice and never costs a restart. Only then do they tell their keeper the plan; trainers wait for it.
- ``commit/<node>``: JSON :class:`Commits`, the steps every rank of the node holds now, those some rank of it
  holds, and the newest step that every rank of the node has committed or skipped (*decided*);
  ``parity/<node>``: JSON ``[steps]``, the steps its keeper holds complete parity of. The link publishes them
  whenever they change.
- ``progress``: JSON :class:`Progress`, the newest step every rank holds (*committed*: the encoders start on it),
  the newest one that is also covered by parity on every node (*protected*: trainers may then overwrite the
  older slot; without erasure coding the two are the same), and the *abandoned* steps newer than that: steps a
  node holds that another node has decided without holding (a rank skipped it), which never become committed,
  so a rank holding one overwrites it. While node 0 holds or has decided a step newer than the protected one,
  its link reads every node's ``commit`` and ``parity`` and publishes ``progress`` when it changes; while another
  node does, its link reads ``progress`` alone (:class:`ProgressTracker`). So a look costs node 0 two reads of N
  keys and every other node one read of one key: the store serves O(N) keys per poll interval for the whole job,
  not O(N^2), and each node checks the signature of one value, not 2N. Each link tells its keeper.

``group/<X>/protected`` (job-wide key): group X's protected step, for the status view (node 0 writes it too).

When the link starts with erasure coding on, it reads what the other nodes of its group published in the
current generation, else in the newest one before it where they published (a replacement starts while the
others wait for it to begin the new one): if they can rebuild a step for this node (:func:`rebuild_candidate`),
it tells the keeper (``prepare``), which allocates the slots that rebuild would fill while the generation is
agreed (a hint; a keeper that holds any snapshot ignores it).

With a checkpoint directory, each ``held`` document also lists the complete steps of the job on disk.
Persisting itself is coordinated by :mod:`ftrun.snapshot.durability`.

Pace: while this node holds or has decided a step the job has not secured yet, or a persist round needs it, the
link polls its keeper and the store every :data:`LINK_INTERVAL` (or the store's poll interval). Otherwise its
poll waits in the keeper, which answers at a change (a commit, a skip, parity, a persist, a fatal error) or after
``POLL_WAIT``; the supervisor nudges it at a new generation, a stop and the final persist. So an idle node costs
a few wakeups a second, not 200 (two processes at 100 a second: 5% of a core on this project's machine).
While it follows the store, a link writes its ``commit`` and ``parity`` documents (node 0 also ``progress``) again
every :data:`REPUBLISH` seconds though they did not change: one deleted from the store (anyone who reaches the
store can) is back within that time, where the job would otherwise wait for it forever.
"""

from __future__ import annotations

import json
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any
from dataclasses import dataclass, field

from torch.distributed import DistError

from ftrun.events import EventLog, brief_numbers
from ftrun.control.coordination import Coordinator
from ftrun.control.spec import NodeSpec
from ftrun.control.backend import OutageReport, reopen_store, spec_address
from ftrun.snapshot.durability import Durability
from ftrun.snapshot.protocol import PEER_LOST, POLL_WAIT, KeeperClient, KeeperError, KeeperUnavailable, socket_name

LINK_INTERVAL = 0.01  # seconds between two polls while the link follows the store (see Pace)
REPUBLISH = 1.0  # seconds: while a step is pending, a document unchanged since is written again this often
NUDGE_TIMEOUT = 2.0  # seconds the supervisor waits for its keeper's answer to a nudge
PEER_LOST_TRIES = 4  # rebuilds of a parity step that a survivor left unanswered, yet lived: then it is bad
PREPARE_LOOKBACK = 8  # generations looked back for the group's documents when the link starts (prepare)


def newest_common(sets: list[set[int]]) -> int:
    """The newest step in every set; 0 when there is none (or no sets)."""
    common = set.intersection(*sets) if sets else set()
    return max(common, default=0)


@dataclass(frozen=True)
class Holdings:
    """What one node holds at the start of a generation (the ``held`` document)."""

    ranks: dict[int, set[int]]
    parity: set[int]
    address: str = ""
    disk: set[int] = field(default_factory=set)  # complete steps of the job in the checkpoint directory

    @property
    def steps(self) -> set[int]:
        """The steps every rank of the node holds."""
        return set.intersection(*self.ranks.values()) if self.ranks else set()

    def encode(self) -> str:
        return json.dumps({"ranks": {str(r): sorted(s) for r, s in self.ranks.items()},
                           "parity": sorted(self.parity), "address": self.address, "disk": sorted(self.disk)})

    @classmethod
    def decode(cls, raw: str | bytes) -> Holdings:
        doc = json.loads(raw)
        return cls({int(r): set(s) for r, s in doc["ranks"].items()}, set(doc["parity"]), doc["address"],
                   set(doc["disk"]))


@dataclass(frozen=True)
class Commits:
    """What the ranks of one node hold now (``held``: every rank; ``some``: at least one), and the newest step
    they have all committed or skipped (the ``commit`` document; see the module doc). A step up to ``decided``
    that is not held by every rank never will be."""

    held: frozenset[int]
    some: frozenset[int] = frozenset()
    decided: int = 0

    def encode(self) -> str:
        return json.dumps({"held": sorted(self.held), "some": sorted(self.some), "decided": self.decided})

    @classmethod
    def decode(cls, raw: str | bytes) -> Commits:
        doc = json.loads(raw)
        return cls(frozenset(int(s) for s in doc["held"]), frozenset(int(s) for s in doc["some"]),
                   int(doc["decided"]))

    def passed(self, step: int) -> bool:
        """Whether a rank of the node went past ``step`` without it: then it never becomes committed."""
        return step <= self.decided and step not in self.held


@dataclass(frozen=True)
class Progress:
    """The job's committed and protected steps, and the abandoned steps newer than the protected one (the
    ``progress`` document; see the module doc)."""

    committed: int
    protected: int
    abandoned: frozenset[int] = frozenset()

    def encode(self) -> str:
        return json.dumps({"committed": self.committed, "protected": self.protected,
                           "abandoned": sorted(self.abandoned)})

    @classmethod
    def decode(cls, raw: str | bytes) -> Progress:
        doc = json.loads(raw)
        return cls(int(doc["committed"]), int(doc["protected"]), frozenset(int(s) for s in doc["abandoned"]))


class ProgressTracker:
    """How a node's link learns :class:`Progress` in one generation (module doc): node 0 computes it from every
    node's documents and publishes it, with each EC group's protected step (``group/<X>/protected`` and a
    ``protected`` event); the other nodes read it. Steps only advance."""

    def __init__(self, coord: Coordinator, nnodes: int, group: int, parity: int, events: EventLog) -> None:
        self.coord = coord
        self.nnodes, self.group, self.parity = nnodes, group, parity
        self.events = events
        self.known = Progress(0, 0)
        self._groups: dict[int, int] = {}  # node 0: the protected step published per group
        self._written = 0.0  # node 0: when it last wrote ``progress`` (monotonic)

    def start(self, step: int) -> None:
        """A new generation restores ``step`` on every rank: it is committed and protected."""
        self.known = Progress(step, step)

    def look(self, gen: int) -> Progress:
        """The progress known after one look (node 0 computes, the others read)."""
        found = self._compute(gen) if self.coord.node_rank == 0 else self._read(gen)
        if found is not None:
            protected = max(self.known.protected, found.protected)
            self.known = Progress(max(self.known.committed, found.committed), protected,
                                  frozenset(s for s in self.known.abandoned | found.abandoned if s > protected))
        return self.known

    def _read(self, gen: int) -> Progress | None:
        raw = self.coord.get("gen", gen, "progress")
        return Progress.decode(raw) if raw is not None else None

    def _compute(self, gen: int) -> Progress | None:
        docs = {n: Commits.decode(raw) for n, raw in self.coord.marks(gen, "commit").items()}
        held = set().union(*(doc.some for doc in docs.values()))
        dead = self.known.abandoned | {s for s in held if any(doc.passed(s) for doc in docs.values())}
        if len(docs) < self.nnodes:
            return Progress(self.known.committed, self.known.protected, frozenset(dead))
        commits = {n: set(doc.held) for n, doc in docs.items()}
        committed = max(self.known.committed, newest_common(list(commits.values())))
        protected = committed
        if self.parity:
            parities = {n: set(json.loads(raw)) for n, raw in self.coord.marks(gen, "parity").items()}
            if len(parities) < self.nnodes:
                return Progress(committed, self.known.protected, frozenset(dead))
            covered = {n: commits[n] & parities[n] for n in commits}
            protected = max(self.known.protected, newest_common(list(covered.values())))
            for first in range(0, self.nnodes, self.group):
                self._group_protected(first // self.group, newest_common([covered[n] for n in
                                                                           group_of(first, self.group)]))
        found = Progress(committed, protected, frozenset(s for s in dead if s > protected))
        if found != self.known or time.monotonic() - self._written > REPUBLISH:  # deleted meanwhile? (Pace)
            self.coord.store.set(self.coord.key("gen", gen, "progress"), found.encode())
            self._written = time.monotonic()
        return found

    def _group_protected(self, group: int, step: int) -> None:
        if step > self._groups.get(group, 0):
            self._groups[group] = step
            self.coord.store.set(self.coord.key("group", group, "protected"), str(step))
            self.events.emit("protected", f"group {group}: step {step} protected by parity", console=False,
                             node=group * self.group, group=group, step=step)


@dataclass(frozen=True)
class RestorePlan:
    """The step a generation restores, and where from: "ram" (every rank holds it), "parity" (``rebuild``:
    node -> the nodes it rebuilds from), "disk" (every node loads it), or "none" (step 0)."""

    step: int
    rebuild: dict[int, list[int]]
    source: str = "none"


def group_of(node: int, group: int) -> list[int]:
    """The nodes of ``node``'s EC group of size ``group``."""
    base = node - node % group
    return list(range(base, base + group))


def plan_restore(held: dict[int, Holdings], group: int, parity: int, bad: frozenset[int] = frozenset(),
                 bad_parity: frozenset[int] = frozenset()) -> RestorePlan:
    """The newest step every rank can restore: held in RAM, or rebuilt from parity of its group (not a step in
    ``bad_parity``: a rebuild of it failed), else from disk (a step complete on disk for every node, not in
    ``bad``: found corrupt).

    A node can rebuild step s when at least ``k = group - parity`` other nodes of its group are *complete* for
    s: every rank of theirs holds s and their keeper holds its parity (then every stripe has k fragments).
    """

    def complete(node: int, step: int) -> bool:
        return step in held[node].steps and step in held[node].parity

    available: list[set[int]] = []
    for node, holdings in held.items():
        steps = set(holdings.steps)
        if parity:
            others = [n for n in group_of(node, group) if n != node and n in held]
            for step in set().union(*(held[n].steps & held[n].parity for n in others)) - steps - bad_parity:
                if sum(complete(n, step) for n in others) >= group - parity:
                    steps.add(step)
        available.append(steps)
    step = newest_common(available)
    disk = newest_common([h.disk - bad for h in held.values()])
    if disk > step:
        return RestorePlan(disk, {}, "disk")
    rebuild = {node: [n for n in group_of(node, group) if n != node and complete(n, step)]
               for node, holdings in held.items() if step and step not in holdings.steps}
    return RestorePlan(step, rebuild, "parity" if rebuild else "ram" if step else "none")


def losses_covered(held: dict[int, Holdings], group: int, parity: int) -> bool:
    """Whether no EC group of size ``group`` has more nodes that hold no snapshot at all (lost, their RAM gone)
    than its ``parity`` covers."""
    emptied = {node for node, holdings in held.items() if not any(holdings.ranks.values())}
    return all(len(emptied.intersection(group_of(node, group))) <= parity for node in emptied)


def start_over_reason(every: dict[int, set[int]], parity: int, secured: int, since: int, *,
                      covered: bool = False) -> str:
    """Why a generation restores nothing though some rank holds a snapshot step (``every``: rank -> the steps it
    holds), in words: ``secured`` is the newest step every rank had committed before it (0: none) since generation
    ``since``; ``covered``: no group lost more nodes than its ``parity`` covers, so what was missing is the step's
    parity (a node lost before its parity was complete on the others, or the parity found corrupt). Ranks that hold
    no step lost their snapshots only if every rank had committed one: after a failure before the first snapshot
    every rank took, they never had one."""
    lost = sorted(rank for rank, steps in every.items() if not steps)
    best = newest_common([steps for steps in every.values() if steps])
    if not lost:
        return f"no snapshot step is held by every rank ({ {r: sorted(s) for r, s in every.items()} })"
    if not secured:
        when = "yet" if since == 0 else f"since generation {since} started from step 0"
        return f"no snapshot step was committed by every rank {when} (ranks {brief_numbers(lost)} hold none)"
    if best:
        cover = ("erasure coding is off" if not parity else
                 "its parity is not complete on enough other nodes of the group: a node lost before the parity was "
                 "complete, or the parity found corrupt" if covered else
                 f"more nodes of a group lost than its {parity} parity cover")
        return (f"ranks {brief_numbers(lost)} lost their snapshots; step {best}, held by every other rank, cannot be "
                f"rebuilt from parity ({cover})")
    return f"ranks {brief_numbers(lost)} lost their snapshots"


def rebuild_candidate(complete: dict[int, set[int]], k: int) -> tuple[int, list[int]]:
    """(step, the nodes complete for it): the newest step that at least ``k`` nodes are *complete* for (every rank
    holds it and the keeper its parity; ``complete``: node -> those steps, other nodes of one group), as
    :func:`plan_restore` needs to rebuild it; (0, []) if none."""
    steps = [s for s in set().union(*complete.values()) if sum(s in c for c in complete.values()) >= k]
    if not steps:
        return 0, []
    step = max(steps)
    return step, sorted(node for node, c in complete.items() if step in c)


class KeeperLink(threading.Thread):
    """Agrees the restore step of each generation and relays what every node holds; see the module doc."""

    def __init__(self, spec: NodeSpec, job: str, events: EventLog, address: str,
                 report: OutageReport | None = None) -> None:
        super().__init__(name="ftrun-keeper-link", daemon=True)
        store = reopen_store(spec_address(spec), spec.rdzv_timeout, report)  # the supervisor reached it before
        self.coord = Coordinator(store, spec.job_id, spec.node_rank, spec.nnodes)
        self.node = spec.node_rank
        self.nnodes = spec.nnodes
        self.group, self.parity = spec.ec_group, spec.ec_parity
        self.world = spec.nnodes * spec.nproc_per_node
        self.events = events
        self.address = address
        self.keeper = KeeperClient(socket_name(job, spec.node_rank), patience=1.0)
        # the supervisor's thread's (_nudge): a keeper that does not answer (frozen) must not hold up a stop
        self._nudger = KeeperClient(socket_name(job, spec.node_rank), timeout=NUDGE_TIMEOUT)
        self._seen = ""  # the version of the keeper's last poll answer
        self.fatal: str | None = None  # ends the job (no room for snapshots, an error of this thread)
        self._generation = -1
        self._plans: dict[int, int] = {}
        self.progress = ProgressTracker(self.coord, self.nnodes, self.group, self.parity, events)
        self._peers: dict[str, str] = {}
        self._published: dict[str, str] = {}  # commit and parity: the document last published
        self._published_at: dict[str, float] = {}  # and when (monotonic)
        self._passes = 0  # how many snapshot steps every local rank took or skipped (durability counts them)
        self.durability = Durability(spec, self.coord, events) if spec.ckpt_dir else None
        self._finish_by: float | None = None  # set by finish(): the deadline of the final persist
        self.rebuilding = False  # its keeper is rebuilding this node's snapshots from parity (status)
        self.keeper_status: dict[str, Any] = {}  # the keeper's view for the status document (ftrun.ui.status)
        self._bad_disk: set[int] = set()  # persisted steps found corrupt: never tried again
        self._bad_parity: set[int] = set()  # steps whose rebuild from parity failed: never tried again
        self._peer_lost_wait = 2 * spec.node_timeout + 5  # a survivor lost during a rebuild is seen lost by then
        self._final: str | None = "did not complete"  # why the final persist failed (None: it is on disk)
        self._final_grace = 0.0
        self._asked_final = self._marked_stopped = False
        self._finished = threading.Event()
        self._halt = threading.Event()
        self._interval = max(LINK_INTERVAL, self.coord.store.poll_interval)
        self._pending = True  # the last poll's answer left steps for the job to secure (see _quiet)
        self._verified = (0, 0.0)  # bytes and seconds of this node's last checksum verification (op_verify)

    def begin(self, generation: int) -> None:
        """A new generation starts: agree its restore step before anything else."""
        self._generation = generation
        self._nudge()

    def stop(self) -> None:
        self._halt.set()
        self._nudge()

    def _nudge(self) -> None:
        """Wake the link's poll waiting in the keeper (called from the supervisor's thread). A keeper that does not
        answer has broken that poll too."""
        self._nudger.try_request("nudge")

    def finish(self, grace: float) -> str | None:
        """The trainers have stopped (or ended): persist the newest globally committed step, within ``grace``
        seconds. None when it is on disk (or there is no checkpoint directory, or nothing to persist: stopped before
        its first generation agreed where to restore from, it ends at once); else why not
        ("did not complete within 60s", "failed: <reason>")."""
        if self.durability is None or not self._plans:
            return None  # no generation agreed its plan yet: no trainer of this run took a step
        self._final_grace = grace
        self._finish_by = time.monotonic() + grace
        self._nudge()
        self._finished.wait(grace + 1)
        return self._final

    def run(self) -> None:
        self._prepare_rebuild()
        while not self._halt.is_set():
            gen = self._generation
            try:
                if gen < 0:
                    pass
                elif gen not in self._plans:
                    self._agree(gen)
                else:
                    if self._relay(gen):
                        continue  # it waited in the keeper's poll
                    if self._finish_by is not None and not self._finished.is_set():
                        self._finishing(gen)
            except (KeeperUnavailable, KeeperError):
                pass  # the keeper is restarting; the supervisor sees its exit
            except DistError:
                break  # the control store is gone; the supervisor sees that too
            except Exception as err:  # a bug: end the job in one line, not leave every restart waiting in restore()
                sys.stderr.write(traceback.format_exc())
                self.fatal = (f"node {self.node}'s keeper link failed ({type(err).__name__}: {err}); without it the "
                              "nodes cannot agree a restore step (traceback above)")
                break
            self._halt.wait(self._interval)
        if self.durability is not None and self.durability.copies is not None:
            self.durability.copies.stop()

    def _prepare_rebuild(self) -> None:
        """Have the keeper allocate ahead the slots of a rebuild the group could make now (see the module doc)."""
        if not self.parity:
            return
        group = set(group_of(self.node, self.group)) - {self.node}
        try:
            current = self.coord.current().gen
            # this generation's documents, else the last ones published: several nodes lost at once bump the
            # generation once each, and the survivors publish nothing until every replacement has joined
            for gen in range(current, max(current - PREPARE_LOOKBACK, -1), -1):
                held = {n: Holdings.decode(raw) for n, raw in self.coord.marks(gen, "held").items() if n in group}
                # what each holds now (published while the generation ran), else what it held at its start
                commits, parities = (self.coord.marks(gen, what) for what in ("commit", "parity"))
                complete = {n: (set(Commits.decode(commits[n]).held) if n in commits else h.steps)
                            & (set(json.loads(parities[n])) if n in parities else h.parity)
                            for n, h in held.items()}
                step, holders = rebuild_candidate(complete, self.group - self.parity)
                if step:
                    self.keeper.request("prepare", step=step, holders=holders,
                                        peers={str(n): h.address for n, h in held.items()})
                    return
        except (KeeperUnavailable, KeeperError, DistError, ValueError, KeyError, TypeError):
            pass  # only a head start: the rebuild allocates what it needs itself

    def _agree(self, gen: int) -> None:
        held = self._gather(gen, "held")
        if held is None:
            return
        agreed = self._plan(gen, held)
        if agreed is None:
            return
        plan, held = agreed
        self.keeper.request("poll", generation=gen, plan=plan.step, restorable=plan.step, committed=plan.step,
                            peers=self._peers)
        self._plans[gen] = plan.step
        self.progress.start(plan.step)
        self._published = {}
        self._passes = 0
        self.coord.publish_restore(gen, plan.step, {"parity": "RAM + parity", "disk": "disk"}.get(plan.source, "RAM"))
        if self.durability is not None:
            self.durability.begin(gen)
        self._report(gen, plan, held)

    def _gather(self, gen: int, what: str) -> dict[int, Holdings] | None:
        """Publish this node's :class:`Holdings` as ``what`` and read every node's; None when the generation moved
        on (or the link halts) meanwhile."""
        reply = self.keeper.request("held", generation=gen)
        disk = self.durability.disk_steps() if self.durability is not None else set()
        mine = Holdings({int(r): set(s) for r, s in reply["held"].items()}, set(reply["parity"]), self.address, disk)
        self.coord.store.set(self.coord.key("gen", gen, what, self.node), mine.encode())
        while (marked := self.coord.marked(gen, what)) is None:
            if self._halt.is_set() or self._generation != gen:
                return None
            time.sleep(self._interval)
        held = {node: Holdings.decode(raw) for node, raw in marked.items()}
        if self.parity:
            self._peers = {str(n): held[n].address for n in group_of(self.node, self.group)}
        return held

    def _plan(self, gen: int, held: dict[int, Holdings]) -> tuple[RestorePlan, dict[int, Holdings]] | None:
        """The generation's plan, down the restore chain: RAM, else peers' parity, else disk, else step 0; with the
        holdings it was made from.

        The nodes that restore a step from their own RAM first verify the checksums of its slots (``verify``:
        only that step's, not every slot's; a slot that fails is dropped by its keeper): if any fails, every node
        publishes its holdings again (``held.<try>``) and plans anew, so a corrupt slot is never loaded and the
        job falls through to the next source without a restart. A parity step is then rebuilt by the nodes
        that lack it, a disk step first loaded by every node (and verified); if any of them fails, every node
        marks that source bad for that step (never tried again by this node) and plans again, within the same
        generation: a failed source never costs a restart. A rebuild that failed only because a survivor became
        unreachable (:data:`PEER_LOST`) marks nothing: the nodes wait for the generation that its loss starts
        (the survivors' RAM and parity are still good). If none comes within twice the node timeout, the survivor
        lives (its keeper was frozen a while, or its supervisor restarted it): they rebuild again, up to
        :data:`PEER_LOST_TRIES` times in all, before the step is marked bad. None when the generation moved on
        meanwhile."""
        tries: dict[int, int] = {}  # parity step -> rebuilds that failed only because a survivor did not answer
        verifies = 0  # verify rounds that found a corrupt slot
        while True:
            plan = plan_restore(held, self.group, self.parity, frozenset(self._bad_disk), frozenset(self._bad_parity))
            if plan.source in ("ram", "parity"):
                verified = self._outcomes(gen, f"verify/{plan.step}.{verifies}", set(held) - set(plan.rebuild),
                                          lambda: self._verify(gen, plan.step))
                if verified is None:
                    return None
                if any(outcome != "ok" for outcome in verified.values()):
                    verifies += 1
                    regathered = self._gather(gen, f"held.{verifies}")
                    if regathered is None:
                        return None
                    held = regathered
                    continue
            if plan.source == "disk":
                what, workers = f"load/{plan.step}", set(held)
            elif plan.source == "parity":
                self.keeper.request("peers", peers=self._peers)  # survivors relay: a keeper restarted knows none
                again = tries.get(plan.step, 0)
                what, workers = f"rebuild/{plan.step}" + (f".{again}" if again else ""), set(plan.rebuild)
            else:
                return plan, held
            outcomes = self._outcomes(gen, what, workers, lambda: self._fetch(gen, plan))
            if outcomes is None:
                return None
            problems = {node: o for node, o in outcomes.items() if o != "ok"}
            if not problems:
                return plan, held
            if plan.source == "parity" and all(o.startswith(PEER_LOST) for o in problems.values()):
                # a survivor was lost during the rebuild: its loss starts the next generation, which plans again
                # without it; this step's parity is not to blame
                deadline = time.monotonic() + self._peer_lost_wait
                while self._generation == gen and not self._halt.is_set() and time.monotonic() < deadline:
                    time.sleep(self._interval)
                if self._generation != gen or self._halt.is_set():
                    return None
                tries[plan.step] = tries.get(plan.step, 0) + 1
                if tries[plan.step] < PEER_LOST_TRIES:
                    self.events.emit("restore_source_retry", f"generation {gen}: a survivor did not answer during "
                                     f"the rebuild of step {plan.step} ({problems}) but was not lost: rebuilding "
                                     "again", console=self.node == 0, generation=gen, step=plan.step,
                                     problems=problems)
                    continue
            bad, source = (self._bad_disk, "persisted") if plan.source == "disk" else (self._bad_parity, "parity of")
            bad.add(plan.step)
            self.events.emit("restore_source_failed", f"generation {gen}: {source} step {plan.step} is not "
                             f"restorable ({problems}); never tried again, trying the next source",
                             console=self.node == 0, generation=gen, step=plan.step, source=plan.source,
                             problems=problems)

    def _outcomes(self, gen: int, what: str, workers: set[int], work: Callable[[], str]) -> dict[int, str] | None:
        """Run ``work`` here if this node is one of ``workers`` and publish its outcome as ``what``; every worker's
        outcome once all are published, None when the generation moved on (or the link halts) meanwhile."""
        if self.node in workers:
            self.coord.store.set(self.coord.key("gen", gen, what, self.node), work())
        while (outcomes := self.coord.marked(gen, what, workers)) is None:
            if self._halt.is_set() or self._generation != gen:
                return None
            time.sleep(self._interval)
        return outcomes

    def _verify(self, gen: int, step: int) -> str:
        """Verify the checksums of this node's slots of ``step``: "ok", or why not (the keeper dropped them)."""
        reply = self.keeper.request("verify", generation=gen, step=step)
        self._verified = (reply["bytes"], reply["seconds"])
        problems = reply["problems"]
        return "; ".join(f"rank {rank}: {why}" for rank, why in sorted(problems.items())) if problems else "ok"

    def _fetch(self, gen: int, plan: RestorePlan) -> str:
        """This node's part of ``plan`` before it can be told: load the disk step, or rebuild from parity;
        "ok" or why not."""
        self.rebuilding = plan.source == "parity"
        try:
            if plan.source == "disk":
                self.keeper.request("load", generation=gen, step=plan.step)
            else:
                self.keeper.request("rebuild", generation=gen, step=plan.step, complete=plan.rebuild[self.node],
                                    peers=self._peers)
        except KeeperError as err:
            return str(err) or "failed"
        finally:
            self.rebuilding = False
        return "ok"

    def _report(self, gen: int, plan: RestorePlan, held: dict[int, Holdings]) -> None:
        leader = self.node == 0
        every = {rank: steps for holdings in held.values() for rank, steps in holdings.ranks.items()}
        fields = {"generation": gen, "step": plan.step, "verified": self._verified[0],
                  "verify_seconds": self._verified[1]}
        self._verified = (0, 0.0)
        if plan.source == "disk":
            assert self.durability is not None
            self.events.emit("restore", f"generation {gen}: trainers restore step {plan.step} from disk "
                             f"({self.durability.step_path(plan.step)}; nothing newer in RAM)", console=leader,
                             restored_from="disk", **fields)
        elif plan.step and plan.rebuild:
            rebuilt = "; ".join(f"node {node} rebuilt from the parity of nodes {sources}"
                                for node, sources in sorted(plan.rebuild.items()))
            self.events.emit("restore", f"generation {gen}: trainers restore step {plan.step} from RAM ({rebuilt})",
                             console=leader, restored_from="parity", rebuilt=plan.rebuild, **fields)
        elif plan.step:
            self.events.emit("restore", f"generation {gen}: trainers restore step {plan.step} from RAM (held by all "
                             f"{self.world} ranks)", console=leader, restored_from="ram", **fields)
        elif any(every.values()):
            lost = sorted(rank for rank, steps in every.items() if not steps)
            best = newest_common([steps for steps in every.values() if steps])
            why = start_over_reason(every, self.parity, *self._secured_before(gen),
                                    covered=losses_covered(held, self.group, self.parity))
            self.events.emit("restore", f"WARNING generation {gen}: {why}; trainers start from step 0",
                             console=leader, restored_from="none", lost_ranks=lost, lost_step=best, **fields)
        elif gen > 0:
            self.events.emit("restore", f"generation {gen}: no RAM snapshot to restore", console=leader,
                             restored_from="none", **fields)

    def _secured_before(self, gen: int) -> tuple[int, int]:
        """(the newest step every rank had committed before ``gen``, the generation since which the control store
        knows it): the steps the generations before ``gen`` committed (their ``progress``), back to the newest
        one that agreed its restore step, and that step."""
        newest = 0
        for earlier in range(gen - 1, -1, -1):
            progress = self.coord.get("gen", earlier, "progress")
            if progress is not None:
                newest = max(newest, Progress.decode(progress).committed)
            restored = self.coord.restore_step(earlier)
            if restored is not None:
                return max(newest, restored[0]), earlier
        return newest, 0

    def _relay(self, gen: int) -> bool:
        """One poll of the keeper, and what its answer changes in the control store. While nothing is pending
        here (:meth:`_quiet`) the poll waits in the keeper for a change; True when it may have waited (the
        caller polls again at once)."""
        known = self.progress.known
        persist, restorable = (0, 0), known.protected
        if self.durability is not None:
            persist = self.durability.persist
            if self.durability.hold is not None:  # a persist round holds the keeper's slots (see durability)
                restorable = min(restorable, self.durability.hold)
        wait = self._quiet(gen)
        reply = self.keeper.request("poll", generation=gen, plan=self._plans[gen], restorable=restorable,
                                    committed=known.committed, peers=self._peers, persist_round=persist[0],
                                    persist=persist[1], abandoned=sorted(known.abandoned), wait=wait,
                                    seen=self._seen)
        self._seen = reply["version"]
        if self.durability is not None:
            self.durability.tick(reply["persisted"], known.protected)
        if reply.get("fatal") and self.fatal is None:
            self.fatal = reply["fatal"]
        self.keeper_status = {"ranks": reply["ranks"], "shm_bytes": reply["shm_bytes"], "committed": known.committed}
        commits = Commits(frozenset(int(s) for s in reply["local"]), frozenset(int(s) for s in reply["some"]),
                          int(reply["decided"]))
        now = time.monotonic()
        for what, doc in (("commit", commits.encode()), ("parity", json.dumps([int(s) for s in reply["parity"]]))):
            stale = self._pending and now - self._published_at.get(what, 0.0) > REPUBLISH  # deleted? (Pace)
            if self._published.get(what) != doc or stale:
                self.coord.store.set(self.coord.key("gen", gen, what, self.node), doc)
                self._published[what], self._published_at[what] = doc, now
        if int(reply["passes"]) > self._passes:
            if self.durability is not None:
                self.durability.snapshot_passed(int(reply["passes"]) - self._passes)
            self._passes = int(reply["passes"])
        self._pending = max(commits.held, default=0) > known.protected or commits.decided > known.protected
        if self._pending:
            self.progress.look(gen)
        return wait > 0

    def _quiet(self, gen: int) -> float:
        """How long the next poll may wait in the keeper: 0 while this link has something to follow in the control
        store (steps this node holds or passed that the job has not secured yet: the other nodes' commits and
        parity; a persist round; the final persist; a new generation), else until the durable tier's next look
        (:meth:`Durability.quiet <ftrun.snapshot.durability.Durability.quiet>`), at most the keeper's limit."""
        if self._pending or self._finish_by is not None or self._generation != gen or self._halt.is_set():
            return 0.0
        return self.durability.quiet() if self.durability is not None else POLL_WAIT

    def _finishing(self, gen: int) -> None:
        """The final persist (see :meth:`finish`): node 0 asks for the newest committed step once every node has
        stopped its trainers (or half the grace has passed); everyone waits for the outcome."""
        assert self.durability is not None and self._finish_by is not None
        if not self._marked_stopped:
            self._marked_stopped = True
            self.coord.mark(gen, "stopped")
        now = time.monotonic()
        if self.node == 0 and not self._asked_final:
            everyone = self.coord.marked(gen, "stopped") is not None
            if everyone or now > self._finish_by - self._final_grace / 2:
                self.progress.look(gen)
                self._asked_final = True
                self.durability.ask_final(self.progress.known.committed)
        outcome = self.durability.final_outcome()
        if outcome is not None or now > self._finish_by:
            self._final = (f"did not complete within {self._final_grace:g}s" if outcome is None
                           else f"failed: {outcome}" if outcome else None)
            self._finished.set()
