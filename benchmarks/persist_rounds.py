"""Persisting while snapshotting at every step, on 2 simulated nodes: training time with ``--ckpt-dir`` against
without, side by side, and how many of the periodic persists reached the disk.

Runs ``examples/train_gpt.py`` (``--snapshot-every 1``) as ``--pairs`` pairs of jobs, alternating without and with
``--ckpt-dir --persist-every 5``. Training time of a job: from the first heartbeat of every rank to the last node
done (both from the job's ``events.jsonl``). Prints the medians, their ratio (persistence on / off; 1.00 means
persisting costs nothing) and, for the jobs with persistence, the persists that completed and failed and the
largest gap between consecutive persisted steps (at most ``persist-every`` plus the steps of one persist).

    .venv/bin/python benchmarks/persist_rounds.py             # 3 pairs, about 2 minutes
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PERSIST_EVERY = 5


def run(workdir: str, name: str, steps: int, ckpt: bool) -> dict:
    logs = os.path.join(workdir, name)
    flags = ["--ckpt-dir", os.path.join(workdir, "ckpt"), "--persist-every", str(PERSIST_EVERY)] if ckpt else []
    subprocess.run([sys.executable, "-m", "ftrun", "--nnodes", "2", "--log-dir", logs, *flags,
                    str(ROOT / "examples" / "train_gpt.py"), "--steps", str(steps), "--snapshot-every", "1"],
                   check=True, capture_output=True, timeout=600)
    events = [json.loads(line) for line in open(os.path.join(logs, "events.jsonl"))]
    first = next(e["time"] for e in events if e["event"] == "first_heartbeat")
    done = max(e["time"] for e in events if e["event"] == "node_done")
    persisted = [e["step"] for e in events if e["event"] == "persisted"]
    failed = sum(e["event"] == "durability" and e.get("degraded", False) for e in events)
    return {"seconds": done - first, "persisted": persisted, "failed": failed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=150)
    args = parser.parse_args()
    results: dict[bool, list[dict]] = {False: [], True: []}
    with tempfile.TemporaryDirectory(prefix="ftrun-bench-persist-") as workdir:
        for pair in range(args.pairs):
            for ckpt in (False, True):
                results[ckpt].append(run(workdir, f"{pair}-{int(ckpt)}", args.steps, ckpt))
    off = statistics.median(r["seconds"] for r in results[False])
    on = statistics.median(r["seconds"] for r in results[True])
    gaps = [b - a for r in results[True] for a, b in zip([0, *r["persisted"]], r["persisted"])]
    print(f"training {args.steps} steps, snapshot every step, 2 nodes: persistence off {off:.2f} s, "
          f"on {on:.2f} s (median of {args.pairs}); on / off = {on / off:.3f}")
    print(f"persists per job with --persist-every {PERSIST_EVERY}: completed "
          f"{[len(r['persisted']) for r in results[True]]}, failed {[r['failed'] for r in results[True]]}; "
          f"largest gap between persisted steps {max(gaps, default=0)}")


if __name__ == "__main__":
    main()
