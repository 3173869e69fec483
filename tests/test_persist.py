"""The durable tier: rank files, manifests, pruning, verification, `ftrun inspect` and `ftrun export`.

Slot images are built as the Snapshotter builds them (capture, copy at the layout's offsets, meta, commit,
seal), without a running job.
"""

from __future__ import annotations

import errno
import io
import json
import os
import shutil
import stat
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn
from torch.distributed import TCPStore

from ftrun.control.coordination import Coordinator
from ftrun.control.signed import SignedStore
from ftrun.control.spec import NodeSpec
from ftrun.control.store import C10dStore, host_store
from ftrun.events import EventLog
from ftrun.snapshot.dcp_copy import DcpCopies
from ftrun.snapshot.durability import Durability, Round
from ftrun.snapshot import persist
from ftrun.snapshot.layout import RNG_KEY, Capture, capture, encode_meta
from ftrun.snapshot.persist import CorruptStep
from ftrun.snapshot.slot import EMPTY, HEADER_SIZE, Header, SlotFile
from ftrun.ui.durable import disk_state

JOB = "jobx"


def make_state(seed: int) -> dict:
    """A small model and AdamW after one step, a numpy array and plain values."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(5, 4)).square().sum().backward()
    optim.step()
    return {"model": model, "optim": optim, "data": np.arange(6, dtype=np.float32).reshape(2, 3) + seed,
            "meta": {"epoch": seed, "lr": 1e-2, "name": "run", "np": np.int64(7), "tup": (1, 2.5)}}


def make_slot(path: Path, state: dict, step: int, *, spare: int = 0) -> tuple[SlotFile, Capture]:
    """A committed, sealed slot file holding ``state`` at ``step`` (what the Snapshotter's _copy does)."""
    taken = capture(state)
    meta = encode_meta(taken.layout, taken.skeleton)
    layout = taken.layout
    slot = SlotFile(str(path), HEADER_SIZE + layout.nbytes + len(meta) + spare)
    if layout.nbytes:
        data = torch.frombuffer(slot.map, dtype=torch.uint8, count=layout.nbytes, offset=HEADER_SIZE)
        for entry, tensor in zip(layout.entries, taken.tensors, strict=True):
            raw = data[entry.offset:entry.offset + entry.nbytes]
            raw.view(getattr(torch, entry.dtype)).reshape(entry.shape).copy_(tensor)
        del data, raw
    slot.payload()[layout.nbytes:layout.nbytes + len(meta)] = meta
    slot.commit(Header(step=step, generation=0, digest=layout.digest, data_len=layout.nbytes, meta_len=len(meta)))
    assert slot.verify() is None
    return slot, taken


def write_step(root: Path, shm: Path, step: int, states: list[dict]) -> dict[int, dict]:
    """Persist one step of ``len(states)`` ranks (1 node) and finalize it; returns the manifest entries."""
    entries = {}
    for rank, state in enumerate(states):
        slot, _ = make_slot(shm / f"slot-{step}-{rank}", state, step)
        entries[rank] = persist.write_rank(persist.partial_dir(str(root), step), rank, slot)
        slot.close()
    persist.finalize(str(root), step, JOB, 1, len(states), entries)
    return entries


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x10]))


def ftrun(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ftrun", *args], capture_output=True, text=True, timeout=120)


def assert_one_line_error(result: subprocess.CompletedProcess, *fragments: str) -> None:
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1 and lines[0].startswith("ftrun: error: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


@pytest.fixture
def dirs(tmp_path: Path) -> tuple[Path, Path]:
    """(checkpoint root, a stand-in for /dev/shm), both under the test's tmp_path."""
    shm = tmp_path / "shm"
    shm.mkdir()
    return tmp_path / "ckpt" / JOB, shm


@pytest.fixture(scope="module")
def states() -> list[dict]:
    return [make_state(0), make_state(1)]


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_write_and_finalize(dirs, states):
    root, shm = dirs
    entries = write_step(root, shm, 30, states)
    final = root / "step-00000030"
    assert persist.complete_steps(str(root)) == [30]
    assert persist.complete_steps(str(root), job=JOB) == [30]
    assert persist.complete_steps(str(root), job="other") == []
    doc = persist.manifest(str(root), 30)
    assert {k: doc[k] for k in ("format", "job", "step", "world", "nnodes", "nproc_per_node")} == \
        {"format": 1, "job": JOB, "step": 30, "world": 2, "nnodes": 1, "nproc_per_node": 2}
    assert doc["ranks"] == {str(r): e for r, e in entries.items()}
    for rank in (0, 1):
        path = final / f"rank-{rank:05d}.snap"
        slot = SlotFile(str(shm / f"slot-30-{rank}"))
        header = slot.header()
        assert doc["ranks"][str(rank)] == {"file": path.name, "bytes": HEADER_SIZE + header.payload_len,
                                           "checksum": header.checksum, "digest": header.digest}
        assert path.read_bytes() == bytes(slot.map[:HEADER_SIZE + header.payload_len])
        slot.close()
        assert mode(path) == 0o600
    assert mode(final / "manifest.json") == 0o600
    assert mode(final) == mode(root) == mode(root.parent) == 0o700
    assert not os.path.exists(persist.partial_dir(str(root), 30))
    assert persist.verify_step(str(root), 30) == {0: None, 1: None}


def test_a_file_where_a_step_goes_is_named_and_left_alone(dirs, states):
    """A file (or a dangling link) named as the step being persisted: the failure named ".step-N.partial" ("Not a
    directory"), not the file in the way."""
    root, shm = dirs
    write_step(root, shm, 10, states)
    (root / "step-00000020").write_text("someone's notes")
    with pytest.raises(OSError, match="not a step directory, in the way") as raised:
        write_step(root, shm, 20, states)
    assert raised.value.filename == str(root / "step-00000020")
    assert (root / "step-00000020").read_text() == "someone's notes" and persist.complete_steps(str(root)) == [10]


def test_a_step_persisted_again_keeps_a_complete_copy_when_the_disk_fails(dirs, states, monkeypatch):
    """A run that resumed from an older step persists step N again: the earlier step N was moved aside before the
    new manifest was written, so a full or read-only disk left only ``step-N.replaced``, which resume ignores."""
    root, shm = dirs
    write_step(root, shm, 30, states)
    before = persist.manifest(str(root), 30)
    real_fsync = persist._fsync
    monkeypatch.setattr(persist, "_fsync", lambda path: (_ for _ in ()).throw(OSError(errno.ENOSPC, "full", path)))
    with pytest.raises(OSError):
        write_step(root, shm, 30, states)
    assert persist.complete_steps(str(root)) == [30] and persist.manifest(str(root), 30) == before
    assert sorted(os.listdir(root)) == [".step-00000030.partial", "step-00000030"]
    monkeypatch.setattr(persist, "_fsync", real_fsync)
    persist.remove_partial(str(root), 30)
    write_step(root, shm, 30, states)  # done: the earlier copy waits, replaced, for the caller to remove it
    assert sorted(os.listdir(root)) == ["step-00000030", "step-00000030.replaced"]
    shutil.rmtree(root / "step-00000030")  # as if killed between the two renames: only the earlier copy is left
    assert persist.put_back_replaced(str(root)) == [30] and persist.complete_steps(str(root)) == [30]
    assert persist.manifest(str(root), 30) == before


def test_bad_inputs_of_writer(dirs, states):
    root, shm = dirs
    slot, _ = make_slot(shm / "slot", states[0], 10)
    entry = persist.write_rank(persist.partial_dir(str(root), 10), 0, slot)
    with pytest.raises(ValueError, match="expected 0..1"):
        persist.finalize(str(root), 10, JOB, 1, 2, {0: entry})
    slot.set_state(EMPTY)
    with pytest.raises(ValueError, match="state empty"):
        persist.write_rank(persist.partial_dir(str(root), 10), 1, slot)
    assert not os.path.exists(os.path.join(persist.partial_dir(str(root), 10), persist.rank_file(1)))
    slot.close()
    readonly = shm / "readonly"
    readonly.mkdir(mode=0o500)
    slot, _ = make_slot(shm / "slot2", states[0], 10)
    if os.geteuid() != 0:  # root writes anywhere
        with pytest.raises(PermissionError):
            persist.write_rank(str(readonly / "sub"), 0, slot)
    slot.close()
    persist.remove_partial(str(root), 10)
    assert not os.path.exists(persist.partial_dir(str(root), 10))
    assert persist.complete_steps(str(root)) == []
    assert persist.complete_steps(str(root / "missing")) == []


@pytest.mark.parametrize("code", [errno.EINVAL, errno.ENOSPC])
def test_sendfile_failures(dirs, states, monkeypatch, code):
    """EINVAL (no sendfile between these filesystems): write() from the mapping; any other error propagates."""
    root, shm = dirs
    slot, _ = make_slot(shm / "slot", states[0], 10)
    calls = []

    def failing(*args):
        calls.append(args)
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(persist.os, "sendfile", failing)
    directory = persist.partial_dir(str(root), 10)
    path = Path(directory) / persist.rank_file(0)
    if code == errno.EINVAL:
        entry = persist.write_rank(directory, 0, slot)
        assert path.read_bytes() == bytes(slot.map[:entry["bytes"]])
    else:
        with pytest.raises(OSError) as err:
            persist.write_rank(directory, 0, slot)
        assert err.value.errno == code and not path.exists()
    assert calls
    slot.close()


def test_partial_and_malformed_steps_ignored(dirs, states):
    root, shm = dirs
    write_step(root, shm, 10, states)
    slot, _ = make_slot(shm / "slot", states[0], 20)
    persist.write_rank(persist.partial_dir(str(root), 20), 0, slot)  # rank 1 never written: step 20 stays partial
    slot.close()
    (root / "step-00000040").mkdir()
    (root / "step-00000040" / "manifest.json").write_text("{not json")
    (root / "step-00000050").mkdir()
    (root / "step-00000050" / "manifest.json").write_text(json.dumps({"format": 1, "step": 50}))
    (root / "step-60").mkdir()
    assert persist.step_dirs(str(root)) == [10, 40, 50]
    assert persist.step_dirs(str(root), partial=True) == [20]
    assert persist.complete_steps(str(root)) == [10]
    with pytest.raises(ValueError, match="step-00000040"):
        persist.manifest(str(root), 40)
    good = json.loads((root / "step-00000010" / "manifest.json").read_text())
    for name, change in (("world", {"world": 10**30}), ("time", {"time": float("nan")}), ("huge", {"time": 1e300}),
                         ("ranks", {"ranks": []})):  # bounded work and a ValueError, not a MemoryError or a hang
        (root / "step-00000070").mkdir(exist_ok=True)
        (root / "step-00000070" / "manifest.json").write_text(json.dumps({**good, "step": 70, **change}))
        with pytest.raises(ValueError, match="step-00000070"):
            persist.manifest(str(root), 70)


def test_prune(dirs, states):
    root, shm = dirs
    for step in (10, 20, 30, 40):
        write_step(root, shm, step, states[:1])
    for step in (15, 35, 50):
        persist.write_rank(persist.partial_dir(str(root), step), 0, make_slot(shm / f"p{step}", states[0], step)[0])
    assert persist.prune(str(root), 2, 40) == [10, 15, 20, 35]
    assert persist.complete_steps(str(root)) == [30, 40]
    assert persist.step_dirs(str(root), partial=True) == [50]  # newer than the step persisted: being written
    assert persist.prune(str(root), 0, 40) == [30]  # never the step persisted
    assert persist.complete_steps(str(root)) == [40]
    assert persist.prune(str(root), 5, 40) == []
    assert persist.prune(str(root / "missing"), 1, 40) == []


def test_prune_spares_the_steps_asked_and_dcp_copies_ask_for_the_one_copied_and_the_newest_copied(dirs, states):
    """--ckpt-format dcp: an export takes seconds; the step it copies, and the newest step with a copy, are kept
    beyond --keep (pruned meanwhile, no copy completed while steps were persisted faster than exported)."""
    root, shm = dirs
    for step in (10, 20, 30, 40):
        write_step(root, shm, step, states[:1])
    (root / "step-00000010" / "dcp").mkdir()  # an earlier run's copy
    copies = DcpCopies(str(root), EventLog("test", None))
    assert copies.done == 10 and copies.spare() == {10}
    copies._running = (30, None, 0.0)  # exporting step 30
    assert copies.spare() == {10, 30}
    assert persist.prune(str(root), 1, 40, spare=copies.spare()) == [20]
    assert persist.complete_steps(str(root)) == [10, 30, 40]


def test_prune_keeps_the_step_just_persisted_and_leaves_newer_steps_alone(dirs, states, monkeypatch):
    """A run that resumed from 51 because 60 and 70 failed their checks (or another run wrote them) persists 53:
    counting 60 and 70 toward --keep deleted 53 and 51 and left only steps that cannot be loaded."""
    root, shm = dirs
    for step in (40, 51, 60, 70):
        write_step(root, shm, step, states[:1])
    flip_byte(root / "step-00000060" / "rank-00000.snap", HEADER_SIZE + 10)
    write_step(root, shm, 53, states[:1])
    assert persist.prune(str(root), 1, 53) == [40, 51]
    assert persist.complete_steps(str(root)) == [53, 60, 70]
    write_step(root, shm, 55, states[:1])
    assert persist.prune(str(root), 2, 55) == []
    real = persist.complete_steps
    monkeypatch.setattr(persist, "complete_steps", lambda *a: [7, *real(*a)])  # 7: pruned by another process
    write_step(root, shm, 57, states[:1])
    assert persist.prune(str(root), 2, 57) == [7, 53]
    assert real(str(root)) == [55, 57, 60, 70]


@pytest.mark.timeout(30)
def test_a_manifest_nested_too_deep_or_a_fifo_in_a_step_is_not_a_step(dirs, states):
    """A hostile step directory: JSON nested 200,000 deep (a RecursionError in json), or a FIFO where a file
    should be (a reader would block forever). Neither is loaded, and nothing hangs or raises past the check."""
    root, shm = dirs
    write_step(root, shm, 10, states)
    (root / "step-00000020").mkdir()
    (root / "step-00000020" / "manifest.json").write_text("[" * 200_000 + "]" * 200_000)
    (root / "step-00000030").mkdir()
    os.mkfifo(root / "step-00000030" / "manifest.json")
    assert persist.complete_steps(str(root)) == [10]
    with pytest.raises(ValueError, match="step-00000020"):
        persist.manifest(str(root), 20)
    with pytest.raises(OSError, match="not a regular file"):
        persist.manifest(str(root), 30)
    rank_file = root / "step-00000010" / "rank-00001.snap"
    rank_file.unlink()
    os.mkfifo(rank_file)
    target = SlotFile(str(shm / "target"), 1 << 20)
    with pytest.raises(OSError, match="not a regular file"):
        persist.load_rank(str(root), 10, 1, target)
    assert target.header().state == EMPTY
    target.close()


@pytest.mark.timeout(60)
def test_a_link_loop_named_as_a_step_or_a_job_is_not_one(dirs, states, tmp_path):
    """``step-00000020`` (and a job's directory) as a link to itself: following it fails with ELOOP, which took
    down the launcher's resume check, ``ftrun inspect`` and ``ftrun export`` with a traceback."""
    root, shm = dirs
    write_step(root, shm, 10, states)
    os.symlink("step-00000020", root / "step-00000020")
    os.symlink(".step-00000030.partial", root / ".step-00000030.partial")
    os.symlink("loop", root.parent / "loop")
    assert persist.complete_steps(str(root)) == [10] and persist.step_dirs(str(root), partial=True) == []
    assert persist.job_dirs(str(root.parent)) == [str(root)]
    listed = ftrun("inspect", str(root.parent))
    assert listed.returncode == 0 and "Traceback" not in listed.stderr, listed.stderr
    assert ftrun("export", str(root.parent), "--format", "torch", str(tmp_path / "out")).returncode == 0


def test_load_rank_round_trip(dirs, states):
    root, shm = dirs
    write_step(root, shm, 30, states)
    original = SlotFile(str(shm / "slot-30-1"))
    size = HEADER_SIZE + original.header().payload_len
    target = SlotFile(str(shm / "target"), size + 8192)
    target.map[:] = b"\xab" * target.size
    persist.load_rank(str(root), 30, 1, target)
    assert bytes(target.map[:size]) == bytes(original.map[:size])
    assert target.header() == original.header()
    assert target.verify() is None
    with pytest.raises(CorruptStep, match="no rank 2"):
        persist.load_rank(str(root), 30, 2, target)
    small = SlotFile(str(shm / "small"), size - 1)
    with pytest.raises(ValueError, match="do not fit"):
        persist.load_rank(str(root), 30, 1, small)
    assert small.header().state == EMPTY
    for slot in (original, target, small):
        slot.close()


@pytest.mark.parametrize("where", ["data", "meta", "header"])
def test_corrupt_rank(dirs, states, where):
    root, shm = dirs
    write_step(root, shm, 30, states)
    path = root / "step-00000030" / "rank-00001.snap"
    image = persist.open_image(str(path))
    header = image.header()
    image.close()
    flip_byte(path, {"data": HEADER_SIZE + 3, "meta": HEADER_SIZE + header.data_len + 5, "header": 16}[where])
    problems = persist.verify_step(str(root), 30)
    assert problems[0] is None and problems[1] is not None
    target = SlotFile(str(shm / "target"), path.stat().st_size + 4096)
    persist.load_rank(str(root), 30, 0, target)
    assert target.header().state != EMPTY
    with pytest.raises(CorruptStep, match="rank-00001.snap"):
        persist.load_rank(str(root), 30, 1, target)
    assert target.header().state == EMPTY
    path.write_bytes(path.read_bytes()[:-1])  # truncated
    assert "beyond capacity" in persist.verify_step(str(root), 30)[1]
    size = path.stat().st_size
    with pytest.raises(CorruptStep, match=f"rank-00001.snap: {size} bytes, the manifest says {size + 1}"):
        persist.load_rank(str(root), 30, 1, target)
    path.write_bytes(path.read_bytes()[:15])  # not even a header: named as such, not 'changed while it was read'
    with pytest.raises(CorruptStep, match=f"rank-00001.snap: 15 bytes, the manifest says {size + 1}"):
        persist.load_rank(str(root), 30, 1, target)
    target.close()
    path.unlink()
    assert "No such file" in persist.verify_step(str(root), 30)[1]


def test_inspect(dirs, states):
    root, shm = dirs
    write_step(root, shm, 10, states)
    write_step(root, shm, 20, states)
    slot, _ = make_slot(shm / "slot", states[0], 30)
    persist.write_rank(persist.partial_dir(str(root), 30), 0, slot)
    slot.close()
    flip_byte(root / "step-00000020" / "rank-00001.snap", HEADER_SIZE + 1)

    result = ftrun("inspect", str(root), "--json")
    assert result.returncode == 1, result.stderr  # a step fails verification
    assert result.stderr.strip() == f"ftrun: 1 step(s) fail verification: {JOB} step 20"
    doc = json.loads(result.stdout)
    rows = {row["step"]: row for row in doc["steps"]}
    assert [row["step"] for row in doc["steps"]] == [10, 20, 30]
    assert rows[10]["state"] == "complete" and rows[10]["corrupt"] == {} and rows[10]["job"] == JOB
    assert rows[10]["ranks"] == rows[10]["world"] == 2
    assert rows[10]["bytes"] == sum(p.stat().st_size for p in (root / "step-00000010").glob("rank-*.snap"))
    assert list(rows[20]["corrupt"]) == ["1"] and "checksum mismatch" in rows[20]["corrupt"]["1"]
    assert rows[30]["state"] == "partial" and rows[30]["ranks"] == 1

    result = ftrun("inspect", str(root), "--no-verify", "--json")
    assert result.returncode == 0, result.stderr
    assert all(row["corrupt"] is None for row in json.loads(result.stdout)["steps"])

    result = ftrun("inspect", str(root.parent))  # the --ckpt-dir that holds the job's directory
    assert result.returncode == 1, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["step", "job", "state", "ranks", "size", "created", "check"]
    assert lines[1].split()[:4] == ["10", JOB, "complete", "2"] and lines[1].endswith("ok")
    assert "rank 1 corrupt: checksum mismatch" in lines[2]
    assert lines[3].split()[:3] == ["30", JOB, "partial"]


def test_inspect_counts_only_regular_rank_files_of_a_partial_step(dirs, states):
    """A symbolic link loop named like a rank file in a partial step (nothing ftrun writes) ended ``ftrun inspect`` in
    an OSError traceback (ELOOP): it is not counted, as nothing but a regular file is."""
    root, shm = dirs
    write_step(root, shm, 10, states)
    partial = root / ".step-00000020.partial"
    partial.mkdir()
    (partial / "rank-00000.snap").symlink_to("rank-00000.snap")
    (partial / "rank-00001.snap").write_bytes(b"x" * 10)
    result = ftrun("inspect", str(root), "--json")
    assert result.returncode == 0, result.stderr
    rows = {row["step"]: row for row in json.loads(result.stdout)["steps"]}
    assert rows[20]["state"] == "partial" and (rows[20]["ranks"], rows[20]["bytes"]) == (1, 10)


def test_inspect_bad_input(tmp_path):
    assert_one_line_error(ftrun("inspect", str(tmp_path / "missing")), "no such checkpoint directory")
    assert_one_line_error(ftrun("inspect", str(tmp_path)), "no checkpoint steps")


def test_export(dirs, states, tmp_path):
    root, shm = dirs
    write_step(root, shm, 10, [make_state(5), make_state(6)])
    write_step(root, shm, 20, states)
    out = tmp_path / "out" / "torch"
    result = ftrun("export", str(root), "--format", "torch", str(out))
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [str(out / "rank-00000.pt"), str(out / "rank-00001.pt")]
    assert mode(out) == mode(out.parent) == 0o700
    for rank, state in enumerate(states):
        path = out / f"rank-{rank:05d}.pt"
        assert mode(path) == 0o600
        loaded = torch.load(path, weights_only=True)
        assert set(loaded) == {"model", "optim", "data", "meta", RNG_KEY}
        for name, tensor in state["model"].state_dict().items():
            assert torch.equal(loaded["model"][name], tensor), name
        assert loaded["model"]._metadata == state["model"].state_dict()._metadata
        optim = state["optim"].state_dict()
        for index, moments in optim["state"].items():
            assert torch.equal(loaded["optim"]["state"][index]["exp_avg"], moments["exp_avg"])
            assert torch.equal(loaded["optim"]["state"][index]["exp_avg_sq"], moments["exp_avg_sq"])
        assert loaded["optim"]["param_groups"] == optim["param_groups"]
        assert torch.equal(loaded["data"], torch.from_numpy(state["data"]))
        assert loaded["meta"] == {**state["meta"], "np": 7}
        assert type(loaded["meta"]["np"]) is int and type(loaded["meta"]["tup"]) is tuple
        assert set(loaded[RNG_KEY]) == {"python", "numpy", "torch"} and loaded[RNG_KEY]["torch"].dtype == torch.uint8
        assert loaded[RNG_KEY]["python"][0] == 3 and len(loaded[RNG_KEY]["python"][1]) == 625

    out = tmp_path / "st"
    result = ftrun("export", str(root), "--step", "10", "--format", "safetensors", str(out))
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [str(out / "rank-00000.safetensors"), str(out / "rank-00001.safetensors")]
    state = make_state(6)
    path = out / "rank-00001.safetensors"
    assert mode(path) == 0o600
    tensors = load_file(path)
    assert torch.equal(tensors["model/0.weight"], state["model"][0].weight)
    assert torch.equal(tensors["model/1.running_mean"], state["model"][1].running_mean)
    assert torch.equal(tensors["optim/state/0/exp_avg"], state["optim"].state_dict()["state"][0]["exp_avg"])
    assert torch.equal(tensors["data"], torch.from_numpy(state["data"]))
    assert {"__rng__/torch", "__rng__/numpy/1"} <= set(tensors)
    with safe_open(path, "pt") as f:
        metadata = f.metadata()
    assert (metadata["ftrun_job"], metadata["ftrun_step"], metadata["ftrun_rank"]) == (JOB, "10", "1")
    skeleton = json.loads(metadata["ftrun_skeleton"])
    assert skeleton["state"]["meta"]["d"][0] == ["epoch", 6]
    assert sorted(row[0] for row in json.loads(metadata["ftrun_layout"])["entries"]) == sorted(tensors)
    assert not list(out.glob("*.partial"))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fmt", ["dcp", "safetensors", "torch"])
def test_an_export_to_a_full_disk_is_one_line_and_leaves_no_file(dirs, small_tmpfs, fmt):
    """A 4 MiB rank exported to a 2 MiB filesystem: one line that says how much was free, nothing left in OUT.
    Before: DCP's CheckpointException (a BaseException) and safetensors' SafetensorError were tracebacks, and DCP
    left a file cut short."""
    root, shm = dirs
    ranks = [{"w": torch.zeros(1)}, {"w": torch.arange(1 << 20, dtype=torch.float32)}]  # rank 0 written, 1 fails
    write_step(root, shm, 10, ranks[::-1] if fmt == "dcp" else ranks)  # dcp: rank 0's values (not sharded)
    out = small_tmpfs(2) / "out"
    assert_one_line_error(ftrun("export", str(root), "--format", fmt, str(out)), "cannot write", "MiB free there")
    assert not out.exists()  # nor the directory it made
    out.mkdir()
    (out / "notes").write_text("")  # what was there stays
    assert ftrun("export", str(root), "--format", fmt, str(out)).returncode == 2
    assert os.listdir(out) == ["notes"]


@pytest.mark.timeout(120)
def test_a_dcp_copy_the_disk_cut_short_is_never_published_though_its_exit_code_is_lost(small_tmpfs, tmp_path):
    """The copy's exporter runs as a child of the supervisor, which reaps every child that exits: ``Popen`` then
    reports exit code 0. A copy that the full disk cut short was renamed to ``step-N/dcp`` and reported as written
    (dcp.load: "metadata is None"); now only the exporter publishes its copy, after checking it."""
    root, shm = small_tmpfs(7) / JOB, tmp_path / "shm"
    shm.mkdir()
    write_step(root, shm, 10, [{"w": torch.arange(1 << 20, dtype=torch.float32)}])  # 4 MiB of 7: no room for a copy
    lines = io.StringIO()
    copies = DcpCopies(str(root), EventLog("test", None, stream=lines))
    copies.want(10, final=True)  # not in SCHED_IDLE: on a busy host (the suite's) a lowered copy starves for minutes
    child = running_copy(copies)
    _, status = os.waitpid(child.pid, 0)  # as the supervisor's reap() does
    assert os.waitstatus_to_exitcode(status) == 1
    copies.poll()
    assert not copies.busy() and copies.done == 0
    assert sorted(os.listdir(root / "step-00000010")) == ["manifest.json", "rank-00000.snap"]
    said = [line for line in lines.getvalue().splitlines() if "DCP copy" in line]
    assert len(said) == 1 and "the DCP copy of step 10 failed (cannot write" in said[0], said
    assert "MiB free there" in said[0] and "step stays on disk" in said[0]


def test_export_bad_input(dirs, states, tmp_path):
    root, shm = dirs
    out = str(tmp_path / "out")
    assert_one_line_error(ftrun("export", str(tmp_path / "missing"), "--format", "torch", out), "no such")
    write_step(root, shm, 10, states)
    write_step(root, shm, 20, states)
    assert_one_line_error(ftrun("export", str(root), "--step", "15", "--format", "torch", out),
                          "no complete step 15", "10, 20")
    assert_one_line_error(ftrun("export", str(root), "--format", "zip", out), "--format", "zip")
    assert_one_line_error(ftrun("export", str(root), out), "--format")
    assert_one_line_error(ftrun("export", str(root), "--step", "x", "--format", "torch", out), "--step")
    flip_byte(root / "step-00000020" / "rank-00000.snap", HEADER_SIZE + 9)
    assert_one_line_error(ftrun("export", str(root), "--format", "torch", out), "step 20", "rank 0")
    assert not os.path.exists(out)  # nothing written before every rank verified
    (tmp_path / "file").write_text("")
    assert_one_line_error(ftrun("export", str(root), "--step", "10", "--format", "torch", str(tmp_path / "file")),
                          "cannot")
    assert ftrun("export", str(root), "--step", "10", "--format", "torch", out).returncode == 0
    kept = (tmp_path / "out" / "rank-00001.pt").read_bytes()
    assert_one_line_error(ftrun("export", str(root), "--step", "10", "--format", "torch", out),
                          "rank-00000.pt exists (and 1 more file(s) this export would write)")  # never replaced
    assert (tmp_path / "out" / "rank-00001.pt").read_bytes() == kept


def test_a_ckpt_dir_shared_by_jobs(dirs, states, tmp_path):
    """Each job's steps live in its own directory; prune keeps only that job's; export picks one job."""
    root, shm = dirs
    other = root.parent / "other"
    write_step(root, shm, 10, states)
    write_step(other, shm, 20, states)
    assert persist.job_dirs(str(root.parent)) == [str(root), str(other)]
    assert persist.job_dirs(str(root)) == [str(root)]
    assert persist.prune(str(other), 1, 20, job="someone-else") == []  # never another job's steps
    out = str(tmp_path / "out")
    assert_one_line_error(ftrun("export", str(root.parent), "--format", "torch", out), "several jobs", "--job")
    assert_one_line_error(ftrun("export", str(root.parent), "--job", "nope", "--format", "torch", out), "nope")
    result = ftrun("export", str(root.parent), "--job", JOB, "--format", "torch", out)
    assert result.returncode == 0, result.stderr
    result = ftrun("inspect", str(root.parent), "--json")
    assert result.returncode == 0, result.stderr
    assert [(row["path"], row["step"]) for row in json.loads(result.stdout)["steps"]] == [
        (str(root / "step-00000010"), 10), (str(other / "step-00000020"), 20)]


def test_steps_of_another_world_size_are_set_aside_not_pruned(dirs, states):
    """A job resumed at another world size (from a DCP copy, or from scratch with the Snapshotter) persists steps
    of its own: pruning deleted the steps of the earlier world, its newest state included, which a run back at
    that world size resumes from. They are moved to previous-<time>/ (the spared ones, a DCP copy's, stay), and
    never count toward --keep."""
    root, shm = dirs
    for step in (10, 14):
        write_step(root, shm, step, states)  # world size 2
    write_step(root, shm, 9, states)
    for step in (5, 12):
        write_step(root, shm, step, states[:1])  # this run: world size 1
    aside, moved = persist.set_aside_other_worlds(str(root), 12, JOB, 1, spare=frozenset({9}))
    assert moved == [10] and os.path.basename(aside).startswith("previous-")
    assert sorted(os.listdir(aside)) == ["step-00000010"]
    assert persist.complete_steps(aside) == [10]  # whole: a run at world size 2 loads it once moved back
    assert persist.prune(str(root), 1, 12, spare=frozenset({9})) == [5]
    assert persist.complete_steps(str(root)) == [9, 12, 14]  # 14: newer than the step persisted, not this run's
    assert persist.set_aside_other_worlds(str(root), 12, JOB, 1, spare=frozenset({9})) == ("", [])


def test_a_node_0_replaced_and_back_leaves_the_persist_rounds_of_the_job_alone(tmp_path):
    """Node 0 leads the persist rounds through one job-wide round document. A node 0 cut off or stalled with a round
    open, replaced by a spare (a newer generation's node 0, which opens rounds of its own), and back on the network
    for the moments before it reads its owner key, finished its old round: it wrote the document back to that
    round's number, the live node 0 then numbered its next rounds from there and took their old answers for new
    ones (persists failed, 'No such file ... .step-N.partial/manifest.json', durability DEGRADED), and a stale node
    persisted the live rounds' steps under its node rank's outcome key. A round of a newer generation than a
    node's own is not that node's: it neither leads nor follows it."""
    server = host_store(0)
    store = SignedStore(C10dStore(server), "0123456789abcdef" * 4)
    spec = NodeSpec("job", 0, 2, 1, "127.0.0.1", 1, "127.0.0.1", "x.py", [], False, False, "/", 1, 0, 1.0, 1.0, 1.0,
                    1.0, 1.0, 1.0, False, ckpt_dir=str(tmp_path / "ckpt"), persist_every=1)
    events = EventLog("test", None, stream=None)

    def node(rank: int, generation: int) -> Durability:
        made = Durability(replace(spec, node_rank=rank), Coordinator(store, "job", rank, 2, run=1), events)
        made.begin(generation)
        made.snapshot_passed(1)
        return made

    stale, old_node_1 = node(0, 0), node(1, 0)
    stale.tick({}, 4)  # opens round 1 and waits for node 1's hold
    old_node_1.tick({}, 4)
    assert old_node_1.hold == 4
    live, node_1 = node(0, 1), node(1, 1)  # generation 1: node 0 was lost, a spare took its rank
    live.tick({}, 6)  # opens round 2
    node_1.tick({}, 6)
    live.tick({}, 6)  # names step 6
    node_1.tick({}, 6)
    assert node_1.persist == (2, 6)
    stale.tick({}, 4)  # back: round 1 has every hold it waited for
    old_node_1.tick({}, 4)
    assert Round.decode(store.get(live.coord.key("persist", "round"))) == Round(2, 1, 6)
    assert stale.open is None and stale.persist == (0, 0) and old_node_1.persist == (0, 0)
    del server


def two_nodes(root: Path, lines: io.StringIO | None = None, **settings: Any) -> tuple[list[Durability], TCPStore]:
    """Node 0 and node 1 of a job of 2 nodes x 1 rank persisting to ``root`` (every snapshot step), in generation 0,
    their terminal lines written to ``lines``; and the control store's server (keep it while they run)."""
    server = host_store(0)
    store = SignedStore(C10dStore(server), "0123456789abcdef" * 4)
    spec = NodeSpec(JOB, 0, 2, 1, "127.0.0.1", 1, "127.0.0.1", "x.py", [], False, False, "/", 1, 0, 1.0, 1.0, 1.0,
                    1.0, 1.0, 1.0, False, ckpt_dir=str(root), persist_every=1, **settings)
    events = EventLog("test", None, stream=lines)
    nodes = [Durability(replace(spec, node_rank=rank), Coordinator(store, JOB, rank, 2, run=1), events)
             for rank in (0, 1)]
    nodes[0].coord.init_job({"ckpt_dir": str(root)})
    for node in nodes:
        node.begin(0)
    return nodes, server


def dcp_nodes(root: Path, lines: io.StringIO | None = None) -> tuple[list[Durability], TCPStore, DcpCopies]:
    """:func:`two_nodes` with ``--ckpt-format dcp``, and node 0's DCP copies."""
    nodes, server = two_nodes(root, lines, ckpt_format="dcp")
    assert nodes[0].copies is not None
    return nodes, server, nodes[0].copies


def persist_round(nodes: list[Durability], shm: Path, states: list[dict], step: int, error: str | None = None,
                  final: bool = False) -> None:
    """One round of ``nodes`` persisting ``step`` (the final one if ``final``): each node's keeper writes its rank's
    file, or fails with ``error``; node 0 finishes the step."""
    root = nodes[0].root
    if final:
        nodes[0].ask_final(step)
    for node in nodes:
        node.snapshot_passed(1)
    for _ in range(3):  # open; hold; name the step
        for node in nodes:
            node.tick({}, step)
    outcomes = []
    for rank, node in enumerate(nodes):
        assert node.persist[1] == step
        done: dict = {"round": node.persist[0], "step": step}
        if error is None:
            slot, _ = make_slot(shm / f"slot-{step}-{rank}", states[rank], step)
            done["entries"] = {str(rank): persist.write_rank(persist.partial_dir(root, step), rank, slot)}
            slot.close()
        else:
            done["error"] = f"node {rank}: {error}"
        outcomes.append(done)
    for rank in (1, 0):
        nodes[rank].tick(outcomes[rank], step)


def test_a_disk_full_for_one_round_then_freed_is_durability_ok_again(dirs, states):
    """One persist round of a 2-node job fails (its disk is full), then space is freed and the next round writes
    its step: the summary and ``ftrun status`` said "DEGRADED" for the rest of the job (every failure counted),
    though the newest step was on disk again. Durability is degraded while the newest persist failed; once a round
    succeeds it is "ok", naming the failures before."""
    root, shm = dirs
    nodes, server = two_nodes(root)
    persist_round(nodes, shm, states, 10, "No space left on device")
    assert disk_state(nodes[0].coord, 10).describe().startswith("DEGRADED: 1 of 1 persists failed")
    persist_round(nodes, shm, states, 20)
    state = disk_state(nodes[0].coord, 20)
    assert state is not None and state.step == 20 and not state.degraded
    assert state.describe().startswith("ok: newest step on disk 20 (0 step(s) behind training"), state.describe()
    assert state.describe().endswith("; 1 of 2 persists failed before (last: node 0: No space left on device; "
                                     "node 1: No space left on device)"), state.describe()
    del server


def test_the_final_persist_copies_its_step_to_dcp_at_once_stopping_an_older_copy(dirs, states):
    """With --ckpt-format dcp the job's end (or a SIGTERM) waits for the DCP copy of the final step. A copy of an
    older step still running (a large state, a slow disk) made it wait for that one first: the final step, complete
    on disk, was reported 'did not complete within 60s' (exit 1 after a SIGTERM). The final step's copy starts at
    once, stopping the older one (which the final copy supersedes), and at the normal priority: training is over,
    and an idle-priority copy on a busy host missed --persist-grace even for a tiny state."""
    root, shm = dirs
    nodes, server, copies = dcp_nodes(root)
    try:
        persist_round(nodes, shm, states, 10)
        assert copies.spare() == {10}  # its copy runs (a child process that imports torch: seconds)
        assert os.sched_getscheduler(running_copy(copies).pid) == os.SCHED_IDLE
        persist_round(nodes, shm, states, 20, final=True)
        assert copies.spare() == {20}
        assert os.sched_getscheduler(running_copy(copies).pid) == os.SCHED_OTHER
    finally:
        copies.stop()
    del server


@pytest.mark.timeout(120)
def test_every_node_judges_the_final_dcp_persist_by_its_copy(small_tmpfs, tmp_path):
    """--ckpt-format dcp: the final persist succeeded once its step is on disk and its DCP copy is written. Node 1
    said so as soon as the ftrun-format step was on disk, node 0 only once the copy ended, and node 0 counted a copy
    that failed as done: a job stopped by SIGTERM exited 143 on node 1's host with no DCP checkpoint of its newest
    step. Every node now reads the copy's outcome from the store: both wait for it, and both report its failure."""
    root, shm = small_tmpfs(10) / JOB, tmp_path / "shm"
    shm.mkdir()
    big = [{"w": torch.arange(1 << 20, dtype=torch.float32)}] * 2  # 4 MiB a rank, 8 of 10 MiB: no room for a copy
    nodes, server, copies = dcp_nodes(root)
    try:
        persist_round(nodes, shm, big, 10, final=True)
        assert [node.final_outcome() for node in nodes] == [None, None]  # its copy runs
        running_copy(copies).wait()
        nodes[0].tick({}, 10)
        outcomes = [node.final_outcome() for node in nodes]
        assert outcomes[0] == outcomes[1], outcomes
        assert outcomes[0] is not None and outcomes[0].startswith("its DCP copy failed (cannot write"), outcomes
    finally:
        copies.stop()
    del server


@pytest.mark.timeout(120)
def test_a_failed_dcp_copy_is_degraded_durability_warned_once(dirs, states):
    """--ckpt-format dcp: a DCP copy that fails (here: a rank file corrupted before the copy read it) left the
    summary and ``ftrun status`` at "durability ok" though no DCP copy of the newest step existed, and warned again
    for every step. Now durability is DEGRADED, naming the failed copy and the newest copy there is, while no newer
    copy is written; the warning is one line until a copy is written again (the event log has each)."""
    root, shm = dirs
    lines = io.StringIO()
    nodes, server, copies = dcp_nodes(root, lines)
    try:
        for step in (10, 20):
            persist_round(nodes, shm, states, step)
            flip_byte(root / persist.step_name(step) / "rank-00001.snap", HEADER_SIZE + 3)
            copies.want(step, final=True)  # at once, at the normal priority (a busy host starves an idle one)
            running_copy(copies).wait()
            nodes[0].tick({}, step)
            state = disk_state(nodes[0].coord, step)
            assert state is not None and state.degraded, state
            assert state.describe().startswith(f"DEGRADED: the DCP copy of step {step} failed ("), state.describe()
            assert "newest DCP copy: none); newest step on disk" in state.describe(), state.describe()
    finally:
        copies.stop()
    said = [line for line in lines.getvalue().splitlines() if "DCP copy" in line]
    assert len(said) == 1 and "the DCP copy of step 10 failed" in said[0], said
    del server


def test_a_final_step_persisted_before_the_end_has_its_copy_made_at_once(dirs, states):
    """--ckpt-format dcp, the job's newest step persisted by a periodic round just before training ended (say with
    --persist-every 1): no final round opens, and its DCP copy went on in SCHED_IDLE, which a busy host starves for
    minutes while the job's end waits for it (--persist-grace, then 'did not complete'). The final persist now
    restarts that copy at once at the normal priority, as a final round's."""
    root, shm = dirs
    nodes, server, copies = dcp_nodes(root)
    try:
        persist_round(nodes, shm, states, 10)
        assert os.sched_getscheduler(running_copy(copies).pid) == os.SCHED_IDLE
        nodes[0].ask_final(10)
        nodes[0].tick({}, 10)
        assert copies.spare() == {10}
        assert os.sched_getscheduler(running_copy(copies).pid) == os.SCHED_OTHER
    finally:
        copies.stop()
    del server


def running_copy(copies: DcpCopies) -> subprocess.Popen[str]:
    assert copies._running is not None
    return copies._running[1]


class AfterRead:
    """A raw control store that runs ``then`` once, right after a read of ``key`` has returned its value."""

    def __init__(self, store: C10dStore, key: str) -> None:
        self.store, self.key = store, key
        self.then: Callable[[], None] | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        values = self.store.get_many(keys)
        if self.key in keys and self.then is not None:
            then, self.then = self.then, None
            then()
        return values


def test_a_stale_node_0_never_writes_its_round_over_one_the_live_node_0_wrote_after_its_read(tmp_path):
    """The stale node 0 of the test above checked that the round document was not a newer generation's, then wrote
    it: when the live node 0 opened its round between that read and that write (the stale one stopped in between,
    or its write held up in a partition), the document went back to the stale round. The other nodes never saw the
    live round, so they never answered its hold, and the live node 0 waited for them for the rest of the
    generation: nothing more was persisted. The write is a compare-and-set from the bytes read."""
    server = host_store(0)
    secret = "0123456789abcdef" * 4
    store = SignedStore(C10dStore(server), secret)
    key = "ftrun/job/1/persist/round"
    interleaved = AfterRead(C10dStore(server), key)
    spec = NodeSpec("job", 0, 2, 1, "127.0.0.1", 1, "127.0.0.1", "x.py", [], False, False, "/", 1, 0, 1.0, 1.0, 1.0,
                    1.0, 1.0, 1.0, False, ckpt_dir=str(tmp_path / "ckpt"), persist_every=1)
    events = EventLog("test", None, stream=None)

    def node(rank: int, generation: int, raw: Any = None) -> Durability:
        signed = store if raw is None else SignedStore(raw, secret)
        made = Durability(replace(spec, node_rank=rank), Coordinator(signed, "job", rank, 2, run=1), events)
        made.begin(generation)
        made.snapshot_passed(1)
        return made

    stale, old_node_1 = node(0, 0, interleaved), node(1, 0)
    assert stale.coord.key("persist", "round") == key
    stale.tick({}, 4)  # opens round 1 and waits for node 1's hold
    old_node_1.tick({}, 4)
    live, node_1 = node(0, 1), node(1, 1)  # generation 1: node 0 was lost, a spare took its rank
    interleaved.then = lambda: live.tick({}, 6)  # the live node 0 opens round 2 right after the stale one's read
    stale.tick({}, 4)  # round 1 has every hold it waited for: it would name step 4
    assert Round.decode(store.get(key)) == Round(2, 1) and stale.open is None
    node_1.tick({}, 6)
    live.tick({}, 6)
    node_1.tick({}, 6)
    assert node_1.persist == (2, 6)
    del server
