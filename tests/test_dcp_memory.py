"""ftrun.dcp: DCP's save/load on the RAM tier. A failure-free run and a failed one of train_dcp.py end bitwise equal
(a crash with dcp.async_save; a node loss, its slots rebuilt from parity); in one process, with the keeper replaced
by an in-memory stand-in: non-tensor values go through JSON, a changed sharding or world size is refused in one
line; outside ftrun both classes refuse at once."""

from __future__ import annotations

import json
import math
import re
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ftrun.dcp
from conftest import ROOT, assert_job_left_nothing, primary_failures
from ftrun.snapshot.layout import Borrowed, capture, decode_meta, encode_meta, restore
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


class FakeSnapshotter:
    """The Snapshotter's contract in one process: save captures the state to layout + JSON, restore loads it."""

    def __init__(self, state):
        self.state, self.saved = state, None

    def save(self, step):
        taken = capture(self.state, rng=False)
        self.saved = step, encode_meta(taken.layout, taken.skeleton), [t.clone() for t in taken.tensors]

    def wait(self):
        pass

    def restore(self):
        step, meta, tensors = self.saved
        layout, skeleton = decode_meta(meta)
        by_path = {e.path: t for e, t in zip(layout.entries, tensors)}
        restore(self.state, layout, skeleton, lambda entry: by_path[entry.path])
        return step


@pytest.fixture
def keeper(monkeypatch):
    """ftrun.dcp with the stand-in for the keeper (no process group: DCP's no_dist)."""
    monkeypatch.setenv(ENV_KEEPER_SOCKET, "test-keeper")
    fake = FakeSnapshotter({"format": ftrun.dcp.FORMAT, "world": 0, "planner": None,
                            "items": Borrowed()})  # the state ftrun.dcp gives its Snapshotter
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
    items = dict(json.loads(keeper.saved[1])["skeleton"]["state"]["items"]["d"])  # all JSON, nothing pickled
    assert items["cfg.betas"] == {"d": [["fqn", "cfg.betas"], ["obj", {"t": [0.9, 0.99]}]]}
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
                                     f"[2, 3] at {at}, the live state {live}; resharding goes through")
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


@pytest.mark.timeout(240)
def test_dcp_async_save_to_ram_resumes_a_crash_bitwise(start_job, tmp_path):
    job, final, expected = run_pair(start_job, tmp_path, ("--nproc-per-node", "2"),
                                    ("--inject", "crash@rank=1,step=13"), ("--async-save",))
    assert final == expected
    restored = re.search(r"restore step (\d+) from RAM", job.output)
    assert restored and restored[1] in ("5", "10"), job.output  # the save of step 10 may still be copying
    assert f"starting at step {restored[1]}" in job.output


@pytest.mark.extended  # make test: test_sharded's FSDP x TP node loss
@pytest.mark.timeout(300)
def test_dcp_save_to_ram_survives_a_node_loss_bitwise(start_job, tmp_path):
    job, final, expected = run_pair(start_job, tmp_path, ("--nnodes", "2", "--nproc-per-node", "2"),
                                    ("--inject", "node-loss@node=1,step=13"))
    assert final == expected
    assert "restore step 10 from RAM (node 1 rebuilt from the parity" in job.output
    assert "starting at step 10" in job.output
