"""Loading a checkpoint folder, all or nothing.

``open_checkpoint`` reads every file and checks it against the model (and optimizer, scheduler, gradient scaler)
without changing anything: no hook of theirs runs, no state is made. ``OpenCheckpoint.apply`` then reads a sharded
checkpoint's tensors into new ones (and checks them), and only then changes the model, the optimizer, the scheduler,
the scaler and the random state, one after the other, each kept first: if any of them fails, everything goes back
to what it was. Any exception becomes one CheckpointError naming the file, the original kept as its cause.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.tensor import DTensor

from helpers.checkpoint.against_run import (check_entries, check_entry_values, check_optimizer, check_scaler,
                                            check_scheduler, check_weights)
from helpers.checkpoint.files import (MODEL_FILE, SHARDED_DIR, STATE_FILE, CheckpointError, read_state,
                                      read_weights, status_of)
from helpers.checkpoint.optimizer_state import describe, kept_state, numbered_state, parameter_names
from helpers.checkpoint.progress import epoch_start_state, set_epoch_start_state
from helpers.checkpoint.shard_metadata import METADATA_FILE, read_shard_metadata, saved_tensors
from helpers.checkpoint.shard_reader import ShardReader
from helpers.checkpoint.state_format import check_state, completed
from helpers.checkpoint.together import FAILURES, first_failure, summary
from helpers.optim import abbreviate
from helpers.wrapping import is_sharded, unwrap

HEADER_BYTES = 8 + 100 * 2**20
"""A safetensors file besides its tensors: the header's length and the header (safetensors refuses one over 100 MB)."""
STATE_BYTES_PER_PARAMETER_BYTE = 4
"""``state.pt`` holds at most this many bytes of optimizer state per byte of weights (Adam with amsgrad keeps 3)."""
STATE_OTHER_BYTES = 64 * 2**20
"""``state.pt`` besides optimizer tensors: random states (about 10 KB per process), progress, history."""


def tensor_bytes(model: nn.Module) -> int:
    """The bytes of ``model``'s weights (whole, where it is sharded)."""
    return sum(value.numel() * value.element_size() for value in unwrap(model).state_dict().values())


def by_parameter(entries: dict[str, object]) -> dict[str, dict[str, object]]:
    """{'parameter.name.entry': value} as {'parameter.name': {'entry': value}}."""
    grouped: dict[str, dict[str, object]] = {}
    for key, value in entries.items():
        parameter, _, name = key.rpartition(".")
        grouped.setdefault(parameter, {})[name] = value
    return grouped


@dataclass
class OpenCheckpoint:
    """A checkpoint folder whose files were all read and checked against a model; ``apply`` loads it."""

    path: Path
    state: dict  # state.pt's contents ({} when neither optimizer nor scheduler needs it and it is absent)
    weights: dict[str, torch.Tensor] | None  # model.safetensors' tensors; None for a sharded checkpoint
    shards: Metadata | None  # sharded/'s metadata, read safely; None for full weights

    def load_into(self, model: nn.Module, optimizer=None, scheduler=None,
                  scaler: torch.amp.GradScaler | None = None) -> dict:
        """``apply``, and return ``state.pt``'s contents."""
        self.apply(model, optimizer, scheduler, scaler)
        return self.state

    def apply(self, model: nn.Module, optimizer=None, scheduler=None, scaler: torch.amp.GradScaler | None = None,
              epoch_start: tuple | None = None) -> Callable[[], None]:
        """Load the weights (and optimizer, scheduler and scaler state, if given) into ``model`` in any wrapping, the
        ones ``open_checkpoint`` checked; ``epoch_start``: (a loader, the random state its epoch started from) to
        set as well. Returns a function that puts everything back as it was (a resume calls it when another process
        failed). With a sharded checkpoint or model, call it on every process.

        Each object is kept before it is changed: the optimizer, scheduler, scaler and random state by reference
        or as their small state dicts, the model's weights as a copy in CPU memory. A sharded checkpoint's tensors
        are read into new tensors first (one more copy of this process's part of the checkpoint).
        """
        target = unwrap(model)
        try:
            weights, optimizer_state = self.tensors(target, optimizer)
        except CheckpointError:
            raise
        except FAILURES as error:
            raise CheckpointError(f"{self.path}: not loaded ({summary(error)})") from error
        undo: list[Callable[[], None]] = []
        try:
            undo.append(kept_weights(target))
            set_model_state_dict(target, weights, options=StateDictOptions(
                full_state_dict=self.shards is None and is_sharded(target)))  # full weights into a sharded model
            if optimizer is not None:
                undo.append(kept_optimizer(optimizer))
                optimizer.load_state_dict(numbered_state(optimizer_state, target, optimizer))
            if scheduler is not None:
                undo.append(kept_state_dict(scheduler))
                scheduler.load_state_dict(dict(self.state["scheduler"]))
            if scaler is not None and self.state.get("scaler") is not None:
                undo.append(kept_state_dict(scaler))
                scaler.load_state_dict(self.state["scaler"])
            if epoch_start is not None:
                loader, random_state = epoch_start
                undo.append(kept_random_state(loader))
                set_epoch_start_state(loader, random_state)
        except BaseException as error:
            put_back(undo)
            if not isinstance(error, Exception):  # KeyboardInterrupt: put back, and go on stopping
                raise
            raise CheckpointError(f"{self.path}: not loaded, and everything is as it was "
                                  f"({summary(error)})") from error
        return lambda: put_back(undo)

    def tensors(self, target: nn.Module, optimizer) -> tuple[dict, dict | None]:
        """The weights and the optimizer state (by parameter name) to load: a full checkpoint's as read; a sharded
        one's read by DCP into new tensors of this process's shards, and checked."""
        if self.shards is None:
            return self.weights, None if optimizer is None else {"state": {}} | self.state["optimizer"]
        folder = self.path / SHARDED_DIR
        weights = {key: torch.empty_like(value) for key, value in get_model_state_dict(target).items()}
        parameters = dict(target.named_parameters())
        moments = {parameter: {name: torch.empty_like(parameters[parameter], dtype=dtype)
                               if tuple(shape) == tuple(parameters[parameter].shape) else torch.empty(shape, dtype=dtype)
                               for name, (shape, dtype) in stats.items()}
                   for parameter, stats in by_parameter(saved_tensors(self.shards, "optimizer.state.")).items()
                   } if optimizer is not None else {}
        try:
            with warnings.catch_warnings():  # without a process group: "assuming the intent is to load in a
                warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)  # single process"
                dcp.load({"model": weights, "optimizer": {"state": moments}},
                         storage_reader=ShardReader(folder, self.shards))
        except FAILURES as error:  # DCP's CheckpointException is a BaseException, raised on every process alike
            _, failure = first_failure(error)
            message = str(failure) if isinstance(failure, CheckpointError) else \
                f"{folder}: torch.distributed.checkpoint could not read it ({summary(error)})"
            raise CheckpointError(message) from error
        if optimizer is None:
            return weights, None
        check_entry_values(folder / METADATA_FILE, moments)
        return weights, {"state": moments, "param_groups": self.state["optimizer"]["param_groups"]}


def put_back(undo: list[Callable[[], None]]) -> None:
    for restore in reversed(undo):
        restore()


def kept_weights(model: nn.Module) -> Callable[[], None]:
    """Copy ``model``'s parameters and buffers (this process's shards) to CPU memory; returns what copies them back."""
    with torch.no_grad():
        live = [value.to_local() if isinstance(value, DTensor) else value
                for value in [*model.parameters(), *model.buffers()]]
        copies = [value.detach().to("cpu", copy=True) for value in live]

    def copy_back() -> None:
        with torch.no_grad():
            for value, copy in zip(live, copies):
                value.copy_(copy)
    return copy_back


def kept_optimizer(optimizer) -> Callable[[], None]:
    """``load_state_dict`` gives an optimizer new ``state`` and ``param_groups`` objects: the old ones go back."""
    state, groups = optimizer.state, optimizer.param_groups

    def restore() -> None:
        optimizer.state, optimizer.param_groups = state, groups
    return restore


def kept_state_dict(obj) -> Callable[[], None]:
    """A scheduler's or a gradient scaler's ``state_dict()`` (small), loaded back to put it back."""
    saved = obj.state_dict()
    return lambda: obj.load_state_dict(saved)


def kept_random_state(loader) -> Callable[[], None]:
    saved = epoch_start_state(loader)
    return lambda: set_epoch_start_state(loader, saved)


def open_checkpoint(path: str | Path, model: nn.Module, optimizer=None, scheduler=None,
                    scaler: torch.amp.GradScaler | None = None) -> OpenCheckpoint:
    """Read every file of checkpoint folder ``path`` and check it against ``model`` (and ``optimizer``,
    ``scheduler``, ``scaler``); raises CheckpointError naming the file and the cause. Changes nothing.

    With an optimizer (resuming), a gradient scaler must be given exactly when the checkpoint holds one."""
    path = Path(path)
    try:
        return checked(path, model, optimizer, scheduler, scaler)
    except CheckpointError:
        raise
    except Exception as error:  # what no check foresaw: still one CheckpointError with its cause
        raise CheckpointError(f"{path}: not readable as a checkpoint ({summary(error)})") from error


def checked(path: Path, model: nn.Module, optimizer, scheduler, scaler) -> OpenCheckpoint:
    status_of(path, path, "folder")
    model_bytes = tensor_bytes(model)
    weights, shards = None, None
    if os.path.lexists(path / SHARDED_DIR):
        status_of(path / SHARDED_DIR, path, "folder")
        shards = read_shard_metadata(path / SHARDED_DIR)
        check_weights(path / SHARDED_DIR, saved_tensors(shards, "model."), model)
        others = [key for key in shards.state_dict_metadata if not key.startswith(("model.", "optimizer.state."))]
        if others:
            raise CheckpointError(f"{path / SHARDED_DIR / METADATA_FILE}: holds entries that are neither weights nor "
                                  f"optimizer state: {abbreviate(others, 3)}")
    else:
        weights = read_weights(path / MODEL_FILE, path, model_bytes + HEADER_BYTES)
        check_weights(path / MODEL_FILE, {key: (value.shape, value.dtype) for key, value in weights.items()}, model)
    state_file = path / STATE_FILE
    state = {}
    if optimizer is not None or scheduler is not None or scaler is not None or os.path.lexists(state_file):
        state = completed(read_state(state_file, path, STATE_BYTES_PER_PARAMETER_BYTE * model_bytes
                                     + STATE_OTHER_BYTES))
        check_state(state_file, state)
    if optimizer is not None:
        if (shards is not None) != is_sharded(model):
            saved, given = ("a sharded", "an unsharded") if shards is not None else ("an unsharded", "a sharded")
            raise CheckpointError(f"{path}: saved from {saved} model, loaded with its optimizer into {given} one; "
                                  f"training continues exactly only as it was saved (sharded or not); its weights "
                                  f"alone load into either (leave the optimizer out)")
        check_optimizer(state_file, state["optimizer"], model, optimizer)
        if shards is not None:
            entries_file = path / SHARDED_DIR / METADATA_FILE
            entries = by_parameter({key: ("tensor", tuple(shape), dtype) for key, (shape, dtype)
                                    in saved_tensors(shards, "optimizer.state.").items()})
        else:
            entries_file, saved_state = state_file, state["optimizer"].get("state", {})
            entries = {parameter: {name: describe(value) for name, value in stats.items()}
                       for parameter, stats in saved_state.items()}
            check_entry_values(state_file, saved_state)
        check_entries(entries_file, entries, kept_by_name(state_file, model, optimizer), model)
    if scheduler is not None:
        check_scheduler(state_file, state["scheduler"], scheduler)
    if optimizer is not None or scaler is not None:
        check_scaler(state_file, state["scaler"], scaler)
    return OpenCheckpoint(path, state, weights, shards)


def kept_by_name(file: Path, model: nn.Module, optimizer) -> dict[str, dict]:
    """``kept_state`` of ``optimizer`` by the parameters' names in ``model``."""
    try:
        kept = kept_state(optimizer)
    except Exception as error:
        raise CheckpointError(f"{file}: cannot tell what state a {type(optimizer).__name__} keeps for its parameters "
                              f"(its step on their shapes alone failed: {summary(error)})") from error
    return {name: entries for names, group in zip(parameter_names(model, optimizer), kept)
            for name, entries in zip(names, group)}


def load_checkpoint(path: str | Path, model: nn.Module, optimizer=None, scheduler=None,
                    scaler: torch.amp.GradScaler | None = None) -> dict:
    """Load the checkpoint folder ``path`` into ``model`` (plain, wrapped or sharded) and, if given, the
    optimizer, scheduler and gradient scaler; returns the rest of the checkpoint (``progress``, ``per_process``).

    Every file is read and checked before anything is changed, and a failure while loading puts back what was
    changed: on a CheckpointError the model, the optimizer, the scheduler and the scaler are exactly as they were.
    A sharded checkpoint loads into any number of processes (each reads the parts its own shards cover), or into
    a plain model without a process group.
    """
    return open_checkpoint(path, model, optimizer, scheduler, scaler).load_into(model, optimizer, scheduler, scaler)


def checkpoint_layout(path: Path) -> str:
    """"sharded" for a checkpoint folder a sharded model wrote (``sharded/``), else "full"."""
    return "sharded" if (Path(path) / SHARDED_DIR).is_dir() else "full"
