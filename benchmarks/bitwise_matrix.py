"""The exact-resumption matrix: {DDP 2, 3, 4 ranks} x {crash, hang, node loss} x {loop, StatefulDataLoader}.

Every point runs ``tests/scripts/ddp_steps.py`` (a default DDP module, dropout, a step LR schedule, the README's
three ftrun lines and nothing else) under ftrun with one injected failure, and compares the final state hash and
the sample ids of every step with the failure-free run of the same shape and data source. Shapes: 2 ranks as
2 nodes x 1, 3 ranks as 3 nodes x 1, 4 ranks as 2 nodes x 2 (node loss needs 2 nodes or more; parity is the
default: m = 1). Failures land mid-epoch (an epoch is 12, 8 and 6 steps for 2, 3 and 4 ranks; a snapshot every
5 steps). The data source "stateful" is a StatefulDataLoader with 2 workers over a shuffling DistributedSampler.

    .venv/bin/python benchmarks/bitwise_matrix.py              # 24 runs, about 4 minutes here
    .venv/bin/python benchmarks/bitwise_matrix.py --ranks 3    # one row of shapes

Exit status 1 when any point differs from its failure-free run.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "scripts" / "ddp_steps.py"
SHAPES = {2: ("--nnodes", "2", "--nproc-per-node", "1"), 3: ("--nnodes", "3", "--nproc-per-node", "1"),
          4: ("--nnodes", "2", "--nproc-per-node", "2")}
FAILURES = {"crash": ("--inject", "crash@rank=1,step=13"),
            "hang": ("--hang-timeout", "2", "--inject", "hang@rank=1,step=13"),
            "node loss": ("--inject", "node-loss@node=1,step=13")}
DATA = {"loop": ("--data", "loop"), "stateful": ("--data", "stateful", "--workers", "2")}
STEPS = "24"


def run(folder: Path, ftrun_flags: tuple[str, ...], script_flags: tuple[str, ...]) -> tuple[str, dict, float]:
    """One ftrun job; (final hash, {rank file: {step: ids}}, seconds). Raises when it fails."""
    ids = folder / "ids"
    ids.mkdir(parents=True)
    out = folder / "hash"
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "ftrun", "--rdzv-id", f"m{uuid.uuid4().hex[:10]}", *ftrun_flags,
                           str(SCRIPT), "--steps", STEPS, "--ids", str(ids), "--out", str(out), "--step-time", "0.02",
                           *script_flags], capture_output=True, text=True, timeout=300)
    seconds = time.perf_counter() - t0
    if done.returncode != 0:
        raise RuntimeError(f"ftrun exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    steps = {}
    for path in sorted(ids.glob("rank*.txt")):
        last: dict[int, str] = {}
        for line in path.read_text().splitlines():
            step, _, rest = line.partition(" ")
            last[int(step)] = rest
        steps[path.name] = last
    return out.read_text().strip(), steps, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="*", default=sorted(SHAPES), choices=sorted(SHAPES))
    parser.add_argument("--data", nargs="*", default=list(DATA), choices=list(DATA))
    args = parser.parse_args()
    bad = 0
    print(f"{'ranks':>5}  {'data':<8}  {'failure':<9}  {'state':<9}  {'sample ids':<10}  {'seconds':>7}")
    with tempfile.TemporaryDirectory(prefix="ftrun-matrix-") as tmp:
        for ranks in args.ranks:
            for data in args.data:
                base = Path(tmp) / f"{ranks}-{data}"
                expected, expected_ids, seconds = run(base / "straight", SHAPES[ranks], DATA[data])
                print(f"{ranks:>5}  {data:<8}  {'none':<9}  {expected[:9]:<9}  {'':<10}  {seconds:7.1f}", flush=True)
                for failure, flags in FAILURES.items():
                    name = failure.replace(" ", "-")
                    try:
                        final, ids, seconds = run(base / name, (*SHAPES[ranks], *flags), DATA[data])
                    except RuntimeError as err:
                        bad += 1
                        print(f"{ranks:>5}  {data:<8}  {failure:<9}  FAILED: {err}", flush=True)
                        continue
                    same, same_ids = final == expected, ids == expected_ids
                    bad += not (same and same_ids)
                    print(f"{ranks:>5}  {data:<8}  {failure:<9}  {'equal' if same else 'DIFFERS':<9}  "
                          f"{'equal' if same_ids else 'DIFFER':<10}  {seconds:7.1f}", flush=True)
    print(f"{bad} point(s) differ from the failure-free run")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
