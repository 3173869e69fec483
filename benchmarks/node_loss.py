"""Losing a whole node with and without a hot spare, and the control-plane cost of coordination at scale.

Case "local": :mod:`node_loss_worker` (64 MiB of state per rank, a RAM snapshot every :data:`EVERY` steps) on 2
simulated nodes x 1 trainer, ``--ec-parity 1``; ``--inject node-loss@node=1,step=S`` (S a snapshot step) kills
node 1 whole. Runs alternate WITH ``--spares 1`` (a warm spare claims rank 1; its keeper rebuilds the snapshots
from parity) and WITHOUT (the supervisor the launcher forked at its start and kept for a first loss; a second loss
would start a new interpreter, which imports torch first). Latency: from the ``inject`` event to the last rank's
mark, written by each worker after its first step following ``restore()`` (the workers' own clock, not events).
Rebuild: ``seconds`` of the ``rebuilt`` event. Every run must end rc 0 with the final state hashes of a
failure-free run. Target: median latency minus rebuild <= 1.5 s, with a spare and without. The ratio with / without
is printed: it was 0.18 when the replacement was a new interpreter (4.2 s here, 18dfbdb; the target then was
<= 0.25).

Case "ops" (no processes): supervisors of 8 and 1024 simulated nodes share a ``C10dStore`` over an in-process
``TCPStore``, counted above it (each :class:`Store` call one round trip; keys named) and below it ("wire":
``TCPStore`` requests): (a) a node's beat interval (``beat``; ``look``: ``gen``, the hang vote and the keys of
``PeerWatch.check``), (b) a generation bump and ``current_raw`` of the others, (c) ``take``; a spare's ``claim``,
(d) a rendezvous poll ``marks(g, "ready")``. (a) was 4 calls and 5 wire round trips while ``gen`` and the hang vote
were read on their own.

    .venv/bin/python benchmarks/node_loss.py --runs 3       # both cases, about 4 minutes
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from ftrun.control import coordination, ownership
from ftrun.control.coordination import Coordinator, Failure
from ftrun.control.store import C10dStore, Store, host_store
from ftrun.launch.peers import PeerWatch

WORKER = Path(__file__).resolve().parent / "node_loss_worker.py"
FTRUN = Path(sys.executable).parent / "ftrun"
SHM_DIR = Path(os.environ.get("FTRUN_SHM_DIR", "/dev/shm"))
SIZE_MIB, STEPS, EVERY, STEP_TIME = 64, 60, 5, 0.1  # worker: state per rank, steps, snapshot interval, s/step
LOSS_STEP = 30  # a snapshot step: node 1 is lost when its trainer reaches it
RUN_TIMEOUT = 240.0  # seconds for one whole job
SCAN_INTERVAL = 0.2  # seconds between looks for the launcher's descendants
TARGET_OVERHEAD = 1.5  # latency minus rebuild (s), with a spare and without
PHASES = ("failure", "spare_claimed", "node_start", "rebuilt", "restore")  # events shown per run
OPS_SIZES = (8, 1024)
MODES = ("spare", "no spare")


@dataclass
class Run:
    mode: str  # "reference" (no failure), "spare" or "no spare"
    index: int
    rc: int | None = None
    latency: float = 0.0  # inject -> every rank's first step of the new generation
    rebuild: float = 0.0  # the keeper's rebuild of node 1's slots from parity
    phases: dict[str, float] = field(default_factory=dict)  # inject -> first event of each of PHASES
    restored: int | None = None
    hashes: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what went wrong: a run with notes is left out of the medians


def run_to_end(proc: subprocess.Popen[bytes]) -> tuple[int | None, int]:
    """Wait for the launcher, then SIGKILL it and every descendant seen while it ran (ftrun's processes lead
    sessions of their own): its exit code (None: timed out) and how many descendants were still alive."""
    seen: set[psutil.Process] = set()
    deadline = time.monotonic() + RUN_TIMEOUT
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            with contextlib.suppress(psutil.Error):
                seen.update(psutil.Process(proc.pid).children(recursive=True))
            time.sleep(SCAN_INTERVAL)
    finally:
        rc = proc.poll()
        proc.kill()
        alive = []
        for process in seen:
            with contextlib.suppress(psutil.Error):  # gone, or its pid reused: kill() checks
                if process.status() != psutil.STATUS_ZOMBIE:
                    process.kill()
                    alive.append(process)
        proc.wait()
    return rc, len(alive)


def run_job(mode: str, index: int, workdir: Path) -> Run:
    run, job = Run(mode, index), f"nodeloss-{os.getpid()}-{mode.replace(' ', '')}-{index}"
    logs = workdir / job
    logs.mkdir()
    extra = [] if mode == "reference" else ["--inject", f"node-loss@node=1,step={LOSS_STEP}"]
    extra += ["--spares", "1"] if mode == "spare" else []
    command = [str(FTRUN), "--nnodes", "2", "--nproc-per-node", "1", "--ec-parity", "1", "--rdzv-id", job,
               "--log-dir", str(logs), *extra, str(WORKER), "--steps", str(STEPS), "--every", str(EVERY),
               "--step-time", str(STEP_TIME), "--size-mib", str(SIZE_MIB), "--marks", str(logs / "marks"),
               "--out", str(logs / "hash")]
    with open(logs / "ftrun.log", "wb") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    try:
        run.rc, left = run_to_end(proc)
    finally:
        shm = list(SHM_DIR.glob(f"ftrun-{job}-*"))
        for path in shm:
            path.unlink(missing_ok=True)
    if run.rc is None:
        run.notes.append(f"timed out after {RUN_TIMEOUT:.0f} s")
    elif left or shm:
        run.notes.append(f"ftrun exited but left {left} process(es) and {len(shm)} file(s) in {SHM_DIR} (removed)")
    analyse(run, logs)
    return run


def analyse(run: Run, logs: Path) -> None:
    run.hashes = [p.read_text().strip() for p in sorted(logs.glob("hash.*"))]
    if run.rc != 0:
        run.notes += [f"exit code {run.rc}", *(logs / "ftrun.log").read_text(errors="replace").splitlines()[-3:]]
    if run.mode == "reference" or not (logs / "events.jsonl").exists():
        return
    events = [json.loads(line) for line in (logs / "events.jsonl").read_text().splitlines()]
    t_kill = next((e["time"] for e in events if e["event"] == "inject"), None)
    if t_kill is None:
        run.notes.append("no inject event")
        return
    after = [e for e in events if e["time"] >= t_kill]
    first = {e["event"]: e["time"] - t_kill for e in reversed(after)}  # the earliest of each kind wins
    run.phases = {kind: first[kind] for kind in PHASES if kind in first}
    run.restored = next((e["step"] for e in after if e["event"] == "restore"), None)
    rebuilt = [e["seconds"] for e in after if e["event"] == "rebuilt"]
    marks = [line.split() for line in (logs / "marks").read_text().splitlines()] if (logs / "marks").exists() else []
    times = {int(m[1]): float(m[2]) for m in marks if m[0] == "1"}  # generation 1: the one the loss started
    run.rebuild, run.latency = sum(rebuilt), max(times.values(), default=t_kill) - t_kill
    if not rebuilt:
        run.notes.append("no rebuilt event")
    if len(times) < 2:
        run.notes.append("not every rank stepped in generation 1")


def describe(run: Run, reference: list[str]) -> str:
    phases = ", ".join(f"{k} {v:.2f}" for k, v in run.phases.items())
    head = (f"{run.mode:<8} run {run.index}: rc {run.rc}, kill -> every rank stepping {run.latency:5.2f} s, rebuild "
            f"{run.rebuild:.3f} s, restored step {run.restored} (s after the kill: {phases})")
    head += ", final state = reference" if run.hashes == reference else ", final state DIFFERS from reference"
    return "\n    ".join([head, *run.notes])


def local_case(runs: int) -> bool:
    workdir = Path(tempfile.mkdtemp(prefix="ftrun-bench-nodeloss-"))
    results: dict[str, list[Run]] = {mode: [] for mode in MODES}
    try:
        ref = run_job("reference", 0, workdir)
        print(f"reference run (no failure): rc {ref.rc}, final state hashes {' '.join(h[:12] for h in ref.hashes)}",
              *ref.notes, sep="\n    ", flush=True)
        for index in range(1, runs + 1):
            for mode in MODES if index % 2 else MODES[::-1]:
                results[mode].append(run_job(mode, index, workdir))
                print(describe(results[mode][-1], ref.hashes), flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"\n{'node 1 lost':<12} {'runs ok':>8} {'kill->stepping':>15} {'rebuild':>9} {'minus rebuild':>14}")
    medians: dict[str, tuple[float, float]] = {}
    for mode, all_runs in results.items():
        good = [r for r in all_runs if not r.notes and r.hashes == ref.hashes]
        cells = [statistics.median(values) if good else math.nan for values in
                 ([r.latency for r in good], [r.rebuild for r in good], [r.latency - r.rebuild for r in good])]
        medians[mode] = (cells[0], cells[2])
        widths = zip(cells, (13, 7, 12))
        print(f"{mode:<12} {len(good):>4}/{len(all_runs):<3} " + " ".join(f"{v:>{w}.3f} s" for v, w in widths))
    every = [ref, *results["spare"], *results["no spare"]]
    rcs, same = all(r.rc == 0 for r in every), bool(ref.hashes) and all(r.hashes == ref.hashes for r in every)
    print(f"every run rc 0: {rcs}; every run's final state equals the failure-free run's: {same}")
    print(f"with spare / without: {medians['spare'][0] / medians['no spare'][0]:.2f}")
    met = True
    for mode, (_, over) in medians.items():  # nan when a mode has no good run: its target is then NOT met
        met = met and over <= TARGET_OVERHEAD
        print(f"{mode} minus rebuild (s): {over:.2f} (target <= {TARGET_OVERHEAD}: "
              f"{'met' if over <= TARGET_OVERHEAD else 'NOT met'})")
    return rcs and same and met


# -- case "ops" ---------------------------------------------------------------------------------------------
@dataclass
class Tally:
    calls: int = 0  # Store calls above C10dStore
    keys: int = 0  # keys those calls name
    wire: int = 0  # TCPStore calls below C10dStore


class CountingStore:
    """A :class:`~ftrun.control.store.Store` that counts each call as one round trip, and the keys it names."""

    def __init__(self, inner: Store, tally: Tally) -> None:
        self.inner, self.tally = inner, tally
        self.poll_interval = inner.poll_interval

    def _count(self, keys: int) -> Store:
        self.tally.calls, self.tally.keys = self.tally.calls + 1, self.tally.keys + keys
        return self.inner

    def set(self, key: str, value: bytes) -> None:
        self._count(1).set(key, value)

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        return self._count(len(keys)).get_many(keys)

    def compare_set(self, key: str, expected: bytes, value: bytes) -> bytes:
        return self._count(1).compare_set(key, expected, value)

    def check(self, keys: Sequence[str]) -> bool:
        return self._count(len(keys)).check(keys)

    def close(self) -> None:
        self.inner.close()


class CountingTCP:
    """A ``TCPStore`` whose every method call (one request and reply each) counts as a wire round trip."""

    def __init__(self, tcp: Any, tally: Tally) -> None:
        self.tcp, self.tally = tcp, tally

    def __getattr__(self, name: str) -> Any:
        self.tally.wire += 1  # C10dStore looks a method up for each call it makes
        return getattr(self.tcp, name)


def ops_at(nnodes: int) -> dict[str, Tally]:
    """The cost of each coordination step in a job of ``nnodes`` simulated supervisors."""
    tally, server = Tally(), host_store(0)
    store = CountingStore(C10dStore(CountingTCP(server, tally)), tally)  # type: ignore[arg-type]
    cost: dict[str, Tally] = {}

    def measure(name: str, action: Callable[[], object]) -> None:
        calls, keys, wire = tally.calls, tally.keys, tally.wire
        action()
        cost[name] = Tally(tally.calls - calls, tally.keys - keys, tally.wire - wire)

    job = f"ops-{nnodes}"
    coordination.use_job(job, "benchmark secret", run=1)
    coords = [Coordinator(store, job, node, nnodes) for node in range(nnodes)]
    coords[0].init_job({"nnodes": nnodes})
    coords[0].touch_watched_keys()
    measure("(c) take a rank (a supervisor starts)", lambda: ownership.take(coords[0], 0, "sup-0", "host"))
    for coord in coords:
        if coord.node_rank:
            ownership.take(coord, coord.node_rank, f"sup-{coord.node_rank}", "host")
        coord.beat()  # the first beat also reads the stored count
        coord.current_raw()  # every node knows generation 0
    watch = PeerWatch(coords[0], 0, nnodes, 5.0, ownership.Owner(1, "me"))
    measure("(a) one beat interval of one node",
            lambda: (coords[0].beat(), watch.check(coords[0].look(watch.keys)[2])))
    seen = coords[0].current_raw()
    failure = Failure("node-lost", "node 1 lost", node=1, detected_by="node 0", incarnation=1)
    measure("(b) bump by the winner", lambda: coords[0].bump(seen, failure))
    measure("(b) one other node learns it", coords[1].current_raw)
    measure("(b) all N-1 other nodes learn it", lambda: [c.current_raw() for c in coords[1:]])
    spare = Coordinator(store, job, 0, nnodes)  # no store call: use_job named the run
    measure("(c) claim of the lost rank by a spare", lambda: ownership.claim(spare, 1, 1, "spare-me", "spare-0", "h"))
    gen = coords[0].current().gen
    for coord in coords[:-1]:
        coord.mark(gen, "ready", 1)
    measure("(d) rendezvous poll, one node missing", lambda: coords[0].marks(gen, "ready"))
    coords[-1].mark(gen, "ready", 1)
    measure("(d) rendezvous poll, every node ready", lambda: coords[0].marks(gen, "ready"))
    return cost


def ops_case() -> None:
    table = {n: ops_at(n) for n in OPS_SIZES}
    print("\ncontrol-store cost (calls: round trips above C10dStore, keys they name; wire: TCPStore round trips)\n"
          f"{'operation':<42}" + "".join(f" | {f'{n} nodes':^20}" for n in OPS_SIZES))
    print(f"{'':<42}" + "".join(f" | {'calls':>6} {'keys':>6} {'wire':>6}" for _ in OPS_SIZES))
    for name in sorted(table[OPS_SIZES[0]], key=lambda name: name[:3]):  # (a) .. (d), measured order within
        print(f"{name:<42}" + "".join(f" | {t.calls:>6} {t.keys:>6} {t.wire:>6}"
                                      for t in (table[n][name] for n in OPS_SIZES)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="pairs of runs (with and without a spare)")
    parser.add_argument("--case", choices=("local", "ops", "all"), default="all")
    args = parser.parse_args()
    passed = local_case(args.runs) if args.case in ("local", "all") else True
    if args.case in ("ops", "all"):
        ops_case()
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
