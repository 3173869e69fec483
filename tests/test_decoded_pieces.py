"""DecodedPieces: a survivor decodes a cell once for every replacement that asks for a piece of it, keeps what
the others will ask for within its budget and for KEPT_FOR seconds, and never serves a piece twice from memory."""

from __future__ import annotations

import threading
import time

import pytest

from ftrun.snapshot import decoded
from ftrun.snapshot.decoded import DecodedPieces

pytestmark = pytest.mark.timeout(30)


def cell(calls: list[int], size: int = 8, pause: float = 0.0):
    def compute() -> dict[int, bytearray]:
        calls.append(1)
        time.sleep(pause)
        return {0: bytearray(b"a" * size), 1: bytearray(b"b" * size)}
    return compute


def test_a_cell_is_computed_once_for_both_wants_and_dropped_once_served():
    pieces, calls = DecodedPieces(1 << 20), []
    assert pieces.take("k", 0, 0, 8, cell(calls)) == b"a" * 8
    assert pieces.take("k", 1, 0, 6, cell(calls)) == b"b" * 6  # kept: the other replacement's, in two requests
    assert pieces.take("k", 1, 6, 2, cell(calls)) == b"b" * 2
    assert calls == [1] and (pieces.computed, pieces.reused) == (1, 2)
    assert pieces.take("k", 1, 0, 8, cell(calls)) == b"b" * 8 and calls == [1, 1]  # served whole: computed anew


def test_replacements_asking_at_once_wait_for_the_one_computing():
    pieces, calls, got = DecodedPieces(1 << 20), [], {}
    threads = [threading.Thread(target=lambda w=w: got.setdefault(w, pieces.take("k", w, 0, 8, cell(calls, 8, 0.2))))
               for w in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert calls == [1] and got == {0: b"a" * 8, 1: b"b" * 8}


def test_nothing_is_kept_past_the_budget_or_for_longer_than_kept_for(monkeypatch):
    pieces, calls = DecodedPieces(20), []
    pieces.take("k1", 0, 0, 8, cell(calls))  # 16 bytes kept
    pieces.take("k2", 0, 0, 8, cell(calls))  # would be 32: not kept
    pieces.take("k2", 1, 0, 8, cell(calls))
    assert len(calls) == 3
    pieces.take("k1", 1, 0, 8, cell(calls))
    assert len(calls) == 3  # k1 was kept
    pieces.take("k3", 0, 0, 8, cell(calls))  # want 1 kept
    monkeypatch.setattr(decoded, "KEPT_FOR", 0.0)
    pieces.take("k4", 0, 0, 8, cell(calls))  # computing a cell expires those kept before
    pieces.take("k3", 1, 0, 8, cell(calls))
    assert len(calls) == 6


def test_a_failed_computation_raises_to_its_caller_and_lets_the_next_compute():
    pieces, calls = DecodedPieces(1 << 20), []

    def fail() -> dict[int, bytearray]:
        raise OSError("peer gone")

    with pytest.raises(OSError, match="peer gone"):
        pieces.take("k", 0, 0, 8, fail)
    assert pieces.take("k", 0, 0, 8, cell(calls)) == b"a" * 8 and calls == [1]
