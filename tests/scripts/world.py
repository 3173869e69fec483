"""A gloo all_reduce of rank + 1 over the world, then writes RANK, GROUP_RANK, WORLD_SIZE and the sum to
``<--out>/<RANK>.json``; with ``--until FILE`` beats until FILE exists (at most 60 s) before exiting."""

import argparse
import json
import os
import time

import torch
import torch.distributed as dist

import ftrun

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--until")
args = parser.parse_args()
dist.init_process_group("gloo")
total = torch.tensor([dist.get_rank() + 1.0])
dist.all_reduce(total)
seen = {name: os.environ[name] for name in ("RANK", "GROUP_RANK", "WORLD_SIZE")}
seen.update(sum=int(total.item()), world=dist.get_world_size())
with open(os.path.join(args.out, f"{seen['RANK']}.json"), "w") as f:
    json.dump(seen, f)
deadline = time.monotonic() + 60
step = 0
while args.until and not os.path.exists(args.until) and time.monotonic() < deadline:
    step += 1
    ftrun.heartbeat(step)
    time.sleep(0.05)
dist.destroy_process_group()
