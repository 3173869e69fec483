"""ftrun's RAM snapshots and persistence against memcpy and torch.save/torch.load; training throughput with them.

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
- Persistence: then ``--jobs`` jobs without and ``--jobs`` with ``--ckpt-dir`` (a fresh directory in the disk
  directory each) and ``--persist-every 1`` (the keeper persists as often as it can) run :mod:`persist_worker`,
  alternating (off, on, off, on, ...), in the one-core-to-spare setting above (its torch threads and batch;
  every core when there is only one), since a trainer using every core leaves none to background work. Each
  job warms up (slots allocated; with persistence the keeper's spare slot too), then times ``--blocks`` (at
  most 2) blocks of ``--steps`` steps with ``save(step)`` after every one, as above; medians of steps/s over
  the blocks of each kind of job. Persist throughput: bytes / seconds of the ``persisted`` events in the jobs'
  ``events.jsonl`` (seconds: from the keeper taking the request, waiting for the slot's CRC-32 seal if need
  be, through sendfile + fsync of the slot image, to node 0's manifest, rename and removal of older steps).
  After training, each job with persistence takes 3 snapshots with the trainer idle, each waited for until
  complete on disk: the median is over all but the first of each job, whose persist also removes the partial
  steps written during training (shown apart, as are the steps complete on disk during training); beside
  torch.save + fsync of the same state to the same disk (above). The keeper persists in the background at the
  lowest CPU priority (SCHED_IDLE) and in the idle I/O class; torch.save runs in the foreground.

Targets, as ratios with PASS/MISS: copy >= 0.8 x numpy.copyto; restore >= 10 x faster than torch.load from
/dev/shm; training with a snapshot every step >= 0.95 x without, and with persistence on >= 0.95 x off, both
with a core to spare.

Sharded rows, last (:mod:`sharded_worker`, 2 trainers, FSDP2, its docstring says what is timed): the snapshot
copy of each rank's local shards >= 0.8 x numpy.copyto of the same bytes; restore from RAM >= 10 x faster than
``dcp.load`` from /dev/shm; ``dcp.save`` through ``ftrun.dcp.MemoryWriter`` >= 5 x faster than to /dev/shm.

    .venv/bin/python benchmarks/snapshot.py            # 1 GiB of state, about 5 minutes
    .venv/bin/python benchmarks/snapshot.py --quick    # 64 MiB, 1 repetition, 1 job of each: smoke check (about 1 min)
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

from ftrun.events import read_events

HERE = Path(__file__).resolve().parent
WORKER, PERSIST_WORKER = HERE / "snapshot_worker.py", HERE / "persist_worker.py"
SHARDED_WORKER = HERE / "sharded_worker.py"
GB = 1e9
TARGET_COPY, TARGET_RESTORE, TARGET_TRAIN, TARGET_DCP_SAVE = 0.8, 10.0, 0.95, 5.0
JOB_TIMEOUT, PERSIST_JOB_TIMEOUT = 1200, 600
IDLE_PERSISTS = 2  # snapshots each job with persistence takes after training, each waited for on disk
PERSIST_BLOCKS = 2  # training blocks per persistence job at most (starting a job costs more than a block)
Results = dict[str, Any]
Jobs = dict[str, list[Results]]  # persist worker results by "off" and "on"


def filesystem(path: str) -> str:
    """'<type> on <device>' of the file system holding ``path``, as df sees it."""
    df = subprocess.run(["df", "--output=source,fstype", path], capture_output=True, text=True, check=True)
    source, fstype = df.stdout.splitlines()[-1].split()
    return f"{fstype} on {source}"


def run_ftrun(job: str, workdir: str, flags: list[str], worker: list[str], timeout: float, nproc: int = 1) -> None:
    """Run ``worker`` (script and arguments) as the ``nproc`` trainers of a 1-node ftrun job with events in
    ``workdir/logs``, killed after ``timeout`` seconds; SystemExit with the tail of ftrun's output if it fails.
    Removes what it left in /dev/shm."""
    log = os.path.join(workdir, "log")
    command = [sys.executable, "-m", "ftrun", "--nnodes", "1", "--nproc-per-node", str(nproc), "--rdzv-id", job,
               "--log-dir", os.path.join(workdir, "logs"), "--hang-timeout", "600", "--hang-timeout-initial", "600",
               *flags, *worker]
    with open(log, "wb") as f:
        proc = subprocess.Popen(command, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    try:
        code = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        code = proc.wait()
    leftovers = glob.glob(f"/dev/shm/ftrun-{job}-*")
    for path in leftovers:
        os.unlink(path)
    if leftovers:
        print(f"WARNING: left in /dev/shm after the job (removed now): {leftovers}")
    if code != 0:
        tail = "\n".join(Path(log).read_text(errors="replace").splitlines()[-30:])
        raise SystemExit(f"the ftrun job {job} failed (exit code {code}); its output ends with:\n{tail}")


def run_job(args: argparse.Namespace, workdir: str, disk_dir: str) -> Results:
    """Run the snapshot worker under ftrun; its results."""
    out = os.path.join(workdir, "out.json")
    run_ftrun(f"bench-snapshot-{os.getpid()}", workdir, ["--max-restarts", "1"],
              [str(WORKER), "--size-mib", str(args.size_mib), "--reps", str(args.reps), "--blocks", str(args.blocks),
               "--steps", str(args.steps), "--disk-dir", disk_dir, "--out", out], JOB_TIMEOUT)
    return finished(out, "restore")


def sharded(args: argparse.Namespace, workdir: str) -> None:
    """The sharded rows: :mod:`sharded_worker` on 2 trainers (FSDP2), its table and targets."""
    os.makedirs(workdir, exist_ok=True)
    out = os.path.join(workdir, "sharded.jsonl")
    run_ftrun(f"bench-sharded-{os.getpid()}", workdir, ["--max-restarts", "1"],
              [str(SHARDED_WORKER), "--size-mib", str(args.size_mib), "--reps", str(args.reps), "--out", out],
              JOB_TIMEOUT, nproc=2)
    gens = {doc["generation"]: doc for doc in map(json.loads, Path(out).read_text().splitlines())}
    if set(gens) != {0, 1}:
        raise SystemExit(f"the sharded worker did not finish (generations {sorted(gens)})")
    first, second = gens[0], gens[1]
    size = first["local_bytes"]
    print(f"\nFSDP2, 2 ranks, {size / 2**20:.0f} MiB of local shards per rank (params + AdamW), medians of "
          f"{args.reps}")
    rows = [("snapshot copy (Snapshotter)", first["copy"]), ("numpy.copyto of the same bytes", first["memcpy"]),
            ("dcp.save to /dev/shm", first["dcp_save_shm"]), ("dcp.load from /dev/shm", first["dcp_load_shm"]),
            ("restore from RAM (first, agreement included)", second["restore_first"]),
            ("restore from RAM (repeated)", second["restore"])]
    rows += [("dcp.save through ftrun.dcp.MemoryWriter", second["dcp_save_memory"]),
             ("  + the next optimizer step's wait for its copy", second["dcp_save_memory_copy"]),
             ("dcp.save to /dev/shm, beside it", second["dcp_save_shm_beside"])]
    for label, seconds in rows:
        print(f"  {label:<46} {seconds:8.3f} s  {size / seconds / GB:6.2f} GB/s")
    print(f"  restored bit for bit: {second['bitwise']}")
    checks = [("FSDP2 copy / memcpy throughput", first["memcpy"] / first["copy"], TARGET_COPY),
              ("dcp.load from /dev/shm / restore from RAM", first["dcp_load_shm"] / second["restore"],
               TARGET_RESTORE)]
    checks.append(("dcp.save to /dev/shm / through the memory writer",
                   second["dcp_save_shm_beside"] / second["dcp_save_memory"], TARGET_DCP_SAVE))
    for label, ratio, target in checks:
        print(f"  {label:<46} {ratio:8.2f}  target >= {target}: {'PASS' if ratio >= target else 'MISS'}")
    print(f"  {'dcp.load from /dev/shm / memcpy':<46} {first['dcp_load_shm'] / first['memcpy']:8.2f}  the most a "
          "restore that copies the bytes once can reach here")


def finished(out: str, key: str) -> Results:
    """A worker's results from ``out``; SystemExit if it has no ``key`` (the worker did not finish)."""
    results = json.loads(Path(out).read_text()) if os.path.exists(out) else {}
    if key not in results:
        raise SystemExit(f"the worker writing {out} did not finish (results: {sorted(results)})")
    return results


def run_persist_job(args: argparse.Namespace, workdir: str, ckpt: str | None, setting: Results) -> Results:
    """Run the persist worker in a job of its own, persisting to ``ckpt`` (None: not at all); its results, with
    the job's ``persisted`` events."""
    os.mkdir(workdir)
    out = os.path.join(workdir, "out.json")
    persist = ["--ckpt-dir", ckpt] if ckpt else []
    flags = ["--max-restarts", "0", "--persist-every", "1", *persist]  # the jobs differ in --ckpt-dir only
    worker = [str(PERSIST_WORKER), "--size-mib", str(args.size_mib), "--batch", str(setting["batch"]), "--threads",
              str(setting["threads"]), "--blocks", str(min(args.blocks, PERSIST_BLOCKS)), "--steps", str(args.steps),
              "--persists", str(IDLE_PERSISTS), "--out", out, *persist]
    run_ftrun(f"bench-persist-{os.getpid()}-{os.path.basename(workdir)}", workdir, flags, worker, PERSIST_JOB_TIMEOUT)
    results = finished(out, "rate")
    results["persisted"] = [e for e in read_events(os.path.join(workdir, "logs")) if e["event"] == "persisted"]
    if ckpt:
        shutil.rmtree(ckpt)
    return results


def run_persist_jobs(args: argparse.Namespace, workdir: str, disk_dir: str, setting: Results) -> Jobs:
    """``--jobs`` jobs without and with persistence, alternating, in the training ``setting`` (threads, batch)."""
    jobs: Jobs = {"off": [], "on": []}
    for index in range(args.jobs):
        for mode in ("off", "on"):
            name = f"{mode}{index}"
            ckpt = os.path.join(disk_dir, f"ckpt-{name}") if mode == "on" else None
            jobs[mode].append(run_persist_job(args, os.path.join(workdir, name), ckpt, setting))
    return jobs


def report(r: Results, jobs: Jobs, disk: str) -> None:
    size, copy, crc, restore, verify = r["bytes"], med(r["copy"]), med(r["crc"]), med(r["restore"]), med(r["verify"])
    shm, dsk = r["shm"], r["disk"]
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
    persist_rate(jobs["on"], size, med(dsk["save"]))
    targets(r, persist_training(jobs, *compared(r)))


def compared(r: Results) -> tuple[str, Results]:
    """The training setting the targets compare in: one core to spare if there is one, else every core computing."""
    return ("one core to spare", r["train_spare"]) if "train_spare" in r else ("every core computing", r["train"])


def targets(r: Results, on_off: float) -> None:
    copy, restore, load = med(r["copy"]), med(r["restore"]), med(r["shm"]["load"])
    spare, setting = compared(r)
    none, every = med(setting["none"]), med(setting["every"])
    print(f"  {'target':<68}{'ratio':>7}")
    for label, ratio, target in (
            (f"copy >= {TARGET_COPY} x numpy.copyto (time numpy / time ftrun)", med(r["numpy"]) / copy, TARGET_COPY),
            (f"restore >= {TARGET_RESTORE:g} x faster than torch.load from /dev/shm", load / restore, TARGET_RESTORE),
            (f"training, snapshot every step >= {TARGET_TRAIN} x none ({spare})", every / none, TARGET_TRAIN),
            (f"training, persistence on >= {TARGET_TRAIN} x off ({spare})", on_off, TARGET_TRAIN)):
        print(f"  {label:<68}{ratio:7.3f}  {'PASS' if ratio >= target else 'MISS'}")
    print(f"  (restore with the keeper's CRC-32 added: {load / (restore + med(r['verify'])):.1f} x faster than "
          f"torch.load from /dev/shm; training with every core computing: "
          f"{med(r['train']['every']) / med(r['train']['none']):.3f})")


def persist_rate(on: list[Results], size: int, torch_save: float) -> None:
    """Print the keeper's persist throughput (trainer idle, first after training, during training) beside
    torch.save + fsync's."""
    torch_rate = size / torch_save

    def of(key: str) -> list[Results]:
        return [e for job in on for e in job["persisted"] if e["step"] in job[key]]

    idle, first = of("idle"), of("first_idle")
    busy = [e for job in on for e in job["persisted"] if e["step"] <= job["trained"]]
    print("  persistence: the keeper writes each rank's slot image to --ckpt-dir with sendfile + fsync, in the "
          "background,\n  in SCHED_IDLE and the idle I/O class; node 0 then writes the manifest, renames the step "
          "directory and\n  removes old steps (all in the persisted event's seconds); torch.save runs in the "
          "foreground\n")
    print(f"  {'write of the state to disk':<40}{'time':>9}{'bandwidth':>14}")
    print(f"  {'torch.save + fsync (above)':<40}{torch_save:7.3f} s{torch_rate / GB:9.2f} GB/s")
    for label, found in ((f"keeper persist, trainer idle ({len(idle)})", idle),
                         (f"  first after training ({len(first)})", first),
                         (f"  during training ({len(busy)} of {sum(j['trained'] for j in on)} steps)", busy)):
        if not found:
            print(f"  {label:<40}{'-':>9}{'-':>14}")
            continue
        rates = [e["bytes"] / e["seconds"] / GB for e in found]
        print(f"  {label:<40}{med(e['seconds'] for e in found):7.3f} s{med(rates):9.2f} GB/s = "
              f"{med(rates) * GB / torch_rate:.2f} x torch.save;  each {' '.join(f'{v:.2f}' for v in rates)}")
    print(f"  (the first persists after training also removed {sum(len(e['pruned']) for e in first)} older or "
          "partial steps)\n")


def persist_training(jobs: Jobs, spare: str, setting: Results) -> float:
    """Print steps/s with persistence off and on; returns the ratio of the medians (on / off)."""
    per_job = len(jobs["off"][0]["rate"])
    print(f"  training, persistence on (--persist-every 1) vs off, {spare} ({setting['threads']} torch threads), "
          f"batch {setting['batch']}:\n  {len(jobs['off'])} jobs of each, alternating off/on, {per_job} blocks of "
          f"{setting['steps']} steps per job, snapshot every step")
    medians = {}
    for mode, label in (("off", "persistence off"), ("on", "persistence on")):
        blocks = [rate for job in jobs[mode] for rate in job["rate"]]
        medians[mode] = med(blocks)
        warm = " ".join(f"{job['warm_up']} ({job['slots']} slots)" for job in jobs[mode])
        print(f"  {label:<22}{medians[mode]:6.3f} steps/s   blocks "
              f"{' | '.join(' '.join(f'{v:.3f}' for v in job['rate']) for job in jobs[mode])};  warm-up steps {warm}")
    print(f"  ratio measured: {medians['on'] / medians['off']:.3f}\n")
    return medians["on"] / medians["off"]


def training(train: Results, label: str, copy: float, crc: float) -> None:
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
    parser.add_argument("--jobs", type=int, default=2, help="jobs with persistence and jobs without, alternating")
    parser.add_argument("--disk-dir", default=tempfile.gettempdir(),
                        help="where the torch.save file and the --ckpt-dir go (a temporary directory inside it)")
    parser.add_argument("--quick", action="store_true",
                        help="64 MiB, 1 repetition, 1 short block, 1 job of each: a smoke check")
    parser.add_argument("--sharded-only", action="store_true", help="only the FSDP2 rows (sharded_worker.py)")
    args = parser.parse_args()
    if args.quick:
        args.size_mib, args.reps, args.blocks, args.steps, args.jobs = 64, 1, 1, 3, 1
    workdir = tempfile.mkdtemp(prefix="ftrun-bench-snapshot-")
    disk = tempfile.mkdtemp(prefix="ftrun-bench-snapshot-disk-", dir=args.disk_dir)
    try:
        if not args.sharded_only:
            results = run_job(args, workdir, disk)
            jobs = run_persist_jobs(args, workdir, disk, compared(results)[1])
            report(results, jobs, disk)
        sharded(args, os.path.join(workdir, "sharded"))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
