"""Shared-memory heartbeat table: trainers write, the supervisor of their node reads.

The contract between a node's trainers and its supervisor (the supervisor's hang detection is
:mod:`ftrun.launch.hangs`). :func:`heartbeat` is the process's one writer: ``ftrun.heartbeat`` and the
Snapshotter (which beats while it waits) both go through it.

One file per node under /dev/shm (mode 0600, named by job and node rank) holds a header and one 64-byte slot
per local rank::

    header: magic b"FTRUNHB1", version u32, slots u32 (padded to 64 bytes)
    slot:   pid i64, step i64 (-1 before the first step), beats u64, monotonic_ns u64, generation i64,
            phase i64 (0 running, 1 exiting: the script is done and the interpreter is shutting down, 2 restored:
            the trainer loaded a snapshot and its first step after it is to come)

A trainer maps its slot once; every :func:`ftrun.heartbeat` is then a ``struct.pack_into`` on the mapping,
no system call (``time.monotonic_ns`` is served by the vDSO). The supervisor zeroes a slot before it starts
a trainer in it and polls the beat counter; a change of counter is a beat, whatever the clocks say.
Injected trainer faults (:mod:`ftrun.control.faults`) fire here, right after the beat that reaches their step.
"""

from __future__ import annotations

import atexit
import mmap
import operator
import os
import signal
import struct
import sys
import time
from dataclasses import dataclass

from ftrun.control.faults import ENV_TRAINER_FAULTS, decode_trainer_faults
from ftrun.control.spec import open_shm_file

ENV_HEARTBEAT_FILE = "FTRUN_HEARTBEAT_FILE"
ENV_HEARTBEAT_SLOT = "FTRUN_HEARTBEAT_SLOT"
ENV_GENERATION = "TORCHELASTIC_RESTART_COUNT"

BEAT_FAULTS = ("crash", "hang")  # the injected faults that fire at a heartbeat

PHASE_RUNNING = 0
PHASE_EXITING = 1
PHASE_RESTORED = 2

_MAGIC = b"FTRUNHB1"
_VERSION = 1
_HEADER = struct.Struct("<8sII")
_HEADER_SIZE = 64
_SLOT = struct.Struct("<qqQQqq")
STEP_LIMIT = 1 << 63  # a step is a signed 64-bit integer in the slot (and in a snapshot's header)
_SLOT_SIZE = 64


@dataclass(frozen=True)
class Beat:
    """One slot as read by the supervisor."""

    pid: int
    step: int
    beats: int
    monotonic_ns: int
    generation: int
    phase: int


class HeartbeatTable:
    """The supervisor's side: creates, reads, resets and finally unlinks the table of one node."""

    def __init__(self, path: str, slots: int) -> None:
        self.path = path
        self.slots = slots
        size = _HEADER_SIZE + slots * _SLOT_SIZE
        fd = open_shm_file(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC)
        try:
            os.fchmod(fd, 0o600)
            os.ftruncate(fd, size)
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        _HEADER.pack_into(self._map, 0, _MAGIC, _VERSION, slots)

    def reset(self, slot: int) -> None:
        """Empty a slot before a new trainer starts in it."""
        _SLOT.pack_into(self._map, _offset(slot), 0, -1, 0, 0, -1, PHASE_RUNNING)

    def read(self, slot: int) -> Beat:
        return Beat(*_SLOT.unpack_from(self._map, _offset(slot)))

    def close(self, unlink: bool = True) -> None:
        """Unmap and (``unlink``) unlink; safe to call twice."""
        if not self._map.closed:
            self._map.close()
        try:
            if unlink:
                os.unlink(self.path)
        except FileNotFoundError:
            pass


def _offset(slot: int) -> int:
    return _HEADER_SIZE + slot * _SLOT_SIZE


class HeartbeatWriter:
    """The trainer's side: its own slot, mapped once; also fires injected trainer faults."""

    def __init__(self, path: str, slot: int, generation: int, faults: list[tuple[str, int]]) -> None:
        fd = os.open(path, os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, _HEADER_SIZE + (slot + 1) * _SLOT_SIZE)
        finally:
            os.close(fd)
        magic, version, slots = _HEADER.unpack_from(self._map, 0)
        if magic != _MAGIC or version != _VERSION or slot >= slots:
            raise RuntimeError(f"{path} is not an ftrun heartbeat table with slot {slot}")
        self._offset = _offset(slot)
        self._pid = os.getpid()
        self._generation = generation
        self._step = -1
        self._beats = 0
        self._faults = sorted((f for f in faults if f[0] in BEAT_FAULTS), key=lambda f: f[1])
        atexit.register(self._write, PHASE_EXITING)

    @classmethod
    def from_env(cls) -> HeartbeatWriter | None:
        path = os.environ.get(ENV_HEARTBEAT_FILE)
        if not path:
            return None
        return cls(path, int(os.environ[ENV_HEARTBEAT_SLOT]), int(os.environ.get(ENV_GENERATION, "0")),
                   decode_trainer_faults(os.environ.get(ENV_TRAINER_FAULTS, "")))

    def beat(self, step: int | None = None, phase: int = PHASE_RUNNING) -> None:
        """Write this trainer's slot, at ``step`` when given: an integer of the slot's signed 64 bits (else a
        ``TypeError`` or ``ValueError``, and the slot keeps the step before, which the exit's last beat writes)."""
        if step is not None:
            step = operator.index(step)
            if not -STEP_LIMIT <= step < STEP_LIMIT:
                raise ValueError(f"ftrun: step {step} is out of range: a step is a signed 64-bit integer (below "
                                 f"{STEP_LIMIT})")
            self._step = step
        self._write(phase)
        if self._faults and self._step >= self._faults[0][1]:
            self._fire(self._faults.pop(0)[0])

    def exiting(self) -> None:
        """Training is over: until the next :meth:`beat`, the supervisor allows --hang-timeout-initial."""
        self._write(PHASE_EXITING)

    def _write(self, phase: int) -> None:
        self._beats += 1
        _SLOT.pack_into(self._map, self._offset, self._pid, self._step, self._beats, time.monotonic_ns(),
                        self._generation, phase)

    def _fire(self, kind: str) -> None:
        print(f"ftrun: injected {kind} at step {self._step} (pid {self._pid})", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os.kill(self._pid, signal.SIGKILL if kind == "crash" else signal.SIGSTOP)


_UNSET = object()
_writer: HeartbeatWriter | None | object = _UNSET


def heartbeat(step: int | None = None) -> None:
    """Tell the supervisor this trainer is alive (and at ``step``); costs no system call.

    Call it once per training step. Hang detection is armed after the first call. Outside ftrun (no table in
    the environment) it does nothing.
    """
    global _writer
    if _writer is _UNSET:
        _writer = HeartbeatWriter.from_env()
    if _writer is not None:
        _writer.beat(step)  # type: ignore[union-attr]


def restored(step: int) -> None:
    """Beat at ``step``, the snapshot this trainer just loaded: until its next beat, its first step after the restore
    (a ``torch.compile`` again in this new process, warm-ups, data loader workers starting) has --hang-timeout-initial,
    as the first step of the job has, not the hang timeout of a step."""
    global _writer
    if _writer is _UNSET:
        _writer = HeartbeatWriter.from_env()
    if _writer is not None:
        _writer.beat(step, PHASE_RESTORED)  # type: ignore[union-attr]


def training_over() -> None:
    """Tell the supervisor this trainer's training is over (the script returned, or a Snapshotter's ``wait()``
    after its loop), if it ever beat: until its next beat, it has --hang-timeout-initial to finish and exit
    (atexit handlers, an upload, threads still running), not the hang timeout of a training step."""
    if isinstance(_writer, HeartbeatWriter):
        _writer.exiting()
