"""ftrun under a real SLURM (munge, slurmctld, 4 slurmd on this host; the ``slurm`` fixture): ``srun ftrun``
with an injected crash, a node lost by ``scontrol update state=down`` and replaced by a spare in the next step
of the batch script from ``ftrun sbatch-template``, and SIGTERM (preemption): persist, exit 143, requeue,
resume. Every run ends with exactly the failure-free run's parameters."""

from __future__ import annotations

import glob
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest

from conftest import ROOT, events_of, gpt_args, job_processes, job_segments

pytestmark = pytest.mark.timeout(300)
FTRUN = [sys.executable, "-m", "ftrun"]
STEP_TIME = "0.1"  # seconds per training step: a node can be lost or a step signalled mid-run


@contextmanager
def slurm_job(slurm):
    """Yields a list for the test to put its SLURM job id in; afterwards the job is killed (if still there) and
    its processes and /dev/shm files are gone, whatever the test did."""
    jobs: list[str] = []
    try:
        yield jobs
    finally:
        for job in jobs:
            subprocess.run(["scancel", "--signal=KILL", "--full", job], env=slurm.env(), capture_output=True,
                           timeout=30)
            deadline = time.monotonic() + 30
            while job_processes(f"slurm-{job}") and time.monotonic() < deadline:
                time.sleep(0.1)
            for path in job_segments(f"slurm-{job}"):
                os.unlink(path)


def sbatch(slurm, script: Path, output: Path, *flags: str) -> str:
    """Submit ``script``; returns the job id."""
    done = subprocess.run(["sbatch", "--parsable", "-o", str(output), *flags, str(script)], env=slurm.env(),
                          cwd=ROOT, check=True, capture_output=True, text=True, timeout=30)
    return done.stdout.strip().split(";")[0]


def wait_for_line(path: Path, pattern: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not (path.exists() and re.search(pattern, path.read_text())):
        assert time.monotonic() < deadline, f"{pattern!r} not in {path}:\n{path.read_text() if path.exists() else ''}"
        time.sleep(0.1)


def wait_for_job_end(slurm, job: str, timeout: float = 180) -> str:
    """Wait until SLURM has finished job ``job``; returns its state (COMPLETED, FAILED, ...) and exit code."""
    deadline = time.monotonic() + timeout
    while True:
        shown = subprocess.run(["scontrol", "show", "job", job], env=slurm.env(), capture_output=True, text=True,
                               timeout=30).stdout
        found = re.search(r"JobState=(\S+).*?ExitCode=(\S+)", shown, re.S)
        if found and found.group(1) not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED"):
            return f"{found.group(1)} {found.group(2)}"
        assert time.monotonic() < deadline, f"SLURM job {job} still running: {shown}"
        time.sleep(0.2)


def launcher_of(job: str, node: str) -> psutil.Process:
    """The ftrun launcher of SLURM job ``job`` on node ``node`` (its step's task)."""
    for proc in psutil.process_iter(["name"]):
        try:
            env = proc.environ()
        except (psutil.Error, OSError):
            continue
        if proc.info["name"] == "ftrun" and env.get("SLURM_JOB_ID") == job and env.get("SLURMD_NODENAME") == node:
            return proc
    raise AssertionError(f"no ftrun launcher of job {job} on {node}")


@contextmanager
def srun_ftrun(slurm, jobs: list[str], output: Path, *ftrun_args: str) -> Iterator[subprocess.Popen[bytes]]:
    """``srun -N2 ftrun --nproc-per-node 2 FTRUN_ARGS``, its output in ``output``; its SLURM job id goes in ``jobs``
    (:func:`slurm_job`'s) once it shows. Killed at the end if it still runs."""
    with open(output, "wb") as sink:
        srun = subprocess.Popen(["srun", "-N2", "--ntasks-per-node", "1", *FTRUN, "--nproc-per-node", "2",
                                 *ftrun_args], env=slurm.env(), cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT)
    try:
        wait_for_line(output, r"job slurm-\d+")
        jobs.append(re.search(r"job slurm-(\d+)", output.read_text()).group(1))  # type: ignore[union-attr]
        yield srun
    finally:
        if srun.poll() is None:
            srun.kill()
            srun.wait()


def batch_script(tmp_path: Path, name: str, nodes: int, spares: int, ftrun_args: list[str]) -> Path:
    script = subprocess.run([*FTRUN, "sbatch-template", "--nodes", str(nodes), "--spares", str(spares), "--",
                             *ftrun_args], capture_output=True, text=True, timeout=60, check=True).stdout
    path = tmp_path / f"{name}.sh"
    path.write_text(script)
    return path


def test_srun_two_nodes_survive_a_crash_bitwise(slurm, gpt_baselines, tmp_path):
    args, out = gpt_args(tmp_path, "srun")
    logs = tmp_path / "logs"
    with slurm_job(slurm) as jobs:
        done = subprocess.run(["srun", "-N2", "--ntasks-per-node", "1", *FTRUN, "--nproc-per-node", "2",
                               "--log-dir", str(logs), "--inject", "crash@rank=1,step=30", *args],
                              env=slurm.env(), cwd=ROOT, capture_output=True, text=True, timeout=240)
        assert done.returncode == 0, done.stdout + done.stderr
        job = re.search(r"job slurm-(\d+)", done.stderr).group(1)  # type: ignore[union-attr]
        jobs.append(job)
        assert out.read_text().strip() == gpt_baselines(2, 2), done.stderr
        events = events_of(logs)
        ranks = {e["slurm_node"]: e["node_rank"] for e in events if e["event"] == "slurm_step"}
        assert ranks == {"n1": 0, "n2": 1}, events
        assert {e["restored_from"] for e in events if e["event"] == "restore"} == {"ram"}, done.stderr
        assert f"job slurm-{job} succeeded" in done.stderr
        assert not job_segments(f"slurm-{job}")


@pytest.mark.extended  # make test: test_torchrun_flags' SIGUSR1 to every process of a local job
def test_slurm_s_sigusr1_to_every_process_of_the_step_is_ignored_in_one_line_and_the_job_goes_on(
        slurm, gpt_baselines, tmp_path):
    """``#SBATCH --signal=USR1@90`` warns of the time limit by SIGUSR1 to every process of the step (here
    ``scancel --signal=USR1``, the same delivery). Without SIGUSR1 in --signals-to-handle every ftrun launcher died
    of it (its default action), and the job with them; now each says so in one line and the job goes on. The
    trainers get SLURM's own copy: this script has no handler, so they die of it and restart from RAM."""
    args, out = gpt_args(tmp_path, "usr1", "--step-time", STEP_TIME)
    output = tmp_path / "srun.out"
    with slurm_job(slurm) as jobs, srun_ftrun(slurm, jobs, output, *args) as srun:
        wait_for_line(output, r"step 30 loss")
        subprocess.run(["scancel", "--signal=USR1", jobs[0]], env=slurm.env(), check=True, timeout=30)
        assert srun.wait(timeout=200) == 0, output.read_text()
    text = output.read_text()
    assert text.count("SIGUSR1 ignored: not in --signals-to-handle (SLURM sends it") == 2, text
    assert re.search(r"generation 1: trainers restore step \d+ from RAM", text), text
    assert out.read_text().strip() == gpt_baselines(2, 2), text


@pytest.mark.extended  # make test: test_status' TUI in the launcher's terminal, this file's srun jobs
def test_tui_under_srun_shows_one_view_of_the_job_once(slurm, tmp_path):
    """``srun -N2 ftrun --tui``: srun merges every node's output, and that is no terminal. Every node printed the
    whole view once a second (a 10 s job: 21 tables); now the step's first node prints it once, at the end."""
    with slurm_job(slurm) as jobs:
        done = subprocess.run(["srun", "-N2", "--ntasks-per-node", "1", *FTRUN, "--tui", "--nproc-per-node", "1",
                               *gpt_args(tmp_path, "tui", "--step-time", "0.05")[0]],
                              env=slurm.env(), cwd=ROOT, capture_output=True, text=True, timeout=240)
        output = done.stdout + done.stderr
        jobs.extend(re.findall(r"job slurm-(\d+) succeeded", output)[:1])
        assert done.returncode == 0 and jobs, output
        assert output.count("job ended: done") == 1 and output.count(f"job slurm-{jobs[0]}  ") == 1, output
        assert output.count(f"job slurm-{jobs[0]} succeeded") == 2 and "node 1's output in" in output, output


@pytest.mark.extended  # make test: the batch loop's next step after a launcher killed, test_spares' spares
def test_batch_script_replaces_a_lost_node_with_a_spare_and_resumes_from_ram_and_parity(slurm, gpt_baselines,
                                                                                       tmp_path):
    """Down node n2 mid-training: SLURM kills the step; the batch loop runs ftrun again on n1 (its RAM) and the
    spare n3, which rebuilds n2's ranks from n1's parity."""
    args, out = gpt_args(tmp_path, "loss", "--step-time", STEP_TIME)
    output = tmp_path / "batch.out"
    script = batch_script(tmp_path, "loss", 2, 1, ["--nproc-per-node", "2", "--log-dir", str(tmp_path / "logs"), *args])
    try:
        with slurm_job(slurm) as jobs:
            job = sbatch(slurm, script, output)
            jobs.append(job)
            wait_for_line(output, r"step 30 loss")
            slurm.scontrol("update", "nodename=n2", "state=down", "reason=ftrun-test")
            # n2's RAM is gone with it: on a real cluster its /dev/shm is its own; here the nodes share one
            for path in glob.glob(f"/dev/shm/ftrun-slurm-{job}-node1-*") + [f"/dev/shm/ftrun-slurm-{job}-host-n2"]:
                os.unlink(path)
            assert wait_for_job_end(slurm, job) == "COMPLETED 0:0", output.read_text()
            text = output.read_text()
            assert out.read_text().strip() == gpt_baselines(2, 2), text
            assert "Node failure on n2" in text and "running ftrun again on the nodes left" in text, text
            assert re.search(r"\[keeper 0\] re-adopted \d+ committed slot", text), text
            restore = re.search(r"generation 0: trainers restore step (\d+) from RAM \(node 1 rebuilt from the parity "
                                r"of nodes \[0\]\)", text)
            assert restore is not None and int(restore.group(1)) >= 20, text
            ranks = [(e["slurm_node"], e["node_rank"], e["claimed"]) for e in events_of(tmp_path / "logs")
                     if e["event"] == "slurm_step"]
            assert sorted(ranks[2:]) == [("n1", 0, 0), ("n3", 1, None)], ranks
            assert not job_segments(f"slurm-{job}")
    finally:
        slurm.resume("n2")


@pytest.mark.extended  # make test: test_srun_two_nodes_survive_a_crash_bitwise, test_recovery's stop tests
def test_sigterm_persists_exits_143_and_the_requeued_job_resumes_from_disk(slurm, gpt_baselines, tmp_path):
    """Preemption: SIGTERM to every process of the job's steps (as ``--signal=TERM@...`` before the time limit);
    ftrun persists the newest committed step and exits 143, and so does the batch script; `scontrol requeue`
    runs the job again (same job id), which resumes from disk."""
    args, out = gpt_args(tmp_path, "preempt", "--step-time", STEP_TIME)
    output = tmp_path / "batch.out"
    ckpt = tmp_path / "ckpt"
    script = batch_script(tmp_path, "preempt", 2, 0, ["--nproc-per-node", "2", "--ckpt-dir", str(ckpt),
                                                 "--persist-every", "1", "--persist-grace", "20", *args])
    with slurm_job(slurm) as jobs:
        job = sbatch(slurm, script, output, "--open-mode=append")
        jobs.append(job)
        wait_for_line(output, r"step 30 loss")
        subprocess.run(["scancel", "--signal=TERM", job], env=slurm.env(), check=True, timeout=30)  # its steps
        assert wait_for_job_end(slurm, job) == "FAILED 143:0", output.read_text()
        text = output.read_text()
        persisted = sorted(int(p.name.split("-")[1]) for p in ckpt.glob("*/step-*") if "partial" not in p.name)
        assert persisted and persisted[-1] >= 20, text
        assert "stopped after persisting (exit 143)" in text and not job_segments(f"slurm-{job}"), text
        # the requeued job runs on other nodes (n1 and n2 drained), as after a preemption; and sooner: slurmd
        # refuses a job it signalled for a while, and a requeued job is otherwise held back for 2 minutes
        slurm.scontrol("update", "nodename=n[1-2]", "state=drain", "reason=ftrun-test")
        try:
            slurm.scontrol("requeue", job)
            slurm.scontrol("update", f"jobid={job}", "StartTime=now")
            assert wait_for_job_end(slurm, job) == "COMPLETED 0:0", output.read_text()
        finally:
            slurm.resume("n1")
            slurm.resume("n2")
        text = output.read_text()
        assert f"trainers restore step {persisted[-1]} from disk" in text, text
        assert "SLURM step" in text and "on n3: node rank 0" in text, text
        assert out.read_text().strip() == gpt_baselines(2, 2), text


@pytest.mark.extended  # make test: test_spares' launcher replacing its killed supervisor
def test_a_supervisor_killed_under_srun_is_replaced_by_its_launcher_and_the_step_resumes_from_ram(
        slurm, gpt_baselines, tmp_path):
    """One node's supervisor dies while its ftrun lives (the OOM killer, a crash): SLURM does not end the step,
    and no other ftrun can join it, so that node's launcher starts a replacement supervisor for its node rank,
    whose keeper re-adopts the node's slots: the step goes on from RAM, instead of the other nodes waiting out
    --rdzv-timeout for a node that never comes and failing the job for good (exit 3)."""
    args, out = gpt_args(tmp_path, "supervisor", "--step-time", STEP_TIME)
    output = tmp_path / "srun.out"
    with slurm_job(slurm) as jobs, srun_ftrun(slurm, jobs, output, "--rdzv-timeout", "60", *args) as srun:
        wait_for_line(output, r"step 30 loss")
        supervisor = re.search(r"\[node 1\] supervisor up \(pid (\d+)", output.read_text())
        assert supervisor is not None, output.read_text()
        os.kill(int(supervisor.group(1)), signal.SIGKILL)
        assert srun.wait(timeout=240) == 0, output.read_text()
    text = output.read_text()
    assert "starting a replacement for node 1" in text, text
    assert re.search(r"generation 1: trainers restore step \d+ from RAM", text), text
    assert out.read_text().strip() == gpt_baselines(2, 2), text


@pytest.mark.extended  # make test: test_srun_two_nodes_survive_a_crash_bitwise, the nothing_replaces unit test
def test_a_launcher_killed_under_srun_ends_the_step_at_once_and_the_batch_script_resumes_from_ram(
        slurm, gpt_baselines, tmp_path):
    """One node's ftrun SIGKILLed (the OOM killer, an admin): its supervisor dies with it, SLURM neither ends the
    step nor starts a new task, and no spare waits. The other node waited out --rdzv-timeout (600 s) for a node
    that could not come and failed the job for good ("did not join", exit 3). Now it ends the step after
    --node-timeout, keeping its snapshots in RAM, and the batch script's next step resumes from RAM on both nodes
    (the killed one left its own), bit for bit."""
    args, out = gpt_args(tmp_path, "killed", "--step-time", STEP_TIME)
    output = tmp_path / "batch.out"
    script = batch_script(tmp_path, "killed", 2, 0, ["--nproc-per-node", "2", "--node-timeout", "2",
                                                     "--log-dir", str(tmp_path / "logs"), *args])
    with slurm_job(slurm) as jobs:
        job = sbatch(slurm, script, output)
        jobs.append(job)
        wait_for_line(output, r"step 30 loss")
        launcher_of(job, "n2").kill()
        assert wait_for_job_end(slurm, job) == "COMPLETED 0:0", output.read_text()
        text = output.read_text()
        assert "did not join" not in text, text
        assert re.search(r"\[node 0\] node 1 lost and nothing replaces it .*: ending the step; this node's snapshots "
                         r"stay in its RAM", text), text
        assert "running ftrun again on the nodes left" in text and "attempt 2 of" in text, text
        restore = re.search(r"generation 0: trainers restore step (\d+) from RAM", text)
        assert restore is not None and int(restore.group(1)) >= 20, text
        assert out.read_text().strip() == gpt_baselines(2, 2), text
        assert not job_segments(f"slurm-{job}")


@pytest.mark.extended  # 55-75 s; make test: nothing_replaces' unit test, the launcher killed under srun
def test_a_supervisor_stalled_under_srun_is_ended_by_its_launcher_and_the_job_completes_bitwise(
        slurm, gpt_baselines, tmp_path):
    """One node's supervisor stopped (SIGSTOP, as a frozen process) while its ftrun lives: the other node declares
    it lost. Its launcher waited on it for ever, and with it srun, whose step waits for every task, after the other
    node had ended the step: the batch script never ran its next step. The launcher now kills a supervisor that
    runs on --node-timeout after the job lost it; the job completes, bit for bit."""
    args, out = gpt_args(tmp_path, "stalled", "--step-time", STEP_TIME)
    output = tmp_path / "batch.out"
    script = batch_script(tmp_path, "stalled", 2, 0, ["--nproc-per-node", "2", "--node-timeout", "2", *args])
    with slurm_job(slurm) as jobs:
        job = sbatch(slurm, script, output)
        jobs.append(job)
        wait_for_line(output, r"step 30 loss")
        supervisor = re.search(r"\[node 1\] supervisor up \(pid (\d+)", output.read_text())
        assert supervisor is not None, output.read_text()
        os.kill(int(supervisor.group(1)), signal.SIGSTOP)
        assert wait_for_job_end(slurm, job, timeout=150) == "COMPLETED 0:0", output.read_text()
        text = output.read_text()
        assert re.search(r"\[launcher\] node 1's supervisor \(pid \d+\) still ran 2s after the job lost it", text), text
        # the other node waited for it, its ftrun beating, instead of ending the step
        assert "ending the step" not in text and "starting a replacement for node 1" in text, text
        assert re.search(r"generation 1: trainers restore step \d+ from RAM", text), text
        assert out.read_text().strip() == gpt_baselines(2, 2), text
        assert not job_segments(f"slurm-{job}")


@pytest.mark.extended  # make test: a node 1's launcher killed under srun (same end of the step, kept RAM)
def test_node_0_s_launcher_killed_under_srun_leaves_every_node_s_ram_to_the_next_step(slurm, gpt_baselines,
                                                                                      tmp_path):
    """Node 0's ftrun SIGKILLed: the c10d control store goes with it, and the step cannot go on. The other nodes
    failed "for good" (exit 3) and removed their snapshots, so with 3 nodes (k=2, m=1) the next step had node
    0's RAM alone, two nodes more lost than parity covers, and started again from step 0. They now keep their
    snapshots for the next step, which resumes from RAM on every node."""
    args, out = gpt_args(tmp_path, "store", "--step-time", STEP_TIME)
    output = tmp_path / "batch.out"
    script = batch_script(tmp_path, "store", 3, 0, ["--nproc-per-node", "1", *args])
    with slurm_job(slurm) as jobs:
        # the baseline's threads: its 3 simulated nodes share this host's cores (1 each), a SLURM node has them all
        job = sbatch(slurm, script, output, "--export=ALL,OMP_NUM_THREADS=1")
        jobs.append(job)
        wait_for_line(output, r"step 30 loss")
        launcher_of(job, "n1").kill()
        assert wait_for_job_end(slurm, job) == "COMPLETED 0:0", output.read_text()
        text = output.read_text()
        assert "control store lost" in text and "attempt 2 of" in text, text
        assert re.search(r"\[node [12]\] control store lost: .*: node 0's ftrun, which hosts it, is gone", text), text
        restore = re.search(r"generation 0: trainers restore step (\d+) from RAM \(held by all 3 ranks\)", text)
        assert restore is not None and int(restore.group(1)) >= 20, text
        assert out.read_text().strip() == gpt_baselines(3, 1), text
        assert not job_segments(f"slurm-{job}")


@pytest.mark.extended  # make test: test_slurm_env's standby in a step, test_spares' standby taking a rank
def test_a_standby_step_takes_the_rank_of_a_node_whose_launcher_was_killed(slurm, gpt_baselines, tmp_path):
    """A hot spare kept as a step of its own (``srun -w n3 ftrun --standby --rdzv-endpoint ...``): was refused
    ("drop --node-rank", a flag never given). It joins the training step's job, and when a node's ftrun is
    SIGKILLed it takes that node's rank, while the other node waits for it instead of ending the step."""
    args, out = gpt_args(tmp_path, "standby", "--step-time", STEP_TIME)
    ftrun = shlex.join([*FTRUN, "--nproc-per-node", "2", "--node-timeout", "2"])
    script = tmp_path / "standby.sh"
    script.write_text(f"""#!/bin/bash
#SBATCH --nodes=3 --ntasks-per-node=1 --no-kill
srun -N2 -n2 -w n1,n2 {ftrun} {shlex.join(args)} &
train=$!
srun -N1 -n1 -w n3 {ftrun} --standby --rdzv-endpoint 127.0.0.1:$((20000 + SLURM_JOB_ID % 20000)) {shlex.join(args)}
echo "standby exited $?"
wait $train
""")
    output = tmp_path / "batch.out"
    with slurm_job(slurm) as jobs:
        job = sbatch(slurm, script, output)
        jobs.append(job)
        wait_for_line(output, r"waiting for a lost node")
        wait_for_line(output, r"step 30 loss")
        launcher_of(job, "n2").kill()
        wait_for_job_end(slurm, job)
        text = output.read_text()
        assert re.search(r"spare standby-\S+ took node rank 1 \(generation 1: node 1 lost", text), text
        assert "ending the step" not in text and "standby exited 0" in text, text
        assert re.search(r"generation 1: trainers restore step \d+ from RAM", text), text
        assert out.read_text().strip() == gpt_baselines(2, 2), text
