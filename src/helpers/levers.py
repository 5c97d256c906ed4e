"""Two of the memory levers notebook 05 predicts, as helpers.finetune applies them: bf16 autocast (``--amp bf16``)
and activation checkpointing (``--gradient-checkpointing``). The third, gradient accumulation, is a loop:
helpers.train.accumulate.

- bf16 autocast runs the forward and the loss with matrix products in bf16 (helpers.train.forward_backward);
  the weights, their gradients and Adam's state stay fp32. Under FSDP2, ``MixedPrecisionPolicy`` also gathers
  the weights in bf16 (half the all-gather traffic and the gathered copies) and reduces gradients in fp32.
- activation checkpointing keeps only each encoder layer's input for backward and computes the layer's forward
  again there: less memory, about one more forward of compute.
"""

from __future__ import annotations

import argparse
import copy
import json

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from transformers import set_seed

from helpers import distributed
from helpers.accumulation import accumulation_lines, compare_accumulation
from helpers.data import PadToLongest, load_split
from helpers.equivalence import EQUIVALENCE_TOLERANCE, whole
from helpers.fsdp import FINETUNE_STRATEGIES, prepare, wrap
from helpers.models import load_tokenizer
from helpers.net import Net
from helpers.train import forward_backward, say, to_device
from helpers.wrapping import unwrap

AMP_DTYPES = {"bf16": torch.bfloat16}  # --amp choices


def amp_dtype(choice: str | None) -> torch.dtype | None:
    """The autocast type of ``--amp choice``; None trains in fp32."""
    return None if choice is None else AMP_DTYPES[choice]


def amp_problem(choice: str | None, device: torch.device) -> str | None:
    """Why ``--amp choice`` cannot run on ``device``, or None. CPUs compute bf16 in any case (torch converts where
    the CPU has no bf16 instructions); a CUDA GPU needs bf16 support (compute capability 8.0 or later)."""
    if choice is None or device.type != "cuda" or torch.cuda.is_bf16_supported():
        return None
    name = torch.cuda.get_device_name(device)
    major, minor = torch.cuda.get_device_capability(device)
    return (f"--amp {choice}: {name} (compute capability {major}.{minor}) has no bf16 support; train in fp32 "
            f"(leave out --amp), or use a GPU of compute capability 8.0 or later")


def enable_checkpointing(net: nn.Module) -> nn.Module:
    """Recompute each encoder layer of ``net.bert`` in backward instead of keeping its activations; returns ``net``.

    transformers' own switch (``activation_checkpointing_enable``, formerly ``gradient_checkpointing_enable``),
    with PyTorch's non-reentrant checkpoint, which restores the random state for the recomputation: dropout draws
    the same masks again, so the gradients are those of the step without it. Call it before DDP or FSDP2 wraps
    ``net``. ``use_cache`` is switched off, which BERT as an encoder never uses and transformers would warn about.
    """
    net.bert.config.use_cache = False
    net.bert.activation_checkpointing_enable({"use_reentrant": False})
    return net


def fsdp_mixed_precision(choice: str | None) -> dict:
    """``fully_shard`` options for ``--amp choice``: bf16 gathered weights and compute, fp32 gradient reduction."""
    if choice is None:
        return {}
    return {"mp_policy": MixedPrecisionPolicy(param_dtype=AMP_DTYPES[choice], reduce_dtype=torch.float32)}


def compare_checkpointing(model: str | None, examples: list, collate, device: torch.device, strategy: str = "ddp",
                          seed: int = 0) -> dict:
    """One training step's gradients under ``strategy`` with and without activation checkpointing, from the same
    weights, batch and random state (dropout on): the largest difference on any rank. Every rank must call it."""
    ranks, me = dist.get_world_size(), dist.get_rank()
    share = len(examples) // ranks
    batch = to_device(collate(examples[me * share:(me + 1) * share]), device)
    set_seed(seed)
    plain = Net(model, pooler=False).to(device)
    gradients = {}
    for name, net in (("checkpointed", enable_checkpointing(copy.deepcopy(plain))), ("plain", plain)):
        parallel = wrap(prepare(net, strategy), strategy, device).train()
        torch.manual_seed(seed + me)  # the same dropout masks in both steps
        forward_backward(parallel, batch, nn.CrossEntropyLoss())
        gradients[name] = {key: whole(p.grad) for key, p in unwrap(parallel).named_parameters()}
    diff = max((gradients["checkpointed"][key] - grad).abs().max().item() for key, grad in gradients["plain"].items())
    largest = torch.tensor(diff, dtype=torch.float64, device=device)
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    return {"strategy": strategy, "world_size": ranks, "per_rank_batch_size": share,
            "max_abs_grad_diff": largest.item()}


def checkpointing_line(result: dict) -> str:
    name = result["strategy"].upper()
    return (f"{name}, {result['world_size']} process(es) x {result['per_rank_batch_size']}, dropout on: gradients max "
            f"|checkpointed - plain| <= {EQUIVALENCE_TOLERANCE:g}: {result['max_abs_grad_diff'] <= EQUIVALENCE_TOLERANCE}")


def main(argv: list[str] | None = None) -> dict:
    """``torchrun --nproc_per_node=2 -m helpers.levers``: for each strategy, gradient accumulation with and without
    the paused communication against one process (helpers.accumulation), and activation checkpointing against
    the same step without it. Rank 0 prints each in words, then everything as one JSON line."""
    parser = argparse.ArgumentParser(prog="python -m helpers.levers", description=main.__doc__.splitlines()[0])
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
    dist.destroy_process_group()
    return result


if __name__ == "__main__":
    main()
