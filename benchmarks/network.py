"""Rebuild of a lost node where the network is the limit: ftrun's nodes on hosts of their own, each NIC limited.

Each node runs on a host of its own (a network namespace with a veth NIC limited to ``--rate-mbit`` megabits per
second each way, and a /dev/shm of its own: ``tests/network_hosts.py``), as on a cluster whose NICs, not its
memory or cores, bound how fast bytes move between machines. For each shape, a real ftrun job of
:mod:`erasure_worker` (``--size-mib`` of state per rank, a snapshot every step): one launcher per host
(``--node-rank``, ``--local-addr``) and a ``--standby`` on one more host per lost node. ``--inject node-loss`` kills
node 1 whole at step ``--loss-at`` (nodes 1 and 2 with m = 2); a standby takes each lost rank and its keeper
rebuilds the lost node's slots from the survivors.

Reported per shape: the slowest ``rebuilt`` event (seconds; relayed through the survivors or fetched directly) against a
plain TCP copy of as many bytes from one host to another through the same NICs (``sendfile`` from /dev/shm into
``recv_into``; best of ``--reps``), and whether every rank ended bit for bit as without the failure. With
``--compare TREE``, each job runs first with another checkout of ftrun (``PYTHONPATH=TREE``: a git worktree of
an older commit), side by side with this one.

Needs root and iproute2 (it says so otherwise). The hosts share this machine's cores: keep ``--rate-mbit`` well
below what loopback TCP reaches here, so that the NICs stay the limit.

    .venv/bin/python benchmarks/network.py                         # 256 MiB per rank, 2 Gbit/s, about 2 minutes
    .venv/bin/python benchmarks/network.py --compare /tmp/before   # and the same with an older checkout
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from statistics import median
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the simulated hosts

from network_hosts import Hosts, hosts_problem  # noqa: E402

WORKER = Path(__file__).resolve().parent / "erasure_worker.py"
ROOT = Path(__file__).resolve().parent.parent
PORT = 29450  # the control store's, on host 0
JOB_TIMEOUT = 600
MIB = 1 << 20
COPY = """
import os, socket, sys, time
size, role = int(sys.argv[1]), sys.argv[2]
if role == "receive":
    server = socket.create_server(("0.0.0.0", int(sys.argv[3])))
    print("ready", flush=True)
    buffer = memoryview(bytearray(b"\\1") * size)
    for _ in range(int(sys.argv[4])):
        conn, _ = server.accept()
        t0, got = time.perf_counter(), 0
        while got < size:
            n = conn.recv_into(buffer[got:])
            if n == 0:
                sys.exit("copy cut short")
            got += n
        print(time.perf_counter() - t0, flush=True)
        conn.close()
else:
    path = f"/dev/shm/bench-copy-{os.getpid()}"
    with open(path, "wb") as f:
        f.truncate(size)
    with open(path, "rb") as f:
        for _ in range(int(sys.argv[4])):
            with socket.create_connection((sys.argv[3], int(sys.argv[5]))) as sock:
                sock.sendfile(f, 0, size)
            time.sleep(0.2)
    os.unlink(path)
"""


@dataclass(frozen=True)
class Shape:
    name: str
    nnodes: int
    flags: tuple[str, ...]
    lost: tuple[int, ...] = (1,)  # the nodes lost at once, each replaced by a standby


SHAPES = (Shape("EC k=2 m=1", 3, ("--ec-group", "3", "--ec-parity", "1")),
          Shape("replication k=1", 2, ()),
          Shape("EC k=4 m=2", 6, ("--ec-group", "6", "--ec-parity", "2"), (1, 2)))


def tcp_copy(hosts: Hosts, nbytes: int, reps: int) -> float:
    """Best seconds of a TCP copy of ``nbytes`` from host 0 to host 1 through their NICs."""
    port = PORT + 1
    receiver = subprocess.Popen(hosts.command(1, sys.executable, "-c", COPY, str(nbytes), "receive", str(port),
                                              str(reps)), stdout=subprocess.PIPE, text=True)
    assert receiver.stdout is not None
    receiver.stdout.readline()  # ready
    subprocess.run(hosts.command(0, sys.executable, "-c", COPY, str(nbytes), "send", hosts.address(1), str(reps),
                                 str(port)), check=True)
    times = [float(line) for line in receiver.stdout]
    receiver.wait()
    return min(times)


def run_job(hosts: Hosts, shape: Shape, args: argparse.Namespace, workdir: str, tree: str | None
            ) -> dict[str, Any]:
    """One job of ``shape`` with ftrun from ``tree`` (None: this checkout); its slowest rebuilt event and
    records."""
    job = f"bench-net-{shape.nnodes}n-{len(os.listdir(workdir))}"
    base = os.path.join(workdir, job)
    log_dir, out_dir, go = f"{base}-logs", f"{base}-out", Path(f"{base}-go")
    os.makedirs(out_dir)
    go.touch()  # no hold: the worker trains straight through
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": tree or str(ROOT)}
    common = ["--rdzv-id", job, "--log-dir", log_dir, "--nproc-per-node", "1", *shape.flags,
              "--rdzv-endpoint", f"{hosts.address(0)}:{PORT}", "--node-timeout", "2", "--max-restarts", "3",
              "--hang-timeout", "600", "--hang-timeout-initial", "600",
              *(x for node in shape.lost for x in ("--inject", f"node-loss@node={node},step={args.loss_at}")),
              str(WORKER), "--size-mib", str(args.size_mib), "--steps", str(args.steps), "--hold-at", "1",
              "--step-time", str(args.step_time), "--go", str(go), "--out-dir", out_dir]
    launchers = [[*hosts.command(i, sys.executable, "-m", "ftrun", "--nnodes", str(shape.nnodes), "--node-rank",
                                 str(i), "--local-addr", hosts.address(i), *common)]
                 for i in range(shape.nnodes)]
    launchers += [hosts.command(host, sys.executable, "-m", "ftrun", "--standby", "--local-addr",
                                hosts.address(host), *common)
                  for host in range(shape.nnodes, shape.nnodes + len(shape.lost))]
    procs = []
    with open(f"{base}.log", "wb") as log:
        for argv in launchers:
            procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          start_new_session=True, env=env))
        try:
            codes = [proc.wait(JOB_TIMEOUT) for proc in procs[:1]]
            codes += [proc.wait(60) for i, proc in enumerate(procs[1:], 1) if i not in shape.lost]  # died with them
        except subprocess.TimeoutExpired:
            codes = [-1]
        finally:
            for proc in procs:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    events = [json.loads(line) for line in Path(log_dir, "events.jsonl").read_text().splitlines()]
    rebuilt = [e for e in events if e["event"] == "rebuilt"]
    records = [json.loads(p.read_text()) for p in Path(out_dir).glob("rank*-gen*.json")]
    final = [r for r in records if "exact" in r]
    if any(codes) or len(rebuilt) != len(shape.lost):
        tail = "\n".join(Path(f"{base}.log").read_text(errors="replace").splitlines()[-30:])
        raise SystemExit(f"the job failed (exit codes {codes}, {len(rebuilt)} rebuilt events):\n{tail}")
    return {"rebuilt": max(rebuilt, key=lambda e: e["seconds"]), "each": [e["seconds"] for e in rebuilt],
            "exact": f"{sum(r['exact'] for r in final)} of {len(final)} bit-exact",
            "failures": [e["kind"] for e in events if e["event"] == "failure" and e.get("primary", True)]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate-mbit", type=float, default=2000, help="each host's NIC, each way (Mbit/s)")
    parser.add_argument("--size-mib", type=int, default=256, help="state per rank (MiB)")
    parser.add_argument("--steps", type=int, default=8, help="training steps (a snapshot after each)")
    parser.add_argument("--loss-at", type=int, default=5, help="step at which node 1 is lost")
    parser.add_argument("--step-time", type=float, default=0.3, help="seconds of sleep per step")
    parser.add_argument("--reps", type=int, default=3, help="repetitions of the TCP copy and of each job")
    parser.add_argument("--compare", metavar="TREE", help="another ftrun checkout, run side by side")
    parser.add_argument("--shapes", nargs="*", default=None, choices=[s.name for s in SHAPES],
                        help="names of the shapes to run (default: all)")
    args = parser.parse_args()
    if not 1 < args.loss_at < args.steps:
        parser.error("need 1 < --loss-at < --steps")
    problem = hosts_problem()
    if problem is not None:
        raise SystemExit(f"cannot make the hosts: {problem}")
    shapes = [s for s in SHAPES if args.shapes is None or s.name in args.shapes]
    trees = {"this checkout": None, **({f"--compare {args.compare}": args.compare} if args.compare else {})}
    hosts = Hosts(max(s.nnodes + len(s.lost) for s in shapes))
    workdir = tempfile.mkdtemp(prefix="ftrun-bench-network-")
    try:
        for i in range(len(hosts.names)):
            hosts.shape(i, rate_mbit=args.rate_mbit)
        print(f"{len(hosts.names)} hosts, NICs of {args.rate_mbit:g} Mbit/s each way; {args.size_mib} MiB per rank, "
              f"one rank per node; the shape's lost nodes lost at step {args.loss_at}; a standby takes the rank of "
              "each", flush=True)
        for shape in shapes:
            copy: float | None = None
            for label, tree in trees.items():
                runs = [run_job(hosts, shape, args, workdir, tree) for _ in range(args.reps)]
                if copy is None:
                    copy = tcp_copy(hosts, runs[0]["rebuilt"]["bytes"], args.reps)
                    print(f"\n{shape.name} ({' '.join(shape.flags) or 'default groups'}; nodes "
                          f"{','.join(map(str, shape.lost))} lost): TCP copy of "
                          f"{runs[0]['rebuilt']['bytes'] / MIB:.0f} MiB between two hosts {copy:.3f} s")
                seconds = [r["rebuilt"]["seconds"] for r in runs]
                how = {"relayed" if r["rebuilt"].get("relayed") else "direct" for r in runs}
                middle = sorted(runs, key=lambda r: r["rebuilt"]["seconds"])[len(runs) // 2]["rebuilt"]
                phases = " ".join(f"{k} {v:.3f}" for k, v in middle.get("phases", {}).items())
                print(f"  {label}: rebuild {median(seconds):.3f} s ({' '.join(f'{s:.3f}' for s in seconds)}), "
                      f"{'/'.join(sorted(how))}, {median(seconds) / copy:.2f} x the TCP copy; "
                      f"{', '.join(r['exact'] for r in runs)}; failures {runs[0]['failures']}\n"
                      f"    each lost node's rebuild (s): "
                      f"{'; '.join(' '.join(f'{x:.3f}' for x in r['each']) for r in runs)}\n"
                      f"    the median run's phases (s): {phases}", flush=True)
    except BaseException:
        print(f"the jobs' logs are kept in {workdir}", file=sys.stderr)
        raise
    else:
        subprocess.run(["rm", "-rf", workdir], check=False)
    finally:
        hosts.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
