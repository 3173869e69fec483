"""Shared-memory heartbeat table: trainers write, the supervisor of their node reads.

One file per node under /dev/shm (mode 0600, named by job and node rank) holds a header and one 64-byte slot
per local rank::

    header: magic b"FTRUNHB1", version u32, slots u32 (padded to 64 bytes)
    slot:   pid i64, step i64 (-1 before the first step), beats u64, monotonic_ns u64, generation i64,
            phase i64 (0 running, 1 exiting: the script is done and the interpreter is shutting down)

A trainer maps its slot once; every :func:`ftrun.heartbeat` is then a ``struct.pack_into`` on the mapping,
no system call (``time.monotonic_ns`` is served by the vDSO). The supervisor zeroes a slot before it starts
a trainer in it and polls the beat counter; a change of counter is a beat, whatever the clocks say.
Injected trainer faults (:mod:`ftrun.control.faults`) fire here, right after the beat that reaches their step.
"""

from __future__ import annotations

import atexit
import json
import mmap
import os
import signal
import struct
import sys
import time
from collections import deque
from dataclasses import asdict, dataclass

from ftrun.control.faults import ENV_TRAINER_FAULTS, decode_trainer_faults

ENV_HEARTBEAT_FILE = "FTRUN_HEARTBEAT_FILE"
ENV_HEARTBEAT_SLOT = "FTRUN_HEARTBEAT_SLOT"
ENV_GENERATION = "TORCHELASTIC_RESTART_COUNT"

BEAT_FAULTS = ("crash", "hang")  # the injected faults that fire at a heartbeat

PHASE_RUNNING = 0
PHASE_EXITING = 1

_MAGIC = b"FTRUNHB1"
_VERSION = 1
_HEADER = struct.Struct("<8sII")
_HEADER_SIZE = 64
_SLOT = struct.Struct("<qqQQqq")
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
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
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

    def close(self) -> None:
        """Unmap and unlink; safe to call twice."""
        if not self._map.closed:
            self._map.close()
        try:
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

    def beat(self, step: int | None = None) -> None:
        if step is not None:
            self._step = step
        self._write(PHASE_RUNNING)
        if self._faults and self._step >= self._faults[0][1]:
            self._fire(self._faults.pop(0)[0])

    def _write(self, phase: int) -> None:
        self._beats += 1
        _SLOT.pack_into(self._map, self._offset, self._pid, self._step, self._beats, time.monotonic_ns(),
                        self._generation, phase)

    def _fire(self, kind: str) -> None:
        print(f"ftrun: injected {kind} at step {self._step} (pid {self._pid})", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os.kill(self._pid, signal.SIGKILL if kind == "crash" else signal.SIGSTOP)


class HangDetector:
    """Decides when one trainer slot counts as hung.

    Detection is armed once the slot has beaten in any generation of the job (a script that never beats gets
    crash detection only). Until the first beat of the current trainer, and once it reports that it is
    exiting, the allowance is ``initial`` seconds from its start (or from its exit); otherwise it is
    ``max(floor, factor * slowest of the recent step intervals)`` from the last beat, or ``initial`` while no
    step interval has been seen yet. Step intervals survive restarts.
    """

    def __init__(self, initial: float, floor: float, factor: float, window: int = 20) -> None:
        self.exiting = False
        self.initial = initial
        self.floor = floor
        self.factor = factor
        self.armed = False
        self._intervals: deque[float] = deque(maxlen=window)
        self._beats = 0
        self._since = 0.0
        self._seen_this_trainer = False
        self._step = -1
        self._step_ns = 0

    def trainer_started(self, now: float) -> None:
        self._beats = 0
        self._since = now
        self._seen_this_trainer = False
        self.exiting = False
        self._step = -1
        self._step_ns = 0

    @property
    def steps_per_second(self) -> float | None:
        """From the recent step intervals (None before two steps)."""
        recent = list(self._intervals)[-5:]
        return len(recent) / sum(recent) if recent and sum(recent) > 0 else None

    @property
    def timeout(self) -> float:
        if not self._seen_this_trainer or self.exiting or not self._intervals:
            return self.initial
        return max(self.floor, self.factor * max(self._intervals))

    @property
    def step(self) -> int:
        """The step of the last beat seen (-1: none)."""
        return self._step

    def silence(self, now: float) -> float:
        """Seconds since this trainer's last beat was seen (since its start before the first)."""
        return now - self._since

    def observe(self, beat: Beat, now: float) -> str | None:
        """Feed the latest slot contents; returns why the trainer is hung, or None."""
        if beat.beats != self._beats:
            self._beats = beat.beats
            self._since = now
            self._seen_this_trainer = True
            self.exiting = beat.phase == PHASE_EXITING
            self.armed = True
            if beat.step != self._step:
                if self._step_ns:
                    self._intervals.append((beat.monotonic_ns - self._step_ns) / 1e9)
                self._step, self._step_ns = beat.step, beat.monotonic_ns
            return None
        if not self.armed or now - self._since <= self.timeout:
            return None
        return self.describe(now)

    def describe(self, now: float) -> str:
        """How long the trainer has been silent, against its timeout."""
        what = ("still exiting" if self.exiting else "no heartbeat" if self._seen_this_trainer
                else "no first heartbeat")
        return f"{what} for {now - self._since:.1f}s (timeout {self.timeout:.1f}s, last step {self._step})"


# How a silent trainer's process looks (:func:`process_state`); a lower value is more likely the cause of a hang.
STOPPED = 0  # stopped by a signal (SIGSTOP) or a debugger: it cannot be waiting for anyone
BUSY = 1  # running, sleeping, or in I/O: not waiting on a futex
WAITING = 2  # its main thread waits on a futex, as a rank blocked in a collective does (gloo)
_STATE_WORDS = {STOPPED: "stopped by a signal", BUSY: "", WAITING: "waiting"}


def process_state(pid: int) -> int:
    """:data:`STOPPED`, :data:`WAITING` or :data:`BUSY` (also when /proc cannot tell) for the process ``pid``."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rpartition(")")[2].split()[0]
        if state in ("T", "t"):
            return STOPPED
        with open(f"/proc/{pid}/wchan") as f:
            return WAITING if "futex" in f.read() else BUSY
    except (OSError, IndexError):
        return BUSY


@dataclass(frozen=True)
class HangSuspect:
    """A silent trainer as its node reports it when a hang is being attributed (see :func:`culprit`)."""

    rank: int
    node: int
    state: int  # STOPPED, BUSY or WAITING
    step: int  # of its last beat
    last_beat: float  # wall-clock time of its last beat (from the trainer's own monotonic clock)
    reason: str  # "no heartbeat for 2.1s (timeout 2.0s, last step 20)"

    @staticmethod
    def encode_all(suspects: list[HangSuspect]) -> str:
        return json.dumps([asdict(s) for s in suspects])

    @classmethod
    def decode_all(cls, raw: str) -> list[HangSuspect]:
        """The suspects of one node (none from a value that does not parse)."""
        try:
            return [cls(**doc) for doc in json.loads(raw)]
        except (ValueError, TypeError):
            return []

    def describe(self) -> str:
        word = _STATE_WORDS.get(self.state, "")
        return f"{self.reason}{', ' + word if word else ''}"


def culprit(suspects: list[HangSuspect]) -> HangSuspect:
    """The trainer that stopped first, among the silent ones of the whole job.

    When one rank stops, its peers block in their next collective and fall silent too, at the same step and
    within milliseconds of its last beat: the beats alone cannot tell them apart. So, in order: a process stopped
    by a signal; then one that is not waiting on a futex (a rank waiting in a gloo collective is); then the lowest
    step; then the oldest last beat; then the lowest rank, so that every node that decides picks the same one."""
    return min(suspects, key=lambda s: (s.state, s.step, s.last_beat, s.rank))
