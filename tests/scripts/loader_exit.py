"""Ends right after its last step, as many scripts do: the loop runs a StatefulDataLoader (one worker) to the end
of its epoch, a snapshot is taken every step, and there is no ``wait()`` nor process group teardown."""

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DistributedSampler, TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

import ftrun

dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(256, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 256))
optimizer = torch.optim.AdamW(model.parameters())
data = TensorDataset(torch.randn(640, 256))
loader = StatefulDataLoader(data, batch_size=16, sampler=DistributedSampler(data), num_workers=1)
snap = ftrun.Snapshotter({"model": model, "optim": optimizer, "data": loader}, every=1)
step = snap.restore()
ddp = DistributedDataParallel(model)
for (x,) in loader:
    loss = ddp(x).square().mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    step += 1
    snap.save(step)
print(f"rank {dist.get_rank()} done at step {step}", flush=True)
