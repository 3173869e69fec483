"""Hang detection: when a trainer's heartbeat slot (:mod:`ftrun.control.heartbeat`) counts as hung, and which
silent trainer of a job most likely caused a hang (a trainer stopped by a signal before one waiting in a
collective).
"""

from __future__ import annotations

import json
from collections import deque
from dataclasses import asdict, dataclass

from ftrun.control.heartbeat import PHASE_EXITING, PHASE_RESTORED, PHASE_RUNNING, Beat


class HangDetector:
    """Decides when one trainer slot counts as hung.

    Detection is armed once the slot has beaten in any generation of the job (a script that never beats gets
    crash detection only). Until the first beat of the current trainer, from a beat that reports a restore to the
    next (the first step after it compiles and warms up again, as the job's first step), and once it reports that
    it is exiting, the allowance is ``initial`` seconds from its start (or from that beat); otherwise it is
    ``max(floor, factor * slowest of the recent step intervals)`` from the last beat, or ``initial`` while no
    step interval has been seen yet. Step intervals survive restarts; the first step after a restore is not one. A
    step interval is the time between two looks' new steps, several steps apart when the trainer steps faster than
    the looks come: the timeout then allows for the whole span, and :attr:`steps_per_second` divides the steps by
    it.
    """

    def __init__(self, initial: float, floor: float, factor: float, window: int = 20) -> None:
        self.phase = PHASE_RUNNING  # of the last beat seen
        self.initial = initial
        self.floor = floor
        self.factor = factor
        self.armed = False
        self._intervals: deque[float] = deque(maxlen=window)
        self._advances: deque[int] = deque(maxlen=window)  # the steps each of _intervals spans
        self._beats = 0
        self._since = 0.0
        self._seen_this_trainer = False
        self._step = -1
        self._step_ns = 0

    def trainer_started(self, now: float) -> None:
        self._beats = 0
        self._since = now
        self._seen_this_trainer = False
        self.phase = PHASE_RUNNING
        self._step = -1
        self._step_ns = 0

    @property
    def steps_per_second(self) -> float | None:
        """From the recent step intervals (None before two steps)."""
        seconds = sum(list(self._intervals)[-5:])
        return sum(list(self._advances)[-5:]) / seconds if seconds > 0 else None

    @property
    def timeout(self) -> float:
        if not self._seen_this_trainer or self.phase != PHASE_RUNNING or not self._intervals:
            return self.initial
        return max(self.floor, self.factor * max(self._intervals))

    @property
    def deadline(self) -> float:
        """When the trainer counts as hung if no beat is seen before (on the clock of :meth:`observe`'s ``now``),
        once detection is :attr:`armed`."""
        return self._since + self.timeout

    @property
    def step(self) -> int:
        """The step of the last beat seen (-1: none)."""
        return self._step

    def silence(self, now: float) -> float:
        """Seconds since this trainer's last beat was seen (since its start before the first)."""
        return now - self._since

    def suspect(self, now: float) -> bool:
        """Whether this trainer counts as a suspect when a hang is attributed: armed and silent for half its
        timeout or more, the floor standing for ``initial`` while it beats with no step interval seen yet (a
        trainer stopped within its first steps, before two looks saw it step, must not be left out: its peers,
        blocked on it, would be blamed instead)."""
        unknown = self._seen_this_trainer and self.phase != PHASE_EXITING and not self._intervals
        return self.armed and self.silence(now) >= (self.floor if unknown else self.timeout) / 2

    def observe(self, beat: Beat, now: float) -> str | None:
        """Feed the latest slot contents; returns why the trainer is hung, or None."""
        if beat.beats != self._beats:
            self._beats = beat.beats
            self._since = now
            self._seen_this_trainer = True
            self.phase = beat.phase
            self.armed = True
            if beat.step != self._step:
                if self._step_ns:
                    self._intervals.append((beat.monotonic_ns - self._step_ns) / 1e9)
                    self._advances.append(max(1, beat.step - self._step))  # a step that went back counts one
                self._step, self._step_ns = beat.step, beat.monotonic_ns
            if self.phase == PHASE_RESTORED:  # the first step after a restore is no step interval, as the job's first
                self._step_ns = 0
            return None
        if not self.armed or now - self._since <= self.timeout:
            return None
        return self.describe(now)

    def describe(self, now: float) -> str:
        """How long the trainer has been silent, against its timeout."""
        if self.phase == PHASE_EXITING:
            what = "no heartbeat since its training was over (its script returned, or a Snapshotter's wait())"
        elif self.phase == PHASE_RESTORED:
            what = "no heartbeat since its restore"
        else:
            what = "no heartbeat" if self._seen_this_trainer else "no first heartbeat"
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
