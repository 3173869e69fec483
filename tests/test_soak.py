"""A long job with many failures: what ftrun's long-lived processes hold does not grow with the restarts."""

from __future__ import annotations

import time

import psutil
import pytest

from conftest import assert_job_left_nothing, gpt_args


def zombie_children(pid: int) -> int:
    """The exited, unreaped children of process ``pid``."""
    try:
        return sum(1 for child in psutil.Process(pid).children() if child.status() == psutil.STATUS_ZOMBIE)
    except psutil.Error:
        return 0


@pytest.mark.timeout(180)
def test_lost_nodes_leave_no_zombies_in_the_launcher(start_job, tmp_path, gpt_baselines):
    """A lost supervisor's zygote, keeper and trainers die with it and are re-parented to the launcher (a child
    subreaper), which reaps them: none stays a zombie for the rest of the job, however many nodes it loses."""
    losses = 3
    faults = [arg for gen in range(losses) for arg in ("--inject", f"node-loss@node=1,step={12 + 12 * gen},gen={gen}")]
    args, out = gpt_args(tmp_path, "lost", "--step-time", "0.05")
    job = start_job("--nnodes", "2", "--nproc-per-node", "1", *faults, *args)
    job.wait_for_event(lambda e: e["event"] == "all_running" and e["generation"] == losses, timeout=120)
    zombies = []  # the launcher's, as the last replacement trains (min: one that just exited is not counted)
    for _ in range(5):
        zombies.append(zombie_children(job.proc.pid))
        time.sleep(0.05)
    assert job.wait() == 0, job.output
    assert len([e for e in job.events() if e["event"] == "node_lost"]) == losses
    assert min(zombies) == 0, f"zombies in the launcher after {losses} lost nodes: {zombies}"
    assert out.read_text().strip() == gpt_baselines(2, 1)
    assert_job_left_nothing(job)
