"""Parity pushed between keepers (m >= 2): what a holder takes into its parity file, what it refuses, and when it
stops waiting. One keeper's :class:`Redundancy` with its real peer server, driven by a real :class:`PeerClient`;
no job (the job-level cases are in test_erasure_recovery)."""

from __future__ import annotations

import json
import os
import socket
import threading
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from isal.isal_zlib import crc32

from ftrun.events import EventLog
from ftrun.snapshot import redundancy
from ftrun.snapshot.erasure import ALIGN
from ftrun.snapshot.redundancy import GroupPlace, Redundancy
from ftrun.snapshot.transport import FRAME, FRAME_MAGIC, PeerClient, PeerError, PeerUnavailable

pytestmark = pytest.mark.timeout(60)

SECRET = b"push-secret-0123456789abcdef"
STEP = 7
PIECE = redundancy.StripeLayout(4, 2).piece_len  # a fragment of CHUNK bytes is two pieces: PIECE, then ALIGN
CHUNK = PIECE + ALIGN
INFOS = {"0": [[4096], [1]], "1": [[4096], [2]], "2": [[4096], [3]], "3": [[4096], [4]]}


@pytest.fixture
def holder(tmp_path) -> Iterator[tuple[Redundancy, bytearray, PeerClient]]:
    """Position 1 of a group of 4 with m = 2, taking pushes of fragment k + 1 of ``STEP`` into ``payload``."""
    keeper = SimpleNamespace(dir=str(tmp_path), job="push", generation=0, cond=threading.Condition(),
                             events=EventLog("keeper 1", None, stream=None), ranks=[])
    listener = socket.create_server(("127.0.0.1", 0))
    red = Redundancy(keeper, GroupPlace(node=1, group=4, parity=2, backend="isa_l_rs_vand"), SECRET, listener)
    red.server.start()
    payload = bytearray(2 * CHUNK)
    expect(red, payload)
    client = PeerClient(*red.server.address, SECRET, timeout=10)
    yield red, payload, client
    client.close()
    red.close()


def expect(red: Redundancy, payload: bytearray) -> None:
    """The holder encodes ``STEP`` into ``payload`` and expects fragment k + 1 pushed."""
    red._fill_incoming(red._open_incoming(STEP, CHUNK, [1]), memoryview(payload))


def put(client: PeerClient, data: bytes, **fields: Any) -> None:
    request = {"step": STEP, "t": 1, "offset": 0, "chunk_len": CHUNK, "crc": crc32(data), **fields}
    client.request("parity_put", payload=data, **request)


def test_pushed_pieces_land_in_the_parity_file_and_count_once_the_sender_ends(holder):
    red, payload, client = holder
    pieces = [(0, PIECE), (PIECE, ALIGN)]
    data = os.urandom(CHUNK)
    for offset, length in pieces:
        put(client, data[offset:offset + length], offset=offset)
    assert bytes(payload[CHUNK:]) == data and bytes(payload[:CHUNK]) == bytes(CHUNK)  # fragment k + 1 at t * L
    client.request("parity_put_end", step=STEP, t=1, infos=INFOS)
    incoming = red._incoming
    assert red._await_pushes(incoming, INFOS, generation=0) == [1]
    assert incoming.crcs[1] == {o: crc32(data[o:o + n]) for o, n in pieces}
    with pytest.raises(PeerError, match="not encoding step"):  # closed: nothing more is taken
        put(client, data[:PIECE])


@pytest.mark.parametrize("fields,why", [
    ({"step": STEP + 1}, "not encoding step 8"),
    ({"t": 0}, "no place for parity 0"),
    ({"t": 2}, "no place for parity 2"),
    ({"chunk_len": CHUNK + ALIGN}, "no place"),
    ({"offset": ALIGN}, "no place"),  # not where a piece starts
    ({"crc": 12345}, "failed its checksum"),
    ({"offset": "zero"}, "ValueError"),
    ({"step": None}, "TypeError"),
])
def test_a_push_with_no_place_is_refused_and_the_holder_keeps_serving(holder, fields, why):
    red, payload, client = holder
    data = os.urandom(PIECE)
    with pytest.raises(PeerError, match=why):
        put(client, data, **fields)
    assert red._incoming is not None and red._incoming.crcs[1] == {}
    put(client, data)  # the same connection, in step
    assert bytes(payload[CHUNK:CHUNK + PIECE]) == data and list(red._incoming.crcs[1]) == [0]
    with pytest.raises(PeerError, match="no place"):  # a piece comes once
        put(client, data)


def test_a_payload_longer_than_a_piece_closes_the_connection(holder):
    red, _, client = holder
    with pytest.raises(PeerUnavailable):
        put(client, bytes(PIECE + ALIGN))
    put(client, os.urandom(PIECE))  # a new connection
    assert list(red._incoming.crcs[1]) == [0]


def test_the_holder_computes_itself_when_pushes_stop_or_the_sender_read_other_data(holder, monkeypatch):
    red, _, client = holder
    monkeypatch.setattr(redundancy, "PUSH_IDLE", 0.2)
    data = os.urandom(CHUNK)
    for offset, length in ((0, PIECE), (PIECE, ALIGN)):
        put(client, data[offset:offset + length], offset=offset)
    other = {**INFOS, "2": [[4096], [99]]}  # the sender read another image of position 2
    client.request("parity_put_end", step=STEP, t=1, infos=other)
    assert red._await_pushes(red._incoming, INFOS, generation=0) == []
    # pieces missing: no end comes, the wait ends after PUSH_IDLE without a piece
    expect(red, bytearray(2 * CHUNK))
    put(client, data[:PIECE])
    assert red._await_pushes(red._incoming, INFOS, generation=0) == []
    # a new generation ends the wait at once (the job lost a node: this step's encode is moot)
    expect(red, bytearray(2 * CHUNK))
    monkeypatch.setattr(redundancy, "PUSH_IDLE", 60.0)
    red.keeper.generation = 1
    assert red._await_pushes(red._incoming, INFOS, generation=0) == []


def test_a_push_waits_while_the_holder_allocates_its_parity_file(holder, monkeypatch):
    """The holder expects pushes before its parity file is allocated (a first encode allocates it): a piece
    that comes meanwhile waits past PUSH_WAIT and lands once the memory is named; if the encode ends instead,
    it is refused."""
    red, _, client = holder
    monkeypatch.setattr(redundancy, "PUSH_WAIT", 0.05)
    with red._pushes:
        red._close_incoming(red._incoming)
    data = os.urandom(PIECE)
    for fill in (True, False):
        incoming = red._open_incoming(STEP, CHUNK, [1])
        payload = bytearray(2 * CHUNK)
        outcome: list[Exception | None] = []
        pusher = threading.Thread(target=lambda: outcome.append(_try(put, client, data)))
        pusher.start()
        pusher.join(0.3)
        assert pusher.is_alive()  # waiting for the memory, past PUSH_WAIT
        if fill:
            red._fill_incoming(incoming, memoryview(payload))
        else:
            with red._pushes:
                red._close_incoming(incoming)
        pusher.join(10)
        if fill:
            assert outcome == [None] and bytes(payload[CHUNK:CHUNK + PIECE]) == data
            with red._pushes:
                red._close_incoming(incoming)
        else:
            assert isinstance(outcome[0], PeerError) and "not encoding step" in str(outcome[0])


def _try(fn: Any, *args: Any) -> Exception | None:
    try:
        fn(*args)
    except Exception as err:  # handed to the test thread
        return err
    return None


def test_a_sender_stopped_mid_piece_does_not_hold_the_holders_encode(tmp_path):
    """A sender stopped (SIGSTOP, a suspended job) halfway through a piece keeps its connection open and sends
    nothing more: after the peer timeout the holder closes that connection, and its encode, which waits for the
    pieces being received before it ends, goes on instead of waiting for the sender forever."""
    keeper = SimpleNamespace(dir=str(tmp_path), job="push", generation=0, cond=threading.Condition(),
                             events=EventLog("keeper 1", None, stream=None), ranks=[])
    red = Redundancy(keeper, GroupPlace(node=1, group=4, parity=2, backend="isa_l_rs_vand"), SECRET,
                     socket.create_server(("127.0.0.1", 0)), peer_timeout=0.5)
    red.server.start()
    expect(red, bytearray(2 * CHUNK))
    stalled = PeerClient(*red.server.address, SECRET)._connect()
    try:
        fields = json.dumps({"op": "parity_put", "step": STEP, "t": 1, "offset": 0, "chunk_len": CHUNK,
                             "crc": 0}).encode()
        stalled.sendall(FRAME.pack(FRAME_MAGIC, len(fields), PIECE) + fields + bytes(PIECE // 2))
        while red._incoming.receiving == 0:
            threading.Event().wait(0.01)
        keeper.generation = 1  # the job moved on: the encode stops waiting for pushes
        encode = threading.Thread(target=red._await_pushes, args=(red._incoming, INFOS, 0), daemon=True)
        encode.start()
        encode.join(30)
        assert not encode.is_alive()
        assert stalled.recv(1) == b""  # the holder closed it
    finally:
        stalled.close()
        red.close()
