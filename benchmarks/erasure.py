"""Erasure-coded redundancy of ftrun's RAM snapshots: parity encoding, rebuild of a lost node, memory per node.

Two shapes side by side, one trainer per node, ``--size-mib`` of state per rank: erasure coding
(``--nnodes 3 --ec-group 3 --ec-parity 1``: G = 3, m = 1, k = 2) and replication (``--nnodes 2``, the default
G = 2, m = 1, k = 1). For each, this script runs a real ftrun job of :mod:`erasure_worker` (a snapshot every
step; method there) with ``--inject node-loss@node=1,step=--loss-at`` and reads ``<log-dir>/events.jsonl``.
A node's *blob* is the state of its ranks (the worker reports its state bytes). Times are medians.

- Encode, pyeclib alone: ``Codec(k, m).encode`` in this process, over the pieces ``StripeLayout(G, m).pieces(L)``
  of random data, for the m stripes a keeper holds parity of (k chunks of L bytes each, a blob's worth);
  ``--reps`` repetitions. Encode, end to end: the keepers' ``parity`` events (fetch of the data fragments from
  the other keepers over TCP, encoding, writing the parity file, checks), blob / seconds per keeper, median over
  the steps before the node loss except each keeper's first two (they allocate the two parity files, shown
  apart); the trainers run meanwhile, as in training.
- Rebuild: the ``rebuilt`` event of node 1's replacement keeper (bytes, seconds; it reads k x those bytes from
  k survivors), against a plain loopback TCP copy of as many bytes by this script (a thread sends a file in
  /dev/shm with ``socket.sendfile``, the client receives it with ``recv_into`` into a faulted buffer) and against
  ``Codec.reconstruct`` alone of the lost node's k chunks, each from k fragments; ``--reps`` runs of each.
  For context, the job's recovery (``recovered``: failure seen to every rank beating again), which includes
  starting the replacement node.
- Memory: the worker stops after saving step ``--hold-at`` until this script has seen that step's parity on
  every node; then the allocated size of each node's files in /dev/shm (``ftrun-<job>-node<N>-*``: its ranks'
  slots and its parity files, not the heartbeat table) over its state bytes, against 2 slots + 2 parity files of
  m/k of a blob = 2 + 2m/k.
- Every rank of the last generation checks at the end that its state is bit for bit the one of a run without
  failure (so the restore was exact).

    .venv/bin/python benchmarks/erasure.py            # 256 MiB per rank, about 3 minutes
    .venv/bin/python benchmarks/erasure.py --quick    # 16 MiB, 2 repetitions: a smoke check (about 1 minute)
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from statistics import median as med
from typing import Any

from ftrun.control.spec import shm_dir
from ftrun.snapshot.erasure import DEFAULT_BACKEND, Codec, StripeLayout

WORKER = Path(__file__).resolve().parent / "erasure_worker.py"
GB = 1e9
MIB = 1 << 20
JOB_TIMEOUT = 900
STOP_GRACE = 30
POLL = 0.1
ALLOCATION_ENCODES = 2  # a keeper's first two encodes allocate its two parity files
LOST_NODE = 1
Event = dict[str, Any]


@dataclass(frozen=True)
class Shape:
    """One redundancy configuration: ``nnodes`` nodes of one trainer in EC groups of ``group`` with ``parity``."""

    name: str
    nnodes: int
    group: int
    parity: int
    flags: tuple[str, ...]  # ftrun's redundancy flags for it (none: the default)

    @property
    def k(self) -> int:
        return self.group - self.parity

    @property
    def expected_memory(self) -> float:
        """Slots + parity files of a node over its state: 2 + 2 m / k."""
        return 2 + 2 * self.parity / self.k


SHAPES = (Shape("erasure coding", 3, 3, 1, ("--ec-group", "3", "--ec-parity", "1")),
          Shape("replication", 2, 2, 1, ()))


@dataclass
class Job:
    """What one job left: its events, the /dev/shm usage per node at the hold, the workers' records."""

    events: list[Event]
    memory: dict[int, dict[str, int]]  # node -> {"slot": bytes, "parity": bytes}
    records: list[dict[str, Any]]

    def of(self, name: str) -> list[Event]:
        return [e for e in self.events if e["event"] == name]

    @property
    def state_bytes(self) -> int:
        """State bytes of one node (one rank per node; every rank has the same size)."""
        return int(self.records[0]["state_bytes"])


# -- pyeclib alone ---------------------------------------------------------------------------------------------
def codec_seconds(shape: Shape, blob: int, reps: int) -> tuple[list[float], list[float]]:
    """Seconds, per rep, of one keeper's encode (its m stripes) and of a lost node's rebuild (its k chunks, each
    from k other fragments) of blobs of ``blob`` random bytes with :class:`Codec` alone."""
    layout, codec, k = StripeLayout(shape.group, shape.parity), Codec(shape.k, shape.parity), shape.k
    chunk_len = layout.chunk_len([blob])
    data = bytearray(k * chunk_len)
    data[:blob] = os.urandom(blob)
    view = memoryview(data)

    def chunks(offset: int, length: int) -> list[memoryview]:
        return [view[i * chunk_len + offset:i * chunk_len + offset + length] for i in range(k)]

    encode, rebuild = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        coded = [[codec.encode(chunks(*piece)) for piece in layout.pieces(chunk_len)] for _ in range(shape.parity)]
        encode.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for lost in range(k):
            for piece, (parity, headers) in zip(layout.pieces(chunk_len), coded[0]):
                available = {i: c for i, c in enumerate(chunks(*piece)) if i != lost}
                available.update({k + t: p for t, p in enumerate(parity)})
                codec.reconstruct(available, headers, lost)
        rebuild.append(time.perf_counter() - t0)
    return encode, rebuild


# -- plain TCP copy --------------------------------------------------------------------------------------------
def tcp_copy_seconds(nbytes: int, reps: int) -> list[float]:
    """Seconds of loopback TCP copies of ``nbytes`` from a /dev/shm file (sendfile) into a faulted buffer."""
    fd, path = tempfile.mkstemp(prefix="ftrun-bench-erasure-tcp-", dir=shm_dir())
    server = socket.create_server(("127.0.0.1", 0))
    try:
        with os.fdopen(fd, "wb") as f:
            for start in range(0, nbytes, 64 * MIB):
                f.write(bytes(min(64 * MIB, nbytes - start)))
        sender = threading.Thread(target=_send_file, args=(server, path, nbytes, reps), daemon=True)
        sender.start()
        buffer = memoryview(bytearray(b"\1") * nbytes)
        times = [_receive(server.getsockname(), buffer) for _ in range(reps)]
        sender.join()
        return times
    finally:
        server.close()
        os.unlink(path)


def _send_file(server: socket.socket, path: str, nbytes: int, reps: int) -> None:
    with open(path, "rb") as f:
        for _ in range(reps):
            conn, _ = server.accept()
            with conn:
                conn.sendfile(f, 0, nbytes)


def _receive(address: tuple[str, int], buffer: memoryview) -> float:
    t0 = time.perf_counter()
    with socket.create_connection(address) as sock:
        got = 0
        while got < len(buffer):
            n = sock.recv_into(buffer[got:])
            if n == 0:
                raise ConnectionError(f"TCP copy ended after {got} of {len(buffer)} bytes")
            got += n
    return time.perf_counter() - t0


# -- the ftrun job ---------------------------------------------------------------------------------------------
def read_events(log_dir: str) -> list[Event]:
    """The complete lines of ``events.jsonl`` so far (none if it does not exist yet)."""
    path = os.path.join(log_dir, "events.jsonl")
    if not os.path.exists(path):
        return []
    text = Path(path).read_text()
    return [json.loads(line) for line in text[:text.rfind("\n") + 1].splitlines() if line.strip()]


def shm_usage(job: str) -> dict[int, dict[str, int]]:
    """Allocated bytes of every node's slot and parity files of ``job``, by node and kind."""
    usage: dict[int, dict[str, int]] = {}
    for path in glob.glob(os.path.join(shm_dir(), f"ftrun-{job}-node*-*")):
        match = re.search(r"-node(\d+)-(?:rank\d+-(slot)\d+|(parity)\d+)$", path)
        if match is not None:
            kind = match.group(2) or match.group(3)
            node = usage.setdefault(int(match.group(1)), {"slot": 0, "parity": 0})
            node[kind] += os.stat(path).st_blocks * 512
    return usage


def hold_then_release(shape: Shape, args: argparse.Namespace, proc: subprocess.Popen[bytes], log_dir: str,
                      job: str, go: Path, deadline: float) -> dict[int, dict[str, int]]:
    """Wait until every node has the parity of step ``--hold-at`` (the trainers wait), measure /dev/shm, go on."""
    while True:
        done = {e["node"] for e in read_events(log_dir) if e["event"] == "parity" and e["step"] == args.hold_at}
        if done >= set(range(shape.nnodes)):
            break
        if proc.poll() is not None or time.monotonic() > deadline:
            raise TimeoutError(f"no parity of step {args.hold_at} on every node (only on {sorted(done)})")
        time.sleep(POLL)
    usage = shm_usage(job)
    go.touch()
    return usage


def run_job(shape: Shape, args: argparse.Namespace, workdir: str) -> Job:
    """Run the worker under ftrun with the node loss injected; what it left, or SystemExit with ftrun's output."""
    job = f"bench-erasure-{shape.nnodes}n-{os.getpid()}"
    base = os.path.join(workdir, job)
    log_dir, out_dir, go, log = f"{base}-logs", f"{base}-out", Path(f"{base}-go"), f"{base}.log"
    os.makedirs(out_dir)
    command = [sys.executable, "-m", "ftrun", "--nnodes", str(shape.nnodes), "--nproc-per-node", "1", *shape.flags,
               "--rdzv-id", job, "--log-dir", log_dir, "--max-restarts", "2", "--hang-timeout", "600",
               "--hang-timeout-initial", "600", "--inject", f"node-loss@node={LOST_NODE},step={args.loss_at}",
               str(WORKER), "--size-mib", str(args.size_mib), "--steps", str(args.steps), "--hold-at",
               str(args.hold_at), "--step-time", str(args.step_time), "--go", str(go), "--out-dir", out_dir]
    print(f"running: {' '.join(command[1:])}", flush=True)
    deadline = time.monotonic() + JOB_TIMEOUT
    with open(log, "wb") as f:
        proc = subprocess.Popen(command, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    memory: dict[int, dict[str, int]] = {}
    try:
        memory = hold_then_release(shape, args, proc, log_dir, job, go, deadline)
        proc.wait(max(deadline - time.monotonic(), 1))
    except (TimeoutError, subprocess.TimeoutExpired) as exc:
        print(f"WARNING: {exc}; stopping the job")
    finally:
        stop(proc)
        remove_leftovers(job)
    code = proc.returncode
    records = [json.loads(p.read_text()) for p in sorted(Path(out_dir).glob("rank*-gen*.json"))]
    result = Job(read_events(log_dir), memory, records)
    if code != 0 or not memory or not result.of("rebuilt"):
        tail = "\n".join(Path(log).read_text(errors="replace").splitlines()[-30:])
        raise SystemExit(f"the ftrun job failed (exit code {code}); its output ends with:\n{tail}")
    return result


def stop(proc: subprocess.Popen[bytes]) -> None:
    """Stop a job still running: SIGTERM to ftrun (it stops its nodes and cleans up), then SIGKILL to all of it."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(STOP_GRACE)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def remove_leftovers(job: str) -> None:
    leftovers = glob.glob(os.path.join(shm_dir(), f"ftrun-{job}-*"))
    for path in leftovers:
        os.unlink(path)
    if leftovers:
        print(f"WARNING: left in {shm_dir()} after the job (removed now): {leftovers}")


# -- results ---------------------------------------------------------------------------------------------------
@dataclass
class Result:
    """The numbers of one shape, as reported."""

    shape: Shape
    state: int  # bytes per node
    encode_alone: float  # seconds, pyeclib alone
    rebuild_alone: float  # seconds, pyeclib reconstruct alone
    keepers: dict[int, float]  # node -> median seconds of its steady encodes
    allocating: float  # median seconds of the keepers' first two encodes
    parity_bytes: int
    rebuilt: Event
    tcp: float  # seconds of a plain TCP copy of the rebuilt bytes
    recovery: float  # seconds from the failure seen to every rank beating again
    memory: dict[int, dict[str, int]]
    records: list[dict[str, Any]]

    @property
    def encode(self) -> float:
        """Median over keepers of the steady end-to-end encode seconds."""
        return med(self.keepers.values())

    def gbs(self, seconds: float) -> str:
        return f"{self.state / seconds / GB:.2f} GB/s"

    def memory_ratio(self, kinds: tuple[str, ...] = ("slot", "parity")) -> list[float]:
        """Each node's files of ``kinds`` over its state bytes, by node."""
        return [sum(usage[k] for k in kinds) / self.state for _, usage in sorted(self.memory.items())]

    def restored(self) -> str:
        """The step(s) the ranks restored after the loss, and on how many ranks."""
        after = [x for x in self.records if x["generation"] > 0]
        return f"step {'/'.join(str(s) for s in sorted({x['restored'] for x in after}))} on {len(after)} ranks"

    def exact(self) -> str:
        """On how many ranks the final state was bit for bit the failure-free one."""
        final = [x["exact"] for x in self.records if "exact" in x]
        return f"{sum(final)} of {self.shape.nnodes} ranks bit-exact"


def steady_encodes(job: Job) -> tuple[dict[int, float], list[float]]:
    """Per keeper, the median seconds of its encodes before the node loss but its first two; and those first."""
    loss = min(e["time"] for e in job.of("inject"))
    by_node: dict[int, list[Event]] = {}
    for event in job.of("parity"):
        if event["time"] < loss:
            by_node.setdefault(event["node"], []).append(event)
    steady, first = {}, []
    for node, events in sorted(by_node.items()):
        seconds = [e["seconds"] for e in sorted(events, key=lambda e: e["step"])]
        first += seconds[:ALLOCATION_ENCODES]
        if seconds[ALLOCATION_ENCODES:]:
            steady[node] = med(seconds[ALLOCATION_ENCODES:])
    if not steady:
        raise SystemExit("no parity computed before the node loss past the first two: raise --loss-at")
    return steady, first


def measure(shape: Shape, args: argparse.Namespace, workdir: str) -> Result:
    job = run_job(shape, args, workdir)
    steady, first = steady_encodes(job)
    encode, rebuild = codec_seconds(shape, job.state_bytes, args.reps)
    rebuilt = job.of("rebuilt")[0]
    tcp = tcp_copy_seconds(rebuilt["bytes"], args.reps)
    return Result(shape, job.state_bytes, med(encode), med(rebuild), steady, med(first),
                  job.of("parity")[0]["parity_bytes"], rebuilt, med(tcp), job.of("recovered")[0]["seconds"],
                  job.memory, job.records)


def row(label: str, a: str, b: str, ratio: str = "") -> None:
    print(f"  {label:<46}{a:>24}{b:>24}{ratio:>12}".rstrip())


def report(results: list[Result], args: argparse.Namespace) -> None:
    ec, rep = results
    print(f"\nstate {ec.state / MIB:.0f} MiB per rank, one rank per node, a snapshot every step; {DEFAULT_BACKEND}; "
          f"medians of {args.reps} (pyeclib, TCP copy) and over steps (keepers)")
    for r in results:
        s = r.shape
        print(f"  {s.name}: --nnodes {s.nnodes} {' '.join(s.flags) or '(default groups)'}: G={s.group}, m={s.parity},"
              f" k={s.k}; parity per node {r.parity_bytes / r.state:.3f} x the state")
    print()
    row("", f"{ec.shape.name} k={ec.shape.k}", f"{rep.shape.name} k={rep.shape.k}", "EC / repl.")
    # k = 1: the codec copies instead of calling pyeclib (the parity of a 1-of-n code is the data itself)
    row("encode per keeper: pyeclib alone", ec.gbs(ec.encode_alone), "a copy, no pyeclib")
    row("encode per keeper: end to end (parity events)", ec.gbs(ec.encode), rep.gbs(rep.encode),
        f"{rep.encode / ec.encode:.2f}")
    row("  each keeper, node 0, 1, ... (GB/s)", spread([ec.state / t / GB for t in ec.keepers.values()]),
        spread([rep.state / t / GB for t in rep.keepers.values()]))
    row("  end to end / pyeclib alone", f"{ec.encode_alone / ec.encode:.2f}", "-")
    row("  first two encodes (parity files allocated)", ec.gbs(ec.allocating), rep.gbs(rep.allocating))
    row("rebuild of node 1 (rebuilt event)", f"{ec.rebuilt['seconds']:.3f} s", f"{rep.rebuilt['seconds']:.3f} s",
        f"{ec.rebuilt['seconds'] / rep.rebuilt['seconds']:.2f}")
    row("  bytes rebuilt", f"{ec.rebuilt['bytes'] / MIB:.1f} MiB", f"{rep.rebuilt['bytes'] / MIB:.1f} MiB")
    row("  bytes read from the survivors (k x)", sources(ec), sources(rep))
    row("  pyeclib reconstruct alone", f"{ec.rebuild_alone:.3f} s", "a copy, no pyeclib")
    row("plain TCP copy of the bytes rebuilt", f"{ec.tcp:.3f} s", f"{rep.tcp:.3f} s")
    row("  rebuild / TCP copy", f"{ec.rebuilt['seconds'] / ec.tcp:.1f}", f"{rep.rebuilt['seconds'] / rep.tcp:.1f}")
    row("recovery: failure seen to every rank beating", f"{ec.recovery:.2f} s", f"{rep.recovery:.2f} s",
        f"{ec.recovery / rep.recovery:.2f}")
    row("memory per node / state: expected 2 + 2m/k", f"{ec.shape.expected_memory:.2f}",
        f"{rep.shape.expected_memory:.2f}", f"{ec.shape.expected_memory / rep.shape.expected_memory:.2f}")
    row("  measured, node 0, 1, ...", spread(ec.memory_ratio()), spread(rep.memory_ratio()),
        f"{med(ec.memory_ratio()) / med(rep.memory_ratio()):.2f}")
    row("  of which slots + parity files (median)", parts(ec), parts(rep))
    row("restored after the loss", ec.restored(), rep.restored())
    row("final state vs a run without failure", ec.exact(), rep.exact())
    print("\n  EC / repl.: the erasure-coding value of the row over the replication one")


def sources(r: Result) -> str:
    return f"{r.shape.k} x {r.rebuilt['bytes'] / MIB:.0f} MiB from {','.join(map(str, r.rebuilt['sources']))}"


def parts(r: Result) -> str:
    return f"{med(r.memory_ratio(('slot',))):.2f} + {med(r.memory_ratio(('parity',))):.2f}"


def spread(values: list[float]) -> str:
    return " ".join(f"{v:.2f}" for v in values)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=256, help="state per rank (MiB)")
    parser.add_argument("--reps", type=int, default=5, help="repetitions of the pyeclib timings and the TCP copy")
    parser.add_argument("--steps", type=int, default=16, help="training steps (a snapshot after each)")
    parser.add_argument("--hold-at", type=int, default=4, help="step at which /dev/shm is measured")
    parser.add_argument("--loss-at", type=int, default=10, help="step at which node 1 is lost")
    parser.add_argument("--step-time", type=float, default=0.05, help="seconds of sleep per training step")
    parser.add_argument("--quick", action="store_true", help="16 MiB, 2 repetitions, 10 steps: a smoke check")
    args = parser.parse_args()
    if args.quick:
        args.size_mib, args.reps, args.steps, args.hold_at, args.loss_at = 16, 2, 10, 3, 6
    if not 0 < args.hold_at < args.loss_at < args.steps:
        parser.error("need 0 < --hold-at < --loss-at < --steps")
    workdir = tempfile.mkdtemp(prefix="ftrun-bench-erasure-")
    try:
        report([measure(shape, args, workdir) for shape in SHAPES], args)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
