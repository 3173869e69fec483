"""What ftrun costs when nothing fails: ftrun against torchrun on the same script, runs alternating.

Cases (:mod:`overhead_worker`, gloo on 127.0.0.1, CPU):

- ``empty 1x2``: a script that returns at once (no import at all): what the launcher alone costs, from its start
  to its exit.
- ``trivial 1x2`` / ``trivial 2x1``: init_process_group, one all_reduce, destroy; 1 node x 2 trainers, and 2
  nodes x 1 trainer (two launchers on this host, node 0 hosting the store: torchrun's static rendezvous with
  --master-addr/--master-port, ftrun's --rdzv-endpoint). Wall time from starting the launcher(s) until the
  last one exited.
- ``train 1x2`` / ``train 1x4``: a small DDP MLP with AdamW; time from start to every rank's first optimizer
  step, and steady-state steps per second (after a warm-up).
- ``snapshot 1x2``: the same training under ftrun with a Snapshotter saving every 10 steps, against torchrun
  running it without snapshots (steady throughput ratio).
- ``ckpt 1x2``: the snapshot case with ``--ckpt-dir``: the exit then includes the final persist.

Both launchers get the same command line (``--nproc-per-node``, ``--master-addr``/``--master-port``,
``--nnodes``/``--node-rank``), ftrun also ``--log-dir`` for its event log. For each run: wall, first step
(slowest rank), exit (the last launcher's exit minus the end of the last trainer's script: the trainers'
interpreter teardown, about 0.6 s with torch here, is in it for both), ftrun's own exit (after its supervisors
reaped the last trainer, from its events), steady steps/s (mean over ranks), and the CPU seconds (user + sys) of
the whole process tree of the launcher(s), trainers included: this process is a child subreaper and reaps every
descendant, so the rusage of its children counts them all (a test suite of a few hundred jobs on a few cores is
bound by it). The table gives medians and ftrun /
torchrun ratios with the issue's targets. In the training cases also the launcher's own CPU in the steady state
(every process of the launchers' sessions but the trainers, in % of one core, over :data:`OWN_WINDOW` seconds
from the warm-up's end): torchrun's agent against ftrun's launcher, supervisors, zygotes and keepers.

    .venv/bin/python benchmarks/overhead.py --pairs 5
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

WORKER = Path(__file__).resolve().parent / "overhead_worker.py"
BIN_DIR = Path(sys.executable).parent
TIMEOUT = 300.0
OWN_WINDOW = 4.0  # seconds of steady training over which the launcher's own CPU is measured
PR_SET_CHILD_SUBREAPER = 36


@dataclass(frozen=True)
class Case:
    name: str
    nnodes: int
    nproc: int
    mode: str  # worker mode: trivial | train, or empty (a script of its own that returns at once)
    worker_args: tuple[str, ...] = ()
    ftrun_worker_args: tuple[str, ...] = ()  # added for ftrun only (the Snapshotter)
    ftrun_flags: tuple[str, ...] = ()
    launchers: tuple[str, ...] = ("torchrun", "ftrun")


@dataclass
class Sample:
    wall: float
    first_step: float
    exit: float  # the last launcher's exit after the last trainer's script returned (its interpreter teardown too)
    steady: float | None
    own_exit: float | None = None  # ftrun: its exit after its supervisors reaped the last trainer (node_done)
    own_cpu: float | None = None  # % of one core the launcher's own processes used in the steady state
    cpu: float | None = None  # CPU seconds (user + sys) of the whole process tree, trainers included


@dataclass
class Result:
    samples: dict[str, list[Sample]] = field(default_factory=lambda: {"torchrun": [], "ftrun": []})
    failed: dict[str, int] = field(default_factory=lambda: {"torchrun": 0, "ftrun": 0})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def commands(case: Case, launcher: str, out: str, ckpt: str) -> list[list[str]]:
    worker = [str(WORKER), case.mode, "--out", out, *case.worker_args]
    if case.mode == "empty":
        worker = [os.path.join(out, "empty.py")]
        Path(worker[0]).write_text('"""Returns at once."""\n')
    port = str(free_port())
    if launcher == "torchrun":
        base = [str(BIN_DIR / "torchrun"), "--nproc-per-node", str(case.nproc), "--master-addr", "127.0.0.1",
                "--master-port", port]
        if case.nnodes == 1:
            return [base + worker]
        return [base + ["--nnodes", str(case.nnodes), "--node-rank", str(n)] + worker for n in range(case.nnodes)]
    # the same command line with one word changed (and ftrun's own flags: its event log, the case's)
    worker += list(case.ftrun_worker_args)
    flags = [f.replace("{ckpt}", ckpt) for f in case.ftrun_flags]
    base = [str(BIN_DIR / "ftrun"), "--nproc-per-node", str(case.nproc), "--master-addr", "127.0.0.1",
            "--master-port", port, "--log-dir", os.path.join(out, "logs"), *flags]
    if case.nnodes == 1:
        return [base + worker]
    return [base + ["--nnodes", str(case.nnodes), "--node-rank", str(n)] + worker for n in range(case.nnodes)]


def run_once(case: Case, launcher: str) -> Sample | None:
    out = tempfile.mkdtemp(prefix="ftrun-overhead-")
    ckpt = os.path.join(out, "ckpt")
    env = dict(os.environ, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    try:
        t0 = time.time()
        procs = [subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env,
                                  start_new_session=True) for cmd in commands(case, launcher, out, ckpt)]
        own: list[float] = []
        if case.mode == "train":
            threading.Thread(target=measure_own_cpu, args=(procs, out, own), daemon=True).start()
        ends = []
        for proc in procs:
            try:
                _, err = proc.communicate(timeout=TIMEOUT)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.communicate()
                print(f"  {launcher}: timed out", file=sys.stderr)
                return None
            ends.append(time.time())
            if proc.returncode != 0:
                print(f"  {launcher}: exit {proc.returncode}: {err.decode()[-2000:]}", file=sys.stderr)
                return None
        reap_descendants()
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
        if case.mode == "empty":
            return Sample(wall=max(ends) - t0, first_step=float("nan"), exit=float("nan"), steady=None, cpu=cpu)
        ranks = [json.loads(Path(out, name).read_text()) for name in sorted(os.listdir(out))
                 if name.startswith("rank")]
        if len(ranks) != case.nnodes * case.nproc:
            print(f"  {launcher}: {len(ranks)} rank results", file=sys.stderr)
            return None
        steady = [r["steady"] for r in ranks if "steady" in r]
        events = Path(out, "logs", "events.jsonl")
        done = [json.loads(line)["time"] for line in (events.read_text().splitlines() if events.exists() else [])
                if '"node_done"' in line]
        return Sample(wall=max(ends) - t0, first_step=max(r["first_step"] for r in ranks) - t0,
                      exit=max(ends) - max(r["end"] for r in ranks),
                      steady=statistics.mean(steady) if steady else None,
                      own_exit=max(ends) - max(done) if done else None, own_cpu=own[0] if own else None,
                      cpu=cpu)
    finally:
        reap_descendants()  # also after a failed run: nothing of it is counted in the next
        shutil.rmtree(out, ignore_errors=True)


def reap_descendants(timeout: float = 30.0) -> None:
    """Reap every process the launchers left to this child subreaper, waiting up to ``timeout`` for those still
    running: their CPU then counts in ``RUSAGE_CHILDREN``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                time.sleep(0.02)
        except ChildProcessError:
            return


def measure_own_cpu(procs: list[subprocess.Popen[bytes]], out: str, result: list[float]) -> None:
    """Append the % of one core that every process of the launchers' sessions but the trainers (their pids are in
    ``out``) used over :data:`OWN_WINDOW` seconds from the warm-up's end; nothing if the job ended first."""
    marker = Path(out, "steady")
    while not marker.exists():
        if all(proc.poll() is not None for proc in procs):
            return
        time.sleep(0.05)
    trainers = {int(Path(out, name).read_text()) for name in os.listdir(out) if name.startswith("pid")}

    def own_seconds() -> float:
        total = 0.0
        for proc in procs:
            try:
                root = psutil.Process(proc.pid)
                for p in [root, *root.children(recursive=True)]:
                    if p.pid not in trainers:
                        times = p.cpu_times()
                        total += times.user + times.system
            except psutil.Error:
                pass
        return total

    before, t0 = own_seconds(), time.monotonic()
    time.sleep(OWN_WINDOW)
    after, elapsed = own_seconds(), time.monotonic() - t0
    if any(proc.poll() is not None for proc in procs):
        return  # the job ended inside the window: its exit is not the steady state
    result.append(100 * (after - before) / elapsed)


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def report(case: Case, result: Result) -> list[str]:
    rows = []
    med = {name: {key: median([getattr(s, key) for s in samples if getattr(s, key) is not None])
                  for key in ("wall", "first_step", "exit", "steady", "own_exit", "own_cpu", "cpu")}
           for name, samples in result.samples.items()}
    t, f = med["torchrun"], med["ftrun"]
    runs = f"{len(result.samples['ftrun'])}/{len(result.samples['torchrun'])}"
    rows.append(f"| {case.name} | {runs} | {t['wall']:.2f} | {f['wall']:.2f} | {f['wall'] / t['wall']:.2f} | "
                f"{t['first_step']:.2f} | {f['first_step']:.2f} | {f['first_step'] / t['first_step']:.2f} | "
                f"{t['exit']:.2f} | {f['exit']:.2f} | {f['own_exit']:.2f} | "
                f"{t['cpu']:.2f} | {f['cpu']:.2f} | {f['cpu'] / t['cpu']:.2f} | "
                + (f"{t['steady']:.0f} | {f['steady']:.0f} | {f['steady'] / t['steady']:.3f} | "
                   f"{t['own_cpu']:.1f} | {f['own_cpu']:.1f} |" if case.mode == "train" else "- | - | - | - | - |"))
    return rows


CASES = {
    "empty-1x2": Case("empty 1x2", 1, 2, "empty"),
    "trivial-1x2": Case("trivial 1x2", 1, 2, "trivial"),
    "trivial-2x1": Case("trivial 2x1", 2, 1, "trivial"),
    # steady state from step 700 (about 9 s in): after the one-time start costs of both launchers
    "train-1x2": Case("train 1x2", 1, 2, "train", ("--steps", "1400", "--warmup", "700")),
    "train-1x4": Case("train 1x4", 1, 4, "train", ("--steps", "200")),
    "snapshot-1x2": Case("snapshot/10 1x2", 1, 2, "train", ("--steps", "1400", "--warmup", "700"),
                         ("--snapshot-every", "10")),
    "ckpt-1x2": Case("ckpt 1x2", 1, 2, "train", ("--steps", "1400", "--warmup", "700"), ("--snapshot-every", "10"),
                     ("--ckpt-dir", "{ckpt}", "--persist-every", "5")),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated: {', '.join(CASES)}")
    args = parser.parse_args()
    unknown = [key for key in args.cases.split(",") if key not in CASES]
    if unknown:
        parser.error(f"unknown case(s) {', '.join(unknown)}: choose from {', '.join(CASES)}")
    header = ["| case | runs f/t | wall torchrun | wall ftrun | ratio | 1st step torchrun | 1st step ftrun | ratio | "
              "exit torchrun | exit ftrun | ftrun exit after trainers | CPU s torchrun | CPU s ftrun | ratio | "
              "steps/s torchrun | steps/s ftrun | ratio | own CPU % torchrun | own CPU % ftrun |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)  # see reap_descendants
    lines = []
    for key in args.cases.split(","):
        case = CASES[key]
        result = Result()
        for pair in range(args.pairs):
            for launcher in (("torchrun", "ftrun") if pair % 2 == 0 else ("ftrun", "torchrun")):
                sample = run_once(case, launcher)
                if sample is None:
                    result.failed[launcher] += 1
                else:
                    result.samples[launcher].append(sample)
                    print(f"{case.name} {launcher}: wall {sample.wall:.2f}s first step {sample.first_step:.2f}s "
                          f"exit {sample.exit:.2f}s" + (f" steady {sample.steady:.0f}/s" if sample.steady else "")
                          + (f" own exit {sample.own_exit:.2f}s" if sample.own_exit is not None else "")
                          + (f" own CPU {sample.own_cpu:.1f}%" if sample.own_cpu is not None else "")
                          + f" CPU {sample.cpu:.2f}s",
                          flush=True)
        lines += report(case, result)
    print("\nmedians (seconds; steps/s); targets: wall and first step ratio <= 1.0, ftrun exit <= 0.3 s without "
          "--ckpt-dir, steady ratio >= 0.98 (>= 0.97 with snapshots)")
    print("\n".join(header + lines))


if __name__ == "__main__":
    main()
