"""The smallest complete DistributedDataParallel training: one process per device, started by torchrun.

    torchrun --standalone --nproc_per_node=2 ddp_minimal.py

Each process uses the GPU numbered LOCAL_RANK when there is one GPU per process, else the CPU (gloo).
"""
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

if "RANK" not in os.environ:
    sys.exit("start this script with torchrun, e.g.: torchrun --standalone --nproc_per_node=2 ddp_minimal.py")
rank, local_rank, world_size = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])
if torch.cuda.device_count() >= int(os.environ["LOCAL_WORLD_SIZE"]):  # one GPU for each process here
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)  # the address of torchrun's store comes from the environment
else:
    device = torch.device("cpu")
    dist.init_process_group("gloo")
if rank == 0:
    print(f"{world_size} processes, backend {dist.get_backend()}, device {device.type}")

torch.manual_seed(0)  # the same data and the same initial weights in every process
x = torch.randn(512, 8)
y = x @ torch.arange(1.0, 9.0).unsqueeze(1) + 0.1 * torch.randn(512, 1)  # y = 1*x1 + 2*x2 + ... + 8*x8 + noise
sampler = DistributedSampler(TensorDataset(x, y), shuffle=True, seed=0)  # this rank's 1/world_size share
loader = DataLoader(TensorDataset(x, y), batch_size=64 // world_size, sampler=sampler)  # global batch 64

net = nn.Linear(8, 1).to(device)
optimizer = torch.optim.SGD(net.parameters(), lr=0.1)  # built on the plain model, before wrapping
model = DistributedDataParallel(net, device_ids=[local_rank] if device.type == "cuda" else None)

for epoch in range(5):
    sampler.set_epoch(epoch)  # a new shuffle every epoch, the same on every rank
    for xb, yb in loader:
        loss = nn.functional.mse_loss(model(xb.to(device)), yb.to(device))
        optimizer.zero_grad()
        loss.backward()  # DDP averages the gradients over all processes during backward
        optimizer.step()
    loss = loss.detach()
    dist.all_reduce(loss)  # the sum of every rank's last-batch loss
    if rank == 0:
        print(f"epoch {epoch}: last batch loss, mean over {world_size} processes: {loss.item() / world_size:.4f}")

weights = [None] * world_size
dist.all_gather_object(weights, net.weight.tolist())
if rank == 0:
    print("weights identical on all ranks:", all(w == weights[0] for w in weights))
    print("learned:", [round(v, 2) for v in weights[0][0]])
del model  # DDP's reducer holds the group: freed after it, it would keep the group's threads running into exit
dist.destroy_process_group()
