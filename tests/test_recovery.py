"""Real jobs with real failures: each recovers in place and ends with the failure-free run's exact state."""

from __future__ import annotations

import glob
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid

import psutil
import pytest

from conftest import (SCRIPTS, TRAIN_GPT, assert_job_left_nothing, free_port, gpt_args, job_processes, job_segments,
                      primary_failures, train_args)

NODES = ("--nnodes", "2", "--nproc-per-node", "2")


def failures(job) -> list[dict]:
    return [e for e in job.events() if e["event"] == "failure" and e.get("primary", True)]


def wait_running(job, generation: int = 0) -> None:
    job.wait_for_event(lambda e: e["event"] in ("first_heartbeat", "recovered") and e["generation"] == generation)


@pytest.mark.extended  # make test: test_snapshots' crash tests (SIGKILL of a trainer, bitwise)
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


@pytest.mark.extended  # test_snapshots.py::test_hang_restores_from_ram_bitwise covers hangs in `make test`
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
    assert (failure["kind"], failure["rank"]) == ("hang", 2), failure
    # the timeout applied is max(--hang-timeout, 5 x the slowest step), which a loaded machine can raise
    applied = float(re.search(r"\(timeout (\d+\.\d)s", failure["message"])[1])
    assert hang_timeout <= applied and failure["time"] - stopped_at <= applied + 1.0, failure
    assert job.wait() == 0, job.output
    assert out.read_text().strip() == baseline_hash
    assert_job_left_nothing(job)


@pytest.mark.extended  # make test: test_crash_loop.py (exceptions, restarts)
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


@pytest.mark.timeout(120)
def test_script_broken_at_import_reports_the_restarts_it_made(start_job):
    """--max-restarts 2: generations 0, 1 and 2 run (two restarts); the third failure ends the job, and every
    line says 2 restarts (it said 3)."""
    job = start_job("--max-restarts", "2", str(SCRIPTS / "raises_at_import.py"))
    assert job.wait() == 3, job.output
    assert sorted(e["generation"] for e in job.events() if e["event"] == "trainers_started") == [0, 1, 2]
    assert len(failures(job)) == 3
    assert job.output.count("restarting every node's trainers") == 2
    assert "generation 3: not started, the restart limit (--max-restarts 2) is reached" in job.output
    assert "restart limit reached (2 restarts)" in job.output
    assert "3 failure(s), 2 restart(s) (limit reached: --max-restarts 2)" in job.output
    assert_job_left_nothing(job)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("how", [pytest.param("atexit", marks=pytest.mark.extended), "thread",  # make test: thread
                                 pytest.param("body", marks=pytest.mark.extended)])
def test_a_rank_slow_to_finish_after_its_loop_is_not_hung(start_job, how):
    """After its loop (``snap.wait()``, or the script's return) a trainer has --hang-timeout-initial to finish and
    exit, not the hang timeout of a step: an atexit handler (``wandb.finish()``, an upload) or a thread that runs
    on, or the script's own last work. Before: atexit ran the user's handler before ftrun's "exiting" mark,
    Python joins threads before any atexit, and the script's own work had no mark: "rank 1 hung" after 1 s,
    restarted 10 times, exit 3."""
    job = start_job("--nproc-per-node", "2", "--hang-timeout", "1", "--hang-timeout-initial", "60",
                    str(SCRIPTS / "slow_exit.py"), "--how", how, "--seconds", "4")
    assert job.wait(120) == 0, job.output
    assert primary_failures(job) == [], job.output


CATCHES_SIGTERM = """\
import os, signal, sys, time
import torch, ftrun
rank, gen, out = os.environ["RANK"], os.environ["TORCHELASTIC_RESTART_COUNT"], sys.argv[1]

def on_sigterm(*_):  # a script's own last checkpoint
    open(os.path.join(out, f"term-gen{gen}-rank{rank}"), "w").close()
    sys.exit(0)

signal.signal(signal.SIGTERM, on_sigterm if sys.argv[2] == "checkpoint" else lambda *_: None)  # or a flag
weights = torch.zeros(4)
snap = ftrun.Snapshotter({"weights": weights}, every=1) if sys.argv[2] == "flag" else None
for step in range(snap.restore() if snap else 0, 200):
    weights += 1
    time.sleep(0.02)
    snap.save(step + 1) if snap else ftrun.heartbeat(step)
"""


@pytest.mark.timeout(180)
def test_a_first_step_after_a_restore_slower_than_the_hang_timeout_is_not_a_hang(start_job, tmp_path):
    """A script that compiles its model (torch.compile) compiles again in every new trainer, in the first step after
    its restore. The restore's beat gave that step only the hang timeout of a step, where the job's first step has
    --hang-timeout-initial: with a compile longer than --hang-timeout, every restore was followed by a hang and the
    job failed for good ('hung twice'). Here the first step after the restore takes 4 hang timeouts more (steps of
    0.2 s before, so the supervisor has seen step intervals; a step timeout of 1 times the slowest, at least the
    hang timeout)."""
    config = tmp_path / "ftrun.yaml"
    config.write_text("hang_step_factor: 1.0\n")
    job = start_job("--config", str(config), "--nproc-per-node", "2", "--hang-timeout", "2", "--inject",
                    "crash@rank=1,step=8", str(SCRIPTS / "ddp_steps.py"), "--steps", "12", "--step-time", "0.2",
                    "--resume-pause", "8")
    assert job.wait(120) == 0, job.output
    assert [(f["kind"], f["rank"]) for f in primary_failures(job)] == [("crash", 1)], job.output
    assert_job_left_nothing(job)


@pytest.mark.timeout(120)
def test_a_restart_kills_trainers_at_once_once_the_job_has_a_snapshot(start_job, tmp_path):
    """A survivor whose SIGTERM handler only sets a flag (as frameworks do) held every restart up for the whole
    --stop-grace: once the job has a committed snapshot, its state comes back from it, and it is killed at once."""
    script = tmp_path / "catches.py"
    script.write_text(CATCHES_SIGTERM)
    job = start_job("--nproc-per-node", "2", "--stop-grace", "30", "--inject", "crash@rank=1,step=15,gen=0",
                    str(script), str(tmp_path), "flag")
    assert job.wait(90) == 0, job.output
    stop = next(e for e in job.events() if e["event"] == "stopped")  # the restart's
    assert stop["sigkill"] and "(killed)" in stop["message"] and stop["seconds"] < 15, stop


@pytest.mark.timeout(120)
def test_without_a_snapshot_or_when_the_job_fails_for_good_trainers_get_sigterm(start_job, tmp_path):
    """A script without the Snapshotter may resume from nothing but its own checkpoint on SIGTERM, and a job that
    fails for good ends with the survivors' finally blocks and handlers run: neither is killed at once."""
    script = tmp_path / "catches.py"
    script.write_text(CATCHES_SIGTERM)
    job = start_job("--nproc-per-node", "2", "--max-restarts", "1", "--inject", "crash@rank=1,step=5,gen=0",
                    "--inject", "crash@rank=1,step=5,gen=1", str(script), str(tmp_path), "checkpoint")
    assert job.wait(90) == 3, job.output
    assert (tmp_path / "term-gen0-rank0").exists() and (tmp_path / "term-gen1-rank0").exists(), job.output


LEAVES_DAEMONS = """\
import os, subprocess, sys, time
import ftrun
marker = f"{os.environ['DAEMON_TEST_MARK']}-gen{os.environ['TORCHELASTIC_RESTART_COUNT']}"
sleeper = [sys.executable, "-c", "import time; time.sleep(300)", marker]
subprocess.Popen(sleeper, start_new_session=True)  # a server in a session of its own
if os.fork() == 0:  # a double-forked daemon
    os.setsid()
    if os.fork() == 0:
        os.execv(sys.executable, sleeper)
    os._exit(0)
for step in range(30):
    ftrun.heartbeat(step)
    time.sleep(0.05)
"""


@pytest.mark.timeout(120)
def test_processes_the_trainers_left_outside_their_groups_do_not_outlive_a_restart(start_job, tmp_path):
    """A trainer's server in a session of its own and a daemon escape the process-group kill: they piled up, one
    per trainer and restart (holding ports, GPU memory). Killed at the restart now; after a success the last
    generation's outlive the job, as under torchrun."""
    script = tmp_path / "daemons.py"
    script.write_text(LEAVES_DAEMONS)
    mark = f"ftrun-test-{uuid.uuid4().hex[:8]}"

    def marked(gen: int) -> list[psutil.Process]:
        return [p for p in psutil.process_iter(["cmdline"]) if f"{mark}-gen{gen}" in (p.info["cmdline"] or [])]

    try:
        job = start_job("--nproc-per-node", "2", "--inject", "crash@rank=1,step=10,gen=0", str(script),
                        env={"DAEMON_TEST_MARK": mark})
        assert job.wait(90) == 0, job.output
        assert marked(0) == [], [p.info["cmdline"] for p in marked(0)]
        [killed] = [e for e in job.events() if e["event"] == "left_killed" and e.get("generation") == 0]
        assert len(killed["pids"]) == 4, killed  # 2 trainers x (server + daemon)
        assert len(marked(1)) == 4  # the last generation's outlive the success
    finally:
        for proc in marked(0) + marked(1):
            proc.kill()


ADDS_AN_ENTRY = """\
import hashlib, time, torch, ftrun
weights = torch.nn.Parameter(torch.linspace(0, 1, 8))
optimizer = torch.optim.SGD([weights], lr=0.1)
state = {"weights": weights, "optimizer": optimizer}
snap = ftrun.Snapshotter(state, every=1)
for step in range(snap.restore(), 30):
    optimizer.zero_grad()
    (weights * weights).sum().backward()
    optimizer.step()
    if step == 10:
        state["ema"] = weights.detach().clone()  # from step 10 on: not in the state a restarted script builds
    elif step > 10:
        state["ema"].mul_(0.9).add_(weights.detach(), alpha=0.1)
    time.sleep(0.02)
    snap.save(step + 1)
snap.wait()
print("HASH", hashlib.sha256(weights.detach().numpy().tobytes() + state["ema"].numpy().tobytes()).hexdigest())
"""


@pytest.mark.timeout(120)
def test_an_entry_added_to_the_state_after_the_start_is_restored_bitwise(start_job, tmp_path):
    """Before, the restore refused the snapshot ("state keys do not match: missing ['ema']") and every restart
    failed the same way: the job ended as a crash loop with its progress lost."""
    script = tmp_path / "adds.py"
    script.write_text(ADDS_AN_ENTRY)
    hashes = []
    for inject in ((), ("--inject", "crash@rank=0,step=20,gen=0")):
        job = start_job(*inject, str(script))
        assert job.wait(90) == 0, job.output
        hashes.append(re.search(r"HASH (\w+)", job.output)[1])
    assert hashes[0] == hashes[1]
    assert [f["kind"] for f in primary_failures(job)] == ["crash"]


@pytest.mark.timeout(240)
def test_a_lost_local_node_is_replaced_by_the_supervisor_forked_at_start(start_job, tmp_path, gpt_baseline):
    """Local mode: the launcher keeps m supervisors (m = 1 here), forked at its start, for the first nodes lost (no
    interpreter to start, nothing to import; a later loss gets a new interpreter, as --tui's supervisors are). The
    job ends bitwise."""
    args, out = gpt_args(tmp_path, "lost")
    job = start_job(*NODES, "--inject", "node-loss@node=1,step=15", *args)
    started = job.wait_for_event(lambda e: e["event"] == "node_start" and e["node"] == 1 and e["incarnation"] == 2)
    command = " ".join(psutil.Process(started["pid"]).cmdline())
    assert job.wait(180) == 0, job.output
    assert [f["kind"] for f in failures(job)] == ["node-lost"], job.output
    assert out.read_text().strip() == gpt_baseline
    assert "-m ftrun.launch.launcher" in command, command  # a fork of the launcher, not -m ftrun.launch.supervisor
    assert_job_left_nothing(job)


@pytest.mark.extended  # make test: test_spares' and test_etcd_jobs' lost nodes
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
    time.sleep(3 * node_timeout)  # a replacement machine takes a while: the loss is declared once, not again
    replacement = start_job(*common, "--node-rank", "1", *script, job_id="multinode", log_dir=node0.log_dir)
    assert replacement.wait() == 0, replacement.output
    assert node0.wait() == 0, node0.output
    assert [(f["kind"], f["node"], f["generation"]) for f in failures(node0)] == [("node-lost", 1, 1)]
    waits = [(e["generation"], e["missing"]) for e in node0.events() if e["event"] == "rendezvous_wait"]
    assert waits == [(1, [1])]  # said once, by node 0
    assert_job_left_nothing(node0)


@pytest.mark.extended  # make test: test_slurm's srun crash and test_network's hosts (a launcher per node)
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


@pytest.mark.timeout(120)
def test_a_stop_reaches_a_stopped_supervisor(start_job):
    """A supervisor stopped (SIGSTOP: a debugger, a job-control mistake) kept the stop the launcher passed on
    pending, and the launcher waited on it for good: one SIGTERM or Ctrl-C did not end the job. The launcher now
    continues its supervisors (SIGCONT) after passing a stop on, as systemd does."""
    job = start_job("--nproc-per-node", "1", str(SCRIPTS / "sleeper.py"), "--seconds", "60")
    supervisor = job.wait_for_event(lambda e: e["event"] == "node_start")["pid"]
    job.wait_for_event(lambda e: e["event"] == "first_heartbeat")
    os.kill(supervisor, signal.SIGSTOP)
    job.proc.send_signal(signal.SIGTERM)
    assert job.wait(timeout=30) == 143, job.output
    assert_job_left_nothing(job)


def ftrun_clean(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ftrun", "clean", *args], capture_output=True, text=True,
                          timeout=60)


def snapshotting_job(start_job, steps: int):
    """A 2-node job training with a snapshot every 2 steps, once both slots of a rank hold one."""
    job = start_job("--nnodes", "2", "--nproc-per-node", "1", str(TRAIN_GPT), "--steps", str(steps),
                    "--snapshot-every", "2", "--step-time", "0.02")
    wait_running(job)
    deadline = time.monotonic() + 30
    while not any(path.endswith("slot1") for path in job_segments(job.job_id)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return job


@pytest.mark.timeout(180)
def test_kill_9_of_ftrun_leaves_files_that_ftrun_clean_removes_but_never_a_live_jobs(start_job):
    job = snapshotting_job(start_job, steps=2000)
    refused = ftrun_clean("--job", job.job_id)
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1, refused
    assert f"job {job.job_id} is running (launcher pid {job.proc.pid}" in refused.stderr
    listed = ftrun_clean("--dry-run")
    assert f"job {job.job_id}: running" in listed.stdout and job_segments(job.job_id), listed
    os.kill(job.proc.pid, signal.SIGKILL)  # supervisors, keepers and trainers die with it; files stay
    job.proc.wait(10)
    deadline = time.monotonic() + 10
    while job_processes(job.job_id) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = {os.path.basename(path).removeprefix(f"ftrun-{job.job_id}-") for path in job_segments(job.job_id)}
    assert {"launcher", "node0-heartbeat", "node0-rank0-slot0", "node1-rank0-slot1"} <= left, left
    cleaned = ftrun_clean("--job", job.job_id)
    assert cleaned.returncode == 0 and f"job {job.job_id}: removed {len(left)} file(s)" in cleaned.stdout, cleaned
    assert_job_left_nothing(job)


@pytest.mark.extended  # make test: two starts of one job at the same moment
@pytest.mark.timeout(180)
def test_a_second_start_of_a_running_job_id_is_refused_and_touches_nothing(start_job):
    """It used to unlink the running job's snapshots (its keeper gave up after 10 s, its supervisor cleaned up)."""
    job = snapshotting_job(start_job, steps=400)
    before = set(job_segments(job.job_id))
    second = start_job("--nnodes", "2", "--nproc-per-node", "1", str(TRAIN_GPT), job_id=job.job_id)
    assert second.wait(30) == 2, second.output
    assert second.output.strip().splitlines() == [f"ftrun: error: job {job.job_id} already runs node 0 on this host "
                                                  "(its keeper holds the node's snapshots): stop it first, or choose "
                                                  "another --rdzv-id"]
    assert before <= set(job_segments(job.job_id))  # nothing of the running job was touched
    assert job.wait(120) == 0 and not failures(job), job.output
    assert_job_left_nothing(job)


@pytest.mark.timeout(180)
def test_two_starts_of_one_job_at_the_same_moment_one_runs_and_the_other_touches_nothing(start_job, tmp_path):
    """Both pass the command's check (no keeper of the job holds its socket yet); the launchers' claim on the
    job's nodes lets one run. The other used to move the job's persisted steps aside (--no-resume) from under the
    first, and then share its snapshot files (a helper's report)."""
    ckpt = tmp_path / "ckpt"
    job_id = f"t{uuid.uuid4().hex[:10]}"
    step = ckpt / job_id / "step-00000010"
    step.mkdir(parents=True)
    ranks = {"0": {"file": "rank-00000.snap", "bytes": 4096, "checksum": 1, "digest": 1}}
    (step / "manifest.json").write_text(json.dumps({"format": 1, "job": job_id, "step": 10, "world": 1,
                                                    "nnodes": 1, "nproc_per_node": 1, "time": 0, "ranks": ranks}))
    args = ("--nproc-per-node", "1", "--ckpt-dir", str(ckpt), "--no-resume", str(SCRIPTS / "sleeper.py"),
            "--seconds", "8")  # long enough that neither can end before the other's launcher starts
    jobs = [start_job(*args, job_id=job_id) for _ in range(2)]
    codes = sorted(job.wait(120) for job in jobs)
    refused = next(job for job in jobs if job.proc.returncode == 2)
    assert codes == [0, 2], [job.output for job in jobs]
    (line,) = refused.output.strip().splitlines()  # the claim's line (the keeper's if the other was that quick)
    assert line.startswith(f"ftrun: error: job {job_id} already runs node 0 on this host (") and line.endswith(
        "): stop it first, or choose another --rdzv-id"), line
    assert sum("--no-resume: moved 1 persisted step(s)" in job.output for job in jobs) == 1
    assert not step.exists() and len(list(ckpt.joinpath(job_id).glob("previous-*/step-00000010"))) == 1
    for job in jobs:
        assert_job_left_nothing(job)


@pytest.mark.extended  # make test: test_a_stop_signal_while_the_job_starts_ends_it_in_one_line
@pytest.mark.timeout(120)
def test_sigterm_before_the_first_generation_agreed_ends_at_once_with_nothing_to_persist(start_job, tmp_path):
    """Stopped as soon as its supervisor is up (its link not yet agreed where the first generation restores
    from): no trainer of this run took a step, so there is nothing to persist. The final persist waited its whole
    grace (60 s) and reported 'did not complete' (1 run in 4 here); now exit 143 at once."""
    for attempt in range(3):  # the window is short: each attempt signals at the supervisor's first line
        job = start_job("--ckpt-dir", str(tmp_path / f"ckpt{attempt}"), str(SCRIPTS / "hello.py"))
        job.wait_for_event(lambda e: e["event"] == "node_start", timeout=60)
        os.killpg(job.proc.pid, signal.SIGTERM)
        assert job.wait(30) == 143, job.output
        assert "did not complete" not in job.output and "Traceback" not in job.output, job.output
        assert_job_left_nothing(job)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("when", ["cli", "imports", "store-wait"])
def test_a_stop_signal_while_the_job_starts_ends_it_in_one_line(start_job, tmp_path, when):
    """A node waiting for its control store (none there): SIGINT while the command loads and checks (a traceback
    from an import, or typer's silent exit 130), while the launcher imports torch, or while it waits, used to end
    in a KeyboardInterrupt traceback (or be lost)."""
    script = SCRIPTS / "hello.py"
    if when == "cli":  # a script the command reads for a second or so before the exec (import_settings parses it:
        script = tmp_path / "long.py"  # it names os.environ)
        script.write_text("import os\nos.environ.get('HOME')\n" + "\n".join(f"x{i} = {i}" for i in range(60000)))
    job = start_job("--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
                    "--rdzv-timeout", "60", str(script))
    if when == "cli":  # in the command's checks: PyYAML's C extension is mapped (the config's import) or the exec
        deadline = time.monotonic() + 30
        process = psutil.Process(job.proc.pid)
        while not any("_yaml" in m.path for m in process.memory_maps()) and "ftrun.launch.launcher" not in " ".join(
                process.cmdline()):
            assert time.monotonic() < deadline
            time.sleep(0.005)
    elif when == "imports":  # as soon as the launcher's interpreter runs: the signal is held until it can stop
        deadline = time.monotonic() + 30
        while "ftrun.launch.launcher" not in " ".join(psutil.Process(job.proc.pid).cmdline()):
            assert time.monotonic() < deadline
            time.sleep(0.01)
    else:
        waiting = job.wait_for_event(lambda e: e["event"] == "store_wait", timeout=30)  # said once, after 3 s
        assert "waiting for the control store at 127.0.0.1:" in waiting["message"]
    job.proc.send_signal(signal.SIGINT)
    assert job.wait(30) == 130, job.output
    assert job.output.strip().splitlines()[-1] == "ftrun: stopped by SIGINT while the job was starting", job.output
    assert "Traceback" not in job.output
    assert_job_left_nothing(job)


@pytest.mark.extended  # make test: test_sigterm_to_one_supervisor_stops_the_whole_job_after_persisting
@pytest.mark.timeout(180)
def test_the_same_stop_delivered_twice_still_persists_the_newest_step(start_job, tmp_path):
    """A signal to a process group that a wrapper (timeout) relays reaches the launcher twice: it used to count as
    a second Ctrl-C, which stops at once, without the final persist."""
    ckpt = tmp_path / "ckpt"
    job = start_job("--ckpt-dir", str(ckpt), "--persist-every", "1000", str(TRAIN_GPT), "--steps", "2000",
                    "--snapshot-every", "5", "--step-time", "0.02")
    deadline = time.monotonic() + 120
    while "step 20 " not in job.output:  # snapshots of step 10 and more taken
        assert time.monotonic() < deadline, job.output
        time.sleep(0.1)
    job.proc.send_signal(signal.SIGTERM)
    time.sleep(0.05)
    job.proc.send_signal(signal.SIGTERM)
    assert job.wait(60) == 128 + signal.SIGTERM, job.output
    persisted = [e["step"] for e in job.events() if e["event"] == "persisted"]
    assert len(persisted) == 1 and persisted[0] >= 10, job.output
    assert_job_left_nothing(job)


def supervisor_of(job, node: int) -> psutil.Process:
    """The supervisor of ``node``, from its node_start event (a supervisor's environment does not name its node:
    it gets its spec from the launcher on a pipe)."""
    return psutil.Process(job.wait_for_event(lambda e: e["event"] == "node_start" and e.get("node") == node)["pid"])


@pytest.mark.timeout(180)
def test_sigterm_to_one_supervisor_stops_the_whole_job_after_persisting(start_job, tmp_path):
    """It used to stop its node alone: the other node restarted and waited for it, the final persist timed out."""
    ckpt = tmp_path / "ckpt"
    job = start_job("--nnodes", "2", "--nproc-per-node", "1", "--ckpt-dir", str(ckpt), "--persist-every", "100",
                    "--persist-grace", "20", str(TRAIN_GPT), "--steps", "2000", "--snapshot-every", "5",
                    "--step-time", "0.02")
    job.wait_for_event(lambda e: e["event"] == "protected" and e["step"] >= 10, timeout=120)
    supervisor_of(job, 1).send_signal(signal.SIGTERM)
    assert job.wait(60) == 128 + signal.SIGTERM, job.output
    events = job.events()
    assert [(e["node"], e["signal"]) for e in events if e["event"] == "stop"] == [(1, "SIGTERM")]
    assert not failures(job) and not [e for e in events if e["event"] == "durability"], job.output
    persisted = [e["step"] for e in events if e["event"] == "persisted"]
    assert len(persisted) == 1 and persisted[0] >= 10, job.output
    assert glob.glob(str(ckpt / "*" / f"step-{persisted[0]:08d}" / "manifest.json")), job.output
    assert "stopped by a signal (exit code 143): 0 failure(s), 0 restart(s)" in job.output
    assert job.output.count("(all 2 nodes simulated on this host: no --node-rank)") == 1  # said once, at start
    assert_job_left_nothing(job)
