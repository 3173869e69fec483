"""Worker of benchmarks/snapshot.py (method there): the only trainer of a 1-node ftrun job.

Generation 0 measures copy, blocking, CRC-32, torch.save/torch.load and training throughput, takes a last
snapshot, writes its results to ``--out`` and SIGKILLs itself; generation 1 (ftrun's restart) restores,
checks the state bit for bit and adds its timings to ``--out``. After each snapshot it waits until the keeper
has sealed (checksummed) it, so the keeper's CRC steals no CPU from the next measurement unless measured.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

import ftrun
from ftrun.snapshot.client import Snapshotter
from ftrun.snapshot.keeper import find_segments
from ftrun.snapshot.layout import capture
from ftrun.snapshot.slot import COMMITTED, SlotFile, checksum

WIDTH = 1024  # every layer is nn.Linear(WIDTH, WIDTH): 4 MiB of float32 weights
STEP_PER_COPY = 4.0  # a training step is sized to take this many times the snapshot copy
MAX_BATCH = 8192
Model = tuple[nn.Sequential, torch.optim.Optimizer]
_slots: dict[str, SlotFile] = {}


def build(size: int) -> Model:
    """Linear layers whose params + AdamW exp_avg + exp_avg_sq take about ``size`` bytes; one step taken."""
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(max(1, round(size / (12 * WIDTH * (WIDTH + 1)))))))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad()
    return model, optimizer


def fingerprint(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    crc = 0
    for t in [*model.state_dict().values(), *(v for s in optimizer.state.values() for v in s.values())]:
        crc = zlib.crc32(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy(), crc)
    return crc


def timed(fn: Callable[..., object], *args: Any) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def copy_all(into: list[torch.Tensor], tensors: list[torch.Tensor]) -> None:
    for view, tensor in zip(into, tensors, strict=True):
        view.copy_(tensor)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: torch.Tensor) -> None:
    model(batch).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def batch_for(model: nn.Module, optimizer: torch.optim.Optimizer, seconds: float) -> int:
    """The batch size whose train step takes about ``seconds``: doubled until it does, then interpolated."""
    probes: list[tuple[int, float]] = []
    while not probes or (probes[-1][1] < seconds and probes[-1][0] < MAX_BATCH):
        batch = torch.randn(2 * probes[-1][0] if probes else 8, WIDTH)
        probes.append((len(batch), min(timed(train_step, model, optimizer, batch) for _ in range(2))))
    if len(probes) == 1:
        return probes[0][0]
    (small, fast), (large, slow) = probes[-2:]
    return max(1, round(small + (seconds - fast) * (large - small) / max(slow - fast, 1e-9)))


def sealed(step: int, timeout: float = 120.0) -> SlotFile:
    """The slot of ``step`` once the keeper has checksummed (sealed) it: the keeper is idle again."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for path, _, _ in find_segments(os.environ["TORCHELASTIC_RUN_ID"], 0):
            if path not in _slots:
                _slots[path] = SlotFile(path, populate=True)  # mapped once, pre-faulted, like the keeper's
            header = _slots[path].header()
            if header.step == step and header.state == COMMITTED and header.sealed:
                return _slots[path]
        time.sleep(0.002)
    raise TimeoutError(f"the keeper did not seal step {step} within {timeout:.0f} s")


def torch_io(state: dict[str, Any], live: Model, path: str, disk: bool, into: dict[str, list[float]]) -> None:
    """Append the times of torch.save, torch.load(weights_only) and load_state_dict through ``path`` to
    ``into``. On disk the save includes fsync and the file leaves the page cache before it is loaded."""
    try:
        t0 = time.perf_counter()
        torch.save(state, path)
        fd = os.open(path, os.O_RDONLY)
        if disk:
            os.fsync(fd)
        into["save"].append(time.perf_counter() - t0)
        if disk:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # so that the load reads the disk
        os.close(fd)
        t0 = time.perf_counter()
        loaded = torch.load(path, weights_only=True)
        into["load"].append(time.perf_counter() - t0)
        into["apply"].append(timed(lambda: (live[0].load_state_dict(loaded["model"]),
                                            live[1].load_state_dict(loaded["optim"]))))
    finally:
        os.unlink(path)


def generation0(args: argparse.Namespace, results: dict[str, Any]) -> None:
    model, optimizer = live = build(args.size_mib << 20)
    snap = Snapshotter({"model": model, "optim": optimizer}, every=1, rng=False, skip=False)
    snap.restore()
    taken = capture({"model": model, "optim": optimizer}, rng=False)  # the layout the Snapshotter copies
    results.update(bytes=taken.layout.nbytes, layers=len(model), width=WIDTH, threads=torch.get_num_threads())
    results.update({key: [] for key in ("first_saves", "copy", "blocked", "crc", "numpy", "torch")})
    step = 0

    def snapshot() -> tuple[float, SlotFile]:
        """Snapshot the next step, wait for the copy and the keeper's seal; how long save() blocked, the slot."""
        nonlocal step
        step += 1
        blocked = timed(snap.save, step)
        snap.wait()
        return blocked, sealed(step)

    for _ in range(2):  # the first save into each of the two slots: allocation and first mapping included
        snapshot()
        results["first_saves"].append(snap.last_copy_seconds)
    src, dst = np.full(taken.layout.nbytes, 1, np.uint8), np.full(taken.layout.nbytes, 0, np.uint8)  # faulted
    flat = torch.zeros(taken.layout.nbytes, dtype=torch.uint8)
    views = [flat[e.offset:e.offset + e.nbytes].view(getattr(torch, e.dtype)).view(e.shape)
             for e in taken.layout.entries]
    for _ in range(args.reps):  # interleaved, so the machine's noise hits every kind of copy alike
        blocked, slot = snapshot()
        results["blocked"].append(blocked)
        results["copy"].append(snap.last_copy_seconds)
        results["crc"].append(timed(checksum, slot.map, slot.header()))
        results["numpy"].append(timed(np.copyto, dst, src))
        results["torch"].append(timed(copy_all, views, taken.tensors))
    del src, dst, flat, views, taken

    state = {"model": model.state_dict(), "optim": optimizer.state_dict()}
    name = f"ftrun-{os.environ['TORCHELASTIC_RUN_ID']}-torch.pt"  # the benchmark removes it if left behind
    results.update(shm={"save": [], "load": [], "apply": []}, disk={"save": [], "load": [], "apply": []})
    for _ in range(args.reps):  # alternating, like the copies
        torch_io(state, live, os.path.join("/dev/shm", name), False, results["shm"])
        torch_io(state, live, os.path.join(args.disk_dir, name), True, results["disk"])
    del state

    copy = statistics.median(results["copy"])
    threads = torch.get_num_threads()
    results["train"], step = train_blocks(model, optimizer, snap, step, args, copy)
    if threads > 1:  # one core left to the snapshot copy and the keeper, as on a GPU node whose CPU idles
        torch.set_num_threads(threads - 1)
        results["train_spare"], step = train_blocks(model, optimizer, snap, step, args, copy)
        torch.set_num_threads(threads)
    snapshot()
    results.update(restore_step=step, fingerprint=fingerprint(model, optimizer))


def train_blocks(model: nn.Module, optimizer: torch.optim.Optimizer, snap: Snapshotter, step: int,
                 args: argparse.Namespace, copy: float) -> tuple[dict[str, Any], int]:
    """Steps/s of blocks without snapshots and with one after every step, alternating; a step takes about
    :data:`STEP_PER_COPY` times ``copy``. Returns the results and the last step."""
    batch = torch.randn(batch_for(model, optimizer, STEP_PER_COPY * copy), WIDTH)
    results: dict[str, Any] = {"batch": len(batch), "steps": args.steps, "threads": torch.get_num_threads(),
                               "none": [], "every": []}
    for block in range(args.blocks):
        for mode in ("none", "every") if block % 2 == 0 else ("every", "none"):
            t0 = time.perf_counter()
            for _ in range(args.steps):
                train_step(model, optimizer, batch)
                step += 1
                if mode == "every":
                    snap.save(step)
                else:
                    ftrun.heartbeat(step)  # what save() does besides the snapshot
            if mode == "every":  # the last snapshot's copy and the keeper's CRC of it belong to this block
                snap.wait()
                sealed(step)
            results[mode].append(args.steps / (time.perf_counter() - t0))
    return results, step


def generation1(args: argparse.Namespace, results: dict[str, Any]) -> None:
    model, optimizer = build(args.size_mib << 20)
    snap = Snapshotter({"model": model, "optim": optimizer}, every=1, rng=False, skip=False)
    t0 = time.perf_counter()
    step = snap.restore()
    results["restore_first"] = time.perf_counter() - t0
    results["restored_ok"] = step == results["restore_step"] and fingerprint(model, optimizer) == results["fingerprint"]
    slot = sealed(step)
    results.update(restore=[], verify=[])
    for _ in range(args.reps):
        results["restore"].append(timed(snap.restore))
        results["verify"].append(timed(checksum, slot.map, slot.header()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag in ("--size-mib", "--reps", "--blocks", "--steps"):
        parser.add_argument(flag, type=int, required=True)
    parser.add_argument("--disk-dir", required=True)
    parser.add_argument("--out", required=True, help="JSON results file")
    args = parser.parse_args()
    torch.set_flush_denormal(True)  # a deep stack of Linear layers drives activations into denormals
    generation = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    results: dict[str, Any] = json.loads(Path(args.out).read_text()) if generation > 0 else {}
    (generation1 if generation > 0 else generation0)(args, results)
    Path(args.out + ".tmp").write_text(json.dumps(results))
    os.replace(args.out + ".tmp", args.out)
    if generation == 0:
        os.kill(os.getpid(), signal.SIGKILL)  # ftrun restarts this trainer: generation 1 restores


if __name__ == "__main__":
    main()
