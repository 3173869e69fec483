"""Multi-node jobs on an etcd control plane (a real 3-member cluster on loopback ports): the job survives the loss
of node 0 (a standby takes its rank) and of the etcd leader (no restart at all), bit-for-bit."""

from __future__ import annotations

import glob
import os
import signal
import time

import pytest

from conftest import SCRIPTS, assert_job_left_nothing, gpt_args, primary_failures
from ftrun.snapshot.dir_owner import OWNER_FILE, read_holder


def wait_for_output(job, text: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while text not in job.output:
        assert job.proc.poll() is None and time.monotonic() < deadline, f"no {text!r}:\n{job.output}"
        time.sleep(0.05)


@pytest.mark.timeout(300)
def test_etcd_leader_then_node_0_lost_job_ends_bitwise_equal(start_job, tmp_path, gpt_baselines, etcd):
    args, out = gpt_args(tmp_path, "etcd", "--step-time", "0.1", "--log-every", "5")
    ckpt = tmp_path / "ckpt"  # only the final persist: held by node 0, then by the standby that takes its rank
    common = ("--rdzv-backend", "etcd", "--rdzv-endpoint", etcd.endpoints, "--nproc-per-node", "2",
              "--node-timeout", "3", "--rdzv-timeout", "60", "--ckpt-dir", str(ckpt), "--persist-every", "100000")
    node0 = start_job("--nnodes", "2", "--node-rank", "0", *common, *args, job_id="etcdjob")
    node1 = start_job("--nnodes", "2", "--node-rank", "1", *common, *args, job_id="etcdjob",
                      log_dir=node0.log_dir)
    standby = start_job("--standby", *common, *args, job_id="etcdjob", log_dir=node0.log_dir)
    # spares that do not fit the job (a --rdzv-id given later wins: the job's, with an output file of their own)
    refused = [(start_job("--standby", *common[:4], "--rdzv-id", "etcdjob", *wrong, job_id=f"etcdjob-refused{i}"),
                why) for i, (wrong, why) in enumerate((
                    (("--nproc-per-node", "1", *args[:1]), "--nproc-per-node 1; not joining"),
                    (("--nproc-per-node", "2", str(SCRIPTS / "sleeper.py")), "is not the job's script")))]
    standby.wait_for_event(lambda e: e["event"] == "spare_up", timeout=120)
    wait_for_output(node0, "step 15 loss")
    leader = etcd.leader()
    assert leader is not None
    etcd.kill(leader)  # the store fails over; no trainer restarts
    wait_for_output(node0, "step 30 loss")
    assert primary_failures(node0) == [], node0.output
    etcd.start(leader)
    os.killpg(node0.proc.pid, signal.SIGKILL)  # node 0: launcher, supervisor, keeper, zygote, trainers
    time.sleep(0.5)
    for path in glob.glob("/dev/shm/ftrun-etcdjob-node0-*"):  # its RAM is gone with it
        os.unlink(path)
    record = ckpt / "etcdjob" / OWNER_FILE
    deadline = time.monotonic() + 60
    while (held := read_holder(str(record.parent))) is None or held[0].pid != standby.proc.pid:
        assert time.monotonic() < deadline and standby.proc.poll() is None, (held, standby.output)
        time.sleep(0.1)
    assert node1.wait(180) == 0, node1.output
    assert standby.wait(60) == 0, standby.output
    assert not record.exists()
    assert out.read_text().strip() == gpt_baselines(2, 2)
    failures = primary_failures(standby)
    assert failures and all(f["kind"] in ("node-lost", "crash") for f in failures), failures
    claimed = [e for e in standby.events() if e["event"] == "spare_claimed"]
    assert [e["node"] for e in claimed] == [0]
    assert "took node rank 0" in node1.output
    for job, why in refused:  # refused, and the job went on unaffected
        assert job.wait(60) == 2 and why in job.output, job.output
    assert_job_left_nothing(node1)


@pytest.mark.extended  # make test: the etcd leader then node 0 lost; test_control_integrity's frozen store
@pytest.mark.timeout(180)
def test_without_quorum_the_job_pauses_then_resumes_or_stops_with_exit_3(start_job, etcd):
    common = ("--rdzv-backend", "etcd", "--rdzv-endpoint", etcd.endpoints, "--node-timeout", "3")
    paused = start_job(*common, "--rdzv-timeout", "60", str(SCRIPTS / "sleeper.py"), "--seconds", "12")
    paused.wait_for_event(lambda e: e["event"] == "trainers_started", timeout=120)
    members = [i for i in range(3) if i != etcd.leader()]
    for i in members:
        etcd.kill(i)  # quorum lost: 1 of 3
    paused.wait_for_event(lambda e: e["event"] == "store_outage", timeout=30)
    for i in members:
        etcd.start(i)
    assert paused.wait(120) == 0, paused.output
    unavailable = [line for line in paused.output.splitlines() if "control store unavailable" in line]
    saying = [line.split("[", 1)[1].split("]", 1)[0] for line in unavailable]  # "launcher", "node 0"
    assert 1 <= len(saying) == len(set(saying)), paused.output  # one line per process whose store paused
    assert "control store back after" in paused.output and primary_failures(paused) == []

    stopped = start_job(*common, "--rdzv-timeout", "5", str(SCRIPTS / "sleeper.py"), "--seconds", "60")
    stopped.wait_for_event(lambda e: e["event"] == "trainers_started", timeout=120)
    members = [i for i in range(3) if i != etcd.leader()]
    try:
        for i in members:
            etcd.kill(i)
        assert stopped.wait(60) == 3, stopped.output
        assert "control store lost" in stopped.output and "Traceback" not in stopped.output
    finally:
        for i in members:
            etcd.start(i)
    assert_job_left_nothing(stopped)
