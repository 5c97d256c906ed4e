"""FSDP2 (``fully_shard``): shard Net over the processes, and the ``--strategy`` of helpers.finetune (ddp or fsdp).

DDP keeps a full copy of the weights, their gradients and Adam's state on every rank. ``fully_shard`` keeps
1/N of each on each of N ranks: before a sharded module's forward it all-gathers its weights, after its
backward it reduce-scatters their gradients, and it frees the gathered weights again after the forward, except
the root's: ``reshard_after_forward``'s default, None, means False for the root (its weights are needed first in the
backward) and True for the others. Here each BertLayer is one such unit and the root (embeddings, head) another.

``fully_shard`` swaps the module's class in place (``Net`` becomes ``FSDPNet``) instead of wrapping it, so
``net.bert`` still works and there is no ``.module``; what changes is that every parameter becomes a new
DTensor object, so an optimizer must be built after sharding. Checkpoints of a sharded model (each process
writes its shards): helpers.checkpoint. Per-rank memory: helpers.memory.fsdp2.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from helpers.checkpoint import CheckpointError, Checkpoints, checkpoint_layout

FINETUNE_STRATEGIES = ("ddp", "fsdp")  # helpers.finetune --strategy


def shard(net: nn.Module, mesh=None, **options) -> nn.Module:
    """``fully_shard`` each BertLayer of ``net.bert``, then ``net`` itself (embeddings, head); returns ``net``.

    ``mesh`` defaults to all processes of the group, on the device of ``net``'s parameters. ``options``
    go to every ``fully_shard`` call (``mp_policy``, ``offload_policy``, ``reshard_after_forward``).
    """
    if mesh is None:
        mesh = init_device_mesh(next(net.parameters()).device.type, (dist.get_world_size(),))
    for layer in net.bert.encoder.layer:
        fully_shard(layer, mesh=mesh, **options)
    fully_shard(net, mesh=mesh, **options)
    return net


def check_strategy(strategy: str) -> None:
    if strategy not in FINETUNE_STRATEGIES:
        raise ValueError(f"strategy {strategy!r}: expected one of {', '.join(FINETUNE_STRATEGIES)}")


def prepare(net: nn.Module, strategy: str, **options) -> nn.Module:
    """Before the optimizer is built: shard ``net`` for FSDP (its parameters become new objects), with ``options``
    for ``fully_shard`` (e.g. ``mp_policy``); DDP: as is."""
    check_strategy(strategy)
    return shard(net, **options) if strategy == "fsdp" else net


def wrap(net: nn.Module, strategy: str, device: torch.device) -> nn.Module:
    """After the optimizer is built: DDP wraps ``net`` (``.module``); a sharded ``net`` is used as it is."""
    check_strategy(strategy)
    if strategy == "fsdp":
        return net
    return nn.parallel.DistributedDataParallel(net, device_ids=[device.index] if device.type == "cuda" else None)


def strategy_problem(directory: Path | None, strategy: str) -> str | None:
    """Why ``--resume`` with ``strategy`` cannot continue from the latest checkpoint in ``directory``, or None.

    An FSDP run saves shards, a DDP run full weights; loading either's optimizer state into the other would
    make a different run, not continue this one.
    """
    check_strategy(strategy)
    try:
        latest = Checkpoints(directory).latest() if directory is not None else None
    except CheckpointError as error:
        return str(error)
    if latest is None:
        return None
    saved = "fsdp" if checkpoint_layout(latest) == "sharded" else "ddp"
    if saved == strategy:
        return None
    held = "sharded weights and optimizer state" if saved == "fsdp" else "full weights and a plain optimizer state"
    return (f"{latest}: saved by a --strategy {saved} run ({held}), resumed with --strategy {strategy}; resume "
            f"with --strategy {saved}, or start a new --checkpoint-dir")
