"""The durable tier end to end: keepers persist snapshots to --ckpt-dir in the background; a job killed whole,
stopped by SIGTERM or losing more nodes than parity covers resumes from disk with exactly the failure-free
run's state; corrupt steps are never loaded; a full disk degrades durability without stopping training."""

from __future__ import annotations

import glob
import hashlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from conftest import (NODES, TRAIN_GPT, assert_job_left_nothing, gpt_args, job_segments, kill_job, primary_failures,
                      restores, run_bitwise)
from ftrun.snapshot.keeper import STALE_INTERVALS
from ftrun.snapshot.slot import HEADER_SIZE


def durable(ckpt, *extra: str) -> tuple[str, ...]:
    return ("--ckpt-dir", str(ckpt), "--persist-every", "1", *extra)


def from_disk(job) -> dict:
    """The restore decision of the job's first generation that restored from disk."""
    plans = [plan for plan in restores(job).values() if plan["restored_from"] == "disk"]
    assert plans, job.output
    return plans[0]


@pytest.mark.extended  # make test: test_slurm's requeued job resumes from disk, the disk fallback below
@pytest.mark.timeout(300)
def test_job_killed_whole_resumes_from_disk_bitwise(start_job, tmp_path, gpt_baselines):
    ckpt = tmp_path / "ckpt"
    args, out = gpt_args(tmp_path, "killed", "--step-time", "0.03")
    first = start_job(*NODES, *durable(ckpt), *args)
    first.wait_for_event(lambda e: e["event"] == "persisted" and e["step"] >= 30, timeout=120)
    kill_job(first)  # every process at once; then the RAM is gone too, as after losing every machine
    for path in job_segments(first.job_id):
        os.unlink(path)
    again = start_job(*NODES, *durable(ckpt), *args, job_id=first.job_id, log_dir=tmp_path / "logs-again")
    assert again.wait(180) == 0, again.output
    assert out.read_text().strip() == gpt_baselines(2, 2)
    plan = from_disk(again)
    assert plan["generation"] == 0 and plan["step"] >= 30, plan
    assert_job_left_nothing(again)


@pytest.mark.extended  # make test: test_slurm's SIGTERM, persist and requeued resume
@pytest.mark.timeout(300)
def test_sigterm_persists_the_newest_step_and_a_rerun_resumes_bitwise(start_job, tmp_path, gpt_baselines):
    ckpt = tmp_path / "ckpt"
    args, out = gpt_args(tmp_path, "term", "--step-time", "0.03")
    flags = ("--ckpt-dir", str(ckpt), "--persist-every", "100")  # no periodic persist: only the final one
    first = start_job(*NODES, *flags, *args)
    first.wait_for_event(lambda e: e["event"] == "first_heartbeat", timeout=120)
    first.wait_for_event(lambda e: e["event"] == "protected" and e["step"] >= 20, timeout=120)
    os.kill(first.proc.pid, signal.SIGTERM)
    assert first.wait(120) == 128 + signal.SIGTERM, first.output
    persisted = [e for e in first.events() if e["event"] == "persisted"]
    assert len(persisted) == 1 and persisted[0]["step"] >= 20, first.output
    assert "ok: newest step on disk" in first.output
    assert_job_left_nothing(first)
    again = start_job(*NODES, *flags, *args, job_id=first.job_id, log_dir=tmp_path / "logs-again")
    assert again.wait(180) == 0, again.output
    assert out.read_text().strip() == gpt_baselines(2, 2)
    assert from_disk(again)["step"] == persisted[0]["step"]


@pytest.mark.timeout(300)
def test_more_nodes_lost_than_parity_covers_falls_back_to_disk_bitwise(start_job, tmp_path, gpt_baselines):
    ckpt = tmp_path / "ckpt"
    job = run_bitwise(start_job, tmp_path, gpt_baselines(2, 2), "disk-fallback", *durable(ckpt, "--ec-parity", "0"),
                      "--inject", "node-loss@node=1,step=28")
    plan = restores(job)[1]
    assert plan["restored_from"] == "disk" and plan["step"] in (10, 20), job.output


@pytest.mark.extended  # make test: test_persist's test_corrupt_rank and test_export
@pytest.mark.timeout(300)
def test_export_matches_the_final_state_and_a_corrupt_newest_step_is_never_loaded(start_job, tmp_path,
                                                                                   gpt_baselines):
    ckpt, out_dir = tmp_path / "ckpt", tmp_path / "export"
    first = run_bitwise(start_job, tmp_path, gpt_baselines(2, 2), "part1", *durable(ckpt, "--keep", "3"))
    steps = sorted(int(d.split("-")[1]) for d in os.listdir(ckpt / first.job_id) if d.startswith("step-"))
    assert len(steps) >= 2 and steps[-1] == 60, steps  # a step may be skipped when the next is committed meanwhile

    for fmt in ("torch", "safetensors"):  # the final step, exported, is the state the job ended with
        done = subprocess.run([sys.executable, "-m", "ftrun", "export", str(ckpt), "--format", fmt,
                               str(out_dir / fmt)], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
    state = torch.load(out_dir / "torch" / "rank-00000.pt", weights_only=True)
    assert exported_state_hash(state) == gpt_baselines(2, 2)
    flat = load_file(out_dir / "safetensors" / "rank-00000.safetensors")
    weights = {key.removeprefix("model/"): value for key, value in flat.items() if key.startswith("model/")}
    assert weights.keys() == state["model"].keys()
    assert all(torch.equal(value, state["model"][key]) for key, value in weights.items())

    # a flipped bit in the newest step: the older is used
    victim = ckpt / first.job_id / "step-00000060" / "rank-00002.snap"
    with open(victim, "r+b") as f:
        f.seek(4096 + 1000)
        byte = f.read(1)
        f.seek(4096 + 1000)
        f.write(bytes([byte[0] ^ 0x01]))
    again = run_bitwise(start_job, tmp_path, gpt_baselines(2, 2), "part2", *durable(ckpt, "--keep", "3"),
                        job_id=first.job_id)
    corrupt = [e for e in again.events() if e["event"] == "restore_source_failed"]
    assert corrupt and corrupt[0]["step"] == 60 and "rank 2" in json.dumps(corrupt[0]["problems"]), again.output
    assert from_disk(again)["step"] == steps[-2]


@pytest.mark.timeout(300)
def test_full_disk_degrades_durability_and_training_completes_from_ram(start_job, tmp_path, gpt_baselines,
                                                                        small_tmpfs):
    small = small_tmpfs(1)
    job = run_bitwise(start_job, tmp_path, gpt_baselines(2, 2), "full", *durable(small),
                      "--inject", "crash@rank=1,step=35")
    warnings = [line for line in job.output.splitlines() if "durability degraded" in line]
    assert len(warnings) == 1 and f"No space left on device ({small}" in warnings[0], job.output  # the file
    assert "ftrun: durability DEGRADED" in job.output
    final = [line for line in job.output.splitlines() if "the final persist" in line]  # fails at once, no timeout
    assert final and all("failed: " in line and "did not complete" not in line for line in final), job.output
    assert len(final) == 1 and "[node 0]" in final[0], final  # the job's outcome, said once (not once per node)
    assert restores(job)[1]["restored_from"] == "ram"  # the crash still restores from RAM
    assert glob.glob(f"{small}/*/step-*") == []


def exported_state_hash(state: dict) -> str:
    """examples/train_gpt.py's state_hash, over the state exported from disk."""
    digest = hashlib.sha256()
    for name, tensor in sorted(state["model"].items()):
        digest.update(name.encode())
        digest.update(tensor.contiguous().numpy().tobytes())
    for index, entry in sorted(state["optim"]["state"].items()):
        for key, value in sorted(entry.items()):
            digest.update(f"{index}.{key}".encode())
            digest.update(value.contiguous().numpy().tobytes() if torch.is_tensor(value) else repr(value).encode())
    digest.update(repr((state["sched"]["last_epoch"], state["data"])).encode())
    return digest.hexdigest()


def persisted_steps(job) -> list[int]:
    return [e["step"] for e in job.events() if e["event"] == "persisted"]


@pytest.mark.timeout(300)
def test_a_snapshot_every_step_persists_every_nth_step(start_job, tmp_path):
    """Keepers hold the step a persist names before any node may overwrite it: with a snapshot at every step,
    every persist succeeds and disk never falls more than persist-every steps, the securing lag and one round
    behind."""
    ckpt = tmp_path / "ckpt"
    job = start_job("--nnodes", "2", "--ckpt-dir", str(ckpt), "--persist-every", "5", str(TRAIN_GPT), "--steps", "60",
                    "--snapshot-every", "1")
    assert job.wait(180) == 0, job.output
    assert "durability degraded" not in job.output, job.output
    steps = persisted_steps(job)
    assert steps[-1] == 60 and len(steps) >= 6, steps
    # a round opens every 5 snapshot steps and names the step secured then, which trails training by at most
    # STALE_INTERVALS (4) snapshots; a round takes a few link ticks (16 steps allows 0.4 s on a loaded machine)
    assert all(b - a <= 5 + STALE_INTERVALS + 16 for a, b in zip([0, *steps], steps)), steps
    assert "ftrun: durability ok: newest step on disk 60 (0 step(s) behind training" in job.output
    assert_job_left_nothing(job)


@pytest.mark.timeout(300)
def test_jobs_sharing_a_ckpt_dir_write_and_prune_only_their_own_steps(start_job, tmp_path, gpt_baselines):
    ckpt = tmp_path / "ckpt"
    flags = ("--nproc-per-node", "2", *durable(ckpt, "--keep", "1"))
    args_a, out_a = gpt_args(tmp_path, "a")
    args_b, out_b = gpt_args(tmp_path, "b")
    a, b = start_job(*flags, *args_a), start_job(*flags, *args_b)  # at once: the same step numbers
    assert a.wait(180) == 0, a.output
    assert b.wait(180) == 0, b.output
    for job, out in ((a, out_a), (b, out_b)):
        assert out.read_text().strip() == gpt_baselines(1, 2)
        assert sorted(os.listdir(ckpt / job.job_id)) == ["step-00000060"], job.output
        assert "ftrun: durability ok" in job.output
    listed = subprocess.run([sys.executable, "-m", "ftrun", "inspect", str(ckpt), "--json"], capture_output=True,
                            text=True, timeout=60)
    assert listed.returncode == 0, listed.stderr
    rows = json.loads(listed.stdout)["steps"]
    assert sorted((row["job"], row["step"], row["state"], row["corrupt"]) for row in rows) == sorted(
        [(a.job_id, 60, "complete", {}), (b.job_id, 60, "complete", {})])


@pytest.mark.extended  # make test: test_dcp_memory's durable DCP copy, this file's pruning
@pytest.mark.timeout(300)
def test_a_dcp_job_ends_with_keep_steps_once_its_copies_are_written(start_job, tmp_path):
    """--ckpt-format dcp keeps the step being copied and the newest copied beyond --keep; once the final step's
    copy is written neither is needed, but nothing pruned them: a job ended with --keep + 2 steps on disk."""
    ckpt = tmp_path / "ckpt"
    job = start_job("--nproc-per-node", "2", *durable(ckpt, "--keep", "1", "--ckpt-format", "dcp"), str(TRAIN_GPT),
                    "--steps", "40", "--snapshot-every", "5", "--step-time", "0.05")
    assert job.wait(240) == 0, job.output
    assert sorted(os.listdir(ckpt / job.job_id)) == ["step-00000040"], job.output
    assert os.listdir(ckpt / job.job_id / "step-00000040" / "dcp"), job.output
    assert_job_left_nothing(job)


@pytest.mark.extended  # make test: test_dcp_memory's reshard, this file's shared directories
@pytest.mark.timeout(300)
def test_a_run_at_another_world_size_sets_the_earlier_steps_aside_in_one_directory(start_job, tmp_path):
    """A run resumed at another world size (from a DCP copy) moves the earlier world's steps aside as it persists
    (here as it persists steps 10 or 15 and 20 again, 1.5 s and more apart, and the step its DCP copy spared once
    the copy of step 25 is written): into one previous-<time>/ directory, not a new one for each move a second or
    more after the last."""
    ckpt = tmp_path / "ckpt"
    flags = durable(ckpt, "--ckpt-format", "dcp")  # --keep 2, and the step a DCP copy spares: 2 or 3 steps stay
    first = start_job("--nnodes", "2", *flags, str(TRAIN_GPT), "--steps", "20", "--snapshot-every", "5")
    assert first.wait(240) == 0, first.output
    left = sorted(name for name in os.listdir(ckpt / first.job_id) if name.startswith("step-"))
    assert len(left) >= 2 and left[-1] == "step-00000020", left
    again = start_job(*flags, str(TRAIN_GPT), "--steps", "25", "--snapshot-every", "5",
                      "--step-time", "0.3", job_id=first.job_id, log_dir=tmp_path / "logs-again")
    assert again.wait(240) == 0, again.output
    aside = [name for name in os.listdir(ckpt / first.job_id) if name.startswith("previous-")]
    assert len(aside) == 1, again.output
    assert sorted(os.listdir(ckpt / first.job_id / aside[0])) == left, again.output
    assert_job_left_nothing(again)


@pytest.mark.extended  # make test: test_more_nodes_lost_than_parity_covers_falls_back_to_disk_bitwise
@pytest.mark.timeout(300)
def test_a_failed_parity_rebuild_falls_back_to_disk_within_the_generation(start_job, tmp_path, gpt_baselines):
    """Node 1's slots and node 0's parity of them are corrupt: the rebuild fails once, every node plans the
    next source (disk) in the same generation, and the job ends bit-exact after one failure."""
    ckpt = tmp_path / "ckpt"
    args, out = gpt_args(tmp_path, "rebuild-fails", "--step-time", "0.05")
    job = start_job(*NODES, *durable(ckpt), "--hang-timeout", "2", *args)
    job.wait_for_event(lambda e: e["event"] == "persisted" and e["step"] >= 20, timeout=120)
    trainers = [job.trainer(rank) for rank in range(4)]
    for trainer in trainers:  # still: nothing rewrites slots or parity now; then a hang restarts the job
        trainer.suspend()
    time.sleep(0.5)
    victims = glob.glob(f"/dev/shm/ftrun-{job.job_id}-node1-rank*-slot*")
    victims += glob.glob(f"/dev/shm/ftrun-{job.job_id}-node0-parity*")
    assert len(victims) >= 4, victims
    for path in victims:
        with open(path, "r+b") as f:
            f.seek(2 * HEADER_SIZE + 100)  # inside the first rank's tensor bytes (a parity image has its header)
            byte = f.read(1)
            f.seek(2 * HEADER_SIZE + 100)
            f.write(bytes([byte[0] ^ 0xFF]))
    assert job.wait(180) == 0, job.output
    assert out.read_text().strip() == gpt_baselines(2, 2)
    assert len(primary_failures(job)) == 1, job.output  # the hang, and no restart for the failed source
    plan = restores(job)[1]
    assert plan["restored_from"] == "disk" and plan["step"] >= 20, job.output
    assert_job_left_nothing(job)


@pytest.mark.extended  # make test: the full disk and the failed rebuild's fall back to disk (the disk tier's errors)
@pytest.mark.timeout(300)
def test_a_checkpoint_dir_that_cannot_be_listed_at_a_restart_restores_from_ram(start_job, tmp_path, gpt_baselines):
    """The job's checkpoint directory cannot be listed as a crash restarts the job (a symbolic link loop stands for
    an NFS server's EIO or ESTALE): the node agrees its restore step without the disk's steps, saying why, and the
    job ends bit-exact; its keeper link does not die with the error, leaving the trainers waiting for a plan."""
    ckpt = tmp_path / "ckpt"
    args, out = gpt_args(tmp_path, "unlisted", "--step-time", "0.05")
    job = start_job("--nproc-per-node", "1", "--ckpt-dir", str(ckpt), "--persist-every", "1000", "--inject",
                    "crash@rank=0,step=40", "--hang-timeout-initial", "60", *args)
    job.wait_for_event(lambda e: e["event"] == "first_heartbeat")
    jobdir = ckpt / job.job_id
    jobdir.rename(ckpt / "moved")
    jobdir.symlink_to(jobdir.name)
    assert job.wait(180) == 0, job.output
    assert out.read_text().strip() == gpt_baselines(1, 1)
    assert restores(job)[1]["restored_from"] == "ram", job.output
    assert "Too many levels of symbolic links" in job.output
    assert len(primary_failures(job)) == 1, job.output  # the crash, and no hang of trainers waiting for a plan
    assert_job_left_nothing(job)
