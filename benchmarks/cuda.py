"""ftrun with CUDA state, on a machine with one GPU: the checks CI cannot run (it has no GPU).

1. Bitwise recovery, GPU: ``examples/train_gpt.py`` (DDP, NCCL, deterministic cuBLAS) as the one trainer of a
   1-node job, without failures and with an injected crash and an injected hang: the two final state hashes
   must be equal. The trainers are forked by the zygote, which must never have initialised CUDA.
2. Bitwise recovery from parity, GPU: the same script on 3 simulated nodes x 1 trainer sharing the GPU
   (gloo over CUDA tensors, k=2 m=1), without failures and with node 1 lost: equal hashes again.
3. The Snapshotter over CUDA tensors (the worker, ``--worker``, one trainer): ``nn.Linear`` layers and AdamW,
   about ``--size-mib`` in all. Medians of 5: ``save()`` (blocking part) and ``save()`` + ``wait()`` beside a
   copy of the same tensors into a pageable and into a pinned host buffer; the time to page-lock a shared-memory
   mapping of as many bytes; training steps/s without snapshots, with one every 10 steps and with one every
   step (2 blocks of 40 steps each); then the trainer kills itself, and its restart times its ``restore()`` and
   3 more into the live CUDA tensors and checks them bit for bit.
4. Training with parity on the GPU: 3 simulated nodes x 1 trainer sharing the GPU (a barrier at the start, no
   collectives after it), each with ``--ec-size-mib`` of CUDA parameters and AdamW state and a snapshot every 10
   steps, with parity (k=2 m=1) and without (``--ec-parity 0``), alternating, twice each: steps/s of the slowest
   rank in the steady state (from its :data:`UNTIMED_SNAPSHOTS`-th snapshot, past the job's first parity, which
   allocates the parity files, to step ``--train-steps``), the largest share of a rank's timed steps spent in
   ``save()`` + ``wait()``, how many snapshots each rank skipped (its newest one not yet secured) and how many
   steps were protected. (Steps take about 7 ms on an H100: 200 steps timed from the first snapshot, as before,
   were 1.4 s, a fifth of it the first parity.)
   The issue's target for parity: >= 0.97 x without.

    python benchmarks/cuda.py                  # about 4 minutes on an H100
    python benchmarks/cuda.py --sections 34    # only the figures
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
GPT = HERE.parent / "examples" / "train_gpt.py"
WIDTH = 4096
JOB_TIMEOUT = 300
EC_EVERY = 10  # section 4: steps between two snapshots
UNTIMED_SNAPSHOTS = 5  # section 4: the first snapshots of a job, which wait for its first parity
TIMED_FROM = UNTIMED_SNAPSHOTS * EC_EVERY  # section 4: the step its timing starts at


def ftrun(workdir: Path, name: str, flags: list[str], script: list[str]) -> tuple[int, float, list[dict]]:
    """Run one job; its exit code, wall seconds and events."""
    logs = workdir / name
    command = [sys.executable, "-m", "ftrun", "--rdzv-id", f"cuda-{name}-{os.getpid()}", "--log-dir", str(logs),
               *flags, *script]
    t0 = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True, timeout=JOB_TIMEOUT)
    seconds = time.perf_counter() - t0
    if proc.returncode:
        print(f"--- {name} exited {proc.returncode}; its output ends with:\n{(proc.stdout + proc.stderr)[-4000:]}")
    events = []
    if (logs / "events.jsonl").exists():
        events = [json.loads(line) for line in (logs / "events.jsonl").read_text().splitlines() if line.strip()]
    return proc.returncode, seconds, events


def recovery(events: list[dict]) -> str:
    """One line per restore and recovery of a job."""
    lines = [f"{e['event']}: {e['message']}" for e in events
             if e["event"] in ("failure", "node_lost", "restore", "recovered", "rebuilt", "restore_source_failed")]
    return "\n    ".join(dict.fromkeys(lines))


def bitwise(workdir: Path, name: str, flags: list[str], faults: list[str], extra: list[str]) -> bool:
    hashes = []
    for run, injected in (("clean", []), ("faulty", faults)):
        out = workdir / f"{name}-{run}.hash"
        inject = [arg for fault in injected for arg in ("--inject", fault)]
        code, seconds, events = ftrun(workdir, f"{name}-{run}", [*flags, *inject],
                                      [str(GPT), "--steps", "60", "--snapshot-every", "10", "--out", str(out), *extra])
        hashes.append(out.read_text().strip() if out.exists() and code == 0 else f"(exit {code})")
        print(f"  {name} {run}: exit {code}, {seconds:.1f} s, hash {hashes[-1][:16]}")
        if injected:
            print(f"    {recovery(events)}")
    same = hashes[0] == hashes[1] and not hashes[0].startswith("(")
    print(f"  {name}: {'PASS' if same else 'FAIL'} (final states {'equal' if same else 'differ'})")
    return same


# -- the worker (one trainer of a 1-node job) ---------------------------------------------------------------
def build(size_mib: int) -> tuple[Any, Any]:
    import torch
    from torch import nn
    torch.manual_seed(0)
    layers = max(1, round(size_mib * 2**20 / (12 * WIDTH * (WIDTH + 1))))  # params + exp_avg + exp_avg_sq
    model = nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(layers))).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    return model, optimizer


def tensors(model: Any, optimizer: Any) -> list[Any]:
    return [*model.state_dict().values(), *(v for s in optimizer.state.values() for v in s.values() if v.dim())]


def digest(model: Any, optimizer: Any) -> str:
    h = hashlib.sha256()
    for t in tensors(model, optimizer):
        h.update(t.detach().cpu().reshape(-1).numpy().tobytes())
    return h.hexdigest()


def register_seconds(nbytes: int) -> dict[str, float]:
    """Seconds to page-lock (cudaHostRegister) and unlock a mapping of a shared-memory file of ``nbytes``."""
    import mmap

    import torch
    cudart = torch.cuda.cudart()
    path = f"/dev/shm/ftrun-cuda-bench-{os.getpid()}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.posix_fallocate(fd, 0, nbytes)
        mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        address = torch.frombuffer(mapping, dtype=torch.uint8, count=1).data_ptr()
        t0 = time.perf_counter()
        ok = cudart.cudaHostRegister(address, nbytes, 1) == cudart.cudaError.success
        t1 = time.perf_counter()
        cudart.cudaHostUnregister(address)
        t2 = time.perf_counter()
        mapping.close()
        return {"register_s": t1 - t0 if ok else -1.0, "unregister_s": t2 - t1}
    finally:
        os.close(fd)
        os.unlink(path)


def train_step(model: Any, optimizer: Any, batch: Any) -> None:
    optimizer.zero_grad(set_to_none=True)
    model(batch).square().mean().backward()
    optimizer.step()


def trainer(size_mib: int, rows: int, every: int, skip: bool) -> tuple[Any, Any, Any, Any]:
    """The model, optimizer, a batch of ``rows`` and a Snapshotter over them (``skip``: see
    :class:`ftrun.Snapshotter`), on GPU 0."""
    import torch

    import ftrun as ft
    torch.cuda.set_device(0)
    model, optimizer = build(size_mib)
    batch = torch.randn(rows, WIDTH, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    return model, optimizer, batch, ft.Snapshotter({"model": model, "optim": optimizer}, every=every, skip=skip)


def worker(args: argparse.Namespace) -> None:
    import torch

    out = Path(args.out)
    model, optimizer, batch, snap = trainer(args.size_mib, args.batch, every=1, skip=False)  # each one measured
    t0 = time.perf_counter()
    start = snap.restore()
    if start:  # generation 1: restored into a fresh model and an optimizer without state yet
        torch.cuda.synchronize()
        results = json.loads(out.read_text())
        results["first_restore_s"] = time.perf_counter() - t0
        results["bitwise"] = start == results["final_step"] and digest(model, optimizer) == results["digest"]
        times = []
        for _ in range(3):  # again, into the live tensors
            t0 = time.perf_counter()
            snap.restore()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        results["restore_s"] = statistics.median(times)
        results["bitwise"] &= digest(model, optimizer) == results["digest"]
        out.write_text(json.dumps(results))
        return
    train_step(model, optimizer, batch)
    torch.cuda.synchronize()
    nbytes = sum(t.numel() * t.element_size() for t in tensors(model, optimizer))
    pageable = torch.zeros(nbytes, dtype=torch.uint8)
    pinned = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=True)

    def host_copy(dst: Any) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        offset = 0
        for t in tensors(model, optimizer):
            n = t.numel() * t.element_size()
            dst[offset:offset + n].copy_(t.detach().reshape(-1).view(torch.uint8))
            offset += n
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    rows: dict[str, list[float]] = {"pageable_s": [], "pinned_s": [], "save_block_s": [], "save_wait_s": [],
                                    "copy_s": []}
    n = 1
    for rep in range(7):  # the first save into each of the two slots allocates it: not counted
        row = {"pageable_s": host_copy(pageable), "pinned_s": host_copy(pinned)}
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        snap.save(n)
        row["save_block_s"] = time.perf_counter() - t0
        snap.wait()
        row["save_wait_s"], row["copy_s"] = time.perf_counter() - t0, snap.last_copy_seconds
        n += 1
        if rep >= 2:
            for key, value in row.items():
                rows[key].append(value)
    results: dict[str, Any] = {"bytes": nbytes, **{k: statistics.median(v) for k, v in rows.items()},
                               **register_seconds(nbytes)}

    def block(every: int, steps: int = 40) -> float:
        nonlocal n
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(steps):
            train_step(model, optimizer, batch)
            if every and (i + 1) % every == 0:
                snap.save(n)
                n += 1
        snap.wait()
        torch.cuda.synchronize()
        return steps / (time.perf_counter() - t0)

    block(0, 5)
    for key, every in (("off", 0), ("every10", 10), ("every1", 1)) * 2:
        results.setdefault(f"steps_per_s_{key}", []).append(block(every))
    snap.save(n)
    snap.wait()
    results["digest"], results["final_step"] = digest(model, optimizer), n
    out.write_text(json.dumps(results))
    os.kill(os.getpid(), signal.SIGKILL)


def train_worker(args: argparse.Namespace) -> None:
    """Section 4: one trainer; its steps/s from the end of its first snapshot's step to its last step. The
    trainers start together (a barrier; no collectives after it)."""
    import torch
    import torch.distributed as dist

    model, optimizer, batch, snap = trainer(args.ec_size_mib, args.batch, every=EC_EVERY, skip=True)
    dist.init_process_group("gloo")
    dist.barrier()
    t0 = None
    in_snapshotter = 0.0  # seconds of the timed steps spent in save() and wait()
    for step in range(snap.restore(), args.train_steps):
        train_step(model, optimizer, batch)
        t = time.perf_counter()
        snap.save(step + 1)
        if step + 1 == TIMED_FROM:
            snap.wait()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
        elif t0 is not None:
            in_snapshotter += time.perf_counter() - t
    t = time.perf_counter()
    snap.wait()
    torch.cuda.synchronize()
    assert t0 is not None
    end = time.perf_counter()
    in_snapshotter += end - t
    Path(args.out, f"rank{os.environ['RANK']}.json").write_text(json.dumps({
        "steps_per_second": (args.train_steps - TIMED_FROM) / (end - t0), "skipped": snap.skipped,
        "snapshotter_share": in_snapshotter / (end - t0)}))
    dist.destroy_process_group()


def training_with_parity(args: argparse.Namespace, workdir: Path) -> bool:
    """Section 4: steps/s with parity over without (slowest rank of each job), alternating."""
    rates: dict[int, list[float]] = {1: [], 0: []}
    secured: dict[int, list[str]] = {1: [], 0: []}  # per job: snapshots skipped by the ranks; steps protected
    shares: dict[int, list[float]] = {1: [], 0: []}  # per job: the largest share of a rank in save() + wait()
    for rep in range(2):
        for parity in (1, 0):
            out = workdir / f"train-{parity}-{rep}"
            out.mkdir()
            code, _, events = ftrun(workdir, f"train-{parity}-{rep}", ["--nnodes", "3", "--nproc-per-node", "1",
                                                                  "--ec-parity", str(parity)],
                               [str(Path(__file__).resolve()), "--train-worker", "--out", str(out), "--ec-size-mib",
                                str(args.ec_size_mib), "--batch", str(args.ec_batch), "--train-steps",
                                str(args.train_steps)])
            ranks = [json.loads(f.read_text()) for f in sorted(out.glob("rank*.json"))]
            if code or len(ranks) != 3:
                print(f"  training job (parity {parity}): FAIL (exit {code}, {len(ranks)} ranks reported)")
                return False
            rates[parity].append(min(rank["steps_per_second"] for rank in ranks))
            shares[parity].append(max(rank["snapshotter_share"] for rank in ranks))
            protected = len({e["step"] for e in events if e["event"] == "protected"})
            secured[parity].append(f"{'/'.join(str(rank['skipped']) for rank in ranks)} skipped"
                                   + (f", {protected} protected" if parity else ""))
    on, off = statistics.median(rates[1]), statistics.median(rates[0])
    runs = " / ".join(" ".join(f"{rate:.2f}" for rate in rates[parity]) for parity in (1, 0))
    print(f"  {on:.2f} steps/s with parity, {off:.2f} without ({runs}): {on / off:.3f}, "
          f"target >= 0.97: {'PASS' if on / off >= 0.97 else 'MISS'}")
    print(f"  % of the timed steps in save() + wait(), the rank most in them: "
          f"{' '.join(f'{100 * share:.1f}' for share in shares[1])} with parity, "
          f"{' '.join(f'{100 * share:.1f}' for share in shares[0])} without")
    print(f"  of {args.train_steps // EC_EVERY} snapshot steps per job, with parity: {'; '.join(secured[1])}; "
          f"without: {'; '.join(secured[0])}")
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--size-mib", type=int, default=1024, help="state of the worker (default 1024)")
    parser.add_argument("--batch", type=int, default=4096, help="rows per training step of the worker")
    parser.add_argument("--sections", default="1234", help="which of the sections to run, in order (default 1234)")
    parser.add_argument("--ec-size-mib", type=int, default=256, help="state per trainer in 4. (default 256)")
    parser.add_argument("--ec-batch", type=int, default=1024, help="rows per training step in 4.")
    parser.add_argument("--train-steps", type=int, default=1500,
                        help="steps of each job in 4. (default 1500: about 10 s timed on an H100)")
    parser.add_argument("--train-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--log-dir", help="keep every job's --log-dir (events.jsonl) under this directory")
    args = parser.parse_args()
    if args.train_steps <= TIMED_FROM:
        parser.error(f"--train-steps must be more than {TIMED_FROM} (the untimed snapshots' steps)")
    if args.log_dir and Path(args.log_dir).is_dir() and any(Path(args.log_dir).iterdir()):
        parser.error(f"--log-dir {args.log_dir} is not empty: name a new directory")
    if args.worker:
        worker(args)
        return 0
    if args.train_worker:
        train_worker(args)
        return 0
    import torch
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/cuda.py needs a CUDA GPU")
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}", flush=True)
    ok = True
    with tempfile.TemporaryDirectory(prefix="ftrun-cuda-") as tmp:
        workdir = Path(args.log_dir or tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        if "1" in args.sections:
            print("1. one trainer on the GPU (NCCL): crash at step 25, hang at step 45", flush=True)
            ok &= bitwise(workdir, "gpu", ["--nnodes", "1", "--nproc-per-node", "1", "--hang-timeout", "3"],
                          ["crash@rank=0,step=25", "hang@rank=0,step=45,gen=1"], [])
        if "2" in args.sections:
            print("2. 3 nodes x 1 trainer on one GPU (gloo), k=2 m=1: node 1 lost at step 25", flush=True)
            ok &= bitwise(workdir, "ec", ["--nnodes", "3", "--nproc-per-node", "1", "--node-timeout", "3"],
                          ["node-loss@node=1,step=25"], ["--backend", "gloo"])
        if "3" in args.sections:
            print(f"3. Snapshotter over {args.size_mib} MiB of CUDA state (medians of 5)", flush=True)
            out = workdir / "worker.json"
            code, seconds, events = ftrun(workdir, "worker", ["--nnodes", "1", "--nproc-per-node", "1",
                                                              "--max-restarts", "1"],
                                          [str(Path(__file__).resolve()), "--worker", "--out", str(out),
                                           "--size-mib", str(args.size_mib), "--batch", str(args.batch)])
            r = json.loads(out.read_text()) if out.exists() else {}
            print(json.dumps(r, indent=1))
            if code or not r.get("bitwise"):
                ok = False
                print("  worker: FAIL")
            else:
                gb = r["bytes"] / 1e9
                print(f"  {gb:.2f} GB: pageable copy {gb / r['pageable_s']:.2f} GB/s, "
                      f"pinned {gb / r['pinned_s']:.2f} GB/s, save()+wait() {gb / r['save_wait_s']:.2f} GB/s "
                      f"(save() blocks {r['save_block_s'] * 1e3:.1f} ms)")
                off = statistics.median(r["steps_per_s_off"])
                for key in ("every10", "every1"):
                    ratio = statistics.median(r["steps_per_s_" + key]) / off
                    print(f"  training with a snapshot {key}: {ratio:.3f} x off ({off:.2f} steps/s off)")
                print(f"  page-locking a shared-memory mapping of as many bytes: {r['register_s']:.3f} s, "
                      f"unlocking it {r['unregister_s']:.3f} s")
                print(f"  restore at the restart {r['first_restore_s']:.3f} s; again into the live CUDA tensors "
                      f"{r['restore_s']:.3f} s ({gb / r['restore_s']:.2f} GB/s); bit-exact: {r['bitwise']}")
                print(f"    {recovery(events)}")
        if "4" in args.sections:
            print(f"4. training with parity (k=2 m=1) over without: 3 nodes x 1 trainer sharing the GPU, "
                  f"{args.ec_size_mib} MiB each, a snapshot every 10 steps", flush=True)
            ok &= training_with_parity(args, workdir)
    print("ALL PASS" if ok else "SOME FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
