"""Erasure-coded peer redundancy end to end: lost nodes are rebuilt from their group's parity in the survivors'
RAM, and the job ends with exactly the failure-free run's state; keepers refuse peers without the job secret."""

from __future__ import annotations

import re
import socket

import psutil
import pytest

from conftest import EVERY, assert_job_left_nothing, gpt_args, primary_failures, restores, run_bitwise
from ftrun.snapshot.transport import PeerClient, PeerUnavailable


def shape(nnodes: int, nproc: int) -> tuple[str, ...]:
    return ("--nnodes", str(nnodes), "--nproc-per-node", str(nproc))


def closed_by_peer(host: str, port: int, data: bytes) -> bool:
    """Send ``data`` on a raw connection; True once the peer closes (or resets) it, within 10 s."""
    with socket.create_connection((host, port), timeout=10) as raw:
        try:
            raw.sendall(data)
            while raw.recv(4096):
                pass
        except ConnectionResetError:
            pass
    return True


def assert_rebuilt(job, lost: set[int], at: int, within: int = EVERY) -> dict:
    """Every node in ``lost`` was rebuilt from parity; the last restore recomputes at most ``within`` of the steps
    done before the loss at step ``at``."""
    decided = restores(job)
    rebuilt = {int(node) for plan in decided.values() for node in plan.get("rebuilt", {})}
    assert rebuilt == lost, job.output
    last = max(decided)
    plan = decided[last]
    assert plan["restored_from"] == "parity" and plan["step"] > 0, job.output
    assert 0 <= at - plan["step"] <= within, plan
    assert {f["kind"] for f in primary_failures(job)} == {"node-lost"}, job.output
    events = [e for e in job.events() if e["event"] == "rebuilt"]
    assert {e["node"] for e in events} == lost
    # each replacement's keeper was told the step as it started, and allocated its slots ahead of the rebuild
    assert {e["node"] for e in job.events() if e["event"] == "rebuild_prepared"} == lost, job.output
    assert "rebuilt from the parity of nodes" in job.output
    return plan


@pytest.mark.extended  # make test: test_slurm's and test_spares' lost nodes, rebuilt from replicas (2 nodes)
@pytest.mark.timeout(240)
def test_two_nodes_replication_rebuilds_a_lost_node_bitwise(start_job, tmp_path, gpt_baselines):
    job = run_bitwise(start_job, tmp_path, gpt_baselines(2, 2), "replica", "--inject", "node-loss@node=1,step=25")
    plan = assert_rebuilt(job, {1}, 25)
    assert plan["step"] == 20 and plan["rebuilt"] == {"1": [0]}
    assert "(RAM +" in job.output  # the summary: step 20 (RAM + parity), wrapped in its column


@pytest.mark.extended  # make test: the parity-loss test below (3 nodes, k=2: the same rebuild from XOR parity)
@pytest.mark.timeout(240)
def test_three_nodes_one_parity_lose_one_bitwise(start_job, tmp_path, gpt_baselines):
    job = run_bitwise(start_job, tmp_path, gpt_baselines(3, 1), "g3m1", "--ec-group", "3", "--ec-parity", "1",
                      "--inject", "node-loss@node=2,step=25", nodes=shape(3, 1))
    plan = assert_rebuilt(job, {2}, 25)
    assert plan["step"] == 20 and plan["rebuilt"] == {"2": [0, 1]}


@pytest.mark.extended
@pytest.mark.timeout(300)
def test_four_nodes_two_parity_lose_two_at_once_bitwise(start_job, tmp_path, gpt_baselines):
    """Both lost nodes are rebuilt from parity, by supervisors the launcher forked at its start (m = 2 of them
    kept: no interpreter to start for either)."""
    args, out = gpt_args(tmp_path, "g4m2")
    job = start_job(*shape(4, 1), "--ec-group", "4", "--ec-parity", "2", "--inject", "node-loss@node=1,step=25",
                    "--inject", "node-loss@node=2,step=25", *args)
    commands = []
    for node in (1, 2):
        started = job.wait_for_event(lambda e: e["event"] == "node_start" and e["node"] == node
                                     and e["incarnation"] == 2)
        commands.append(" ".join(psutil.Process(started["pid"]).cmdline()))
    assert job.wait(180) == 0, job.output
    assert out.read_text().strip() == gpt_baselines(4, 1)
    assert all("-m ftrun.launch.launcher" in command for command in commands), commands
    plan = assert_rebuilt(job, {1, 2}, 25)
    assert plan["step"] == 20
    assert_job_left_nothing(job)


@pytest.mark.timeout(300)
def test_a_survivor_lost_during_a_rebuild_is_one_more_lost_node(start_job, tmp_path, gpt_baselines):
    """Node 1 lost; while its replacement rebuilds from parity, node 2 (a survivor it reads from) is lost too.
    Nothing is blamed on the parity: the next generation rebuilds both nodes (2 lost, 2 parity) at the same step,
    and the job ends with the failure-free state."""
    job = run_bitwise(start_job, tmp_path, gpt_baselines(4, 1), "serve-loss", "--ec-group", "4", "--ec-parity", "2",
                      "--inject", "node-loss@node=1,step=25", "--inject", "serve-loss@node=2,step=1,gen=1",
                      nodes=shape(4, 1))
    assert any(e["event"] == "inject" and "while it serves a peer's rebuild" in e["message"] for e in job.events())
    failed = [e for e in job.events() if e["event"] == "rebuild_failed" and e.get("peer_lost")]
    assert failed, job.output
    assert not any(e["event"] == "restore_source_failed" for e in job.events()), job.output
    decided = restores(job)
    last = decided[max(decided)]
    # the step the failed rebuild was for: 20 unless step 20 was not yet protected everywhere when node 1 was lost
    assert last["restored_from"] == "parity" and last["step"] == failed[0]["step"] in (10, 20), last
    assert set(last["rebuilt"]) == {"1", "2"}, last
    # m = 2: each position computed both parity fragments of its own stripe and pushed the second to its holder
    assert any(e["event"] == "parity" and e.get("pushed") == [1] for e in job.events()), job.output


@pytest.mark.timeout(300)
@pytest.mark.parametrize("nnodes,flags", [pytest.param(3, (), marks=pytest.mark.extended),  # make test: m = 2
                                          (4, ("--ec-group", "4", "--ec-parity", "2"))], ids=["m1", "m2-pushed"])
def test_node_lost_while_parity_of_a_newer_step_is_computed_restores_a_protected_step(start_job, tmp_path,
                                                                                       gpt_baselines, nnodes, flags):
    """Node 1 is lost while it computes parity of step 30 (or of the next snapshot, if ranks skipped 30). With
    m = 2 it has pushed the second parity fragment of its stripe to node 2 by then, but not said that the data it
    read was unchanged: node 2 never uses those pieces. The job restores a step whose parity every survivor
    completed and ends with the failure-free state."""
    job = run_bitwise(start_job, tmp_path, gpt_baselines(nnodes, 1), f"mid-parity-{nnodes}", *flags, "--inject",
                      "parity-loss@node=1,step=30", nodes=shape(nnodes, 1))
    found = [m for e in job.events() if e["event"] == "inject"
             and (m := re.search(r"while it computes parity of step (\d+)", e["message"]))]
    assert len(found) == 1, job.output
    lost_at = int(found[0].group(1))
    assert lost_at >= 30, job.output
    plan = assert_rebuilt(job, {1}, lost_at, within=lost_at)  # a skipped snapshot may leave an older one newest
    # the step being encoded only if the other nodes had finished its parity (then enough fragments rebuild it)
    assert plan["step"] <= lost_at
    parity = [e for e in job.events() if e["event"] == "parity"]
    assert plan["step"] in {e["step"] for e in parity if e["node"] != 1}
    if nnodes == 4:
        rebuilt = min(e["time"] for e in job.events() if e["event"] == "rebuilt")  # generation 1 reaches it again
        assert not any(e["node"] == 2 and e["step"] == lost_at and e["pushed"] and e["time"] < rebuilt
                       for e in parity)
        # the replacement's parity of the restored step, which the others hold already: none pushed or awaited
        assert all(e["phases"]["pushes"] == 0 and not e["pushed"] for e in parity
                   if e["node"] == 1 and e["time"] > rebuilt and e["step"] <= plan["step"]), job.output


@pytest.mark.extended  # make test: test_node_lost_while_parity_of_a_newer_step_is_computed_..._step[m2-pushed]
@pytest.mark.timeout(300)
def test_snapshots_faster_than_parity_are_skipped_not_waited_for_and_a_lost_node_is_rebuilt_bitwise(
        start_job, tmp_path, gpt_baselines):
    """A snapshot every step, faster than the job protects them with parity: ranks skip snapshots instead of
    waiting (a step some rank skipped is abandoned, and a rank that took it writes over it). Node 1, lost at step
    40, is rebuilt at the newest protected step, and the job ends with the failure-free state."""
    job = run_bitwise(start_job, tmp_path, gpt_baselines(3, 1), "skip", "--inject", "node-loss@node=1,step=40",
                      nodes=shape(3, 1), script=("--snapshot-every", "1"))
    assert any(e["event"] == "snapshot_skipped" for e in job.events()), job.output
    lost = min(f["time"] for f in primary_failures(job))
    protected = [e["step"] for e in job.events() if e["event"] == "protected" and e["time"] < lost]
    assert len(protected) < 39, protected  # some steps were never protected
    last = restores(job)[max(restores(job))]
    assert last["restored_from"] == "parity" and last["rebuilt"] == {"1": [0, 2]}, last
    assert max(protected) <= last["step"] <= 40, (protected, last)  # the newest protected (maybe as it was lost)


@pytest.mark.extended  # make test: test_durable's more-nodes-lost-than-parity (to disk)
@pytest.mark.timeout(240)
def test_more_lost_nodes_than_parity_starts_over_saying_what_was_lost(start_job, tmp_path, gpt_baselines):
    job = run_bitwise(start_job, tmp_path, gpt_baselines(3, 1), "too-many", "--inject", "node-loss@node=1,step=25",
                      "--inject", "node-loss@node=2,step=25", nodes=shape(3, 1))
    last = restores(job)[max(restores(job))]
    assert last["step"] == 0 and last["restored_from"] == "none", job.output
    assert "WARNING" in last["message"] and "cannot be rebuilt from parity" in last["message"], last
    assert set(last["lost_ranks"]) <= {1, 2} and last["lost_ranks"], last


@pytest.mark.extended  # make test: test_hostile's hostile traffic on every listening port, keepers' included
@pytest.mark.timeout(240)
def test_keepers_refuse_peers_without_the_secret_and_keep_serving(start_job, tmp_path, gpt_baselines):
    args, out = gpt_args(tmp_path, "secret", "--step-time", "0.05")
    job = start_job(*shape(2, 2), "--inject", "node-loss@node=1,step=40", *args)
    started = job.wait_for_event(lambda e: e["event"] == "keeper_start" and e["node"] == 0 and e["peer_address"])
    host, _, port = started["peer_address"].rpartition(":")
    intruder = PeerClient(host, int(port), b"not the job secret, but long enough")
    with pytest.raises(PeerUnavailable, match="authentication"):
        intruder.request("info", step=10)
    intruder.close()
    for garbage in (b"\x00" * 64 + b"GET / HTTP/1.0\r\n\r\n" * 100,  # not a handshake
                    b"FTRF" + (1 << 31).to_bytes(4, "big") + (1 << 40).to_bytes(8, "big")):  # an oversize frame
        assert closed_by_peer(host, int(port), garbage)
    assert job.wait(180) == 0, job.output
    assert out.read_text().strip() == gpt_baselines(2, 2)
    rejected = [e for e in job.events() if e["event"] == "peer_rejected"]
    assert len(rejected) >= 3 and any("authentication" in e["message"] for e in rejected), rejected
    assert_rebuilt(job, {1}, 40)  # the keeper went on serving its peer after the intruders


@pytest.mark.extended  # make test: a survivor lost during a rebuild, test_relayed_rebuild's silent survivor
@pytest.mark.timeout(300)
def test_a_survivor_frozen_during_a_rebuild_is_restarted_and_the_rebuild_tried_again(start_job, tmp_path,
                                                                                      gpt_baselines):
    """Node 1 lost; while its replacement rebuilds it, node 0's keeper (a survivor it reads from) stops (SIGSTOP)
    and its node lives on. Its supervisor's keeper watch kills it once it answered nothing for 15 s and restarts
    it (it re-adopts its slots and parity); the rebuild that failed for want of that survivor is tried again
    instead of its parity being given up (which restored step 0), and the job ends with the failure-free state."""
    job = run_bitwise(start_job, tmp_path, gpt_baselines(3, 1), "serve-stall", "--node-timeout", "1",
                      "--inject", "node-loss@node=1,step=25", "--inject", "serve-stall@node=0,step=1,gen=1",
                      nodes=shape(3, 1))
    events = job.events()
    assert any(e["event"] == "inject" and "stops itself (SIGSTOP)" in e["message"] for e in events), job.output
    assert any(e["event"] == "keeper_unresponsive" and e["node"] == 0 for e in events), job.output
    assert [e["event"] for e in events if e["event"] in ("rebuild_failed", "restore_source_retry")][:2] == \
        ["rebuild_failed", "restore_source_retry"], job.output
    assert not any(e["event"] == "restore_source_failed" for e in events), job.output
    assert_rebuilt(job, {1}, 25)
