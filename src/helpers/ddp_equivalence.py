"""Check that DDP computes what one process computes: the same gradients, then the same weights everywhere.

    torchrun --nproc_per_node=2 -m helpers.ddp_equivalence --global-batch-size 8

Each of N ranks takes its B/N share of one batch of B training examples and runs forward and backward
under DistributedDataParallel, which averages the gradients over the ranks. Every rank also runs the
same network, unwrapped, on the whole batch in one piece, as one process would. Dropout is off (eval
mode), so both compute the same function. Rank 0 prints the comparison; the last line is JSON.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from transformers import set_seed

from helpers import distributed
from helpers.data import PadToLongest, load_split
from helpers.finetune import weights_digest
from helpers.models import ModelNotAvailableError, load_tokenizer, resolve_model
from helpers.net import Net
from helpers.optim import two_lr_adam
from helpers.train import to_device

TOLERANCE = 1e-6


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m helpers.ddp_equivalence", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model name or directory (default: $BERT_MODEL, else the bundled tiny BERT)")
    parser.add_argument("--global-batch-size", type=int, default=8,
                        help="B, the batch of one process; each of N ranks takes B / N examples of it (default 8)")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def find_problem(args: argparse.Namespace, world_size: int) -> str | None:
    if args.global_batch_size < world_size or args.global_batch_size % world_size:
        return (f"--global-batch-size {args.global_batch_size} must be a positive multiple of the number of "
                f"processes ({world_size}), so that every rank gets the same share")
    try:
        resolve_model(args.model)
    except ModelNotAvailableError as error:
        return str(error)
    return None


def loss_and_backward(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    batch = to_device(batch, next(model.parameters()).device)
    loss = nn.functional.cross_entropy(model(batch["input_ids"], batch["attention_mask"]), batch["labels"])
    loss.backward()
    return loss.detach()


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    world_size, rank = distributed.world_size(), distributed.rank()
    problem = find_problem(args, world_size)
    device = distributed.device_for_this_process()
    distributed.init_process_group(device)
    problem = distributed.agree_on_problem(problem)
    if problem:
        distributed.stop_everywhere(problem)

    collate = PadToLongest(load_tokenizer(args.model))
    examples = load_split("train")[:args.global_batch_size]
    share = args.global_batch_size // world_size

    set_seed(args.seed)
    net = Net(args.model, pooler=False).to(device).eval()  # eval(): no dropout
    one_process = copy.deepcopy(net)
    optimizer = two_lr_adam(net)
    model = DistributedDataParallel(net, device_ids=[device.index] if device.type == "cuda" else None)

    rank_loss = loss_and_backward(model, collate(examples[rank * share:(rank + 1) * share]))
    whole_loss = loss_and_backward(one_process, collate(examples))

    differences = [(p.grad - q.grad).abs().max() for p, q in zip(net.parameters(), one_process.parameters())]
    max_difference = torch.stack(differences).max()
    dist.all_reduce(max_difference, op=dist.ReduceOp.MAX)
    dist.all_reduce(rank_loss)
    optimizer.step()
    digests = [None] * world_size
    dist.all_gather_object(digests, weights_digest(net))

    result = {"world_size": world_size, "per_rank_batch_size": share, "global_batch_size": args.global_batch_size,
              "loss_one_process": whole_loss.item(), "loss_mean_over_ranks": rank_loss.item() / world_size,
              "gradient_tensors": len(differences), "max_abs_grad_diff": max_difference.item(),
              "weights_identical_on_all_ranks": len(set(digests)) == 1}
    if rank == 0:
        print(f"one process, batch of {args.global_batch_size}:     loss {result['loss_one_process']:.4f}")
        print(f"{world_size} ranks x {share} examples, mean:  loss {result['loss_mean_over_ranks']:.4f}")
        print(f"gradients of {len(differences)} tensors: max |DDP - one process| <= {TOLERANCE:g}: "
              f"{result['max_abs_grad_diff'] <= TOLERANCE}")
        print(f"after optimizer.step(), weights bitwise identical on all {world_size} ranks: "
              f"{result['weights_identical_on_all_ranks']}")
        print(json.dumps(result), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
