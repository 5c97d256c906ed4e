"""FSDP2 (``fully_shard``): shard Net over the processes, train it in helpers.finetune, save and load sharded checkpoints.

DDP keeps a full copy of the weights, their gradients and Adam's state on every rank. ``fully_shard`` keeps
1/N of each on each of N ranks: before a sharded module's forward it all-gathers its weights, after its
backward it reduce-scatters their gradients, and it frees the gathered weights again after the forward
(``reshard_after_forward``). Here each BertLayer is one such unit and the root (embeddings, head) another.

``fully_shard`` swaps the module's class in place (``Net`` becomes ``FSDPNet``) instead of wrapping it, so
``net.bert`` still works and there is no ``.module``; what changes is that every parameter becomes a new
DTensor object, so an optimizer must be built after sharding. Per-rank memory: helpers.fsdp_memory.
"""

from __future__ import annotations

import shutil
import tempfile
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard

from helpers.checkpoint import (STATE_FILE, TEMPORARY_PREFIX, CheckpointError, Checkpoints, Progress,
                                check_process_count, fsync_dir, fsync_file, read_state)
from helpers.distributed import rank, world_size

STRATEGIES = ("ddp", "fsdp")
SHARDED_DIR = "sharded"  # a sharded checkpoint's torch.distributed.checkpoint files: one per rank + .metadata


# --- sharding ---------------------------------------------------------------------------------------------

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


def is_sharded(model: nn.Module) -> bool:
    return isinstance(model, FSDPModule)


class FullWeights:
    """What ``model.state_dict()`` would be without sharding: plain tensors, on every rank.

    Functions that read ``model.state_dict()`` (``weights_digest``, ``save_checkpoint``) accept it in place of
    the model. Building it is a collective: every rank must call it.
    """

    def __init__(self, model: nn.Module):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        self.weights = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True)) \
            if is_sharded(model) else model.state_dict()

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.weights


# --- the strategy of helpers.finetune ----------------------------------------------------------------------

def check_strategy(strategy: str) -> None:
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy {strategy!r}: expected one of {', '.join(STRATEGIES)}")


def prepare(net: nn.Module, strategy: str) -> nn.Module:
    """Before the optimizer is built: shard ``net`` for FSDP (its parameters become new objects); DDP: as is."""
    check_strategy(strategy)
    return shard(net) if strategy == "fsdp" else net


def wrap(net: nn.Module, strategy: str, device: torch.device) -> nn.Module:
    """After the optimizer is built: DDP wraps ``net`` (``.module``); a sharded ``net`` is used as it is."""
    check_strategy(strategy)
    if strategy == "fsdp":
        return net
    return nn.parallel.DistributedDataParallel(net, device_ids=[device.index] if device.type == "cuda" else None)


def checkpoints_for(strategy: str, directory, every: int = 0, labels: tuple[str, ...] | None = None) -> Checkpoints:
    """A folder of checkpoints in the format the strategy writes: full weights (DDP) or shards (FSDP).

    ``labels`` are saved with full weights only; shards are for resuming, and the run's --output-dir model
    carries the names."""
    check_strategy(strategy)
    return (ShardedCheckpoints if strategy == "fsdp" else Checkpoints)(directory, every=every, labels=labels)


def strategy_problem(directory: Path | None, strategy: str) -> str | None:
    """Why ``--resume`` with ``strategy`` cannot continue from the latest checkpoint in ``directory``, or None."""
    check_strategy(strategy)
    if directory is None or not (Path(directory) / "latest").is_file():
        return None
    latest = Path(directory) / (Path(directory) / "latest").read_text(encoding="utf-8").strip()
    saved = "fsdp" if (latest / SHARDED_DIR).is_dir() else "ddp"
    if saved == strategy:
        return None
    held = "sharded weights and optimizer state" if saved == "fsdp" else "full weights and a plain optimizer state"
    return (f"{latest}: saved by a --strategy {saved} run ({held}), resumed with --strategy {strategy}; resume "
            f"with --strategy {saved}, or start a new --checkpoint-dir")


# --- sharded checkpoints (torch.distributed.checkpoint) ---------------------------------------------------

def save_sharded(path: str | Path, model: nn.Module, optimizer=None, extra: dict | None = None) -> Path:
    """Write the checkpoint folder ``path`` from every rank: each writes its own shards into ``sharded/``, rank 0
    also ``state.pt`` (``extra``: scheduler, progress, ...). Written into a temporary folder and renamed, so it
    appears complete or not at all. Call it on every rank.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    path = Path(path)
    temporary = [Path(tempfile.mkdtemp(prefix=TEMPORARY_PREFIX, dir=path.parent)) if rank() == 0 else None]
    dist.broadcast_object_list(temporary, src=0)
    temporary = temporary[0]
    model_state, optimizer_state = get_state_dict(model, optimizer if optimizer is not None else [])
    dcp.save({"model": model_state} | ({"optimizer": optimizer_state} if optimizer is not None else {}),
             checkpoint_id=temporary / SHARDED_DIR)
    for file in (temporary / SHARDED_DIR).iterdir():  # each rank flushes what it wrote; .metadata by rank 0
        if file.name.startswith(f"__{rank()}_") or (rank() == 0 and file.name == ".metadata"):
            fsync_file(file)
    dist.barrier()
    if rank() == 0:
        torch.save((extra or {}) | {"world_size": world_size(), "has_optimizer": optimizer is not None},
                   temporary / STATE_FILE)
        fsync_file(temporary / STATE_FILE)
        fsync_dir(temporary / SHARDED_DIR)
        fsync_dir(temporary)
        if path.exists():
            shutil.rmtree(path)
        temporary.rename(path)
        fsync_dir(path.parent)
    dist.barrier()
    return path


def check_sharded(path: Path) -> None:
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint folder")
    if not (path / SHARDED_DIR / ".metadata").is_file():
        what = "a full-weights checkpoint (helpers.checkpoint, written by --strategy ddp)" \
            if (path / "model.safetensors").is_file() else "not a sharded checkpoint"
        raise CheckpointError(f"{path}: {what}: it has no {SHARDED_DIR}/.metadata; load it with "
                              f"helpers.checkpoint.load_checkpoint")


def load_sharded(path: str | Path, model: nn.Module, optimizer=None) -> dict:
    """Load the sharded checkpoint ``path`` into ``model`` (sharded over any number of ranks, or a plain model
    without a process group) and, if given, ``optimizer``; returns ``state.pt``'s contents.

    torch.distributed.checkpoint reads, on each rank, the parts of the saved shards that this rank's own
    shards cover, so a checkpoint saved by 2 processes loads into 1, 4 or a plain ``Net`` (resharding).
    """
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    path = Path(path)
    check_sharded(path)
    state = read_state(path / STATE_FILE)
    if optimizer is not None and not state.get("has_optimizer"):
        raise CheckpointError(f"{path / STATE_FILE}: holds no optimizer state (it was saved without an optimizer)")
    plain = not (dist.is_available() and dist.is_initialized())
    if plain and is_sharded(model):
        raise CheckpointError(f"{path}: a sharded model needs its process group to load into")
    if plain and optimizer is not None:
        raise CheckpointError(f"{path}: loading optimizer state needs a process group (torchrun, or a group of one)")
    if plain:  # no process group: plain tensors, read in this process
        model_state = model.state_dict()
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            read_shards(path, {"model": model_state}, model, no_dist=True)
        model.load_state_dict(model_state)
        return state
    model_state, optimizer_state = get_state_dict(model, optimizer if optimizer is not None else [])
    loaded = {"model": model_state} | ({"optimizer": optimizer_state} if optimizer is not None else {})
    read_shards(path, loaded, model)
    set_state_dict(model, optimizer if optimizer is not None else [], model_state_dict=loaded["model"],
                   optim_state_dict=loaded.get("optimizer", {}))
    return state


def read_shards(path: Path, state_dict: dict, model: nn.Module, **options) -> None:
    """``dcp.load`` into ``state_dict`` in place; a checkpoint of another model raises CheckpointError."""
    import torch.distributed.checkpoint as dcp

    try:
        dcp.load(state_dict, checkpoint_id=path / SHARDED_DIR, **options)
    except Exception as error:  # torch raises CheckpointException, RuntimeError or KeyError for a mismatch
        cause = (str(error).strip().splitlines() or [""])[0][:300]
        raise CheckpointError(f"{path / SHARDED_DIR}: does not fit {type(model).__name__} "
                              f"({type(error).__name__}: {cause})") from None


class ShardedCheckpoints(Checkpoints):
    """``Checkpoints`` for a sharded model: every rank writes its own shards (no rank gathers the full model),
    rank 0 writes ``state.pt`` and the ``latest``/``best`` pointers. Resuming needs the same number of ranks
    (each gets its own random state back); loading the weights alone (``load_sharded``) does not.
    """

    def write(self, path: Path, model: nn.Module, optimizer, scheduler, progress: Progress,
              per_process: list) -> Path:
        """Every rank writes its own shards; rank 0 also the scheduler, progress and random states."""
        dist.barrier()  # rank 0 has removed what a killed save left behind
        return save_sharded(path, model, optimizer, {"scheduler": scheduler.state_dict() if scheduler is not None
                                                     else None, "progress": progress.shared(),
                                                     "per_process": per_process})

    def load(self, path: Path, model: nn.Module, optimizer, scheduler) -> dict:
        check_sharded(path)
        state = read_state(path / STATE_FILE)
        check_process_count(path, state, " (helpers.fsdp.load_sharded loads the weights into any number)")
        load_sharded(path, model, optimizer)
        if scheduler is not None:
            scheduler.load_state_dict(state["scheduler"])
        return state


# --- equivalence with one process ------------------------------------------------------------------------

TOLERANCE = 1e-6


def compare_with_one_process(model: str | None, examples: list, collate, device: torch.device, seed: int = 0,
                             lr: float = 0.1) -> dict:
    """One sharded step on this rank's share of ``examples`` against one process on all of them; every rank joins.

    Compares the gradients, then the weights after one SGD step (Adam's first step divides by the gradient's
    own size, so a gradient near Adam's eps moves its weight by up to ``lr`` either way: a rounding
    difference then shows as a large one). Dropout is off (eval mode).
    """
    import copy

    from transformers import set_seed

    from helpers.ddp_equivalence import loss_and_backward
    from helpers.net import Net

    ranks, me = dist.get_world_size(), dist.get_rank()
    share = len(examples) // ranks
    examples = examples[:share * ranks]
    set_seed(seed)
    one_process = Net(model, pooler=False).to(device).eval()  # eval(): no dropout
    sharded = shard(copy.deepcopy(one_process))
    rank_loss = loss_and_backward(sharded, collate(examples[me * share:(me + 1) * share]))
    whole_loss = loss_and_backward(one_process, collate(examples))

    named = dict(one_process.named_parameters())
    grad_diff = max((p.grad.full_tensor() - named[name].grad).abs().max().item()
                    for name, p in sharded.named_parameters())
    for net in (sharded, one_process):
        torch.optim.SGD(net.parameters(), lr=lr).step()
    weight_diff = max((p.full_tensor() - named[name]).abs().max().item() for name, p in sharded.named_parameters())
    dist.all_reduce(rank_loss)
    local = sum(p.to_local().numel() for p in sharded.parameters())
    return {"world_size": ranks, "per_rank_batch_size": share, "global_batch_size": len(examples),
            "loss_one_process": whole_loss.item(), "loss_mean_over_ranks": rank_loss.item() / ranks,
            "gradient_tensors": len(named), "max_abs_grad_diff": grad_diff, "sgd_lr": lr,
            "max_abs_weight_diff_after_sgd": weight_diff, "parameters": sum(p.numel() for p in named.values()),
            "parameters_on_this_rank": local}


def print_comparison(result: dict) -> None:
    """The comparison in words, at a precision that does not depend on the CPU; rank 0 only."""
    if dist.get_rank() != 0:
        return
    print(f"one process, batch of {result['global_batch_size']}:  loss {result['loss_one_process']:.4f}")
    print(f"{result['world_size']} ranks x {result['per_rank_batch_size']}, mean:    loss "
          f"{result['loss_mean_over_ranks']:.4f}")
    print(f"parameters: {result['parameters']:,} in all, {result['parameters_on_this_rank']:,} on rank 0")
    print(f"gradients of {result['gradient_tensors']} tensors: max |FSDP - one process| <= {TOLERANCE:g}: "
          f"{result['max_abs_grad_diff'] <= TOLERANCE}")
    print(f"after one SGD step (lr {result['sgd_lr']:g}): max |FSDP - one process| <= {TOLERANCE:g}: "
          f"{result['max_abs_weight_diff_after_sgd'] <= TOLERANCE}", flush=True)
