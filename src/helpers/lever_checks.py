"""What notebook 09 checks in several processes, in one launch: for DDP and FSDP2, gradient accumulation with and
without the paused communication against one process on one batch (helpers.accumulation), and activation
checkpointing against the same step without it.

    torchrun --standalone --nproc_per_node=2 -m helpers.lever_checks      # both strategies, over gloo on a CPU
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist

from helpers import distributed
from helpers.accumulation import accumulation_lines, compare_accumulation
from helpers.data import PadToLongest, load_split
from helpers.equivalence import (EQUIVALENCE_TOLERANCE, gradients, largest_difference, parallel_copy, reference_net,
                                 share)
from helpers.fsdp import FINETUNE_STRATEGIES
from helpers.levers import enable_checkpointing
from helpers.models import load_tokenizer
from helpers.step import train_step
from helpers.train import say


def compare_checkpointing(model: str | None, examples: list, collate, device: torch.device, strategy: str = "ddp",
                          seed: int = 0) -> dict:
    """One training step's gradients under ``strategy`` with and without activation checkpointing, from the same
    weights, batch and random state (dropout on): the largest difference on any rank. Every rank must call it."""
    mine = share(examples)
    (batch,) = mine.batches(collate, device)
    plain = reference_net(model, device, seed, dropout=True)
    steps = {"plain": parallel_copy(plain, strategy, device),
             "checkpointed": parallel_copy(plain, strategy, device, change=enable_checkpointing)}
    for parallel in steps.values():
        torch.manual_seed(seed + dist.get_rank())  # the same dropout masks in both steps
        train_step(parallel, [batch])  # no optimizer: the gradients stay
    return {"strategy": strategy, "world_size": dist.get_world_size(), "per_rank_batch_size": len(mine.mine),
            "max_abs_grad_diff": largest_difference(steps["checkpointed"], gradients(steps["plain"]))}


def checkpointing_line(result: dict) -> str:
    """``compare_checkpointing``'s result in words."""
    ok = result["max_abs_grad_diff"] <= EQUIVALENCE_TOLERANCE
    return (f"{result['strategy'].upper()}: {result['world_size']} process(es) x {result['per_rank_batch_size']}, "
            f"dropout on: gradients with activation checkpointing = without (<= {EQUIVALENCE_TOLERANCE:g}): {ok}")


def main(argv: list[str] | None = None) -> dict:
    """Run the checks of this module for each ``--strategy``; rank 0 prints each in words, then all as one JSON line."""
    parser = argparse.ArgumentParser(prog="python -m helpers.lever_checks", description=main.__doc__.splitlines()[0])
    parser.add_argument("--device", choices=distributed.DEVICE_CHOICES, default="auto")
    parser.add_argument("--strategy", nargs="+", choices=FINETUNE_STRATEGIES, default=list(FINETUNE_STRATEGIES))
    parser.add_argument("--grad-accum-steps", type=int, default=4, metavar="N")
    parser.add_argument("--examples", type=int, default=32, help="the first training examples: one global batch")
    parser.add_argument("--model", help="as helpers.finetune's --model (default: the bundled tiny BERT)")
    args = parser.parse_args(argv)
    problem = distributed.device_problem(args.device)
    if problem:
        distributed.stop_before_joining(problem)
    device = distributed.device_for_this_process(args.device)
    distributed.init_process_group(device)
    examples, collate = load_split("train")[:args.examples], PadToLongest(load_tokenizer(args.model))
    say(f"{dist.get_world_size()} process(es), backend {dist.get_backend()}, device {device.type}")
    result = {"accumulation": [], "checkpointing": []}
    for strategy in args.strategy:
        result["accumulation"].append(compare_accumulation(args.model, examples, collate, device, strategy,
                                                           args.grad_accum_steps))
        say("\n".join(accumulation_lines(result["accumulation"][-1])))
        result["checkpointing"].append(compare_checkpointing(args.model, examples, collate, device, strategy))
        say(checkpointing_line(result["checkpointing"][-1]))
    say(json.dumps(result))
    distributed.leave_process_group()
    return result


if __name__ == "__main__":
    main()
