"""Check that DDP computes what one process computes: the same gradients, then the same weights everywhere.

    torchrun --nproc_per_node=2 -m helpers.finetune --check-equivalence

Each of N ranks takes its B/N share of one batch of B training examples and runs forward and backward
under DistributedDataParallel, which averages the gradients over the ranks. Every rank also runs the
same network, unwrapped, on the whole batch in one piece, as one process would. Dropout is off (eval
mode), so both compute the same function.
"""

from __future__ import annotations

import copy
import hashlib

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from transformers import set_seed

from helpers.net import Net
from helpers.optim import two_lr_adam
from helpers.train import input_device, to_device

TOLERANCE = 1e-6


def weights_digest(model: torch.nn.Module) -> str:
    """SHA-256 of every tensor of the state_dict, in key order: equal digests mean bitwise equal weights."""
    digest = hashlib.sha256()
    for key, tensor in model.state_dict().items():
        digest.update(key.encode())
        digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def loss_and_backward(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    batch = to_device(batch, input_device(model))
    loss = nn.functional.cross_entropy(model(batch["input_ids"], batch["attention_mask"]), batch["labels"])
    loss.backward()
    return loss.detach()


def compare_with_one_process(model: str | None, examples: list, collate, device: torch.device, seed: int = 0) -> dict:
    """One DDP step on this rank's share of ``examples`` against one process on all of them; every rank joins.

    Needs the process group. Each rank takes len(examples) // world_size of them; a remainder is left out.
    """
    world_size, rank = dist.get_world_size(), dist.get_rank()
    share = len(examples) // world_size
    examples = examples[:share * world_size]
    set_seed(seed)
    net = Net(model, pooler=False).to(device).eval()  # eval(): no dropout
    one_process = copy.deepcopy(net)
    optimizer = two_lr_adam(net)
    ddp = DistributedDataParallel(net, device_ids=[device.index] if device.type == "cuda" else None)

    rank_loss = loss_and_backward(ddp, collate(examples[rank * share:(rank + 1) * share]))
    whole_loss = loss_and_backward(one_process, collate(examples))

    differences = [(p.grad - q.grad).abs().max() for p, q in zip(net.parameters(), one_process.parameters())]
    max_difference = torch.stack(differences).max()
    dist.all_reduce(max_difference, op=dist.ReduceOp.MAX)
    dist.all_reduce(rank_loss)
    optimizer.step()
    digests = [None] * world_size
    dist.all_gather_object(digests, weights_digest(net))
    return {"world_size": world_size, "per_rank_batch_size": share, "global_batch_size": len(examples),
            "loss_one_process": whole_loss.item(), "loss_mean_over_ranks": rank_loss.item() / world_size,
            "gradient_tensors": len(differences), "max_abs_grad_diff": max_difference.item(),
            "weights_identical_on_all_ranks": len(set(digests)) == 1}


def print_comparison(result: dict) -> None:
    """The comparison in words, at a precision that does not depend on the CPU; rank 0 only."""
    if dist.get_rank() != 0:
        return
    whole, world_size, share = result["global_batch_size"], result["world_size"], result["per_rank_batch_size"]
    print(f"one process, batch of {whole}:  loss {result['loss_one_process']:.4f}")
    print(f"{world_size} ranks x {share}, mean:    loss {result['loss_mean_over_ranks']:.4f}")
    print(f"gradients of {result['gradient_tensors']} tensors: max |DDP - one process| <= {TOLERANCE:g}: "
          f"{result['max_abs_grad_diff'] <= TOLERANCE}")
    print(f"after optimizer.step(), weights bitwise identical on all {world_size} ranks: "
          f"{result['weights_identical_on_all_ranks']}", flush=True)
