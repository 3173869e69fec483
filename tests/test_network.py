"""Jobs whose nodes are hosts of their own (network namespaces with a NIC each, :mod:`network_hosts`): the control
store, the trainers' collectives and the keepers' snapshots cross real interfaces, not loopback. A standby on a
fourth host takes a lost node's rank; its keeper rebuilds the snapshots from its group's parity, relayed through
the survivors (each byte crosses its NIC once). A host cut off the network (its NIC down: no reset, packets just
vanish) is a lost node too, and when it comes back it cannot disturb the job that went on without it. A slow
network changes nothing. Every job ends with the failure-free state."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest

from conftest import assert_job_left_nothing, gpt_args, primary_failures, restores
from network_hosts import Hosts, hosts_problem

pytestmark = pytest.mark.timeout(300)

PORT = 29400  # the control store's, on node 0's host (each host has its own ports)
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


@pytest.fixture
def hosts() -> Iterator[Hosts]:
    problem = hosts_problem()
    if problem is not None:
        pytest.skip(problem)
    made = Hosts(4)
    yield made
    made.close()


def start_nodes(start_job, hosts: Hosts, tmp_path, name: str, nnodes: int, *flags: str, standby: bool = True):
    """``nnodes`` launchers (node i on host i) and, on the next host, a standby with the same command line. The
    trainers use one thread each, as in the local baseline runs (the hosts share this machine's cores; a thread
    count changes the order of float sums)."""
    args, out = gpt_args(tmp_path, name, "--step-time", "0.05")
    common = ("--nproc-per-node", "1", "--rdzv-endpoint", f"{hosts.address(0)}:{PORT}", "--node-timeout", "3",
              *flags, *args)
    nodes = [start_job("--nnodes", str(nnodes), "--node-rank", str(i), "--local-addr", hosts.address(i), *common,
                       job_id=name, log_dir=tmp_path / "logs", prefix=tuple(hosts.command(i)), env=ONE_THREAD)
             for i in range(nnodes)]
    spare = start_job("--standby", "--local-addr", hosts.address(nnodes), *common, job_id=name,
                      log_dir=tmp_path / "logs", prefix=tuple(hosts.command(nnodes)), env=ONE_THREAD) if standby else None
    return nodes, spare, out


def assert_left_nothing(hosts: Hosts, *jobs) -> None:
    """No process of the jobs and nothing in any host's /dev/shm survives them."""
    for job in jobs:
        assert_job_left_nothing(job)
    left = {i: os.listdir(hosts.shm(i)) for i in range(len(hosts.names)) if os.listdir(hosts.shm(i))}
    assert not left, f"left in the hosts' /dev/shm: {left}"


def test_a_lost_host_is_rebuilt_relayed_through_the_survivors_on_a_standby(start_job, hosts, tmp_path, gpt_baselines):
    for i in range(4):
        hosts.shape(i, rate_mbit=400)
    nodes, spare, out = start_nodes(start_job, hosts, tmp_path, "netloss", 3, "--ec-group", "3", "--ec-parity", "1",
                                    "--inject", "node-loss@node=1,step=25")
    assert nodes[0].wait(240) == 0, nodes[0].output
    assert nodes[2].wait(60) == 0 and spare.wait(60) == 0, spare.output
    assert out.read_text().strip() == gpt_baselines(3, 1)
    events = nodes[0].events()
    assert [e["node"] for e in events if e["event"] == "spare_claimed"] == [1]
    plan = restores(nodes[0])[max(restores(nodes[0]))]
    assert plan["restored_from"] == "parity" and plan["rebuilt"] == {"1": [0, 2]}, plan
    rebuilt = [e for e in events if e["event"] == "rebuilt"]
    assert len(rebuilt) == 1 and rebuilt[0]["relayed"], rebuilt
    # the keepers reached each other at their hosts' addresses, not loopback
    keepers = {e["node"]: e["peer_address"] for e in events if e["event"] == "keeper_start"}
    assert all(address.startswith(hosts.address(0).rsplit(".", 1)[0]) for address in keepers.values()), keepers
    assert {f["kind"] for f in primary_failures(nodes[0])} == {"node-lost"}
    assert_left_nothing(hosts, *nodes, spare)


def test_a_host_cut_off_the_network_is_replaced_and_cannot_disturb_the_job_when_it_returns(start_job, hosts,
                                                                                          tmp_path, gpt_baselines):
    nodes, spare, out = start_nodes(start_job, hosts, tmp_path, "netcut", 2)
    nodes[0].wait_for_event(lambda e: e["event"] == "protected" and e["step"] >= 20, timeout=120)
    hosts.cut(1)
    nodes[0].wait_for_event(lambda e: e["event"] == "spare_claimed", timeout=60)
    time.sleep(2)
    hosts.heal(1)  # node 1's old supervisor is back on the network, with its trainers and keeper
    assert nodes[0].wait(240) == 0, nodes[0].output
    assert spare.wait(60) == 0, spare.output
    assert out.read_text().strip() == gpt_baselines(2, 1)
    assert nodes[1].wait(60) != 0, nodes[1].output  # it learned it was replaced and stood down
    failures = primary_failures(nodes[0])
    assert failures and {f["kind"] for f in failures} == {"node-lost"}, failures
    assert_left_nothing(hosts, *nodes, spare)


def test_a_slow_network_changes_nothing(start_job, hosts, tmp_path, gpt_baselines):
    for i in range(2):
        hosts.shape(i, rate_mbit=50)
    nodes, _, out = start_nodes(start_job, hosts, tmp_path, "netslow", 2, "--inject", "crash@rank=1,step=25",
                                standby=False)
    assert nodes[0].wait(240) == 0, nodes[0].output
    assert nodes[1].wait(60) == 0, nodes[1].output
    assert out.read_text().strip() == gpt_baselines(2, 1)
    assert [f["kind"] for f in primary_failures(nodes[0])] == ["crash"]  # the injected one, nothing else
    plan = restores(nodes[0])[1]
    assert plan["restored_from"] == "ram" and plan["step"] == 20, plan
    assert_left_nothing(hosts, *nodes)
