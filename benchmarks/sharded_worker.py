"""Worker of the sharded rows of benchmarks/snapshot.py: one of 2 trainers of ``ftrun --nproc-per-node 2``.

FSDP2 (``fully_shard`` per layer) over ``nn.Linear(1024, 1024)`` layers, AdamW after one step, about
``--size-mib`` of state in all (each rank holds half). Generation 0, medians of ``--reps``, every measurement of
a repetition back to back so noise hits them alike:

- copy: ``Snapshotter.save(step)`` + ``wait()``, its ``last_copy_seconds``, against ``numpy.copyto`` of as many
  bytes as this rank's local shards (the bytes the snapshot holds);
- ``dcp.save`` of DCP's app state (``get_state_dict``) to a ``FileSystemWriter`` directory in /dev/shm, and
  ``dcp.load`` of it back (``set_state_dict``);

Then rank 0 SIGKILLs itself; in generation 1 every rank times ``restore()`` (the agreement included) and a
repeated restore from the same slot (header checks and the copy into the live DTensors), and checks the state
bit for bit. Last (a job uses the Snapshotter or the memory writer: its snapshots come after), ``dcp.save``
through ``ftrun.dcp.MemoryWriter`` beside ``dcp.save`` to /dev/shm, alternating: the time ``dcp.save`` blocks (the
copy of parameters and optimizer state runs on, in the background) and, apart, that time plus what an
optimizer step right after it waits for the copy (the worst case: no forward or backward to overlap). Rank 0 writes
its results to ``--out`` (JSON, one object per generation, appended).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.fsdp import fully_shard

from ftrun.dcp import MemoryWriter
from ftrun.snapshot.client import Snapshotter

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from train_fsdp import AppState  # noqa: E402  DCP's app-state recipe, as the examples use it

WIDTH = 1024


def build(size: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    layers = max(1, round(size / (12 * WIDTH * (WIDTH + 1))))
    model = nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(layers)))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(4, WIDTH)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    return model, optimizer


def local_tensors(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = [v.to_local() for v in model.state_dict().values()]
    out += [v.to_local() if hasattr(v, "to_local") else v for s in optimizer.state.values() for v in s.values()]
    return out


def fingerprint(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    crc = 0
    for t in local_tensors(model, optimizer):
        crc = zlib.crc32(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy(), crc)
    return crc


def timed(fn, *args, **kwargs) -> float:  # type: ignore[no-untyped-def]
    dist.barrier()
    t0 = time.perf_counter()
    fn(*args, **kwargs)
    return time.perf_counter() - t0


def generation_0(args: argparse.Namespace, model: nn.Module, optimizer: torch.optim.Optimizer,
                 snap: Snapshotter) -> dict:
    nbytes = sum(t.numel() * t.element_size() for t in local_tensors(model, optimizer))
    source, target = np.ones(nbytes, dtype=np.uint8), np.zeros(nbytes, dtype=np.uint8)
    rows: dict[str, list[float]] = {"copy": [], "memcpy": [], "dcp_save_shm": [], "dcp_load_shm": []}
    directory = tempfile.mkdtemp(prefix="ftrun-bench-dcp-", dir="/dev/shm") if dist.get_rank() == 0 else ""
    holder = [directory]
    dist.broadcast_object_list(holder)
    directory = holder[0]
    app = {"app": AppState(model, optimizer)}
    try:
        for rep in range(args.reps + 2):  # two saves to map both slots first
            snap.save(rep + 1)
            snap.wait()
            if rep < 2:
                continue
            rows["copy"].append(snap.last_copy_seconds)
            rows["memcpy"].append(timed(np.copyto, target, source))
            rows["dcp_save_shm"].append(timed(dcp.save, app, checkpoint_id=directory))
            rows["dcp_load_shm"].append(timed(dcp.load, app, checkpoint_id=directory))
    finally:
        if dist.get_rank() == 0:
            shutil.rmtree(directory, ignore_errors=True)
    result = {key: statistics.median(values) for key, values in rows.items()}
    result["local_bytes"] = nbytes
    result["fingerprint"] = fingerprint(model, optimizer)
    return result


def generation_1(args: argparse.Namespace, model: nn.Module, optimizer: torch.optim.Optimizer, snap: Snapshotter,
                 expected: int) -> dict:
    t0 = time.perf_counter()
    step = snap.restore()
    first = time.perf_counter() - t0
    same = fingerprint(model, optimizer) == expected
    result = {"restore_first": first, "restore": timed(snap.restore), "step": step, "bitwise": same}
    # last: the memory writer keeps its own snapshot stream, which the Snapshotter above must not restore
    rows: dict[str, list[float]] = {"dcp_save_memory": [], "dcp_save_memory_copy": [], "dcp_save_shm_beside": []}
    directory = tempfile.mkdtemp(prefix="ftrun-bench-dcp-", dir="/dev/shm") if dist.get_rank() == 0 else ""
    holder = [directory]
    dist.broadcast_object_list(holder)
    app = {"app": AppState(model, optimizer)}
    try:
        for rep in range(args.reps + 2):  # two saves to map both slots first
            seconds = timed(dcp.save, app, storage_writer=MemoryWriter(step + 1 + rep))
            t0 = time.perf_counter()
            optimizer.step()  # no gradients: it changes nothing, but waits for the copy as every step does
            waited = time.perf_counter() - t0
            if rep >= 2:
                rows["dcp_save_memory"].append(seconds)
                rows["dcp_save_memory_copy"].append(seconds + waited)
                rows["dcp_save_shm_beside"].append(timed(dcp.save, app, checkpoint_id=holder[0]))
    finally:
        if dist.get_rank() == 0:
            shutil.rmtree(holder[0], ignore_errors=True)
    return {**result, **{key: statistics.median(values) for key, values in rows.items()}}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size-mib", type=int, default=256)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    model, optimizer = build(args.size_mib << 20)
    snap = Snapshotter({"model": model, "optim": optimizer}, every=1, skip=False)  # each snapshot measured
    generation = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    rank = dist.get_rank()
    if generation == 0:
        result = generation_0(args, model, optimizer, snap)
        expected = [result["fingerprint"]]
        if rank == 0:
            with open(args.out, "a") as f:
                f.write(json.dumps({"generation": 0, **result}) + "\n")
        with open(f"{args.out}.rank{rank}", "w") as f:
            json.dump(expected, f)
        dist.barrier()
        if rank == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)  # killed by ftrun when rank 0 dies
    with open(f"{args.out}.rank{rank}") as f:
        expected = json.load(f)[0]
    for p in model.parameters():  # the restore must bring the snapshot's values back
        p.data.to_local().zero_() if hasattr(p.data, "to_local") else p.data.zero_()
    result = generation_1(args, model, optimizer, snap, expected)
    if rank == 0:
        with open(args.out, "a") as f:
            f.write(json.dumps({"generation": 1, **result}) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
