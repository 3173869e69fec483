"""The control store cannot be steered from outside: every value is signed with the job secret, a value that does
not verify is ignored with one warning, a replayed generation never moves the job backwards, each run of a job
id has its own keys, and stores listen on the address they are bound to. (A running job under attack:
test_hostile.py.)"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from datetime import timedelta

import psutil
import pytest
from torch.distributed import DistError, TCPStore

from conftest import SCRIPTS, assert_job_left_nothing, free_port
from ftrun.control.backend import StoreAddress, reconnect_timeout, reopen_store
from ftrun.control.coordination import Coordinator, Failure, Generation, open_run
from ftrun.control.signed import TAG_MARK, SignedStore
from ftrun.control.ownership import Owner, take
from ftrun.control import store as store_module
from ftrun.control.generation_watch import GenerationWatch
from ftrun.control.spec import STOP_KIND
from ftrun.control.store import LOOPBACK, C10dStore, check_bind_address, host_store, route_address
from ftrun.errors import UsageError
from ftrun.events import EventLog, read_events
from ftrun.launch.peers import PeerWatch
from ftrun.launch.slurm import SlurmStep, agree_node_rank
from ftrun.launch.rendezvous import nothing_replaces
from ftrun.snapshot import link as link_module
from ftrun.snapshot.link import Commits, Progress, ProgressTracker

SECRET = "0123456789abcdef" * 4
# a control store in a process of its own, which a test can kill: prints its port
STORE_HOST = ("import time; from ftrun.control.store import host_store; store = host_store(0); "
              "print(store.port, flush=True); time.sleep(120)")


def freeze(pid: int) -> None:
    """SIGSTOP ``pid`` and wait until it is stopped: the signal takes effect when the process is next scheduled, and
    a request sent before that is answered (the test then saw no freeze, about 1 run in 2)."""
    os.kill(pid, signal.SIGSTOP)
    process, deadline = psutil.Process(pid), time.monotonic() + 10
    while process.status() != psutil.STATUS_STOPPED:
        assert time.monotonic() < deadline, f"process {pid} did not stop"
        time.sleep(0.001)


@pytest.fixture
def server():
    store = host_store(0)
    store.set_timeout(timedelta(seconds=5))
    yield store
    del store


@pytest.fixture
def signed(server):
    """``make(secret=SECRET)``: a (SignedStore, warnings list) pair on the test's store."""

    def make(secret: str = SECRET) -> tuple[SignedStore, list[str]]:
        warnings: list[str] = []
        return SignedStore(C10dStore(server), secret, warnings.append), warnings

    return make


def coordinator(store: SignedStore, node: int = 0, run: int = 1) -> Coordinator:
    return Coordinator(store, "job", node, 2, run=run)


# -- the signed wrapper -------------------------------------------------------------------------------------------

def test_values_round_trip_and_bad_ones_read_as_absent_with_one_warning_per_key(server, signed):
    store, warnings = signed()
    store.set("k", b"payload \x00\xff")
    assert (store.get("k") == b"payload \x00\xff"
            and server.get("k").endswith(store.seal("k", b"payload \x00\xff")[-64:]))
    assert store.get("missing") is None and not warnings
    sealed = server.get("k")
    cases = {
        "tampered": sealed[:2] + b"X" + sealed[3:],
        "copied": None,  # the authentic value of "k", stored under another key
        "garbage": b"\xff garbage {",
        "truncated": sealed[:-10],
        "empty": b"",
        "wrong-secret": SignedStore(C10dStore(server), "another secret, long enough").seal("wrong-secret", b"x"),
        "tag-of-random-hex": b"7" + TAG_MARK + b"0" * 64,
    }
    for key, value in cases.items():
        server.set(key, sealed if value is None else value)
        assert store.get(key) is None, key
        assert store.get(key) is None, key  # a second read warns no more
    assert [w.split(" of ")[1].split(":")[0] for w in warnings] == list(cases)  # one line per key, naming it
    assert all("WARNING" in w and "sender unknown" in w for w in warnings)
    assert store.multi_get(["k", "garbage", "missing"]) == [b"payload \x00\xff", None, None]
    won, now = store.compare_set("garbage", b"\xff garbage {", "fixed")
    assert won and store.open("garbage", now) == b"fixed"


def test_a_store_of_another_job_secret_reads_nothing(server, signed):
    ours, _ = signed()
    theirs, warnings = signed("a different job's secret")
    ours.set("k", "v")
    assert theirs.get("k") is None and len(warnings) == 1


# -- generations -------------------------------------------------------------------------------------------------

def test_garbage_and_forged_generations_are_ignored_and_bump_replaces_them(server, signed):
    store, warnings = signed()
    coord = coordinator(store)
    coord.init_job({"nnodes": 2})
    seen = coord.current_raw()
    assert Generation.decode(seen).gen == 0
    key = coord.key("gen")
    forged = Generation(5, "crash", "forged").encode()
    for value in (b"\xff not json", forged.encode(), forged.encode() + TAG_MARK + b"0" * 64, b""):
        server.set(key, value)
        assert coord.current_raw() == seen
        assert coordinator(store, node=1).current_raw() == seen  # a fresh reader finds it in history/
    raw, won = coord.bump(seen, Failure("crash", "rank 1 crashed", 0, 1, "waitpid"))
    assert won and Generation.decode(raw).gen == 1 and coord.current_raw() == raw
    assert coordinator(store, node=1).current_raw() == raw
    assert [g.gen for g in coord.history()] == [0, 1]
    assert warnings and all(key in w for w in warnings)


def test_a_replayed_older_generation_never_moves_the_job_backwards(server, signed):
    store, warnings = signed()
    coord = coordinator(store)
    coord.init_job({"nnodes": 2})
    gen0 = server.get(coord.key("gen"))
    seen, _ = coord.bump(coord.current_raw(), Failure("crash", "first", 0, 0, "waitpid"))
    seen, _ = coord.bump(seen, Failure("hang", "second", 1, 2, "heartbeat"))
    server.set(coord.key("gen"), gen0)  # authentic, but generation 0
    assert Generation.decode(coord.current_raw()).gen == 2
    assert Generation.decode(coordinator(store, node=1).current_raw()).gen == 2  # fresh: history/ tells
    assert any("older than generation 2" in w for w in warnings)
    raw, won = coordinator(store, node=1).bump(seen, Failure("crash", "third", 1, 3, "waitpid"))
    assert won and Generation.decode(raw).gen == 3


def test_two_nodes_moving_the_job_for_the_same_failure_at_the_same_instant_one_wins(server, signed, monkeypatch):
    """A hang's culprit is agreed job-wide, so two nodes can bump with the same failure at once. A compare-and-set
    tells success by the bytes stored afterwards: two equal documents (their times equal too; CI saw two bumps
    0.7 us apart) made both nodes believe they won, and the failure was reported twice."""
    store, _ = signed()
    first = coordinator(store)
    first.init_job({"nnodes": 2})
    seen = first.current_raw()
    monkeypatch.setattr("ftrun.control.coordination.time.time", lambda: 1795684767.5142207)
    hang = Failure("hang", "rank 0 hung", 0, 0, "heartbeat", 45)
    stale = [store.get_raw(first.key("gen"))]
    second_store, _ = signed()
    read = second_store.get_raw
    second_store.get_raw = lambda key: stale.pop() if stale else read(key)  # read just before the first's write
    wins = [won for _, won in (first.bump(seen, hang), coordinator(second_store, node=1).bump(seen, hang))]
    assert wins == [True, False]
    assert Generation.decode(first.current_raw()).gen == 1


def test_counters_with_garbage_neither_raise_nor_drop_the_connection(server, signed):
    store, _ = signed()
    coord = coordinator(store)
    coord.touch_watched_keys()
    coord.beat()
    assert coord.beats() == [1, 0]
    server.set(coord.key("node", 0, "beat"), b"not a number")
    server.set(coord.key("node", 1, "beat"), b"\xff")
    assert coord.beats() == [1, 0]  # the last authentic counts stay
    coord.beat()  # goes on from the authentic count it knows
    assert coord.beats() == [2, 0]
    server.set(coord.key("node", 0, "owner"), b"12x")
    assert take(coord, 0, "a", "h") == 1 and take(coord, 0, "b", "h") == 2
    assert store.get("still/connected") is None


# -- runs (incarnations) -------------------------------------------------------------------------------------------

def test_a_lost_node_is_declared_once_while_its_replacement_is_awaited(server, signed, monkeypatch):
    """The regression of a replacement slower than --node-timeout: its predecessor's loss is not declared again
    (each declaration was one more generation, until --max-restarts ended the job)."""
    store, _ = signed()
    watcher, peer = coordinator(store, 0), coordinator(store, 1)
    watcher.init_job({"nnodes": 2})
    me = Owner(take(watcher, 0, "node0", "h"), "node0")
    assert take(peer, 1, "first", "h") == 1
    clock = [1000.0]
    monkeypatch.setattr("ftrun.launch.peers.time.monotonic", lambda: clock[0])

    def silent_for(watch: PeerWatch, seconds: float) -> tuple[int, float] | None:
        """Checks every 0.25 s (as the supervisor's) for ``seconds``: the first loss seen, or None."""
        for _ in range(round(seconds / 0.25)):
            clock[0] += 0.25
            if (lost := watch.check()) is not None:
                return lost
        return None

    peer.beat()
    first_owner = server.get(peer.key("node", 1, "owner"))
    assert silent_for(PeerWatch(watcher, 0, 2, 1.0, me), 3.0)[0] == 1  # lost: declared
    watcher.bump(watcher.current_raw(), Failure("node-lost", "node 1 lost", 1, detected_by="test", incarnation=1))
    assert silent_for(PeerWatch(watcher, 0, 2, 1.0, me), 30.0) is None  # the next generation waits for it
    awaiting = PeerWatch(watcher, 0, 2, 1.0, me)
    assert silent_for(awaiting, 0.5) is None
    assert take(peer, 1, "replacement", "h") == 2  # a new owner has the timeout to beat from its take
    assert silent_for(awaiting, 0.75) is None
    server.set(peer.key("node", 1, "owner"), first_owner)  # a replayed older owner starts no clock
    assert silent_for(awaiting, 0.75)[0] == 1  # ... and is lost when it does not
    watcher.bump(watcher.current_raw(), Failure("node-lost", "node 1 lost", 1, detected_by="test", incarnation=2))
    peer.beat()  # it was alive after all: it rejoins the generation, and is watched again
    peer.rejoin(2)
    assert silent_for(PeerWatch(watcher, 0, 2, 1.0, me), 3.0)[0] == 1


def test_under_srun_a_lost_node_whose_ftrun_beats_is_waited_for_and_one_whose_ftrun_is_gone_ends_the_step(
        server, signed):
    """A supervisor stalled past --node-timeout (stopped, frozen) while its ftrun lived was taken for a node whose
    ftrun is gone: the other nodes ended the SLURM step, though it could come back or its ftrun replace it. They
    now end it for a lost node only when its ftrun has not beaten since their last look."""
    store, _ = signed()
    watcher, peer = coordinator(store, 0), coordinator(store, 1)
    watcher.init_job({"nnodes": 2})
    take(watcher, 0, "node0", "h")
    assert take(peer, 1, "first", "h") == 1
    peer.beat_launcher(1)
    watcher.bump(watcher.current_raw(), Failure("node-lost", "node 1 lost", 1, detected_by="test", incarnation=1))
    launchers = watcher.launcher_beats([1])  # as a rendezvous begins
    peer.beat_launcher(1)
    assert nothing_replaces(watcher, [1], launchers) is None  # its ftrun lives: wait
    assert nothing_replaces(watcher, [1], launchers) == 1  # it stopped beating since the last look: gone
    store.set(watcher.key("node", 1, "replacing"), "1")
    assert nothing_replaces(watcher, [1], launchers) is None  # its ftrun starts a replacement: wait for it


def counted(server: TCPStore) -> tuple[C10dStore, list[int]]:
    """A store on ``server`` that counts its round trips (every call of the TCPStore client)."""
    trips = [0]

    class Counted:
        def __init__(self, tcp: TCPStore) -> None:
            self.tcp = tcp

        def __getattr__(self, name: str):
            def call(*args, **kwargs):
                trips[0] += 1
                return getattr(self.tcp, name)(*args, **kwargs)
            return call

    raw = C10dStore(server)
    raw.tcp = Counted(raw.tcp)
    return raw, trips


def test_a_watching_supervisors_look_costs_two_round_trips(server):
    """check + multi_get for the generation, the hang vote and the peers' keys together: with any key absent a c10d
    store reads them one by one, so every key a look reads exists (it was 4 round trips with the generation and
    the hang vote read on their own, 2 + N + 1 with the vote's key absent)."""
    raw, trips = counted(server)
    coords = [Coordinator(SignedStore(raw, SECRET), "job", n, 4, run=1) for n in range(4)]
    coords[0].init_job({"nnodes": 4})
    for node, coord in enumerate(coords):
        take(coord, node, f"node{node}", "h")
        coord.touch_watched_keys()
        coord.beat()
    watch = PeerWatch(coords[0], 0, 4, 5.0, Owner(1, "node0"))
    seen = coords[0].current_raw()
    trips[0] = 0
    for _ in range(10):
        current, vote, values = coords[0].look(watch.keys)
        assert current == seen and not Coordinator.hang_vote_open(vote, 0)
        assert watch.check(values) is None
    assert trips[0] == 20
    coords[2].open_hang_vote(0)  # a peer attributes a hang: every look sees it
    assert Coordinator.hang_vote_open(coords[1].look([])[1], 0)
    assert not Coordinator.hang_vote_open(coords[1].look([])[1], 1)  # another generation's (a replay) is not open


def test_a_wait_on_every_node_costs_one_round_trip_while_one_is_missing(server):
    """``marked``: None (one round trip) while a node has not set its key or its value is not authentic; every
    value once all are there. ``marks`` reads the keys one by one meanwhile."""
    raw, trips = counted(server)
    coords = [Coordinator(SignedStore(raw, SECRET), "job", n, 8, run=1) for n in range(8)]
    for coord in coords[:7]:
        coord.mark(1, "ready", 5)
    trips[0] = 0
    assert coords[0].marked(1, "ready") is None
    assert trips[0] == 1
    trips[0] = 0
    assert len(coords[0].marks(1, "ready")) == 7
    assert trips[0] == 1 + 8  # check, then one key at a time
    assert coords[0].marked(1, "ready", [0, 3]) == {0: "5", 3: "5"}
    raw.set(coords[7].key("gen", 1, "ready", 7), b"5")  # not signed: not authentic
    assert coords[0].marked(1, "ready") is None
    coords[7].mark(1, "ready", 5)
    assert coords[0].marked(1, "ready") == dict.fromkeys(range(8), "5")


def test_node_0_computes_the_progress_and_the_others_read_one_key(server, tmp_path):
    """6 nodes in EC groups of 3 (m = 1): node 0 reads every node's commit and parity documents (4 round trips)
    and publishes the committed and protected steps and each group's; any other node reads one key (1 round
    trip), whatever the number of nodes."""
    raw, trips = counted(server)
    coords = [Coordinator(SignedStore(raw, SECRET), "job", n, 6, run=1) for n in range(6)]
    coords[0].init_job({"nnodes": 6})
    events = EventLog("test", str(tmp_path))
    trackers = [ProgressTracker(coord, 6, 3, 1, events) for coord in coords]
    for tracker in trackers:
        tracker.start(10)

    def publish(what: str, steps: dict[int, list[int]], decided: int = 0) -> None:
        for node, held in steps.items():
            doc = (Commits(frozenset(held), frozenset(held), decided or max(held)).encode() if what == "commit"
                   else json.dumps(held))
            coords[node].store.set(coords[node].key("gen", 1, what, node), doc)

    publish("commit", {n: [10, 20] for n in range(6)})
    publish("parity", {n: [10, 20] if n < 3 else [10] for n in range(6)})  # group 1 still encodes step 20
    trips[0] = 0
    assert trackers[4].look(1) == Progress(10, 10)  # nothing published yet
    assert trips[0] == 1
    trips[0] = 0
    assert trackers[0].look(1) == Progress(20, 10)
    assert trips[0] == 4 + 1 + 2  # commit and parity (check + multi_get each), progress, each group's step
    assert (coords[3].get("group", 0, "protected"), coords[3].get("group", 1, "protected")) == (b"20", b"10")
    trips[0] = 0
    assert trackers[4].look(1) == Progress(20, 10)
    assert trips[0] == 1
    publish("parity", {n: [10, 20] for n in range(3, 6)})
    assert trackers[0].look(1) == Progress(20, 20)
    assert trackers[5].look(1) == Progress(20, 20)
    assert [(e["group"], e["step"]) for e in read_events(str(tmp_path)) if e["event"] == "protected"] == \
        [(0, 20), (1, 10), (1, 20)]
    publish("commit", {n: [20] for n in range(6)})  # older steps dropped: what was learned stays
    assert trackers[0].look(1) == Progress(20, 20) and trackers[1].look(1) == Progress(20, 20)
    # a rank of node 4 skipped step 30, which the others took: abandoned job-wide until a newer step is protected
    publish("commit", {n: [20, 30] for n in range(6) if n != 4})
    publish("commit", {4: [20]}, decided=29)  # not yet: its ranks may still take 30
    assert trackers[0].look(1) == Progress(20, 20) == trackers[2].look(1)
    publish("commit", {4: [20]}, decided=30)
    assert trackers[0].look(1) == Progress(20, 20, frozenset({30})) == trackers[2].look(1)
    publish("commit", {n: [30, 40] if n != 4 else [20, 40] for n in range(6)})
    publish("parity", {n: [20, 40] for n in range(6)})
    assert trackers[0].look(1) == Progress(40, 40) == trackers[2].look(1)


def test_a_progress_document_deleted_from_the_store_is_written_again(server, tmp_path, monkeypatch):
    """Anyone who reaches the store may delete node 0's ``progress``: while the step is still pending, node 0's
    next look after :data:`~ftrun.snapshot.link.REPUBLISH` writes it again though it did not change, so the
    other nodes learn it (before: never, and their trainers waited for ever)."""
    coords = [Coordinator(SignedStore(C10dStore(server), SECRET), "job", n, 2, run=1) for n in range(2)]
    coords[0].init_job({"nnodes": 2})
    trackers = [ProgressTracker(coord, 2, 2, 1, EventLog("test", str(tmp_path))) for coord in coords]
    for node, coord in enumerate(coords):
        coord.store.set(coord.key("gen", 1, "commit", node), Commits(frozenset({10, 20})).encode())
        coord.store.set(coord.key("gen", 1, "parity", node), json.dumps([10]))
    monkeypatch.setattr(link_module, "REPUBLISH", 3600.0)
    assert trackers[0].look(1) == Progress(20, 10)
    server.delete_key(coords[0].key("gen", 1, "progress"))
    assert trackers[0].look(1) == Progress(20, 10) and trackers[1].look(1) == Progress(0, 0)  # not yet
    monkeypatch.setattr(link_module, "REPUBLISH", 0.0)
    assert trackers[0].look(1) == Progress(20, 10)
    assert trackers[1].look(1) == Progress(20, 10)


def test_an_unexpected_error_of_the_keeper_link_ends_the_job_in_one_line(capsys):
    """The link thread agrees each generation's restore step; it caught the keeper's and the store's errors only,
    so any other (a bug, an OSError of a disk it reads) ended the thread silently and every restart after waited
    in restore() until the initial hang timeout. It now sets ``fatal``, which the supervisor turns into the job's
    end, and prints the traceback."""
    link = object.__new__(link_module.KeeperLink)  # the state run() reads: no keeper, no store
    link.node, link.parity, link.fatal, link.durability = 1, 0, None, None
    link._halt, link._generation, link._plans, link._interval = threading.Event(), 3, {}, 0.01

    def agree(gen: int) -> None:
        raise ZeroDivisionError("division by zero")

    link._agree = agree
    link.run()  # returns: the thread ends
    assert link.fatal == ("node 1's keeper link failed (ZeroDivisionError: division by zero); without it the nodes "
                          "cannot agree a restore step (traceback above)")
    assert "in agree" in capsys.readouterr().err


def test_a_generation_watch_tells_every_move_at_once_a_forged_one_changes_nothing_and_a_lost_store(monkeypatch):
    """The supervisor's GenerationWatch, on a connection of its own: set by each move (a failure's, a stop's),
    never without one, once by a forged history key (the generation read then is the same), and when the store's
    process dies. Its rounds are made short: a round that ends unanswered goes on waiting on the same connection."""
    monkeypatch.setattr(store_module, "_WAIT_ROUND", timedelta(milliseconds=100))
    host = subprocess.Popen([sys.executable, "-c", STORE_HOST], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        port = int(host.stdout.readline())
        store = SignedStore(C10dStore(TCPStore(LOOPBACK, port, is_master=False)), SECRET, lambda message: None)
        coord = coordinator(store)
        coord.init_job({"nnodes": 2})
        seen = coord.current_raw()
        watcher = coordinator(store, node=1)
        watch = GenerationWatch(C10dStore(TCPStore(LOOPBACK, port, is_master=False)), watcher, after=0)
        assert not watch.moved.wait(0.5)  # several rounds, nothing moved
        coordinator(store, node=1).current_raw()  # a fresh reader reads the missing history/1: the store wakes
        assert not watch.moved.wait(0.3)  # the watch's wait, which must not take that for a move
        for failure in (Failure("crash", "rank 1 crashed", 0, 1, "waitpid"), Failure(STOP_KIND, "stop", 0)):
            seen, won = coord.bump(seen, failure)
            assert won and watch.moved.wait(10)
            watch.moved.clear()
            assert watcher.current_raw() == seen
        store.raw.set(coord.key("history", 3), b"forged")
        assert watch.moved.wait(10) and not watch.lost
        watch.moved.clear()
        assert watcher.current_raw() == seen and not watch.moved.wait(0.3)
        host.kill()
        assert watch.moved.wait(10) and watch.lost
    finally:
        host.kill()
        host.wait()


@pytest.mark.timeout(60)
def test_a_store_whose_host_is_frozen_fails_its_operations_within_the_timeout():
    """A store process stopped (SIGSTOP: a frozen host) accepts requests and never answers; torch's client waited
    forever (a frozen node 0 froze every node of the job). The watchdog cuts the connection: the operation waiting
    and every later one raise DistError, saying why."""
    host = subprocess.Popen([sys.executable, "-c", STORE_HOST], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        port = int(host.stdout.readline())
        store = C10dStore(TCPStore(LOOPBACK, port, is_master=False), op_timeout=1.0)
        store.set("key", b"value")
        assert store.get_many(["key", "missing"]) == [b"value", None]
        freeze(host.pid)
        began = time.monotonic()
        with pytest.raises(DistError, match=f"control store at {LOOPBACK}:{port} did not answer for 1s"):
            store.get_many(["key"])
        assert time.monotonic() - began < 10
        with pytest.raises(DistError):
            store.set("key", b"again")
    finally:
        host.kill()
        host.wait()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("then", ["answers", "dies"])
def test_a_store_frozen_for_a_while_is_one_pause_line_and_one_line_when_it_answers_again(then):
    """As etcd's outages: an operation unanswered for 2 s is told once, and its answer once (the job pauses). One
    that fails instead (the store's host gone: as a c10d node 0 cut off the network, its connection reset or timed
    out) is no answer: 'control store back after 13s; going on' came just before 'control store lost: Connection
    timed out'."""
    host = subprocess.Popen([sys.executable, "-c", STORE_HOST], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    said: list[str] = []
    try:
        port = int(host.stdout.readline())
        store = C10dStore(TCPStore(LOOPBACK, port, is_master=False), op_timeout=30.0, on_outage=said.append,
                          on_recovered=lambda seconds: said.append(f"back after {seconds:.0f}s"),
                          on_failed=lambda: said.append("failed"))
        store.set("key", b"value")
        freeze(host.pid)
        if then == "dies":
            threading.Timer(3.5, host.kill).start()  # after the pause line: the operation fails, unanswered
            with pytest.raises(DistError):
                store.get_many(["key"])
            assert len(said) == 2 and "has not answered for" in said[0] and said[1] == "failed", said
            return
        threading.Timer(5.5, os.kill, (host.pid, signal.SIGCONT)).start()  # several looks of the watchdog: one
        assert store.get_many(["key"]) == [b"value"]  # late under load still leaves another
        assert len(said) == 2 and re.search(r"has not answered for [2-5]s; ftrun waits up to 30s", said[0]), said
        assert said[1] in ("back after 5s", "back after 6s"), said
        store.set("key", b"again")  # answered at once: nothing more said
        assert len(said) == 2
    finally:
        host.kill()
        host.wait()


def test_a_connection_opened_after_the_store_was_reached_waits_for_it_as_long_as_an_operation():
    """A supervisor's later connections (its beats, its generation watch, its keeper's link) waited --rdzv-timeout
    (600 s) for a c10d store gone meanwhile (node 0 cut off during the first rendezvous), under a line saying
    "ftrun waits up to 60s for it", then ended in a traceback (UsageError): now 60 s, then the store is lost as
    for a failed operation. etcd's wait is its quorum pause."""
    c10d, etcd = StoreAddress("c10d", "10.0.0.1:29400"), StoreAddress("etcd", "10.0.0.1:2379")
    assert reconnect_timeout(c10d, 600) == 60 and reconnect_timeout(c10d, 20) == 20
    assert reconnect_timeout(etcd, 600) == 600
    # not reached: the store is lost, as when an operation fails (the supervisor's traceback ended in UsageError)
    with pytest.raises(DistError, match="unreachable after 1s"):
        reopen_store(StoreAddress("c10d", f"{LOOPBACK}:{free_port()}"), 1)


def test_each_run_of_a_job_id_has_its_own_keys(server, signed):
    store, warnings = signed()
    first = open_run(store, "job", None)
    assert first == 1 and open_run(store, "job", None) == 1  # a later node joins the running run
    old = Coordinator(store, "job", 0, 2, run=first)
    old.init_job({"nnodes": 2})
    old.store.set(old.key("persist", "done"), "60")
    old.store.set(old.key("state"), "failed")  # its launcher ended it
    second = open_run(store, "job", None)
    new = Coordinator(store, "job", 0, 2, run=second)
    assert second == 2 and new.get("persist", "done") is None and new.job_doc() is None
    assert Coordinator(store, "job", 0, 2).run == 2  # readers (ftrun status) follow the current run
    # SLURM steps: one run per step, whatever the previous step left
    step1 = open_run(store, "job", "slurm-7.1")
    assert step1 == 3 and open_run(store, "job", "slurm-7.1") == 3 and open_run(store, "job", "slurm-7.2") == 4
    # a replayed incarnation document cannot send a new launcher into an old run
    server.set("ftrun/job/incarnation", store.seal("ftrun/job/incarnation", json.dumps({"run": 1, "token": None})))
    Coordinator(store, "job", 0, 2, run=4).init_job({"nnodes": 2})
    assert open_run(store, "job", None) == 5 and any("a replay" in w for w in warnings)
    Coordinator(store, "job", 0, 2, run=5).init_job({"nnodes": 2})
    server.set("ftrun/job/incarnation", b"garbage")
    assert open_run(store, "job", None) == 6


def test_a_node_with_another_secret_is_told_so_at_once(server, signed):
    """Two hosts without a shared home directory each made their own ~/.ftrun/secret: the second node ignored
    the first's values, started a run of its own, and both waited --rdzv-timeout (600 s) for the other."""
    store, _ = signed()
    run = open_run(store, "job", None)
    Coordinator(store, "job", 0, 2, run=run).init_job({"nnodes": 2})
    other, warnings = signed("another secret")
    with pytest.raises(UsageError, match="signed with another secret: every node of a job needs the same secret "
                                         r"file \(--secret-file"):
        open_run(other, "job", None)
    assert warnings == []  # the one line above, not a warning first
    assert open_run(store, "job", None) == run  # nothing changed for the job


def test_a_run_whose_supervisors_stopped_beating_is_not_joined(server, signed):
    store, _ = signed()
    run = open_run(store, "job", None)
    coord = Coordinator(store, "job", 0, 2, run=run)
    coord.init_job({"nnodes": 2})
    coord.touch_watched_keys()
    coord.beat()  # then it died without its launcher marking the end
    assert open_run(store, "job", None, stale_after=0.2) == run + 1


def test_slurm_rank_agreement_waits_for_authentic_claims(server, signed, tmp_path, monkeypatch):
    monkeypatch.setenv("FTRUN_SHM_DIR", str(tmp_path))  # the claim files
    store, warnings = signed()
    steps = [SlurmStep("7", "0", node_id, f"n{node_id}", 2, ["n0", "n1"], 1) for node_id in (0, 1)]
    server.set("ftrun/job/slurm-step/0/claim/1", b"0")  # unsigned: "node 1 holds rank 0"
    ranks: dict[int, int] = {}
    late = threading.Timer(0.3, lambda: ranks.update({1: agree_node_rank(store, "job", steps[1], 0, 10)}))
    late.start()
    ranks[0] = agree_node_rank(store, "job", steps[0], 1, 10)
    late.join()
    assert ranks == {0: 1, 1: 0} and len(warnings) == 1


# -- binding ---------------------------------------------------------------------------------------------------------

def listeners(pid: int) -> list[str]:
    return [f"{c.laddr.ip}:{c.laddr.port}" for c in psutil.Process(pid).net_connections("inet")
            if c.status == psutil.CONN_LISTEN]


def test_stores_listen_on_the_bound_address_only(server):
    assert f"{LOOPBACK}:{server.port}" in listeners(os.getpid())
    assert not {f"0.0.0.0:{server.port}", f":::{server.port}"} & set(listeners(os.getpid()))  # no wildcard
    client = TCPStore(LOOPBACK, server.port, is_master=False, timeout=timedelta(seconds=5))
    client.set("x", "1")
    assert server.get("x") == b"1"
    assert route_address("127.0.0.1", 29400) == "127.0.0.1"
    assert check_bind_address("0.0.0.0") == "0.0.0.0" and check_bind_address("localhost") == "127.0.0.1"
    with pytest.raises(UsageError, match="198.51.100.77 is not an address of this host"):
        check_bind_address("198.51.100.77")
    with pytest.raises(UsageError, match="already in use"):
        host_store(server.port)
    external = [a.address for addrs in psutil.net_if_addrs().values() for a in addrs
                if a.family == socket.AF_INET and not a.address.startswith("127.")]
    if external:  # multi-node default: the address of the interface on the way to the endpoint, nothing else
        assert route_address(external[0], 29400) == external[0]
        before = set(listeners(os.getpid()))  # another test's socket may hold the same port on another address
        other = host_store(0, bind=external[0])
        assert set(listeners(os.getpid())) - before == {f"{external[0]}:{other.port}"}


def test_control_store_connections_resend_at_least_every_second(server):
    """A beat lost on the way is sent again within a second of the network's return, not after TCP's doubling
    pauses (up to about twice a cut): both ends of every connection to the control store bound them."""
    with socket.socket() as probe:
        try:
            probe.setsockopt(socket.IPPROTO_TCP, store_module.TCP_RTO_MAX_MS, store_module.RESEND_MAX_MS)
        except OSError:
            pytest.skip("this kernel cannot bound TCP's resends (TCP_RTO_MAX_MS: Linux >= 6.15)")
    client = store_module.connect_store(LOOPBACK, server.port, 5)
    client.set("x", "1")
    ends = [c for c in psutil.Process().net_connections(kind="tcp") if c.status == psutil.CONN_ESTABLISHED
            and server.port in (c.laddr.port, c.raddr.port if c.raddr else None)]
    assert len(ends) >= 2, ends  # the client's end and the server's
    for end in ends:
        with socket.socket(fileno=os.dup(end.fd)) as sock:
            assert sock.getsockopt(socket.IPPROTO_TCP, store_module.TCP_RTO_MAX_MS) == 1000, end


@pytest.mark.timeout(60)
def test_ftrun_store_binds_its_host_and_refuses_a_foreign_one():
    bad = subprocess.run([sys.executable, "-m", "ftrun", "store", "--host", "198.51.100.77", "--port", "0"],
                         capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        bad.stderr.strip()] and "198.51.100.77 is not an address of this host" in bad.stderr
    store = subprocess.Popen([sys.executable, "-m", "ftrun", "store", "--host", "127.0.0.1", "--port", "0"],
                             stdout=subprocess.PIPE, text=True)
    try:
        line = store.stdout.readline()
        assert line.startswith("ftrun store listening on 127.0.0.1:"), line
        assert all(a.startswith("127.0.0.1:") for a in listeners(store.pid))
    finally:
        store.kill()
        store.wait(10)


# -- a later run ---------------------------------------------------------------------------------------------------

@pytest.mark.timeout(180)
def test_a_later_run_of_a_job_id_at_a_long_lived_store_starts_clean(start_job, tmp_path):
    port = free_port()
    store = subprocess.Popen([sys.executable, "-m", "ftrun", "store", "--host", "127.0.0.1", "--port", str(port)],
                             stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert "listening" in store.stdout.readline()
        job_id = f"reused{uuid.uuid4().hex[:6]}"
        node = ("--nnodes", "1", "--node-rank", "0", "--rdzv-endpoint", f"127.0.0.1:{port}", "--nproc-per-node", "1")
        script = (str(SCRIPTS / "sleeper.py"), "--seconds", "1")
        first = start_job(*node, "--inject", "crash@rank=0,step=5", *script, job_id=job_id, log_dir=tmp_path / "1")
        assert first.wait(120) == 0 and "1 failure(s), 1 restart(s)" in first.output, first.output
        second = start_job(*node, *script, job_id=job_id, log_dir=tmp_path / "2")
        assert second.wait(120) == 0 and "0 failure(s), 0 restart(s)" in second.output, second.output
        assert [e["generation"] for e in second.events() if e["event"] == "trainers_started"] == [0]
        assert_job_left_nothing(second)
    finally:
        os.killpg(store.pid, signal.SIGKILL)
        store.wait(10)
