"""SLURM hostlists and the step environment (unit level; the real cluster tests start slurmd daemons)."""

from __future__ import annotations

import os
import re
import subprocess

import pytest

from ftrun.errors import UsageError
from ftrun.launch.sbatch import render
from ftrun.launch.slurm import (PORT_BASE, PORT_SPAN, assign_node_ranks, claim_path, expand_hostlist, read_claim,
                                slurm_step, write_claim)
from ftrun.control.spec import ENV_SHM_DIR

CASES = {
    "n1": ["n1"],
    "n[1-3,7]": ["n1", "n2", "n3", "n7"],
    "gpu-[01-04]-ib": ["gpu-01-ib", "gpu-02-ib", "gpu-03-ib", "gpu-04-ib"],
    "a[1-2]b[3-4]": ["a1b3", "a1b4", "a2b3", "a2b4"],
    "n[1-2],gpu01,x[009-011]": ["n1", "n2", "gpu01", "x009", "x010", "x011"],
    "rack[1-2]-n[1,3]": ["rack1-n1", "rack1-n3", "rack2-n1", "rack2-n3"],
}


@pytest.mark.parametrize("hostlist, hosts", CASES.items())
def test_hostlists_expand_like_slurm(hostlist, hosts):
    assert expand_hostlist(hostlist) == hosts


# SLURM 22.05's scontrol rejects text after a bracket group (gpu-[01-04]-ib); newer releases accept it
@pytest.mark.parametrize("hostlist", [hostlist for hostlist in CASES if not hostlist.endswith("]-ib")])
def test_hostlists_expand_like_scontrol(hostlist, slurm):
    shown = subprocess.run(["scontrol", "show", "hostnames", hostlist], env=slurm.env(), capture_output=True,
                           text=True, timeout=30)
    assert shown.returncode == 0, shown.stderr
    assert expand_hostlist(hostlist) == shown.stdout.split()


@pytest.mark.parametrize("bad", ["n[1-", "n[a-b]", "n[3-1]", "n]1[", "n[1-\u00b2]",
                                 "n[1-99999999999]", "a[1-1000]b[1-1000]", ",".join(["n[1-60000]"] * 2)])
def test_malformed_hostlists_are_one_line_errors(bad):
    with pytest.raises(UsageError, match="malformed SLURM hostlist"):
        expand_hostlist(bad)


def test_step_environment():
    env = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_NODEID": "2", "SLURM_NNODES": "3",
           "SLURM_STEP_NODELIST": "n[1-3]", "SLURM_STEP_TASKS_PER_NODE": "1(x3)"}
    step = slurm_step(env)
    assert step is not None and (step.node_id, step.nnodes, step.run_id) == (2, 3, "slurm-4242")
    assert step.endpoint == f"n1:{PORT_BASE + 4242}"
    assert slurm_step({"SLURM_JOB_ID": "1"}) is None  # salloc/sbatch shell, not a step


def test_more_than_one_task_per_node_is_an_error_that_says_what_to_do():
    env = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_STEP_NODELIST": "n1", "SLURM_STEP_TASKS_PER_NODE": "2"}
    with pytest.raises(UsageError, match="--ntasks-per-node 1"):
        slurm_step(env)


@pytest.mark.parametrize("job_id", ["abc", "1/../x", "", "-5", "1 2"])
def test_a_slurm_job_id_that_is_not_a_number_is_a_one_line_error(job_id):
    """``int(SLURM_JOB_ID)`` for the store's port raised a ValueError traceback from ``ftrun run`` (the flags too:
    ``--rdzv-endpoint`` given or not)."""
    from ftrun.launch.config import build_config

    env = {"SLURM_JOB_ID": job_id, "SLURM_STEP_ID": "0", "SLURM_NODEID": "0", "SLURM_NNODES": "1",
           "SLURM_STEP_NODELIST": "n1", "SLURM_STEP_TASKS_PER_NODE": "1"}
    for flags in ({}, {"rdzv_endpoint": "127.0.0.1:29400"}):
        with pytest.raises(UsageError, match=f"SLURM_JOB_ID={job_id!r} is not a SLURM job id"):
            build_config(None, flags, env)


def test_a_slurm_node_list_whose_first_host_is_no_host_name_is_a_one_line_error(monkeypatch):
    """Resolving its first host for the control store (``n..1``, or a label of more than 63 characters) raised a
    UnicodeError traceback from the idna codec; the endpoint made of it is refused as any other such endpoint."""
    from ftrun.launch.config import build_config

    monkeypatch.setenv("PATH", "")  # no scontrol to ask for the node's address (a slow timeout without slurmctld)
    for hosts in ("n..1", "x" * 64):
        env = {"SLURM_JOB_ID": "99", "SLURM_STEP_ID": "0", "SLURM_NODEID": "0", "SLURM_NNODES": "1",
               "SLURM_STEP_NODELIST": hosts, "SLURM_STEP_TASKS_PER_NODE": "1"}
        with pytest.raises(UsageError, match="is not a host name"):
            build_config(None, {}, env)


def test_a_slurm_step_sets_the_job_shape_unless_flags_say_otherwise():
    from ftrun.launch.config import build_config

    env = {"SLURM_JOB_ID": "99", "SLURM_STEP_ID": "1", "SLURM_NODEID": "1", "SLURM_NNODES": "2",
           "SLURM_STEP_NODELIST": "n[3-4]", "SLURM_STEP_TASKS_PER_NODE": "1(x2)"}
    cfg = build_config(None, {}, env)
    assert (cfg.nnodes, cfg.node_rank, cfg.rdzv_id, cfg.rdzv_endpoint) == (2, 1, "slurm-99", f"n3:{PORT_BASE + 99}")
    assert not cfg.local_mode
    assert build_config(None, {"rdzv_endpoint": "head:29400"}, env).rdzv_endpoint == "head:29400"
    assert build_config(None, {}, {}).local_mode


def test_a_standby_in_a_slurm_step_joins_the_job_it_names_without_the_steps_rank():
    """``srun -N1 -w n3 ftrun --standby --rdzv-endpoint n1:PORT ...`` (a hot spare for a job's training step):
    was refused with "--standby joins a job as a spare without a node rank: drop --node-rank", a flag the user never
    gave (the step's node id was taken for one). It takes the job id from the step, and says where the store is."""
    from ftrun.launch.config import build_config

    env = {"SLURM_JOB_ID": "99", "SLURM_STEP_ID": "1", "SLURM_NODEID": "0", "SLURM_NNODES": "1",
           "SLURM_STEP_NODELIST": "n3", "SLURM_STEP_TASKS_PER_NODE": "1"}
    cfg = build_config(None, {"standby": True, "rdzv_endpoint": "n1:20099"}, env)
    assert (cfg.standby, cfg.node_rank, cfg.rdzv_id, cfg.rdzv_endpoint) == (True, None, "slurm-99", "n1:20099")
    with pytest.raises(UsageError, match=f"--standby under srun needs --rdzv-endpoint: .* port {PORT_BASE + 99}$"):
        build_config(None, {"standby": True}, env)


def test_standalone_inside_a_slurm_step_is_a_job_of_this_host_alone():
    """``srun --pty bash`` then ``ftrun --standalone`` (the clusters' interactive recipe with torchrun): was
    "--standalone cannot be combined with --node-rank", and an ``srun -n4 --pty`` shell a refusal."""
    from ftrun.launch.config import build_config

    env = {"SLURM_JOB_ID": "99", "SLURM_STEP_ID": "0", "SLURM_NODEID": "0", "SLURM_NNODES": "1",
           "SLURM_STEP_NODELIST": "n3", "SLURM_STEP_TASKS_PER_NODE": "4"}
    cfg = build_config(None, {"standalone": True, "nproc_per_node": "2"}, env)
    assert cfg.local_mode and cfg.nnodes == 1 and cfg.node_rank is None and cfg.rdzv_id != "slurm-99"


@pytest.mark.parametrize("claims, ranks", [
    ([None, None, None], [0, 1, 2]),  # a first step: SLURM node ids
    ([0, None], [0, 1]),  # node rank 1 lost, a spare takes it
    ([1, None], [1, 0]),  # node rank 0 lost: the survivor keeps rank 1 though it is SLURM node 0 now
    ([None, 0, 1], [2, 0, 1]),
    ([0, 0], [0, 1]),  # two claims of one rank: the lower node id keeps it
    ([7, None], [0, 1]),  # a claim out of range is no claim
])
def test_node_ranks_follow_the_snapshots_a_node_holds(claims, ranks):
    assert assign_node_ranks(claims, len(claims)) == ranks


def test_claim_files_are_private_and_per_node(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_SHM_DIR, str(tmp_path))
    assert read_claim("slurm-5", "n1") is None
    write_claim("slurm-5", "n1", 3)
    assert read_claim("slurm-5", "n1") == 3 and read_claim("slurm-5", "n2") is None
    assert os.stat(claim_path("slurm-5", "n1")).st_mode & 0o777 == 0o600


def test_sbatch_template_loops_srun_steps_with_spares():
    script = render(2, 1, 4, ["--nproc-per-node", "8", "train.py", "--lr", "3e-4 x"], ftrun=["ftrun"])
    assert "#SBATCH --nodes=3" in script and "#SBATCH --no-kill" in script and "ATTEMPTS=4" in script
    assert "FTRUN=(ftrun --nproc-per-node 8 train.py --lr '3e-4 x')" in script
    assert 'srun --nodes=2 --ntasks=2 --ntasks-per-node=1 "${FTRUN[@]}"' in script
    with pytest.raises(UsageError, match="at least"):
        render(0, 1, 4, ["train.py"])
    # a typo of a count printed a script asking SLURM for 10**30 nodes, or a loop bash's integers cannot count
    for counts in ((10**30, 1, 4), (65537, 1, 4), (2, 10**30, 4), (2, 1, 10**30)):
        with pytest.raises(UsageError, match=r"at most 65536 \(ftrun's --nnodes\).*at most 2147483647"):
            render(*counts, ["train.py"])
    with pytest.raises(UsageError, match="after --"):
        render(2, 1, 4, [])


@pytest.mark.parametrize("args, message", [
    (["--bogus", "train.py"], "after --: No such option: --bogus"),
    (["--nproc-per-node", "8"], "after --: Missing argument 'script'"),
    (["run", "--max-restarts", "x", "train.py"], "Invalid value for '--max-restarts'"),
    (["--node-rank", "1", "train.py"], "srun gives each node its rank"),
    (["--nnodes", "3", "train.py"], "--nnodes 3, but each step runs --nodes 2"),
])
def test_sbatch_template_checks_the_ftrun_arguments(args, message):
    from ftrun.cli import check_batch_args

    with pytest.raises(UsageError, match=re.escape(message)):
        check_batch_args(args, 2)
    good = ["--nnodes", "1:2", "--nproc-per-node", "8", "train.py", "--bogus"]
    check_batch_args(good, 2)
    assert good == ["--nnodes", "1:2", "--nproc-per-node", "8", "train.py", "--bogus"]  # the parser consumed a list


@pytest.mark.parametrize("requeued", [False, True])
def test_sbatch_template_gives_no_resume_to_the_first_attempt_of_the_first_run_only(tmp_path, requeued):
    """The batch script, run by bash with a fake srun that fails twice (a lost node) then succeeds: only the first
    attempt of a job that was not requeued moves the checkpoint aside; the script's own --no-resume stays."""
    from ftrun.cli import script_index

    args = ["run", "--no-resume", "--ckpt-dir", "/ckpt", "--nproc-per-node", "2", "train.py", "--no-resume"]
    batch = tmp_path / "job.sh"
    batch.write_text(render(2, 1, 3, args, ftrun=["ftrun"], script_at=script_index(args)))
    (tmp_path / "bin").mkdir()
    srun = tmp_path / "bin" / "srun"
    srun.write_text('#!/bin/bash\necho "$*" >> "$SRUN_LOG"\n[ "$(wc -l < "$SRUN_LOG")" -ge 3 ]\n')
    srun.chmod(0o755)
    log = tmp_path / "srun.log"
    env = {**os.environ, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", "SRUN_LOG": str(log)}
    env.pop("SLURM_RESTART_COUNT", None)
    if requeued:
        env["SLURM_RESTART_COUNT"] = "1"
    done = subprocess.run(["bash", str(batch)], env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stdout + done.stderr
    srun_args = "--nodes=2 --ntasks=2 --ntasks-per-node=1 ftrun run --ckpt-dir /ckpt --nproc-per-node 2"
    resume, start_over = f"{srun_args} train.py --no-resume", f"{srun_args} --no-resume train.py --no-resume"
    assert log.read_text().splitlines() == [resume if requeued else start_over, resume, resume]


def test_test_clusters_started_side_by_side_number_their_jobs_apart(tmp_path):
    """Two test clusters on this host (two checkouts testing at once) must not both run a job 1: its ftrun job
    id (`slurm-1`: its /dev/shm files, which the tests' cleanup removes) and its control store port would be the
    other cluster's. Each cluster's port base (one free base each) gives it its own block of job ids."""
    from slurm_cluster import JOBS_PER_CLUSTER, PORT_BASES, SlurmCluster

    firsts = []
    for base in (PORT_BASES[0], PORT_BASES[1], PORT_BASES[-1]):
        cluster = SlurmCluster(str(tmp_path / str(base)))
        os.makedirs(cluster.root)
        cluster._write_conf(base)
        found = re.search(r"^FirstJobId=(\d+)$", open(cluster.conf).read(), re.M)
        assert found is not None
        firsts.append(int(found.group(1)))
    ports = [PORT_BASE + job % PORT_SPAN for first in firsts for job in range(first, first + JOBS_PER_CLUSTER)]
    assert len(set(ports)) == len(ports), firsts
