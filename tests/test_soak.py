"""A long job with many failures: what ftrun's long-lived processes hold does not grow with the restarts."""

from __future__ import annotations

import contextlib
import os
import secrets
import time
import uuid

import psutil
import pytest

from conftest import assert_job_left_nothing, gpt_args, job_segments, kill_job
from ftrun.control.coordination import Coordinator, Failure, Generation, use_job
from ftrun.control.store import C10dStore, host_store
from ftrun.snapshot.dcp_copy import dcp_path
from ftrun.ui.status import gather
from ftrun.ui.summary import recoveries


def zombie_children(pid: int) -> int:
    """The exited, unreaped children of process ``pid``."""
    try:
        return sum(1 for child in psutil.Process(pid).children() if child.status() == psutil.STATUS_ZOMBIE)
    except psutil.Error:
        return 0


@pytest.mark.extended  # make test: test_recovery's no orphans at the restart limit, test_spares' lost nodes
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


class CountingStore:
    """A store that counts the operations made on it."""

    def __init__(self, store: object) -> None:
        self.store = store
        self.ops = 0

    def __getattr__(self, name: str) -> object:
        attr = getattr(self.store, name)
        if not callable(attr):
            return attr

        def counted(*args: object, **kwargs: object) -> object:
            self.ops += 1
            return attr(*args, **kwargs)

        return counted


@pytest.mark.timeout(60)
def test_a_live_status_view_reads_the_same_keys_after_40_restarts_as_after_10():
    """`ftrun status` and --tui gather the job's status twice a second: each refresh reads the generations made
    since the last, not every generation of the job again (5 reads per generation with 3 nodes, growing without
    bound over a long job), and shows the same recoveries as a fresh reading."""
    job = f"t{uuid.uuid4().hex[:10]}"
    use_job(job, secrets.token_hex(16))
    server = host_store(0)
    counting = CountingStore(C10dStore(server))
    nodes = [Coordinator(counting, job, node, 3) for node in range(3)]
    viewer, settled = Coordinator(counting, job, -1, 3), {}

    def restart(times: int) -> None:
        for _ in range(times):
            raw, _ = nodes[0].bump(nodes[0].current_raw(), Failure("crash", "rank 1 failed", 0, 1, "waitpid"))
            gen = Generation.decode(raw).gen
            nodes[0].publish_restore(gen, gen * 10, "RAM")
            for node in nodes:
                node.mark(gen, "up", time.time())

    def reads_per_refresh() -> int:
        gather(viewer, settled=settled)  # reads what is new since the last refresh
        before = counting.ops
        gather(viewer, settled=settled)
        return counting.ops - before

    restart(10)
    after_10 = reads_per_refresh()
    restart(30)
    after_40 = reads_per_refresh()
    assert after_40 == after_10, (after_10, after_40)
    assert gather(viewer, settled=settled).events == recoveries(Coordinator(counting, job, -1, 3))
    assert len(settled) == 38  # every restart but the last 2


def dcp_copy_of(ckpt: str) -> psutil.Process | None:
    """The running DCP copy (``python -m ftrun.snapshot.dcp_copy``) of the job directory under ``ckpt``."""
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            argv = proc.cmdline()
            if "ftrun.snapshot.dcp_copy" in argv and argv[argv.index("ftrun.snapshot.dcp_copy") + 1].startswith(ckpt):
                return proc
    return None


@pytest.mark.extended  # make test: test_persist's test_a_dcp_copy_the_disk_cut_short_is_never_published
@pytest.mark.timeout(120)
def test_a_dcp_copy_ends_with_a_launcher_killed_by_sigkill(start_job, tmp_path):
    """A launcher killed by SIGKILL takes every process of its job along; the DCP copy of a step (a child of
    node 0's supervisor, which dies with the launcher) too: it was re-parented to init and went on writing to
    the job's directory, renaming its copy into place, after the job was gone."""
    ckpt = str(tmp_path / "ckpt")
    args, _ = gpt_args(tmp_path, "copy", "--step-time", "0.05")
    job = start_job("--nnodes", "2", "--nproc-per-node", "1", "--ckpt-dir", ckpt, "--ckpt-format", "dcp",
                    "--persist-every", "1", *args)
    copy = None
    try:
        while copy is None and job.proc.poll() is None:
            copy = dcp_copy_of(ckpt)
        assert copy is not None, job.output
        copy.suspend()  # it copies no further until the launcher is gone
        argv = copy.cmdline()
        step = int(argv[argv.index("ftrun.snapshot.dcp_copy") + 2])
        job.proc.kill()
        job.proc.wait()
        copy.resume()
        copy.wait(60)
        assert not os.path.exists(dcp_path(os.path.join(ckpt, job.job_id), step))
    finally:
        if copy is not None:
            with contextlib.suppress(psutil.Error):
                copy.kill()


@pytest.mark.extended  # make test: test_recovery's kill -9 of ftrun and ftrun clean
@pytest.mark.timeout(240)
def test_a_rerun_of_another_shape_after_a_sigkill_does_not_restore_the_killed_run_s_ram(start_job, tmp_path,
                                                                                         gpt_baselines):
    """A launcher killed by SIGKILL leaves its nodes' snapshots in /dev/shm, which a rerun of the job adopts. A
    rerun with fewer nodes restored the killed run's world-size-3 states into world size 2 (the durable tier
    refuses that), and left node 2's files behind for good; a rerun of the same shape still restores them."""
    args, out = gpt_args(tmp_path, "shape", "--step-time", "0.03")
    first = start_job("--nnodes", "3", "--nproc-per-node", "1", *args)
    first.wait_for_event(lambda e: e["event"] == "protected" and e["step"] >= 20, timeout=120)
    kill_job(first)  # every process at once: the RAM snapshots stay
    assert any(path.endswith("-node2-shape") for path in job_segments(first.job_id))
    again = start_job("--nnodes", "2", "--nproc-per-node", "1", *args, job_id=first.job_id,
                      log_dir=tmp_path / "logs-again")
    assert again.wait(180) == 0, again.output
    assert out.read_text().strip() == gpt_baselines(2, 1)
    removed = [e for e in again.events() if e["event"] == "keeper_adopted" and "not restoring them" in e["message"]]
    assert sorted(e["node"] for e in removed) == [0, 1], again.output
    assert "an earlier run of 3 node(s) x 1 trainer(s)" in removed[0]["message"]
    assert_job_left_nothing(again)  # node 2's files too
