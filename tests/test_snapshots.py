"""RAM snapshots end to end: real jobs of examples/train_gpt.py with injected failures restore from RAM and
end with exactly the failure-free run's state; at most one snapshot interval of steps is recomputed."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest

from conftest import EVERY, NODES, SCRIPTS, assert_job_left_nothing, gpt_args, primary_failures, restores, run_bitwise
from ftrun.snapshot.keeper import STALE_INTERVALS, find_segments
from ftrun.snapshot.slot import COMMITTED, HEADER_SIZE, SlotFile


def assert_recovered_from_ram(job, expected: list[tuple[int, int]], most_recomputed: int = EVERY) -> None:
    """Each failure (generation, restore step) as expected, and at most EVERY steps recomputed per failure."""
    decided = restores(job)
    failures = primary_failures(job)
    assert [(f["generation"], decided[f["generation"]]["step"]) for f in failures] == expected, job.output
    for failure in failures:
        restored = decided[failure["generation"]]
        assert restored["restored_from"] == "ram"
        assert 0 <= failure["step"] - restored["step"] <= most_recomputed, (failure, restored)


@pytest.mark.timeout(240)
def test_trainer_crash_restores_from_ram_bitwise(start_job, tmp_path, gpt_baseline):
    """With Python's warnings shown, neither a keeper nor a trainer leaves a socket for the collector (each printed
    a ResourceWarning at its exit)."""
    job = run_bitwise(start_job, tmp_path, gpt_baseline, "crash", "--inject", "crash@rank=1,step=25",
                      env={"PYTHONWARNINGS": "default"})
    assert_recovered_from_ram(job, [(1, 20)])
    assert "restore step 20 from RAM" in job.output
    assert "ResourceWarning" not in job.output, job.output


@pytest.mark.timeout(240)
def test_hang_restores_from_ram_bitwise(start_job, tmp_path, gpt_baseline):
    """The hung rank is the one blamed, on whichever node it is: its peers, blocked in the next all-reduce, fall
    silent at the same step within milliseconds of it, and used to be blamed about half the time."""
    job = run_bitwise(start_job, tmp_path, gpt_baseline, "hang", "--hang-timeout", "2",
                      "--inject", "hang@rank=3,step=35", "--inject", "hang@rank=0,step=45,gen=1")
    assert [(f["kind"], f["rank"], f["node"], f["step"]) for f in primary_failures(job)] == \
        [("hang", 3, 1, 35), ("hang", 0, 0, 45)], job.output
    assert_recovered_from_ram(job, [(1, 30), (2, 40)])


@pytest.mark.timeout(120)
def test_a_keeper_that_keeps_failing_ends_the_job_instead_of_restarting_for_ever(start_job):
    """A keeper that dies is restarted at once; one that dies each time (a bug of one of its threads, a resource
    it cannot get) was restarted for ever, one line each time, while the job trained without snapshots."""
    job = start_job("--nproc-per-node", "1", str(SCRIPTS / "sleeper.py"), "--seconds", "60")
    job.wait_for_event(lambda e: e["event"] == "first_heartbeat")
    killed = 0
    while killed < 8:  # each keeper killed once it serves (killed while it starts: "did not start")
        event = job.wait_for_event(lambda e: e["event"] == "failure" or (e["event"] == "keeper_start"
                                                                         and e["incarnation"] == killed + 1))
        if event["event"] == "failure":
            break
        os.kill(event["pid"], signal.SIGKILL)
        killed += 1
    assert job.wait(60) != 0, job.output
    assert killed == 5, job.output
    assert "node 0's snapshot keeper failed 5 times within 120s (last: killed by SIGKILL); not restarting it again" \
        in job.output
    assert_job_left_nothing(job)


@pytest.mark.timeout(240)
def test_keeper_crash_is_repaired_without_a_restart_and_its_slots_are_readopted(start_job, tmp_path, gpt_baseline):
    job = run_bitwise(start_job, tmp_path, gpt_baseline, "keeper", "--inject", "keeper-crash@node=1,step=20",
                      "--inject", "crash@rank=3,step=45")
    events = job.events()
    assert [e["node"] for e in events if e["event"] == "keeper_failed"] == [1]
    adopted = [e for e in events if e["event"] == "keeper_adopted" and e["source"] == "keeper 1"]
    assert adopted and any(kept.startswith("parity") for kept in adopted[0]["kept"]), adopted  # parity too
    # the keeper crash did not restart anything; the later trainer crash restored from RAM
    assert [f["kind"] for f in primary_failures(job)] == ["crash"]
    assert_recovered_from_ram(job, [(1, 40)])


@pytest.mark.timeout(240)
def test_crash_in_the_middle_of_a_snapshot_copy_restores_the_previous_step(start_job, tmp_path, gpt_baseline):
    job = run_bitwise(start_job, tmp_path, gpt_baseline, "copy", "--inject", "copy-crash@rank=1,step=30")
    assert_recovered_from_ram(job, [(1, 20)])


@pytest.mark.extended  # make test: the crash in the middle of a snapshot copy
@pytest.mark.timeout(240)
def test_crash_between_commits_of_different_ranks_restores_a_step_every_rank_holds(start_job, tmp_path,
                                                                                   gpt_baseline):
    job = run_bitwise(start_job, tmp_path, gpt_baseline, "commit", "--inject", "commit-crash@rank=1,step=30")
    assert_recovered_from_ram(job, [(1, 20)])


@pytest.mark.timeout(240)
@pytest.mark.parametrize("parity", ["0", pytest.param("1", marks=pytest.mark.extended)])  # make test: parity 0
def test_flipped_byte_in_a_committed_slot_is_never_loaded(start_job, tmp_path, gpt_baseline, parity):
    args, out = gpt_args(tmp_path, "flip")
    job = start_job(*NODES, "--ec-parity", parity, "--hang-timeout", "600", "--inject", "hang@rank=1,step=35", *args)
    victim = job.trainer(rank=1)
    deadline = time.monotonic() + 60
    while victim.status() != psutil.STATUS_STOPPED:
        assert time.monotonic() < deadline, job.output
        time.sleep(0.05)
    # rank 1 (node 0, local rank 1) holds steps 20 and 30; corrupt the committed, sealed slot of step 30
    slots = [SlotFile(path) for path, local, _ in find_segments(job.job_id, 0) if local == 1]
    newest = max(slots, key=lambda s: s.header().step)
    while not newest.header().sealed:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert newest.header().step == 30 and newest.header().state == COMMITTED
    newest.map[HEADER_SIZE + newest.header().data_len // 2] ^= 0x40
    for slot in slots:
        slot.close()
    os.kill(victim.pid, signal.SIGKILL)
    assert job.wait(180) == 0, job.output
    assert out.read_text().strip() == gpt_baseline
    invalid = [e for e in job.events() if e["event"] == "slot_invalid"]
    assert len(invalid) == 1 and "checksum mismatch" in invalid[0]["message"] and invalid[0]["step"] == 30
    if parity == "0":
        assert_recovered_from_ram(job, [(1, 20)], most_recomputed=2 * EVERY)  # the corrupt step costs one interval
    else:  # node 0 rebuilds step 30 from node 1's parity: the corruption costs nothing
        plan = restores(job)[1]
        assert (plan["step"], plan["restored_from"], plan["rebuilt"]) == (30, "parity", {"0": [1]}), job.output
    assert_job_left_nothing(job)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("megabytes, what, detail", [(4, "snapshots", "more for local rank"),
                                                      (14, "parity", "for a parity file")])
def test_too_small_shm_stops_the_job_with_one_line_saying_how_much_is_needed(start_job, tmp_path, small_tmpfs,
                                                                             megabytes, what, detail):
    """4 MiB: no room for the slots (8 of 1.3 MiB); 14 MiB: room for the slots, not for the parity files (4 of
    2.6 MiB), where the encoder retried quietly and the trainers waited for protection forever."""
    small = small_tmpfs(megabytes)
    args, out = gpt_args(tmp_path, "small")
    job = start_job(*NODES, *args, env={"FTRUN_SHM_DIR": str(small)})
    assert job.wait(120) != 0
    lines = [line for line in job.output.splitlines() if f"too small for {what}" in line]
    assert lines and detail in lines[0] and "is free" in lines[0], job.output
    assert [f["kind"] for f in primary_failures(job)] == ["fatal"]
    assert os.listdir(small) == [], "segments left in the small tmpfs"


def run_outside_ftrun(code: str) -> subprocess.CompletedProcess[str]:
    """``python -c code`` with no ftrun or torchelastic variable in its environment."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FTRUN_", "TORCHELASTIC_"))}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)


def test_outside_ftrun_the_snapshotter_warns_once_and_does_nothing():
    code = ("import torch, ftrun\n"
            "m = torch.nn.Linear(2, 2); o = torch.optim.AdamW(m.parameters())\n"
            "s = ftrun.Snapshotter({'model': m, 'optim': o}); ftrun.Snapshotter({'model': m})\n"
            "assert s.restore() == 0\n"
            "m(torch.ones(1, 2)).sum().backward(); o.step(); s.save(1); s.wait()\n"
            "print('ok')\n")
    result = run_outside_ftrun(code)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr
    assert result.stderr.count("not running under ftrun") == 1


def test_a_step_that_goes_back_is_refused_in_one_line_outside_ftrun_too():
    """A restore takes the newest step, so save() refuses a step that goes back (one counted per epoch), and a
    step that is not an integer; an int tensor or a numpy integer is one. ``every`` is an int >= 1."""
    code = ("import numpy, torch, ftrun\n"
            "s = ftrun.Snapshotter({'w': torch.zeros(2)})\n"
            "s.save(5); s.save(5); s.save(torch.tensor(6)); s.save(numpy.int64(7))\n"
            "try:\n    s.save(7.5)\nexcept TypeError:\n    print('not an int')\n"
            "for every in (0, 2.5, True):\n"
            "    try:\n        ftrun.Snapshotter({}, every=every)\n"
            "    except ValueError as err:\n        print(err)\n"
            "s.save(3)\n")
    result = run_outside_ftrun(code)
    assert result.returncode != 0 and result.stdout.strip().splitlines() == [
        "not an int", *(f"ftrun.Snapshotter: every must be an int >= 1, got {v}" for v in ("0", "2.5", "True"))
    ], (result.stdout, result.stderr)
    assert result.stderr.strip().splitlines()[-1] == (
        "ValueError: Snapshotter.save(3): the step went back (the previous one was 7); pass a step that grows "
        "over the whole run, not one that starts again each epoch"), result.stderr


def test_a_second_snapshotter_in_a_process_is_refused_in_one_line(start_job, tmp_path):
    """The keeper holds one snapshot stream per rank: a second Snapshotter (one for the model, one for the
    optimizer, say) would interleave theirs, so making it raises at once (and the job stops, with no restart left
    here)."""
    script = tmp_path / "two.py"
    script.write_text("import torch, ftrun\n"
                      "model = torch.nn.Linear(2, 2)\n"
                      "first = ftrun.Snapshotter({'model': model})\n"
                      "second = ftrun.Snapshotter({'optim': torch.optim.SGD(model.parameters(), lr=0.1)})\n")
    job = start_job("--nnodes", "1", "--nproc-per-node", "1", "--max-restarts", "0", str(script))
    assert job.wait(120) == 3, job.output
    assert "RuntimeError: ftrun.Snapshotter: this process has one already" in job.output, job.output


def test_a_restarted_trainer_that_saves_without_restoring_is_told_in_one_line(start_job, tmp_path):
    """A script that never calls restore() starts over after a restart while the job restores a step: one line
    says so, once, and the job goes on."""
    script = tmp_path / "no_restore.py"
    script.write_text("import torch, ftrun\n"
                      "snap = ftrun.Snapshotter({'w': torch.zeros(4)})\n"
                      "for step in range(6):\n    snap.save(step + 1)\n")
    job = start_job("--nnodes", "1", "--nproc-per-node", "1", "--inject", "crash@rank=0,step=3", str(script))
    assert job.wait(120) == 0, job.output
    assert job.output.count("ftrun.Snapshotter: save() before restore() in restarted generation 1:") == 1, job.output


def test_ranks_at_uneven_paces_skip_snapshots_then_are_paced_and_restore_a_recent_step_both_hold(start_job):
    """No collectives, rank 1 six times slower: rank 0 skips its snapshots while rank 1 does not hold its newest
    one, then waits in save() (beating, not hung) once its restore point would fall more than STALE_INTERVALS
    snapshots behind; rank 1 writes over the steps rank 0 skipped. A crash of rank 1 at step 16 restores a step
    both hold at most that many snapshots back, and each rank ends with its own state."""
    job = start_job("--nnodes", "1", "--nproc-per-node", "2", "--hang-timeout", "2",
                    "--inject", "crash@rank=1,step=16", str(SCRIPTS / "uneven.py"), "--steps", "20", "--slow", "0.3")
    assert job.wait(120) == 0, job.output
    assert ["rank 1 killed by SIGKILL at step 16" in f["message"] for f in primary_failures(job)] == [True], job.output
    restored = restores(job)[1]
    assert restored["restored_from"] == "ram" and 16 - STALE_INTERVALS <= restored["step"] < 16, restored
    done = {rank: re.search(rf"rank {rank} done at step 20 with weights (\d+), restored from step (\d+), (\d+) "
                            r"snapshots skipped", job.output) for rank in (0, 1)}
    assert all(done.values()), job.output
    assert [int(done[rank][1]) for rank in (0, 1)] == [20, 20]
    assert int(done[0][3]) > 0  # in the last generation too: rank 0 ran ahead of rank 1 again
    skipped = [e for e in job.events() if e["event"] == "snapshot_skipped"]
    assert skipped and {e["rank"] for e in skipped} == {0}, skipped


def test_a_snapshot_skipped_at_the_end_of_training_is_taken_at_exit_and_persisted(start_job, tmp_path):
    """Rank 0, ahead of rank 1, skips its snapshot of step 8 (one every 2 steps), takes one more step and ends
    without calling wait(). Its weights are updated by hand (no optimizer), so save() cloned them: at exit its
    Snapshotter takes that snapshot after all, once rank 1 has caught up, with step 8's weights, not step 9's. The
    final persist holds step 8, and the job started again from it restores that step's weights (the script
    checks) and ends as the first run did."""
    args = ("--nnodes", "1", "--nproc-per-node", "2", "--ckpt-dir", str(tmp_path / "ckpt"),
            str(SCRIPTS / "uneven.py"), "--steps", "9", "--every", "2", "--slow", "0.2", "--no-wait")
    first = start_job(*args)
    assert first.wait(120) == 0, first.output
    assert re.search(r"rank 0 done at step 9 with weights 9, restored from step 0, [1-9]\d* snapshots skipped",
                     first.output), first.output
    assert "ftrun: durability ok: newest step on disk 8 " in first.output, first.output
    again = start_job(*args, job_id=first.job_id)
    assert again.wait(120) == 0, again.output
    assert "rank 0 done at step 9 with weights 9, restored from step 8," in again.output, again.output


def test_a_skipped_snapshot_of_live_tensors_is_not_taken_at_exit(start_job, tmp_path):
    """An SGD step updates the weights, so the snapshot reads them live; the script ends without wait() and
    changes them after its loop. Rank 0's snapshot of the last step, skipped, is not taken at exit (it would hold
    the changed weights as step 8's): one line says so, and the final persist holds an earlier step."""
    job = start_job("--nnodes", "1", "--nproc-per-node", "2", "--ckpt-dir", str(tmp_path / "ckpt"),
                    str(SCRIPTS / "uneven.py"), "--steps", "8", "--slow", "0.2", "--no-wait", "--optimizer",
                    "--after-loop", "100")
    assert job.wait(120) == 0, job.output
    assert "the snapshot of step 8 was skipped and is not taken at exit" in job.output, job.output
    persisted = re.search(r"durability ok: newest step on disk (\d+) ", job.output)
    assert persisted and 0 < int(persisted[1]) < 8, job.output


def test_an_optimizer_outside_the_state_waits_for_the_copy_of_its_parameters(start_job):
    """The state holds the model only; the SGD that updates it (stateless) is not in it. The snapshot copies the
    parameter live, so that optimizer's step waits for the copy too: after a crash the restored parameter is
    exactly the restored step's (the script checks every element), and the run ends as one without a crash."""
    job = start_job("--nnodes", "1", "--nproc-per-node", "1", "--inject", "crash@rank=0,step=8",
                    str(SCRIPTS / "outside_optimizer.py"), "--steps", "12")
    assert job.wait(120) == 0, job.output
    restored = re.search(r"rank 0 done at step 12, restored from step (\d+)", job.output)
    assert restored and 0 < int(restored[1]) <= 8, job.output

