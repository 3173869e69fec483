"""Relayed rebuilds (XOR parity): a replacement's keeper receives each byte of its blob once, summed along a chain
of the survivors, bit for bit what a direct rebuild gives; a corrupt or refused relay falls back to the direct
rebuild, which checks every parity piece. Real keepers of one EC group in this process, with real slot files
and real TCP between them; no job (the job-level cases are in test_erasure_recovery)."""

from __future__ import annotations

import dataclasses
import os
import socket
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from ftrun.events import read_events
from ftrun.snapshot.erasure import ALIGN, StripeLayout
from ftrun.snapshot import redundancy
from ftrun.snapshot.keeper import MIN_PEER_TIMEOUT, Keeper, peer_timeout
from ftrun.snapshot.protocol import PEER_LOST
from ftrun.snapshot.slot import HEADER_SIZE, checksum
from ftrun.snapshot.transport import PeerClient, PeerError
from test_slots import shm, spec, write_snapshot  # noqa: F401 - shm: the fixture

pytestmark = pytest.mark.timeout(60)

STEP = 10
PIECE = 16 * ALIGN  # small coding pieces, so a chunk has several and a segment can end inside one
RELAY_PART = 5 * ALIGN  # relayed requests of terms that start and end inside pieces
RELAY_PART_NIC = 3 * ALIGN  # likewise, of XOR chains
SIZES = (5 * PIECE + 123, 2 * PIECE + 7)  # payload bytes of local ranks 0 and 1 (the blob spans two slot files)


class Group:
    """The keepers of one EC group of ``group`` nodes with ``parity`` parity, each holding ``STEP`` with its
    parity; a lost node's replacement rebuilds it (:meth:`rebuild`). Events go to ``log_dir``."""

    def __init__(self, group: int, parity: int, log_dir: str, one_host: bool = False) -> None:
        self.group, self.parity, self.log_dir, self.one_host = group, parity, log_dir, one_host
        self.secret = os.urandom(32)
        self.peers: dict[str, str] = {}
        self.keepers = {node: self.start(node) for node in range(group)}
        self.payloads: dict[tuple[int, int], bytes] = {}
        for node, keeper in self.keepers.items():
            keeper.handle({"op": "poll", "generation": 0, "plan": 0, "restorable": 0, "peers": self.peers})
            for rank, size in enumerate(SIZES):
                payload = self.payloads[node, rank] = os.urandom(size + 512 * node)  # blobs of other lengths
                reply = keeper.handle({"op": "reserve", "rank": rank, "step": STEP, "generation": 0,
                                       "size": len(payload)})
                slot = keeper.ranks[rank].files[reply["slot"]]
                write_snapshot(slot, STEP, payload)
                keeper.handle({"op": "commit", "rank": rank, "slot": reply["slot"], "step": STEP})
                slot.seal(checksum(slot.map, slot.header()))
        encoders = [threading.Thread(target=k.redundancy.encode, args=(STEP, 0, 0, lambda: None))
                    for k in self.keepers.values()]  # together: with m = 2 a position pushes to the others
        for thread in encoders:
            thread.start()
        for thread in encoders:
            thread.join()
        assert all(STEP in k.redundancy.steps for k in self.keepers.values())

    def start(self, node: int) -> Keeper:
        keeper = Keeper(dataclasses.replace(spec(len(SIZES)), nnodes=self.group, node_rank=node,
                                            ec_group=self.group, ec_parity=self.parity, log_dir=self.log_dir), [])
        host = "127.0.0.1" if self.one_host else f"127.0.0.{node + 1}"  # a loopback address per simulated host
        keeper.enable_redundancy(self.secret, socket.create_server((host, 0)))
        red = keeper.redundancy
        red.layout = StripeLayout(self.group, self.parity, PIECE)
        red.server.start()
        host, port = red.server.address
        self.peers[str(node)] = f"{host}:{port}"
        return keeper

    def lose(self, node: int) -> None:
        self.close(self.keepers.pop(node))

    def rebuild(self, node: int, received: list[int] | None = None, complete: list[int] | None = None
                ) -> dict[str, Any]:
        """``node``'s replacement rebuilds ``STEP`` from ``complete`` (default: every other node); the length of
        every fetch it makes from a peer goes into ``received``."""
        keeper = self.keepers[node] = self.start(node)
        if received is not None:
            fetch = keeper.redundancy._fetch_into

            def counted(peer: int, op: str, into: memoryview, **fields: Any) -> None:
                received.append(len(into))
                fetch(peer, op, into, **fields)

            keeper.redundancy._fetch_into = counted
        complete = sorted(set(self.keepers) - {node}) if complete is None else complete
        for other in self.keepers.values():  # as every link tells its keeper (replacements have new addresses)
            other.redundancy.peers = {int(n): address for n, address in self.peers.items()}
        return keeper.handle({"op": "rebuild", "generation": 1, "step": STEP, "complete": complete,
                              "peers": self.peers})

    def blob(self, node: int) -> int:
        return sum(HEADER_SIZE + len(self.payloads[node, rank]) for rank in range(len(SIZES)))

    def holds(self, node: int) -> bool:
        """Whether ``node``'s keeper holds ``STEP`` in every rank, bit for bit the payload written, verified."""
        keeper = self.keepers[node]
        for rank, _ in enumerate(SIZES):
            index = keeper.ranks[rank].index_of(STEP)
            if index is None:
                return False
            slot = keeper.ranks[rank].files[index]
            payload = self.payloads[node, rank]
            if bytes(slot.payload()[:len(payload)]) != payload or slot.verify() is not None:
                return False
        return True

    def events(self, name: str) -> list[dict[str, Any]]:
        return [e for e in read_events(self.log_dir) if e["event"] == name]

    @staticmethod
    def close(keeper: Keeper) -> None:
        keeper.stop()
        keeper.redundancy.close()
        keeper.unlink_all()

    def close_all(self) -> None:
        for keeper in self.keepers.values():
            self.close(keeper)


@pytest.fixture
def make_group(shm, tmp_path, monkeypatch) -> Iterator[Any]:
    monkeypatch.setattr(redundancy, "RELAY_PART", RELAY_PART)
    monkeypatch.setattr(redundancy, "RELAY_PART_NIC", RELAY_PART_NIC)
    groups: list[Group] = []

    def make(group: int, parity: int, one_host: bool = False) -> Group:
        groups.append(Group(group, parity, str(tmp_path / f"logs{len(groups)}"), one_host))
        return groups[-1]

    yield make
    for group in groups:
        group.close_all()


@pytest.mark.parametrize("shape,lost", [((3, 1), 0), ((3, 1), 1), ((3, 1), 2), ((4, 1), 3), ((4, 2), 1)],
                         ids=["k2-node0", "k2-node1", "k2-node2", "k3", "k2m2-one-lost"])
def test_a_relayed_rebuild_is_bit_exact_and_receives_each_byte_once(make_group, shape, lost):
    group = make_group(*shape)
    group.lose(lost)
    received: list[int] = []
    reply = group.rebuild(lost, received)
    assert reply.get("bytes") == group.blob(lost), reply
    assert group.keepers[lost].redundancy.relayed and group.holds(lost)
    assert not group.keepers[lost].redundancy.decoded  # one lost: summed along chains
    assert sum(received) == group.blob(lost)  # the bytes past the blob (zeros) are never fetched
    assert [e["relayed"] for e in group.events("rebuilt")] == [True]
    assert not group.events("rebuild_relay_failed")


@pytest.mark.parametrize("one_host", [False, True], ids=["relayed", "direct"])
@pytest.mark.parametrize("shape,lost", [((3, 1), 1), ((6, 2), 2)], ids=["k2", "k4m2"])
def test_survivors_serve_a_rebuild_at_normal_priority_though_they_served_encoders_at_idle(make_group, shape, lost,
                                                                                         one_host):
    """Encoding is background work: a thread serving an encoder's fetch runs in SCHED_IDLE from then on. A rebuild
    is not: its requests, the survivors' relayed fetches among them, go over connections of their own, so no
    survivor serves them on a thread an encoder lowered (which waits for every idle core)."""
    group = make_group(*shape, one_host=one_host)
    policies: list[int] = []
    for keeper in group.keepers.values():
        def record(step: int, serving: Any = keeper.redundancy.serving_rebuild) -> None:
            policies.append(os.sched_getscheduler(0))  # the serving thread's policy (Linux: 0 = this thread)
            serving(step)

        keeper.redundancy.serving_rebuild = record
    group.lose(lost)
    reply = group.rebuild(lost)
    assert reply.get("bytes") == group.blob(lost) and group.holds(lost), reply
    assert group.keepers[lost].redundancy.relayed is not one_host
    assert policies and os.SCHED_IDLE not in policies, policies


def test_a_relay_that_fails_falls_back_to_the_direct_rebuild(make_group, monkeypatch):
    group = make_group(3, 1)
    group.lose(1)

    def refuse(step: int, request: dict[str, Any]) -> bytearray:
        raise OSError("the relay broke down")

    monkeypatch.setattr(group.keepers[2].redundancy, "_relay", refuse)
    received: list[int] = []
    assert group.rebuild(1, received).get("bytes") == group.blob(1)
    assert not group.keepers[1].redundancy.relayed and group.holds(1)
    assert sum(received) >= 2 * group.blob(1)  # k = 2: every fragment fetched here, then XORed
    fell = group.events("rebuild_relay_failed")
    assert len(fell) == 1 and "the relay broke down" in fell[0]["message"], fell
    assert [e["relayed"] for e in group.events("rebuilt")] == [False]


def test_survivors_restarted_during_a_rebuild_relay_to_the_holders_the_request_names(make_group):
    """Survivors whose keepers were restarted (by their supervisors) know no peer's address until their links tell
    them again, which may come after the rebuild's next request: the relay requests name the holders down the
    chain, so the relayed rebuild goes on instead of failing as if a survivor were lost."""
    group = make_group(3, 1)
    group.lose(1)
    keeper = group.keepers[1] = group.start(1)
    for node in (0, 2):
        group.keepers[node].redundancy.peers = {}
    reply = keeper.handle({"op": "rebuild", "generation": 1, "step": STEP, "complete": [0, 2], "peers": group.peers})
    assert reply.get("bytes") == group.blob(1), reply
    assert keeper.redundancy.relayed and group.holds(1)


def test_a_relay_answer_of_another_length_is_a_wrong_answer_not_a_lost_survivor(make_group, monkeypatch):
    """A survivor whose relay answers with more bytes than asked is refused from the reply's header: the rebuild
    falls back to the direct one at once, not to waiting for the survivor's loss as if it had not answered."""
    group = make_group(3, 1)
    group.lose(1)

    def longer(step: int, request: dict[str, Any]) -> bytearray:
        return bytearray(int(request["length"]) + 1)

    monkeypatch.setattr(group.keepers[2].redundancy, "_relay", longer)
    assert group.rebuild(1).get("bytes") == group.blob(1)
    assert group.holds(1) and not group.events("rebuild_failed")
    fell = group.events("rebuild_relay_failed")
    assert len(fell) == 1 and "bytes to a request for" in fell[0]["message"], fell


@pytest.mark.parametrize("shape,lost", [((4, 2), (1, 2)), ((5, 2), (0, 3)), ((4, 2), (0, 1))])
def test_two_lost_of_two_parity_are_relayed_as_pyeclibs_terms_and_receive_each_byte_once(make_group, shape, lost):
    """With two of a stripe's fragments lost, a chunk is not an XOR of survivors: each holder of its chain adds
    its fragment's term of the reconstruction (pyeclib), and the replacement still receives only its blob."""
    group = make_group(*shape)
    for node in lost:
        group.lose(node)
    survivors = sorted(set(range(shape[0])) - set(lost))
    for node in lost:  # both from the survivors, as in the generation after the loss
        received: list[int] = []
        assert "error" not in group.rebuild(node, received, complete=survivors)
        assert group.keepers[node].redundancy.relayed and group.holds(node)
        assert sum(received) == group.blob(node)
    assert not group.events("rebuild_relay_failed"), group.events("rebuild_relay_failed")


def test_every_survivor_on_one_host_is_a_direct_rebuild(make_group):
    """With no NIC in the way, k fragments fetched and reconstructed once cost less than a term at every holder, and
    fetching them costs less than an XOR chain whose hops are CPU copies too (Redundancy._on_this_host)."""
    group = make_group(4, 2, one_host=True)
    for node in (1, 2):
        group.lose(node)
    for node in (1, 2):
        received: list[int] = []
        assert "error" not in group.rebuild(node, received, complete=[0, 3])
        assert not group.keepers[node].redundancy.relayed and group.holds(node)
        assert sum(received) >= 2 * group.blob(node)  # k = 2 fragments per byte
    xor = make_group(3, 1, one_host=True)
    xor.lose(1)
    received: list[int] = []
    assert "error" not in xor.rebuild(1, received) and not xor.keepers[1].redundancy.relayed and xor.holds(1)
    assert sum(received) >= 2 * xor.blob(1)
    assert [e["relayed"] for e in xor.events("rebuilt")] == [False] and not xor.events("rebuild_relay_failed")


@pytest.mark.parametrize("shape,lost,part", [((3, 1), (1,), RELAY_PART_NIC), ((4, 2), (1, 2), RELAY_PART)],
                         ids=["xor", "terms"])
def test_relayed_parts_are_small_for_xor_and_large_for_terms(make_group, monkeypatch, shape, lost, part):
    """Small parts keep every link of an XOR chain busy; terms, computed per part at every hop, take larger ones
    (see RELAY_PART)."""
    group = make_group(*shape)
    for node in lost:
        group.lose(node)
    survivors = sorted(set(range(shape[0])) - set(lost))
    lengths: list[int] = []
    for node in survivors:
        relay = group.keepers[node].redundancy._relay

        def spy(step: int, request: dict[str, Any], relay: Any = relay) -> bytearray:
            lengths.append(int(request["length"]))
            return relay(step, request)

        monkeypatch.setattr(group.keepers[node].redundancy, "_relay", spy)
    assert "error" not in group.rebuild(lost[0], complete=survivors)
    assert group.keepers[lost[0]].redundancy.relayed and group.holds(lost[0])
    assert max(lengths) == part, lengths


@pytest.mark.parametrize("shape,lost,t", [((3, 1), (1,), 0), ((4, 2), (1, 2), 1)])
def test_a_corrupt_parity_piece_stops_the_relay_and_the_direct_rebuild_names_it(make_group, shape, lost, t):
    """Node 0 holds parity fragment k + t of the stripe of node 1's chunk 0: XOR parity (m = 1), or with two
    lost, a term of the reconstruction."""
    group = make_group(*shape)
    for node in lost:
        group.lose(node)
    parity = group.keepers[0].redundancy
    assert parity.layout.parity_stripes(0)[t] == parity.layout.chunk_stripe(1, 0)
    file = parity.files[parity.steps.index(STEP)]
    chunk_len = file.header().data_len // shape[1]
    file.map[HEADER_SIZE + t * chunk_len + HEADER_SIZE + 100] ^= 0x01  # of the tensor bytes of node 1's rank 0
    reply = group.rebuild(1, complete=sorted(set(range(shape[0])) - set(lost)))
    assert "fails its checksum" in reply.get("error", ""), reply
    assert group.keepers[1].ranks[0].index_of(STEP) is None  # nothing corrupt is held
    fell = group.events("rebuild_relay_failed")
    assert len(fell) == 1 and "fails its checksum" in fell[0]["message"], fell


def test_a_relay_refuses_requests_for_other_fragments_or_bytes_and_keeps_serving(make_group):
    group = make_group(3, 1)
    host, _, port = group.peers["0"].rpartition(":")
    client = PeerClient(host, int(port), group.secret, timeout=10)
    layout = StripeLayout(3, 1, PIECE)
    mine = next(i for i in range(3) if layout.position(0, i) == 0)  # node 0's fragment of stripe 0
    other = next(i for i in range(3) if layout.position(0, i) != 0)
    good = {"step": STEP, "stripe": 0, "chunk_len": 4 * PIECE, "offset": 0, "length": ALIGN, "rebuild": True}
    for fields in ({"parts": [other, mine]}, {"parts": [mine]}, {"parts": [mine, mine]}, {"parts": [mine, 3]},
                   {"parts": [mine, other], "length": RELAY_PART + ALIGN}, {"parts": [mine, other], "offset": -ALIGN},
                   {"parts": [mine, other], "offset": 4 * PIECE}, {"parts": [mine, other], "stripe": 3}):
        with pytest.raises(PeerError, match="bad xor request"):
            client.request("xor", into=memoryview(bytearray(ALIGN)), **{**good, **fields})
    _, got = client.request("xor", into=memoryview(bytearray(ALIGN)), **{**good, "parts": [mine, other]})
    assert got == ALIGN
    want = next(i for i in range(2) if i != mine)  # a data fragment that is not node 0's: the others are terms
    terms = {"want": want, "sources": [i for i in range(3) if i != want], "parts": [mine]}
    for fields in ({"sources": [mine]}, {"sources": [want, mine]}, {"want": 2}, {"want": mine},
                   {"sources": [mine, 7]}, {"sources": [mine, mine]}, {"parts": [mine, want]}, {"parts": []}):
        with pytest.raises(PeerError, match="bad xor request"):
            client.request("xor", into=memoryview(bytearray(ALIGN)), **{**good, **terms, **fields})
    _, got = client.request("xor", into=memoryview(bytearray(ALIGN)), **{**good, **terms})
    assert got == ALIGN
    client.close()


def test_a_survivor_that_does_not_answer_a_relay_is_lost_without_a_direct_retry(make_group):
    """Node 2 stops serving while node 0's replacement rebuilds: whether the replacement asks it itself or node 1
    relays to it, the rebuild fails as a lost survivor (the link plans without it), and no direct rebuild spends
    a second timeout on it."""
    group = make_group(3, 1)
    group.lose(0)
    group.keepers[2].redundancy.server.close()
    reply = group.rebuild(0)
    assert PEER_LOST in reply.get("error", ""), reply
    assert [e.get("peer_lost") for e in group.events("rebuild_failed")] == [True]
    assert not group.events("rebuild_relay_failed")


def test_a_keeper_waits_on_a_silent_peer_for_the_node_timeout(shm):
    assert peer_timeout(1.0) == MIN_PEER_TIMEOUT and peer_timeout(30.0) == 30.0
    keeper = Keeper(dataclasses.replace(spec(1), nnodes=2, ec_group=2, ec_parity=1, node_timeout=8.0), [])
    keeper.enable_redundancy(os.urandom(32), socket.create_server(("127.0.0.1", 0)))
    try:
        assert keeper.redundancy.peer_timeout == 8.0
        keeper.redundancy.peers = {1: "127.0.0.1:9"}
        assert keeper.redundancy._connections.timeout == 8.0
    finally:
        keeper.redundancy.close()
        keeper.unlink_all()


@pytest.mark.parametrize("shape,lost", [((4, 2), (1, 2)), ((6, 2), (1, 2)), ((6, 2), (0, 3))])
@pytest.mark.parametrize("budget", [redundancy.DECODED_BUDGET, 0], ids=["kept", "nothing-kept"])
def test_two_lost_chunks_of_a_stripe_are_decoded_once_for_both_replacements(make_group, monkeypatch, shape, lost,
                                                                             budget):
    """Where both lost nodes hold data of a stripe, a survivor decodes each cell of it once for both: the second
    replacement is answered with what the first one's request decoded (``decode``; redundancy's module doc). With
    no room to keep a decoded piece, each replacement's request decodes its cell again: bit for bit the same."""
    monkeypatch.setattr(redundancy, "DECODED_BUDGET", budget)
    group = make_group(*shape)
    for node in lost:
        group.lose(node)
    survivors = sorted(set(range(shape[0])) - set(lost))
    asked: list[tuple[Any, ...]] = []
    for node in survivors:
        decode = group.keepers[node].redundancy._decode

        def spy(step: int, request: dict[str, Any], decode: Any = decode, node: int = node) -> bytes:
            start = int(request["offset"]) - int(request["offset"]) % RELAY_PART
            asked.append((node, request["stripe"], start, int(request["want"])))
            return decode(step, request)

        monkeypatch.setattr(group.keepers[node].redundancy, "_decode", spy)
    for node in lost:
        received: list[int] = []
        assert "error" not in group.rebuild(node, received, complete=survivors)
        assert group.keepers[node].redundancy.relayed and group.keepers[node].redundancy.decoded
        assert group.holds(node) and sum(received) == group.blob(node)
    assert not group.events("rebuild_relay_failed"), group.events("rebuild_relay_failed")
    assert [e["decoded"] for e in group.events("rebuilt")] == [True, True]
    wants: dict[tuple[Any, ...], set[int]] = {}
    for *cell, want in asked:
        wants.setdefault(tuple(cell), set()).add(want)
    by_both = [cell for cell, wanted in wants.items() if len(wanted) == 2]
    assert by_both, asked  # the shape has stripes with both lost nodes' data
    computed = sum(group.keepers[node].redundancy._decoded.computed for node in survivors)
    assert computed == (len(asked) if budget == 0 else len(wants))  # every request, or every cell once


def test_a_decode_refuses_requests_for_other_fragments_or_bytes_and_keeps_serving(make_group):
    group = make_group(4, 2)
    host, _, port = group.peers["0"].rpartition(":")
    client = PeerClient(host, int(port), group.secret, timeout=10)
    layout = StripeLayout(4, 2, PIECE)
    stripe = next(s for s in range(4) if layout.position(s, 2) == 0)  # node 0 holds parity fragment 2 of it
    good = {"step": STEP, "stripe": stripe, "chunk_len": 4 * PIECE, "offset": 0, "length": ALIGN, "rebuild": True,
            "want": 0, "sources": [2, 3], "others": [1]}  # both data fragments from both parity fragments
    for fields in ({"sources": [1, 3]}, {"sources": [2]}, {"sources": [2, 2]}, {"sources": [2, 3, 1]},
                   {"sources": [2, 7]}, {"want": 1}, {"want": 2}, {"others": [0]}, {"others": [3]},
                   {"others": [1, 1]}, {"others": [1, 5]}, {"length": RELAY_PART + ALIGN},
                   {"offset": RELAY_PART - ALIGN, "length": 2 * ALIGN}, {"offset": -ALIGN}, {"offset": 4 * PIECE},
                   {"length": 0}, {"stripe": 4}, {"stripe": (stripe + 1) % 4}):
        with pytest.raises(PeerError, match="bad decode request"):
            client.request("decode", into=memoryview(bytearray(ALIGN)), **{**good, **fields})
    for fields in ({"sources": "ab"}, {"sources": None}, {"others": 5}, {"want": None}, {"offset": "x"},
                   {"chunk_len": [1]}):  # not even the right types: an error answer, not a dead server thread
        with pytest.raises(PeerError):
            client.request("decode", into=memoryview(bytearray(ALIGN)), **{**good, **fields})
    _, got = client.request("decode", into=memoryview(bytearray(ALIGN)), **good)
    assert got == ALIGN
    client.close()


def test_a_survivor_that_does_not_answer_a_decoding_survivor_is_lost_without_a_direct_retry(make_group):
    """Two of six lost: node 5 stops serving, so every survivor that decodes a cell from its fragment fails to
    fetch it, and the rebuild fails as a lost survivor, not as a bad relay."""
    group = make_group(6, 2)
    for node in (1, 2):
        group.lose(node)
    group.keepers[5].redundancy.server.close()
    reply = group.rebuild(1, complete=[0, 3, 4, 5])
    assert PEER_LOST in reply.get("error", ""), reply
    assert [e.get("peer_lost") for e in group.events("rebuild_failed")] == [True]
    assert not group.events("rebuild_relay_failed")


def test_an_encoders_info_waits_for_a_committed_slot_being_checksummed(make_group, monkeypatch):
    """A peer's encoder asks for a step as soon as the job commits it, often before this keeper's background
    thread has checksummed its slot: the answer waits for the seal (up to SEAL_WAIT) instead of failing the
    encode, which would wait ENCODE_RETRY and log a parity failure every step."""
    monkeypatch.setattr(redundancy, "SEAL_WAIT", 0.5)
    group = make_group(3, 1)
    keeper = group.keepers[0]
    slots = []
    for rank, size in enumerate(SIZES):
        reply = keeper.handle({"op": "reserve", "rank": rank, "step": STEP + 1, "generation": 0, "size": size})
        slot = keeper.ranks[rank].files[reply["slot"]]
        write_snapshot(slot, STEP + 1, os.urandom(size))
        keeper.handle({"op": "commit", "rank": rank, "slot": reply["slot"], "step": STEP + 1})
        slots.append(slot)
    host, _, port = group.peers["0"].rpartition(":")
    client = PeerClient(host, int(port), group.secret, timeout=10)
    with pytest.raises(PeerError, match="not sealed yet"):  # never sealed: after SEAL_WAIT, as before
        client.request("info", reply_len=0, step=STEP + 1)

    def seal() -> None:
        for slot in slots:
            with keeper.cond:
                slot.seal(checksum(slot.map, slot.header()))
                keeper.cond.notify_all()

    timer = threading.Timer(0.2, seal)
    timer.start()
    reply, _ = client.request("info", reply_len=0, step=STEP + 1)
    timer.join()
    assert reply["crcs"] == [slot.header().checksum for slot in slots]
    with pytest.raises(PeerError, match="not held"):  # a step not held fails at once
        client.request("info", reply_len=0, step=STEP + 2)
    client.close()
