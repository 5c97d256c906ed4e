"""One harness for "the same as one process": data-parallel training checked against one process, for DDP and
FSDP2 alike.

    torchrun --nproc_per_node=2 -m helpers.finetune --check-equivalence [--strategy fsdp]

Each of N ranks takes its share of one batch of B training examples (``share``) and runs a parallel copy of a
network on it (``parallel_copy``): DDP averages the gradients over the ranks, FSDP2 reduce-scatters them onto each
rank's shard. Every rank also runs the same network, unwrapped, on the whole batch in one piece, as one process
would (``reference_net``). ``largest_difference`` then compares the two, tensor by tensor, and reports the largest
difference on any rank. On it stand ``--check-equivalence`` (``compare_with_one_process``), notebook 09's
accumulation checks (helpers.accumulation) and its activation checkpointing check (helpers.lever_checks).

Dropout is off in the reference (eval mode), so both sides compute the same function. ``--check-equivalence``
then takes one SGD step on both: under DDP every rank updates its own full copy, which must stay bitwise identical
to the others. The step is SGD, not Adam: Adam's first step divides each gradient by its own size, so a gradient
near Adam's eps moves its weight by up to the learning rate either way, and a rounding difference shows as a large
one.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from transformers import set_seed

from helpers.checkpoint import weights_digest
from helpers.fsdp import prepare, wrap
from helpers.net import Net
from helpers.step import train_step
from helpers.train import input_device, to_device
from helpers.wrapping import unwrap

EQUIVALENCE_TOLERANCE = 1e-6  # max |parallel - one process| over gradients and weights: float32 rounding


@dataclass(frozen=True)
class Share:
    """This rank's part of one global batch: ``examples`` (all ranks' together), ``mine`` in ``micro_batches``
    micro-batches of at most ``micro_batch_size``."""

    examples: list
    mine: list
    micro_batches: int
    micro_batch_size: int

    def batches(self, collate, device: torch.device) -> list[dict[str, torch.Tensor]]:
        """This rank's micro-batches, collated, on ``device``."""
        size = self.micro_batch_size
        return [to_device(collate(self.mine[start:start + size]), device) for start in range(0, len(self.mine), size)]


def share(examples: list, micro_batches: int = 1, *, equal: bool = False) -> Share:
    """This rank's share of ``examples``: len(examples) // world_size of them (a remainder is left out), or with
    ``equal`` the most that fill ``micro_batches`` equal micro-batches; otherwise the last may be shorter."""
    ranks, me = dist.get_world_size(), dist.get_rank()
    size = len(examples) // ranks
    if equal:
        size -= size % micro_batches
    if size == 0:
        raise ValueError(f"{len(examples)} example(s) do not fill {micro_batches} {'equal ' if equal else ''}"
                         f"micro-batch(es) on each of {ranks} process(es)")
    micro = -(-size // micro_batches)
    return Share(examples[:size * ranks], examples[me * size:(me + 1) * size], -(-size // micro), micro)


def reference_net(model: str | None, device: torch.device, seed: int, dropout: bool = False) -> Net:
    """The network every comparison starts from, as helpers.finetune builds it (no pooler), the same on every rank;
    in eval mode (no dropout) unless ``dropout``."""
    set_seed(seed)
    net = Net(model, pooler=False).to(device)
    return net.train(dropout)


def parallel_copy(net: nn.Module, strategy: str, device: torch.device, change=None) -> nn.Module:
    """A copy of ``net`` without gradients, ``change``d (e.g. ``enable_checkpointing``) and made data-parallel for
    ``strategy`` ("ddp" or "fsdp") as training makes it."""
    twin = copy.deepcopy(net)
    twin.zero_grad(set_to_none=True)
    if change is not None:
        twin = change(twin)
    return wrap(prepare(twin, strategy), strategy, device)


def loss_and_backward(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    batch = to_device(batch, input_device(model))
    loss = nn.functional.cross_entropy(model(batch["input_ids"], batch["attention_mask"]), batch["labels"])
    loss.backward()
    return loss.detach()


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """The full tensor: a sharded DTensor gathered from every rank (a collective), a plain tensor as it is."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def gradients(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's whole gradient, by name (a collective for a sharded model: every rank must call it)."""
    return {name: whole(p.grad) for name, p in unwrap(model).named_parameters()}


def largest_on_any_rank(value: float, device: torch.device) -> float:
    largest = torch.tensor(value, dtype=torch.float64, device=device)
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    return largest.item()


def largest_difference(model: nn.Module, reference: dict[str, torch.Tensor], weights: bool = False) -> float:
    """max |each parameter's gradient (its weights, with ``weights``) in ``model`` - ``reference[name]``|, whole
    tensors compared, the largest on any rank. Every rank of the group must call it."""
    named = unwrap(model).named_parameters()
    difference = max((whole(p if weights else p.grad) - reference[name]).abs().max().item() for name, p in named)
    return largest_on_any_rank(difference, next(unwrap(model).parameters()).device)


def compare_with_one_process(model: str | None, examples: list, collate, device: torch.device,
                             strategy: str = "ddp", seed: int = 0, lr: float = 0.1, accumulation: int = 1) -> dict:
    """One ``strategy`` step ("ddp" or "fsdp") on this rank's share of ``examples`` against one process on all of
    them: the gradients, then the weights after one SGD step of ``lr``. Every rank of the group must call it.

    Each rank takes len(examples) // world_size of them (a remainder is left out) in ``accumulation``
    micro-batches, whose gradients it adds up as training does (``train_step`` without its update).
    """
    mine = share(examples, accumulation)
    one_process = reference_net(model, device, seed)
    parallel = parallel_copy(one_process, strategy, device)
    batches = mine.batches(collate, device)
    rank_loss = torch.tensor(train_step(parallel, batches)[0], dtype=torch.float64, device=device)
    whole_loss = loss_and_backward(one_process, collate(mine.examples))

    named = dict(one_process.named_parameters())
    grad_diff = largest_difference(parallel, {name: p.grad for name, p in named.items()})
    for net in (unwrap(parallel), one_process):
        torch.optim.SGD(net.parameters(), lr=lr).step()
    weight_diff = largest_difference(parallel, named, weights=True)
    dist.all_reduce(rank_loss)
    ranks = dist.get_world_size()
    result = {"strategy": strategy, "world_size": ranks, "per_rank_batch_size": len(mine.mine),
              "micro_batches": len(batches), "micro_batch_size": mine.micro_batch_size,
              "global_batch_size": len(mine.examples), "loss_one_process": whole_loss.item(),
              "loss_mean_over_ranks": rank_loss.item() / ranks, "gradient_tensors": len(named),
              "max_abs_grad_diff": grad_diff, "sgd_lr": lr, "max_abs_weight_diff_after_sgd": weight_diff,
              "parameters": sum(p.numel() for p in named.values()),
              "parameters_on_this_rank": sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel()
                                             for p in unwrap(parallel).parameters())}
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
