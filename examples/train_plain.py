"""A plain deterministic DDP training script that checkpoints itself: runs unchanged under torchrun or ftrun.

It uses no ftrun API except a guarded ``ftrun.heartbeat``, so it shows what ftrun gives a script without
code changes: crash and hang detection and global in-place restarts. Every ``--ckpt-every`` steps rank 0
writes model, optimizer and step to ``--ckpt-dir`` (atomically); on start every rank resumes from it. The
batch of a step is drawn from a generator seeded by (step, rank), so a resumed run is bit-for-bit the run
that did not fail (see the DDP warm-up below: a script that keeps its own checkpoints needs it; the Snapshotter
does it for scripts that use it). At the end rank 0 writes the SHA-256 of the final parameters and optimizer state.

    ftrun --nnodes 2 --nproc-per-node 2 examples/train_plain.py --steps 60 --ckpt-dir /tmp/ck --out /tmp/h
"""

from __future__ import annotations

import argparse
import hashlib
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

try:
    from ftrun import heartbeat
except ImportError:  # plain torchrun without ftrun installed
    def heartbeat(step: int | None = None) -> None:
        pass


def state_hash(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    for index, state in sorted(optimizer.state_dict()["state"].items()):
        for key, value in sorted(state.items()):
            digest.update(f"{index}.{key}".encode())
            digest.update(value.cpu().contiguous().numpy().tobytes() if torch.is_tensor(value)
                          else repr(value).encode())
    return digest.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--ckpt-dir", required=True)
    parser.add_argument("--ckpt-every", type=int, default=5)
    parser.add_argument("--out", help="file for the final state hash (rank 0)")
    parser.add_argument("--step-time", type=float, default=0.0, help="extra seconds per step (slower runs)")
    parser.add_argument("--fail-always", action="store_true", help="raise on rank 0 at the first step")
    parser.add_argument("--raise-at", type=int, help="raise on rank 0 at this step of the first generation")
    args = parser.parse_args()

    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
        torch.use_deterministic_algorithms(True)

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    path = os.path.join(args.ckpt_dir, "checkpoint.pt")
    start = 0
    if os.path.exists(path):
        checkpoint = torch.load(path, map_location=device, weights_only=True)
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        start = checkpoint["step"]
        if rank == 0:
            print(f"resumed from step {start} (restart {os.environ.get('TORCHELASTIC_RESTART_COUNT')})", flush=True)
    ddp = DistributedDataParallel(model)
    # DDP re-buckets gradients after its first backward (in the order they became ready), which changes the
    # order of the floating-point sums in the all-reduce. One warm-up backward without an optimizer step at
    # every start makes every real step use the re-built buckets, so a resumed run stays bitwise equal.
    ddp(torch.zeros(1, 32, device=device)).sum().backward()
    optimizer.zero_grad(set_to_none=True)

    for step in range(start, args.steps):
        if rank == 0 and (args.fail_always
                          or (step == args.raise_at and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0")):
            raise RuntimeError(f"injected exception at step {step}")
        generator = torch.Generator().manual_seed(step * 1000 + rank)
        x = torch.randn(16, 32, generator=generator).to(device)
        y = x.sum(dim=1, keepdim=True).sin()
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if args.step_time:
            time.sleep(args.step_time)
        heartbeat(step + 1)
        if rank == 0 and (step + 1) % args.ckpt_every == 0:
            os.makedirs(args.ckpt_dir, exist_ok=True)
            tmp = path + ".tmp"
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step + 1}, tmp)
            os.replace(tmp, path)

    if rank == 0 and args.out:
        with open(args.out, "w") as f:
            f.write(state_hash(model, optimizer) + "\n")
        print(f"final state hash {state_hash(model, optimizer)[:16]}", flush=True)
    # Free DDP's reducer while the process group is still registered: freeing it after
    # destroy_process_group() joins gloo's threads with the GIL held and can deadlock (torch 2.13).
    del ddp
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
