"""What ``state.pt`` holds, part by part, as ``save_checkpoint`` writes it: a crafted or damaged file is refused here,
before anything is loaded, whatever run reads it (``against_run`` then compares it with that run)."""

from __future__ import annotations

from pathlib import Path

import torch

from helpers.checkpoint.progress import PER_PROCESS, SHARED, check_rng_state
from helpers.checkpoint.validation import (is_count, is_finite, is_number, plain_tensor_problem, problems_in,
                                           require, require_accepted, shown)
from helpers.torch_private import grad_scaler_state

STATE_PARTS = ("optimizer", "scheduler", "scaler", "progress", "per_process")
"""What ``state.pt`` holds (``save_checkpoint``); a new part joins here and in ``check_state``."""
ADDED_LATER = {"scaler": None}
"""Parts a ``state.pt`` saved before they existed lacks, read as what that run had: no gradient scaler."""
PROGRESS_ADDED_LATER = {"skipped_steps": 0}
"""The same for the fields of ``progress``: a run without a gradient scaler skips no step."""
DEEPEST = 12
"""Containers within containers in a state.pt, at most (its deepest, a process's numpy random state, is 5 deep)."""
PLAIN = (type(None), bool, int, float, str)


def completed(state):
    """``state.pt``'s contents with what a checkpoint saved before a part existed lacks (``ADDED_LATER``)."""
    if type(state) is not dict:
        return state  # check_state names what it is
    state = state | {part: value for part, value in ADDED_LATER.items() if part not in state}
    progress = state.get("progress")
    if type(progress) is dict:
        state["progress"] = progress | {name: value for name, value in PROGRESS_ADDED_LATER.items()
                                        if name not in progress}
    return state


def check_state(file: Path, state) -> None:
    """Raise CheckpointError unless ``state`` (``state.pt``'s contents) has the parts and types ``save_checkpoint``
    writes: plain data and plain CPU tensors only, no deeper than ``DEEPEST``; its random states are tried on new
    generators. A crafted or damaged file fails here, not halfway through a resume."""
    with problems_in(file, "not a checkpoint's state as save_checkpoint writes it"):
        require(type(state) is dict and set(state) == set(STATE_PARTS), lambda: f"holds {listed(state)}, not the "
                                                                                f"parts {list(STATE_PARTS)}")
        check_plain_data("", state, 0)
        check_saved_optimizer(state["optimizer"])
        check_saved_scaler(state["scaler"])
        scheduler = state["scheduler"]
        require(scheduler is None or type(scheduler) is dict and all(type(key) is str for key in scheduler),
                lambda: f"scheduler: {type(scheduler).__name__} is not a scheduler's state_dict")
        check_progress(state["progress"])
        require(type(state["per_process"]) is list, lambda: f"per_process is a {type(state['per_process']).__name__}")
        for index, mine in enumerate(state["per_process"]):
            check_per_process(f"per_process[{index}]", mine)


def listed(value) -> str:
    return shown(list(value)) if isinstance(value, dict) else type(value).__name__


def check_plain_data(where: str, value, depth: int) -> None:
    """``value`` is plain data: None, bools, numbers, text, plain CPU tensors, in lists, tuples and dicts."""
    require(depth <= DEEPEST, lambda: f"{where or 'it'}: nested deeper than {DEEPEST} levels")
    if isinstance(value, torch.Tensor):
        problem = plain_tensor_problem(value)
        require(problem is None, lambda: f"{where}: {problem}")
    elif isinstance(value, dict):
        for key, item in value.items():
            require(type(key) in (str, int), lambda: f"{where or 'it'}: has the key {shown(key)}")
            check_plain_data(f"{where}[{key!r}]" if where else key, item, depth + 1)
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            check_plain_data(f"{where}[{index}]", item, depth + 1)
    else:
        require(type(value) in PLAIN, lambda: f"{where}: a {type(value).__name__}, which a checkpoint's state never "
                                              f"holds")


def check_saved_optimizer(optimizer) -> None:
    """None, or a state dict by parameter name: settings in ``param_groups``, entries in ``state`` (absent where they
    went into sharded/)."""
    if optimizer is None:
        return
    require(type(optimizer) is dict and set(optimizer) in ({"param_groups"}, {"param_groups", "state"}),
            lambda: f"optimizer: holds {listed(optimizer)}, not param_groups and state")
    groups = optimizer["param_groups"]
    require(type(groups) is list and all(type(group) is dict and type(group.get("params")) is list
                                         and all(type(name) is str for name in group["params"])
                                         and all(type(key) is str for key in group) for group in groups),
            "optimizer: its param_groups are not lists of parameter names with their settings")
    entries = optimizer.get("state", {})
    require(type(entries) is dict and all(type(name) is str and type(stats) is dict
                                          and all(type(stat) is str for stat in stats)
                                          for name, stats in entries.items()),
            "optimizer: its state is not a dict from parameter names to their state")


def check_saved_scaler(scaler) -> None:
    """None, or a GradScaler's state: its scale, factors and counts, each a finite number of its kind."""
    if scaler is None:
        return
    kinds = grad_scaler_state()
    require(type(scaler) is dict and set(scaler) == set(kinds),
            lambda: f"scaler: holds {listed(scaler)}, not a GradScaler's {list(kinds)}")
    scale, growth, backoff, interval, tracker = (scaler[key] for key in kinds)  # in GRAD_SCALER_STATE's order
    require(all(type(scaler[key]) is kind for key, kind in kinds.items()) and is_finite(scale) and scale > 0
            and is_finite(growth, 1.0) and is_finite(backoff) and 0 < backoff < 1 and interval >= 1
            and 0 <= tracker < interval, lambda: f"scaler: not a GradScaler's scale, factors and counts: "
                                                 f"{shown(scaler)}")


def check_progress(progress) -> None:
    """Where the run stands: counts, and one row of numbers per finished epoch."""
    require(type(progress) is dict and set(progress) == set(SHARED),
            lambda: f"progress: holds {listed(progress)}, not {list(SHARED)}")
    require(all(is_count(progress[name]) for name in ("step", "epoch", "batch", "skipped_steps"))
            and progress["skipped_steps"] <= progress["step"],
            lambda: f"progress: step, epoch, batch and skipped_steps are not counts: {shown(progress)}")
    history = progress["history"]
    require(type(history) is list and all(type(row) is dict for row in history), "progress: history is not a list "
                                                                                  "of rows")
    for index, row in enumerate(history):
        for key, value in row.items():
            require(is_number(value) or type(value) is list and all(is_number(item) for item in value),
                    lambda: f"progress: history[{index}][{key!r}] is {shown(value)}, not a number or a list of them")


def check_per_process(where: str, mine) -> None:
    """One process's part: random states, its losses of the epoch so far, where the epoch started."""
    require(type(mine) is dict and set(mine) == {"rng", *PER_PROCESS},
            lambda: f"{where}: holds {listed(mine)}, not rng, {', '.join(PER_PROCESS)}")
    require_accepted(f"{where}: rng", check_rng_state, mine["rng"])
    losses = mine["batch_losses"]
    require(type(losses) is list and all(is_number(loss) for loss in losses),
            f"{where}: batch_losses is not a list of numbers")
    start = mine["epoch_start"]
    if start is not None:
        require(type(start) is dict and set(start) == {"rng", "loader"},
                lambda: f"{where}: epoch_start holds {listed(start)}")
        require_accepted(f"{where}: epoch_start: rng", check_rng_state, start["rng"])
        if start["loader"] is not None:
            require_accepted(f"{where}: epoch_start: loader", torch.Generator().set_state, start["loader"])

