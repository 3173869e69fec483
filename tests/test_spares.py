"""Hot spares: a lost node's rank goes to a warm spare (one claim wins), and the job ends bit-for-bit as without
the loss; node-rank ownership and claims on a real store."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from conftest import (NODES, SCRIPTS, assert_job_left_nothing, free_port, gpt_args, primary_failures,
                      run_bitwise)
from ftrun.control.coordination import Coordinator, Failure, use_job
from ftrun.control.ownership import SpareDoc, claim, enlist, owner, spare_doc, spares, take, update_spare
from ftrun.control.store import C10dStore, host_store
from ftrun.events import EventLog, read_events
from ftrun.launch.fencing import fence_verdict
from ftrun.launch.leaving import _ACK_TIMEOUT, staying
from ftrun.launch.peers import SpareWatch
from ftrun.launch.processes import RESTART_LIMIT
from ftrun.launch.spare_pool import SparePool
from ftrun.snapshot import keeper
from ftrun.snapshot.protocol import listen, socket_name
from ftrun.snapshot.slot import META_HEADROOM

WORKER = Path(__file__).parents[1] / "benchmarks" / "erasure_worker.py"


def test_two_spares_racing_for_a_lost_rank_one_claims_it():
    use_job("spares", "a secret long enough for the test")
    server = host_store(0)
    coord = Coordinator(C10dStore(server), "spares", 0, 2, run=1)
    assert take(coord, 1, "first", "h") == 1
    wins: list[int | None] = []

    def race(name: str) -> None:
        wins.append(claim(Coordinator(C10dStore(server), "spares", -1, 2, run=1), 1, 1, name, name, "h"))

    threads = [threading.Thread(target=race, args=(f"spare-{i}",)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(wins, key=str) == [2] + [None] * 7
    winner = owner(coord, 1)[1]
    assert winner is not None and winner.incarnation == 2 and winner.spare is not None
    assert winner.id != "first"  # the lost owner is fenced out
    assert claim(coord, 1, 1, "late", "late", "h") is None  # the lost incarnation was replaced already
    assert take(coord, 1, "by-hand", "h") == 3  # a supervisor started for the rank takes it whatever is there


def test_a_launcher_s_replacement_first_to_a_lost_rank_keeps_the_spares_out():
    """The replacement a multi-node launcher starts for its dead supervisor claims the rank from the lost
    incarnation (0: the supervisor died before it took the rank): first, it holds the rank and a spare's claim
    from the same incarnation fails, instead of taking the rank from a supervisor that already runs it."""
    use_job("spares", "a secret long enough for the test")
    coord = Coordinator(C10dStore(host_store(0)), "spares", 0, 2, run=1)
    assert claim(coord, 0, 0, "replacement-0", None, "h") == 1  # no owner yet
    assert take(coord, 1, "first", "h") == 1
    assert claim(coord, 1, 1, "replacement", None, "h") == 2
    assert claim(coord, 1, 1, "spare-0", "spare-0", "h") is None
    held = owner(coord, 1)[1]
    assert held is not None and held.id == "replacement" and held.spare is None


def test_a_supervisor_declared_lost_is_not_declared_again_when_its_launcher_finds_it_dead():
    """A node's launcher that finds its supervisor dead does not declare the loss of an incarnation a peer has
    declared already: by the current generation's document (whose ``node/<r>/lost`` is written a moment after
    it), or by ``node/<r>/lost`` when a later generation came (until the supervisor rejoins, alive after all)."""
    use_job("declared", "a secret long enough for the test")
    server = host_store(0)
    coord = Coordinator(C10dStore(server), "declared", 0, 2, run=1)
    coord.init_job({"nnodes": 2})
    assert take(coord, 1, "first", "h") == 1
    start = coord.current_raw()
    assert not coord.declared_lost(start, 1, 1)
    lost, won = coord.bump(start, Failure("node-lost", "node 1 lost", 1, None, "node 0", incarnation=1))
    assert won and coord.declared_lost(lost, 1, 1)
    assert not coord.declared_lost(lost, 1, 2) and not coord.declared_lost(lost, 0, 1)
    coord.store.set(coord.key("node", 1, "lost"), "")  # as just before the bump writes it
    assert coord.declared_lost(lost, 1, 1)
    coord.store.set(coord.key("node", 1, "lost"), "1")
    later, won = coord.bump(lost, Failure("crash", "rank 0 exited with code 1", 0, 0, "waitpid"))
    assert won and coord.declared_lost(later, 1, 1)
    Coordinator(C10dStore(server), "declared", 1, 2, run=1).rejoin(1)  # it was alive after all
    assert not coord.declared_lost(later, 1, 1)


def test_spares_enlisting_at_once_get_distinct_places():
    """Two spares that enlist together used to both store "1" as the count, both believe they had stored it (the
    store compares bytes, and signing is deterministic) and share index 0: one's "took" record then overwrote
    the other's, and the summary forgot which spare took the node."""
    use_job("spares-enlist", "a secret long enough for the test")
    server = host_store(0)
    barrier = threading.Barrier(8)
    places: list[int] = []

    def join(name: str) -> None:
        coord = Coordinator(C10dStore(server), "spares-enlist", -1, 2, run=1)
        barrier.wait()
        places.append(enlist(coord, spare_doc(name, "h", 1)))

    threads = [threading.Thread(target=join, args=(f"spare-{i}",)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(places) == list(range(8))
    listed = spares(Coordinator(C10dStore(server), "spares-enlist", 0, 2, run=1))
    assert sorted(d.name for d in listed) == [f"spare-{i}" for i in range(8)]


def test_node_0_waits_at_its_end_for_a_spare_that_took_a_rank_whose_first_launcher_said_goodbye():
    """Node 0's launcher keeps the control store up until every node's current owner said it left. The launcher of
    a node whose rank a spare took used to say goodbye for the node (the extended test of a survivor cut off during
    a rebuild: node 0 closed the store while the spare still ran, and the spare ended with exit 3, "control store
    lost"): a goodbye now names the incarnation that leaves, and that launcher says none."""
    use_job("staying", "a secret long enough for the test")
    coord = Coordinator(C10dStore(host_store(0)), "staying", 0, 3, run=1)
    for node in range(2):
        take(coord, node, f"first-{node}", "h")
    assert staying(coord, set()) == [0, 1]  # node 2 never had an owner: nothing to wait for
    coord.store.set(coord.key("node", 1, "lost"), "1")
    assert claim(coord, 1, 1, "spare-0", "spare-0", "h") == 2
    coord.store.set(coord.key("gen", 0, "left", 1), "1")  # a goodbye of incarnation 1 (not the spare's)
    coord.store.set(coord.key("gen", 0, "left", 0), "1")
    gone: set[int] = set()
    assert staying(coord, gone) == [1] and gone == {0, 2}
    coord.store.set(coord.key("gen", 0, "left", 1), "2")  # the spare's
    assert staying(coord, gone) == [] and gone == {0, 1, 2}


def test_a_launcher_kills_its_supervisor_of_a_node_at_once_when_a_spare_took_it_else_a_timeout_after_its_loss():
    """Fencing.end_lost's decision (fence_verdict), driven on a real store with the clock passed in: a
    supervisor whose loss is declared is killed only ``node_timeout`` after this launcher first saw that, and not
    once it rejoined; one whose rank a spare took, at once, unless this launcher handed the node to that spare or
    the spare is no newer than the incarnation its replacement takes over from."""
    use_job("fence", "a secret long enough for the test")
    coord = Coordinator(C10dStore(host_store(0)), "fence", 0, 2, run=1)
    stalled: dict[int, float] = {}

    def verdict(now: float, handed_to: str | None = None, replaced: int = 0) -> tuple[int, bool] | None:
        found = fence_verdict(coord, 1, handed_to, replaced, stalled, 10.0, now)
        return None if found is None else (found[0].incarnation, found[1])

    assert verdict(0.0) is None and stalled == {}  # nobody holds the rank
    assert take(coord, 1, "first", "h") == 1
    assert verdict(1.0) is None and stalled == {}  # a slow supervisor, however slow, is never killed
    coord.store.set(coord.key("node", 1, "lost"), "1")
    assert verdict(100.0) is None and verdict(110.0) is None and stalled == {1: 100.0}
    assert verdict(110.5) == (1, False) and stalled == {}  # stalled: killed node_timeout after its loss was seen
    assert verdict(200.0) is None and stalled == {1: 200.0}
    coord.store.set(coord.key("node", 1, "lost"), "")  # it rejoined in time
    assert verdict(300.0) is None and stalled == {}
    coord.store.set(coord.key("node", 1, "lost"), "1")
    assert verdict(0.0, replaced=1) is None and stalled == {}  # the lost owner that a replacement here takes over
    assert claim(coord, 1, 1, "spare-0", "spare-0", "h") == 2
    assert verdict(400.0) == (2, True) and stalled == {}  # a spare took the rank: at once
    assert verdict(400.0, handed_to="spare-0") is None  # the spare this launcher handed the node to
    assert verdict(400.0, replaced=2) is None  # no newer than what this launcher's replacement takes over from


@pytest.mark.timeout(30)
def test_a_spare_counts_as_waiting_only_while_it_beats():
    """A spare's record stays "waiting" when the spare is killed while it waits; the nodes that count on it see
    its beats instead: one whose count stops for the timeout is not waiting, one that took a rank neither."""
    use_job("spare-beats", "a secret long enough for the test")
    coord = Coordinator(C10dStore(host_store(0)), "spare-beats", 0, 2, run=1)
    watch = SpareWatch(coord, timeout=0.2)
    assert not watch.waiting()  # none enlisted
    live, dead = (enlist(coord, spare_doc(name, "h", 1)) for name in ("live", "dead"))
    coord.store.set(coord.key("spares", dead, "beat"), "1")  # beats once, then is killed
    for beat in range(1, 6):  # the live one beats before every look: always waiting
        coord.store.set(coord.key("spares", live, "beat"), str(beat))
        assert watch.waiting()
        time.sleep(0.05)
    update_spare(coord, live, SpareDoc("live", "h", 1, "took", node=1))
    while watch.waiting():  # the dead one counts until its count has not moved for the timeout
        time.sleep(0.02)
    coord.store.set(coord.key("spares", dead, "beat"), "2")  # it beats again after all (it was only stalled)
    assert watch.waiting()


def test_a_spare_watch_kept_up_at_every_poll_looks_a_few_times_per_timeout():
    """Under srun a supervisor's rendezvous asks SpareWatch whether a spare waits once per --node-timeout, but must
    look at it more often than every half timeout (a longer gap restarts every spare's clock). It looked at every
    peer check (4 per second, two round trips each, on every node, for as long as the job waited for a node); it
    now looks SPARE_LOOKS times per timeout whatever the callers' poll rate."""

    class CountingStore(C10dStore):
        reads = 0

        def get_many(self, keys: list[str]) -> list[bytes | None]:
            CountingStore.reads += 1
            return super().get_many(keys)

    use_job("spare-looks", "a secret long enough for the test")
    coord = Coordinator(CountingStore(host_store(0)), "spare-looks", 0, 2, run=1)
    enlist(coord, spare_doc("waiting", "h", 1))
    watch = SpareWatch(coord, timeout=600.0)
    before = CountingStore.reads
    for _ in range(50):  # polls well within a quarter of the timeout: no look
        watch.keep_up()
    assert CountingStore.reads == before
    assert watch.waiting() and CountingStore.reads > before  # the caller's own question still looks
    quick = SpareWatch(coord, timeout=0.004)
    time.sleep(0.002)
    before = CountingStore.reads
    quick.keep_up()  # a quarter of its timeout passed: a look
    assert CountingStore.reads > before


@pytest.mark.timeout(90)
@pytest.mark.timeout(60)
def test_a_standby_whose_c10d_store_goes_away_while_it_joins_says_so_in_one_line(start_job, tmp_path):
    """A --standby waiting for the job at a c10d store whose host went away (node 0 lost during the first
    rendezvous, its host cut off the network) ended in a traceback ending 'torch.distributed.DistNetworkError:
    Connection timed out': one line now, exit 3, nothing left behind."""
    host = subprocess.Popen([sys.executable, "-c", "import time; from ftrun.control.store import host_store; "
                             "store = host_store(0); print(store.port, flush=True); time.sleep(60)"],
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        port = int(host.stdout.readline())
        args, _ = gpt_args(tmp_path, "store-gone")
        standby = start_job("--standby", "--rdzv-endpoint", f"127.0.0.1:{port}", "--nproc-per-node", "1", *args)
        launcher = psutil.Process(standby.proc.pid)
        deadline = time.monotonic() + 40
        while not any(c.raddr and c.raddr.port == port for c in launcher.net_connections("tcp")):  # polling for the job
            assert time.monotonic() < deadline and standby.proc.poll() is None, standby.output
            time.sleep(0.1)
        host.kill()
        assert standby.wait(30) == 3, standby.output
        assert "Traceback" not in standby.output, standby.output
        assert "ftrun: control store lost while joining the job: " in standby.output, standby.output
    finally:
        host.kill()
        host.wait()


@pytest.mark.extended  # make test: test_a_spare_counts_as_waiting_only_while_it_beats (SpareWatch)
def test_a_standby_killed_while_it_waits_is_not_waited_for_under_srun(start_job, tmp_path):
    """Under srun, a --standby's ftrun is SIGKILLed while it waits (its host lost), then node 1's: the standby's
    record in the store still said "waiting", so node 0 waited out --rdzv-timeout for it and failed the job for
    good (exit 3, no next step of the batch script). A spare counts only while it beats: the step ends after
    --node-timeout as with no standby (exit 1), node 0 keeping its snapshots in RAM for the next step."""
    args, _ = gpt_args(tmp_path, "dead-standby", "--step-time", "0.3")
    common = ("--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--nproc-per-node", "1", "--node-timeout", "1",
              "--rdzv-timeout", "120", *args)
    step = {"SLURM_JOB_ID": "1", "SLURM_STEP_ID": "0", "SLURM_NNODES": "2", "SLURM_STEP_NODELIST": "localhost"}
    node0 = start_job(*common, env={**step, "SLURM_NODEID": "0", "SLURMD_NODENAME": "n0"})
    node1 = start_job(*common, job_id=node0.job_id, log_dir=node0.log_dir,
                      env={**step, "SLURM_NODEID": "1", "SLURMD_NODENAME": "n1"})
    standby = start_job("--standby", *common, job_id=node0.job_id, log_dir=node0.log_dir)
    node0.wait_for_event(lambda e: e["event"] == "spare_up", timeout=60)
    standby.proc.kill()  # its supervisor, keeper and zygote die with it
    assert standby.wait(10) == -signal.SIGKILL
    node1.proc.kill()
    assert node0.wait(60) == 1, node0.output
    assert "node 1 lost and nothing replaces it" in node0.output and "did not join" not in node0.output, node0.output


@pytest.mark.timeout(240)
def test_a_spare_takes_lost_node_0_and_the_job_ends_bitwise_equal(start_job, tmp_path, gpt_baselines):
    job = run_bitwise(start_job, tmp_path, gpt_baselines(2, 2), "spare", "--spares", "2",
                      "--inject", "node-loss@node=0,step=25")
    [failure] = primary_failures(job)
    assert failure["kind"] == "node-lost" and failure["node"] == 0
    events = job.events()
    claims = [e for e in events if e["event"] == "spare_claimed"]
    assert len(claims) == 1 and claims[0]["node"] == 0, claims  # two spares raced; one claimed
    assert not [e for e in events if e["event"] == "node_lost"]  # no cold replacement was started
    assert [e["spare"] for e in events if e["event"] == "spare_took"] == [claims[0]["spare"]]
    assert f"spare {claims[0]['spare']} (" in job.output and "took node rank 0 in generation 1" in job.output
    [restore] = [e for e in events if e["event"] == "restore" and e["generation"] == 1][:1]
    assert "parity" in restore["message"], restore
    assert_job_left_nothing(job)


@pytest.mark.timeout(180)
def test_a_spare_allocates_the_slots_it_would_rebuild_while_it_waits(start_job, tmp_path):
    """A spare sizes its reserve from the nodes' status and allocates it while the job trains; the node rank it
    takes gets it as slot 0 of its ranks, so the rebuild writes into memory allocated before."""
    go = tmp_path / "go"
    job = start_job("--nnodes", "2", "--spares", "1", "--nproc-per-node", "2", "--inject", "node-loss@node=1,step=6",
                    str(WORKER), "--size-mib", "8", "--steps", "9", "--hold-at", "4", "--go", str(go),
                    "--out-dir", str(tmp_path))
    reserved = job.wait_for_event(lambda e: e["event"] == "spare_reserve")
    go.touch()  # generation 0 trains on past step 4, and node 1 is lost at step 6
    assert job.wait() == 0, job.output
    events = job.events()
    [claimed] = [e for e in events if e["event"] == "spare_claimed"]
    [rebuilt] = [e for e in events if e["event"] == "rebuilt"]
    assert claimed["spare"] == reserved["spare"] and claimed["node"] == rebuilt["node"] == 1
    # sized as the keeper sizes a slot for the images rebuilt (header and payload) with the trainers' headroom
    assert claimed["reserve_bytes"] >= rebuilt["bytes"] == reserved["bytes"] - 2 * META_HEADROOM, (
        reserved, claimed, rebuilt)
    assert "of its slots allocated before" in job.output
    assert_job_left_nothing(job)


@pytest.mark.timeout(240)
def test_a_stalled_node_whose_rank_a_spare_took_is_killed_and_the_spare_resumes_from_its_ram(start_job, tmp_path,
                                                                                           gpt_baselines):
    """Local mode: node 1 stalls whole (SIGSTOP to its supervisor, keeper, zygote and trainers). A spare takes its
    rank, but on this host the stalled keeper holds the node's socket and files: the launcher kills the stalled
    supervisor (its processes die with it), the spare's keeper adopts the node's snapshots, and the job has one
    failure and ends bit-for-bit as without it. Before, every spare's keeper failed to start (socket in use, with
    a traceback) and each one cost a generation until the stalled node came back."""
    args, out = gpt_args(tmp_path, "stalled", "--step-time", "0.05")
    job = start_job(*NODES, "--spares", "1", "--node-timeout", "3", *args)
    job.wait_for_event(lambda e: e["event"] == "protected" and e["step"] >= 20, timeout=120)
    [start] = [e for e in job.events() if e["event"] == "node_start" and e["node"] == 1]
    node = psutil.Process(start["pid"])
    stalled = [node, *node.children(recursive=True)]
    for process in stalled:
        process.send_signal(signal.SIGSTOP)
    try:
        assert job.wait(180) == 0, job.output
    finally:
        for process in stalled:
            if process.is_running():
                process.send_signal(signal.SIGCONT)
    assert out.read_text().strip() == gpt_baselines(2, 2)
    [failure] = primary_failures(job)
    assert failure["kind"] == "node-lost" and failure["node"] == 1, job.output
    events = job.events()
    assert [e["node"] for e in events if e["event"] == "fenced"] == [1], job.output
    assert [e["node"] for e in events if e["event"] == "spare_took"] == [1], job.output
    assert "Traceback" not in job.output and "did not start" not in job.output
    assert not any(process.is_running() and process.status() != psutil.STATUS_ZOMBIE for process in stalled)
    assert_job_left_nothing(job)


@pytest.mark.extended  # make test: the standby's launcher replacing its supervisor on the same host
@pytest.mark.timeout(240)
def test_a_node_replaced_by_a_standby_on_its_host_leaves_it_the_node_s_files(start_job, tmp_path, gpt_baselines):
    """Multi-node: node 1's supervisor stalls (SIGSTOP) until a --standby on the same host has taken its rank, then
    resumes, finds itself replaced and leaves (or its launcher, seeing the rank taken, kills it first). The node's
    files (same names on this host) are the standby's now: the leaving node kills its keeper instead of letting it
    unlink them, and neither it nor its launcher removes them. Before, the standby's slots vanished and every later
    generation failed (10 restarts, exit 3)."""
    args, out = gpt_args(tmp_path, "replaced-here", "--step-time", "0.05")
    common = ("--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--node-timeout", "1",
              "--nproc-per-node", "1")
    # the threads of the baseline (local mode: the host's cores shared by its 2 trainers); a node of a multi-node
    # job gives its one trainer every core, and a matrix product's sums then run in another order
    env = {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // 2))}
    node0 = start_job(*common, "--node-rank", "0", *args, env=env)
    job_id = node0.job_id
    node1 = start_job(*common, "--node-rank", "1", *args, job_id=job_id, log_dir=node0.log_dir, env=env)
    standby = start_job("--standby", *common[2:], *args, job_id=job_id, log_dir=node0.log_dir, env=env)
    supervisor = kill_supervisor(node0, 1, signal.SIGSTOP)
    try:
        node0.wait_for_event(lambda e: e["event"] == "spare_claimed", timeout=60)
        time.sleep(1)
    finally:
        with contextlib.suppress(psutil.NoSuchProcess):  # its launcher, seeing the rank taken, may have killed it
            supervisor.send_signal(signal.SIGCONT)
    assert node0.wait(180) == 0, node0.output
    assert standby.wait(60) == 0, standby.output
    assert node1.wait(60) == 4, node1.output  # it left a job that went on: not "failed"
    assert out.read_text().strip() == gpt_baselines(2, 1)
    assert [f["kind"] for f in primary_failures(node0)] == ["node-lost"], node0.output
    assert "leaving the job: node rank 1 was taken by spare" in node1.output, node1.output
    assert f"job {job_id} goes on without node 1, which a spare replaced (exit code 4)" in node1.output
    assert "Traceback" not in node0.output + standby.output  # (node 1's old trainer lost its peers: its own)
    assert_job_left_nothing(node0)


def test_a_keeper_waits_for_the_socket_of_its_node_then_says_in_one_line_that_another_holds_it(monkeypatch, capsys):
    """The keeper's socket is the lock on its node's files on this host: a second keeper of the node waits for it
    (a stalled predecessor being killed), then exits 1 with one line, before touching any file."""
    monkeypatch.setattr(keeper, "SOCKET_WAIT", 0.3)
    held = listen(socket_name("job-socket-test", 3))
    with pytest.raises(SystemExit) as exited:
        keeper.listen_alone("job-socket-test", 3)
    assert exited.value.code == 1
    line = capsys.readouterr().err
    assert line.count("\n") == 1 and "another keeper of job job-socket-test's node 3 still runs on this host" in line
    held.close()
    held = listen(socket_name("job-socket-test", 3))
    timer = threading.Timer(0.1, held.close)  # the holder goes away while the next one waits: it gets the socket
    timer.start()
    keeper.listen_alone("job-socket-test", 3).close()
    timer.join()


@pytest.mark.timeout(60)
def test_a_keeper_started_ahead_waits_without_touching_any_node_and_leaves_when_never_needed():
    """A spare's keeper is started with the spare (its imports done when a node is claimed): until its start it
    listens on no port; closed unused, it exits 0. (Started, it serves as any keeper: every job's keepers now
    start this way.)"""
    from ftrun.launch.keeper_ahead import KeeperAhead

    ahead = KeeperAhead()
    try:
        proc = psutil.Process(ahead.proc.pid)
        deadline = time.monotonic() + 30
        while "ftrun.snapshot.keeper" not in " ".join(proc.cmdline()) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.0)  # its imports
        assert proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
        assert [c for c in proc.net_connections("all") if c.status == psutil.CONN_LISTEN] == []
        ahead.close()
        _, status = os.waitpid(ahead.proc.pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        ahead.close()  # it exits at the end of its socket


def start_two_nodes(start_job, tmp_path, name: str, *extra: str, step_time: float = 0.05):
    """Nodes 0 and 1 of a multi-node job (``--node-rank``, an endpoint on this host), each its own launcher, with
    the threads of the failure-free local run; returns (node 0, node 1, the hash file, the common arguments)."""
    args, out = gpt_args(tmp_path, name, "--step-time", str(step_time))
    common = ("--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--nproc-per-node", "1",
              "--rdzv-timeout", "30", *extra)
    env = {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // 2))}  # as in the test above
    node0 = start_job(*common, "--node-rank", "0", *args, env=env)
    node1 = start_job(*common, "--node-rank", "1", *args, job_id=node0.job_id, log_dir=node0.log_dir, env=env)
    return node0, node1, out, (*common, *args), env


def kill_supervisor(node0, node: int, signum: int = signal.SIGKILL) -> psutil.Process:
    """SIGKILL ``node``'s supervisor (the OOM killer, a crash), or send it ``signum`` (SIGSTOP: it stalls), once the
    job has protected step 20; its launcher lives on. Returns the supervisor."""
    node0.wait_for_event(lambda e: e["event"] == "protected" and e["step"] >= 20, timeout=120)
    [start] = [e for e in node0.events() if e["event"] == "node_start" and e["node"] == node]
    supervisor = psutil.Process(start["pid"])
    supervisor.send_signal(signum)
    return supervisor


@pytest.mark.extended  # make test: test_a_multi_node_launcher_ends_its_stalled_supervisor_and_replaces_it_...
@pytest.mark.timeout(240)
@pytest.mark.parametrize("node", [0, 1])
def test_a_multi_node_launcher_replaces_its_killed_supervisor_and_the_job_resumes_from_its_ram(
        start_job, tmp_path, gpt_baselines, node):
    """Multi-node, outside SLURM: a node's supervisor dies while its launcher lives. The launcher declares the node
    lost and starts a replacement for its rank, whose keeper re-adopts the node's slots: the job goes on from RAM
    and ends bit-for-bit as without the loss, also when the node is node 0, whose launcher hosts the control store.
    Before, that launcher exited 1 and the other node waited out --rdzv-timeout for a replacement, then failed."""
    node0, node1, out, _, _ = start_two_nodes(start_job, tmp_path, f"respawn-{node}")
    kill_supervisor(node0, node)
    assert node0.wait(180) == 0, node0.output + node1.output
    assert node1.wait(60) == 0, node1.output
    assert out.read_text().strip() == gpt_baselines(2, 1)
    assert [(f["kind"], f["node"]) for f in primary_failures(node0)] == [("node-lost", node)], node0.output
    assert f"starting a replacement for node {node}" in (node0, node1)[node].output
    assert "trainers restore step" in node0.output and "from RAM" in node0.output, node0.output
    assert_job_left_nothing(node0)


@pytest.mark.timeout(240)
def test_a_multi_node_launcher_ends_its_stalled_supervisor_and_replaces_it_from_its_ram(start_job, tmp_path,
                                                                                      gpt_baselines):
    """Multi-node outside SLURM, no spare: node 1's supervisor stalls (SIGSTOP, a frozen process) and stays stopped
    while its ftrun lives. Node 0 declares it lost; its launcher kills it --node-timeout later and starts a
    replacement, whose keeper re-adopts the node's slots: one restart (the launcher finds the loss declared: no
    second generation), from RAM, and the failure-free hash. Before, nothing replaced it: node 0 waited out
    --rdzv-timeout for node 1 and failed ("did not join", exit 3)."""
    node0, node1, out, _, _ = start_two_nodes(start_job, tmp_path, "stalled-replaced", "--node-timeout", "1")
    supervisor = kill_supervisor(node0, 1, signal.SIGSTOP)
    assert node0.wait(90) == 0, node0.output + node1.output
    assert node1.wait(30) == 0, node1.output
    assert out.read_text().strip() == gpt_baselines(2, 1)
    failures = primary_failures(node0)
    assert [(f["kind"], f["node"], f["generation"]) for f in failures] == [("node-lost", 1, 1)], node0.output
    assert "(seen by node 0 (supervisor beats))" in node0.output and ", 1 restart(s)" in node0.output, node0.output
    assert f"node 1's supervisor (pid {supervisor.pid}) still ran 1s after the job lost it" in node1.output
    assert "starting a replacement for node 1" in node1.output, node1.output
    [restore] = [e for e in node0.events() if e["event"] == "restore" and e["generation"] == 1][:1]
    assert "from RAM" in restore["message"] and "parity" not in restore["message"], restore
    assert_job_left_nothing(node0)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("node", [pytest.param(0, marks=pytest.mark.extended), 1])  # make test: node 1
def test_a_killed_supervisor_s_replacement_and_a_standby_racing_for_its_rank_one_takes_it(
        start_job, tmp_path, gpt_baselines, node):
    """Multi-node with a --standby: a node's supervisor is killed, its launcher starts a replacement and the
    standby claims the rank too. Both take it from the incarnation the node-lost generation names, by one
    compare-and-set: one wins, the other leaves without training (the replacement with exit code 6, its launcher
    4; an unused standby with 0), the job has one failure, not a second restart, and ends bit-for-bit. Node 0's
    launcher, which hosts the control store, keeps it up until the job ends (it left 10 s after its node did, and
    the job, store lost, ended with exit 3)."""
    # node 0: the job trains on for longer than a launcher waited for the others to leave (10 s)
    node0, node1, out, common, env = start_two_nodes(start_job, tmp_path, f"race-{node}", step_time=0.4 if node == 0
                                                     else 0.05)
    standby = start_job("--standby", *common[2:], job_id=node0.job_id, log_dir=node0.log_dir, env=env)
    kill_supervisor(node0, node)
    lost, other = (node0, node1)[node], (node0, node1)[1 - node]
    assert other.wait(180) == 0, node0.output + node1.output + standby.output
    assert standby.wait(60) == 0, standby.output
    spare_took = "spare_claimed" in {e["event"] for e in node0.events()}
    assert lost.wait(60) == (4 if spare_took else 0), lost.output
    if spare_took:
        assert f"leaving the job: node rank {node} was taken by spare" in lost.output, lost.output
    assert out.read_text().strip() == gpt_baselines(2, 1)
    assert [(f["kind"], f["node"]) for f in primary_failures(node0)] == [("node-lost", node)], node0.output
    # no traceback of ftrun's (a trainer's "[rank0]: Traceback", its gloo peer gone with the killed node, may come)
    assert not [line for line in (node0.output + standby.output).splitlines()
                if "Traceback" in line and not line.startswith("[rank")], node0.output + standby.output
    assert_job_left_nothing(node0)


@pytest.mark.timeout(240)
@pytest.mark.extended  # make test: the standby's launcher replacing its supervisor (the same fixture and race)
def test_a_stalled_supervisor_killed_after_a_standby_took_its_rank_leaves_the_job_to_it(start_job, tmp_path,
                                                                                      gpt_baselines):
    """Multi-node: node 1's supervisor stalls (SIGSTOP) until a --standby took its rank, and is then killed (by the
    user, or the OOM killer) before it could see that. Its launcher finds the rank's owner key naming the spare:
    it leaves the job to it (exit code 4) and leaves it the node's files on this host, and the job has one restart
    and ends bit-for-bit. Before, the launcher declared node 1 lost a second time and started a replacement, which
    took the rank from the running standby: an extra restart, and the standby's ftrun ended with 4."""
    node0, node1, out, common, env = start_two_nodes(start_job, tmp_path, "stalled-killed", "--node-timeout", "1")
    standby = start_job("--standby", *common[2:], job_id=node0.job_id, log_dir=node0.log_dir, env=env)
    supervisor = kill_supervisor(node0, 1, signal.SIGSTOP)
    try:
        node0.wait_for_event(lambda e: e["event"] == "spare_claimed", timeout=60)
    finally:
        with contextlib.suppress(psutil.NoSuchProcess):  # its launcher may have killed it first (Fencing.end_lost)
            supervisor.send_signal(signal.SIGKILL)
    assert node0.wait(180) == 0, node0.output + node1.output + standby.output
    assert standby.wait(60) == 0, standby.output
    assert node1.wait(60) == 4, node1.output
    assert out.read_text().strip() == gpt_baselines(2, 1)
    assert [(f["kind"], f["node"]) for f in primary_failures(node0)] == [("node-lost", 1)], node0.output
    assert "starting a replacement" not in node1.output, node1.output
    assert "leaving the job: node rank 1 was taken by spare" in node1.output, node1.output
    assert f"job {node0.job_id} goes on without node 1, which a spare replaced (exit code 4)" in node1.output
    assert_job_left_nothing(node0)


@pytest.mark.timeout(240)
# make test: declared by node 0 first, then the supervisor killed: test_a_multi_node_launcher_ends_its_stalled_...;
# the launcher first: test_a_multi_node_launcher_replaces_its_killed_...
@pytest.mark.extended
@pytest.mark.parametrize("declared_first", [True, False])
def test_a_node_lost_once_is_one_restart_whoever_declares_it_first(start_job, tmp_path, gpt_baselines,
                                                                   declared_first):
    """Multi-node, no spare: node 1's supervisor stalls (SIGSTOP) and is killed, either once node 0 has declared
    it lost (its beats stopped for --node-timeout) or at once (its launcher declares it first). Either way the
    loss is one node-lost generation: its launcher starts the replacement, which claims the rank from the lost
    incarnation, and the job ends bit-for-bit with one restart. Before, a launcher whose supervisor died after
    node 0 had declared it lost declared it a second time: two generations for one loss, both counted against
    --max-restarts, and every node restarted twice."""
    node0, node1, out, _, _ = start_two_nodes(start_job, tmp_path, "lost-once", "--node-timeout", "1")
    supervisor = kill_supervisor(node0, 1, signal.SIGSTOP)
    try:
        if declared_first:
            node0.wait_for_event(lambda e: e["event"] == "failure" and e.get("kind") == "node-lost", timeout=60)
    finally:
        with contextlib.suppress(psutil.NoSuchProcess):  # its launcher may have killed it first (Fencing.end_lost)
            supervisor.send_signal(signal.SIGKILL)
    assert node0.wait(180) == 0, node0.output + node1.output
    assert node1.wait(60) == 0, node1.output
    assert out.read_text().strip() == gpt_baselines(2, 1)
    failures = primary_failures(node0)
    assert [(f["kind"], f["node"], f["generation"]) for f in failures] == [("node-lost", 1, 1)], node0.output
    seen_by = "(seen by node 0 (supervisor beats))" if declared_first else "(seen by launcher)"
    assert seen_by in node0.output + node1.output, node0.output + node1.output
    assert ", 1 restart(s)" in node0.output, node0.output
    assert "starting a replacement for node 1" in node1.output, node1.output
    assert_job_left_nothing(node0)


@pytest.mark.extended  # make test: test_a_multi_node_launcher_replaces_its_killed_supervisor_..._ram[0]
@pytest.mark.timeout(240)
# make test: SIGKILL (the same replacement; the kill of a stalled supervisor: test_a_multi_node_launcher_ends_its_...)
@pytest.mark.parametrize("signum", [pytest.param(signal.SIGKILL, id="killed"),
                                    pytest.param(signal.SIGSTOP, id="stalled", marks=pytest.mark.extended)])
def test_a_standby_s_launcher_replaces_its_supervisor_that_died_or_stalled_after_it_took_a_rank(
        start_job, tmp_path, gpt_baselines, signum):
    """Multi-node with a --standby: node 1 is lost whole (its launcher killed), the standby takes its rank, and
    then the standby's supervisor dies (the OOM killer), or stalls (SIGSTOP: node 0 declares it lost and its ftrun
    kills it --node-timeout later), while its ftrun lives. That ftrun replaces it as any node's does: the
    replacement takes the rank from the incarnation that was lost, its keeper re-adopts the node's slots, and the
    job ends bit-for-bit with two restarts. Before, node 0 waited out --rdzv-timeout for a replacement, then failed
    (exit 3): the standby's ftrun exited 1 (killed), or waited on its stopped supervisor (stalled)."""
    node0, node1, out, common, env = start_two_nodes(start_job, tmp_path, "standby-respawn", "--node-timeout", "2",
                                                     step_time=0.3)
    standby = start_job("--standby", *common[2:], job_id=node0.job_id, log_dir=node0.log_dir, env=env)
    node0.wait_for_event(lambda e: e["event"] == "protected" and e["step"] >= 20, timeout=120)
    node1.proc.kill()  # node 1 lost whole: its supervisor, keeper and trainers die with its launcher
    took = node0.wait_for_event(lambda e: e["event"] == "node_start" and e["node"] == 1 and e["incarnation"] == 2,
                                timeout=60)
    node0.wait_for_event(lambda e: e["event"] == "protected" and e["step"] >= 40, timeout=120)
    os.kill(took["pid"], signum)
    assert node0.wait(180) == 0, node0.output + standby.output
    assert standby.wait(60) == 0, standby.output
    assert out.read_text().strip() == gpt_baselines(2, 1)
    assert [(f["kind"], f["node"]) for f in primary_failures(node0)] == [("node-lost", 1)] * 2, node0.output
    assert "starting a replacement for node 1" in standby.output, standby.output
    if signum == signal.SIGSTOP:
        assert f"node 1's supervisor (pid {took['pid']}) still ran 2s after the job lost it" in standby.output
    assert "from RAM" in [e for e in node0.events() if e["event"] == "restore" and e["generation"] == 2][0]["message"]
    assert_job_left_nothing(node0)


@pytest.mark.timeout(120)
def test_a_standby_whose_spare_died_while_it_waited_starts_another(start_job, tmp_path):
    """A --standby's spare (its supervisor) is SIGKILLed while it waits (the OOM killer) and its ftrun lives: that
    ftrun exited 1 without a word, leaving the spare's record "waiting" and its reserve in /dev/shm, and no spare
    took the rank of a node lost afterwards. It now says so, marks the record gone, unlinks the reserve and starts
    another spare, as --spares does, which takes node 1's rank when node 1 is lost and resumes from RAM."""
    node0, node1, _, common, env = start_two_nodes(start_job, tmp_path, "spare-died", "--node-timeout", "1",
                                                   step_time=0.3)
    standby = start_job("--standby", *common[2:], job_id=node0.job_id, log_dir=node0.log_dir, env=env)
    first = node0.wait_for_event(lambda e: e["event"] == "spare_up", timeout=60)
    os.kill(first["pid"], signal.SIGKILL)
    node0.wait_for_event(lambda e: e["event"] == "spare_up" and e["pid"] != first["pid"], timeout=60)
    node0.wait_for_event(lambda e: e["event"] == "protected", timeout=60)  # a step to restore from RAM
    node1.proc.kill()  # node 1 lost whole
    node0.wait_for_event(lambda e: e["event"] == "restore" and e["generation"] == 1, timeout=60)
    node0.proc.send_signal(signal.SIGTERM)
    assert node0.wait(60) == 143, node0.output
    assert standby.wait(60) == 143, standby.output
    assert "killed by SIGKILL while it waited for a lost node; starting another" in standby.output, standby.output
    restore = [e for e in node0.events() if e["event"] == "restore" and e["generation"] == 1]
    assert "from RAM" in restore[0]["message"], node0.output
    assert "took node rank 1" in node0.output and "hot spare(s) ready" not in node0.output, node0.output


def exit_times(*jobs, timeout: float = 120) -> list[float]:
    """Wait for every one of ``jobs`` to exit; when each did (``time.time()``, seen within 20 ms)."""
    ended: dict[int, float] = {}
    deadline = time.monotonic() + timeout
    while len(ended) < len(jobs) and time.monotonic() < deadline:
        for index, job in enumerate(jobs):
            if index not in ended and job.proc.poll() is not None:
                ended[index] = time.time()
        time.sleep(0.02)
    assert len(ended) == len(jobs), "\n".join(job.output for job in jobs)
    return [ended[index] for index in range(len(jobs))]


def sleeper_nodes(start_job, seconds: float, *extra: str):
    """Nodes 0 and 1 of a multi-node job of tests/scripts/sleeper.py (no collectives: a lost node is seen by its
    beats, and each generation sleeps ``seconds`` again); returns (node 0, node 1, the common arguments)."""
    common = ("--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--nproc-per-node", "1", "--node-timeout", "1", *extra,
              str(SCRIPTS / "sleeper.py"), "--seconds", str(seconds))
    node0 = start_job("--nnodes", "2", "--node-rank", "0", *common)
    node1 = start_job("--nnodes", "2", "--node-rank", "1", *common, job_id=node0.job_id, log_dir=node0.log_dir)
    return node0, node1, common


@pytest.mark.timeout(180)
def test_node_0_ends_with_a_standby_that_took_a_lost_node_s_rank(start_job):
    """A --standby took node 1's rank (node 1's ftrun killed whole) and ran it to the end: its ftrun, not hosting
    the control store, never said that node 1 had left, so node 0's launcher kept the store up for _ACK_TIMEOUT
    (10 s) after the job had ended, waiting for it. The standby now says so as node 1's launcher would."""
    node0, node1, common = sleeper_nodes(start_job, 3)
    standby = start_job("--standby", *common, job_id=node0.job_id, log_dir=node0.log_dir)
    node0.wait_for_event(lambda e: e["event"] == "spare_up", timeout=120)
    node0.wait_for_event(lambda e: e["event"] == "first_heartbeat", timeout=120)
    node1.proc.kill()  # node 1 lost whole: its supervisor and trainer die with its launcher
    node0_end, standby_end = exit_times(node0, standby)
    assert node0.proc.returncode == 0 and standby.proc.returncode == 0, node0.output + standby.output
    assert "took node rank 1" in node0.output, node0.output
    late = (node0_end - standby_end) / _ACK_TIMEOUT
    assert late < 0.5, f"node 0 ended {late:.2f} x _ACK_TIMEOUT after the standby that ran node 1"
    assert_job_left_nothing(node0)


@pytest.mark.timeout(180)
def test_node_0_does_not_wait_at_its_end_for_a_lost_node_or_a_dead_standby(start_job):
    """The job fails for good when node 1 is lost (--max-restarts 0), after a --standby was killed while it waited.
    Node 0's launcher kept the control store up for _ACK_TIMEOUT (10 s) at its end, waiting for a goodbye from
    node 1, declared lost, and for the standby's record, still "waiting": neither could ever come. It now waits
    only for nodes not declared lost and for spares that still beat."""
    node0, node1, common = sleeper_nodes(start_job, 30, "--max-restarts", "0")
    standby = start_job("--standby", *common, job_id=node0.job_id, log_dir=node0.log_dir)
    node0.wait_for_event(lambda e: e["event"] == "spare_up", timeout=120)
    node0.wait_for_event(lambda e: e["event"] == "first_heartbeat", timeout=120)
    standby.proc.kill()  # its spare's record stays "waiting"
    node1.proc.kill()  # node 1 lost whole
    [node0_end] = exit_times(node0)
    assert node0.proc.returncode == 3, node0.output
    [lost] = [e for e in primary_failures(node0) if e["kind"] == "node-lost"]
    late = (node0_end - lost["time"]) / _ACK_TIMEOUT
    assert late < 0.75, f"node 0 ended {late:.2f} x _ACK_TIMEOUT after node 1 was declared lost"


def test_spares_that_keep_dying_are_started_again_only_up_to_the_restart_limit(tmp_path):
    """--spares started a spare again whenever one died while it waited, for ever: one that dies at once each time
    (the OOM killer's pick as it allocates its reserve) was started again and again, a new interpreter each time,
    each enlisting one more record in the control store. Spares now follow the keeper's rule: after RESTART_LIMIT
    exits within RESTART_WINDOW no more start (a lost node then gets a replacement supervisor), in one line."""
    started: list[subprocess.Popen[bytes]] = []

    def spawn(name: str) -> subprocess.Popen[bytes]:
        started.append(subprocess.Popen(["true"]))
        return started[-1]

    pool = SparePool(1, spawn, EventLog("launcher", str(tmp_path), stream=None))
    pool.fill()
    for _ in range(3 * RESTART_LIMIT):
        for proc in started:
            proc.wait()
        pool.fill()
    assert len(started) == RESTART_LIMIT and not pool.alive()
    gone = [e["message"] for e in read_events(str(tmp_path)) if e["event"] == "spare_gone"]
    assert gone[-1].endswith("starting no more (a lost node gets a replacement supervisor instead)"), gone
    assert gone[:-1] == [f"spare spare-{i} exited (0); starting another" for i in range(RESTART_LIMIT - 1)]


@pytest.mark.timeout(90)
def test_a_standby_whose_job_s_control_store_is_lost_does_not_exit_0(start_job):
    """Node 0's ftrun, which hosts the c10d control store, is SIGKILLed while a --standby waits: the standby said
    "control store lost" and exited 0, as when the job ends well, so a script or scheduler saw success. A job's
    end is recorded in the store before its host closes it (and the host waits for the waiting spares to see it),
    so a lost store is no end: the standby exits 3, as the job's nodes do."""
    common = ("--nnodes", "1", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--nproc-per-node", "1",
              str(SCRIPTS / "sleeper.py"), "--seconds", "60")
    node0 = start_job("--node-rank", "0", *common)
    standby = start_job("--standby", *common[2:], job_id=node0.job_id)
    standby.wait_for_event(lambda e: e["event"] == "spare_up", timeout=60)
    node0.proc.kill()  # the control store goes with it
    assert standby.wait(60) == 3, standby.output
    assert "control store lost" in standby.output, standby.output
