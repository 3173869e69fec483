"""Exact resumption without help from the script: DDP's re-bucketing, the data loader's position and seed draw,
and a clean exit with data loader workers. The full {2, 3, 4 ranks} x {crash, hang, node loss} x {loop,
StatefulDataLoader} matrix is ``benchmarks/bitwise_matrix.py``; the suite holds the points below, and train_gpt
(no warm-up in it since this change) covers 3 ranks x node loss and 4 ranks x crash, hang and node loss."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from conftest import SCRIPTS, assert_job_left_nothing, primary_failures
from ftrun.snapshot.ddp_buckets import _left_as_found
from ftrun.snapshot.layout import capture, restore
from ftrun.snapshot.loader_seed import LoaderSeedGuard

DDP_STEPS = SCRIPTS / "ddp_steps.py"


def ids_by_step(folder: Path) -> dict[str, dict[int, list[str]]]:
    """rank file -> step -> sample ids, the last line of each step winning (a resumed run repeats steps)."""
    out: dict[str, dict[int, list[str]]] = {}
    for path in sorted(folder.glob("rank*.txt")):
        steps: dict[int, list[str]] = {}
        for line in path.read_text().splitlines():
            step, *ids = line.split()
            steps[int(step)] = ids
        out[path.name] = steps
    return out


def ddp_run(start_job, tmp_path: Path, name: str, shape: tuple[str, ...], *flags: str, script: tuple[str, ...] = ()):
    """Run ddp_steps with ``flags`` for ftrun and ``script`` for the script; (job, final hash, ids by step)."""
    ids, out = tmp_path / f"{name}-ids", tmp_path / f"{name}.hash"
    ids.mkdir()
    job = start_job(*shape, *flags, str(DDP_STEPS), "--steps", "24", "--ids", str(ids), "--out", str(out), *script)
    assert job.wait(120) == 0, job.output
    assert_job_left_nothing(job)
    return job, out.read_text().strip(), ids_by_step(ids)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("shape", ["one", pytest.param("chained", marks=pytest.mark.extended),  # make test: one,
                                   pytest.param("redirected", marks=pytest.mark.extended)])  # and the unit test below
def test_a_new_ddp_module_sums_in_another_order_unless_warmed_up(tmp_path, shape):
    """Three gloo ranks, no launcher: a DDP module rebuilt after step 3 ends differently from one kept for all 6
    steps (the drift ftrun removes; if this fails, torch no longer re-buckets and ddp_buckets.py can go), and
    with BucketWarmup armed it ends bit-identically, RNG states and BatchNorm statistics included. Chained: a DDP
    head on a DDP backbone's output, whose warm-up backward went on into the backbone's graph, so the real
    backward failed ("Trying to backward through the graph a second time") after every restore. Redirected:
    training code called through DDP by a one-shot patch of the module's forward, as Lightning's DDP strategy
    calls training_step; the warm-up used the patch up, and the real forward raised after every restore."""
    procs = [subprocess.Popen([sys.executable, str(SCRIPTS / "rebucket.py"), str(rank), "3", str(tmp_path / "init"),
                               str(tmp_path / f"rank{rank}.json"), *([shape] if shape != "one" else [])],
                              stderr=subprocess.PIPE, text=True)
             for rank in range(3)]
    try:
        for proc in procs:
            assert proc.wait(90) == 0, proc.stderr.read()  # type: ignore[union-attr]
    finally:
        for proc in procs:
            proc.kill()
    for rank in range(3):
        hashes = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert hashes["resumed"] != hashes["straight"], "DDP's first step no longer sums in another order"
        assert hashes["warmed"] == hashes["straight"], rank


def numbered() -> torch.utils.data.TensorDataset:
    return torch.utils.data.TensorDataset(torch.arange(40))


def stateful_loader(**kw):
    stateful_dataloader = pytest.importorskip("torchdata.stateful_dataloader",
                                              reason="torchdata is ftrun's optional [data] extra")
    return stateful_dataloader.StatefulDataLoader(numbered(), batch_size=4, shuffle=True, **kw)


def resumed_draws(after: int, guard: bool) -> tuple[list, list]:
    """Ids and a random number per step after ``after`` steps: straight on, and resumed (new loader, state and
    RNG loaded as a restore would) with or without the LoaderSeedGuard; one epoch is 10 steps."""
    torch.manual_seed(0)
    loader = stateful_loader()
    straight, it = [], iter(loader)
    for step in range(after + 3):
        if step == after:
            saved, rng = loader.state_dict(), torch.get_rng_state()
        try:
            batch = next(it)
        except StopIteration:
            it = iter(loader)
            batch = next(it)
        if step >= after:
            straight.append((batch[0].tolist(), torch.rand(1).item()))
    again = stateful_loader()
    again.load_state_dict(saved)
    torch.set_rng_state(rng)
    seeds = LoaderSeedGuard({"data": again}) if guard else None
    resumed, it = [], iter(again)
    for _ in range(3):
        try:
            batch = next(it)
        except StopIteration:
            it = iter(again)
            batch = next(it)
        resumed.append((batch[0].tolist(), torch.rand(1).item()))
        if seeds is not None:
            seeds.release()
            seeds = None
    return straight, resumed


@pytest.mark.timeout(60)
def test_accelerate_s_prepared_stateful_loader_draws_its_resume_seed_from_the_throwaway():
    """accelerate's prepared loader (``use_stateful_dataloader``) passes for the StatefulDataLoader it wraps: the
    throwaway set on it stayed on the wrapper, the wrapped loader drew its seed from the restored RNG, and dropout
    after a restore differed from the run without failure (2 nodes x 2 ranks, kill -9: another final hash)."""
    accelerate = pytest.importorskip("accelerate", reason="accelerate is not installed (pip install accelerate)")
    pytest.importorskip("torchdata.stateful_dataloader", reason="torchdata is ftrun's optional [data] extra")
    prepared = accelerate.Accelerator(cpu=True, dataloader_config=accelerate.DataLoaderConfiguration(
        use_stateful_dataloader=True)).prepare(DataLoader(numbered(), batch_size=4))
    next(iter(prepared))
    saved = prepared.state_dict()
    torch.manual_seed(0)
    rng = torch.get_rng_state()
    prepared.load_state_dict(saved)
    seeds = LoaderSeedGuard({"data": prepared})
    next(iter(prepared))
    seeds.release()
    assert torch.equal(torch.get_rng_state(), rng)


def test_the_ddp_warm_up_puts_back_a_parameter_its_forward_replaced():
    """MoCo's and BYOL's momentum encoders: their forward sets ``param_k.data = param_k.data * m + param_q.data *
    (1 - m)``. With 3 or more ranks the warm-up ran that forward once more after a restore, and its new tensor
    stayed: the resumed run's key encoder was one momentum update ahead, and its final state differed from the
    failure-free run's."""

    class Momentum(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.query, self.key = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
            self.key.requires_grad_(False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                for q, k in zip(self.query.parameters(), self.key.parameters()):
                    k.data = k.data * 0.9 + q.data * 0.1
            return self.query(x) + self.key(x)

    class Wrapper(torch.nn.Module):  # what the warm-up uses of a DistributedDataParallel
        def __init__(self, module: torch.nn.Module) -> None:
            super().__init__()
            self.module = module
            self.require_backward_grad_sync = False  # the DDP attribute the warm-up sets and puts back

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.module(x)

    torch.manual_seed(0)
    model = Wrapper(Momentum())
    before = {name: t.clone() for name, t in model.state_dict().items()}
    with _left_as_found(model):
        model(torch.ones(2, 4)).sum().backward()
    assert all(torch.equal(t, before[name]) for name, t in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


def test_a_resumed_stateful_loader_leaves_the_rng_as_restored(capsys):
    straight, resumed = resumed_draws(4, guard=False)
    assert [ids for ids, _ in resumed] == [ids for ids, _ in straight]
    assert resumed != straight, "torchdata's resume iterator no longer draws from the RNG: loader_seed.py can go"
    straight, resumed = resumed_draws(4, guard=True)
    assert resumed == straight
    assert capsys.readouterr().err == ""


def test_a_loader_restored_at_the_end_of_its_epoch_warns_that_its_draws_may_differ(capsys):
    straight, resumed = resumed_draws(10, guard=True)
    assert [ids for ids, _ in resumed] == [ids for ids, _ in straight]
    assert "restored at the end of its epoch" in capsys.readouterr().err


def test_a_plain_dataloader_is_left_as_it_is_and_named(tmp_path):
    loader = DataLoader(numbered(), batch_size=4)
    taken = capture({"data": loader, "n": 3}, rng=False)
    assert taken.uncaptured == ["data"] and taken.skeleton["state"]["data"] == {"X": "DataLoader"}
    state = {"data": loader, "n": 0}
    restore(state, taken.layout, taken.skeleton, lambda e: torch.empty(0))
    assert state["data"] is loader and state["n"] == 3


@pytest.mark.timeout(240)
def test_three_ranks_resume_mid_epoch_at_the_same_sample_and_end_bitwise_equal(start_job, tmp_path):
    """DDP on 3 ranks, dropout, LR schedule, a StatefulDataLoader with 2 workers over a shuffling
    DistributedSampler, epoch by epoch (8 steps each). A crash at step 13 restores step 10 (mid-epoch): the
    sample ids of every step and the final state equal the run's without failure. (Hangs and node losses: the
    matrix, and train_gpt's tests.)"""
    shape = ("--nproc-per-node", "3")
    script = ("--data", "stateful", "--workers", "2")
    _, expected, expected_ids = ddp_run(start_job, tmp_path, "straight", shape, script=script)
    job, final, ids = ddp_run(start_job, tmp_path, "crash", shape, "--inject", "crash@rank=1,step=13",
                              script=script)
    assert [(f["kind"], f["rank"]) for f in primary_failures(job)] == [("crash", 1)], job.output
    assert "restore step 10 from RAM" in job.output
    assert ids == expected_ids
    assert final == expected


@pytest.mark.timeout(240)
def test_an_optimizer_whose_step_runs_the_forward_resumes_bitwise_on_three_ranks(start_job, tmp_path):
    """LBFGS calls its closure, forward and backward, inside ``step()``. The resume window ended at the step's
    pre-hook, before that forward, so the DDP warm-up never ran: on 3 ranks the resumed run's first step summed
    gradients in DDP's initial bucket order, and its final state differed from the run's without failure."""
    shape, script = ("--nproc-per-node", "3"), ("--optim", "lbfgs", "--steps", "16")
    _, expected, _ = ddp_run(start_job, tmp_path, "straight", shape, script=script)
    job, final, _ = ddp_run(start_job, tmp_path, "crash", shape, "--inject", "crash@rank=1,step=8", script=script)
    assert [(f["kind"], f["rank"]) for f in primary_failures(job)] == [("crash", 1)], job.output
    assert "restore step 5 from RAM" in job.output
    assert final == expected


@pytest.mark.timeout(240)
def test_dcp_app_state_resumes_bitwise_on_three_ddp_ranks(start_job, tmp_path):
    """DCP's AppState recipe through ftrun.dcp: ``dcp.load`` calls ``get_state_dict``, which makes the state of the
    restarted trainer's fresh optimizer with a step at a zero learning rate. That step ended the resume window
    MemoryReader() had opened, before the first training forward: the DDP warm-up never ran, and on 3 ranks the
    resumed run's first step summed gradients in DDP's initial bucket order, its final state not the run's without
    failure."""
    shape, script = ("--nproc-per-node", "3"), ("--dcp", "--steps", "16")
    _, expected, _ = ddp_run(start_job, tmp_path, "straight", shape, script=script)
    job, final, _ = ddp_run(start_job, tmp_path, "crash", shape, "--inject", "crash@rank=1,step=8", script=script)
    assert [(f["kind"], f["rank"]) for f in primary_failures(job)] == [("crash", 1)], job.output
    assert "restore step 5 from RAM" in job.output
    assert final == expected


@pytest.mark.extended  # make test: the optimizer step hooks of every other test (a compiled step: 27 s)
@pytest.mark.timeout(240)
def test_a_compiled_optimizer_step_waits_for_the_snapshot_untraced(start_job, tmp_path):
    """``torch.compile(optimizer.step)`` (PyTorch's recipe for a faster step) traced ftrun's step hooks too: the
    wait for the snapshot copy, a thread's join, broke the graph with one Dynamo warning per rank ('Dynamo does not
    know how to trace the builtin `_thread.get_ident`', a PyTorch issue to file, it said). The hooks run untraced:
    no warning, and a crash resumes to the state of the run without failure."""
    shape, script = ("--nproc-per-node", "2"), ("--steps", "12", "--every", "1", "--compile-step")
    _, expected, _ = ddp_run(start_job, tmp_path, "straight", shape, script=script)
    job, final, _ = ddp_run(start_job, tmp_path, "crash", shape, "--inject", "crash@rank=1,step=8", script=script)
    assert [(f["kind"], f["rank"]) for f in primary_failures(job)] == [("crash", 1)], job.output
    assert "Dynamo" not in job.output and "Warning" not in job.output, job.output
    assert final == expected


@pytest.mark.timeout(180)
def test_a_script_that_exits_while_a_snapshot_is_copied_exits_cleanly(start_job):
    """Two nodes, a StatefulDataLoader with a worker, a snapshot every step and no wait() at the end: the copy of
    the last one runs while the script returns. As a daemon thread it was stopped mid-copy at finalization and
    rank 0 died of SIGABRT ("terminate called without an active exception") in about half the runs: a failure
    and a restart."""
    job = start_job("--nnodes", "2", "--nproc-per-node", "1", str(SCRIPTS / "loader_exit.py"))
    assert job.wait(120) == 0, job.output
    assert not primary_failures(job) and "0 failure(s)" in job.output, job.output
    assert_job_left_nothing(job)


@pytest.mark.timeout(120)
def test_a_plain_dataloader_in_the_state_is_named_once_with_the_fix(start_job, tmp_path):
    job, _, _ = ddp_run(start_job, tmp_path, "plain", ("--nproc-per-node", "1"),
                        script=("--data", "plain", "--every", "2"))
    assert job.output.count("the position of data (a torch DataLoader) is not captured") == 1, job.output
    assert "StatefulDataLoader" in job.output
