"""RAM snapshots of ftrun against memcpy and torch.save/torch.load: copy, blocking, restore, training throughput.

The Snapshotter only works inside an ftrun job (it talks to the node's keeper), so this script runs
:mod:`snapshot_worker` as the one trainer of ``ftrun --nnodes 1 --nproc-per-node 1`` and prints the JSON the
worker writes. State: ``nn.Linear(1024, 1024)`` layers and AdamW after one step (exp_avg and exp_avg_sq
exist), about ``--size-mib`` in all; the trainer runs with the threads ftrun gives it (cores / trainers).
Times are medians of ``--reps`` repetitions unless said otherwise.

- Copy: ``save(step)``, ``wait()``; the Snapshotter's ``last_copy_seconds`` (keeper reserve to commit
  acknowledged). Each repetition also times ``numpy.copyto`` of as many bytes between two faulted buffers and
  a torch ``copy_`` of every tensor into one flat buffer, so noise hits all three alike. The first save into
  each of the two slots allocates and maps it: shown apart, not in the medians. Blocking: how long ``save()``
  itself takes (capture of the state, start of the copy thread).
- Keeper CRC-32: ``ftrun.snapshot.slot.checksum`` (same function, same threads) of the slot the keeper has just
  sealed: the keeper's work after every commit.
- torch.save, torch.load(weights_only=True) and load_state_dict of the model's and optimizer's state dicts via
  a file in /dev/shm and in ``--disk-dir``, alternating; on disk the save includes fsync and the file's pages
  are dropped from the page cache before the load.
- Restore: the worker SIGKILLs itself after a last snapshot; ftrun restarts it (generation 1), which times its
  first ``restore()`` (it also waits for the job to agree on the step), repeated ones (header checks, copy into
  the live tensors) and, apart, the CRC-32 the keeper verifies before the job agrees on the step; and checks the
  restored state bit for bit.
- Training: steps (forward, backward, AdamW) on a batch sized so a step takes about 4x the copy; blocks of
  ``--steps`` steps alternate between no snapshots and ``save(step)`` after every step (such a block ends when
  its last copy is committed and checksummed by the keeper), ``--blocks`` of each; medians of steps/s. Twice:
  with every core computing (CPU training: the copy and the keeper's CRC can only take cycles from it), and with
  one core left idle (as on a GPU node, whose CPU waits for the GPU during a step).

Targets, as ratios with PASS/MISS: copy >= 0.8 x numpy.copyto; restore >= 10 x faster than torch.load from
/dev/shm; training with a snapshot every step >= 0.95 x without, with a core to spare.

    .venv/bin/python benchmarks/snapshot.py            # 1 GiB of state, about 2 minutes
    .venv/bin/python benchmarks/snapshot.py --quick    # 64 MiB, 1 repetition: a smoke check (about 20 s)
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from statistics import median as med
from typing import Any

WORKER = Path(__file__).resolve().parent / "snapshot_worker.py"
GB = 1e9
TARGET_COPY, TARGET_RESTORE, TARGET_TRAIN = 0.8, 10.0, 0.95
JOB_TIMEOUT = 1200


def filesystem(path: str) -> str:
    """'<type> on <device>' of the file system holding ``path``, as df sees it."""
    df = subprocess.run(["df", "--output=source,fstype", path], capture_output=True, text=True, check=True)
    source, fstype = df.stdout.splitlines()[-1].split()
    return f"{fstype} on {source}"


def run_job(args: argparse.Namespace, workdir: str, disk_dir: str) -> dict[str, Any]:
    """Run the worker under ftrun; its results, or SystemExit with the tail of ftrun's output."""
    job, out, log = f"bench-snapshot-{os.getpid()}", os.path.join(workdir, "out.json"), os.path.join(workdir, "log")
    command = [sys.executable, "-m", "ftrun", "--nnodes", "1", "--nproc-per-node", "1", "--rdzv-id", job,
               "--log-dir", os.path.join(workdir, "logs"), "--max-restarts", "1", "--hang-timeout", "600",
               "--hang-timeout-initial", "600", str(WORKER), "--size-mib", str(args.size_mib), "--reps",
               str(args.reps), "--blocks", str(args.blocks), "--steps", str(args.steps), "--disk-dir", disk_dir,
               "--out", out]
    with open(log, "wb") as f:
        proc = subprocess.Popen(command, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    try:
        code = proc.wait(JOB_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        code = proc.wait()
    leftovers = glob.glob(f"/dev/shm/ftrun-{job}-*")
    for path in leftovers:
        os.unlink(path)
    if leftovers:
        print(f"WARNING: left in /dev/shm after the job (removed now): {leftovers}")
    results = json.loads(Path(out).read_text()) if os.path.exists(out) else {}
    if code != 0 or "restore" not in results:
        tail = "\n".join(Path(log).read_text(errors="replace").splitlines()[-30:])
        raise SystemExit(f"the ftrun job failed (exit code {code}); its output ends with:\n{tail}")
    return results


def report(r: dict[str, Any], disk: str) -> None:
    size, copy, crc, restore, verify = r["bytes"], med(r["copy"]), med(r["crc"]), med(r["restore"]), med(r["verify"])
    shm, dsk, train = r["shm"], r["disk"], r["train"]
    fs = filesystem(disk)
    print(f"state {size / 2**30:.2f} GiB: {r['layers']} x nn.Linear({r['width']}, {r['width']}) + AdamW state, "
          f"{r['threads']} torch threads; medians of {len(r['copy'])}")
    print(f"disk: {disk} ({fs}{', NOT a disk' if fs.startswith('tmpfs') else ''})\n")
    print(f"  {'copy of the state':<36}{'time':>9}{'bandwidth':>14}")
    for label, seconds in (("ftrun copy into a slot (steady)", copy), ("numpy.copyto, same bytes", med(r["numpy"])),
                           ("torch copy_ into one flat buffer", med(r["torch"])), ("keeper's CRC-32 of the slot", crc)):
        print(f"  {label:<36}{seconds:7.3f} s{size / seconds / GB:9.2f} GB/s")
    first = " / ".join(f"{s:.3f} s" for s in r["first_saves"])
    print(f"  first save into slot 0 / slot 1: {first} (allocation included, not in the medians)\n")

    def row(label: str, ours: str, in_shm: str, on_disk: str) -> None:
        print(f"  {label:<20}{ours:>26}{in_shm:>22}{on_disk:>26}")

    def gbs(seconds: float) -> str:
        return f"{size / seconds / GB:.2f} GB/s"

    row("", "ftrun RAM snapshot", "torch, /dev/shm", "torch, disk")
    row("write: loop blocked", f"{med(r['blocked']) * 1e3:.1f} ms (save())", f"{med(shm['save']):.3f} s (save)",
        f"{med(dsk['save']):.3f} s (save+fsync)")
    row("write: complete", f"{copy:.3f} s (copy)", "= blocked", "= blocked")
    row("read", f"{restore:.3f} s (restore())", f"{med(shm['load']):.3f} s (load)",
        f"{med(dsk['load']):.3f} s (load, cold)")
    row("  + keeper's CRC-32", f"{verify:.3f} s (before agreement)", "-", "-")
    row("  into live state", "included", f"+{med(shm['apply']):.3f} s", f"+{med(dsk['apply']):.3f} s")
    row("read bandwidth", gbs(restore), gbs(med(shm["load"])), gbs(med(dsk["load"])))
    print(f"  first restore() of generation 1 (waits for the agreed step, maps the slot): {r['restore_first']:.3f} s;"
          f" restored state {'bit-exact' if r['restored_ok'] else 'DIFFERS'}\n")

    for key, label in (("train", "every core computing"), ("train_spare", "one core to spare")):
        if key in r:
            training(r[key], label, copy, crc)

    spare = "one core to spare" if "train_spare" in r else "every core computing"
    none, every = med(r.get("train_spare", train)["none"]), med(r.get("train_spare", train)["every"])
    print(f"  {'target':<58}{'ratio':>7}")
    for label, ratio, target in (
            (f"copy >= {TARGET_COPY} x numpy.copyto (time numpy / time ftrun)", med(r["numpy"]) / copy, TARGET_COPY),
            (f"restore >= {TARGET_RESTORE:g} x faster than torch.load from /dev/shm", med(shm["load"]) / restore,
             TARGET_RESTORE),
            (f"training, snapshot every step >= {TARGET_TRAIN} x none ({spare})", every / none, TARGET_TRAIN)):
        print(f"  {label:<58}{ratio:7.3f}  {'PASS' if ratio >= target else 'MISS'}")
    print(f"  (restore with the keeper's CRC-32 added: {med(shm['load']) / (restore + verify):.1f} x faster than "
          f"torch.load from /dev/shm; training with every core computing: {med(train['every']) / med(train['none']):.3f})")


def training(train: dict[str, Any], label: str, copy: float, crc: float) -> None:
    none, every = med(train["none"]), med(train["every"])
    step = 1 / none
    print(f"  training, {label} ({train['threads']} torch threads), batch {train['batch']}: {step:.3f} s/step = "
          f"{step / copy:.1f} x the copy; {len(train['none'])} blocks of {train['steps']} steps per mode")
    for name, key in (("no snapshots", "none"), ("snapshot every step", "every")):
        print(f"  {name:<22}{med(train[key]):6.3f} steps/s   blocks {' '.join(f'{v:.3f}' for v in train[key])}")
    print(f"  with no overlap at all: step / (step + copy + CRC) = {step / (step + copy + crc):.3f}; ratio "
          f"measured: {every / none:.3f}\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=1024, help="model + AdamW state size (MiB)")
    parser.add_argument("--reps", type=int, default=5, help="repetitions of each timing")
    parser.add_argument("--blocks", type=int, default=3, help="training blocks per mode")
    parser.add_argument("--steps", type=int, default=6, help="training steps per block")
    parser.add_argument("--disk-dir", default=tempfile.gettempdir(),
                        help="where the torch.save file on disk goes (a temporary directory inside it)")
    parser.add_argument("--quick", action="store_true", help="64 MiB, 1 repetition, 1 short block: a smoke check")
    args = parser.parse_args()
    if args.quick:
        args.size_mib, args.reps, args.blocks, args.steps = 64, 1, 1, 3
    workdir = tempfile.mkdtemp(prefix="ftrun-bench-snapshot-")
    disk = tempfile.mkdtemp(prefix="ftrun-bench-snapshot-disk-", dir=args.disk_dir)
    try:
        results = run_job(args, workdir, disk)
        report(results, disk)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
