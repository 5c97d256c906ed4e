"""Check that data-parallel training computes what one process computes, for DDP and FSDP2 alike.

    torchrun --nproc_per_node=2 -m helpers.finetune --check-equivalence [--strategy fsdp]

Each of N ranks takes its B/N share of one batch of B training examples and runs forward and backward through
the parallel model: DDP averages the gradients over the ranks, FSDP2 reduce-scatters them onto each rank's
shard. Every rank also runs the same network, unwrapped, on the whole batch in one piece, as one process
would. Dropout is off (eval mode), so both compute the same function. Then both take one SGD step: under DDP
every rank updates its own full copy, which must stay bitwise identical to the others.

The step is SGD, not Adam: Adam's first step divides each gradient by its own size, so a gradient near Adam's
eps moves its weight by up to the learning rate either way, and a rounding difference shows as a large one.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn
from transformers import set_seed

from helpers.checkpoint import weights_digest
from helpers.fsdp import prepare, wrap
from helpers.net import Net
from helpers.train import accumulate, input_device, to_device
from helpers.wrapping import unwrap

EQUIVALENCE_TOLERANCE = 1e-6  # max |parallel - one process| over gradients and weights: float32 rounding


def loss_and_backward(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    batch = to_device(batch, input_device(model))
    loss = nn.functional.cross_entropy(model(batch["input_ids"], batch["attention_mask"]), batch["labels"])
    loss.backward()
    return loss.detach()


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """The full tensor: a sharded DTensor gathered from every rank (a collective), a plain tensor as it is."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def compare_with_one_process(model: str | None, examples: list, collate, device: torch.device,
                             strategy: str = "ddp", seed: int = 0, lr: float = 0.1, accumulation: int = 1) -> dict:
    """One ``strategy`` step ("ddp" or "fsdp") on this rank's share of ``examples`` against one process on all of
    them: the gradients, then the weights after one SGD step of ``lr``. Every rank of the group must call it.

    Each rank takes len(examples) // world_size of them (a remainder is left out) in ``accumulation``
    micro-batches, whose gradients it adds up as training does (helpers.train.accumulate).
    """
    ranks, me = dist.get_world_size(), dist.get_rank()
    share = len(examples) // ranks
    examples = examples[:share * ranks]
    set_seed(seed)
    one_process = Net(model, pooler=False).to(device).eval()  # eval(): no dropout
    parallel = wrap(prepare(copy.deepcopy(one_process), strategy), strategy, device)
    mine, micro = examples[me * share:(me + 1) * share], -(-share // accumulation)
    batches = [to_device(collate(mine[start:start + micro]), device) for start in range(0, share, micro)]
    rank_loss = torch.tensor(accumulate(parallel, batches), dtype=torch.float64, device=device)
    whole_loss = loss_and_backward(one_process, collate(examples))

    named = dict(one_process.named_parameters())
    mine = list(unwrap(parallel).named_parameters())
    grad_diff = max((whole(p.grad) - named[name].grad).abs().max().item() for name, p in mine)
    for net in (unwrap(parallel), one_process):
        torch.optim.SGD(net.parameters(), lr=lr).step()
    weight_diff = max((whole(p) - named[name]).abs().max().item() for name, p in mine)
    largest = torch.tensor([grad_diff, weight_diff], dtype=torch.float64, device=rank_loss.device)
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)  # the largest difference on any rank
    grad_diff, weight_diff = largest.tolist()
    dist.all_reduce(rank_loss)
    result = {"strategy": strategy, "world_size": ranks, "per_rank_batch_size": share,
              "micro_batches": len(batches), "micro_batch_size": micro, "global_batch_size": len(examples),
              "loss_one_process": whole_loss.item(),
              "loss_mean_over_ranks": rank_loss.item() / ranks, "gradient_tensors": len(named),
              "max_abs_grad_diff": grad_diff, "sgd_lr": lr, "max_abs_weight_diff_after_sgd": weight_diff,
              "parameters": sum(p.numel() for p in named.values()),
              "parameters_on_this_rank": sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel()
                                             for _, p in mine)}
    if strategy == "ddp":  # every rank updated a full copy of its own: are the copies the same?
        digests = [None] * ranks
        dist.all_gather_object(digests, weights_digest(parallel))
        result["weights_identical_on_all_ranks"] = len(set(digests)) == 1
    return result


def print_comparison(result: dict) -> None:
    """The comparison in words, at a precision that does not depend on the CPU; rank 0 only."""
    if dist.get_rank() != 0:
        return
    name, tolerance = result["strategy"].upper(), EQUIVALENCE_TOLERANCE
    lines = [f"one process, batch of {result['global_batch_size']}:  loss {result['loss_one_process']:.4f}",
             f"{result['world_size']} ranks x {result['per_rank_batch_size']}"
             + (f" ({result['micro_batches']} micro-batches of {result['micro_batch_size']})"
                if result.get("micro_batches", 1) > 1 else "")
             + f", mean:    loss {result['loss_mean_over_ranks']:.4f}",
             f"parameters: {result['parameters']:,} in all, {result['parameters_on_this_rank']:,} on rank 0",
             f"gradients of {result['gradient_tensors']} tensors: max |{name} - one process| <= {tolerance:g}: "
             f"{result['max_abs_grad_diff'] <= tolerance}",
             f"after one SGD step (lr {result['sgd_lr']:g}): max |{name} - one process| <= {tolerance:g}: "
             f"{result['max_abs_weight_diff_after_sgd'] <= tolerance}"]
    if "weights_identical_on_all_ranks" in result:
        lines.append(f"after that step, weights bitwise identical on all {result['world_size']} ranks: "
                     f"{result['weights_identical_on_all_ranks']}")
    print("\n".join(lines), flush=True)
