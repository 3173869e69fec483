"""Prints ``hello from rank R`` on stdout and ``err from rank R`` on stderr. --allreduce: a gloo all_reduce of
rank + 1 over the world, printed as ``sum S world W``. --wait-usr1: prints ``ready``, waits (up to 30 s) for
SIGUSR1, prints ``got SIGUSR1 in rank R``, then sleeps until stopped (``KeyboardInterrupt in rank R`` when
stopped by SIGINT)."""

import os
import signal
import sys
import time

rank = os.environ["RANK"]
print(f"hello from rank {rank} role {os.environ['ROLE_NAME']}", flush=True)
print(f"err from rank {rank}", file=sys.stderr, flush=True)
if "--allreduce" in sys.argv:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    total = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(total)
    print(f"sum {int(total.item())} world {dist.get_world_size()}", flush=True)
    dist.destroy_process_group()
if "--wait-usr1" in sys.argv:
    got = []
    signal.signal(signal.SIGUSR1, lambda *_: got.append(True))
    print(f"ready {rank}", flush=True)
    try:
        deadline = time.monotonic() + 30
        while not got and time.monotonic() < deadline:
            time.sleep(0.02)
        print(f"got SIGUSR1 in rank {rank}" if got else f"no SIGUSR1 in rank {rank}", flush=True)
        time.sleep(30)
    except KeyboardInterrupt:
        print(f"KeyboardInterrupt in rank {rank}", flush=True)
