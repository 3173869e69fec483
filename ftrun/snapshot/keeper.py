"""The snapshot keeper: one process per node that owns the node's snapshot slots in shared memory.

It outlives trainers (they restart, the keeper and its memory stay) and is restarted by its supervisor if it
dies (as it does when one of its background threads fails: :meth:`Keeper._background`); a new keeper re-adopts
the slot files after validating their headers and checksums. It never imports torch: it handles bytes
(:mod:`ftrun.snapshot.slot`) and talks JSON lines (:mod:`ftrun.snapshot.protocol`).

Invariant (per job): at every instant there is a step that every rank can restore, and restore picks the
newest such step. Each local rank has two slots. A trainer asks the keeper which slot to copy step s into
(``reserve``); the keeper gives an empty slot, or else the older one, but only once the rank's newest
committed step is the newest step every rank of the job holds (``restorable``, told by the supervisor, which
gathers every node's holdings from the control store). So a slot holding the newest globally
restorable step is never overwritten, and a crash at any point (mid-copy: the slot stays WRITING; between
one rank's commit and another's: the older step is still held by all) leaves a consistent step.
A trainer does not wait for that: if its newest step is not restorable yet, it skips the snapshot of s (training
goes on; snapshots come as fast as the job secures them), as long as its newest snapshot is at most
:data:`STALE_INTERVALS` of its snapshot intervals behind s (the least step difference between its reserves).
Beyond, it waits for the job to secure that one, so the restore point never falls further behind: ranks that
drift apart (no collectives, a slow start) are paced to the slowest again, and parity slower than several
intervals paces training as it must.
``Snapshotter(skip=False)`` always waits (a snapshot at exactly every N steps). Ranks may disagree on a skip, so
a step that some rank has passed (committed or skipped a newer one, ``decided``) without holding it is
*abandoned*: it can never become restorable. The supervisors publish each node's holdings with its ranks' oldest
``decided`` step and tell every keeper the job's abandoned steps (:mod:`ftrun.snapshot.link`); a rank holding
one as its newest writes its next snapshot over it.
A rank's first commit (or restored slot) has its other slot allocated, below the trainers' priority, before the
trainer asks for it (``allocate_other``): only a rank's first snapshot waits for /dev/shm pages.

Per generation: the supervisor asks which steps every local rank holds (``held``: committed slots, by their
headers), agrees the restore step with the other nodes, has the checksums of that step's slots verified
(``verify``: bad ones are discarded and logged, and the nodes agree again from what is left), and tells it
(``plan``); restoring trainers wait for the plan. Slots of newer steps written by an older
generation are then discarded: that future did not happen for every rank.

With erasure coding (``--ec-parity`` > 0) the keeper also holds parity for its EC group
(:mod:`ftrun.snapshot.redundancy`): an encoder thread brings it up to date with the newest globally committed
step (``committed``, told by the supervisor), and ``restorable`` is then the job's *protected* step (held by
every rank, with complete parity on every node), so a slot is only overwritten once the newer one is
protected. A replacement node's keeper rebuilds its ranks' slots of the agreed step from its group's parity
(``rebuild``) before the plan is told; told the likely step as soon as its node starts (``prepare``), it
allocates their memory meanwhile. The sealer (checksums of new snapshots) and the encoder run below the
trainers' priority (:mod:`ftrun.snapshot.priority`); a rebuild, which trainers wait for, does not.

With a checkpoint directory (``--ckpt-dir``) a persister thread writes the step the job asks for (``persist``
of a round, told by the link: :mod:`ftrun.snapshot.durability`) from the slots to disk
(:mod:`ftrun.snapshot.persist`), at the lowest CPU and I/O priority. The slots of that step are pinned in the
request that names it, before the same request may raise ``restorable``, and stay pinned until they are written;
a trainer that would overwrite one gets another slot (a spare third one, allocated the first time it is needed). At
a generation start the keeper can also ``load`` a persisted step into its slots (verified) when disk holds the
newest step every rank can restore.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import hashlib
import json
import os
import queue
import re
import select
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from ftrun.errors import error_text
from ftrun.events import EventLog
from ftrun.control.faults import Fault, parse_faults
from ftrun.control.spec import NodeSpec, open_shm_file, safe_job_id, shm_dir, write_shm_file
from ftrun.snapshot.heap import reuse_large_blocks
from ftrun.snapshot.priority import lower_priority, lower_to_background
from ftrun.snapshot.protocol import (PEER_LOST, POLL_WAIT, LineSocket, listen, receive_handoff, same_user,
                                     socket_name)
from ftrun.snapshot.redundancy import GroupPlace, Redundancy, RedundancyError, parity_name
from ftrun.snapshot.persist import CorruptStep, image_size, load_rank, partial_dir, write_rank
from ftrun.snapshot.slot import (ALLOCATE_STEP, COMMITTED, EMPTY, HEADER_SIZE, RESTORED, SLOTS_PER_RANK, SPARE_SLOT,
                                 WRITING, Header, SlotFile, checksum, checksum_threads, slot_capacity,
                                 slot_name)
from ftrun.snapshot.transport import PeerError, PeerUnavailable

ENV_KEEPER_FAULTS = "FTRUN_KEEPER_FAULTS"
ENV_JOB_SECRET = "FTRUN_JOB_SECRET"  # hex; keepers authenticate each other with it (never given to trainers)
ENV_PEER_FD = "FTRUN_KEEPER_PEER_FD"  # the listening TCP socket for peers, inherited from the supervisor
ENV_EARLIER_RUN = "FTRUN_KEEPER_EARLIER_RUN"  # "1": segments found at start are from an earlier run (SLURM step)
# a keeper started ahead of its node: the descriptor of the socket its environment (and peer socket) comes on
ENV_KEEPER_HANDOFF = "FTRUN_KEEPER_HANDOFF"
# How the supervisor stops its keeper. SIGTERM, SIGINT, SIGUSR1 and SIGUSR2 are ignored: SLURM sends SIGTERM (and, with
# --signal, SIGUSR1/2 as a pre-emption warning) to every process of a step at once, and the keeper must outlive it
# to persist the final step.
STOP_SIGNAL = signal.SIGRTMIN + 3
NODE_LOST_SIGNAL = signal.SIGRTMIN + 4  # keeper -> supervisor: kill every process of the node (an injected fault)
ENCODE_RETRY = 0.2
# A trainer skips a snapshot rather than wait for a slot only while its newest snapshot is at most this many of its
# snapshot intervals behind the step it saves; beyond, it waits for the job to secure that one (see the module doc).
STALE_INTERVALS = 4
POLL_RECHECK = 0.25  # seconds between two looks of a waiting poll for a change that notified nobody (bytes allocated)
SOCKET_WAIT = 10.0  # seconds a starting keeper waits for another keeper of its node to leave (listen_alone)
MIN_PEER_TIMEOUT = 5.0  # seconds: the least a keeper waits on a peer (see peer_timeout)
THREAD_FAILED = 70  # the exit status of a keeper one of whose background threads failed (EX_SOFTWARE)
# accept(2)'s errors for want of resources: passing, unlike those of a listening socket that was shut down
OUT_OF_RESOURCES = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
# Seconds the persister waits for the checksum of a slot it writes (the sealer, at background priority, may be
# behind): past it the round fails (one warning; the next round tries again), where it waited forever.
SEAL_WAIT = 600.0
# Advice printed with the /dev/shm capacity error.
SHM_ADVICE = "enlarge it (docker run --shm-size=..., or a bigger tmpfs) or snapshot less often/less state"


class Stale(Exception):
    """A request of a generation that is over."""


def human(nbytes: float) -> str:
    if nbytes < 1024:
        return f"{int(nbytes)} B"
    for unit in ("KiB", "MiB", "GiB"):
        nbytes /= 1024
        if nbytes < 1024:
            break
    return f"{nbytes:.1f} {unit}"


def free_bytes(directory: str) -> int:
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


def capacity_problem(node: int, local_rank: int, nproc: int, slot_bytes: int, missing: int, free: int,
                     directory: str) -> str | None:
    """The one-line error when ``missing`` more bytes do not fit in ``free``; None when they do."""
    if missing <= free:
        return None
    return (f"{directory} too small for snapshots: node {node} needs {human(missing)} more for local rank "
            f"{local_rank} (2 slots of {human(slot_bytes)}; about {human(2 * slot_bytes * nproc)} for its "
            f"{nproc} local rank(s)) but only {human(free)} is free; {SHM_ADVICE}")


def parity_room_problem(node: int, file_bytes: int, free: int, directory: str) -> str:
    """The one-line error when a parity file does not fit beside the slots."""
    return (f"{directory} too small for parity: node {node} needs {human(file_bytes)} for a parity file (2 of them "
            f"beside its snapshot slots) but only {human(free)} is free; {SHM_ADVICE}, or run without parity "
            "(--ec-parity 0: a lost node then resumes from disk)")


@dataclass
class RankSlots:
    """What the keeper knows of one local rank's two slots."""

    files: list[SlotFile | None] = field(default_factory=lambda: [None] * (SPARE_SLOT + 1))
    steps: list[int | None] = field(default_factory=lambda: [None] * (SPARE_SLOT + 1))  # committed step held
    generations: list[int] = field(default_factory=lambda: [0] * (SPARE_SLOT + 1))
    last: dict[str, Any] = field(default_factory=dict)  # the last commit: step, time, bytes, copy_gbs (status)
    sizing: threading.Lock = field(default_factory=threading.Lock)  # held while one of its files is made or grown
    asking: int = 0  # callers of ensure_slot waiting for or holding ``sizing`` (the allocation ahead yields to them)
    decided: int = 0  # the newest step it committed or skipped in this generation (from the plan's step on)
    interval: int = 0  # its snapshot interval: the least step difference between two reserves (0: not known)
    passes: int = 0  # how many snapshot steps it decided (committed or skipped) in this generation

    def held(self) -> set[int]:
        return {s for s in self.steps if s is not None}

    def newest(self) -> int:
        return max(self.held(), default=0)

    def index_of(self, step: int) -> int | None:
        return next((i for i, held in enumerate(self.steps) if held == step), None)

    def decide(self, step: int) -> None:
        """It committed or skipped its snapshot of ``step``."""
        if step > self.decided:
            self.decided = step
            self.passes += 1

    def passed(self, step: int) -> bool:
        """Whether it went past ``step`` without holding it: then it never will (as :meth:`Commits.passed
        <ftrun.snapshot.link.Commits.passed>` for a node)."""
        return step <= self.decided and step not in self.held()

    def vacant(self, pinned: set[int]) -> int:
        """A slot to restore a step into (from disk or parity) that evicts nothing needed: an empty slot, else
        the spare (allocated if need be), else the oldest one; never a pinned one (at most one is)."""
        usable = [i for i in range(SPARE_SLOT + 1) if i not in pinned]
        empty = [i for i in usable if self.steps[i] is None]
        return empty[0] if empty else min(usable, key=lambda i: self.steps[i])  # type: ignore[arg-type, return-value]

    def pick(self, restorable: int, pinned: set[int], abandoned: set[int]) -> int | None:
        """The slot to write the next snapshot into, or None to skip it: an empty slot; else the slot of the
        newest step held if that step is abandoned (some rank skipped it: it never becomes restorable); else,
        once the newest step held is restorable, the oldest unpinned slot that does not hold it; else the spare
        slot, allocated the first time a pinned slot (being persisted) is in the way."""
        usable = [i for i in range(SPARE_SLOT + 1) if i not in pinned]
        empty = [i for i in usable if self.steps[i] is None and (i < SLOTS_PER_RANK or self.files[i] is not None)]
        if empty:
            return empty[0]
        newest = self.newest()
        if newest in abandoned and (index := self.index_of(newest)) in usable:
            return index
        if newest > restorable:
            return None
        older = [i for i in usable if self.steps[i] is not None and self.steps[i] != newest]
        if older:
            return min(older, key=lambda i: self.steps[i])  # type: ignore[arg-type, return-value]
        return SPARE_SLOT if SPARE_SLOT in usable and self.files[SPARE_SLOT] is None else None


class Keeper:
    def __init__(self, spec: NodeSpec, faults: list[str]) -> None:
        self.spec = spec
        self.node = spec.node_rank
        self.job = safe_job_id(spec.job_id)
        self.dir = shm_dir()
        self.events = EventLog(f"keeper {self.node}", spec.log_dir)
        mine = [f for f in parse_faults(faults) if f.where == self.node]
        self.crash_faults = [f for f in mine if f.kind == "keeper-crash"]
        self.parity_faults = [f for f in mine if f.kind == "parity-loss"]
        self.serve_faults = [f for f in mine if f.kind == "serve-loss"]
        self.stall_faults = [f for f in mine if f.kind == "serve-stall"]
        self.ranks = [RankSlots() for _ in range(spec.nproc_per_node)]
        self.cond = threading.Condition()
        self.generation = -1
        self.plans: dict[int, int] = {}
        self.restorable = 0
        self.committed = 0
        self.abandoned: set[int] = set()  # steps > restorable that some rank of the job passed without holding
        self._told_skip = -1  # the generation whose first skipped snapshot was logged
        self.fatal: str | None = None
        self.seals: queue.Queue[tuple[int, int, int]] = queue.Queue()
        self.allocations: queue.Queue[tuple[int, int, int]] = queue.Queue()  # (rank, slot now holding a step, payload)
        self.redundancy: Redundancy | None = None
        self.coding = threading.Lock()  # one encoding or rebuild at a time
        self.persist_request: tuple[int, int] = (0, 0)  # (round, step) the job asks to persist (the link tells it)
        self.persisted: dict[str, Any] = {}  # the outcome of the last one: round, step, entries or error, seconds
        self.pinned: dict[int, set[int]] = {}  # local rank -> slots being persisted (not to be overwritten)
        self._pinned_round = 0  # the persist round the pins are for
        self._stopping = False
        self._nudges = 0  # op_nudge calls: each changes the answer of a waiting poll

    def enable_redundancy(self, secret: bytes, listener: socket.socket) -> None:
        spec = self.spec
        place = GroupPlace(self.node, spec.ec_group, spec.ec_parity, spec.ec_backend)
        self.redundancy = Redundancy(self, place, secret, listener, peer_timeout(spec.node_timeout))
        self.redundancy.serving_rebuild = self._fire_serve_fault

    # -- slot files -----------------------------------------------------------------------------------------
    def path(self, local: int, index: int) -> str:
        return os.path.join(self.dir, slot_name(self.job, self.node, local, index))

    def adopt(self, earlier_run: bool) -> None:
        """Take over the slot files a previous keeper of this node left: keep the valid committed ones.
        ``earlier_run``: they come from an earlier run of the job (a previous SLURM step, a rerun after the
        launcher was killed), whose generation numbers mean nothing now, so they count as older than any
        generation (like restored slots); of a run of another shape, they are removed (:meth:`_drop_other_shape`)."""
        if earlier_run:
            self._drop_other_shape()
        kept, dropped = [], []
        for path, local, index in find_segments(self.job, self.node):
            if local >= len(self.ranks) or index > SPARE_SLOT:
                os.unlink(path)
                continue
            try:
                slot = SlotFile(path)
            except (OSError, ValueError) as err:
                dropped.append(f"{os.path.basename(path)}: {err}")
                continue
            self.ranks[local].files[index] = slot
            header = slot.header()
            if header.state == EMPTY or header.state == WRITING:
                continue
            problem = slot.verify()
            if problem is None:
                self.ranks[local].steps[index] = header.step
                self.ranks[local].generations[index] = RESTORED if earlier_run else header.generation
                kept.append(f"rank {local} slot {index} step {header.step}")
            else:
                slot.set_state(EMPTY)
                dropped.append(f"rank {local} slot {index}: {problem}")
        if self.redundancy is not None:
            kept += self.redundancy.adopt()
        if kept or dropped:
            self.events.emit("keeper_adopted", f"re-adopted {len(kept)} committed slot(s)"
                             f"{': ' + ', '.join(kept) if kept else ''}"
                             f"{'; dropped ' + '; '.join(dropped) if dropped else ''}",
                             node=self.node, kept=kept, dropped=dropped)

    def _drop_other_shape(self) -> None:
        """Remove this node's slot and parity files if an earlier run of the job of another shape (nodes, trainers
        per node, EC groups) left them, then record this run's shape beside them. A snapshot is one global rank's
        state in a world of that shape: a rerun with ``--nnodes 2`` after a killed ``--nnodes 3`` run would
        otherwise restore a world-size-3 state into world size 2, and one with fewer trainers per node other
        ranks' states (the durable tier refuses the same). Files without a recorded shape are adopted as before."""
        path = os.path.join(self.dir, shape_name(self.job, self.node))
        spec = self.spec
        shape = (f"{spec.nnodes} node(s) x {spec.nproc_per_node} trainer(s), EC groups of {spec.ec_group} with "
                 f"{spec.ec_parity} parity")
        try:
            with os.fdopen(open_shm_file(path, os.O_RDONLY), errors="replace") as f:  # garbage: another shape
                earlier = f.read()
        except OSError:  # none (files of an older ftrun), or not a file of this user's ftrun
            earlier = shape
        if earlier != shape:
            removed = unlink_segments(self.job, self.node)
            self.events.emit("keeper_adopted", f"removed {len(removed)} snapshot file(s) of an earlier run of "
                             f"{earlier}, not of this run's shape ({shape}): not restoring them", node=self.node,
                             kept=[], dropped=[os.path.basename(p) for p in removed])
        write_shm_file(path, shape)

    def ensure_slot(self, local: int, index: int, payload: int, allocate: bool = True) -> SlotFile:
        """The slot file with room for ``payload`` bytes: as it is if it has the room, else made anew with
        :func:`slot_capacity` (the trainers' headroom, so a snapshot whose metadata grows by a few bytes keeps its
        file); allocated (all pages) here, after a capacity check. ``allocate=False``: a new file gets its header
        page only, for a caller that allocates as it writes (a rebuild); a file left so is completed the next time
        it is asked for with ``allocate``."""
        rank = self.ranks[local]
        with self.cond:
            rank.asking += 1
        try:
            with rank.sizing:  # the trainer's reserve and the allocation ahead may race for a file
                return self._ensure_slot(local, index, payload, allocate)
        finally:
            with self.cond:
                rank.asking -= 1

    def _ensure_slot(self, local: int, index: int, payload: int, allocate: bool) -> SlotFile:
        rank = self.ranks[local]
        slot = rank.files[index]
        if slot is not None and slot.capacity >= payload:
            if allocate and not slot.allocated:
                try:
                    slot.allocate(0, slot.size)
                except OSError as err:
                    raise MemoryError(capacity_problem(self.node, local, len(self.ranks), slot.size, slot.size, 0,
                                                       self.dir) + f" ({err.strerror})") from err
            return slot
        size = HEADER_SIZE + slot_capacity(payload)
        missing = size - (slot.size if slot else 0)
        other = rank.files[1 - index] if index < SLOTS_PER_RANK else None
        missing_both = missing + max(0, size - (other.size if other else 0))
        problem = capacity_problem(self.node, local, len(self.ranks), size, missing_both, free_bytes(self.dir),
                                   self.dir)
        if problem is not None:
            raise MemoryError(problem)
        if slot is not None:
            slot.close()
        try:
            slot = SlotFile(self.path(local, index), size, allocate=allocate)
        except PermissionError as err:  # something not ftrun's at its name (see open_shm_file)
            raise MemoryError(f"cannot make the slot file {err.filename}: {err.strerror}") from err
        except OSError as err:
            raise MemoryError(capacity_problem(self.node, local, len(self.ranks), size, missing_both, 0,
                                               self.dir) + f" ({err.strerror})") from err
        rank.files[index] = slot
        self.events.emit("slot_allocated", f"rank {local} slot {index}: {human(size)}", console=False,
                         node=self.node, local_rank=local, slot=index, bytes=size)
        return slot

    def claim_vacant(self, local: int, image: int, allocate: bool = True) -> tuple[int, SlotFile]:
        """A slot of ``local`` to restore a step of ``image`` bytes (header included) into, from disk or parity:
        :meth:`RankSlots.vacant`, emptied, with a trainer's headroom, marked WRITING until it is verified;
        ``allocate``: as for :meth:`ensure_slot`."""
        with self.cond:
            rank = self.ranks[local]
            index = rank.vacant(self._pinned(local))
            rank.steps[index] = None
        slot = self.ensure_slot(local, index, image - HEADER_SIZE, allocate)
        slot.set_state(WRITING)
        return index, slot

    def hold_restored(self, local: int, index: int, step: int) -> None:
        """Slot ``index`` of ``local`` now holds the verified, restored ``step`` (its other slot is allocated ahead)."""
        with self.cond:
            self.ranks[local].steps[index] = step
            self.ranks[local].generations[index] = RESTORED
            self.cond.notify_all()
        file = self.ranks[local].files[index]
        if file is not None:
            self.allocations.put((local, index, file.header().payload_len))

    def unlink_all(self) -> None:
        for rank in self.ranks:
            for slot in rank.files:
                if slot is not None:
                    slot.close()
        unlink_segments(self.job, self.node)

    # -- requests -------------------------------------------------------------------------------------------
    def handle(self, request: dict[str, Any]) -> dict[str, Any]:
        op = request.get("op")
        handler = getattr(self, f"op_{op}", None)
        if handler is None:
            return {"error": f"unknown op {op!r}"}
        for name, count in (("rank", len(self.ranks)), ("slot", SPARE_SLOT + 1)):  # never indexed from the end
            if name in request and not (type(request[name]) is int and 0 <= request[name] < count):
                return {"error": f"bad request {op}: no {name} {request[name]!r} on this node"}
        try:
            return handler(**{k: v for k, v in request.items() if k != "op"})
        except Stale as err:
            return {"error": f"stale: {err}"}
        except MemoryError as err:
            with self.cond:
                self.fatal = self.fatal or str(err)
                self.cond.notify_all()
            return {"error": str(err)}
        except (TypeError, KeyError, ValueError) as err:
            return {"error": f"bad request {op}: {err}"}

    def op_held(self, generation: int) -> dict[str, Any]:
        """The steps every local rank holds in a committed slot, by its header (the checksums of the step the job
        agrees to restore are verified next, by :meth:`op_verify`: not every slot's), and the parity steps held."""
        held: dict[str, list[int]] = {}
        with self.cond:
            self.generation = max(self.generation, generation)
            for local, rank in enumerate(self.ranks):
                for index, step in enumerate(rank.steps):
                    slot = rank.files[index]
                    if step is not None and slot is not None and (problem := slot.problem()) is not None:
                        self._drop_invalid(local, index, problem, "using an older snapshot")
                held[str(self.global_rank(local))] = sorted(rank.held())
        return {"held": held, **self._redundancy_state()}

    def op_verify(self, generation: int, step: int) -> dict[str, Any]:
        """Verify the checksum of every local rank's slot of ``step``, the step the job is about to restore from
        RAM (sealing one the sealer had not reached yet), as many slots at once as the cores take (each checksum
        runs on :func:`checksum_threads`) and outside the lock: trainers wait
        for the plan, so nothing writes a slot of ``step`` meanwhile; one that changed anyway (a stale trainer's
        ``corrupt``) counts as not verified. A slot that fails is dropped (never loaded); ``problems``: global
        rank -> why, empty when every local rank holds ``step`` verified."""
        t0 = time.perf_counter()
        problems: dict[str, str] = {}
        todo: list[tuple[int, int, SlotFile, Header]] = []
        with self.cond:
            self._check_current(generation)
            for local, rank in enumerate(self.ranks):
                index = rank.index_of(step)
                slot = rank.files[index] if index is not None else None
                if index is None or slot is None:
                    problems[str(self.global_rank(local))] = f"step {step} not held"
                else:
                    todo.append((local, index, slot, slot.header()))
        at_once = max(1, min(len(todo), len(os.sched_getaffinity(0)) // checksum_threads()))  # a thread per core
        with ThreadPoolExecutor(at_once) as pool:
            crcs = list(pool.map(lambda t: checksum(t[2].map, t[3]), todo))
        with self.cond:
            for (local, index, slot, header), crc in zip(todo, crcs):
                problem = "changed while it was verified" if self.ranks[local].steps[index] != step else \
                    slot.judge(header, crc)
                if problem is not None:
                    problems[str(self.global_rank(local))] = problem
                    if self.ranks[local].steps[index] == step:
                        self._drop_invalid(local, index, problem, "using an older snapshot")
            self.cond.notify_all()  # the encoder waits for seals
        verified = sum(header.payload_len for _, _, _, header in todo)
        return {"problems": problems, "bytes": verified, "seconds": time.perf_counter() - t0}

    def _drop_invalid(self, local: int, index: int, problem: str, then: str) -> None:
        """Slot ``index`` of ``local`` cannot be loaded (``problem``): emptied, and logged with what ``then``
        happens; caller holds the lock."""
        step = self.ranks[local].steps[index]
        self.ranks[local].steps[index] = None
        file = self.ranks[local].files[index]
        if file is not None:
            file.set_state(EMPTY)
        self.events.emit("slot_invalid", f"rank {self.global_rank(local)} slot {index} (step {step}) not loadable: "
                         f"{problem}; {then}", node=self.node, local_rank=local, slot=index, step=step,
                         problem=problem)

    def _redundancy_state(self) -> dict[str, Any]:
        if self.redundancy is None:
            return {"parity": []}
        return {"parity": self.redundancy.held()}

    def _apply_plan(self, generation: int, step: int) -> None:
        """Record the agreed restore step of ``generation`` (once); caller holds the lock."""
        self.generation = max(self.generation, generation)
        if generation in self.plans:
            return
        if self.redundancy is not None:
            self.redundancy.drop_prepared()  # a rebuild took its slots, or none came
            self.redundancy.drop_newer(step)
        for rank in self.ranks:
            for index, held in enumerate(rank.steps):
                if held is not None and held > step and rank.generations[index] < generation:
                    rank.steps[index] = None
                    slot = rank.files[index]
                    if slot is not None:
                        slot.set_state(EMPTY)
        self.plans[generation] = step
        self.restorable = self.committed = step
        self.abandoned = set()  # the steps after the plan are taken anew
        for rank in self.ranks:
            rank.decided = step
            rank.interval = 0
            rank.passes = 0
        self.cond.notify_all()

    def op_poll(self, generation: int, plan: int, restorable: int, committed: int = 0,
                peers: dict[str, str] | None = None, persist_round: int = 0, persist: int = 0,
                abandoned: list[int] | None = None, wait: float = 0.0, seen: str = "") -> dict[str, Any]:
        """Take what the link tells, then answer; with ``wait`` > 0, only once the answer's ``version`` differs
        from ``seen`` (the link's last one), or after ``wait`` seconds (at most :data:`POLL_WAIT`): the link
        sleeps in here while nothing changes, and a change (a commit, a skip, parity, a persist, a
        :meth:`op_nudge`) answers at once."""
        with self.cond:
            self._apply_plan(generation, plan)
            if persist_round > self.persist_request[0]:  # pinned before restorable moves: see durability
                self.persist_request = (persist_round, persist)
                indexes = [rank.index_of(persist) for rank in self.ranks]
                self._pinned_round = persist_round
                self.pinned = ({} if None in indexes else
                               {local: {index} for local, index in enumerate(indexes)})  # type: ignore[misc]
            if peers:
                self._set_peers(peers)
            if generation == self.generation:
                if restorable > self.restorable:
                    self.restorable = restorable
                if committed > self.committed:
                    self.committed = committed
                self.abandoned = {s for s in abandoned or () if s > self.restorable}
                self.cond.notify_all()
            deadline = time.monotonic() + min(max(wait, 0.0), POLL_WAIT)
            while (reply := self._poll_reply())["version"] == seen and not self._stopping:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self.cond.wait(min(left, POLL_RECHECK))
            return reply

    def op_ping(self) -> dict[str, Any]:
        """Answer at once, taking no lock: the supervisor's watch that this keeper still serves
        (:mod:`ftrun.launch.keeper_watch`)."""
        return {}

    def op_nudge(self) -> dict[str, Any]:
        """Answer the link's waiting ``poll`` now (its supervisor has news for it: a generation, a stop)."""
        with self.cond:
            self._nudges += 1
            self.cond.notify_all()
        return {}

    def _poll_reply(self) -> dict[str, Any]:
        """The answer to ``poll`` with its ``version`` (a digest of the rest); caller holds the lock."""
        local = set.intersection(*(rank.held() for rank in self.ranks)) if self.ranks else set()
        reply = {"local": sorted(local), "some": sorted(set().union(*(rank.held() for rank in self.ranks))),
                 "decided": min((rank.decided for rank in self.ranks), default=0),
                 "passes": min((rank.passes for rank in self.ranks), default=0),
                 "fatal": self.fatal, "persisted": self.persisted,
                 "ranks": [rank.last for rank in self.ranks], "shm_bytes": self._shm_bytes(),
                 "nudges": self._nudges, **self._redundancy_state()}
        reply["version"] = hashlib.blake2b(json.dumps(reply, sort_keys=True).encode(), digest_size=8).hexdigest()
        return reply

    def _shm_bytes(self) -> int:
        files = [f for rank in self.ranks for f in rank.files if f is not None]
        if self.redundancy is not None:
            files += [f for f in self.redundancy.files if f is not None]
        return sum(f.size for f in files)

    def _set_peers(self, peers: dict[str, str]) -> None:
        """The group's keepers' addresses (JSON keys are strings: node ranks)."""
        if self.redundancy is not None:
            self.redundancy.peers = {int(node): address for node, address in peers.items()}

    def op_peers(self, peers: dict[str, str]) -> dict[str, Any]:
        """The group's keepers' addresses, before the generation's plan is agreed: a survivor relays a rebuild to
        them, and a keeper restarted meanwhile knows none yet."""
        with self.cond:
            self._set_peers(peers)
        return {}

    def op_rebuild(self, generation: int, step: int, complete: list[int], peers: dict[str, str]) -> dict[str, Any]:
        """Rebuild every local rank's slot of ``step`` from the group's nodes in ``complete``; then it is held."""
        if self.redundancy is None:
            return {"error": "erasure coding is off on this node"}
        with self.coding:
            with self.cond:
                self._check_current(generation)
                self._set_peers(peers)
            try:
                nbytes, seconds = self.redundancy.rebuild(step, [int(n) for n in complete])
            except PeerUnavailable as err:  # a survivor lost meanwhile: not the parity's fault (see the link)
                self.events.emit("rebuild_failed", f"could not rebuild step {step} of node {self.node}: {err}",
                                 node=self.node, step=step, peer_lost=True)
                return {"error": f"{PEER_LOST} during the rebuild of step {step}: {err}"}
            except (PeerError, RedundancyError, LookupError, KeyError, ValueError, OSError) as err:
                self.events.emit("rebuild_failed", f"could not rebuild step {step} of node {self.node}: {err}",
                                 node=self.node, step=step)
                return {"error": f"rebuild of step {step} failed: {err}"}
        sources = sorted(int(n) for n in complete)
        relayed = self.redundancy.relayed
        how = " (relayed, the lost nodes' chunks decoded at once)" if self.redundancy.decoded else \
            " (relayed)" if relayed else ""
        self.events.emit("rebuilt", f"rebuilt the {len(self.ranks)} slot(s) of step {step} from the parity of "
                         f"nodes {sources}{how} in {seconds * 1000:.0f} ms "
                         f"({human(nbytes)}, {nbytes / max(seconds, 1e-9) / 1e9:.2f} GB/s), checksums verified",
                         node=self.node, step=step, sources=sources, bytes=nbytes, seconds=seconds, relayed=relayed,
                         decoded=self.redundancy.decoded, phases=self.redundancy.phases,
                         allocated_ahead=self.redundancy.allocated_ahead)
        return {"bytes": nbytes, "seconds": seconds}

    def op_prepare(self, step: int, holders: list[int], peers: dict[str, str]) -> dict[str, Any]:
        """Allocate, ahead of a likely rebuild of ``step``, the slots it would fill, sized from the parity metadata
        of the first of ``holders`` that answers (nodes holding parity of it; another may be lost too); a hint:
        :meth:`op_rebuild` takes them if the sizes agree, a plan or a load without a rebuild gives them up.
        Only a keeper that holds no snapshot at all (a replacement's) does it: claiming slots evicts nothing then."""
        if self.redundancy is None:
            return {"bytes": 0}
        problems = []
        with self.coding:
            with self.cond:
                if any(rank.held() for rank in self.ranks):
                    return {"bytes": 0}
                self._set_peers(peers)
            for holder in holders:
                try:
                    nbytes = self.redundancy.prepare(step, int(holder))
                    break
                except (PeerError, RedundancyError, LookupError, KeyError, TypeError, ValueError, OSError,
                        MemoryError) as err:  # no room: the rebuild, if it comes, says so; a hint is never fatal
                    problems.append(f"node {holder}: {err}")
            else:
                self.events.emit("rebuild_prepared", f"not allocating ahead for a rebuild of step {step}: "
                                 f"{'; '.join(problems)}", console=False, node=self.node, step=step, bytes=0)
                return {"bytes": 0}
        self.events.emit("rebuild_prepared", f"allocating {human(nbytes)} of slots for a likely rebuild of step "
                         f"{step}", console=False, node=self.node, step=step, bytes=nbytes)
        return {"bytes": nbytes}

    def op_load(self, generation: int, step: int) -> dict[str, Any]:
        """Load every local rank's persisted snapshot of ``step`` from the checkpoint directory into a slot,
        verified."""
        root = self.spec.ckpt_dir
        if root is None:
            return {"error": "no checkpoint directory"}
        if self.redundancy is not None:
            self.redundancy.drop_prepared()
        t0 = time.perf_counter()
        loaded = 0
        for local, rank in enumerate(self.ranks):
            with self.cond:
                self._check_current(generation)
                if rank.index_of(step) is not None:
                    continue  # already held (an earlier try)
            try:
                index, slot = self.claim_vacant(local, image_size(root, step, self.global_rank(local)))
                load_rank(root, step, self.global_rank(local), slot)
            except (OSError, CorruptStep, KeyError, ValueError) as err:
                return {"error": f"rank {self.global_rank(local)}: {err}"}
            loaded += slot.header().payload_len
            self.hold_restored(local, index, step)
        seconds = time.perf_counter() - t0
        self.events.emit("loaded", f"loaded step {step} of {len(self.ranks)} rank(s) from {root} in "
                         f"{seconds * 1000:.0f} ms ({human(loaded)}), checksums verified", node=self.node, step=step,
                         bytes=loaded, seconds=seconds)
        return {}

    def op_restore(self, rank: int, generation: int) -> dict[str, Any]:
        with self.cond:
            self._wait_for_plan(generation)
            step = self.plans[generation]
            if step == 0:
                return {"step": 0}
            slots = self.ranks[rank]
            for index, held in enumerate(slots.steps):
                slot = slots.files[index]
                if held == step and slot is not None:
                    return {"step": step, "slot": index, "path": slot.path}
        return {"error": f"agreed step {step} is not held by local rank {rank}"}

    def op_reserve(self, rank: int, step: int, generation: int, size: int, skip: bool = True) -> dict[str, Any]:
        slots = self.ranks[rank]
        with self.cond:
            self._wait_for_plan(generation)
            if step > slots.decided:  # the rank decided its previous snapshot (taken or skipped) before this one
                slots.interval = min(slots.interval or step, step - slots.decided)
            while (index := slots.pick(self.restorable, self._pinned(rank), self._abandoned())) is None:
                self._check_current(generation)
                if skip and step - slots.newest() <= STALE_INTERVALS * slots.interval:
                    return self._skip(rank, step)
                self.cond.wait(1.0)
            slots.steps[index] = None
        slot = self.ensure_slot(rank, index, size)
        slot.set_state(WRITING)
        return {"slot": index, "path": slot.path}

    def _abandoned(self) -> set[int]:
        """The steps no rank of the job can restore any more: those the link told, and those a local rank passed
        without holding them (known here before the link can tell it); caller holds the lock."""
        held = set().union(*(rank.held() for rank in self.ranks))
        return self.abandoned | {s for s in held if any(rank.passed(s) for rank in self.ranks)}

    def _skip(self, rank: int, step: int) -> dict[str, Any]:
        """Local rank ``rank`` skips its snapshot of ``step``: its newest is not restorable yet, and waiting for
        it would stall training. The step is abandoned job-wide (see the module doc); caller holds the lock."""
        slots = self.ranks[rank]
        newest = slots.newest()
        why = (f"its step {newest} is not yet "
               f"{'protected by parity' if self.redundancy is not None else 'held by every rank'}")
        slots.decide(step)
        self.cond.notify_all()  # a waiting poll answers: the rank passed a step
        if self._told_skip < self.generation:  # the first of the generation on this node: one line, not one each
            self._told_skip = self.generation
            self.events.emit("snapshot_skipped", f"rank {self.global_rank(rank)} skipped its snapshot of step "
                             f"{step}: {why} (training goes on: snapshots are taken as fast as the job secures "
                             f"them; a rank waits only once its newest is {STALE_INTERVALS} snapshots old)",
                             console=self.node == 0, node=self.node, rank=self.global_rank(rank),
                             step=step, newest=newest)
        return {"skip": why}

    def op_commit(self, rank: int, slot: int, step: int, seconds: float = 0.0) -> dict[str, Any]:
        slots = self.ranks[rank]
        file = slots.files[slot]
        if file is None:
            return {"error": f"local rank {rank} slot {slot} does not exist"}
        header = file.header()
        if file.problem() is not None or header.step != step:
            return {"error": f"local rank {rank} slot {slot} is not committed at step {step} ({header.describe()})"}
        with self.cond:
            if header.generation < self.generation:  # its trainer was stopped by a restart with this on the way
                file.set_state(EMPTY)
                raise Stale(f"generation {header.generation} is over")
            slots.steps[slot] = step
            slots.generations[slot] = header.generation
            slots.decide(step)
            slots.last = {"step": step, "time": time.time(), "bytes": header.payload_len,
                          "copy_gbs": header.payload_len / seconds / 1e9 if seconds > 0 else None}
            self.cond.notify_all()
        self.seals.put((rank, slot, step))
        self.allocations.put((rank, slot, header.payload_len))
        for fault in self.crash_faults:
            if step >= fault.step and header.generation == fault.gen:
                self.events.emit("inject", f"injected {fault.spec}: keeper killing itself at step {step}",
                                 node=self.node)
                os.kill(os.getpid(), signal.SIGKILL)
        return {}

    def op_corrupt(self, rank: int, slot: int, reason: str) -> dict[str, Any]:
        with self.cond:
            self._drop_invalid(rank, slot, reason, "found by its trainer, never loaded")
        return {}

    def op_restored(self, rank: int, step: int, nbytes: int, seconds: float) -> dict[str, Any]:
        self.events.emit("restored", f"rank {self.global_rank(rank)} restored step {step} from RAM in "
                         f"{seconds * 1000:.0f} ms ({human(nbytes)}, {nbytes / max(seconds, 1e-9) / 1e9:.1f} GB/s)",
                         console=False, node=self.node, rank=self.global_rank(rank),
                         step=step, bytes=nbytes, seconds=seconds)
        return {}

    def _wait_for_plan(self, generation: int) -> None:
        while generation not in self.plans:
            self._check_current(generation)
            self.cond.wait(1.0)

    def _check_current(self, generation: int) -> None:
        if generation < self.generation or self._stopping:
            raise Stale(f"generation {generation} is over")

    def global_rank(self, local: int) -> int:
        return self.node * len(self.ranks) + local

    # -- background sealing ---------------------------------------------------------------------------------
    def seal_forever(self) -> None:
        """Compute the checksum of each committed slot, unless it was reserved again meanwhile."""
        lower_to_background()
        while True:
            local, index, step = self.seals.get()
            slot = self.ranks[local].files[index]
            if slot is None or (header := slot.header()).sealed:  # sealed already (a generation start's verify)
                continue
            crc = checksum(slot.map, header)
            with self.cond:
                if self.ranks[local].steps[index] == step and slot.header() == header and header.state == COMMITTED:
                    slot.seal(crc)
                    self.cond.notify_all()  # the encoder waits for the committed step to be sealed

    # -- allocation ahead -----------------------------------------------------------------------------------
    def allocate_forever(self) -> None:
        """After each commit or restore, make the rank's other slot ready for a snapshot of the size it holds."""
        lower_to_background()
        while True:
            self.allocate_other(*self.allocations.get())

    def allocate_other(self, local: int, committed: int, payload: int) -> None:
        """Slot ``1 - committed`` of ``local`` sized for a ``payload`` of bytes, with every page allocated, unless
        it holds a step or is so already. Allocating /dev/shm costs about as much as copying into it: done here,
        below the trainers' priority, a rank's second snapshot does not wait for it, only the first. It goes
        :data:`ALLOCATE_STEP` at a time and stops when anyone asks for a file of the rank (:meth:`ensure_slot`):
        a trainer's ``reserve`` waits for one step at most and allocates the rest itself, at its own priority.
        No room is left for that ``reserve`` to report (it names what is missing)."""
        if committed >= SLOTS_PER_RANK:
            return
        rank, other = self.ranks[local], 1 - committed
        with self.cond:
            if rank.steps[other] is not None:
                return
        with rank.sizing:  # a file already big enough is returned as it is, and the loop ends at once if allocated
            try:
                file = self._ensure_slot(local, other, payload, allocate=False)
            except MemoryError:
                return
        for offset in range(0, file.size, ALLOCATE_STEP):
            if rank.asking:
                return
            with rank.sizing:
                if rank.files[other] is not file or file.allocated:
                    return
                try:
                    file.allocate(offset, min(ALLOCATE_STEP, file.size - offset))
                except OSError:
                    return

    # -- background parity ----------------------------------------------------------------------------------
    def encode_forever(self) -> None:
        """Keep this node's parity at the newest globally committed step (see the module doc)."""
        assert self.redundancy is not None
        lower_to_background()
        failed: tuple[int, str] | None = None
        while True:
            with self.cond:
                while not self._stopping and not self._encode_due():
                    self.cond.wait(1.0)
                if self._stopping:
                    return
                step, generation, protected = self.committed, self.generation, self.restorable
            try:
                with self.coding:
                    self.redundancy.encode(step, generation, protected, lambda: self._fire_parity_fault(step))
                failed = None
            except Exception as err:  # noqa: BLE001 - the encoder must outlive anything one step does
                if isinstance(err, OSError) and err.errno == errno.ENOSPC or isinstance(err, PermissionError):
                    # as no room for slots, or something not ftrun's at a slot's name: the job ends (the
                    # trainers would wait for protection that never comes)
                    problem = (f"cannot make the parity file {err.filename}: {err.strerror}"
                               if isinstance(err, PermissionError) else
                               parity_room_problem(self.node, self.redundancy.wanted, free_bytes(self.dir), self.dir))
                    with self.cond:
                        self.fatal = self.fatal or problem
                        self.cond.notify_all()
                    return
                if self._stopping:  # the keeper closes its files as it stops: not a failure of the parity
                    return
                expected = isinstance(err, (PeerUnavailable, PeerError, RedundancyError, LookupError, OSError))
                if failed != (step, str(err)):  # once per step and cause, then retried quietly
                    failed = (step, str(err))
                    self.events.emit("parity_failed", f"parity of step {step} not computed yet: "
                                     f"{'' if expected else type(err).__name__ + ': '}{err}; retrying",
                                     console=not expected, node=self.node, step=step)
                time.sleep(ENCODE_RETRY)

    def _encode_due(self) -> bool:
        assert self.redundancy is not None
        return (self.committed > 0 and self.committed not in self.redundancy.steps
                and len(self.redundancy.peers) >= self.spec.ec_group and not self._sealing(self.committed))

    def _sealing(self, step: int) -> bool:
        """Whether a local rank's committed slot of ``step`` still waits for its checksum (called under cond)."""
        for rank in self.ranks:
            for index, held in enumerate(rank.steps):
                file = rank.files[index]
                if held == step and file is not None:
                    header = file.header()
                    if header.state == COMMITTED and header.step == step and not header.sealed:
                        return True
        return False

    def _fire_serve_fault(self, step: int) -> None:
        self._lose_node(self.serve_faults, step, f"serves a peer's rebuild of step {step}")
        for fault in self.stall_faults:
            if step >= fault.step and self.generation == fault.gen:
                self.stall_faults.clear()  # once
                self.events.emit("inject", f"injected {fault.spec}: keeper {self.node} stops itself (SIGSTOP) "
                                 f"while it serves a peer's rebuild of step {step}", node=self.node)
                os.kill(os.getpid(), signal.SIGSTOP)

    def _fire_parity_fault(self, step: int) -> None:
        self._lose_node(self.parity_faults, step, f"computes parity of step {step}")

    def _lose_node(self, faults: list[Fault], step: int, doing: str) -> None:
        """An injected node loss of ``faults`` due at ``step``: the supervisor kills every process of the node."""
        for fault in faults:
            if step >= fault.step and self.generation == fault.gen:
                self.events.emit("inject", f"injected {fault.spec}: node {self.node} lost while it {doing}",
                                 node=self.node)
                os.kill(os.getppid(), NODE_LOST_SIGNAL)
                threading.Event().wait()

    # -- background persistence -----------------------------------------------------------------------------
    def _pinned(self, local: int) -> set[int]:
        return self.pinned.get(local, set())

    def persist_forever(self) -> None:
        """Write each step the job asks for from the slots to the checkpoint directory, at low priority.

        While a rank's slot is written it is pinned: a trainer that needs a slot gets another one (the spare, if
        need be), so persistence never makes trainers wait and never sees a slot change under it."""
        lower_priority()
        handled = 0
        while True:
            with self.cond:
                while not self._stopping and self.persist_request[0] <= handled:
                    self.cond.wait(1.0)
                if self._stopping:
                    return
                handled, step = self.persist_request
                pinned = [next(iter(self._pinned(local)), None) for local in range(len(self.ranks))]
                indexes = [i if i is not None and rank.steps[i] == step else None
                           for rank, i in zip(self.ranks, pinned)]
            result: dict[str, Any] = {"round": handled, "step": step}
            t0 = time.perf_counter()
            try:
                if None in indexes:
                    raise LookupError(f"step {step} is not held by every local rank")
                result["entries"] = self._write_step(step, indexes)  # type: ignore[arg-type]
            except (OSError, LookupError, ValueError) as err:  # ValueError: the slot changed (a new generation)
                result["error"] = f"node {self.node}: {error_text(err)}"
            result["seconds"] = time.perf_counter() - t0
            with self.cond:
                if self._pinned_round == handled:  # not a newer round's pins
                    self.pinned = {}
                self.persisted = result
                self.cond.notify_all()

    def _write_step(self, step: int, indexes: list[int]) -> dict[str, dict[str, Any]]:
        assert self.spec.ckpt_dir is not None
        entries = {}
        for local, index in enumerate(indexes):
            slot = self.ranks[local].files[index]
            assert slot is not None
            self._await_seal(local, index, slot, step)  # the checksum goes to disk too
            entries[str(self.global_rank(local))] = write_rank(partial_dir(self.spec.ckpt_dir, step),
                                                               self.global_rank(local), slot)
        return entries

    def _await_seal(self, local: int, index: int, slot: SlotFile, step: int) -> None:
        """Wait until ``slot`` (slot ``index`` of ``local``, holding ``step``) is sealed. LookupError when no seal
        can come (the slot no longer holds the step: a new generation's plan or a trainer's report emptied it), the
        keeper stops, or none came in :data:`SEAL_WAIT` seconds."""
        deadline = time.monotonic() + SEAL_WAIT
        with self.cond:  # the sealer notifies it
            while not (header := slot.header()).sealed:
                if self._stopping:
                    raise LookupError("the keeper is stopping")
                left = deadline - time.monotonic()
                if self.ranks[local].steps[index] != step or header.state != COMMITTED or header.step != step:
                    raise LookupError(f"rank {self.global_rank(local)}'s slot of step {step} was emptied before its "
                                      "checksum was computed")
                if left <= 0:
                    raise LookupError(f"the checksum of rank {self.global_rank(local)}'s slot of step {step} was "
                                      f"not computed in {SEAL_WAIT:g} s")
                self.cond.wait(min(left, POLL_RECHECK))

    # -- serving --------------------------------------------------------------------------------------------
    def serve(self, server: socket.socket, stop: int | None = None) -> None:
        """Serve connections on ``server`` until the stop signal's number can be read on ``stop``, the wakeup fd
        of :func:`main`'s handler (None: until ``server`` is shut down). Invariant: a stop signal ends the loop
        whichever thread the kernel delivers it to: Python runs handlers in the main thread only, so one delivered
        to another thread left the main thread blocked in ``accept`` until its supervisor's SIGKILL
        (``--stop-grace`` later); the wakeup byte is written by the thread that received it."""
        self._background("ftrun-seal", self.seal_forever)
        self._background("ftrun-allocate", self.allocate_forever)
        if self.spec.ckpt_dir is not None:
            self._background("ftrun-persist", self.persist_forever)
        if self.redundancy is not None:
            self._background("ftrun-peer-server", self.redundancy.server.serve)
            self._background("ftrun-parity", self.encode_forever)
        waiter = select.poll()
        for fd in (server.fileno(), stop):
            if fd is not None:
                waiter.register(fd, select.POLLIN)
        while True:
            ready = {fd for fd, _ in waiter.poll()}
            if stop in ready and STOP_SIGNAL in os.read(stop, 64):
                self.stop()
                break
            if server.fileno() not in ready:
                continue
            try:
                conn, _ = server.accept()
            except OSError as err:
                if self._stopping or err.errno not in OUT_OF_RESOURCES:
                    break
                self._not_served(f"could not accept a connection ({err})")
                continue
            if not same_user(conn):
                conn.close()
                continue
            try:
                threading.Thread(target=self._serve_connection, args=(LineSocket(conn),), daemon=True).start()
            except RuntimeError as err:  # can't start new thread
                conn.close()  # its client connects again
                self._not_served(f"closed a connection that could not get a thread ({err})")

    def _not_served(self, what: str) -> None:
        """One line for a connection the keeper could not take in for want of resources (file descriptors, threads),
        then a pause for the connections open to end: serving ends only when the keeper stops (its files are
        unlinked then), never for a passing shortage."""
        self.events.emit("keeper_connection_failed", f"keeper {self.node} {what}; going on", node=self.node)
        time.sleep(0.1)

    def _background(self, name: str, work: Callable[[], None]) -> None:
        """Run ``work`` in daemon thread ``name``, guarded. Invariant: a keeper serves only while each of its
        background threads runs: the others wait for what a dead one would have done (the encoder and the
        persister for seals, the link for parity and persists), so the job's protected step would stop with
        nothing saying why. An unexpected error of one (unless the keeper is stopping: it closes its files)
        prints its traceback and one line, and ends this process without touching its files: the supervisor
        restarts the keeper, which re-adopts the slots (sealing those left unsealed), and training goes on."""

        def guarded() -> None:
            try:
                work()
            except Exception as err:  # noqa: BLE001 - a bug: restarting the keeper is its remedy
                if self._stopping:
                    return
                sys.stderr.write(traceback.format_exc())
                self.events.emit("keeper_thread_failed", f"keeper thread {name} failed ({type(err).__name__}: "
                                 f"{err}); exiting, for the supervisor to restart the keeper (traceback above)",
                                 node=self.node, thread=name)
                os._exit(THREAD_FAILED)

        threading.Thread(target=guarded, name=name, daemon=True).start()

    def _serve_connection(self, conn: LineSocket) -> None:
        try:
            while True:
                request = conn.receive()
                if request is None:
                    return
                conn.send(self._answer(request))
        except (OSError, ValueError):
            pass
        finally:
            conn.close()

    def _answer(self, request: dict[str, Any]) -> dict[str, Any]:
        """:meth:`handle`'s reply; an error it raises (a bug) is an error reply and one line. Invariant: a request
        is always answered: a connection closed instead has the client send it again for a minute
        (:class:`~ftrun.snapshot.protocol.KeeperClient`), failing the same way each time."""
        try:
            return self.handle(request)
        except Exception as err:  # noqa: BLE001 - a bug of one request: the keeper and its other clients go on
            message = f"keeper {self.node} failed request {request.get('op')!r} ({type(err).__name__}: {err})"
            self.events.emit("keeper_request_failed", message, node=self.node, op=str(request.get("op")))
            return {"error": message}

    def stop(self) -> None:
        with self.cond:
            self._stopping = True
            self.cond.notify_all()


def find_segments(job: str, node: int | str = "*") -> list[tuple[str, int, int]]:
    """(path, local rank, slot index) of every slot file of ``job`` on ``node`` ("*": every node)."""
    found = []
    for path in sorted(glob.glob(os.path.join(shm_dir(), slot_name(safe_job_id(job), node, "*", "*")))):
        match = re.search(r"-rank(\d+)-slot(\d+)$", path)
        if match is not None:
            found.append((path, int(match.group(1)), int(match.group(2))))
    return found


def peer_timeout(node_timeout: float) -> float:
    """How long one receive or send of a keeper waits on a peer: the node timeout, after which the peer's
    watchers declare its node lost (a host cut off the network answers nothing: its packets just vanish), and a
    rebuild still waiting on it would hold the next generation back; at least :data:`MIN_PEER_TIMEOUT`. A payload
    received in one call (``MSG_WAITALL``) that stops midway returns what came when the time is up, and the next
    call waits once more: a silent peer is given up after one to two timeouts."""
    return max(MIN_PEER_TIMEOUT, node_timeout)


def shape_name(job: str, node: int | str) -> str:
    """The file recording the shape of the run whose keeper of ``node`` made the node's slot files."""
    return f"ftrun-{job}-node{node}-shape"


def unlink_segments(job: str, node: int | str = "*") -> list[str]:
    """Unlink every slot and parity file of ``job`` (of one node, or of all), and its shape file; returns the
    paths of the slot and parity files removed."""
    for path in glob.glob(os.path.join(shm_dir(), shape_name(safe_job_id(job), node))):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    removed = []
    parity = glob.glob(os.path.join(shm_dir(), parity_name(safe_job_id(job), node, "*")))
    for path in [p for p, _, _ in find_segments(job, node)] + sorted(parity):
        try:
            os.unlink(path)
            removed.append(path)
        except FileNotFoundError:
            pass
    return removed


def listen_alone(job: str, node: int) -> socket.socket:
    """The keeper's socket, which no other keeper of the job's node on this host holds: the lock on the node's
    files in /dev/shm (another keeper would adopt, overwrite and at its end unlink them). A replaced supervisor
    of a local job still running (stalled) holds it until the launcher has killed it: tried again for up to
    :data:`SOCKET_WAIT` seconds, then one line and exit 1."""
    deadline = time.monotonic() + SOCKET_WAIT
    while True:
        try:
            return listen(socket_name(job, node))
        except OSError as err:
            if err.errno != errno.EADDRINUSE:
                raise
            if time.monotonic() >= deadline:
                print(f"ftrun: keeper of node {node}: another keeper of job {job}'s node {node} still runs on this "
                      f"host (its socket is in use after {SOCKET_WAIT:g}s); not starting", file=sys.stderr,
                      flush=True)
                raise SystemExit(1) from None
        time.sleep(0.05)


def await_start(sock: socket.socket) -> None:
    """In a keeper started ahead (its imports done): wait on ``sock`` for the node's start, a byte carrying the
    peer socket (when erasure coding is on) then the keeper's environment as one JSON line, which replaces this
    process's; exit when ``sock`` closes without one (the supervisor never needed it)."""
    line, fds = receive_handoff(sock, 1)
    if not line:
        os._exit(0)
    os.environ.clear()
    os.environ.update(json.loads(line))
    if fds:
        os.environ[ENV_PEER_FD] = str(fds[0])


def main() -> None:
    if ENV_KEEPER_HANDOFF in os.environ:
        await_start(socket.socket(fileno=int(os.environ.pop(ENV_KEEPER_HANDOFF))))
    reuse_large_blocks()  # before any thread starts: pyeclib's fragments then cost no page faults
    spec = NodeSpec.from_env()
    server = listen_alone(safe_job_id(spec.job_id), spec.node_rank)  # before anything touches the node's files
    faults = [f for f in os.environ.get(ENV_KEEPER_FAULTS, "").split(";") if f]
    keeper = Keeper(spec, faults)
    if ENV_PEER_FD in os.environ:
        keeper.enable_redundancy(bytes.fromhex(os.environ.pop(ENV_JOB_SECRET)),
                                 socket.socket(fileno=int(os.environ[ENV_PEER_FD])))

    stop, wakeup = os.pipe()  # the stop signal's number is written to ``wakeup`` by the thread that receives it
    os.set_blocking(wakeup, False)
    signal.set_wakeup_fd(wakeup, warn_on_full_buffer=False)
    signal.signal(STOP_SIGNAL, lambda signum, frame: None)  # a handler of Python's: it writes the wakeup byte
    for ignored in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(ignored, signal.SIG_IGN)
    keeper.adopt(os.environ.get(ENV_EARLIER_RUN) == "1")
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    try:
        keeper.serve(server, stop)
    finally:
        keeper.unlink_all()
        server.close()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # files unlinked, socket closed, events unbuffered: the interpreter's teardown (torch's, the encoder
    # pool's idle threads) only made the job's end later (trainers done to ftrun's exit, 2 x 1: 0.11-0.13 s, now
    # 0.07-0.08 s; 4 alternating pairs)


if __name__ == "__main__":
    main()
