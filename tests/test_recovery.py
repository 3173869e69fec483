"""Real jobs with real failures: each recovers in place and ends with the failure-free run's exact state."""

from __future__ import annotations

import os
import signal
import time

import pytest

from conftest import SCRIPTS, assert_job_left_nothing, free_port, train_args

NODES = ("--nnodes", "2", "--nproc-per-node", "2")


def failures(job) -> list[dict]:
    return [e for e in job.events() if e["event"] == "failure" and e.get("primary", True)]


def wait_running(job, generation: int = 0) -> None:
    job.wait_for_event(lambda e: e["event"] in ("first_heartbeat", "recovered") and e["generation"] == generation)


@pytest.mark.timeout(240)
def test_kill_9_of_a_trainer_restarts_all_once_and_state_is_bitwise_equal(start_job, tmp_path, baseline_hash):
    args, out = train_args(tmp_path, "kill9", "--step-time", "0.05")
    job = start_job(*NODES, *args)
    wait_running(job)
    victim = job.trainer(rank=1)
    os.kill(victim.pid, signal.SIGKILL)
    assert job.wait() == 0, job.output
    assert [(f["kind"], f["rank"]) for f in failures(job)] == [("crash", 1)]
    assert "killed by SIGKILL" in failures(job)[0]["message"]
    generations = [e["generation"] for e in job.events() if e["event"] == "trainers_started"]
    assert sorted(generations) == [0, 0, 1, 1]  # every node restarted its trainers exactly once
    assert out.read_text().strip() == baseline_hash
    assert_job_left_nothing(job)


@pytest.mark.timeout(240)
def test_sigstop_is_a_hang_detected_within_timeout(start_job, tmp_path, baseline_hash):
    hang_timeout = 2.0
    args, out = train_args(tmp_path, "sigstop", "--step-time", "0.05")
    job = start_job(*NODES, "--hang-timeout", str(hang_timeout), *args)
    wait_running(job)
    victim = job.trainer(rank=2)
    stopped_at = time.time()
    os.kill(victim.pid, signal.SIGSTOP)
    failure = job.wait_for_event(lambda e: e["event"] == "failure")
    assert failure["kind"] == "hang"
    assert failure["time"] - stopped_at <= hang_timeout + 1.0
    assert job.wait() == 0, job.output
    assert out.read_text().strip() == baseline_hash
    assert_job_left_nothing(job)


@pytest.mark.timeout(240)
def test_exception_in_trainer_restarts(start_job, tmp_path, baseline_hash):
    args, out = train_args(tmp_path, "raise", "--raise-at", "12")
    job = start_job(*NODES, *args)
    assert job.wait() == 0, job.output
    [failure] = failures(job)
    assert failure["kind"] == "crash" and failure["rank"] == 0
    assert "exited with code 1" in failure["message"]
    assert out.read_text().strip() == baseline_hash
    assert_job_left_nothing(job)


@pytest.mark.timeout(240)
def test_restart_limit_ends_job_with_summary_and_no_orphans(start_job, tmp_path):
    args, _ = train_args(tmp_path, "always", "--fail-always")
    job = start_job(*NODES, "--max-restarts", "1", *args)
    assert job.wait() != 0
    assert len(failures(job)) == 2
    assert "restart limit reached (1 restarts)" in job.output
    assert "failed" in job.output and "failures and recoveries" in job.output
    assert_job_left_nothing(job)


@pytest.mark.timeout(240)
def test_node_loss_in_local_mode_gets_a_replacement(start_job, tmp_path, baseline_hash):
    args, out = train_args(tmp_path, "nodeloss", "--step-time", "0.02")
    job = start_job(*NODES, "--inject", "node-loss@node=1,step=10", *args)
    assert job.wait() == 0, job.output
    [failure] = failures(job)
    assert failure["kind"] == "node-lost" and failure["node"] == 1
    incarnations = [e["incarnation"] for e in job.events() if e["event"] == "node_start" and e["node"] == 1]
    assert incarnations == [1, 2]
    assert out.read_text().strip() == baseline_hash
    assert_job_left_nothing(job)



@pytest.mark.timeout(240)
def test_multi_node_mode_lost_node_seen_by_beats_and_replaced(start_job, tmp_path):
    node_timeout = 2.0
    endpoint = f"127.0.0.1:{free_port()}"
    common = ("--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", endpoint, "--node-timeout",
              str(node_timeout), "--rdzv-timeout", "60")
    script = (str(SCRIPTS / "sleeper.py"), "--seconds", "6")
    node0 = start_job(*common, "--node-rank", "0", *script, job_id="multinode")
    node1 = start_job(*common, "--node-rank", "1", *script, job_id="multinode", log_dir=node0.log_dir)
    wait_running(node0)
    lost_at = time.time()
    os.killpg(node1.proc.pid, signal.SIGKILL)  # the launcher; its supervisor and trainers die with it
    failure = node0.wait_for_event(lambda e: e["event"] == "failure")
    assert failure["kind"] == "node-lost" and failure["node"] == 1
    assert failure["detected_by"] == "node 0 (supervisor beats)"
    assert failure["time"] - lost_at <= node_timeout + 1.0
    replacement = start_job(*common, "--node-rank", "1", *script, job_id="multinode", log_dir=node0.log_dir)
    assert replacement.wait() == 0, replacement.output
    assert node0.wait() == 0, node0.output
    assert_job_left_nothing(node0)


@pytest.mark.timeout(240)
def test_multi_node_mode_trains_through_a_crash_bitwise(start_job, tmp_path, baseline_hash):
    endpoint = f"127.0.0.1:{free_port()}"
    args, out = train_args(tmp_path, "multinode")
    common = ("--nnodes", "2", "--nproc-per-node", "2", "--rdzv-endpoint", endpoint, "--inject",
              "crash@rank=3,step=15")
    node0 = start_job(*common, "--node-rank", "0", *args, job_id="mncrash")
    node1 = start_job(*common, "--node-rank", "1", *args, job_id="mncrash", log_dir=node0.log_dir)
    assert node1.wait() == 0, node1.output
    assert node0.wait() == 0, node0.output
    assert [(f["kind"], f["rank"]) for f in failures(node0)] == [("crash", 3)]
    assert out.read_text().strip() == baseline_hash
    assert_job_left_nothing(node0)


@pytest.mark.timeout(120)
def test_sigterm_to_launcher_stops_every_process(start_job):
    job = start_job(*NODES, str(SCRIPTS / "sleeper.py"), "--seconds", "60")
    wait_running(job)
    job.proc.send_signal(signal.SIGTERM)
    assert job.wait(timeout=30) == 143
    assert_job_left_nothing(job)
