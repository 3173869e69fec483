"""Coordination of the durable tier over the control store, run by each supervisor's keeper link.

Persisting step S needs every rank's slot of S to stay in RAM, on every node, until it is on disk. Slots turn
over as fast as steps are committed (a keeper overwrites a slot once a newer step is *restorable*), and nodes
learn which step is restorable at different times: a step named by node 0 may already be overwritten on a node
by the time it reads the name. So a persist is a *round* in two phases, under ``ftrun/<job>/persist/``:

1. **hold.** Node 0 opens round T: ``round`` = ``{"round": T, "generation": g, "step": null}``. Each other node
   of generation g, on reading it, stops raising its keeper's restorable step and answers
   ``round/<T>/hold/<node>`` with that step F. A keeper never overwrites a slot of a step at or above its
   restorable step (it only replaces slots older than the newest step it holds, and only once that newest step
   is restorable).
2. **write.** Once every other node answered, node 0 names ``S = max F`` over their answers and its own
   restorable step (``"step": S``), in the same tick, so node 0 itself never holds. S is committed by every rank
   (it is restorable somewhere), and no node can have overwritten it: each keeper's restorable step stayed at
   most its F <= S since it answered. Each node asks its keeper to persist S; the keeper pins S's slots in the same
   request that lifts the hold, writes them, and the node answers ``round/<T>/<node>`` with the outcome. Node 0
   finishes the step when every node has answered (:func:`ftrun.snapshot.persist.finalize`) and prunes old ones.

A node reads the round document every ``READ_INTERVAL``, and at every link tick once its ranks passed
``persist_every`` snapshot steps since its last hold (a round is due), so a round's hold starts within a tick or
two of its opening. A hold lasts about two link ticks; a trainer skips a snapshot in it only if it commits two
more steps meanwhile (one slot is free; a pinned slot in the way brings in the spare third slot). Memory: at most
three slots per rank, the third only while a persist is written.

Rounds run one at a time. Node 0 opens the next once its ranks have passed ``persist_every`` snapshot steps
(taken, or skipped because the one before was not secured yet) since it opened the previous one and that one
is closed; so at any instant the newest complete step on disk is at most ``persist_every`` snapshot steps plus
one round plus the time the job takes to secure a snapshot behind training, at any snapshot rate.
A generation change cancels the open round (``"step": -1``; a node lifts its hold when its generation changes);
the next round opens in the new generation. The final persist (``final``: every trainer has stopped, slots no
longer change) skips the hold and names the newest committed step at once.

Outcome keys, written by node 0: ``done`` (newest step complete on disk) and ``done_time``; ``degraded`` (why the
last round failed; "" once one succeeds); ``failed`` and ``failed_reason`` (the newest step whose round failed,
and why); ``rounds`` and ``failures`` (counts); with ``--ckpt-format dcp``, ``dcp_done`` (the newest step with a
complete DCP copy) and ``dcp_failed`` (``{"step": S, "reason": ...}``: the newest step whose copy failed, while no
newer copy is written; "" after). :mod:`ftrun.ui.durable` reads them.

The final persist succeeded, on every node alike (:meth:`Durability.final_outcome` reads only these keys), once
its step is complete on disk and, with ``--ckpt-format dcp`` (the user asked for a DCP checkpoint), its DCP copy
too, checked and renamed into place; it failed once either failed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from dataclasses import dataclass, replace
from typing import Any

from torch.distributed import DistError

from ftrun.control.coordination import CAS_TRIES, Coordinator
from ftrun.control.spec import NodeSpec
from ftrun.errors import error_text
from ftrun.events import EventLog
from ftrun.snapshot.dcp_copy import DcpCopies
from ftrun.snapshot.persist import (MANIFEST, MAX_MANIFEST_BYTES, complete_steps, finalize, manifest, move_aside,
                                    open_regular, prune, remove_partial, replaced_dir, set_aside_other_worlds,
                                    step_name, steps_text)
from ftrun.snapshot.protocol import POLL_WAIT

STEP_NUMBER = re.compile(r"step-\d+")
READ_INTERVAL = 0.2  # how often a node reads the round document while it holds nothing for one
CANCELLED = -1  # the step of a round cancelled by a generation change


@dataclass(frozen=True)
class Round:
    """The ``round`` document: round ``round`` of generation ``generation`` persists ``step`` (None: hold phase;
    :data:`CANCELLED`)."""

    round: int
    generation: int
    step: int | None = None
    final: bool = False

    def encode(self) -> str:
        return json.dumps({"round": self.round, "generation": self.generation, "step": self.step,
                           "final": self.final})

    @classmethod
    def decode(cls, raw: bytes) -> Round | None:
        """The document, or None when ``raw`` is not one (never raises)."""
        try:
            doc = json.loads(raw)
            found = cls(int(doc["round"]), int(doc["generation"]),
                        None if doc["step"] is None else int(doc["step"]), bool(doc["final"]))
        except (ValueError, KeyError, TypeError):
            return None
        return found


class Durability:
    """One node's part of the protocol above; node 0 also opens rounds and finishes steps."""

    def __init__(self, spec: NodeSpec, coord: Coordinator, events: EventLog) -> None:
        assert spec.ckpt_dir is not None
        self.spec = spec
        self.root = spec.ckpt_dir
        self.coord = coord
        self.events = events
        self.leader = spec.node_rank == 0
        self.generation = -1
        # this node's side
        self.persist: tuple[int, int] = (0, 0)  # (round, step) its keeper is asked to persist
        self.hold: int | None = None  # the restorable step its keeper is held at, while a round is in its hold
        self._holding = 0  # the round it holds for
        self._reported = 0  # the newest round whose outcome it published
        self._next_read = 0.0
        self._snapshots = 0  # snapshot steps its ranks passed since it opened (node 0) or held for the last round
        # node 0's side
        self.open: Round | None = None  # the round in progress
        self.done = number(coord.get("persist", "done")) or 0  # a replacement node 0 goes on from the store
        self._final = 0  # the step of the final persist, once asked
        self._final_opened = False
        self._degraded: str | None = None
        self._rounds = number(coord.get("persist", "rounds")) or 0
        self._failures = number(coord.get("persist", "failures")) or 0
        self.copies = DcpCopies(self.root, events) if self.leader and spec.ckpt_format == "dcp" else None
        self._copies_told: tuple[int, tuple[int, str] | None] = (0, None)  # (done, failure) node 0 last published
        self._aside = ""  # where this process moved steps of another world size (one directory, not one per move)

    def disk_steps(self) -> set[int]:
        """Complete steps of this job, with as many ranks as it has now, on disk; none, with a warning, while the
        checkpoint directory cannot be read (an NFS server's EIO or ESTALE): the generation restores from RAM."""
        world = self.spec.nnodes * self.spec.nproc_per_node
        try:
            return {step for step in complete_steps(self.root, self.spec.job_id)
                    if manifest(self.root, step)["world"] == world}
        except (OSError, ValueError) as err:  # ValueError: a step replaced between two reads of its manifest
            self.events.emit("durability", f"WARNING cannot list the persisted steps in {self.root} "
                             f"({error_text(err)}); restoring without them", reason=error_text(err))
            return set()

    # -- every node ------------------------------------------------------------------------------------------
    def begin(self, generation: int) -> None:
        """The generation's restore step is agreed: lift any hold; node 0 cancels the round of an older one."""
        self.generation = generation
        self.hold = None
        cancelled = self.open
        if self.leader and cancelled is not None and cancelled.generation != generation:
            self._set_round(Round(cancelled.round, cancelled.generation, CANCELLED))
            if cancelled.step:
                remove_partial(self.root, cancelled.step)
            self.open = None
            self._snapshots = self.spec.persist_every  # due again in the new generation

    def tick(self, outcome: dict[str, Any], restorable: int) -> None:
        """Publish the keeper's outcome, follow the round document (updates :attr:`persist` and :attr:`hold`),
        and on node 0 drive the rounds. ``restorable``: the newest step this node knows every rank can restore."""
        done_round = int(outcome.get("round", 0))
        if done_round > self._reported:
            self._reported = done_round
            self.coord.store.set(self.coord.key("persist", "round", done_round, self.spec.node_rank),
                                 json.dumps(outcome))
        if self.leader:
            self._lead(restorable)
            if self.copies is not None:
                self._poll_copies()
        now = time.monotonic()
        # a round due: node 0 opens it about now, so hold for it at once
        if self.hold is None and now < self._next_read and not self.leader and not self._due:
            return
        self._next_read = now + READ_INTERVAL
        current = self._read_round()
        if current is None or current.round < max(self._holding, self.persist[0]):
            return
        if current.step is None:
            if current.generation == self.generation and current.round > self._holding and not self.leader:
                self._holding, self.hold, self._snapshots = current.round, restorable, 0
                self.coord.store.set(self.coord.key("persist", "round", current.round, "hold", self.spec.node_rank),
                                     str(restorable))
            return
        self._holding = max(self._holding, current.round)
        self.hold = None
        if current.step > 0 and current.round > self.persist[0] and current.generation == self.generation:
            self.persist = (current.round, current.step)

    def quiet(self) -> float:
        """How long (seconds) the link may wait for its keeper before it ticks again: 0 while a round needs this node
        (a hold, a round due or open); else until its next read of the round document (every node but 0), or of
        the running DCP copy (node 0); else :data:`~ftrun.snapshot.protocol.POLL_WAIT` (the keeper answers a change
        at once: a snapshot passed, a persist written)."""
        if self.hold is not None or self.open is not None or self._due:
            return 0.0
        if not self.leader:
            return min(POLL_WAIT, max(0.0, self._next_read - time.monotonic()))
        return READ_INTERVAL if self.copies is not None and self.copies.busy() else POLL_WAIT

    @property
    def _due(self) -> bool:
        """Whether its ranks passed ``persist_every`` snapshot steps since it opened (node 0) or held for the last
        round: a round is due."""
        return self._snapshots >= self.spec.persist_every

    def snapshot_passed(self, count: int) -> None:
        """Its ranks passed ``count`` more snapshot steps (every one took or skipped each)."""
        self._snapshots += count

    # -- node 0 ----------------------------------------------------------------------------------------------

    def ask_final(self, step: int) -> None:
        """Node 0: every trainer has stopped; persist ``step``, the newest committed one, after the open round."""
        self._final = step
        self.coord.store.set(self.coord.key("persist", "final"), str(step))

    def _lead(self, restorable: int) -> None:
        opened = self.open
        if opened is None:
            if self._final and not self._final_opened:
                self._final_opened = True
                if self._final > self.done:
                    self._open(self._final, final=True)
                elif self.copies is not None and self.copies.done < self.done and self.copies.failure is None:
                    self.copies.want(self.done, final=True)  # on disk before: its copy, still to come, at once
            elif self._due and self.generation >= 0 and not self._final:
                self._snapshots = 0
                self._open()
            return
        if opened.step is None:  # node 0 answers last, as it names the step: it never holds
            holds = self._answers(opened.round, "hold", first=1)
            if holds is not None:
                step = max([restorable] + [int(h) for h in holds.values() if h.isdigit()])
                if step <= self.done:  # nothing newer than what is on disk
                    self._set_round(Round(opened.round, opened.generation, CANCELLED))
                    self.open = None
                else:
                    self.open = Round(opened.round, opened.generation, step)
                    self._set_round(self.open)
            return
        outcomes = self._answers(opened.round)
        if outcomes is not None and not self._superseded(self._read_round()):
            self.open = None
            self._finish(opened, {node: _outcome(raw) for node, raw in outcomes.items()})

    def _document(self) -> tuple[bytes, Round | None]:
        """The exact bytes of the round document (b"": not set) and the round they hold (None: none authentic)."""
        key = self.coord.key("persist", "round")
        raw = self.coord.store.get_raw(key) or b""
        payload = self.coord.store.open(key, raw) if raw else None
        return raw, Round.decode(payload) if payload is not None else None

    def _read_round(self) -> Round | None:
        return self._document()[1]

    def _open(self, step: int | None = None, final: bool = False) -> None:
        """Open this generation's next round (numbered after the document's, as it is when written)."""
        self.open = self._set_round(Round(0, self.generation, step, final), numbered=True)

    def _set_round(self, new: Round, numbered: bool = False) -> Round | None:
        """Write the round document ``new`` (``numbered``: as the round after the document's) unless this node 0
        is :meth:`_superseded`; returns what it wrote (None: superseded). Invariant: a write never replaces a
        document it did not read: a compare-and-set from the bytes read, so a newer generation's node 0 that
        writes between the read and the write (while this one is stalled, or its write delayed in a partition) is
        never overwritten. Each failed compare-and-set means another node 0 wrote in between: read again."""
        for _ in range(CAS_TRIES):
            raw, current = self._document()
            if self._superseded(current):
                return None
            if numbered:
                new = replace(new, round=(current.round if current is not None else 0) + 1)
            if self.coord.store.compare_set(self.coord.key("persist", "round"), raw, new.encode())[0]:
                return new
        raise DistError("the control store's persist round document keeps changing; giving up")

    def _superseded(self, current: Round | None) -> bool:
        """Whether the round document ``current`` is a newer generation's: that generation's node 0 leads the
        rounds now, and this one was replaced (cut off or stalled, then back for the moments before it reads its
        owner key). It drops its round instead of finishing it or writing the document: an older round's number
        there would make the new node 0 number its next rounds from it again and take their old answers for new
        ones."""
        if current is None or current.generation <= self.generation:
            return False
        self.open = None
        return True

    def _answers(self, number: int, *what: str, first: int = 0) -> dict[int, str] | None:
        """node -> answer to round ``number`` (its hold, or its outcome) of nodes ``first``.., once all of them
        answered; else None."""
        nodes = range(first, self.spec.nnodes)
        values = self.coord.all_set([self.coord.key("persist", "round", number, *what, node) for node in nodes])
        return None if values is None else {node: raw.decode(errors="replace") for node, raw in zip(nodes, values)}

    def _finish(self, finished: Round, outcomes: dict[int, dict[str, Any]]) -> None:
        """Every node wrote its ranks' files of the round's step (or failed): finish the step on disk, or report
        why not."""
        step = finished.step
        assert step is not None and step > 0
        self._rounds += 1
        errors = [str(o["error"]) for o in outcomes.values() if "error" in o]
        entries: dict[int, dict] = {}
        if not errors:
            try:
                entries = {int(r): e for o in outcomes.values() for r, e in o["entries"].items()}
            except (KeyError, TypeError, ValueError, AttributeError):
                errors = ["a node's outcome is malformed"]
        t0 = time.perf_counter()
        replaced = replaced_dir(self.root, step)
        if not errors:
            try:  # a step-N left by an earlier run of the job (it resumed from older) goes to `replaced`
                path = finalize(self.root, step, self.spec.job_id, self.spec.nnodes, self.spec.nproc_per_node,
                                entries)
            except (OSError, ValueError) as err:
                errors = [error_text(err)]
        if errors:
            self._failed(step, "; ".join(errors))
            return
        self._drop_replaced(replaced)
        pruned = self._tidy(step)  # the step is on disk: failing to delete older ones does not undo that
        self.done = step
        if self.copies is not None:
            self.copies.want(step, finished.final)
        nbytes = sum(int(e["bytes"]) for e in entries.values())
        seconds = max(float(o.get("seconds", 0.0)) for o in outcomes.values())  # the keepers wrote in parallel
        finishing = time.perf_counter() - t0  # manifest, rename, pruning
        self._set_counts()
        self.coord.store.set(self.coord.key("persist", "done_time"), str(time.time()))
        self.coord.store.set(self.coord.key("persist", "done"), str(step))
        if self._degraded is not None:
            self._degraded = None
            self.coord.store.set(self.coord.key("persist", "degraded"), "")
        self.events.emit("persisted", f"persisted step {step} to {path} ({nbytes / 2**20:.1f} MiB written in "
                         f"{seconds:.2f}s, {nbytes / max(seconds, 1e-9) / 1e9:.2f} GB/s; finished in {finishing:.2f}s)"
                         f"{'; removed ' + steps_text(pruned) if pruned else ''}", step=step, bytes=nbytes,
                         seconds=seconds, finish_seconds=finishing, path=path, pruned=pruned)

    def _tidy(self, step: int) -> list[int]:
        """With ``step`` the newest on disk: move steps of another world size aside and prune the others beyond
        ``--keep`` but those a DCP copy needs. Returns the steps removed (none, with a warning, on an OSError)."""
        try:
            spare = self.copies.spare() if self.copies is not None else frozenset()
            aside, moved = set_aside_other_worlds(self.root, step, self.spec.job_id,
                                                  self.spec.nnodes * self.spec.nproc_per_node, spare, self._aside)
            if moved:
                self._aside = aside
                self.events.emit("durability", f"moved {steps_text(moved)} of another world size to {aside} (kept, "
                                 "not counted toward --keep: a run at that world size resumes from them once "
                                 "moved back)", step=step, moved=moved, path=aside)
            return prune(self.root, self.spec.keep, step, self.spec.job_id, spare)
        except OSError as err:
            self.events.emit("durability", f"WARNING could not remove old steps after persisting step {step}: "
                             f"{error_text(err)}", step=step)
            return []

    def _poll_copies(self) -> None:
        """Drive the DCP copies (node 0); once one is written, the steps kept for the copies before are pruned
        like any other (a job ended with ``--keep`` + 2 steps: the last persist spared the step then copied and
        the newest copied before it)."""
        assert self.copies is not None
        copied = self.copies.done
        self.copies.poll()
        done, failure = self._copies_told
        self._copies_told = (self.copies.done, self.copies.failure)
        if done != self.copies.done:
            self.coord.store.set(self.coord.key("persist", "dcp_done"), str(self.copies.done))
        if failure != self.copies.failure:
            failed = self.copies.failure
            self.coord.store.set(self.coord.key("persist", "dcp_failed"),
                                 json.dumps({"step": failed[0], "reason": failed[1]}) if failed else "")
        if self.copies.done > copied and self.done:
            pruned = self._tidy(self.done)
            if pruned:
                self.events.emit("durability", f"removed {steps_text(pruned)}, kept beyond --keep until the DCP "
                                 f"copy of step {self.copies.done} was written", step=self.done, pruned=pruned)

    def _drop_replaced(self, replaced: str) -> None:
        """Delete the step an earlier run left where this one persisted, unless it was saved at another world
        size: that one is moved into ``previous-<time>/`` (kept, as ``--no-resume`` keeps steps)."""
        if not os.path.isdir(replaced):
            return
        try:
            with open_regular(os.path.join(replaced, MANIFEST)) as f:
                world = json.loads(f.read(MAX_MANIFEST_BYTES))["world"]
        except (OSError, ValueError, KeyError, TypeError, RecursionError):
            world = None
        if world is None or world == self.spec.nnodes * self.spec.nproc_per_node:
            shutil.rmtree(replaced, ignore_errors=True)
            return
        try:
            aside = self._aside = move_aside(self.root, [replaced], self._aside)
        except OSError as err:  # kept where it is; put_back_replaced never takes it while step-N exists
            self.events.emit("durability", f"WARNING could not move {replaced} aside: {err.strerror}", path=replaced)
            return
        self.events.emit("durability", f"moved {os.path.basename(replaced).removesuffix('.replaced')}, saved at "
                         f"world size {world} and persisted again by this run, to {aside}", path=aside,
                         saved_world=world)

    def _failed(self, step: int, reason: str) -> None:
        remove_partial(self.root, step)
        self._failures += 1
        self._set_counts()
        self.coord.store.set(self.coord.key("persist", "degraded"), reason)
        self.coord.store.set(self.coord.key("persist", "failed_reason"), reason)
        self.coord.store.set(self.coord.key("persist", "failed"), str(step))
        cause = STEP_NUMBER.sub("step-N", reason)  # the files a reason names are the step's own
        if cause != self._degraded:  # one warning per cause; the counts say how often
            self._degraded = cause
            self.events.emit("durability", f"WARNING durability degraded: persisting step {step} to {self.root} "
                             f"failed ({reason}); training goes on from RAM snapshots, retrying at the next "
                             "persist", step=step, degraded=True, reason=reason)

    def _set_counts(self) -> None:
        self.coord.store.set(self.coord.key("persist", "rounds"), str(self._rounds))
        self.coord.store.set(self.coord.key("persist", "failures"), str(self._failures))

    def final_outcome(self) -> str | None:
        """After :meth:`ask_final` (by node 0): "" once the final step is on disk (with ``--ckpt-format dcp``: and
        its DCP copy), why not once it failed, None while unknown. The same on every node: read from the store."""
        final = number(self.coord.get("persist", "final"))
        if final is None:
            return None
        done, failed = number(self.coord.get("persist", "done")), number(self.coord.get("persist", "failed"))
        if final == 0:  # nothing was ever committed
            return ""
        if done is not None and done >= final:
            return self._final_copy(int(final)) if self.spec.ckpt_format == "dcp" else ""
        if failed is not None and failed >= final:
            reason = self.coord.get("persist", "degraded")
            return reason.decode(errors="replace") if reason else "failed"
        return None

    def _final_copy(self, final: int) -> str | None:
        """"" once the DCP copy of step ``final`` (or of a newer one) is written, why not once it failed, else
        None."""
        if (number(self.coord.get("persist", "dcp_done")) or 0) >= final:
            return ""
        failed = dcp_failure(self.coord.get("persist", "dcp_failed"))
        if failed is not None and failed[0] >= final:
            return f"its DCP copy failed ({failed[1]}); step {final} is on disk in ftrun's format only"
        return None

    def step_path(self, step: int) -> str:
        return os.path.join(self.root, step_name(step))


def _outcome(raw: str) -> dict[str, Any]:
    """A node's outcome document; a malformed one counts as an error."""
    try:
        doc = json.loads(raw)
    except ValueError:
        doc = None
    return doc if isinstance(doc, dict) else {"error": "malformed outcome"}


def dcp_failure(raw: bytes | None) -> tuple[int, str] | None:
    """The ``dcp_failed`` document read as (step, reason); None when absent, cleared or malformed."""
    try:
        doc = json.loads(raw) if raw else None
        return (int(doc["step"]), str(doc["reason"])) if doc else None
    except (ValueError, KeyError, TypeError):
        return None


def number(raw: bytes | None, kind: type = int) -> int | float | None:
    """``raw`` read as a number of ``kind``, or None when it is absent or not one."""
    try:
        return None if raw is None else kind(raw)
    except ValueError:
        return None
