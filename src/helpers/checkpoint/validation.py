"""The one way a check says what is wrong: ``require(condition, problem)`` raises ``Invalid``, and ``problems_in``
turns it into a CheckpointError naming the file, with the ``Invalid`` as its cause. The shard metadata
(``shard_metadata``) and the saved state (``state_format``) are checked through it; the words for values and
tensors (``shown``, ``is_number``, ``plain_tensor_problem``) serve ``shard_reader`` and ``against_run`` too."""

from __future__ import annotations

import math
import reprlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from helpers.checkpoint.files import CheckpointError, reason


class Invalid(Exception):
    """What a check found wrong, in words; ``problems_in`` names the file."""


def require(condition: bool, problem: str | Callable[[], str]) -> None:
    """Raise Invalid(``problem``) unless ``condition``; a callable ``problem`` is only called to say it."""
    if not condition:
        raise Invalid(problem() if callable(problem) else problem)


def require_accepted(where: str, function: Callable, *arguments) -> None:
    """``function(*arguments)``; whatever it raises becomes Invalid naming ``where``, with that error as its cause."""
    try:
        function(*arguments)
    except Exception as error:
        raise Invalid(f"{where}: {reason(error)}") from error


@contextmanager
def problems_in(file: Path, what: str) -> Iterator[None]:
    """Inside the block, Invalid("x") becomes CheckpointError("{file}: {what}: x") caused by it."""
    try:
        yield
    except Invalid as error:
        raise CheckpointError(f"{file}: {what}: {error}") from error


def shown(value) -> str:
    """``value``'s repr, shortened; its type where the repr fails (a crafted instance may lack its fields)."""
    try:
        return reprlib.repr(value)
    except Exception:
        return f"a {type(value).__name__}"


def is_count(value) -> bool:
    """A whole number >= 0 (``True`` is not one)."""
    return type(value) is int and value >= 0


def is_number(value) -> bool:
    """An int or a float (not a bool)."""
    return type(value) in (int, float)


def is_finite(value, minimum: float = 0.0) -> bool:
    """A finite int or float >= ``minimum``."""
    return is_number(value) and math.isfinite(value) and value >= minimum


def plain_tensor_problem(value) -> str | None:
    """What keeps ``value`` from being a tensor as a run saves one (a plain, dense, contiguous CPU tensor that needs
    no gradient), or None."""
    if type(value) is not torch.Tensor:
        return f"a {type(value).__name__}, not a plain tensor"
    if value.layout != torch.strided:
        return f"a tensor of layout {value.layout}, not a dense one"
    if value.device.type != "cpu":
        return f"a tensor on the {value.device.type} device, where a checkpoint's tensors load onto the CPU"
    if value.is_quantized or value.requires_grad or not value.is_contiguous():
        return "a quantized, gradient-tracking or non-contiguous tensor"
    return None
