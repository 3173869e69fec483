"""The trainer's side of RAM snapshots: :class:`Snapshotter`.

``save(step)`` captures the structure of the state (and clones of the few tensors that a forward pass may
change: buffers, RNG states) and returns; a background thread asks the node's keeper for a slot, copies
every tensor into it, writes the layout, marks the slot committed and tells the keeper (or skips the snapshot
when the keeper says so: the previous one is not secured job-wide yet, and training does not wait). A GPU
trainer's slots are page-locked on their first use (:mod:`ftrun.snapshot.pinning`), so its copies run at DMA
speed. Once an optimizer of the process has stepped, parameters and optimizer state are copied from the live
tensors: they do not change before the next optimizer step (an EMA's change after it, frozen ones never), and a
step pre-hook on every optimizer of the process (``register_optimizer_step_pre_hook``, in the state or not)
waits for the copy. Before that (a loop without an optimizer updates its parameters by hand) they are cloned at
``save()`` like buffers. So a snapshot is exactly the state at ``step``, and the copy overlaps the next forward
and backward.

A snapshot the keeper told ``save()`` to skip is taken later (by ``wait()``, or at interpreter exit) only while
it is still that step's state: one that holds no live tensor (all cloned at ``save()``) always; one that does
by ``wait()``, while no optimizer has stepped and ``save()`` has not been called for a later step, never at exit
(the script may have changed the live tensors after its loop, loading its best weights say; the newest snapshot
taken stays the final one).

``restore()`` asks the keeper for the step the job agreed on (it waits for the agreement), maps the slot,
checks its header (committed, sealed, the agreed step, the layout's digest) and copies it into the live
objects. The checksum itself was verified by the keeper when the generation started, before the step was
agreed (a slot that fails it falls through to an older step without a restart), so restore reads the bytes
once. A slot that fails the checks is reported to the keeper and never loaded; the trainer exits with an
error and the next generation agrees on an older step.

The *resume window* runs from a restore of a step > 0 to the end of the first optimizer step (or ``save``) after it:
its end, as an optimizer with a closure (LBFGS) runs the step's forward and backward inside ``step()``. A caller that
loads more after the restore opens it itself once that is done (``restore(open_window=False)``, then
:meth:`Snapshotter.open_resume_window`): :mod:`ftrun.dcp`, whose ``dcp.load`` calls ``get_state_dict``, which makes a
fresh optimizer's state with a step at a zero learning rate, no training step. In it,
the first training forward of each DDP module runs a warm-up that leaves no trace, so the resumed step sums
gradients in the order the failure-free run did (:mod:`ftrun.snapshot.ddp_buckets`), and the restored data
loaders draw their resume iterator's seed from a throwaway generator, not from the restored RNG
(:mod:`ftrun.snapshot.loader_seed`).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import operator
import os
import signal
import sys
import threading
import time
import weakref
from collections.abc import MutableMapping
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from ftrun.control.heartbeat import ENV_HEARTBEAT_SLOT, heartbeat, restored, training_over
from ftrun.control.faults import ENV_TRAINER_FAULTS, decode_trainer_faults
from ftrun.snapshot.ddp_buckets import BucketWarmup
from ftrun.snapshot.layout import (
    Capture,
    Entry,
    LayoutChanged,
    capture,
    decode_meta,
    encode_meta,
    local_shard,
    restore,
)
from ftrun.snapshot.loader_seed import LoaderSeedGuard
from ftrun.snapshot.pinning import PinnedMappings
from ftrun.snapshot.protocol import ENV_KEEPER_SOCKET, KeeperClient, KeeperError
from ftrun.snapshot.slot import HEADER_SIZE, Header, SlotFile

SLOT_WAIT_BEAT_SECONDS = 0.5  # how often a trainer whose snapshot waits for a slot beats
_PENDING: set[Snapshotter] = set()  # Snapshotters whose newest save() was skipped (taken at exit)
_SNAPSHOTTERS: weakref.WeakSet[Snapshotter] = weakref.WeakSet()  # every optimizer step waits for their copies
_STEPPED: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()  # optimizers seen stepping


def stepped_memory() -> set[int]:
    """The storage addresses of every parameter and state tensor of the optimizers seen stepping in this process
    (local shards of DTensors): memory that only an optimizer step changes, and every step waits for the
    snapshot copies (:func:`_before_optimizer_step`), so a copy may read it live in the background
    (:mod:`ftrun.dcp`, whose items do not say which are parameters)."""
    found = set()
    for optimizer in list(_STEPPED):
        tensors = [p for group in optimizer.param_groups for p in group["params"]]
        tensors += [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        found.update(local_shard(t).untyped_storage().data_ptr() for t in tensors)
    return found


@torch.compiler.disable  # a compiled optimizer step (torch.compile(opt.step)) runs the hooks as they are, untraced
def _before_optimizer_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Any optimizer's step waits for every Snapshotter's copy (it may change the tensors a copy reads)."""
    _STEPPED.add(optimizer)
    for snap in list(_SNAPSHOTTERS):
        snap._before_step()


@torch.compiler.disable
def _after_optimizer_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """The first optimizer step after a restore ends the resume window, once it is done: an optimizer with a closure
    (LBFGS) runs the step's forward, which the window's DDP warm-up must see, inside ``step()``."""
    for snap in list(_SNAPSHOTTERS):
        snap._end_resume_window()


register_optimizer_step_pre_hook(_before_optimizer_step)  # from import on: the optimizers are seen before a save
register_optimizer_step_post_hook(_after_optimizer_step)


class SnapshotCorrupt(RuntimeError):
    """The agreed snapshot failed verification on this rank; it was not loaded."""


class Snapshotter:
    """Asynchronous RAM snapshots of ``state`` every ``every`` steps, kept by ftrun's keeper.

    ``state`` maps names to modules, optimizers, LR schedulers, anything with ``state_dict()`` and
    ``load_state_dict()``, tensors, numpy arrays and plain values (plain values are restored into this
    dict). RNG states are included unless ``rng=False``. Outside ftrun it warns once and does nothing. Under
    ftrun a process has one at a time (a second is a ``RuntimeError``): the keeper holds one stream per rank.
    While the job has not yet secured this rank's newest snapshot (held by every rank, protected by parity), a
    snapshot is skipped rather than waited for, unless that newest one is more than a few intervals old
    (:mod:`ftrun.snapshot.keeper`); ``skip=False`` always waits: a snapshot at exactly every ``every``
    steps, the training paced by the job's protection. :attr:`skipped` counts the skipped ones.
    """

    _warned = False

    def __init__(self, state: MutableMapping[str, Any], every: int = 1, *, rng: bool = True,
                 skip: bool = True) -> None:
        if isinstance(every, bool) or not hasattr(type(every), "__index__") or operator.index(every) < 1:
            raise ValueError(f"ftrun.Snapshotter: every must be an int >= 1, got {every!r}")
        every = operator.index(every)  # a numpy integer is one
        self.state = state
        self.every = every
        self.rng = rng
        self.skip = skip
        self.skipped = 0  # snapshots skipped because the previous one was not yet secured job-wide
        self._pending: tuple[int, Capture, bytes, Any] | None = None  # the newest save() if skipped (see wait())
        self._saved_step = 0  # the step of the newest save() call, a snapshot step or not
        self._restored = 0
        name = os.environ.get(ENV_KEEPER_SOCKET)
        self.active = bool(name)
        if not self.active:
            if not Snapshotter._warned:
                Snapshotter._warned = True
                print("ftrun.Snapshotter: not running under ftrun; snapshots are off", file=sys.stderr)
            return
        if len(_SNAPSHOTTERS):
            raise RuntimeError("ftrun.Snapshotter: this process has one already (ftrun.dcp's writer and reader use "
                               "one too); the keeper holds one snapshot stream per rank: put every object in one "
                               "state")
        self._keeper = KeeperClient(name or "")
        # its place among the node's trainers, which the keeper's slots are of: not LOCAL_RANK, which is 0 for every
        # trainer with --virtual-local-rank
        self._rank = int(os.environ[ENV_HEARTBEAT_SLOT])
        self._generation = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        self._faults = [f for f in decode_trainer_faults(os.environ.get(ENV_TRAINER_FAULTS, ""))
                        if f[0] in ("copy-crash", "commit-crash")]
        self._slots: dict[str, SlotFile] = {}
        self._pinned = PinnedMappings()  # the slots GPU tensors are copied into, page-locked
        self._job: threading.Thread | None = None
        self._awaiting_slot = threading.Event()  # the copy waits for the keeper's reserve (see wait())
        self._error: BaseException | None = None
        self._disabled = False
        self.last_copy_seconds = 0.0
        self._window: tuple[BucketWarmup, LoaderSeedGuard] | None = None  # the resume window (module docstring)
        self._window_due = False  # a step was restored and its window is not open yet
        self._told_uncaptured = False
        self._asked_restore = False  # restore() was called, or save() said it was not (a restarted trainer that
        # never calls it resumes nothing)
        _SNAPSHOTTERS.add(self)

    # -- restore --------------------------------------------------------------------------------------------
    def restore(self, *, open_window: bool = True) -> int:
        """Load the snapshot every rank agreed on into the live state; returns its step (0: none). The resume window
        (module docstring) opens unless ``open_window`` is False: then :meth:`open_resume_window` opens it."""
        if not self.active:
            return 0
        self._asked_restore = True
        plan = self._keeper.request("restore", rank=self._rank, generation=self._generation)
        step = int(plan["step"])
        if step == 0:
            return 0
        t0 = time.perf_counter()
        slot = self._map(plan["path"])
        if torch.cuda.is_initialized():  # a GPU trainer: its tensors load faster from page-locked memory
            self._pinned.pin(slot.map)
        problem = slot.problem()
        header = slot.header()
        if problem is None and not header.sealed:
            problem = "not verified by the keeper (no checksum)"
        if problem is None and header.step != step:
            problem = f"holds step {header.step}, not the agreed {step}"
        meta = bytes(slot.payload()[header.data_len:header.payload_len]) if problem is None else b""
        layout, skeleton = decode_meta(meta) if problem is None else (None, None)
        if layout is not None and layout.digest != header.digest:
            problem = "layout digest does not match the header"
        if problem is not None:
            self._keeper.request("corrupt", rank=self._rank, slot=int(plan["slot"]), reason=problem)
            raise SnapshotCorrupt(f"snapshot of step {step} in {slot.path} failed verification: {problem}")
        try:
            restore(self.state, layout, skeleton, functools.partial(_view, _data(slot, header.data_len)))
        except LayoutChanged as err:  # another mesh: this step cannot be loaded here, an older source may
            self._keeper.request("corrupt", rank=self._rank, slot=int(plan["slot"]), reason=str(err))
            raise SnapshotCorrupt(f"snapshot of step {step} does not fit the live state: {err}") from None
        self._keeper.request("restored", rank=self._rank, step=step, nbytes=header.payload_len,
                             seconds=time.perf_counter() - t0)
        self._restored = step
        self._window_due = True
        if open_window:
            self.open_resume_window()
        restored(step)
        return step

    def open_resume_window(self) -> None:
        """Open the resume window of the step restored, if it is due: once per restore, before the first ``save()``
        of a later step (optimizer steps before it, a loading caller's, are no training steps)."""
        if self._window_due:
            self._window_due = False
            warmup = BucketWarmup()
            warmup.arm()
            self._window = warmup, LoaderSeedGuard(self.state)

    # -- save -----------------------------------------------------------------------------------------------
    def save(self, step: int) -> None:
        """Beat; every ``every`` steps also snapshot the state at ``step``, copying in the background. ``step`` is
        an int that never goes back over the run (a restore takes the newest step): a step counted from 0 again
        each epoch is a ``ValueError``, outside ftrun too."""
        step, previous = operator.index(step), max(self._saved_step, self._restored)
        if step < previous:
            raise ValueError(f"Snapshotter.save({step}): the step went back (the previous one was {previous}); "
                             "pass a step that grows over the whole run, not one that starts again each epoch")
        heartbeat(step)
        self._saved_step = step
        if not self.active:
            return
        if not self._asked_restore and self._generation > 0:
            self._asked_restore = True  # say it once
            if os.environ.get("RANK", "0") == "0":
                print(f"ftrun.Snapshotter: save() before restore() in restarted generation {self._generation}: "
                      "this trainer does not resume from the step the job agreed on; call restore() (or load "
                      "through ftrun.dcp.MemoryReader) before the training loop", file=sys.stderr, flush=True)
        if step > self._restored:
            self._window_due = False
            self._end_resume_window()
        if self._disabled or step % self.every:
            return
        self._join()
        self._drop_pending()
        taken = capture(self.state, rng=self.rng, live=len(_STEPPED) > 0, stepped=stepped_memory)
        if taken.uncaptured and not self._told_uncaptured:
            self._told_uncaptured = True
            if os.environ.get("RANK", "0") == "0":
                print(f"ftrun.Snapshotter: the position of {', '.join(taken.uncaptured)} (a torch DataLoader) is not "
                      "captured: after a restore its epoch starts over. torchdata's StatefulDataLoader resumes at "
                      "the same sample (pip install torchdata).", file=sys.stderr, flush=True)
        meta = encode_meta(taken.layout, taken.skeleton)
        ready = _cuda_ready_event(taken)
        # Not a daemon: the interpreter joins it before it finalizes. A daemon thread still copying when the
        # script returns is stopped where it stands (pthread_exit at its next GIL take) with the snapshot, the
        # loader and its workers referenced from its frame; with a StatefulDataLoader's workers that ended
        # in SIGABRT at exit ("terminate called without an active exception") under ftrun only.
        # Started before it is published: another thread's wait() (DCP's async save in thread mode saves in its
        # own thread while the optimizer pre-hook waits in the training thread) must never join an unstarted one.
        job = threading.Thread(target=self._copy, args=(step, taken, meta, ready, self.skip), name="ftrun-snapshot")
        job.start()
        self._job = job

    def wait(self) -> None:
        """Block until the newest ``save()``'s snapshot is committed; if it was skipped, take it now, waiting for a
        slot, if it is still that step's state (module doc). Called after the training loop, it puts the state at
        its end in RAM (and on disk with ``--ckpt-dir``); at interpreter exit it runs by itself, but takes a
        skipped snapshot only if it holds no live tensor. From its return until the next ``save()`` the trainer
        counts as done training: it has --hang-timeout-initial to finish (an evaluation, an upload) and exit.

        While the copy waits for the keeper to give it a slot (until the job has agreed its restore step; and when
        it does not skip, until every rank holds this rank's newest snapshot, with parity until the job has
        protected it) the trainer beats: it is waiting for the job, not hung. It does not beat while the copy
        itself runs.
        """
        self._join()
        self._take_pending()
        training_over()

    def _take_pending(self, at_exit: bool = False) -> None:
        """Take the skipped snapshot of the newest ``save()``, if any and the state is still its step's (module
        doc), waiting for a slot: in a thread, so the trainer beats meanwhile, or (at interpreter exit, where no
        thread starts) in this one."""
        pending = self._pending
        if pending is None:
            return
        self._drop_pending()
        step, taken = pending[0], pending[1]
        if taken.by_reference and (at_exit or step != self._saved_step):  # the live tensors may have changed
            if at_exit and os.environ.get("RANK", "0") == "0":
                print(f"ftrun.Snapshotter: the snapshot of step {step} was skipped and is not taken at exit (the "
                      "script may have changed the live tensors since); the newest one taken stays the last. Call "
                      "wait() after the loop to take it.", file=sys.stderr, flush=True)
            return
        args = (*pending, False)
        if at_exit:
            self._copy(*args)
        else:
            self._job = threading.Thread(target=self._copy, args=args, name="ftrun-snapshot")
            self._job.start()
        self._join()

    def _join(self) -> None:
        """Block until the snapshot being copied is committed or skipped (the optimizer pre-hook calls this)."""
        if not self.active or (job := self._job) is None:
            return
        job.join(SLOT_WAIT_BEAT_SECONDS)
        while job.is_alive():
            if self._awaiting_slot.is_set():
                heartbeat()
            job.join(SLOT_WAIT_BEAT_SECONDS)
        if self._job is job:
            self._job = None
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"ftrun snapshot failed: {error}") from error

    def _before_step(self) -> None:
        """Every optimizer step waits for the copy (a skipped snapshot is then given up: the state changes)."""
        self._join()
        self._drop_pending()

    def _drop_pending(self) -> None:
        self._pending = None
        _PENDING.discard(self)

    def _end_resume_window(self) -> None:
        if self._window is not None:
            warmup, loaders = self._window
            self._window = None
            warmup.disarm()
            loaders.release()

    def _copy(self, step: int, taken: Capture, meta: bytes, ready: Any, skip: bool) -> None:
        try:
            t0 = time.perf_counter()
            layout = taken.layout
            self._awaiting_slot.set()
            try:
                reply = self._keeper.request("reserve", rank=self._rank, step=step, generation=self._generation,
                                             size=layout.nbytes + len(meta), skip=skip)
            finally:
                self._awaiting_slot.clear()
            if "skip" in reply:  # the rank's newest snapshot is not restorable yet: training does not wait for it
                self.skipped += 1
                self._pending = step, taken, meta, ready
                _PENDING.add(self)  # kept alive for the exit (a script run by runpy drops its globals first)
                return
            slot = self._map(reply["path"])
            half = len(layout.entries) // 2
            stream = torch.cuda.Stream() if ready is not None else None
            # no_grad: copying a parameter into the slot must not record autograd history (a third slower)
            # into a page-locked slot the copies from the GPU are queued on the stream, then waited for at once
            queued = stream is not None and self._pinned.pin(slot.map)
            with torch.no_grad(), torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                if stream is not None:
                    stream.wait_event(ready)
                data = _data(slot, layout.nbytes)
                for i, (entry, tensor) in enumerate(zip(layout.entries, taken.tensors)):
                    if i == half:
                        self._fire("copy-crash", step)
                    _view(data, entry).copy_(tensor, non_blocking=queued)
                if stream is not None:
                    stream.synchronize()
                del data
            slot.payload()[layout.nbytes:layout.nbytes + len(meta)] = meta
            self._fire("commit-crash", step)
            slot.commit(Header(step=step, generation=self._generation, digest=layout.digest,
                               data_len=layout.nbytes, meta_len=len(meta)))
            self.last_copy_seconds = time.perf_counter() - t0
            self._keeper.request("commit", rank=self._rank, slot=int(reply["slot"]), step=step,
                                 seconds=self.last_copy_seconds)
        except KeeperError as err:
            if str(err).startswith("stale"):
                return  # this generation is over; the supervisor is stopping this trainer
            self._disabled = True
            print(f"ftrun: snapshots off on local rank {self._rank}: {err}", file=sys.stderr, flush=True)
        except BaseException as err:  # handed to the training thread at the next wait()
            self._error = err

    def _map(self, path: str) -> SlotFile:
        slot = self._slots.get(path)
        if slot is None or slot.size < os.stat(path).st_size:
            if slot is not None:  # the keeper grew the file: map it anew
                self._pinned.forget(slot.map)
                slot.close()
            slot = self._slots[path] = SlotFile(path, populate=True)
        return slot

    def _fire(self, kind: str, step: int) -> None:
        for fault in self._faults:
            if fault[0] == kind and step >= fault[1]:
                print(f"ftrun: injected {kind} at snapshot step {step} (pid {os.getpid()})", file=sys.stderr,
                      flush=True)
                os.kill(os.getpid(), signal.SIGKILL)


@atexit.register
def _take_skipped_at_exit() -> None:
    """At interpreter exit, each Snapshotter whose newest ``save()`` was skipped takes it where that is safe
    (module doc): the state at the end of training is in RAM, and persisted with ``--ckpt-dir``."""
    for snap in list(_PENDING):
        try:
            snap._join()
            snap._take_pending(at_exit=True)
        except Exception as err:  # noqa: BLE001 - one line at exit, not a traceback
            print(f"ftrun: the last snapshot was not taken at exit: {err}", file=sys.stderr, flush=True)


def _data(slot: SlotFile, nbytes: int) -> torch.Tensor:
    """The slot's data region as a uint8 tensor over the shared mapping (no copy)."""
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(slot.map, dtype=torch.uint8, count=nbytes, offset=HEADER_SIZE)


def _view(data: torch.Tensor, entry: Entry) -> torch.Tensor:
    raw = data[entry.offset:entry.offset + entry.nbytes]
    return raw.view(getattr(torch, entry.dtype)).reshape(entry.shape)


def _cuda_ready_event(taken: Capture) -> Any:
    """A CUDA event after the work that produced the state, when any tensor is on a GPU."""
    if any(t.is_cuda for t in taken.tensors):
        event = torch.cuda.Event()
        event.record()
        return event
    return None
