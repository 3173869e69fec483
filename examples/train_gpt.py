"""A tiny deterministic character-level GPT trained with DDP, resumed bit-for-bit from ftrun RAM snapshots.

It shows the three lines a script adds to get snapshots: ``ftrun.Snapshotter`` over model, optimizer, LR
scheduler and data loader, ``restore()`` at start and ``save(step + 1)`` after every step (also the
heartbeat). The text is generated here; the loader's position (epoch, cursor) is part of the snapshot, and
dropout makes the RNG states, which the snapshot also holds, matter. A run that is restarted from a snapshot
ends in the same state as one that never failed: rank 0 writes the SHA-256 of the final state to ``--out``.
Outside ftrun the snapshots are off and it trains from scratch like any torchrun script.

    ftrun --nnodes 2 --nproc-per-node 2 examples/train_gpt.py --steps 60 --out /tmp/h
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim import AdamW, Optimizer
from torch.optim.lr_scheduler import LambdaLR, LRScheduler

import ftrun

BLOCK, EMBED, HEADS, LAYERS, DROPOUT = 32, 64, 4, 2, 0.1
WORDS = {
    "subject": "the cat|a dog|my friend|the old sailor|every child|the robot|her brother|a tired farmer",
    "verb": "sees|likes|paints|follows|forgets|builds|carries|finds",
    "adjective": "red|quiet|broken|shiny|tiny|strange|warm|ancient",
    "noun": "boat|garden|letter|mountain|lamp|river|song|castle",
    "end": ".|.|.|!|?",
}


def make_text(sentences: int = 1800, seed: int = 1234) -> str:
    """About 60 KB of sentences drawn from fixed word lists, the same on every call."""
    rng, words = random.Random(seed), {key: value.split("|") for key, value in WORDS.items()}
    pick = lambda key: rng.choice(words[key])  # noqa: E731
    return " ".join(f"{pick('subject')} {pick('verb')} the {pick('adjective')} {pick('noun')}{pick('end')}"
                    for _ in range(sentences))


class CharLoader:
    """Windows of ``BLOCK + 1`` tokens in an order set by its own state only: a permutation of every start
    offset, seeded by the epoch; each global batch is cut in disjoint per-rank shares."""

    def __init__(self, tokens: torch.Tensor, batch_size: int, rank: int, world: int) -> None:
        self.tokens, self.batch_size, self.rank, self.world = tokens, batch_size, rank, world
        self.windows = len(tokens) - BLOCK
        self.epoch, self.cursor = 0, 0
        self.order = self._permutation()

    def _permutation(self) -> torch.Tensor:
        return torch.randperm(self.windows, generator=torch.Generator().manual_seed(self.epoch))

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's (inputs, targets) of the next global batch."""
        if self.cursor + self.batch_size * self.world > self.windows:
            self.epoch, self.cursor = self.epoch + 1, 0
            self.order = self._permutation()
        first = self.cursor + self.rank * self.batch_size
        starts = self.order[first:first + self.batch_size]
        self.cursor += self.batch_size * self.world
        windows = self.tokens[starts[:, None] + torch.arange(BLOCK + 1)]
        return windows[:, :-1], windows[:, 1:]

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "cursor": self.cursor}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.cursor = state["epoch"], state["cursor"]
        self.order = self._permutation()


class Block(nn.Module):
    """Pre-norm transformer block: causal multi-head self-attention, then an MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(EMBED), nn.LayerNorm(EMBED)
        self.qkv, self.proj = nn.Linear(EMBED, 3 * EMBED), nn.Linear(EMBED, EMBED)
        self.mlp = nn.Sequential(nn.Linear(EMBED, 4 * EMBED), nn.GELU(), nn.Linear(4 * EMBED, EMBED),
                                 nn.Dropout(DROPOUT))
        self.attn_drop, self.resid_drop = nn.Dropout(DROPOUT), nn.Dropout(DROPOUT)

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        q, k, v = (t.view(batch, length, HEADS, -1).transpose(1, 2) for t in self.qkv(x).split(EMBED, dim=2))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.size(-1))
        scores = scores + torch.full((length, length), float("-inf"), device=x.device).triu(1)  # causal
        y = self.attn_drop(scores.softmax(dim=-1)) @ v
        return self.resid_drop(self.proj(y.transpose(1, 2).reshape(batch, length, EMBED)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab_size, EMBED), nn.Embedding(BLOCK, EMBED)
        for embedding in (self.tok, self.pos):
            nn.init.normal_(embedding.weight, std=0.02)
        self.drop = nn.Dropout(DROPOUT)
        self.blocks = nn.Sequential(*(Block() for _ in range(LAYERS)))
        self.ln = nn.LayerNorm(EMBED)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.tok(idx) + self.pos(torch.arange(idx.size(1), device=idx.device)))
        return self.ln(self.blocks(x)) @ self.tok.weight.T  # head tied to the token embedding


def build(vocab_size: int, steps: int, device: torch.device) -> tuple[GPT, AdamW, LambdaLR]:
    """Model (identical on every rank), AdamW (weight decay on matrices only), warm-up + cosine LR."""
    torch.manual_seed(0)
    model = GPT(vocab_size).to(device)
    params = list(model.parameters())
    optimizer = AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                       {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}], lr=3e-3)
    return model, optimizer, LambdaLR(optimizer, lambda step: lr_factor(step, steps))


def lr_factor(step: int, steps: int) -> float:
    """Linear warm-up over the first tenth of the steps, then cosine decay to a tenth of the peak."""
    warmup, progress = max(1, steps // 10), min(step / max(steps, 1), 1.0)
    return min((step + 1) / warmup, 0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


def train_step(ddp: DistributedDataParallel, optimizer: Optimizer, scheduler: LRScheduler, loader: CharLoader,
               device: torch.device) -> torch.Tensor:
    inputs, targets = (t.to(device) for t in loader.next_batch())
    logits = ddp(inputs)
    loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
    optimizer.step()
    scheduler.step()
    return loss.detach()


def state_hash(model: nn.Module, optimizer: Optimizer, scheduler: LRScheduler, loader: CharLoader) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    for index, state in sorted(optimizer.state_dict()["state"].items()):
        for key, value in sorted(state.items()):
            digest.update(f"{index}.{key}".encode())
            data = value.cpu().contiguous().numpy().tobytes() if torch.is_tensor(value) else repr(value).encode()
            digest.update(data)
    digest.update(repr((scheduler.last_epoch, loader.state_dict())).encode())
    return digest.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--snapshot-every", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per rank and step")
    parser.add_argument("--out", help="file for the final state hash (rank 0)")
    parser.add_argument("--step-time", type=float, default=0.0, help="extra seconds per step (slower runs)")
    parser.add_argument("--log-every", type=int, default=10, help="print rank 0's loss every N steps")
    parser.add_argument("--backend", help="process group backend (default: nccl with CUDA, else gloo; gloo with "
                        "CUDA runs several ranks on one GPU)")
    args = parser.parse_args()

    use_cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if use_cuda else torch.device("cpu")
    if use_cuda:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS
        torch.use_deterministic_algorithms(True)
        torch.cuda.set_device(device)
    dist.init_process_group(args.backend or ("nccl" if use_cuda else "gloo"))
    rank, world = dist.get_rank(), dist.get_world_size()

    text = make_text()
    vocab = sorted(set(text))
    loader = CharLoader(torch.tensor([vocab.index(c) for c in text]), args.batch_size, rank, world)
    model, optimizer, scheduler = build(len(vocab), args.steps, device)
    torch.manual_seed(1000 + rank)  # per-rank dropout; the snapshot holds these RNG states
    random.seed(rank)
    np.random.seed(rank)
    ddp = DistributedDataParallel(model)

    snap = ftrun.Snapshotter({"model": model, "optim": optimizer, "sched": scheduler, "data": loader},
                             every=args.snapshot_every)
    start = snap.restore()
    if rank == 0:
        print(f"starting at step {start} (restart {os.environ.get('TORCHELASTIC_RESTART_COUNT')})", flush=True)
    for step in range(start, args.steps):
        loss = train_step(ddp, optimizer, scheduler, loader, device)
        if rank == 0 and (step + 1) % args.log_every == 0:
            print(f"step {step + 1} loss {loss.item():.4f}", flush=True)
        if args.step_time:
            time.sleep(args.step_time)
        snap.save(step + 1)
    snap.wait()

    if rank == 0 and args.out:
        digest = state_hash(model, optimizer, scheduler, loader)
        with open(args.out, "w") as f:
            f.write(digest + "\n")
        print(f"final state hash {digest[:16]}", flush=True)
    # Free DDP's reducer while the process group is still registered: freeing it after
    # destroy_process_group() joins gloo's threads with the GIL held and can deadlock (torch 2.13).
    del ddp
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
