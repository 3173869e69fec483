"""Erasure-coded redundancy of ftrun's RAM snapshots: parity encoding, rebuild of a lost node, memory per node.

Three shapes side by side, one trainer per node, ``--size-mib`` of state per rank: erasure coding
(``--nnodes 3 --ec-group 3 --ec-parity 1``: G = 3, m = 1, k = 2; ``--nnodes 6 --ec-group 6 --ec-parity 2``:
k = 4, m = 2, two nodes lost at once) and replication (``--nnodes 2``, the default G = 2, m = 1, k = 1). For
each, this script runs a real ftrun job of :mod:`erasure_worker` (a snapshot every step; method there) with
``--inject node-loss@node=N,step=--loss-at`` and reads ``<log-dir>/events.jsonl``. A node's *blob* is the state
of its ranks (the worker reports its state bytes). Times are medians.

- Encode, codec alone: :func:`~ftrun.snapshot.erasure.encode_parity` in this process for the m stripes a keeper
  holds parity of, its fetches copies from memory; ``--reps`` repetitions. With m >= 2, also with pyeclib's own
  arithmetic where ISA-L's kernels compute (:mod:`ftrun.snapshot.gf_kernels`), as without ISA-L's library. Encode,
  end to end: the keepers' ``parity`` events (fetch of the data fragments from the other keepers over TCP, encoding,
  writing the parity file, checks), blob / seconds per keeper, median over the steps before the node loss except
  each keeper's first two (they allocate the two parity files, shown apart); the trainers run meanwhile, as in
  training. The job's pace of protection: median seconds between two steps protected by parity on every node
  (``protected`` events), past the first two. With m >= 2, the share of the fragments k + 1.. that their stripes'
  own positions pushed (the rest the holders computed from the data themselves). Encode, one keeper alone: as a
  keeper, over loopback TCP from peer servers (with m >= 2: its own stripe, the other fragments pushed to a peer).
- Rebuild: the slowest ``rebuilt`` event of the lost nodes' replacement keepers (bytes, seconds; each reads k x
  those bytes from k survivors), against a plain loopback TCP copy of as many bytes by this script (a thread
  sends a file in /dev/shm with ``socket.sendfile``, the client receives it with ``recv_into`` into a faulted
  buffer; the target; for context also into a new /dev/shm file, whose pages are allocated as they arrive, as a
  new node's must be) and against :func:`~ftrun.snapshot.erasure.rebuild_chunk` alone of the lost node's k
  chunks, into new slots allocated during the transfer, and into slots allocated before it (what a replacement's
  keeper has when told the step early enough: ``prepare``); ``--reps`` runs of each. The rebuilt event's phases
  (seconds): metadata, slots claimed, transfer, verification, and the part of the transfer spent waiting for the
  slots' memory; and how much of that memory was allocated before the rebuild began.
  For context, the job's recovery (``recovered``: failure seen to every rank beating again), which includes
  starting the replacement node. With ``--spares N`` the jobs have N hot spares, which allocate the slots they
  would rebuild while they wait (N as many as the nodes lost: every rebuild writes into memory allocated before;
  on this 2-core host, 256 MiB, k=2: rebuild / TCP copy 5.2 without a spare, 3.3 with one).
- Memory: the worker stops after saving step ``--hold-at`` until this script has seen that step's parity on
  every node; then the allocated size of each node's files in /dev/shm (``ftrun-<job>-node<N>-*``: its ranks'
  slots and its parity files, not the heartbeat table) over its state bytes, against 2 slots + 2 parity files of
  m/k of a blob = 2 + 2m/k.
- Every rank of the last generation checks at the end that its state is bit for bit the one of a run without
  failure (so the restore was exact).
- Training: 3 nodes x 1 trainer doing a fixed amount of matrix products per step and then waiting
  ``--train-sleep`` with the CPU idle (as a GPU step leaves the host's cores to other work; 3 CPU-bound trainers
  on this 2-core host would leave the encoders no core at all), a snapshot every ``--every`` steps, with parity
  (m = 1) and without (``--ec-parity 0``), alternating ``--train-reps`` times: steps per second of the slowest
  rank (and the largest share of a rank's time in the Snapshotter's ``save()`` and ``wait()``), from its
  :data:`UNTIMED_SNAPSHOTS`-th snapshot to step ``--train-steps`` (200: about 14 s timed): the steady state of
  a long job. What a job does once is before it and shown apart, the seconds each rank spent in those calls:
  the first snapshots wait for the job's first parity, which allocates the parity files while the zygotes import
  what trainers import next (once every trainer has beaten).

Targets, printed as PASS/MISS: encode end to end >= 2 GB/s per keeper (k=2, m=1) and >= 1 GB/s (k=4, m=2);
rebuild <= 1.5 x the TCP copy (k=1, k=2) and <= 2 x (m=2, two lost); memory per node <= 2 + 2m/k; training
with parity >= 0.97 x without.

    .venv/bin/python benchmarks/erasure.py            # 256 MiB per rank, about 3.5 minutes
    .venv/bin/python benchmarks/erasure.py --quick    # 16 MiB, 2 repetitions: a smoke check (about 1 minute)
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import mmap
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
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from statistics import median as med
from typing import Any

from isal.isal_zlib import crc32

from ftrun.control.spec import shm_dir
from ftrun.snapshot.ec_groups import DEFAULT_BACKEND
from ftrun.snapshot.erasure import Codec, Scratch, Segment, StripeLayout, encode_parity, rebuild_chunk
from ftrun.snapshot.gf_kernels import ENV_ISAL_LIBRARY, load_isal
from ftrun.snapshot.heap import reuse_large_blocks
from ftrun.snapshot.slot import HEADER_SIZE, AheadAllocator, SlotFile
from ftrun.snapshot.transport import FileRange, PeerClient, PeerServer, Reply

WORKER = Path(__file__).resolve().parent / "erasure_worker.py"
GB = 1e9
MIB = 1 << 20
JOB_TIMEOUT = 900
STOP_GRACE = 30
POLL = 0.1
ALLOCATION_ENCODES = 2  # a keeper's first two encodes allocate its two parity files
UNTIMED_SNAPSHOTS = 4  # the training jobs' first snapshots, which wait for the first parity (reported apart)
Event = dict[str, Any]


@dataclass(frozen=True)
class Shape:
    """One redundancy configuration: ``nnodes`` nodes of one trainer in EC groups of ``group`` with ``parity``."""

    name: str
    nnodes: int
    group: int
    parity: int
    flags: tuple[str, ...]  # ftrun's redundancy flags for it (none: the default)
    lost: tuple[int, ...] = (1,)  # the nodes lost at once at --loss-at
    rebuild_target: float = 1.5  # rebuild / TCP copy of the same bytes, at most
    encode_target: float | None = None  # GB/s of blob per keeper, end to end, at least

    @property
    def k(self) -> int:
        return self.group - self.parity

    @property
    def expected_memory(self) -> float:
        """Slots + parity files of a node over its state: 2 + 2 m / k."""
        return 2 + 2 * self.parity / self.k


SHAPES = (Shape("EC k=2 m=1", 3, 3, 1, ("--ec-group", "3", "--ec-parity", "1"), encode_target=2.0),
          Shape("EC k=4 m=2", 6, 6, 2, ("--ec-group", "6", "--ec-parity", "2"), (1, 2), 2.0, 1.0),
          Shape("replication k=1", 2, 2, 1, ()))


@dataclass
class Job:
    """What one job left: its events, the /dev/shm usage per node at the hold, the workers' records."""

    events: list[Event]
    memory: dict[int, dict[str, int]]  # node -> {"slot": bytes, "parity": bytes}
    records: list[dict[str, Any]]

    def of(self, name: str) -> list[Event]:
        return [e for e in self.events if e["event"] == name]

    @property
    def loss(self) -> float:
        """When the injected node loss happened (the first ``inject`` event)."""
        return min(e["time"] for e in self.of("inject"))

    @property
    def state_bytes(self) -> int:
        """State bytes of one node (one rank per node; every rank has the same size)."""
        return int(self.records[0]["state_bytes"])


# -- the codec alone -------------------------------------------------------------------------------------------
@contextlib.contextmanager
def pyeclib_only() -> Iterator[None]:
    """pyeclib's own arithmetic in this process where ISA-L's kernels would compute (as without ISA-L's library)."""
    saved = os.environ.get(ENV_ISAL_LIBRARY)
    os.environ[ENV_ISAL_LIBRARY] = ""
    load_isal.cache_clear()
    try:
        yield
    finally:
        if saved is None:
            del os.environ[ENV_ISAL_LIBRARY]
        else:
            os.environ[ENV_ISAL_LIBRARY] = saved
        load_isal.cache_clear()


def codec_seconds(shape: Shape, blob: int, reps: int) -> tuple[list[float], list[float]]:
    """Seconds, per rep, of one keeper's encode (its m stripes) and of a lost node's rebuild (its k chunks) of
    blobs of ``blob`` random bytes with :mod:`ftrun.snapshot.erasure` alone, its fetches copies from memory (the
    same pipeline and thread pool as a keeper's, without the network)."""
    layout, codec, k = StripeLayout(shape.group, shape.parity), Codec(shape.k, shape.parity), shape.k
    chunk_len = layout.chunk_len([blob])
    data = bytearray(k * chunk_len)
    data[:blob] = os.urandom(blob)
    parity = [bytearray(chunk_len) for _ in range(shape.parity)]
    rebuilt = mmap.mmap(-1, k * chunk_len)

    def fetch_into(i: int, offset: int, length: int, into: memoryview) -> None:
        source = data if i < k else parity[i - k]
        start = (i * chunk_len if i < k else 0) + offset
        into[:] = memoryview(source)[start:start + length]

    encode, rebuild = [], []
    scratch = Scratch()  # a keeper's receive buffers, kept from one rebuild to the next
    with ThreadPoolExecutor(2 * shape.group) as pool:
        for _ in range(reps):
            t0 = time.perf_counter()
            for t in range(shape.parity):
                encode_parity(codec, layout, 0, t, chunk_len, fetch_into, memoryview(parity[t]), pool)
            encode.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            for chunk in range(k):
                _rebuild_into(codec, layout, chunk, chunk_len, rebuild_sources(shape, chunk), fetch_into,
                              memoryview(rebuilt), lambda end: None, pool, scratch)
            rebuild.append(time.perf_counter() - t0)
    if rebuilt[:] != data:
        raise SystemExit("the codec alone did not rebuild the data")
    return encode, rebuild


def rebuild_sources(shape: Shape, chunk: int) -> list[int]:
    """The fragments of a stripe that survive when data fragment ``chunk`` is lost; with m >= 2, as in the job,
    another data fragment of the stripe is lost too (pyeclib rebuilds then, not the XOR)."""
    also_lost = (chunk + 1) % shape.k if shape.parity > 1 and shape.k > 1 else chunk
    return [i for i in range(shape.group) if i not in (chunk, also_lost)]


# -- one keeper alone over loopback TCP ----------------------------------------------------------------------------
def pipeline_alone(shape: Shape, blob: int, reps: int) -> tuple[list[float], list[float], list[float]]:
    """Seconds, per rep, of one keeper's encode (with m >= 2, its own stripe's m parity fragments from one
    fetch of the data, m - 1 of them pushed to a peer) and of one lost node's rebuild through the real path (keeper
    transport, ``recv_into``, XOR or pyeclib, parity CRCs; the rebuild into a new /dev/shm slot file allocated
    ahead of the transfer as a keeper's, then its CRC-32; and the same rebuild into a slot file allocated before
    it began, as a replacement's keeper allocates it when told the step early) with only that keeper working:
    each peer is a transport server sending from a /dev/shm file, as a keeper does. What a node with cores of its
    own sees; the job above shares 2 cores among all its simulated nodes."""
    layout, codec, k = StripeLayout(shape.group, shape.parity), Codec(shape.k, shape.parity), shape.k
    chunk_len = layout.chunk_len([blob])
    secret = os.urandom(32)
    files, servers = [], []
    try:
        for i in range(shape.group):  # fragment i of one stripe: k data chunks, then m parity
            fd, path = tempfile.mkstemp(prefix="ftrun-bench-erasure-frag-", dir=shm_dir())
            with os.fdopen(fd, "wb") as f:
                for _ in range(0, chunk_len, 64 * MIB):
                    f.write(os.urandom(min(64 * MIB, chunk_len)))
                f.truncate(chunk_len)
            files.append(path)
            servers.append(PeerServer(secret, lambda r, path=path: Reply({}, [FileRange(path, int(r["offset"]),
                                                                                         int(r["length"]))]),
                                      max_payload=0))
            servers[-1].start()
        clients: dict[tuple[int, int], PeerClient] = {}

        def fetch_into(i: int, offset: int, length: int, into: memoryview) -> None:
            key = (i, threading.get_ident())
            if key not in clients:
                clients[key] = PeerClient(*servers[i].address, secret)
            _, got = clients[key].request("piece", into=into, offset=offset, length=length)
            assert got == length

        pushing = shape.parity > 1 and k > 1  # as a keeper: its stripe's other parity pushed to their holders
        pushed = memoryview(bytearray(chunk_len))
        receiver = PeerServer(secret, lambda r: Reply({}), max_payload=layout.piece_len,
                              sink=lambda r, n: (pushed[int(r["offset"]):int(r["offset"]) + n], lambda ok: None))
        receiver.start()
        servers.append(receiver)
        push = PeerClient(*receiver.address, secret)
        also = {u: lambda offset, piece, crc, u=u: push.request("parity_put", payload=piece, t=u, offset=offset)
                for u in range(1, shape.parity)} if pushing else {}
        out = mmap.mmap(-1, chunk_len)
        encode: list[float] = []
        rebuild: list[float] = []
        prepared: list[float] = []
        with ThreadPoolExecutor(2 * shape.group) as pool:
            scratch = Scratch()
            for _ in range(reps):
                t0 = time.perf_counter()
                for t in range(1 if pushing else shape.parity):  # each of its stripes from k data fragments
                    encode_parity(codec, layout, 0, t, chunk_len, fetch_into, memoryview(out), pool, scratch, also)
                encode.append(time.perf_counter() - t0)
                for ahead, times in ((False, rebuild), (True, prepared)):
                    path = os.path.join(shm_dir(), f"ftrun-bench-erasure-slot-{os.getpid()}")
                    try:
                        slot = SlotFile(path, HEADER_SIZE + k * chunk_len, allocate=False)  # as a rebuild's slots
                        if ahead:  # a replacement whose keeper was told the step early enough (prepare)
                            AheadAllocator([(slot, slot.size)]).ready(slot.size)
                        t0 = time.perf_counter()
                        memory = AheadAllocator([(slot, slot.size)])
                        for chunk in range(k):  # the lost node's k chunks, each from k other fragments
                            _rebuild_into(codec, layout, chunk, chunk_len, rebuild_sources(shape, chunk),
                                          fetch_into, slot.payload(), lambda end: memory.ready(HEADER_SIZE + end),
                                          pool, scratch)
                        memory.ready(memory.total)
                        crc32(slot.payload())
                        times.append(time.perf_counter() - t0)
                        slot.close()
                    finally:
                        os.unlink(path)
        for client in [*clients.values(), push]:
            client.close()
        return encode, rebuild, prepared
    finally:
        for server in servers:
            server.close()
        for path in files:
            os.unlink(path)


def _rebuild_into(codec: Codec, layout: StripeLayout, chunk: int, chunk_len: int, sources: list[int],
                  fetch_into: Any, blob: memoryview, ready: Callable[[int], None], pool: ThreadPoolExecutor,
                  scratch: Scratch) -> None:
    """Chunk ``chunk`` of the blob in ``blob``'s memory, rebuilt as a keeper does: each fetch and write first
    waits for ``ready(end)`` of the blob bytes it brings (its views die with this call)."""
    base = chunk * chunk_len
    view = blob[base:base + chunk_len]
    segments = [Segment(o, n, view[o:o + n]) for o, n in layout.pieces(chunk_len)]

    def fetch_ready(i: int, offset: int, length: int, into: memoryview) -> None:
        ready(base + offset + length)
        fetch_into(i, offset, length, into)

    def write(offset: int, data: Any) -> None:
        ready(base + offset + len(data))
        view[offset:offset + len(data)] = data

    rebuild_chunk(codec, layout, chunk, chunk_len, sources, fetch_ready, segments, write, pool, scratch)


# -- plain TCP copy --------------------------------------------------------------------------------------------
def tcp_copy_seconds(nbytes: int, reps: int, fresh: bool = False) -> list[float]:
    """Seconds of loopback TCP copies of ``nbytes`` from a /dev/shm file (sendfile) into a faulted buffer, or
    with ``fresh`` into a new /dev/shm file (its pages allocated as they are received, as a new node's are)."""
    fd, path = tempfile.mkstemp(prefix="ftrun-bench-erasure-tcp-", dir=shm_dir())
    server = socket.create_server(("127.0.0.1", 0))
    try:
        with os.fdopen(fd, "wb") as f:
            for start in range(0, nbytes, 64 * MIB):
                f.write(bytes(min(64 * MIB, nbytes - start)))
        sender = threading.Thread(target=_send_file, args=(server, path, nbytes, reps), daemon=True)
        sender.start()
        buffer = memoryview(bytearray(b"\1") * nbytes)
        times = [_receive_fresh(server.getsockname(), nbytes) if fresh else _receive(server.getsockname(), buffer)
                 for _ in range(reps)]
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


def _receive_fresh(address: tuple[str, int], nbytes: int) -> float:
    path = os.path.join(shm_dir(), f"ftrun-bench-erasure-copy-{os.getpid()}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        t0 = time.perf_counter()
        os.ftruncate(fd, nbytes)
        with mmap.mmap(fd, nbytes) as memory:
            view = memoryview(memory)
            _receive(address, view)
            seconds = time.perf_counter() - t0
            view.release()
        return seconds
    finally:
        os.close(fd)
        os.unlink(path)


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
               "--hang-timeout-initial", "600", *(("--spares", str(args.spares)) if args.spares else ()),
               *(x for node in shape.lost for x in ("--inject", f"node-loss@node={node},step={args.loss_at}")),
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
    encode_alone: float  # seconds, the codec alone
    rebuild_alone: float  # seconds, the codec alone
    pyeclib_alone: tuple[float, float] | None  # (encode, rebuild) seconds, the codec alone with pyeclib's arithmetic
    encode_tcp: float  # seconds, one keeper alone over loopback TCP
    rebuild_tcp: float  # seconds, one rebuild alone over loopback TCP
    rebuild_prepared: float  # the same into slots allocated before it began
    keepers: dict[int, float]  # node -> median seconds of its steady encodes
    pushed: float | None  # share of the parity fragments k + t (t >= 1) pushed by their stripe's position
    protected_every: float  # median seconds between two steps protected by the whole group (steady)
    allocating: float  # median seconds of the keepers' first two encodes
    parity_bytes: int
    rebuilt: Event  # the slowest rebuild of the lost nodes
    tcp: float  # seconds of a plain TCP copy of the rebuilt bytes
    tcp_fresh: float  # the same into new /dev/shm memory
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
        return f"{sum(final)} of {self.shape.nnodes} bit-exact"


def steady_encodes(job: Job) -> tuple[dict[int, float], list[float]]:
    """Per keeper, the median seconds of its encodes before the node loss but its first two; and those first."""
    loss = job.loss
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


def pushed_share(job: Job, parity: int) -> float | None:
    """Of the parity fragments k + t, t >= 1, that the keepers committed before the node loss, the share their
    stripes' own positions pushed (None with m = 1)."""
    loss = job.loss
    events = [e for e in job.of("parity") if e["time"] < loss]
    if parity < 2 or not events:
        return None
    return sum(len(e.get("pushed", [])) for e in events) / (len(events) * (parity - 1))


def protection_interval(job: Job) -> float:
    """Median seconds between two consecutive steps protected by parity on every node of the group (``protected``
    events) before the node loss, past the first two (they allocate the parity files)."""
    loss = job.loss
    times = sorted(e["time"] for e in job.of("protected") if e["time"] < loss)[ALLOCATION_ENCODES:]
    if len(times) < 2:
        raise SystemExit("fewer than two steps protected before the node loss past the first two: raise --loss-at")
    return med([b - a for a, b in zip(times, times[1:])])


def measure(shape: Shape, args: argparse.Namespace, workdir: str) -> Result:
    job = run_job(shape, args, workdir)
    steady, first = steady_encodes(job)
    encode, rebuild = codec_seconds(shape, job.state_bytes, args.reps)
    pyeclib_alone = None
    if shape.parity > 1:
        with pyeclib_only():
            encode_pyeclib, rebuild_pyeclib = codec_seconds(shape, job.state_bytes, args.reps)
        pyeclib_alone = med(encode_pyeclib), med(rebuild_pyeclib)
    encode_tcp, rebuild_tcp, rebuild_prepared = pipeline_alone(shape, job.state_bytes, args.reps)
    rebuilt = max(job.of("rebuilt"), key=lambda e: e["seconds"])
    tcp = tcp_copy_seconds(rebuilt["bytes"], args.reps)
    tcp_fresh = tcp_copy_seconds(rebuilt["bytes"], args.reps, fresh=True)
    return Result(shape, job.state_bytes, med(encode), med(rebuild), pyeclib_alone, med(encode_tcp),
                  med(rebuild_tcp), med(rebuild_prepared), steady, pushed_share(job, shape.parity),
                  protection_interval(job), med(first), job.of("parity")[0]["parity_bytes"], rebuilt, med(tcp),
                  med(tcp_fresh), job.of("recovered")[0]["seconds"], job.memory, job.records)


# -- training with parity on and off ---------------------------------------------------------------------------
def training_rate(args: argparse.Namespace, workdir: str, parity: int, rep: int) -> tuple[float, list[float]]:
    """Steps per second of 3 nodes x 1 trainer computing (``--matmuls`` matrix products per step) with a
    snapshot every ``--every`` steps, in EC groups of 3 with ``parity`` parity (0: no redundancy), past the first
    :data:`UNTIMED_SNAPSHOTS`; the shares of a trainer's time spent in the Snapshotter's ``wait()`` and
    ``save()`` then, of the rank that spent most; and the most seconds a rank spent in them before."""
    job = f"bench-erasure-train{parity}-{rep}-{os.getpid()}"
    out_dir = os.path.join(workdir, job)
    os.makedirs(out_dir)
    command = [sys.executable, "-m", "ftrun", "--nnodes", "3", "--nproc-per-node", "1", "--ec-group", "3",
               "--ec-parity", str(parity), "--rdzv-id", job, "--log-dir", f"{out_dir}-logs", str(WORKER),
               "--size-mib", str(args.size_mib), "--steps", str(args.train_steps), "--every", str(args.every),
               "--matmuls", str(args.matmuls), "--step-time", str(args.train_sleep), "--out-dir", out_dir,
               "--timed-from", str(UNTIMED_SNAPSHOTS * args.every)]
    try:
        done = subprocess.run(command, capture_output=True, timeout=JOB_TIMEOUT)
    finally:
        remove_leftovers(job)
    records = [json.loads(p.read_text()) for p in sorted(Path(out_dir).glob("rank*-gen0.json"))]
    timed = [x for x in records if "steps_per_second" in x]
    if done.returncode != 0 or len(timed) != 3:
        raise SystemExit(f"the training job failed (exit code {done.returncode}): {done.stdout[-3000:]!r}")
    most = max(timed, key=lambda x: sum(x["blocked_share"]))
    rate = min(x["steps_per_second"] for x in timed)  # the job goes at its slowest rank's pace
    return rate, [*most["blocked_share"], max(x["startup_blocked"] for x in timed)]


Training = tuple[list[tuple[float, list[float]]], list[tuple[float, list[float]]]]


def training_ratio(args: argparse.Namespace, workdir: str) -> Training:
    """:func:`training_rate` with parity on (m = 1) and off, alternating, ``--train-reps`` times each."""
    on, off = [], []
    for rep in range(args.train_reps):
        off.append(training_rate(args, workdir, 0, rep))
        on.append(training_rate(args, workdir, 1, rep))
    return on, off


# -- report ----------------------------------------------------------------------------------------------------
def row(label: str, *cells: str) -> None:
    print(f"  {label:<44}" + "".join(f"{c:>37}" for c in cells).rstrip())


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def report(results: list[Result], args: argparse.Namespace) -> None:
    print(f"\nstate {results[0].state / MIB:.0f} MiB per rank, one rank per node, a snapshot every step; "
          f"{DEFAULT_BACKEND}; medians of {args.reps} (codec alone, TCP copy) and over steps (keepers)"
          + (f"; the jobs with {args.spares} hot spare(s)" if args.spares else ""))
    for r in results:
        s = r.shape
        print(f"  {s.name}: --nnodes {s.nnodes} {' '.join(s.flags) or '(default groups)'}: G={s.group}, m={s.parity},"
              f" k={s.k}; nodes {','.join(map(str, s.lost))} lost; parity per node {r.parity_bytes / r.state:.3f} x "
              "the state")
    print()
    row("", *(r.shape.name for r in results))
    row("encode per keeper: codec alone", *(r.gbs(r.encode_alone) for r in results))
    row("  with pyeclib's arithmetic (no ISA-L kernels)", *("-" if r.pyeclib_alone is None else
                                                           r.gbs(r.pyeclib_alone[0]) for r in results))
    row("encode: one keeper alone over TCP", *(r.gbs(r.encode_tcp) for r in results))
    row("encode per keeper: end to end (parity events)", *(r.gbs(r.encode) for r in results))
    row("  each keeper, node 0, 1, ... (GB/s)", *(spread([r.state / t / GB for t in r.keepers.values()])
                                                  for r in results))
    row("  first two encodes (parity files allocated)", *(r.gbs(r.allocating) for r in results))
    row("  a step protected on every node every (s)", *(f"{r.protected_every:.3f} s" for r in results))
    row("  parity k+1.. pushed by the stripe's position", *("-" if r.pushed is None else f"{r.pushed:.0%}"
                                                            for r in results))
    row("rebuild of a lost node (slowest rebuilt event)", *(f"{r.rebuilt['seconds']:.3f} s" for r in results))
    row("  bytes rebuilt", *(f"{r.rebuilt['bytes'] / MIB:.1f} MiB" for r in results))
    row("  bytes read from the survivors (k x)", *(sources(r) for r in results))
    row("  its phases in the job (s)", *(phases(r.rebuilt) for r in results))
    row("  its slots allocated before it began", *(f"{r.rebuilt.get('allocated_ahead', 0) / (r.rebuilt['bytes']):.0%}"
                                                   for r in results))
    row("  codec alone", *(f"{r.rebuild_alone:.3f} s" for r in results))
    row("  with pyeclib's arithmetic (no ISA-L kernels)", *("-" if r.pyeclib_alone is None else
                                                           f"{r.pyeclib_alone[1]:.3f} s" for r in results))
    row("  one rebuild alone over TCP (allocation, CRC)", *(f"{r.rebuild_tcp:.3f} s" for r in results))
    row("  the same into slots allocated before", *(f"{r.rebuild_prepared:.3f} s" for r in results))
    row("plain TCP copy of the bytes rebuilt", *(f"{r.tcp:.3f} s" for r in results))
    row("  rebuild / TCP copy", *(f"{r.rebuilt['seconds'] / r.tcp:.2f}" for r in results))
    row("  one rebuild alone / TCP copy", *(f"{r.rebuild_tcp / r.tcp:.2f}" for r in results))
    row("  the same into slots allocated before / TCP", *(f"{r.rebuild_prepared / r.tcp:.2f}" for r in results))
    row("  (TCP copy into new /dev/shm memory: the pages", *(f"{r.tcp_fresh:.3f} s" for r in results))
    row("   a new node allocates / into faulted memory)", *(f"{r.tcp_fresh / r.tcp:.2f}" for r in results))
    row("recovery: failure seen to every rank beating", *(f"{r.recovery:.2f} s" for r in results))
    row("memory per node / state: 2 + 2m/k", *(f"{r.shape.expected_memory:.2f}" for r in results))
    row("  measured, node 0, 1, ...", *(spread(r.memory_ratio()) for r in results))
    row("  of which slots + parity files (median)", *(parts(r) for r in results))
    row("restored after the loss", *(r.restored() for r in results))
    row("final state vs a run without failure", *(r.exact() for r in results))
    print("\ntargets")
    for r in results:
        s = r.shape
        if s.encode_target is not None:
            rate, alone = r.state / r.encode / GB, r.state / r.encode_tcp / GB
            print(f"  {s.name}: encode end to end {rate:.2f} GB/s per keeper in the job, {alone:.2f} alone, target "
                  f">= {s.encode_target}: {verdict(rate >= s.encode_target)} in the job, "
                  f"{verdict(alone >= s.encode_target)} alone")
        ratio, alone, ahead = r.rebuilt["seconds"] / r.tcp, r.rebuild_tcp / r.tcp, r.rebuild_prepared / r.tcp
        print(f"  {s.name}: rebuild / TCP copy {ratio:.2f} in the job, {alone:.2f} alone, {ahead:.2f} alone into "
              f"slots allocated before, target <= {s.rebuild_target}: {verdict(ratio <= s.rebuild_target)} in the "
              f"job, {verdict(alone <= s.rebuild_target)} alone, {verdict(ahead <= s.rebuild_target)} allocated "
              "before")
        most = max(r.memory_ratio())
        print(f"  {s.name}: memory per node {most:.2f} x the state, target <= {s.expected_memory:.2f}: "
              f"{verdict(most <= s.expected_memory + 0.02)}")


def report_training(training: Training, args: argparse.Namespace) -> None:
    on, off = ([rate for rate, _ in runs] for runs in training)
    blocked_on, blocked_off = ([f"{100 * wait:.1f}+{100 * save:.1f}" for _, (wait, save, _) in runs]
                               for runs in training)
    startup_on, startup_off = ([start for _, (_, _, start) in runs] for runs in training)
    ratio = med(on) / med(off)
    print(f"  training, 3 nodes, a snapshot every {args.every} steps: {med(on):.2f} steps/s with parity, "
          f"{med(off):.2f} without ({spread(on)} / {spread(off)}): {ratio:.3f}, target >= 0.97: "
          f"{verdict(ratio >= 0.97)}")
    print(f"    % of the time in wait() + save(), the rank most in them: {' '.join(blocked_on)} with parity, "
          f"{' '.join(blocked_off)} without")
    print(f"    before that, the first {UNTIMED_SNAPSHOTS} snapshots (s): {spread(startup_on)} with parity, "
          f"{spread(startup_off)} without")


def sources(r: Result) -> str:
    """What the rebuild read, from which nodes, and how many of the group were lost at once (the injected
    losses may fall in two generations: then one at a time)."""
    lost = r.shape.group - len(r.rebuilt["sources"])
    return (f"{r.shape.k} x {r.rebuilt['bytes'] / MIB:.0f} MiB from {','.join(map(str, r.rebuilt['sources']))} "
            f"({lost} lost)")


def parts(r: Result) -> str:
    return f"{med(r.memory_ratio(('slot',))):.2f} + {med(r.memory_ratio(('parity',))):.2f}"


def phases(event: Event) -> str:
    """A rebuilt event's phases, short: meta, claim, transfer, verify, and the transfer's wait for memory."""
    return " ".join(f"{value:.2f}" for value in event.get("phases", {}).values())


def spread(values: list[float]) -> str:
    return " ".join(f"{v:.2f}" for v in values)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=256, help="state per rank (MiB)")
    parser.add_argument("--reps", type=int, default=5, help="repetitions of the codec timings and the TCP copy")
    parser.add_argument("--steps", type=int, default=16, help="training steps (a snapshot after each)")
    parser.add_argument("--hold-at", type=int, default=4, help="step at which /dev/shm is measured")
    parser.add_argument("--loss-at", type=int, default=10, help="step at which node 1 is lost")
    parser.add_argument("--step-time", type=float, default=0.05, help="seconds of sleep per training step")
    parser.add_argument("--train-steps", type=int, default=200, help="steps of each training-throughput job")
    parser.add_argument("--every", type=int, default=10, help="snapshot interval of the training-throughput jobs")
    parser.add_argument("--matmuls", type=int, default=30, help="256 x 256 matrix products per step of those jobs")
    parser.add_argument("--train-sleep", type=float, default=0.07,
                        help="seconds each of their steps waits with the CPU idle (a GPU step's kernels)")
    parser.add_argument("--train-reps", type=int, default=2, help="training-throughput jobs with parity on and off")
    parser.add_argument("--shapes", nargs="*", default=None, choices=[s.name for s in SHAPES],
                        help="names of the shapes to run (default: all; none: only the training jobs)")
    parser.add_argument("--spares", type=int, default=0,
                        help="hot spares of the node-loss jobs (each allocates the slots it would rebuild while it "
                             "waits; as many as nodes lost: every rebuild writes into memory allocated before)")
    parser.add_argument("--no-training", action="store_true", help="skip the training-throughput jobs")
    parser.add_argument("--quick", action="store_true", help="16 MiB, 2 repetitions, 12 steps: a smoke check")
    args = parser.parse_args()
    if args.quick:
        args.size_mib, args.reps, args.steps, args.hold_at, args.loss_at = 16, 2, 12, 3, 8
        args.train_steps, args.train_reps, args.matmuls = (UNTIMED_SNAPSHOTS + 2) * args.every, 1, 20
    if not 0 < args.hold_at < args.loss_at < args.steps:
        parser.error("need 0 < --hold-at < --loss-at < --steps")
    if args.train_steps <= UNTIMED_SNAPSHOTS * args.every:
        parser.error(f"--train-steps must be more than {UNTIMED_SNAPSHOTS} x --every (the untimed snapshots)")
    shapes = [s for s in SHAPES if args.shapes is None or s.name in args.shapes]
    reuse_large_blocks()  # the rows timed in this process allocate as a keeper does
    workdir = tempfile.mkdtemp(prefix="ftrun-bench-erasure-")
    try:
        if shapes:
            report([measure(shape, args, workdir) for shape in shapes], args)
        if not args.no_training:
            report_training(training_ratio(args, workdir), args)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
