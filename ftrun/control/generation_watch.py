"""Tells a supervisor the moment its job's generation moves, so that it need not read ``gen`` 50 times a second.

Every move of the generation, a failure's or a stop's, writes ``history/<g+1>`` right after its compare-and-set
on ``gen`` (:meth:`~ftrun.control.coordination.Coordinator.bump`). The watch blocks on a connection of its own
to the control store until that key is set (a TCPStore ``wait``: the server answers at once, nothing polls),
sets :attr:`GenerationWatch.moved`, and waits for the next one.

Invariant: the watch only says when to look. The reader still reads ``gen`` itself (authenticated, replays
ignored), and still reads it now and then without being told: a forged ``history`` key costs one early read; a
move whose ``history`` key was never written (its writer died between its two writes) is seen at the reader's
next read of its own. Only the c10d store has such a wait; an etcd job's supervisors read ``gen`` at its poll
interval, as before.

:attr:`GenerationWatch.moved` is a :class:`Wakeup`: an event with a descriptor, so that a reader can wait for a
move and for other things (its trainers' exits) in one ``select``.

The thread cannot be interrupted in its wait: it is a daemon and ends with its process (supervisors end with
``os._exit``), or when the store is gone (:attr:`GenerationWatch.lost`, and :attr:`moved` set: the reader's
own read then meets the error).
"""

from __future__ import annotations

import os
import select
import threading

from torch.distributed import DistError

from ftrun.control.coordination import Coordinator
from ftrun.control.store import C10dStore


class Wakeup:
    """An event that is a descriptor: a pipe that holds a byte while it is set, so that :meth:`fileno` can join
    other descriptors in a ``select``. Set by one thread, cleared and waited for by another; a set after a clear
    is never lost (it writes after the clear drained)."""

    def __init__(self) -> None:
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        os.set_blocking(self._write, False)

    def fileno(self) -> int:
        return self._read

    def set(self) -> None:
        try:
            os.write(self._write, b"!")
        except BlockingIOError:  # the pipe is full: set many times over
            pass

    def clear(self) -> None:
        try:
            while os.read(self._read, 4096):
                pass
        except BlockingIOError:
            pass

    def wait(self, timeout: float | None = None) -> bool:
        """Whether it is set, waiting up to ``timeout`` seconds for it (None: for ever)."""
        return bool(select.select([self._read], [], [], timeout)[0])

    def is_set(self) -> bool:
        return self.wait(0)


class GenerationWatch:
    """Sets :attr:`moved` each time a generation after ``after`` is written; the reader clears it, then reads.
    ``store``: a connection that nothing else uses."""

    def __init__(self, store: C10dStore, coord: Coordinator, after: int) -> None:
        self.moved = Wakeup()
        self.lost = False
        self._store = store
        self._coord = coord
        self._next = after + 1
        self._thread = threading.Thread(target=self._run, name="ftrun-gen-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                self._store.wait(self._coord.key("history", self._next))
            except DistError:
                self.lost = True
                self.moved.set()
                return
            self._next += 1
            self.moved.set()
