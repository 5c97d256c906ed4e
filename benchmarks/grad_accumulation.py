"""Seconds per optimizer step of 2-process DDP (gloo, CPU) with 4 micro-batches per step: the loop most examples use
(``helpers.accumulation.accumulate_naively``: an all-reduce of every gradient bucket on each micro-batch) against
``helpers.step.train_step`` (``no_sync`` on all but the last micro-batch: one round per step), and the bytes each
all-reduces per step (counted with a DDP communication hook, ``helpers.accumulation.CollectiveCounter``).

    python benchmarks/grad_accumulation.py        # about a minute on 2 cores

Notebook 09's network (``Net`` on the bundled tiny BERT, 1.5 M parameters, 5.7 MiB of fp32 gradients), global
batch 32 of random tokens without padding (sequence 64): 16 per process, 4 micro-batches of 4. Both loops run in
the same launch on the same model, in windows of a few steps that alternate (which goes first alternates too), so
a change in machine load hits both; each window's ratio naive / no_sync is kept.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import common  # first: it sets the quiet, offline environment before transformers is imported
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

LOOPS = ("naive", "no_sync")


def worker(rank: int, world_size: int, port: int, args: argparse.Namespace, out: str) -> None:
    from helpers.accumulation import CollectiveCounter, accumulate_naively
    from helpers.distributed import leave_process_group
    from helpers.net import Net
    from helpers.step import train_step

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(Net(pooler=False))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-5)
    counter = CollectiveCounter(model)
    generator = torch.Generator().manual_seed(rank)
    micro = args.global_batch // world_size // args.micro_batches
    batches = [{"input_ids": torch.randint(5, 5000, (micro, args.seq_len), generator=generator),
                "attention_mask": torch.ones(micro, args.seq_len, dtype=torch.long),
                "labels": torch.randint(0, 2, (micro,), generator=generator)} for _ in range(args.micro_batches)]
    loops = {"naive": accumulate_naively, "no_sync": train_step}

    def step(loop: str) -> None:
        loops[loop](model, batches)
        optimizer.step()
        optimizer.zero_grad()

    for loop in LOOPS:  # warm-up: DDP's buckets, Adam's state
        step(loop)
    traffic = {}
    for loop in LOOPS:
        with counter:
            step(loop)
        traffic[loop] = counter.summary()["all-reduce"]
    seconds = {loop: [] for loop in LOOPS}
    for window in range(args.windows):
        for loop in (LOOPS if window % 2 == 0 else LOOPS[::-1]):
            dist.barrier()
            start = time.perf_counter()
            for _ in range(args.steps):
                step(loop)
            dist.barrier()
            seconds[loop].append((time.perf_counter() - start) / args.steps)
    if rank == 0:
        Path(out).write_text(json.dumps({"seconds": seconds, "traffic": traffic,
                                         "gradient_bytes": 4 * sum(p.numel() for p in model.parameters())}))
    leave_process_group(model)


def run(rounds: int = 3, windows: int = 4, steps: int = 3, global_batch: int = 32, micro_batches: int = 4,
        seq_len: int = 64) -> dict:
    """``rounds`` launches of 2 processes; per launch, ``windows`` timed windows of each loop. Returns every window's
    seconds per step by loop, and the all-reduce traffic of one step of each loop."""
    args = argparse.Namespace(windows=windows, steps=steps, global_batch=global_batch, micro_batches=micro_batches,
                              seq_len=seq_len)
    result = {"seconds": {loop: [] for loop in LOOPS}, "settings": vars(args)}
    for _ in range(rounds):
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "result.json")
            mp.spawn(worker, args=(2, common.free_port(), args, out), nprocs=2)
            launch = json.loads(Path(out).read_text())
        for loop in LOOPS:
            result["seconds"][loop] += launch["seconds"][loop]
        result["traffic"], result["gradient_bytes"] = launch["traffic"], launch["gradient_bytes"]
    return result


def ratios(result: dict) -> list[float]:
    """naive / no_sync for each window: the two ran one after the other, under the same load."""
    return common.ratios(result["seconds"]["naive"], result["seconds"]["no_sync"])


def report(result: dict) -> list[str]:
    settings, seconds = result["settings"], result["seconds"]
    micro = settings["global_batch"] // 2 // settings["micro_batches"]
    lines = [f"2 DDP processes (gloo, CPU, 1 thread each), global batch {settings['global_batch']} = 2 x "
             f"{settings['micro_batches']} micro-batches of {micro}, sequence {settings['seq_len']}; "
             f"{len(seconds['naive'])} windows of {settings['steps']} steps per loop"]
    for loop in LOOPS:
        traffic = result["traffic"][loop]
        lines.append(f"{loop:<8} median {statistics.median(seconds[loop]):.3f} s per optimizer step "
                     f"(min {min(seconds[loop]):.3f}, max {max(seconds[loop]):.3f}); all-reduce per step: "
                     f"{traffic['calls']} calls, {traffic['bytes'] / 2**20:.2f} MiB "
                     f"({traffic['bytes'] / result['gradient_bytes']:.1f} x the gradients)")
    lines.append(f"naive / no_sync: median {statistics.median(ratios(result)):.2f}x "
                 f"({common.spread(ratios(result))})")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="launches of 2 processes (default 3)")
    parser.add_argument("--windows", type=int, default=4, help="timed windows of each loop per launch (default 4)")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per window (default 3)")
    args = parser.parse_args()
    print(f"machine: {common.machine(torch_threads=False)}")
    print("\n".join(report(run(args.rounds, args.windows, args.steps))))
    print(f"load average at end {common.load_average()}")


if __name__ == "__main__":
    main()
