"""Writing a checkpoint folder atomically (helpers.checkpoint.atomic): after a kill at any moment, the folder exists
complete or not at all.

Not sharded (plain, DataParallel, DDP, torch.compile): rank 0 writes ``model.safetensors`` (the full weights) and
``state.pt`` (optimizer, scheduler, gradient scaler, where the run stands, every process's random state). Sharded
(FSDP2): every process writes its shards of the weights and of the optimizer state into ``sharded/``
(torch.distributed.checkpoint's files), so no process ever holds the whole model; rank 0 writes the rest into
``state.pt``. Weights and optimizer state go under the plain model's parameter names, whatever the wrapping.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from helpers.checkpoint.atomic import atomic_folder, fsync_file
from helpers.checkpoint.files import MODEL_FILE, SHARDED_DIR, STATE_FILE, CheckpointError
from helpers.checkpoint.optimizer_state import named_state
from helpers.checkpoint.progress import Progress
from helpers.checkpoint.together import FAILURES, summary
from helpers.checkpoint.weights import full_weights
from helpers.distributed import rank
from helpers.wrapping import is_sharded, unwrap


def write_weights(file: Path, weights: dict[str, torch.Tensor], labels: tuple[str, ...] | None) -> None:
    """Full weights into a safetensors file; ``labels``, the output names in index order, into its metadata."""
    metadata = {"labels": json.dumps(list(labels), ensure_ascii=False)} if labels else None
    save_file({key: value.detach().cpu().contiguous() for key, value in weights.items()}, file, metadata=metadata)
    fsync_file(file)


def save_checkpoint(path: str | Path, model: nn.Module, optimizer=None, scheduler=None, *,
                    scaler: torch.amp.GradScaler | None = None, progress: Progress | None = None,
                    per_process: list | None = None, labels: tuple[str, ...] | None = None) -> Path:
    """Write the checkpoint folder ``path`` atomically: it appears complete or not at all.

    Call it on every process: a sharded model's processes each write their own shards; otherwise rank 0
    writes everything and the others return at once. ``scaler`` is fp16 training's gradient scaler (its scale
    and how many steps it has gone without inf or nan); ``per_process`` holds what differs between processes
    (their random states); ``labels``, the names of the model's outputs, go into ``model.safetensors``.
    An optimizer that has not stepped is saved without state, and left without. A failed write raises
    CheckpointError; with a sharded model, on every process.
    """
    path, sharded = Path(path), is_sharded(model)
    if not sharded and rank() != 0:
        return path
    try:
        model_state = get_model_state_dict(unwrap(model))
        optimizer_state = named_state(model, optimizer) if optimizer is not None else None
    except ValueError as error:  # the optimizer holds a tensor that is not a parameter of the model
        raise CheckpointError(f"{path}: not saved ({error})") from error
    state = {"optimizer": optimizer_state,
             "scheduler": scheduler.state_dict() if scheduler is not None else None,
             "scaler": scaler.state_dict() or None if scaler is not None else None,  # a disabled one's is {}
             "progress": (progress or Progress()).shared(), "per_process": per_process or []}
    try:
        with atomic_folder(path, every_process=sharded) as folder:
            if sharded:  # each process its shards; the optimizer's settings (param_groups) stay in state.pt
                tensors = {"model": model_state} | ({"optimizer": {"state": optimizer_state["state"]}}
                                                    if optimizer is not None else {})
                dcp.save(tensors, storage_writer=FileSystemWriter(folder / SHARDED_DIR))  # it flushes its files
                if optimizer is not None:
                    state["optimizer"] = {"param_groups": optimizer_state["param_groups"]}
            else:
                write_weights(folder / MODEL_FILE, model_state, labels)
            if rank() == 0:
                torch.save(state, folder / STATE_FILE)
                fsync_file(folder / STATE_FILE)
    except FAILURES as error:  # DCP's CheckpointException is a BaseException: `except Exception` misses it
        raise CheckpointError(f"{path}: not saved ({summary(error)})") from error
    return path


def save_model(path: str | Path, model: nn.Module, labels: tuple[str, ...] | None = None) -> Path:
    """The trained model for readers (``helpers.predict.load_classifier``, ``load_checkpoint``): its full weights
    and label names in ``path/model.safetensors``, whatever the wrapping. Call it on every process (a sharded
    model's weights are gathered first); rank 0 writes."""
    path, weights = Path(path), full_weights(model)
    if rank() == 0:
        with atomic_folder(path) as folder:
            write_weights(folder / MODEL_FILE, weights, labels)
    return path
