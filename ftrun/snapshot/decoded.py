"""Pieces a survivor decoded for a joint rebuild of several lost nodes, kept until their replacement asks.

With two nodes of an EC group lost (m >= 2), both lost chunks of a stripe come from the same k surviving
fragments. A survivor asked for a piece of one (``decode``, :mod:`ftrun.snapshot.redundancy`) fetches those
fragments' bytes once, computes the pieces of every lost chunk of the stripe from them, answers with the one asked
for and keeps the others here for the other replacements, which ask the same survivor for the same cell. So the
stripe's data crosses the survivors' NICs once for all lost nodes, not once per lost node.

Invariants: a cell is computed by one thread at a time (others asking for it meanwhile wait for that result); a
kept piece is dropped once its bytes were all served, or :data:`KEPT_FOR` seconds on (at the next cell computed
or :meth:`DecodedPieces.expire`, which the keeper's encoder calls every step), or never kept when the kept
bytes would pass ``budget`` (a replacement far behind the other then computes its cells again: slower, never
wrong). Nothing here is trusted beyond what the survivor computed itself.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

KEPT_FOR = 30.0  # seconds a decoded piece waits for the replacement that wants it


@dataclass
class _Cell:
    pieces: dict[int, bytearray]  # wanted fragment -> its bytes of the cell
    served: dict[int, int] = field(default_factory=dict)  # wanted fragment -> bytes of it served so far
    born: float = field(default_factory=time.monotonic)


class DecodedPieces:
    """Decoded cells by key (step, stripe, cell, sources, ...: the caller's), at most ``budget`` bytes kept."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self._cells: dict[Hashable, _Cell] = {}
        self._computing: set[Hashable] = set()
        self._kept = 0
        self._cond = threading.Condition()
        self.computed = 0  # cells computed (a kept piece served instead counts in ``reused``)
        self.reused = 0

    def take(self, key: Hashable, want: int, offset: int, length: int,
             compute: Callable[[], dict[int, bytearray]]) -> bytes:
        """Bytes ``[offset, offset + length)`` of fragment ``want``'s piece of cell ``key``: kept, or computed by
        ``compute`` (every wanted fragment's piece of the cell; ``want``'s among them), the others then kept."""
        with self._cond:
            while True:
                cell = self._cells.get(key)
                if cell is not None and want in cell.pieces:
                    self.reused += 1
                    return self._serve(key, cell, want, offset, length)
                if key not in self._computing:
                    self._computing.add(key)
                    break
                self._cond.wait()
        try:
            pieces = compute()
        finally:
            with self._cond:
                self._computing.discard(key)
                self._cond.notify_all()
        with self._cond:
            self.computed += 1
            self._expire()
            cell = _Cell(pieces)
            size = sum(len(p) for p in pieces.values())
            if key not in self._cells and self._kept + size <= self.budget:
                self._cells[key] = cell
                self._kept += size
                return self._serve(key, cell, want, offset, length)
            return bytes(memoryview(pieces[want])[offset:offset + length])

    def expire(self) -> None:
        """Drop the pieces kept for longer than :data:`KEPT_FOR` (their replacement is not coming)."""
        with self._cond:
            self._expire()

    def _serve(self, key: Hashable, cell: _Cell, want: int, offset: int, length: int) -> bytes:
        piece = cell.pieces[want]
        out = bytes(memoryview(piece)[offset:offset + length])
        cell.served[want] = cell.served.get(want, 0) + length
        if cell.served[want] >= len(piece):  # a replacement asks for each byte once
            del cell.pieces[want]
            self._kept -= len(piece)
            if not cell.pieces:
                del self._cells[key]
        return out

    def _expire(self) -> None:
        old = time.monotonic() - KEPT_FOR
        for key in [key for key, cell in self._cells.items() if cell.born < old]:
            self._kept -= sum(len(p) for p in self._cells.pop(key).pieces.values())
