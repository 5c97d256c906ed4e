"""A checkpoint against the run that loads it: the weights fit the model, and the optimizer, scheduler and gradient
scaler state is what this run's objects would have written. The same keys (a few that torch adds are named and
allowed), each of this run's type (``None`` is not a bool), the settings equal to this run's (a checkpoint another
run wrote is refused, naming the setting that differs), and what changes as the run goes (the learning rate, where
the schedule stands, the scaler's scale) finite and in range. Nothing here changes the objects it looks at."""

from __future__ import annotations

import math
from itertools import chain
from pathlib import Path

import torch
from torch import nn

from helpers.checkpoint.files import CheckpointError
from helpers.checkpoint.optimizer_state import parameter_names
from helpers.checkpoint.validation import is_number, shown
from helpers.optim import abbreviate
from helpers.torch_private import GRAD_SCALER_POSITION, schedule_position
from helpers.wrapping import unwrap

MOVED_BY_SCHEDULE = ("lr",)
"""The settings of an optimizer's group a scheduler changes as it steps; every other one must equal this run's."""
ADDED_BY_TORCH = ("initial_lr", "param_names")
"""Keys torch adds to an optimizer's group: a scheduler's ``initial_lr``, and the names of an optimizer built from
named parameters. A saved group may hold them where this run's does not (it was saved with a scheduler, or named
parameters); every key this run's group has must be saved."""
DEEPEST = 8
"""How deep ``same_type`` and ``same_value`` follow lists and dicts (a setting is a number, a pair, a short list)."""


def same_type(saved, mine, depth: int = 0) -> bool:
    """Whether ``saved`` has the type of ``mine``, item by item in lists, tuples and dicts (a tensor: its dtype and
    shape). Exact types: ``None`` is not ``False``, ``1`` is not ``1.0``."""
    if depth > DEEPEST or type(saved) is not type(mine):
        return False
    if isinstance(mine, torch.Tensor):
        return (saved.dtype, saved.shape) == (mine.dtype, mine.shape)
    if isinstance(mine, (list, tuple)):
        return len(saved) == len(mine) and all(same_type(a, b, depth + 1) for a, b in zip(saved, mine))
    if isinstance(mine, dict):
        return saved.keys() == mine.keys() and all(same_type(saved[key], mine[key], depth + 1) for key in mine)
    return True


def same_value(saved, mine) -> bool:
    """``same_type``, and equal in every value (a NaN equals nothing)."""
    if not same_type(saved, mine):
        return False
    if isinstance(mine, torch.Tensor):
        return bool(torch.equal(saved.cpu(), mine.detach().cpu()))
    if isinstance(mine, (list, tuple)):
        return all(same_value(a, b) for a, b in zip(saved, mine))
    if isinstance(mine, dict):
        return all(same_value(saved[key], mine[key]) for key in mine)
    return saved == mine


def numbers_in(value, depth: int = 0) -> list[float]:
    """Every number in ``value`` (in lists, tuples and dicts; a tensor's values), bools left out."""
    if depth > DEEPEST:
        return [math.nan]
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().double().flatten().tolist() if value.is_floating_point() else []
    if isinstance(value, (list, tuple)):
        return [number for item in value for number in numbers_in(item, depth + 1)]
    if isinstance(value, dict):
        return [number for item in value.values() for number in numbers_in(item, depth + 1)]
    return [value] if is_number(value) else []


def setting_problem(key: str, saved, mine, moves: bool) -> str | None:
    """What is wrong with the saved value of the setting ``key`` where this run has ``mine``: another type, another
    value, or (for one that ``moves`` as the run goes) a number that is not finite and >= 0; or None."""
    if not same_type(saved, mine):
        return f"{key!r} saved as {shown(saved)}, it has {shown(mine)}"
    if moves:
        if not all(math.isfinite(number) and number >= 0 for number in numbers_in(saved)):
            return f"{key!r} saved as {shown(saved)}, where finite numbers >= 0 belong"
    elif not same_value(saved, mine):
        return f"{key!r} saved as {shown(saved)}, it has {shown(mine)}"
    return None


def check_weights(file: Path, saved: dict[str, tuple], model: nn.Module) -> None:
    """Raise CheckpointError if the ``saved`` names, shapes and dtypes do not fit ``model`` exactly."""
    expected = {key: (value.shape, value.dtype) for key, value in unwrap(model).state_dict().items()}
    missing = [key for key in expected if key not in saved]
    unexpected = [key for key in saved if key not in expected]
    different = [f"{key} {tuple(saved[key][0])} {saved[key][1]} (the model has {tuple(shape)} {dtype})"
                 for key, (shape, dtype) in expected.items() if key in saved and saved[key] != (shape, dtype)]
    problems = [f"{label}: {abbreviate(names, 3)}" for label, names in
                (("missing", missing), ("unexpected", unexpected), ("different shape or dtype", different)) if names]
    if problems:
        raise CheckpointError(f"{file}: saved from a different model than {type(unwrap(model)).__name__}; "
                              + "; ".join(problems))


def group_problem(saved: dict, mine: dict) -> str | None:
    """What keeps the saved settings of a group from being those of this run's group ``mine``, or None."""
    lacking = [key for key in mine if key not in saved]
    if lacking:
        return f"{shown(lacking)} not saved, which it has"
    extra = [key for key in saved if key not in mine and key not in ADDED_BY_TORCH]
    if extra:
        return f"{extra[0]!r} saved, which it does not have"
    problems = (setting_problem(key, saved[key], mine[key], moves=key in MOVED_BY_SCHEDULE) for key in mine
                if key != "params")
    if "initial_lr" in saved and "initial_lr" not in mine:  # saved with a scheduler, loaded without one
        problems = chain(problems, [setting_problem("initial_lr", saved["initial_lr"], 0.0, moves=True)])
    return next(filter(None, problems), None)


def check_optimizer(file: Path, saved: dict | None, model: nn.Module, optimizer) -> None:
    """Raise CheckpointError unless the saved optimizer settings (``saved``, from ``file``) are those of this run's
    ``optimizer`` over ``model``: the same parameters in the same groups, and every setting as ``group_problem``
    wants it."""
    if saved is None:
        raise CheckpointError(f"{file}: holds no optimizer state (it was saved without an optimizer)")
    try:
        groups = parameter_names(model, optimizer)
    except ValueError as error:
        raise CheckpointError(f"{file}: {error}") from error
    saved_groups = [group["params"] for group in saved["param_groups"]]
    if [len(group) for group in saved_groups] != [len(group) for group in groups]:
        raise CheckpointError(f"{file}: the optimizer's parameter groups differ: saved "
                              f"{[len(group) for group in saved_groups]} tensors per group, this optimizer has "
                              f"{[len(group) for group in groups]}")
    moved = [f"{name} (saved: {theirs})" for mine, saved_group in zip(groups, saved_groups)
             for name, theirs in zip(mine, saved_group) if name != theirs]
    if moved:
        raise CheckpointError(f"{file}: the optimizer's groups hold other parameters than saved: "
                              f"{abbreviate(moved, 3)}")
    for index, (group, theirs) in enumerate(zip(optimizer.param_groups, saved["param_groups"])):
        problem = group_problem(theirs, group)
        if problem:
            raise CheckpointError(f"{file}: the optimizer's settings differ in group {index}: {problem}")


def describe_stats(stats: dict) -> str:
    return ", ".join(f"{name} {entry[1]} {entry[2]}" if isinstance(entry, tuple) else f"{name} ({entry.__name__})"
                     for name, entry in sorted(stats.items())) or "nothing"


def check_entries(file: Path, entries: dict[str, dict], kept: dict[str, dict], model: nn.Module) -> None:
    """Raise CheckpointError unless each parameter's saved state ``entries`` (by name, each entry ``describe``d, from
    ``file``) is what this optimizer ``kept`` for it (``kept_state``, by name). A parameter may have no saved state
    at all (Adam makes none for one that never had a gradient, as Net's unused pooler)."""
    problems = []
    for parameter, stats in entries.items():
        if parameter not in kept:
            problems.append(f"{parameter} is not a parameter of {type(unwrap(model)).__name__}")
        elif stats != kept[parameter]:
            problems.append(f"{parameter}: saved {describe_stats(stats)}, this optimizer keeps "
                            f"{describe_stats(kept[parameter])}")
    if problems:
        raise CheckpointError(f"{file}: the optimizer state saved does not fit this optimizer: "
                              f"{abbreviate(problems, 3)}")


def check_entry_values(file: Path, state: dict[str, dict]) -> None:
    """Raise CheckpointError unless every number of the optimizer ``state`` (by parameter name) that is not a
    tensor's elements is finite, and each ``step`` a count of steps taken: Adam divides by 1 - beta ** step."""
    for parameter, stats in state.items():
        for name, value in stats.items():
            numbers = numbers_in(value) if not isinstance(value, torch.Tensor) or value.dim() == 0 else []
            wrong = not all(math.isfinite(number) for number in numbers)
            if name == "step":
                wrong = wrong or not all(number >= 1 and number == int(number) for number in numbers)
            if wrong:
                raise CheckpointError(f"{file}: the optimizer state saved does not fit this optimizer: {parameter}: "
                                      f"{name} is {shown(numbers[0] if len(numbers) == 1 else numbers)}, not "
                                      + ("a count of steps taken" if name == "step" else "a finite number"))


def check_scheduler(file: Path, saved: dict | None, scheduler) -> None:
    """Raise CheckpointError unless ``saved`` is what ``scheduler`` would save: its keys (``load_state_dict`` sets
    every saved key as an attribute), each of its type, the schedule itself equal, and where it stands in range."""
    if saved is None:
        raise CheckpointError(f"{file}: holds no scheduler state (it was saved without a scheduler)")
    mine = scheduler.state_dict()
    extra = [key for key in saved if key not in mine]
    lacking = [key for key in mine if key not in saved]
    problem = (f"{extra[0]!r} saved, which it does not have" if extra
               else f"{shown(lacking)} not saved, which it has" if lacking
               else next(filter(None, (setting_problem(key, saved[key], value, moves=key in schedule_position())
                                       for key, value in mine.items())), None))
    if problem:
        raise CheckpointError(f"{file}: the scheduler state differs from this {type(scheduler).__name__}'s: {problem}")


def check_scaler(file: Path, saved: dict | None, scaler: torch.amp.GradScaler | None) -> None:
    """Raise CheckpointError unless the run resumes with a gradient scaler exactly when it was saved with one
    (fp16 mixed precision), with the same settings. A disabled scaler counts as none."""
    scaler = scaler if scaler is not None and scaler.is_enabled() else None
    if saved is not None and scaler is None:
        raise CheckpointError(f"{file}: saved with a gradient scaler (fp16 mixed precision, --amp fp16), resumed "
                              f"without one; resume with one to continue exactly (its weights alone load without: "
                              f"leave out the optimizer)")
    if saved is None and scaler is not None:
        raise CheckpointError(f"{file}: saved without a gradient scaler (in fp32 or bf16), resumed with one (fp16 "
                              f"mixed precision, --amp fp16); resume with the precision it was saved with")
    if saved is None:
        return
    problem = next(filter(None, (setting_problem(key, saved[key], value, moves=key in GRAD_SCALER_POSITION)
                                 for key, value in scaler.state_dict().items())), None)
    if problem:
        raise CheckpointError(f"{file}: the gradient scaler's state differs from this GradScaler's: {problem}")
