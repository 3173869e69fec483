"""ftrun.dcp: DCP's save/load on the RAM tier. A failure-free run and a failed one of train_dcp.py end bitwise equal
(a crash with dcp.async_save; a node loss, its slots rebuilt from parity); in one process, with the keeper replaced
by an in-memory stand-in: non-tensor values go through JSON, a changed sharding or world size is refused in one
line; outside ftrun both classes refuse at once."""

from __future__ import annotations

import io
import json
import math
import os
import pickle
import re
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.stateful import Stateful

import ftrun.dcp
from conftest import ROOT, assert_job_left_nothing, primary_failures
from ftrun.snapshot import dcp_items
from ftrun.snapshot.layout import capture, decode_meta, encode_meta, restore
from ftrun.snapshot.protocol import ENV_KEEPER_SOCKET

TRAIN_DCP = ROOT / "examples" / "train_dcp.py"
SINGLE_PROCESS = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


@pytest.mark.timeout(30)
def test_outside_ftrun_both_classes_refuse_at_once(monkeypatch):
    monkeypatch.delenv(ENV_KEEPER_SOCKET, raising=False)
    message = rf"needs ftrun's RAM tier: run the script under ftrun \({ENV_KEEPER_SOCKET} is not set\)"
    t0 = time.monotonic()
    for make in (lambda: ftrun.dcp.MemoryWriter(5), ftrun.dcp.MemoryReader):
        with pytest.raises(RuntimeError, match=message):
            make()
    assert time.monotonic() - t0 < 1


@pytest.mark.timeout(60)
def test_a_writer_copied_into_another_process_refuses_to_save(monkeypatch, tmp_path):
    """``dcp.async_save`` with ``AsyncCheckpointerType.PROCESS`` pickles the writer into a process it spawns: that
    copy refuses at DCP's first call, in one line, instead of writing as the trainer."""
    monkeypatch.setenv(ENV_KEEPER_SOCKET, "test-keeper")
    writer = tmp_path / "writer.pickle"
    writer.write_bytes(pickle.dumps(ftrun.dcp.MemoryWriter(5)))
    code = ("import pickle, sys\n"
            "writer = pickle.loads(open(sys.argv[1], 'rb').read())\n"
            "for call in (writer.reset, lambda: writer.set_up_storage_writer(True),\n"
            "             lambda: writer.write_data(None, None)):\n"  # torch 2.13 calls reset() only with an id
            "    try:\n        call()\n    except RuntimeError as err:\n        print(err)\n")
    result = subprocess.run([sys.executable, "-c", code, str(writer)], capture_output=True, text=True, timeout=50)
    assert result.stdout.strip().splitlines() == 3 * [
        "ftrun.dcp.MemoryWriter saves in the trainer's process only: use dcp.async_save's thread mode (the "
        "default), not AsyncCheckpointerType.PROCESS"], (result.stdout, result.stderr)


class FakeSnapshotter:
    """The Snapshotter's contract in one process: save captures the state to layout + JSON, restore loads it."""

    def __init__(self, state):
        self.state, self.saved = state, None

    def save(self, step):
        taken = capture(self.state, rng=False)
        self.borrowed = dict(self.state["tensors"])  # what the copy thread would read, after save() returned
        self.saved = step, encode_meta(taken.layout, taken.skeleton), [t.clone() for t in taken.tensors]

    def wait(self):
        self.waited = getattr(self, "waited", 0) + 1

    def restore(self, open_window=True):
        step, meta, tensors = self.saved
        layout, skeleton = decode_meta(meta)
        by_path = {e.path: t for e, t in zip(layout.entries, tensors)}
        restore(self.state, layout, skeleton, lambda entry: by_path[entry.path])
        return step

    def open_resume_window(self):
        self.windows = getattr(self, "windows", 0) + 1


@pytest.fixture
def keeper(monkeypatch):
    """ftrun.dcp with the stand-in for the keeper (no process group: DCP's no_dist)."""
    monkeypatch.setenv(ENV_KEEPER_SOCKET, "test-keeper")
    fake = FakeSnapshotter(dcp_items.stored(0, None, {}))  # the state ftrun.dcp gives its Snapshotter
    monkeypatch.setattr(ftrun.dcp, "_snap", fake)
    monkeypatch.setattr(ftrun.dcp, "_restored", None)
    monkeypatch.setattr(ftrun.dcp, "_loaded", None)
    monkeypatch.setattr(ftrun.dcp, "_saved", False)
    return fake


@SINGLE_PROCESS
@pytest.mark.timeout(60)
def test_values_round_trip_through_json_and_an_unpicklable_free_value_is_refused(keeper, monkeypatch):
    state = {"w": torch.arange(12.0).reshape(4, 3), "cfg": {"betas": (0.9, 0.99), "name": "x", "inf": -math.inf},
             "step": 7}
    dcp.save(state, storage_writer=ftrun.dcp.MemoryWriter(7), no_dist=True)
    objects = dict(json.loads(keeper.saved[1])["skeleton"]["state"]["objects"]["d"])  # all JSON, nothing pickled
    assert objects["cfg.betas"] == ["cfg.betas", {"t": [0.9, 0.99]}]
    with pytest.raises(RuntimeError, match="made after a MemoryWriter save; a MemoryReader loads at the start"):
        ftrun.dcp.MemoryReader()
    monkeypatch.setattr(ftrun.dcp, "_saved", False)  # a restarted trainer
    live = {"w": torch.zeros(4, 3), "cfg": {"betas": None, "name": None, "inf": None}, "step": 0}
    weight = live["w"]
    dcp.load(live, storage_reader=ftrun.dcp.MemoryReader(), no_dist=True)
    assert ftrun.dcp.restored_step() == 7 and live["w"] is weight and torch.equal(weight, state["w"])
    assert live["cfg"] == state["cfg"] and live["step"] == 7

    with pytest.raises(dcp.CheckpointException) as err:
        dcp.save({"lock": object()}, storage_writer=ftrun.dcp.MemoryWriter(8), no_dist=True)
    assert "MemoryWriter keeps non-tensor values as JSON, never pickled: cannot snapshot object at" in str(err.value)


class TitanTrainState(Stateful):
    """torchtitan's TrainState and dataloader shape: lists in ``torch.save``'d BytesIO, a pickled loader state."""

    def __init__(self, step: int, losses: list[float]) -> None:
        self.step, self.losses = step, losses

    def state_dict(self) -> dict:
        losses = io.BytesIO()
        torch.save(self.losses, losses)
        return {"step": torch.tensor(self.step, dtype=torch.int32), "global_avg_losses": losses,
                "dp_rank_0": pickle.dumps({"samples_yielded": self.step})}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])
        state["global_avg_losses"].seek(0)
        self.losses = torch.load(state["global_avg_losses"], weights_only=False)
        assert pickle.loads(state["dp_rank_0"]) == {"samples_yielded": self.step}


@SINGLE_PROCESS
@pytest.mark.timeout(60)
def test_torchtitan_s_train_state_of_bytesio_values_round_trips(keeper, monkeypatch):
    dcp.save({"train_state": TitanTrainState(5, [4.5, 4.25])}, storage_writer=ftrun.dcp.MemoryWriter(5),
             no_dist=True)
    monkeypatch.setattr(ftrun.dcp, "_saved", False)  # a restarted trainer
    live = TitanTrainState(0, [])
    dcp.load({"train_state": live}, storage_reader=ftrun.dcp.MemoryReader(), no_dist=True)
    assert (live.step, live.losses) == (5, [4.5, 4.25])


@SINGLE_PROCESS
@pytest.mark.timeout(60)
def test_dcp_save_borrows_only_what_an_optimizer_step_alone_changes(keeper):
    """dcp.save returns before the copy: parameters and optimizer state of an optimizer seen stepping (the step
    waits for the copy) are read in place; a buffer (the next forward changes it) is cloned first."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3))
    optimizer = torch.optim.AdamW(model.parameters())
    dcp.save({"model": model}, storage_writer=ftrun.dcp.MemoryWriter(1), no_dist=True)  # before any step
    assert all(t.untyped_storage().data_ptr() != p.untyped_storage().data_ptr()
               for t, p in zip(keeper.borrowed.values(), model.parameters()))
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    dcp.save({"model": model, "optim": optimizer.state_dict()}, storage_writer=ftrun.dcp.MemoryWriter(2),
             no_dist=True)
    live = {name: t for name, t in model.state_dict(keep_vars=True).items()}
    live.update({f"optim.state.{i}.{k}": v for i, s in optimizer.state_dict()["state"].items() for k, v in s.items()})
    same = {key.split("@")[0].removeprefix("model."): t.untyped_storage().data_ptr()
            for key, t in keeper.borrowed.items()}
    for name, t in live.items():
        if name in same and isinstance(t, torch.Tensor):
            stepped = name.startswith("optim.") or name in dict(model.named_parameters())
            assert (same[name] == t.untyped_storage().data_ptr()) == stepped, name


@SINGLE_PROCESS
def test_wait_blocks_until_the_newest_save_is_copied(keeper):
    """dcp.save returns before the copy; ftrun.dcp.wait() is the call to make before changing parameters in place
    outside an optimizer step (an EMA swap), which the copy would otherwise take."""
    model = torch.nn.Linear(3, 3)
    dcp.save({"model": model}, storage_writer=ftrun.dcp.MemoryWriter(1), no_dist=True)
    before = getattr(keeper, "waited", 0)
    ftrun.dcp.wait()
    assert keeper.waited == before + 1


@SINGLE_PROCESS
@pytest.mark.timeout(60)
def test_another_sharding_or_world_size_is_refused_in_one_line(keeper, monkeypatch):
    half = {"fqn": "w", "at": [2, 0], "sizes": [2, 3], "size": [4, 3], "dtype": "float32", "t": torch.ones(2, 3)}
    monkeypatch.setattr(ftrun.dcp, "_restored", 9)
    for at, live in (([2, 0], "reads [2, 3] of it into its chunk at [0, 0]"),
                     ([0, 0], "has the chunk [4, 3] at [0, 0]")):
        monkeypatch.setattr(ftrun.dcp, "_loaded", {"format": ftrun.dcp.FORMAT, "world": 1, "planner": None,
                                                   "items": {"w": {**half, "at": at}}})
        with pytest.raises(dcp.CheckpointException) as err:
            dcp.load({"w": torch.zeros(4, 3)}, storage_reader=ftrun.dcp.MemoryReader(), no_dist=True)
        error = err.value.failures[0][0]
        assert isinstance(error, ftrun.dcp.ReshardRequired) and "\n" not in str(error)
        assert str(error).startswith(f"ftrun.dcp.MemoryReader: w: this rank's RAM snapshot of step 9 holds the chunk "
                                     f"[2, 3] at {at}, the live state {live}; the world size is the same, so "
                                     "the sharding changed (another device mesh or parallelism)")
        assert "start over (--no-resume)" in str(error)
    monkeypatch.setattr(ftrun.dcp, "_loaded", {"format": ftrun.dcp.FORMAT, "world": 4, "planner": None, "items": {}})
    with pytest.raises(ftrun.dcp.ReshardRequired, match="saved at world size 4, this job runs 1; resharding"):
        ftrun.dcp.MemoryReader()


def run_pair(start_job, tmp_path, shape: tuple[str, ...], flags: tuple[str, ...], failed_script: tuple[str, ...] = ()):
    """train_dcp without failure, then with ``flags``: (the failed run's job, its hash, the straight run's)."""
    hashes = []
    for name, extra, more in (("straight", (), ()), ("failed", flags, failed_script)):
        out = tmp_path / f"{name}.hash"
        job = start_job(*shape, *extra, str(TRAIN_DCP), "--steps", "25", "--out", str(out), *more)
        assert job.wait(150) == 0, job.output
        assert_job_left_nothing(job)
        hashes.append(out.read_text().strip())
    assert len(primary_failures(job)) == 1, job.output
    return job, hashes[1], hashes[0]


@pytest.mark.extended  # make test: the dcp.save crash and reshard above
@pytest.mark.timeout(240)
def test_dcp_async_save_to_ram_resumes_a_crash_bitwise(start_job, tmp_path):
    job, final, expected = run_pair(start_job, tmp_path, ("--nproc-per-node", "2"),
                                    ("--inject", "crash@rank=1,step=13"), ("--async-save",))
    assert final == expected
    restored = re.search(r"restore step (\d+) from RAM", job.output)
    assert restored and restored[1] in ("5", "10"), job.output  # the save of step 10 may still be copying
    assert f"starting at step {restored[1]}" in job.output
    assert "save() before restore()" not in job.output  # MemoryReader restored through the Snapshotter


@pytest.mark.extended  # make test: test_sharded's FSDP x TP node loss
@pytest.mark.timeout(300)
def test_dcp_save_to_ram_survives_a_node_loss_bitwise(start_job, tmp_path):
    job, final, expected = run_pair(start_job, tmp_path, ("--nnodes", "2", "--nproc-per-node", "2"),
                                    ("--inject", "node-loss@node=1,step=13"))
    assert final == expected
    assert "restore step 10 from RAM (node 1 rebuilt from the parity" in job.output
    assert "starting at step 10" in job.output


@pytest.mark.timeout(300)
def test_dcp_save_crash_resumes_bitwise_and_its_durable_dcp_copy_reshards_to_another_world_size(start_job, tmp_path):
    """dcp.save (its copy in the background until the next optimizer step) survives a crash bitwise; with
    ``--ckpt-format dcp`` the final step is also on disk in DCP's format: torch alone loads it into an unsharded
    model, and a run of the job at world size 1 loads it through MemoryReader, resharded, bit for bit."""
    ckpt = tmp_path / "ckpt"
    full = {name: tmp_path / f"{name}.pt" for name in ("failed", "resharded")}
    failed, final, expected = run_pair(start_job, tmp_path, ("--nproc-per-node", "2"),
                                  ("--inject", "crash@rank=1,step=13", "--ckpt-dir", str(ckpt),
                                   "--ckpt-format", "dcp"), ("--full-out", str(full["failed"])))
    assert final == expected
    copies = sorted(ckpt.glob("*/step-*/dcp"))
    assert copies and copies[-1].parent.name == "step-00000025", list(ckpt.rglob("*"))
    assert {os.stat(p).st_mode & 0o777 for p in copies[-1].iterdir()} == {0o600}
    load = ("import torch, torch.distributed.checkpoint as dcp, sys\n"
            "full = torch.load(sys.argv[1], weights_only=True)\n"
            "state = {'app': {'model': {k: torch.zeros_like(v) for k, v in full.items()}}}\n"
            "dcp.load(state, checkpoint_id=sys.argv[2], no_dist=True)\n"
            "assert 'ftrun' not in sys.modules\n"
            "print(sum(torch.equal(state['app']['model'][k], v) for k, v in full.items()), len(full))\n")
    loaded = subprocess.run([sys.executable, "-c", load, str(full["failed"]), str(copies[-1])], capture_output=True,
                            text=True, timeout=120, cwd=tmp_path)
    assert loaded.returncode == 0, loaded.stderr
    same, total = map(int, loaded.stdout.split())
    assert same == total > 0

    job = start_job("--nproc-per-node", "1", "--ckpt-dir", str(ckpt), str(TRAIN_DCP), "--steps", "25",
                    "--full-out", str(full["resharded"]), job_id=failed.job_id)
    assert job.wait(150) == 0, job.output
    assert "starting at step 25" in job.output, job.output
    a, b = torch.load(full["failed"], weights_only=True), torch.load(full["resharded"], weights_only=True)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
