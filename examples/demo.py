"""`make run`: the tiny GPT (examples/train_gpt.py, RAM snapshots every 10 steps) on 2 simulated nodes x 2
trainers, once without failures and once with an injected crash and an injected hang, both recovered from the
snapshots in RAM; ends by checking that both runs end with bit-identical parameters and optimizer state."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

FTRUN = [sys.executable, "-m", "ftrun"]
SCRIPT = Path(__file__).with_name("train_gpt.py")
STEPS = 60


def train(workdir: Path, name: str, faults: list[str]) -> str:
    out = workdir / f"{name}.hash"
    command = [*FTRUN, "--nnodes", "2", "--nproc-per-node", "2", "--hang-timeout", "3",
               "--log-dir", str(workdir / name / "logs"), *[arg for f in faults for arg in ("--inject", f)],
               str(SCRIPT), "--steps", str(STEPS), "--snapshot-every", "10", "--out", str(out)]
    print(f"\n$ ftrun {' '.join(command[3:])}\n", flush=True)
    subprocess.run(command, check=True)
    return out.read_text().strip()


def main() -> int:
    workdir = Path(tempfile.mkdtemp(prefix="ftrun-demo-"))
    try:
        clean = train(workdir, "failure-free", [])
        faulty = train(workdir, "with-failures", ["crash@rank=1,step=25", "hang@rank=2,step=45,gen=1"])
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"\nfailure-free run:  {clean}\nwith a crash+hang: {faulty}")
    if clean != faulty:
        print("MISMATCH: the final parameters differ", file=sys.stderr)
        return 1
    print("the final parameters equal the failure-free run's, bit for bit")
    return 0


if __name__ == "__main__":
    sys.exit(main())
