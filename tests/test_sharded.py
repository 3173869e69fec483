"""Sharded state (FSDP2, tensor parallel, DCP's get_state_dict, ZeroRedundancyOptimizer) in the Snapshotter: each
rank's local shards with their placements, restored in place into the live DTensors, bit-exactly; a changed layout
refused in one line."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from conftest import ROOT, assert_job_left_nothing, primary_failures
from ftrun.snapshot.layout import LayoutChanged, capture, restore

TRAIN_FSDP = ROOT / "examples" / "train_fsdp.py"


@pytest.fixture
def one_rank(tmp_path):
    """A gloo process group of one rank in this process, and its 1-D mesh; destroyed after the test."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
    finally:
        dist.destroy_process_group()


def snapshot(state):
    taken = capture(state, rng=False)
    return taken, {e.path: t.detach().clone() for e, t in zip(taken.layout.entries, taken.tensors)}


def restore_from(state, taken, tensors):
    restore(state, taken.layout, taken.skeleton, lambda entry: tensors[entry.path])


def test_fsdp2_model_and_optimizer_round_trip_in_place(one_rank):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    fully_shard(model, mesh=one_rank)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 5)).sum().backward()
    optimizer.step()
    state = {"model": model, "optim": optimizer}
    taken, tensors = snapshot(state)
    entry = taken.layout.entries[0]
    assert (entry.path, entry.shape) == ("model/0.weight", (7, 5))  # the local shard
    node = taken.skeleton["state"]["model"]["S"]["d"][0][1]
    assert node["pl"] == ["Shard(dim=0)"] and node["mesh"] == [0] and node["names"] == ["dp"]
    expected = {k: v.to_local().clone() for k, v in model.state_dict().items()}
    params = [p for p in model.parameters()]
    model(torch.randn(2, 5)).sum().backward()
    optimizer.step()  # the live state moves on
    restore_from(state, taken, tensors)
    assert [p for p in model.parameters()] == params  # the same DTensors, loaded in place
    for key, value in model.state_dict().items():
        assert isinstance(value, DTensor) and torch.equal(value.to_local(), expected[key])


def test_an_optimizer_without_state_gets_dtensors_on_its_parameters_mesh(one_rank):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 6)
    fully_shard(model, mesh=one_rank)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    taken, tensors = snapshot({"model": model, "optim": optimizer})
    fresh = torch.optim.AdamW(model.parameters())  # a restarted trainer's optimizer: no state yet
    restore_from({"model": model, "optim": fresh}, taken, tensors)
    for param in model.parameters():
        for key in ("exp_avg", "exp_avg_sq"):
            value = fresh.state[param][key]
            assert isinstance(value, DTensor) and value.placements == param.placements
            assert torch.equal(value.to_local(), optimizer.state[param][key].to_local())


def test_a_changed_placement_is_refused_naming_the_entry_and_both_layouts(one_rank):
    shard = distribute_tensor(torch.arange(6.0).reshape(3, 2), one_rank, [Shard(0)])
    taken, tensors = snapshot({"w": shard})
    replicated = distribute_tensor(torch.zeros(3, 2), one_rank, [Replicate()])
    with pytest.raises(LayoutChanged) as err:
        restore_from({"w": replicated}, taken, tensors)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("cannot restore w: the snapshot holds a DTensor on mesh [0] with (Shard(dim=0))")
    assert "the live one is on mesh [0] with (Replicate())" in message


def run_pair(start_job, tmp_path, shape: tuple[str, ...], flags: tuple[str, ...], script: tuple[str, ...],
             failed_script: tuple[str, ...] = ()):
    """train_fsdp without failure, then with ``flags``: (the failed run's job, its hash, the straight run's)."""
    hashes = []
    for name, extra, more in (("straight", (), ()), ("failed", flags, failed_script)):
        out = tmp_path / f"{name}.hash"
        job = start_job(*shape, *extra, str(TRAIN_FSDP), "--steps", "25", "--out", str(out), *script, *more)
        assert job.wait(150) == 0, job.output
        assert_job_left_nothing(job)
        hashes.append(out.read_text().strip())
    assert len(primary_failures(job)) == 1, job.output
    assert "restore step 10 from" in job.output
    return job, hashes[1], hashes[0]


def test_a_zero_redundancy_optimizer_is_its_partition_and_comes_back_with_its_scheduled_lr(one_rank):
    """ZeroRedundancyOptimizer's state_dict() is rank 0's consolidation, a collective: every save raised torch's
    "Optimizer state has not been consolidated" on every rank, and the job ended in a crash loop. It is stored as
    this rank's partition, its local optimizer's state, and restored with the LR its scheduler set (in the ZeRO
    optimizer's groups too, which its step copies to the local one): the resumed training is bit for bit."""

    def build() -> dict:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3)
        zero = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=0.1)
        return {"model": model, "optim": zero, "sched": torch.optim.lr_scheduler.StepLR(zero, 2, gamma=0.5)}

    def train(state: dict, steps: range) -> None:
        for i in steps:
            state["optim"].zero_grad()
            state["model"](torch.full((2, 4), float(i))).square().sum().backward()
            state["optim"].step()
            state["sched"].step()

    straight, resumed = build(), build()
    train(straight, range(3))
    taken, tensors = snapshot(straight)
    restore_from(resumed, taken, tensors)
    assert resumed["optim"].param_groups[0]["lr"] == straight["optim"].param_groups[0]["lr"] == 0.05
    train(straight, range(3, 6))
    train(resumed, range(3, 6))
    assert all(torch.equal(a, b) for a, b in zip(straight["model"].parameters(), resumed["model"].parameters()))
    assert str(straight["optim"].optim.state_dict()) == str(resumed["optim"].optim.state_dict())


@pytest.mark.timeout(240)
def test_fsdp2_through_dcp_app_state_resumes_from_ram_bitwise(start_job, tmp_path):
    """FSDP2 with uneven shards, the state given as DCP's AppState recipe (get_state_dict / set_state_dict)."""
    _, final, expected = run_pair(start_job, tmp_path, ("--nproc-per-node", "2"),
                                  ("--inject", "crash@rank=1,step=13"), ("--state", "dcp-app"))
    assert final == expected


@pytest.mark.extended  # make test: test_fsdp2_through_dcp_app_state_resumes_from_ram_bitwise, test_dcp_memory
@pytest.mark.timeout(300)
def test_fsdp_x_tp_survives_a_node_loss_bitwise_and_exports_to_dcp_that_torch_alone_loads(start_job, tmp_path):
    """FSDP x TP on a 2 x 2 mesh (strided shards): node 1 lost, its shards rebuilt from parity, the final state
    equal to the run without failure. Its last persisted step, as the keeper wrote it in DCP's format
    (``--ckpt-format dcp``) and as ``ftrun export --format dcp`` writes it, loads with torch alone (no ftrun, no
    process group) into an unsharded model: the full state FSDP gathered at the end."""
    ckpt, full, out = tmp_path / "ckpt", tmp_path / "full.pt", tmp_path / "dcp"
    _, final, expected = run_pair(start_job, tmp_path, ("--nnodes", "2", "--nproc-per-node", "2"),
                                  ("--inject", "node-loss@node=1,step=13", "--ckpt-dir", str(ckpt),
                                   "--ckpt-format", "dcp"), ("--tp", "2"),
                                  ("--full-out", str(full)))
    assert final == expected
    exported = subprocess.run([sys.executable, "-m", "ftrun", "export", str(ckpt), str(out), "--format", "dcp"],
                              capture_output=True, text=True, timeout=120)
    assert exported.returncode == 0, exported.stderr
    assert {os.stat(p).st_mode & 0o777 for p in out.iterdir()} == {0o600}
    load = ("import torch, torch.distributed.checkpoint as dcp, sys\n"
            "full = torch.load(sys.argv[1], weights_only=True)\n"
            "state = {'model': {k: torch.zeros_like(v) for k, v in full.items()}}\n"
            "dcp.load(state, checkpoint_id=sys.argv[2], no_dist=True)\n"
            "assert 'ftrun' not in sys.modules\n"
            "print(sum(torch.equal(state['model'][k], v) for k, v in full.items()), len(full))\n")
    copies = sorted(ckpt.glob("*/step-*/dcp"))
    assert copies, list(ckpt.rglob("*"))
    for written in (out, copies[-1]):
        loaded = subprocess.run([sys.executable, "-c", load, str(full), str(written)], capture_output=True,
                                text=True, timeout=120, cwd=tmp_path)
        assert loaded.returncode == 0, loaded.stderr
        same, total = map(int, loaded.stdout.split())
        assert same == total == 14, written
