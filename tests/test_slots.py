"""Slot files and the keeper's rules, in process: real shared-memory files in a private tmpfs directory."""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import os
import socket
import stat
import struct
import subprocess
import threading
import time
from typing import Any

import pytest

from ftrun.control.spec import ENV_NODE_SPEC, ENV_SHM_DIR, NodeSpec, safe_job_id
from ftrun.events import read_events
from ftrun.launch.keeper_ahead import KEEPER_COMMAND
from ftrun.snapshot import keeper as keeper_module
from ftrun.snapshot.keeper import Keeper, capacity_problem
from ftrun.snapshot import pinning
from ftrun.snapshot.protocol import KeeperClient, KeeperError, KeeperUnavailable, LineSocket, listen, socket_name
from ftrun.snapshot.link import newest_common
from ftrun.snapshot.slot import (ALLOCATE_STEP, COMMITTED, EMPTY, HEADER_SIZE, WRITING, AheadAllocator, Header,
                                 SlotFile, checksum)


@pytest.fixture
def shm(monkeypatch):
    directory = f"/dev/shm/ftrun-test-{os.getpid()}-{time.monotonic_ns()}"
    os.makedirs(directory, mode=0o700)
    monkeypatch.setenv(ENV_SHM_DIR, directory)
    yield directory
    for name in os.listdir(directory):
        os.unlink(os.path.join(directory, name))
    os.rmdir(directory)


def write_snapshot(slot: SlotFile, step: int, payload: bytes, generation: int = 0) -> None:
    slot.set_state(WRITING)
    slot.payload()[:len(payload)] = payload
    slot.commit(Header(step=step, generation=generation, digest=7, data_len=len(payload) - 3, meta_len=3))


def test_slot_commit_seal_verify_and_a_flipped_byte(shm):
    path = os.path.join(shm, "s")
    slot = SlotFile(path, HEADER_SIZE + (5 << 20))
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert slot.problem() == "state empty"
    write_snapshot(slot, 10, os.urandom(5 << 20))
    assert slot.header().state == COMMITTED and not slot.header().sealed
    assert slot.verify() is None and slot.header().sealed  # the first verification seals
    assert slot.verify() is None
    slot.map[HEADER_SIZE + 12345] ^= 0x01
    assert "checksum mismatch" in slot.verify()
    slot.map[HEADER_SIZE + 12345] ^= 0x01
    assert slot.verify() is None
    slot.set_state(WRITING)
    assert slot.verify() == "state writing"
    slot.close()


def test_checksum_covers_identity_fields(shm):
    slot = SlotFile(os.path.join(shm, "s"), HEADER_SIZE + 4096)
    write_snapshot(slot, 10, b"x" * 100)
    slot.verify()
    struct.pack_into("<q", slot.map, 16, 20)  # the step field
    assert "checksum mismatch" in slot.verify()
    slot.close()


def test_capacity_message_says_needed_and_free():
    assert capacity_problem(0, 1, 2, 100 << 20, 200 << 20, 300 << 20, "/dev/shm") is None
    message = capacity_problem(0, 1, 2, 100 << 20, 200 << 20, 64 << 20, "/dev/shm")
    assert "200.0 MiB more" in message and "64.0 MiB is free" in message and "/dev/shm" in message
    assert "\n" not in message


def test_newest_common():
    assert newest_common([{10, 20}, {20, 30}, {20}]) == 20
    assert newest_common([{10}, {20}]) == 0
    assert newest_common([]) == 0


def spec(nproc: int = 2) -> NodeSpec:
    return NodeSpec("unit", 0, 1, nproc, "127.0.0.1", 1, "127.0.0.1", "x.py", [], False, False, "/", 1, 0, 1.0,
                    1.0, 1.0, 1.0, 1.0, 1.0, False)


def commit_via_keeper(keeper: Keeper, rank: int, step: int, generation: int = 0, skip: bool = True) -> int:
    reply = keeper.handle({"op": "reserve", "rank": rank, "step": step, "generation": generation, "size": 4096,
                           "skip": skip})
    assert "error" not in reply, reply
    slot = keeper.ranks[rank].files[reply["slot"]]
    write_snapshot(slot, step, os.urandom(1000), generation)
    assert keeper.handle({"op": "commit", "rank": rank, "slot": reply["slot"], "step": step}) == {}
    return reply["slot"]


def test_keeper_never_overwrites_the_newest_step_every_rank_holds_and_skips_rather_than_wait(shm, tmp_path):
    """A rank whose newest step is not restorable yet skips its snapshot at once (the keeper reports the step as
    decided) while its newest is at most STALE_INTERVALS of its intervals old, and waits beyond (or always, asked
    not to skip); a step the job abandoned (some rank skipped it) is overwritten, the restorable one
    never."""
    keeper = Keeper(dataclasses.replace(spec(), log_dir=str(tmp_path)), [])
    keeper.handle({"op": "poll", "generation": 0, "plan": 0, "restorable": 0})
    for rank in (0, 1):
        commit_via_keeper(keeper, rank, 10)
    assert keeper.handle({"op": "poll", "generation": 0, "plan": 0, "restorable": 0})["local"] == [10]
    commit_via_keeper(keeper, 0, 20)  # into the empty second slot: 10 is kept
    t0 = time.monotonic()
    reply = keeper.handle({"op": "reserve", "rank": 0, "step": 30, "generation": 0, "size": 4096})
    assert "skip" in reply and "step 20 is not yet held by every rank" in reply["skip"], reply
    assert time.monotonic() - t0 < 0.5 and keeper.ranks[0].held() == {10, 20}
    assert keeper.ranks[0].interval == 10
    poll = keeper.handle({"op": "poll", "generation": 0, "plan": 0, "restorable": 10})
    assert poll["local"] == [10] and poll["decided"] == 10  # rank 0 decided step 30 (skipped), rank 1 step 10
    assert [keeper.ranks[r].passes for r in (0, 1)] == [3, 1] and poll["passes"] == 1  # snapshot steps decided
    # asked not to skip, rank 0 waits, until a rank elsewhere is known to have skipped 20 (the job abandoned it):
    # then it writes 40 over 20, keeping 10
    for step, skip, abandoned in ((40, False, [20]), (90, True, [20, 40])):
        done = threading.Event()
        threading.Thread(target=lambda: (commit_via_keeper(keeper, 0, step, skip=skip), done.set()),
                         daemon=True).start()
        time.sleep(0.3)
        assert not done.is_set(), f"rank 0 overwrote a slot for step {step} while its newest was not restorable"
        keeper.handle({"op": "poll", "generation": 0, "plan": 0, "restorable": 10, "abandoned": abandoned})
        assert done.wait(5) and keeper.ranks[0].held() == {10, step}
        if step == 40:  # 80 is STALE_INTERVALS intervals past rank 0's newest 40: skipped; 90 waits (below)
            assert "skip" in keeper.handle({"op": "reserve", "rank": 0, "step": 80, "generation": 0, "size": 4096})
            assert keeper.ranks[0].held() == {10, 40} and keeper.ranks[0].decided == 80
    commit_via_keeper(keeper, 1, 90)
    keeper.handle({"op": "poll", "generation": 0, "plan": 0, "restorable": 90})
    commit_via_keeper(keeper, 0, 100)
    assert keeper.ranks[0].held() == {90, 100}
    # a new generation takes its steps anew: what the last one skipped or abandoned is forgotten
    keeper.handle({"op": "poll", "generation": 1, "plan": 90, "restorable": 90})
    assert keeper.abandoned == set() and keeper.ranks[0].held() == {90} and keeper.ranks[0].decided == 90
    assert keeper.ranks[0].interval == 0 and keeper.ranks[0].passes == 0
    events = [e for e in read_events(str(tmp_path)) if e["event"] == "snapshot_skipped"]
    assert [(e["rank"], e["step"], e["newest"]) for e in events] == [(0, 30, 20)]
    keeper.stop()


def test_a_poll_with_wait_answers_at_a_commit_a_skip_or_a_nudge_and_else_when_its_wait_ends(shm, monkeypatch):
    """The link's poll sleeps in the keeper while its answer is what the link last saw (``seen``), and answers at
    once when a snapshot is committed or skipped, or the supervisor nudges it (woken: with its look-again
    interval made longer than the test, only a notification can answer it); a poll with a version the link has
    not seen never waits."""
    keeper = Keeper(spec(nproc=1), [])
    base = {"op": "poll", "generation": 0, "plan": 0, "restorable": 0}
    seen = keeper.handle(base)["version"]
    t0 = time.monotonic()
    assert keeper.handle({**base, "wait": 0.3, "seen": seen})["version"] == seen  # nothing changed: all of it
    assert 0.25 < time.monotonic() - t0 < 2
    assert keeper.handle({**base, "wait": 5, "seen": "another"})["version"] == seen  # not what it saw: at once
    monkeypatch.setattr(keeper_module, "POLL_WAIT", 60.0)
    monkeypatch.setattr(keeper_module, "POLL_RECHECK", 60.0)
    for change in (lambda: commit_via_keeper(keeper, 0, 10), lambda: commit_via_keeper(keeper, 0, 20),
                   lambda: keeper.handle({"op": "reserve", "rank": 0, "step": 30, "generation": 0, "size": 4096}),
                   lambda: keeper.handle({"op": "nudge"})):
        answers: list[dict] = []
        waiting = threading.Thread(target=lambda: answers.append(keeper.handle({**base, "wait": 60, "seen": seen})),
                                   daemon=True)
        waiting.start()
        time.sleep(0.2)
        assert not answers, "the poll answered before anything changed"
        change()
        waiting.join(10)
        assert answers and answers[0]["version"] != seen
        seen = answers[0]["version"]
    assert answers[0]["local"] == [10, 20] and answers[0]["decided"] == 30  # step 30 was skipped
    keeper.stop()


def test_a_nudge_reaches_a_keeper_restarted_since_the_last_one_and_none_is_no_wait(shm):
    """The supervisor's nudge goes over a kept connection: when the keeper it reached has gone (its connection
    closed) the nudge tries once more on a new one, and reaches the new keeper; no keeper at all answers None
    at once."""
    name = f"ftrun-test-nudge-{os.getpid()}-{time.monotonic_ns()}"
    client = KeeperClient(name)
    assert client.try_request("nudge") is None
    old = listen(name)

    def answer_once() -> None:
        conn, _ = old.accept()
        line = LineSocket(conn)
        line.receive()
        line.send({})
        conn.close()

    answering = threading.Thread(target=answer_once, daemon=True)
    answering.start()
    assert client.try_request("nudge") == {}
    answering.join(5)
    old.close()
    keeper = Keeper(spec(nproc=1), [])
    server = listen(name)
    threading.Thread(target=keeper.serve, args=(server,), daemon=True).start()
    try:
        assert client.try_request("nudge") == {} and keeper._nudges == 1
    finally:
        keeper.stop()
        server.shutdown(socket.SHUT_RDWR)
        server.close()
        client.close()


def test_a_snapshot_a_few_bytes_larger_keeps_its_slot_files(shm):
    """A slot is made with the trainers' headroom: snapshots whose metadata grows by a few bytes (a step counter, a
    loss value) keep writing into the same files instead of a new allocation (and a new page-locking) each time."""
    keeper = Keeper(spec(1), [])
    keeper.handle({"op": "poll", "generation": 0, "plan": 0, "restorable": 0})
    inodes = set()
    for step in range(1, 7):
        size = (1 << 20) + step * 7
        reply = keeper.handle({"op": "reserve", "rank": 0, "step": step, "generation": 0, "size": size})
        slot = keeper.ranks[0].files[reply["slot"]]
        assert slot.capacity >= size
        inodes.add(os.stat(slot.path).st_ino)
        write_snapshot(slot, step, os.urandom(size))
        keeper.handle({"op": "commit", "rank": 0, "slot": reply["slot"], "step": step})
        keeper.handle({"op": "poll", "generation": 0, "plan": 0, "restorable": step})
    assert len(inodes) == 2 and keeper.ranks[0].held() == {5, 6}
    keeper.unlink_all()


def test_a_ranks_other_slot_is_allocated_after_its_first_commit_and_a_held_step_is_never_touched(shm):
    keeper = Keeper(spec(), [])
    keeper.handle({"op": "poll", "generation": 0, "plan": 0, "restorable": 0})
    assert commit_via_keeper(keeper, 0, 10) == 0
    keeper.allocate_other(*keeper.allocations.get_nowait())
    ahead = keeper.ranks[0].files[1]
    assert ahead is not None and ahead.allocated and ahead.capacity >= 4096
    assert os.stat(ahead.path).st_mode & 0o777 == 0o600
    assert keeper.ranks[1].files == [None, None, None]  # rank 1 committed nothing yet
    keeper.handle({"op": "poll", "generation": 0, "plan": 0, "restorable": 10})
    assert commit_via_keeper(keeper, 0, 20) == 1 and keeper.ranks[0].files[1] is ahead  # taken as it was
    inode = os.stat(keeper.ranks[0].files[0].path).st_ino
    keeper.allocate_other(*keeper.allocations.get_nowait())  # slot 0 holds step 10: left alone
    assert keeper.ranks[0].held() == {10, 20} and os.stat(keeper.ranks[0].files[0].path).st_ino == inode
    # the allocation ahead yields to anyone asking for a file of the rank, who then allocates the rest
    commit_via_keeper(keeper, 1, 10)
    keeper.ranks[1].asking = 1
    keeper.allocate_other(*keeper.allocations.get_nowait())
    keeper.ranks[1].asking = 0
    sparse = keeper.ranks[1].files[1]
    assert sparse is not None and not sparse.allocated
    assert commit_via_keeper(keeper, 1, 20) == 1 and keeper.ranks[1].files[1] is sparse and sparse.allocated
    keeper.unlink_all()


def test_allocating_ahead_without_room_leaves_the_error_to_the_trainers_reserve(shm, monkeypatch):
    keeper = Keeper(spec(), [])
    keeper.handle({"op": "poll", "generation": 0, "plan": 0, "restorable": 0})
    commit_via_keeper(keeper, 0, 10)
    monkeypatch.setattr("ftrun.snapshot.keeper.free_bytes", lambda directory: 0)
    keeper.allocate_other(0, 0, 10 << 20)  # a snapshot grown to 10 MiB: no room for it
    assert keeper.ranks[0].files[1] is None and keeper.fatal is None
    reply = keeper.handle({"op": "reserve", "rank": 0, "step": 20, "generation": 0, "size": 10 << 20})
    assert "too small for snapshots" in reply["error"]
    keeper.unlink_all()


def keeper_with_rank_0_ahead() -> Keeper:
    """A keeper in generation 0 whose ranks both committed step 10, and rank 0 also step 20."""
    keeper = Keeper(spec(), [])
    keeper.handle({"op": "poll", "generation": 0, "plan": 0, "restorable": 0})
    for rank in (0, 1):
        commit_via_keeper(keeper, rank, 10)
    keeper.handle({"op": "poll", "generation": 0, "plan": 0, "restorable": 10})
    commit_via_keeper(keeper, 0, 20)  # rank 1 never commits 20
    return keeper


def test_keeper_plan_discards_newer_steps_of_older_generations_and_readopts(shm):
    keeper = keeper_with_rank_0_ahead()
    held = keeper.handle({"op": "held", "generation": 1})["held"]
    assert held == {"0": [10, 20], "1": [10]}
    keeper.handle({"op": "poll", "generation": 1, "plan": 10, "restorable": 10})
    assert keeper.handle({"op": "restore", "rank": 0, "generation": 1})["step"] == 10
    assert keeper.ranks[0].held() == {10}
    # a new keeper (after a crash) finds the same committed, checksummed slots
    again = Keeper(spec(), [])
    again.adopt(earlier_run=False)
    assert [r.held() for r in again.ranks] == [{10}, {10}]
    keeper.unlink_all()
    assert os.listdir(shm) == []


def test_a_generation_start_verifies_the_checksums_of_the_step_it_restores_not_of_every_slot(shm, tmp_path):
    """``held`` reads headers only; ``verify`` checks the checksums of the agreed step's slots (sealing one the
    sealer had not reached): a restart reads the bytes it restores, not every slot of every rank (at 1 GiB per
    rank the keeper read 4 GiB before the job could agree). A slot that fails is dropped and logged, never
    restored: the job then plans an older step."""
    keeper = Keeper(dataclasses.replace(spec(), log_dir=str(tmp_path)), [])
    keeper.handle({"op": "poll", "generation": 0, "plan": 0, "restorable": 0})
    for step in (10, 20):
        for rank in (0, 1):
            commit_via_keeper(keeper, rank, step)
        keeper.handle({"op": "poll", "generation": 0, "plan": 0, "restorable": step})
    slots = {(rank, step): keeper.ranks[rank].files[keeper.ranks[rank].index_of(step)]
             for rank in (0, 1) for step in (10, 20)}
    for (rank, step), slot in slots.items():
        if step == 10 or rank == 0:  # rank 1's newest stays unsealed: its seal is still queued
            slot.seal(checksum(slot.map, slot.header()))
    for rank in (0, 1):
        slots[rank, 10].map[HEADER_SIZE + 5] ^= 0x01  # the older step of both ranks goes bad in RAM
    assert keeper.handle({"op": "held", "generation": 1})["held"] == {"0": [10, 20], "1": [10, 20]}
    reply = keeper.handle({"op": "verify", "generation": 1, "step": 20})
    assert reply["problems"] == {} and reply["bytes"] == 2000, reply
    assert slots[1, 20].header().sealed
    reply = keeper.handle({"op": "verify", "generation": 1, "step": 10})
    assert set(reply["problems"]) == {"0", "1"} and "checksum mismatch" in reply["problems"]["0"], reply
    assert [rank.held() for rank in keeper.ranks] == [{20}, {20}]
    assert all(slots[rank, 10].header().state == EMPTY for rank in (0, 1))
    invalid = [e for e in read_events(str(tmp_path)) if e["event"] == "slot_invalid"]
    assert [(e["local_rank"], e["step"]) for e in invalid] == [(0, 10), (1, 10)]
    assert keeper.handle({"op": "verify", "generation": 1, "step": 10})["problems"] == {
        "0": "step 10 not held", "1": "step 10 not held"}
    keeper.unlink_all()


def test_slots_of_an_earlier_run_count_as_older_than_its_first_generation(shm):
    """A new SLURM step starts again at generation 0: a step only some ranks held in the earlier run is dropped."""
    keeper_with_rank_0_ahead()  # then the step is killed
    later = Keeper(spec(), [])
    later.adopt(earlier_run=True)
    assert later.handle({"op": "held", "generation": 0})["held"] == {"0": [10, 20], "1": [10]}
    later.handle({"op": "poll", "generation": 0, "plan": 10, "restorable": 10})
    assert [r.held() for r in later.ranks] == [{10}, {10}]
    later.unlink_all()


def test_keeper_refuses_to_allocate_beyond_free_space(shm, monkeypatch):
    monkeypatch.setattr("ftrun.snapshot.keeper.free_bytes", lambda directory: 1 << 20)
    keeper = Keeper(spec(), [])
    keeper.handle({"op": "poll", "generation": 0, "plan": 0, "restorable": 0})
    reply = keeper.handle({"op": "reserve", "rank": 0, "step": 1, "generation": 0, "size": 10 << 20})
    assert "too small for snapshots" in reply["error"] and "1.0 MiB is free" in reply["error"]
    assert keeper.handle({"op": "poll", "generation": 0, "plan": 0, "restorable": 0})["fatal"] == reply["error"]


def test_allocate_ahead_fills_a_sparse_slot_in_order_and_a_full_directory_is_an_error(shm, monkeypatch):
    """A rebuild's slots are made sparse and allocated ahead of the transfer: a writer waits for each position
    (never touching an unallocated page, which would be a SIGBUS on a full /dev/shm); when the directory is full,
    ready() raises ENOSPC instead."""
    size = HEADER_SIZE + 3 * ALLOCATE_STEP + 12345
    slots = [SlotFile(os.path.join(shm, f"s{i}"), size, allocate=False) for i in range(2)]
    assert not slots[0].allocated and os.stat(slots[0].path).st_blocks * 512 == HEADER_SIZE
    memory = AheadAllocator([(slot, size - 999) for slot in slots])
    memory.ready(memory.total - 1)
    view = memoryview(slots[1].map)
    view[size - 1000] = 1  # below the position waited for
    view.release()
    memory.ready(memory.total)
    assert all(slot.allocated for slot in slots)

    calls = []
    real = os.posix_fallocate

    def fill_up(fd: int, offset: int, length: int) -> None:
        calls.append(offset)
        if len(calls) > 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, offset, length)

    monkeypatch.setattr(os, "posix_fallocate", fill_up)
    sparse = SlotFile(os.path.join(shm, "s2"), size, allocate=False)
    memory = AheadAllocator([(sparse, size)])
    memory.ready(ALLOCATE_STEP)
    with pytest.raises(OSError, match="No space left"):
        memory.ready(2 * ALLOCATE_STEP + 1)
    assert not sparse.allocated


def test_allocate_ahead_stopped_by_any_error_is_an_error_for_the_writer(shm, monkeypatch):
    """An allocation that failed with anything but an OSError ended the allocating thread with a traceback and
    told the writer that every page was allocated: a rebuild then wrote into pages never allocated (on a full
    /dev/shm, a SIGBUS). Any error stops the writer (ready raises it) short of the pages it did not allocate."""
    uncaught: list[threading.ExceptHookArgs] = []
    monkeypatch.setattr(threading, "excepthook", uncaught.append)
    real = os.posix_fallocate

    def break_at_the_second_step(fd: int, offset: int, length: int) -> None:
        if offset >= ALLOCATE_STEP:
            raise RuntimeError("a bug in allocate")
        real(fd, offset, length)

    monkeypatch.setattr(os, "posix_fallocate", break_at_the_second_step)
    size = HEADER_SIZE + 3 * ALLOCATE_STEP
    sparse = SlotFile(os.path.join(shm, "s0"), size, allocate=False)
    memory = AheadAllocator([(sparse, size)])
    memory.ready(ALLOCATE_STEP)
    for end in (ALLOCATE_STEP + 1, memory.total):
        with pytest.raises(RuntimeError, match="a bug in allocate"):
            memory.ready(end)
    assert not sparse.allocated and uncaught == []


def test_a_slot_a_failed_rebuild_left_sparse_is_allocated_before_a_trainer_gets_it(shm):
    keeper = Keeper(spec(), [])
    keeper.handle({"op": "poll", "generation": 0, "plan": 0, "restorable": 0})
    index, slot = keeper.claim_vacant(0, HEADER_SIZE + (4 << 20), allocate=False)
    assert not slot.allocated  # the rebuild stopped before its allocation ran: then a trainer reserves it
    assert keeper.ensure_slot(0, index, 4 << 20) is slot and slot.allocated
    keeper.unlink_all()


def replica_keeper(node: int, secret: bytes) -> tuple[Keeper, str]:
    """A keeper of node ``node`` of a 2-node job with replication (G = 2, m = 1), serving peers on loopback."""
    keeper = Keeper(dataclasses.replace(spec(1), nnodes=2, node_rank=node, ec_group=2, ec_parity=1), [])
    keeper.enable_redundancy(secret, socket.create_server(("127.0.0.1", 0)))
    assert keeper.redundancy is not None
    keeper.redundancy.server.start()
    host, port = keeper.redundancy.server.address
    return keeper, f"{host}:{port}"


def test_the_first_encode_allocates_the_other_parity_file_and_the_next_encode_takes_it(shm):
    secret = os.urandom(32)
    keepers = [replica_keeper(node, secret) for node in (0, 1)]
    peers = {str(node): address for node, (_, address) in enumerate(keepers)}
    for step in (10, 20):
        for keeper, _ in keepers:
            keeper.handle({"op": "poll", "generation": 0, "plan": 0, "restorable": step - 10, "peers": peers})
            commit_via_keeper(keeper, 0, step)
            slot = keeper.ranks[0].files[keeper.ranks[0].index_of(step)]
            slot.seal(checksum(slot.map, slot.header()))
        for keeper, _ in keepers:
            keeper.redundancy.encode(step, 0, step - 10, lambda: None)
        parity = keepers[0][0].redundancy
        if step == 10:
            assert parity.steps == [10, None]
            ahead = parity.files[1]
            assert ahead is not None and ahead.allocated and ahead.capacity == parity.files[0].capacity
        else:  # step 20 went into the file allocated ahead; the parity of step 10 was left alone
            assert parity.steps == [10, 20] and parity.files[1] is ahead
    for keeper, _ in keepers:
        keeper.stop()
        keeper.redundancy.close()
        keeper.unlink_all()


def test_a_replacement_allocates_its_slots_before_the_rebuild_and_the_rebuild_takes_them(shm, monkeypatch):
    """Told the likely step as its node starts (``prepare``), a replacement's keeper allocates the slots while
    the job agrees its plan; the rebuild fills those very slots, bit for bit. Prepared slots that no rebuild
    takes are given up when the plan comes: emptied, their allocation stopped."""
    secret = os.urandom(32)
    survivor, lost = (replica_keeper(node, secret) for node in (0, 1))
    peers = {"0": survivor[1], "1": lost[1]}
    payload = os.urandom(3 * ALLOCATE_STEP + 5000)
    for keeper, _ in (survivor, lost):
        keeper.handle({"op": "poll", "generation": 0, "plan": 0, "restorable": 0, "peers": peers})
        reply = keeper.handle({"op": "reserve", "rank": 0, "step": 10, "generation": 0, "size": len(payload)})
        slot = keeper.ranks[0].files[reply["slot"]]
        write_snapshot(slot, 10, payload)
        keeper.handle({"op": "commit", "rank": 0, "slot": reply["slot"], "step": 10})
        slot.seal(checksum(slot.map, slot.header()))
    for keeper, _ in (survivor, lost):
        keeper.redundancy.encode(10, 0, 0, lambda: None)
    lost[0].stop()
    lost[0].unlink_all()

    for planned in (True, False):
        replacement, address = replica_keeper(1, secret)
        peers["1"] = address
        with monkeypatch.context() as patched:  # no room now: a hint that fails is never fatal to the job
            patched.setattr("ftrun.snapshot.keeper.free_bytes", lambda directory: 1 << 20)
            assert replacement.handle({"op": "prepare", "step": 10, "holders": [0], "peers": peers})["bytes"] == 0
            assert replacement.fatal is None and replacement.redundancy._prepared is None
        # the first holder named is lost too (a second node lost at once): the next one answers
        prepared = replacement.handle({"op": "prepare", "step": 10, "holders": [7, 0],
                                       "peers": {**peers, "7": "127.0.0.1:1"}})
        assert prepared["bytes"] == HEADER_SIZE + len(payload)
        writer = replacement.redundancy._prepared
        files = [file for _, _, file, _, _ in writer.targets]
        if planned:
            writer.memory.ready(writer.memory.total)  # the job took its time agreeing the plan
            reply = replacement.handle({"op": "rebuild", "generation": 1, "step": 10, "complete": [0],
                                        "peers": peers})
            assert reply["bytes"] == HEADER_SIZE + len(payload), reply
            assert replacement.redundancy.allocated_ahead == HEADER_SIZE + len(payload)
            index = replacement.ranks[0].index_of(10)
            assert replacement.ranks[0].files[index] is files[0]
            assert bytes(files[0].payload()[:len(payload)]) == payload and files[0].verify() is None
        else:
            replacement.handle({"op": "poll", "generation": 1, "plan": 0, "restorable": 0})
            assert replacement.redundancy._prepared is None and not writer.memory._thread.is_alive()
            assert files[0].header().state == EMPTY and replacement.ranks[0].held() == set()
        replacement.stop()
        replacement.unlink_all()
    survivor[0].stop()
    survivor[0].unlink_all()


def test_a_spares_reserve_is_allocated_handed_over_as_slot_0_and_given_back_when_room_runs_short(shm, monkeypatch):
    """A reserve allocates its files (mode 0600) in the background, never takes more than half of the free room,
    hands them over as slot 0 of a node's ranks (never over a file there), and is given back whole when less
    than half its size is left free."""
    from ftrun.snapshot import reserve as reserve_module
    from ftrun.snapshot.reserve import SlotReserve, reserve_path, unlink_reserves
    from ftrun.snapshot.slot import slot_name

    free = {"bytes": 1 << 40}
    monkeypatch.setattr(reserve_module, "free_bytes", lambda directory: free["bytes"])
    size = HEADER_SIZE + (3 << 20)
    reserve = SlotReserve("job/x", "spare 1", 2)
    free["bytes"] = 2 * 2 * size - 1  # short of twice what it would take
    assert not reserve.want([size, size]) and not os.listdir(shm)
    free["bytes"] = 1 << 40
    assert reserve.want([size, size])
    paths = [reserve_path("job/x", "spare 1", local) for local in (0, 1)]
    assert all(os.path.dirname(p) == shm and f"-reserve-{safe_job_id('spare 1')}-rank" in p for p in paths)
    assert all(stat.S_IMODE(os.stat(p).st_mode) == 0o600 for p in paths)
    assert not reserve.want([size, size])  # nothing to grow
    occupied = os.path.join(shm, slot_name(safe_job_id("job/x"), 3, 1, 0))
    SlotFile(occupied, 2 * HEADER_SIZE).close()  # node 3's rank 1 has a slot 0 already: kept as it is
    deadline = time.monotonic() + 10
    while reserve.allocated < 2 * size and time.monotonic() < deadline:
        time.sleep(0.01)
    assert reserve.hand_over(3) == size  # rank 0's file, allocated whole
    taken = SlotFile(os.path.join(shm, slot_name(safe_job_id("job/x"), 3, 0, 0)))
    assert taken.size == size and taken.allocated and taken.header().state == EMPTY
    taken.close()
    assert os.path.getsize(occupied) == 2 * HEADER_SIZE and not any(os.path.exists(p) for p in paths)

    again = SlotReserve("job/x", "spare 2", 1)
    assert again.want([size])
    free["bytes"] = size // 2 - 1  # the nodes need the room: the reserve goes
    assert not again.want([2 * size]) and not os.path.exists(reserve_path("job/x", "spare 2", 0))
    free["bytes"] = 1 << 40
    assert again.want([size])
    unlink_reserves("job/x")  # what the launcher does for a spare killed while it held one
    again.release()
    assert sorted(os.listdir(shm)) == sorted(os.path.basename(p) for p in (occupied, taken.path))


def test_a_mapping_is_page_locked_once_in_a_thread_of_its_own_and_unlocked_when_forgotten(tmp_path, monkeypatch):
    slot = SlotFile(str(tmp_path / "slot"), 2 * HEADER_SIZE)
    assert pinning.PinnedMappings().pin(slot.map) is False  # this CPU build of torch: pageable, and no exception
    calls: list[tuple[str, int]] = []

    def register(address: int, length: int) -> bool:
        assert threading.current_thread() is not threading.main_thread()  # a failed call's last error dies with it
        calls.append(("register", length))
        return True

    monkeypatch.setattr(pinning, "_register", register)
    monkeypatch.setattr(pinning, "_unregister", lambda address: calls.append(("unregister", 0)) or True)
    pins = pinning.PinnedMappings()
    assert pins.pin(slot.map) and pins.pin(slot.map)
    pins.forget(slot.map)
    pins.forget(slot.map)
    assert calls == [("register", 2 * HEADER_SIZE), ("unregister", 0)]
    monkeypatch.setattr(pinning, "_register", lambda address, length: 1 / 0)
    assert pins.pin(slot.map) is False and pins.pin(slot.map) is False  # tried once: it stays pageable
    pins.forget(slot.map)
    assert calls[-1] == ("unregister", 0) and len(calls) == 2
    slot.close()


@pytest.mark.timeout(30)
def test_a_trainer_never_talks_to_a_keeper_socket_that_another_user_holds():
    """The keeper's socket is an abstract Unix socket, a name any local user may bind (while the keeper restarts,
    say): a client asks only a keeper of its own user, so another user's process that answers at that name is
    never told a request nor believed (it could name a slot file of its own to restore from)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to run a process as another user")
    name = f"ftrun-keeper-impostor{os.getpid()}-node0"
    ready, go = os.pipe()
    pid = os.fork()
    if pid == 0:  # another user, answering every request as a keeper would
        try:
            os.setgid(65534)
            os.setuid(65534)
            server = listen(name)
            os.write(go, b"1")
            while True:
                conn = LineSocket(server.accept()[0])
                while conn.receive() is not None:
                    conn.send({"step": 60, "slot": 0, "path": "/tmp/impostor-slot"})
        finally:
            os._exit(0)
    try:
        assert os.read(ready, 1) == b"1"
        client = KeeperClient(name, patience=0.5, timeout=1.0)
        with pytest.raises(KeeperUnavailable):
            client.request("restore", rank=0, generation=0)
        assert client.try_request("ping") is None
    finally:
        os.kill(pid, 9)
        os.waitpid(pid, 0)


def test_parity_of_a_step_a_new_generation_drops_is_dropped_with_its_slots(shm):
    """Parity of a step newer than a generation's plan was computed from slots the plan discards (that future did
    not happen for every rank): it goes with them, so the step is encoded again once the new generation commits it,
    and a rebuild gives back what the new generation committed, not the old one's bytes."""
    secret = os.urandom(32)
    survivor, lost = (replica_keeper(node, secret) for node in (0, 1))
    peers = {"0": survivor[1], "1": lost[1]}

    def commit(keeper: Keeper, step: int, generation: int) -> bytes:
        payload = os.urandom(5000)
        reply = keeper.handle({"op": "reserve", "rank": 0, "step": step, "generation": generation,
                               "size": len(payload)})
        slot = keeper.ranks[0].files[reply["slot"]]
        write_snapshot(slot, step, payload, generation)
        assert keeper.handle({"op": "commit", "rank": 0, "slot": reply["slot"], "step": step}) == {}
        slot.seal(checksum(slot.map, slot.header()))
        return payload

    for keeper, _ in (survivor, lost):
        keeper.handle({"op": "poll", "generation": 0, "plan": 0, "restorable": 0, "peers": peers})
        commit(keeper, 10, 0)
    for keeper, _ in (survivor, lost):
        keeper.redundancy.encode(10, 0, 0, lambda: None)
        keeper.handle({"op": "poll", "generation": 0, "plan": 0, "restorable": 10, "committed": 10})
        commit(keeper, 20, 0)
    survivor[0].redundancy.encode(20, 0, 10, lambda: None)  # node 1 fails before it encodes step 20
    for keeper, _ in (survivor, lost):
        keeper.handle({"op": "held", "generation": 1})
        keeper.handle({"op": "poll", "generation": 1, "plan": 10, "restorable": 10})
        assert keeper.ranks[0].held() == {10}
    assert survivor[0].redundancy.held() == [10]  # not step 20 of generation 0: no rank holds it any more
    again = {keeper: commit(keeper, 20, 1) for keeper, _ in (survivor, lost)}
    survivor[0].handle({"op": "poll", "generation": 1, "plan": 10, "restorable": 10, "committed": 20})
    assert survivor[0]._encode_due()
    survivor[0].redundancy.encode(20, 1, 10, lambda: None)
    lost[0].stop()
    lost[0].unlink_all()
    replacement, peers["1"] = replica_keeper(1, secret)
    reply = replacement.handle({"op": "rebuild", "generation": 2, "step": 20, "complete": [0], "peers": peers})
    assert "error" not in reply, reply
    file = replacement.ranks[0].files[replacement.ranks[0].index_of(20)]
    assert bytes(file.payload()[:5000]) == again[lost[0]]
    for keeper in (replacement, survivor[0]):
        keeper.stop()
        keeper.redundancy.close()
        keeper.unlink_all()


def test_parity_finished_after_a_new_generations_plan_dropped_its_step_is_not_held(shm):
    """The plan comes while the encoder checks with a peer that the data did not change: the parity it then
    completes is of slots the plan discarded, and is not held either."""
    secret = os.urandom(32)
    survivor, peer = (replica_keeper(node, secret) for node in (0, 1))
    peers = {"0": survivor[1], "1": peer[1]}
    for step in (10, 20):
        for keeper, _ in (survivor, peer):
            keeper.handle({"op": "poll", "generation": 0, "plan": 0, "restorable": step - 10, "peers": peers})
            commit_via_keeper(keeper, 0, step)
            slot = keeper.ranks[0].files[keeper.ranks[0].index_of(step)]
            slot.seal(checksum(slot.map, slot.header()))
    serve, infos = peer[0].redundancy.server.handler, []

    def plan_during_the_last_info(request: dict) -> object:
        if request["op"] == "info" and len(infos.append(request) or infos) == 2:
            survivor[0].handle({"op": "held", "generation": 1})
            survivor[0].handle({"op": "poll", "generation": 1, "plan": 10, "restorable": 10})
        return serve(request)

    peer[0].redundancy.server.handler = plan_during_the_last_info
    with pytest.raises(keeper_module.RedundancyError, match="step 20 of node 0 was discarded"):
        survivor[0].redundancy.encode(20, 0, 10, lambda: None)
    assert survivor[0].ranks[0].held() == {10} and survivor[0].redundancy.held() == []
    for keeper, _ in (survivor, peer):
        keeper.stop()
        keeper.redundancy.close()
        keeper.unlink_all()


def test_a_persisted_rank_file_larger_than_its_manifest_says_is_a_failed_load_not_a_full_shm(shm, tmp_path):
    """A keeper sizes the slot it loads a persisted step into by the rank file: one the disk made huge (sparse,
    garbled) is a step that fails to load (the job tries the next source), never "/dev/shm too small", which
    ends the job."""
    from ftrun.snapshot import persist
    root = tmp_path / "ckpt"
    keeper = Keeper(dataclasses.replace(spec(1), ckpt_dir=str(root)), [])
    keeper.handle({"op": "poll", "generation": 0, "plan": 0, "restorable": 0})
    slot = keeper.ranks[0].files[commit_via_keeper(keeper, 0, 10)]
    slot.verify()
    entry = persist.write_rank(persist.partial_dir(str(root), 10), 0, slot)
    persist.finalize(str(root), 10, "unit", 1, 1, {0: entry})
    keeper.unlink_all()
    path = root / persist.step_name(10) / persist.rank_file(0)
    os.truncate(path, 1 << 40)
    later = Keeper(dataclasses.replace(spec(1), ckpt_dir=str(root)), [])
    later.handle({"op": "held", "generation": 0})
    reply = later.handle({"op": "load", "generation": 0, "step": 10})
    assert f"the manifest says {entry['bytes']}" in reply.get("error", ""), reply
    assert later.fatal is None and all(f is None or f.size < 1 << 30 for f in later.ranks[0].files)
    later.unlink_all()


def test_a_request_naming_a_rank_or_slot_the_keeper_lacks_is_an_error_reply(shm):
    """A local rank or slot index out of range (or negative: Python would index from the end) is refused in one
    line, not an exception that ends the connection's thread (the client then sends it again for a minute), nor a
    slot file named for rank -1 that no cleanup finds."""
    keeper = Keeper(spec(1), [])
    keeper.handle({"op": "poll", "generation": 0, "plan": 0, "restorable": 0})
    for request in ({"op": "commit", "rank": 1, "slot": 0, "step": 1},
                    {"op": "corrupt", "rank": 0, "slot": 3, "reason": "x"},
                    {"op": "reserve", "rank": -1, "step": 5, "generation": 0, "size": 10},
                    {"op": "commit", "rank": 0, "slot": -1, "step": 1},
                    {"op": "restore", "rank": "0", "generation": 0}):
        reply = keeper.handle(request)
        assert reply.get("error", "").startswith(f"bad request {request['op']}"), (request, reply)
    assert os.listdir(shm) == []
    keeper.unlink_all()


def test_a_commit_of_a_generation_that_is_over_is_stale_and_not_held(shm):
    """A trainer killed by a restart with its commit on the way: the keeper reads it after the next generation's
    plan discarded the steps newer than the plan, and must not hold that step of the old generation again."""
    keeper = Keeper(spec(1), [])
    keeper.handle({"op": "poll", "generation": 0, "plan": 0, "restorable": 0})
    reply = keeper.handle({"op": "reserve", "rank": 0, "step": 5, "generation": 0, "size": 4096})
    write_snapshot(keeper.ranks[0].files[reply["slot"]], 5, os.urandom(1000), generation=0)
    keeper.handle({"op": "held", "generation": 1})
    keeper.handle({"op": "poll", "generation": 1, "plan": 0, "restorable": 0})
    assert keeper.handle({"op": "commit", "rank": 0, "slot": reply["slot"], "step": 5})["error"].startswith("stale")
    assert keeper.ranks[0].held() == set() and keeper.ranks[0].files[reply["slot"]].header().state == EMPTY
    assert keeper.handle({"op": "poll", "generation": 1, "plan": 0, "restorable": 0})["local"] == []
    keeper.unlink_all()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("thread, broken", [("ftrun-seal", "checksum"), ("ftrun-allocate", "allocate_other"),
                                            ("ftrun-persist", "_write_step"), ("ftrun-parity", "_encode_due"),
                                            ("ftrun-peer-server", "_accept_loop")])
def test_a_keeper_whose_background_thread_fails_exits_for_its_supervisor_to_restart_it(shm, tmp_path, monkeypatch,
                                                                                      capsys, thread, broken):
    """A background thread that died of an unexpected error left a keeper that answers pings and does nothing
    more: a dead sealer left every later snapshot unsealed, so the encoder and the persister waited forever and
    the job's protected step stopped with nothing saying why. Now the keeper prints the traceback and one line,
    and exits (without touching its files) with THREAD_FAILED: its supervisor restarts it, training goes on."""
    ckpt = str(tmp_path / "ckpt") if thread == "ftrun-persist" else None
    parity = {"nnodes": 2, "ec_group": 2, "ec_parity": 1} if thread in ("ftrun-parity", "ftrun-peer-server") else {}
    keeper = Keeper(dataclasses.replace(spec(1), log_dir=str(tmp_path), ckpt_dir=ckpt, **parity), [])
    if parity:
        keeper.enable_redundancy(b"k" * 32, socket.create_server(("127.0.0.1", 0)))
    exits: list[int] = []
    exited = threading.Event()
    monkeypatch.setattr(keeper_module.os, "_exit", lambda code: (exits.append(code), exited.set()))
    # broken before the threads start: a thread may hold the method it calls next while it waits
    owner = {"checksum": keeper_module, "_accept_loop": keeper.redundancy.server if keeper.redundancy else None}
    monkeypatch.setattr(owner.get(broken, keeper), broken, lambda *args: 1 // 0)
    server = listen(f"ftrun-hg-test-{os.getpid()}-{time.monotonic_ns()}")
    serving = threading.Thread(target=keeper.serve, args=(server,), daemon=True)
    serving.start()
    try:
        keeper.handle({"op": "poll", "generation": 0, "plan": 0, "restorable": 0})
        commit_via_keeper(keeper, 0, 10)  # sealed, the other slot allocated, persisted (asked next), encoded
        keeper.handle({"op": "poll", "generation": 0, "plan": 0, "restorable": 10, "persist_round": 1, "persist": 10})
        assert exited.wait(20), f"{thread} died and the keeper lived on"
        assert exits == [keeper_module.THREAD_FAILED]
        [event] = [e for e in read_events(str(tmp_path)) if e["event"] == "keeper_thread_failed"]
        assert event["thread"] == thread and event["message"] == (
            f"keeper thread {thread} failed (ZeroDivisionError: integer division or modulo by zero); exiting, for "
            "the supervisor to restart the keeper (traceback above)")
        assert "1 // 0" in capsys.readouterr().err
    finally:
        keeper.stop()
        server.shutdown(socket.SHUT_RDWR)
        serving.join(10)
        server.close()
        if keeper.redundancy is not None:
            keeper.redundancy.close()
        keeper.unlink_all()


class ServingKeeper:
    """A keeper serving its local socket ``server`` in a thread, until closed."""

    def __init__(self, keeper: Keeper, server: socket.socket) -> None:
        self.keeper, self.server = keeper, server
        self.thread = threading.Thread(target=keeper.serve, args=(server,), daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.keeper.stop()
        self.server.shutdown(socket.SHUT_RDWR)
        self.thread.join(10)
        self.server.close()
        self.keeper.unlink_all()


@pytest.mark.timeout(60)
def test_a_request_the_keeper_fails_on_is_answered_as_an_error_at_once(shm, tmp_path, monkeypatch):
    """A request whose handling raised an error the keeper did not expect (a bug) ended its connection's thread with
    a traceback, and its client sent it again on a new connection for a minute (KeeperClient's patience), failing
    the same way each time, before it said that the keeper was not answering. Now it is answered at once with an
    error naming the request and the error, in one line, and the keeper serves on."""
    uncaught: list[threading.ExceptHookArgs] = []
    monkeypatch.setattr(threading, "excepthook", uncaught.append)
    keeper = Keeper(dataclasses.replace(spec(1), log_dir=str(tmp_path)), [])
    monkeypatch.setattr(keeper, "op_nudge", lambda: 1 // 0)
    name = f"ftrun-hg-test-{os.getpid()}-{time.monotonic_ns()}"
    serving = ServingKeeper(keeper, listen(name))
    client = KeeperClient(name, patience=20)
    try:
        with pytest.raises(KeeperError) as failed:
            client.request("nudge")
        message = "keeper 0 failed request 'nudge' (ZeroDivisionError: integer division or modulo by zero)"
        assert str(failed.value) == message
        assert client.request("ping") is not None  # the same connection, answered
        assert [e["message"] for e in read_events(str(tmp_path)) if e["event"] == "keeper_request_failed"] == [message]
        assert uncaught == []
    finally:
        client.close()
        serving.close()


class ShortOfDescriptors(socket.socket):
    """A listening socket whose first accept fails for want of file descriptors (EMFILE)."""

    failed = False

    def accept(self) -> tuple[socket.socket, Any]:
        if not self.failed:
            self.failed = True
            raise OSError(errno.EMFILE, "Too many open files")
        return super().accept()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("short_of", ["descriptors", "threads"])
def test_a_keeper_short_of_descriptors_or_threads_for_a_connection_serves_on(shm, tmp_path, monkeypatch, short_of):
    """accept() failing for want of file descriptors ended the keeper's serving loop, and a connection whose thread
    could not start (the user at its process limit) raised out of it: either way the keeper then unlinked every
    snapshot of its node and exited, for a passing shortage. Now that connection is closed (its client connects
    again) with one line, and the keeper serves on."""
    keeper = Keeper(dataclasses.replace(spec(1), log_dir=str(tmp_path)), [])
    name = f"ftrun-hg-test-{os.getpid()}-{time.monotonic_ns()}"
    server = listen(name)
    if short_of == "descriptors":
        server = ShortOfDescriptors(fileno=server.detach())
    else:
        start = threading.Thread.start
        refused: list[threading.Thread] = []

        def start_but_the_first_client(thread: threading.Thread) -> None:
            if thread.name.endswith("(_serve_connection)") and not refused:  # a client's thread
                refused.append(thread)
                raise RuntimeError("can't start new thread")
            start(thread)

        monkeypatch.setattr(threading.Thread, "start", start_but_the_first_client)
    serving = ServingKeeper(keeper, server)
    client = KeeperClient(name, patience=20, timeout=2.0)
    try:
        assert client.request("ping") is not None
        [event] = [e for e in read_events(str(tmp_path)) if e["event"] == "keeper_connection_failed"]
        assert event["message"].startswith("keeper 0 ") and event["message"].endswith("; going on")
        assert serving.thread.is_alive()
    finally:
        client.close()
        serving.close()


@pytest.mark.timeout(60)
def test_a_keeper_stops_when_its_stop_signal_reaches_a_thread_other_than_the_main_one(shm):
    """The kernel may deliver the supervisor's stop signal (sent to the process) to any thread of the keeper, and
    Python runs the handler in the main thread only, which sat blocked in accept(): the keeper went on until the
    supervisor SIGKILLed it --stop-grace (3 s) later, at the end of every job where it happened (strace on the
    keeper made it likely). Sent to another of its threads on purpose, it now stops the keeper, which removes its
    files and exits 0."""
    node = dataclasses.replace(spec(1), job_id=f"stop-{os.getpid()}-{time.monotonic_ns()}")
    proc = subprocess.Popen(KEEPER_COMMAND, env={**os.environ, ENV_NODE_SPEC: node.encode(), ENV_SHM_DIR: shm},
                            stdout=subprocess.PIPE, start_new_session=True)
    assert proc.stdout is not None
    client = KeeperClient(socket_name(node.job_id, 0), patience=20)
    try:
        assert proc.stdout.readline() == b"ready\n"
        client.request("poll", generation=0, plan=0, restorable=0)
        client.request("reserve", rank=0, step=1, generation=0, size=4096)  # a slot file in the shm dir
        assert os.listdir(shm)
        while not (others := [int(tid) for tid in os.listdir(f"/proc/{proc.pid}/task") if int(tid) != proc.pid]):
            time.sleep(0.01)
        assert ctypes.CDLL(None, use_errno=True).tgkill(proc.pid, others[0], keeper_module.STOP_SIGNAL) == 0
        assert proc.wait(timeout=20) == 0  # before: not until a SIGKILL
        assert os.listdir(shm) == []
    finally:
        client.close()
        proc.kill()
        proc.wait()
        proc.stdout.close()


def _persist_round(keeper: Keeper, number: int, step: int, bound: float) -> dict:
    """Ask ``keeper`` (its persister running) to persist ``step`` in round ``number``; its outcome."""
    keeper.handle({"op": "poll", "generation": 0, "plan": 0, "restorable": step, "persist_round": number,
                   "persist": step})
    with keeper.cond:
        assert keeper.cond.wait_for(lambda: keeper.persisted.get("round") == number, bound), f"round {number} hangs"
        return keeper.persisted


@pytest.mark.timeout(60)
def test_the_persister_waits_for_a_seal_only_while_one_can_come(shm, tmp_path, monkeypatch):
    """The persister polled its slot's ``sealed`` every 5 ms with no bound and no stop check: a slot emptied before
    its checksum (a trainer's report, a new generation's plan), a sealer far behind, or a stop left it (and every
    later persist round of the job) waiting forever. It now fails the round (one warning; the next round tries
    again) when the slot no longer holds the step or no seal came in SEAL_WAIT, and ends when the keeper stops."""
    keeper = Keeper(dataclasses.replace(spec(1), ckpt_dir=str(tmp_path / "ckpt")), [])
    keeper.handle({"op": "poll", "generation": 0, "plan": 0, "restorable": 0})
    persister = threading.Thread(target=keeper.persist_forever, daemon=True)  # no sealer: nothing gets sealed
    persister.start()
    try:
        waiting = threading.Event()  # the persister looks at the slot: it waits for its seal

        def watch(slot: SlotFile) -> None:
            header = slot.header
            monkeypatch.setattr(slot, "header", lambda: (waiting.set(), header())[1])

        watch(keeper.ranks[0].files[commit_via_keeper(keeper, 0, 10)])
        monkeypatch.setattr(keeper_module, "SEAL_WAIT", 0.5)
        assert _persist_round(keeper, 1, 10, 20)["error"] == ("node 0: the checksum of rank 0's slot of step 10 was "
                                                              "not computed in 0.5 s")
        monkeypatch.setattr(keeper_module, "SEAL_WAIT", 600.0)
        waiting.clear()
        keeper.handle({"op": "poll", "generation": 0, "plan": 0, "restorable": 10, "persist_round": 2,
                       "persist": 10})
        assert waiting.wait(20)
        keeper.handle({"op": "corrupt", "rank": 0, "slot": keeper.ranks[0].index_of(10), "reason": "test"})
        assert _persist_round(keeper, 2, 10, 20)["error"] == ("node 0: rank 0's slot of step 10 was emptied before "
                                                              "its checksum was computed")
        watch(keeper.ranks[0].files[commit_via_keeper(keeper, 0, 20)])
        waiting.clear()
        keeper.handle({"op": "poll", "generation": 0, "plan": 0, "restorable": 20, "persist_round": 3,
                       "persist": 20})
        assert waiting.wait(20)
        keeper.stop()
        persister.join(20)
        assert not persister.is_alive(), "the persister outlived its keeper's stop"
    finally:
        keeper.stop()
        keeper.unlink_all()


def test_a_slot_the_sealer_seals_while_it_is_verified_stays_held(shm, monkeypatch):
    """The background sealer may seal the agreed step's slot while ``verify`` reads it (it lags under load): the
    seal changes the header, not the bytes, so the slot is verified, not dropped as changed (which would throw
    the newest snapshot away and restore an older one)."""
    keeper = Keeper(spec(), [])
    keeper.handle({"op": "poll", "generation": 0, "plan": 0, "restorable": 0})
    for rank in (0, 1):
        commit_via_keeper(keeper, rank, 10)
    slots = [keeper.ranks[rank].files[keeper.ranks[rank].index_of(10)] for rank in (0, 1)]
    assert not any(slot.header().sealed for slot in slots)
    plain = keeper_module.checksum

    def sealed_meanwhile(buf: Any, header: Any, threads: int | None = None) -> int:
        crc = plain(buf, header, threads)
        for slot in slots:  # the sealer got there first
            if slot.map is buf:
                slot.seal(crc)
        return crc

    monkeypatch.setattr(keeper_module, "checksum", sealed_meanwhile)
    reply = keeper.handle({"op": "verify", "generation": 1, "step": 10})
    assert reply["problems"] == {}, reply
    assert [rank.held() for rank in keeper.ranks] == [{10}, {10}]
    keeper.unlink_all()


def test_the_sealer_does_not_checksum_a_slot_sealed_already(shm, monkeypatch):
    """A commit queues its slot's seal; a generation start's ``verify`` may seal it first (the sealer lags under
    load): the sealer then skips it rather than read the whole slot once more."""
    keeper = Keeper(spec(), [])
    keeper.handle({"op": "poll", "generation": 0, "plan": 0, "restorable": 0})
    for rank in (0, 1):
        commit_via_keeper(keeper, rank, 10)
    assert keeper.handle({"op": "verify", "generation": 1, "step": 10})["problems"] == {}  # seals rank 0's and 1's
    calls: list[int] = []
    plain = keeper_module.checksum
    monkeypatch.setattr(keeper_module, "checksum", lambda buf, header, threads=None: (
        calls.append(header.step), plain(buf, header, threads))[1])
    commit_via_keeper(keeper, 0, 20)  # unsealed: the sealer's
    threading.Thread(target=keeper.seal_forever, daemon=True).start()  # blocks on its queue once done
    newest = keeper.ranks[0].files[keeper.ranks[0].index_of(20)]
    deadline = time.monotonic() + 30
    while not newest.header().sealed and time.monotonic() < deadline:
        time.sleep(0.01)
    assert newest.header().sealed and calls == [20], calls
    keeper.unlink_all()
