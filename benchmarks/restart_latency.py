"""Restart latency of ftrun against torchrun: kill -9 of one worker until every rank is training again.

The same plain gloo script (:mod:`latency_worker`, CPU) runs on 2 simulated nodes of this host under each
launcher, rendezvous and collectives on 127.0.0.1 only:

- ftrun: one ``ftrun --nnodes 2 --nproc-per-node 2`` process (it simulates the nodes itself);
- torchrun: one ``torchrun`` per node, c10d rendezvous at a free loopback port, the first one hosting the
  rendezvous store, with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (the workers get their own store).

Each worker appends ``restart_count rank time pid`` to a mark file right after its first all_reduce. A run
waits until every rank has marked, lets the job train for one more second, records ``t_kill`` and sends
SIGKILL to the worker of rank 1 (its pid is in its mark: ftrun's trainers are forks of a zygote, so their
/proc environ does not show RANK). The latency is the time from ``t_kill`` until every rank has a mark
written after ``t_kill``: every rank trains again (the first all_reduce is collective, so the ranks get there
within milliseconds of each other). New workers are told apart by time, not by TORCHELASTIC_RESTART_COUNT:
torchrun counts the restarts of each agent, so a node that restarts for the other node's failure can start
its workers with 0 again.

The run then waits for the launcher(s) to finish the job. A run that times out on the way is a hang, one
whose launcher exits early or non-zero a failure: both are printed and counted but left out of the medians.
Runs alternate between the launchers to spread the machine's noise. Target: ftrun's median at most half of
torchrun's.

With ``--state-mib N`` only ftrun runs (torchrun has no snapshots to restore): each worker holds N MiB of state
that it snapshots after every step and restores after the restart (mind /dev/shm and memory: each rank takes N
MiB in its process and 2 N in /dev/shm, plus 2 N per rank of parity with several nodes). The kill comes once every
rank has committed two snapshots; once every rank trains again the job is stopped (SIGTERM, exit
143). Each run also prints where the time went, from the job's events (``--log-dir``): from the kill until the
failure is seen, the generation's trainers are stopped, the new ones forked, the restore step agreed (with the
seconds of the keepers' checksum verification in it), every rank restored (with the slowest trainer's copy in
it; a trainer builds its state before it restores) and every rank trains again.

    .venv/bin/python benchmarks/restart_latency.py --runs 5
    .venv/bin/python benchmarks/restart_latency.py --runs 3 --nnodes 1 --state-mib 1024 --steps 1000
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

import psutil

from ftrun.control.spec import shm_dir
from ftrun.events import read_events
from ftrun.snapshot.keeper import find_segments
from ftrun.snapshot.slot import COMMITTED, SlotFile

WORKER = Path(__file__).resolve().parent / "latency_worker.py"
BIN_DIR = Path(sys.executable).parent  # ftrun and torchrun live next to the interpreter of the venv
LAUNCHERS = ("ftrun", "torchrun")
TARGET_RATIO = 0.5
START_TIMEOUT = 120.0  # seconds until every rank marked once (cold imports on a busy machine)
RESTART_TIMEOUT = 60.0  # seconds from the kill until every rank marked again
EXIT_GRACE = 30.0  # seconds for the launchers to exit on top of the remaining steps
TRAIN_BEFORE_KILL = 1.0
POLL = 0.01
EXIT_STOPPED = 128 + signal.SIGTERM  # ftrun stopped by SIGTERM (--state-mib runs)
# the milestones of a restart (--state-mib runs), in order: each phase ends at one, from the kill
PHASES = (("seen", "failure seen"), ("stopped", "old trainers stopped"), ("forked", "new trainers forked"),
          ("agreed", "restore step agreed"), ("restored", "every rank restored"), ("training", "every rank trains"))

T = TypeVar("T")
Status = Literal["ok", "hang", "failed"]


@dataclass(frozen=True)
class Mark:
    """One line of the mark file: a worker process that finished its first all_reduce."""

    restart_count: int
    rank: int
    time: float
    pid: int


@dataclass
class RunResult:
    launcher: str
    index: int
    status: Status = "ok"
    latency: float | None = None  # kill -> every rank did its first all_reduce again
    restart_counts: list[int] = field(default_factory=list)  # TORCHELASTIC_RESTART_COUNT of the new workers
    phases: dict[str, float] = field(default_factory=dict)  # --state-mib: milestone -> seconds after the kill
    verify: float = 0.0  # --state-mib: seconds of the slowest keeper's checksum verification before the agreement
    copy: float = 0.0  # --state-mib: seconds of the slowest trainer's restore copy
    notes: list[str] = field(default_factory=list)  # why a run failed or hung, launcher log tails


@dataclass
class Summary:
    launcher: str
    results: list[RunResult] = field(default_factory=list)

    @property
    def latencies(self) -> list[float]:
        return [r.latency for r in self.results if r.status == "ok" and r.latency is not None]

    @property
    def median(self) -> float | None:
        return statistics.median(self.latencies) if self.latencies else None

    def count(self, status: Status) -> int:
        return sum(r.status == status for r in self.results)


class RunError(Exception):
    def __init__(self, status: Status, detail: str) -> None:
        super().__init__(detail)
        self.status = status


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def read_marks(path: Path) -> list[Mark]:
    if not path.exists():
        return []
    marks = []
    for line in path.read_text().splitlines():
        restart_count, rank, stamp, pid = line.split()
        marks.append(Mark(int(restart_count), int(rank), float(stamp), int(pid)))
    return marks


def every_rank_since(path: Path, world: int, since: float) -> list[Mark] | None:
    """The marks written after ``since`` if every rank has one among them, else None."""
    marks = [m for m in read_marks(path) if m.time > since]
    return marks if {m.rank for m in marks} == set(range(world)) else None


def launch_commands(launcher: str, args: argparse.Namespace, run_id: str, log_dir: Path) -> list[list[str]]:
    common = ["--nnodes", str(args.nnodes), "--nproc-per-node", str(args.nproc_per_node),
              "--rdzv-id", run_id, "--max-restarts", "3"]
    script = [str(WORKER), "--steps", str(args.steps), "--step-time", str(args.step_time),
              "--state-mib", str(args.state_mib)]
    if launcher == "ftrun":
        return [[str(BIN_DIR / "ftrun"), *common, "--log-dir", str(log_dir), *script]]
    endpoint = f"127.0.0.1:{free_port()}"
    return [[str(BIN_DIR / "torchrun"), *common, "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
             "--rdzv-conf", f"is_host={int(node == 0)}", "--local-addr", "127.0.0.1",
             "--monitor-interval", "0.1", *script]
            for node in range(args.nnodes)]


def log_tail(logs: list[Path], lines: int = 3) -> list[str]:
    tails: list[str] = []
    for log in logs:
        text = log.read_text(errors="replace").strip().splitlines()[-lines:] if log.exists() else []
        tails.extend(f"  {log.name}: {line}" for line in text)
    return tails


def run_once(launcher: str, index: int, args: argparse.Namespace, workdir: Path) -> RunResult:
    run_dir = Path(tempfile.mkdtemp(prefix=f"{launcher}-{index}-", dir=workdir))
    mark_file = run_dir / "marks"
    world = args.nnodes * args.nproc_per_node
    env = {**os.environ, "LATENCY_MARK_FILE": str(mark_file), "GLOO_SOCKET_IFNAME": "lo"}
    if launcher == "torchrun":
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    result = RunResult(launcher, index)
    procs: list[subprocess.Popen[bytes]] = []
    logs: list[Path] = []
    try:
        run_id = f"latency-{os.getpid()}-{launcher}-{index}"
        for node, command in enumerate(launch_commands(launcher, args, run_id, run_dir / "logs")):
            logs.append(run_dir / f"{launcher}{node}.log")
            with open(logs[-1], "wb") as log:
                procs.append(subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                                              stdin=subprocess.DEVNULL, start_new_session=True))

        def wait_marks(since: float, timeout: float, what: str) -> list[Mark]:
            return wait_for(lambda: every_rank_since(mark_file, world, since), timeout, procs, what)

        started = wait_marks(0.0, START_TIMEOUT, "every rank to start")
        if args.state_mib:
            wait_for(lambda: snapshots_taken(run_id, args) or None, START_TIMEOUT, procs,
                     "every rank's first two snapshots")
        time.sleep(TRAIN_BEFORE_KILL)
        victim = next(m for m in started if m.rank == 1)
        t_kill = time.time()
        try:
            os.kill(victim.pid, signal.SIGKILL)
        except ProcessLookupError:
            raise RunError("failed", "rank 1 was gone before the kill (raise --steps)") from None
        restarted = wait_marks(t_kill, RESTART_TIMEOUT, "every rank to restart after the kill")
        result.latency = max(m.time for m in restarted) - t_kill
        result.restart_counts = sorted({m.restart_count for m in restarted})
        if args.state_mib:
            for proc in procs:
                proc.send_signal(signal.SIGTERM)
        wait_for(lambda: all(p.poll() is not None for p in procs) or None,
                 args.steps * args.step_time + EXIT_GRACE, [], "the launcher(s) to exit")
        codes = [p.returncode for p in procs]
        if any(code != (EXIT_STOPPED if args.state_mib else 0) for code in codes):
            raise RunError("failed", f"exit codes {codes}")
        if args.state_mib:
            breakdown(result, run_dir / "logs", t_kill, max(m.time for m in restarted))
    except RunError as err:
        result.status = err.status
        result.notes = [str(err), *log_tail(logs)]
    finally:
        for proc in procs:
            kill_tree(proc)
        leftovers = [m.pid for m in read_marks(mark_file) if kill_worker(m)]
        if leftovers:
            result.notes.append(f"workers left behind by the launcher (now killed): {leftovers}")
        for path in glob.glob(os.path.join(shm_dir(), f"ftrun-{run_id}-*")):  # left by a launcher killed above
            os.unlink(path)
    return result


def snapshots_taken(run_id: str, args: argparse.Namespace) -> bool:
    """Whether every rank of the job has two committed snapshots (their checksums may still be on the way: the
    keeper's sealer runs at background priority)."""
    committed = 0
    for node in range(args.nnodes):
        for path, _, _ in find_segments(run_id, node):
            try:
                slot = SlotFile(path)
            except (OSError, ValueError):  # being made (no header yet), or gone
                continue
            committed += slot.header().state == COMMITTED
            slot.close()
    return committed >= 2 * args.nnodes * args.nproc_per_node


def breakdown(result: RunResult, log_dir: Path, t_kill: float, training: float) -> None:
    """The milestones of the restart (:data:`PHASES`) in ``result``, from the job's events of generation 1."""
    events = [e for e in read_events(str(log_dir)) if e["time"] >= t_kill]

    def last(name: str) -> dict[str, Any]:
        return max((e for e in events if e["event"] == name and e.get("generation", 1) == 1),
                   key=lambda e: e["time"])

    forked = last("trainers_started")["time"]
    seen = min(e["time"] for e in events if e["event"] == "failure")
    stopped = max(e["time"] for e in events if e["event"] == "stopped" and e["time"] <= forked)
    restored = [e for e in events if e["event"] == "restored"]
    times = {"seen": seen, "stopped": stopped, "forked": forked, "agreed": last("restore")["time"],
             "restored": max(e["time"] for e in restored), "training": training}
    result.phases = {name: at - t_kill for name, at in times.items()}
    result.verify = max(e.get("verify_seconds", 0.0) for e in events if e["event"] == "restore")
    result.copy = max(e["seconds"] for e in restored)


def describe_phases(results: list[RunResult]) -> list[str]:
    """Lines: the median seconds of each phase of a restart over ``results``."""
    lines, before = [], 0.0
    for name, label in PHASES:
        at = statistics.median(r.phases[name] for r in results)
        detail = ""
        if name == "agreed":
            detail = f"  (keeper checksum verification {statistics.median(r.verify for r in results):.3f} s)"
        elif name == "restored":
            detail = f"  (slowest trainer's restore copy {statistics.median(r.copy for r in results):.3f} s)"
        lines.append(f"  {label:<24}{at:7.3f} s after the kill, phase {at - before:6.3f} s{detail}")
        before = at
    return lines


def kill_tree(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL a launcher's process group and, if it still runs, its descendants (torchrun's workers lead
    their own sessions)."""
    descendants = []
    if proc.poll() is None:
        with contextlib.suppress(psutil.NoSuchProcess):
            descendants = psutil.Process(proc.pid).children(recursive=True)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    for process in descendants:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    proc.wait()
    psutil.wait_procs(descendants, timeout=10)


def kill_worker(mark: Mark) -> bool:
    """SIGKILL the worker of ``mark`` if it still runs (not a later process with its pid); True if it did."""
    try:
        process = psutil.Process(mark.pid)
        if process.create_time() > mark.time or process.status() == psutil.STATUS_ZOMBIE:
            return False
        process.kill()
    except psutil.NoSuchProcess:
        return False
    return True


def wait_for(check: Callable[[], T | None], timeout: float, procs: list[subprocess.Popen[bytes]], what: str) -> T:
    """Poll ``check`` until it returns a value; a launcher of ``procs`` that exits first is a failure."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value is not None:
            return value
        exited = [p.returncode for p in procs if p.poll() is not None]
        if exited:
            raise RunError("failed", f"a launcher exited (codes {exited}) while waiting for {what}")
        time.sleep(POLL)
    raise RunError("hang", f"timed out after {timeout:.0f} s waiting for {what}")


def describe(result: RunResult) -> str:
    head = f"{result.launcher:<8} run {result.index}: {result.status:<6}"
    if result.latency is not None:
        counts = "/".join(map(str, result.restart_counts))
        head += f" kill -> every rank's first all_reduce {result.latency:6.2f} s (restart count {counts})"
    if result.phases:
        head += "; " + ", ".join(f"{name} {at:.3f}" for name, at in result.phases.items())
    return "\n    ".join([head, *result.notes])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="runs per launcher")
    parser.add_argument("--nnodes", type=int, default=2)
    parser.add_argument("--nproc-per-node", type=int, default=2)
    parser.add_argument("--steps", type=int, default=100, help="steps of each worker process")
    parser.add_argument("--step-time", type=float, default=0.05, help="worker's sleep per step (s)")
    parser.add_argument("--only", choices=LAUNCHERS, help="benchmark one launcher only")
    parser.add_argument("--state-mib", type=int, default=0,
                        help="MiB of snapshotted state per rank: ftrun only, with a breakdown of its restart")
    args = parser.parse_args()
    if args.nnodes * args.nproc_per_node < 2:
        parser.error("the job needs a rank 1 to kill")
    if args.state_mib < 0 or (args.state_mib and args.only == "torchrun"):
        parser.error("--state-mib takes a size in MiB and runs ftrun only")
    if args.state_mib:
        args.only = "ftrun"

    launchers = [args.only] if args.only else list(LAUNCHERS)
    summaries = {launcher: Summary(launcher) for launcher in launchers}
    workdir = Path(tempfile.mkdtemp(prefix="restart-latency-"))
    try:
        for index in range(1, args.runs + 1):
            for launcher in launchers:
                result = run_once(launcher, index, args, workdir)
                summaries[launcher].results.append(result)
                print(describe(result), flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    print()
    for summary in summaries.values():
        median = f"{summary.median:.2f} s" if summary.median is not None else "n/a"
        print(f"{summary.launcher:<8} median {median} over {len(summary.latencies)} runs "
              f"({summary.count('hang')} hangs, {summary.count('failed')} failures)")
        measured = [r for r in summary.results if r.phases]
        if measured:
            print(f"where a restart with {args.state_mib} MiB per rank went (medians over {len(measured)} runs):")
            print("\n".join(describe_phases(measured)))
    if args.only:
        return 0 if summaries[args.only].latencies else 1
    ftrun, torchrun = summaries["ftrun"].median, summaries["torchrun"].median
    if ftrun is None or torchrun is None:
        print("ratio ftrun/torchrun: n/a (a launcher has no successful run)")
        return 1
    ratio = ftrun / torchrun
    verdict = "met" if ratio <= TARGET_RATIO else "NOT met"
    print(f"ratio ftrun/torchrun: {ratio:.2f} (target <= {TARGET_RATIO}: {verdict})")
    return 0 if ratio <= TARGET_RATIO else 1


if __name__ == "__main__":
    sys.exit(main())
