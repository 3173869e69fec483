"""Worker of benchmarks/erasure.py (method there): one trainer per node of an ftrun job with erasure coding.

The state is :data:`TENSORS` float32 tensors of about ``--size-mib`` MiB in all, random from a seed per rank,
held as the parameters of a module, as a model's: a snapshot takes them by reference and copies them in the
background (a plain dict's tensors would be cloned in the training thread at every save). Step s adds s + 1 to
one element, so the state at any step can be recomputed. Every step waits for the previous snapshot's copy,
changes the state, saves the next step (a snapshot every step) and sleeps ``--step-time``.
The worker writes ``rank<R>-gen<G>.json`` into ``--out-dir`` after ``restore()`` (restored step, state bytes)
and again at the end, with ``exact``: whether the final state is bit for bit the one recomputed from step 0
(so the restore was exact; checked at the end not to compete with a rebuild for the CPU). In generation 0 it stops
after saving step ``--hold-at`` until the file ``--go`` exists, so the benchmark can look at /dev/shm while
nothing moves; ftrun's ``--inject node-loss`` later kills one node, whose replacement restores rebuilt slots.

Training mode (``--matmuls N``, no ``--go``): each step also multiplies two 256 x 256 matrices N times (a fixed
amount of work), a snapshot is taken every ``--every`` steps, and the final record holds ``steps_per_second``
from the end of step ``--timed-from`` to the last step, the shares of that time spent in the Snapshotter's
``wait()`` and ``save()`` (``blocked_share``), and the seconds spent in them before (``startup_blocked``: the
first snapshots wait for the job's first parity, whose files are allocated then).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from ftrun import Snapshotter

TENSORS = 4
HOLD_POLL = 0.05


def build(size_mib: int) -> dict[str, torch.Tensor]:
    """Uninitialized state tensors (a restore fills them without competing for the CPU with a rebuild)."""
    numel = max(1, (size_mib << 20) // 4 // TENSORS)
    return {f"t{i}": torch.empty(numel) for i in range(TENSORS)}


def initialize(state: dict[str, torch.Tensor], rank: int) -> None:
    """The state at step 0: random values from a generator seeded with ``rank``."""
    generator = torch.Generator().manual_seed(rank)
    for tensor in state.values():
        tensor.normal_(generator=generator)


def advance(state: dict[str, torch.Tensor], step: int) -> None:
    """The change made by ``step``: one element of one tensor grows by step + 1."""
    tensor = state[f"t{step % TENSORS}"]
    tensor[step * 7919 % tensor.numel()] += step + 1


def exact(state: dict[str, torch.Tensor], rank: int, size_mib: int, step: int) -> bool:
    """Whether ``state`` is bit for bit the state at ``step``, recomputed from step 0."""
    expected = build(size_mib)
    initialize(expected, rank)
    for s in range(step):
        advance(expected, s)
    return all(torch.equal(state[name], expected[name]) for name in state)


def record(out_dir: str, rank: int, generation: int, doc: dict[str, object]) -> None:
    path = Path(out_dir) / f"rank{rank}-gen{generation}.json"
    path.with_suffix(".tmp").write_text(json.dumps(doc))
    os.replace(path.with_suffix(".tmp"), path)


def hold(go: str) -> None:
    while not os.path.exists(go):
        time.sleep(HOLD_POLL)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag in ("--size-mib", "--steps"):
        parser.add_argument(flag, type=int, required=True)
    parser.add_argument("--hold-at", type=int, default=0, help="step after which generation 0 waits for --go")
    parser.add_argument("--step-time", type=float, default=0.0, help="seconds of sleep per step")
    parser.add_argument("--go", help="file whose existence ends the hold")
    parser.add_argument("--every", type=int, default=1, help="a snapshot every this many steps")
    parser.add_argument("--matmuls", type=int, default=0, help="256 x 256 matrix products per step")
    parser.add_argument("--timed-from", type=int, default=0, help="step after which steps per second are timed "
                        "(default: the first snapshot's)")
    parser.add_argument("--out-dir", required=True)
    args = parser.parse_args()
    rank, generation = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    state = build(args.size_mib)
    model = torch.nn.Module()
    for name, tensor in state.items():
        model.register_parameter(name, torch.nn.Parameter(tensor, requires_grad=False))
    state = dict(model.named_parameters())
    # measuring parity per step (a snapshot every step, each one awaited); training mode: as a job would
    snap = Snapshotter({"model": model}, every=args.every, rng=False, skip=args.matmuls > 0)
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    start = snap.restore()
    if start == 0:
        initialize(state, rank)
    doc: dict[str, object] = {"rank": rank, "generation": generation, "restored": start,
                              "state_bytes": sum(t.nbytes for t in state.values())}
    record(args.out_dir, rank, generation, doc)
    timed_from = None
    in_wait = in_save = startup = 0.0  # seconds in wait() and in save() from --timed-from on, and before
    for step in range(start, args.steps):
        for _ in range(args.matmuls):
            torch.mm(a, b)
        t0 = time.perf_counter()
        snap.wait()  # the copy of the previous snapshot reads the live tensors
        t1 = time.perf_counter()
        advance(state, step)
        t2 = time.perf_counter()
        snap.save(step + 1)
        if timed_from is not None:
            in_wait, in_save = in_wait + t1 - t0, in_save + time.perf_counter() - t2
        else:
            startup += t1 - t0 + time.perf_counter() - t2
        if generation == 0 and step + 1 == args.hold_at and args.go:
            hold(args.go)
        if step + 1 == (args.timed_from or args.every):
            timed_from = (step + 1, time.perf_counter())
        time.sleep(args.step_time)
    snap.wait()
    if args.matmuls and timed_from is not None:
        elapsed = time.perf_counter() - timed_from[1]
        doc["steps_per_second"] = (args.steps - timed_from[0]) / elapsed
        doc["blocked_share"] = [in_wait / elapsed, in_save / elapsed]
        doc["startup_blocked"] = startup
    record(args.out_dir, rank, generation, {**doc, "exact": exact(state, rank, args.size_mib, args.steps)})


if __name__ == "__main__":
    main()
