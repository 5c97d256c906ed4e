"""Samples/s of BERT training with 1 process vs 2 DDP processes (gloo, CPU), at a fixed global batch.

    python benchmarks/ddp_scaling.py            # a few minutes on 2 cores

Three set-ups, measured side by side in rounds (so a change in machine load hits all of them):
  1 process x 1 thread, 2 DDP processes x 1 thread each, 1 process x 2 threads.
The model (BERT, hidden 256, 4 layers, sequence 128, random weights and tokens) is big enough that
compute, not communication or Python, dominates a step. Prints the machine and its load, medians,
speed-up (median and range of the ratios of windows timed in the same round) and efficiency.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from transformers import BertConfig, BertModel

from helpers.distributed import leave_process_group

import common  # benchmarks/common.py: the machine and its load

SETUPS = {"1 process x 1 thread": (1, 1), "2 processes x 1 thread": (2, 1), "1 process x 2 threads": (1, 2)}


class Classifier(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.bert = BertModel(config, add_pooling_layer=False)
        self.linear = nn.Linear(config.hidden_size, 2)

    def forward(self, input_ids):
        return self.linear(self.bert(input_ids=input_ids).last_hidden_state[:, 0])


def worker(rank: int, world_size: int, threads: int, port: int, args: argparse.Namespace, out: str) -> None:
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    config = BertConfig(vocab_size=8000, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                        intermediate_size=1024, max_position_embeddings=args.seq_len)
    torch.manual_seed(0)
    model = Classifier(config)
    if world_size > 1:
        model = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    per_rank = args.global_batch // world_size
    generator = torch.Generator().manual_seed(rank)
    input_ids = torch.randint(0, config.vocab_size, (per_rank, args.seq_len), generator=generator)
    labels = torch.randint(0, 2, (per_rank,), generator=generator)

    def step():
        loss = nn.functional.cross_entropy(model(input_ids), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    for _ in range(2):  # warm-up: allocator, DDP buckets, Adam state
        step()
    rates = []
    for _ in range(args.windows):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(args.steps):
            step()
        dist.barrier()
        rates.append(args.global_batch * args.steps / (time.perf_counter() - start))
    if rank == 0:
        Path(out).write_text(" ".join(map(str, rates)))
    leave_process_group(model)


def measure(world_size: int, threads: int, args: argparse.Namespace) -> list[float]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rates")
        mp.spawn(worker, args=(world_size, threads, common.free_port(), args, out), nprocs=world_size)
        return [float(x) for x in Path(out).read_text().split()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--global-batch", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=4, help="steps per timed window")
    parser.add_argument("--windows", type=int, default=2, help="timed windows per launch")
    parser.add_argument("--rounds", type=int, default=3, help="launches of every set-up, interleaved")
    args = parser.parse_args()

    print(f"machine: {common.machine(torch_threads=False)}")
    print(f"global batch {args.global_batch}, sequence {args.seq_len}, "
          f"{args.rounds} rounds x {args.windows} windows x {args.steps} steps per set-up")
    rates = {name: [] for name in SETUPS}
    for _ in range(args.rounds):
        for name, (world_size, threads) in SETUPS.items():
            rates[name] += measure(world_size, threads, args)
    base = rates["1 process x 1 thread"]
    print(f"{'set-up':<24}{'median samples/s':>18}{'min':>8}{'max':>8}{'speed-up':>10}{'range':>14}{'efficiency':>12}")
    for name, (world_size, threads) in SETUPS.items():
        speedups = common.ratios(rates[name], base)  # window i of every set-up ran in the same round
        speedup = statistics.median(speedups)
        print(f"{name:<24}{statistics.median(rates[name]):>18.1f}{min(rates[name]):>8.1f}{max(rates[name]):>8.1f}"
              f"{speedup:>9.2f}x{min(speedups):>7.2f}-{max(speedups):.2f}x{speedup / (world_size * threads):>11.0%}")
    print(f"load average at end {common.load_average()}")

if __name__ == "__main__":
    main()
