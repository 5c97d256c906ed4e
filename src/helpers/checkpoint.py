"""Checkpoints that survive a kill, load safely into any wrapping, and let a run continue exactly.

One mechanism for every wrapping: torch.distributed.checkpoint's state-dict API (``get_state_dict``,
``set_state_dict``) gives the weights and the optimizer state of a plain, DDP-wrapped, compiled or FSDP2-sharded
model under the same plain names (``unwrap`` first removes DataParallel, which it does not know). Where the
tensors go depends on whether the model is sharded:

- not sharded (plain, DataParallel, DDP, torch.compile): rank 0 writes ``model.safetensors`` (the full weights)
  and ``state.pt`` (optimizer, scheduler, gradient scaler, where the run stands, every process's random state);
- sharded (FSDP2): every process writes its own shards of the weights and of the optimizer state into
  ``sharded/`` (torch.distributed.checkpoint's files), so no process ever holds the whole model; rank 0 writes
  the rest into ``state.pt``.

Reading never runs code (helpers.checkpoint_files). Weights load into any model of the same shape, across
wrappings, layouts and numbers of processes (a sharded checkpoint into a plain ``Net``); resuming, which loads
the optimizer too, needs the layout and the number of processes that saved it. A folder of checkpoints has a
text file ``latest`` naming the newest one and ``best`` naming the one with the lowest validation loss. A
classifier trained on your own files carries its label names in ``model.safetensors``'s metadata.

The contract (tests/test_checkpoint.py case by case, tests/test_checkpoint_fuzz.py on real folders of each layout):

- Loading reads and checks every file before it changes anything: any bad input (a damaged, truncated, crafted or
  mismatched folder, in any layout, DCP's own failures included) raises one CheckpointError that names the file
  and keeps the original exception as its cause; the model, the optimizer, the scheduler and every class of the
  process are then as they were.
- Saving writes a new folder and only then points ``latest`` at it, so after a kill at any moment ``latest``
  names a checkpoint that loads. If a process fails to write, every process raises CheckpointError at once.

``state.pt`` holds one entry per part of a run (``STATE_PARTS``); another optional part is one more entry, written in
``save_checkpoint``, checked in ``check_state`` (and against the live object in ``open_checkpoint``) and loaded in
``load_into``, as the gradient scaler of ``--amp fp16`` is.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import re
import reprlib
import warnings
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_model_state_dict, set_state_dict)

from helpers.atomic import (FAILURES, atomic_folder, fsync_file, remove_folder, remove_temporaries, same_outcome,
                            summary, write_text_atomic)
from helpers.checkpoint_files import (MODEL_FILE, SHARDED_DIR, STATE_FILE, CheckedShardReader, CheckpointError,
                                      read_shard_metadata, read_state, read_weights, reason, saved_tensors)
from helpers.distributed import agree_on_problem, barrier, gather, rank, world_size
from helpers.optim import abbreviate
from helpers.wrapping import is_sharded, unwrap

NAME = re.compile(r"step-(\d+)(?:-(\d+))?")
"""A checkpoint folder: ``step-000012``, or ``step-000012-2`` for the second save of that step."""


def state_dicts_equal(a: dict, b: dict) -> bool:
    """True if ``a`` and ``b`` have the same keys and every tensor is equal in dtype, shape and every value.

    Tensors on different devices are compared on the CPU, so a GPU checkpoint compares with a CPU model.
    """
    if a.keys() != b.keys():
        return False
    for key, x in a.items():
        y = b[key]
        if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x.cpu(), y.cpu()):
            return False
    return True


def full_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The weights of ``model`` in any wrapping, whole and under plain names, as ``Net().state_dict()`` has them.

    A sharded model's are gathered from every process, so call it on every process.
    """
    return get_model_state_dict(unwrap(model), options=StateDictOptions(full_state_dict=True))


def weights_digest(model: nn.Module) -> str:
    """SHA-256 of the full weights (``full_weights``), in key order: equal digests mean bitwise equal weights."""
    digest = hashlib.sha256()
    for key, tensor in full_weights(model).items():
        digest.update(key.encode())
        digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


# --- where a run stands ------------------------------------------------------------------------------------

@dataclass
class Progress:
    """Where a run stands; every checkpoint holds it, so training continues from exactly there."""

    step: int = 0  # optimizer steps taken in the whole run
    epoch: int = 0  # epochs finished
    batch: int = 0  # batches of the current epoch already trained
    skipped_steps: int = 0  # of those steps, the ones a gradient scaler skipped (inf or nan in the gradients)
    history: list[dict] = field(default_factory=list)  # fit()'s row for each finished epoch
    # The fields below differ between processes (each has its own batches), so each process's are saved.
    batch_losses: list[float] = field(default_factory=list)  # this process's losses of the current epoch so far
    epoch_start: dict | None = None  # the random state this epoch's data order was drawn from (epoch_start_state)

    def shared(self) -> dict:
        """The fields that are the same on every process, as plain data."""
        return {key: value for key, value in asdict(self).items() if key not in PER_PROCESS}


PER_PROCESS = ("batch_losses", "epoch_start")


def rng_state() -> dict:
    """The state of every random number generator a training step may draw from (dropout, shuffling)."""
    numpy = np.random.get_state(legacy=False)
    state = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": {"key": torch.from_numpy(numpy["state"]["key"].astype(np.int64)), "pos": numpy["state"]["pos"],
                  "has_gauss": numpy["has_gauss"], "gauss": numpy["gauss"]},
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    """Put every random number generator back where ``rng_state()`` found it."""
    torch.set_rng_state(state["torch"])
    random.setstate(python_state(state["python"]))
    np.random.set_state(numpy_state(state["numpy"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def python_state(saved) -> tuple:
    version, internal, gauss = saved
    return version, tuple(internal), gauss


def numpy_state(saved: dict) -> dict:
    return {"bit_generator": "MT19937", "has_gauss": saved["has_gauss"], "gauss": saved["gauss"],
            "state": {"key": saved["key"].numpy().astype(np.uint32), "pos": saved["pos"]}}


def check_rng_state(state: dict) -> None:
    """Raise unless ``set_rng_state`` takes ``state``: tried on new generators, so none of the process changes."""
    torch.Generator().set_state(state["torch"])
    random.Random().setstate(python_state(state["python"]))
    np.random.RandomState().set_state(numpy_state(state["numpy"]))
    cuda = state.get("cuda", [])
    if not isinstance(cuda, list) or not all(isinstance(t, torch.Tensor) and t.dtype == torch.uint8 for t in cuda):
        raise TypeError("its 'cuda' part is not a list of byte tensors")
    if cuda and torch.cuda.is_available() and len(cuda) > torch.cuda.device_count():
        raise ValueError(f"it holds the random states of {len(cuda)} GPUs, torch sees {torch.cuda.device_count()}")


# --- writing: atomic, so a kill at any moment leaves the previous checkpoint intact -------------------------

def write_weights(file: Path, weights: dict[str, torch.Tensor], labels: tuple[str, ...] | None) -> None:
    """Full weights into a safetensors file; ``labels``, the output names in index order, into its metadata."""
    metadata = {"labels": json.dumps(list(labels), ensure_ascii=False)} if labels else None
    save_file({key: value.detach().cpu().contiguous() for key, value in weights.items()}, file, metadata=metadata)
    fsync_file(file)


def state_dicts(model: nn.Module, optimizer) -> tuple[dict, dict | None]:
    """``get_state_dict`` of ``model`` in any wrapping and of ``optimizer`` (None: no optimizer), under plain
    names, leaving the optimizer as it was.

    For an optimizer that has not stepped, get_state_dict makes Adam's state with a step of learning rate 0
    (``_init_optim_state``), so that every entry exists. That state is returned, and taken off the optimizer again:
    its first real step would otherwise count as Adam's second. Gradients are put aside meanwhile, since with
    gradients present get_state_dict makes no state.
    """
    if optimizer is None:
        return get_model_state_dict(unwrap(model)), None
    untouched = not optimizer.state
    parameters = [p for group in optimizer.param_groups for p in group["params"]]
    gradients = [p.grad for p in parameters] if untouched else []
    try:
        if untouched:
            for parameter in parameters:
                parameter.grad = None
        return get_state_dict(unwrap(model), optimizer)
    finally:
        if untouched:
            optimizer.state.clear()
            for parameter, gradient in zip(parameters, gradients):
                parameter.grad = gradient


def every_entry(model: nn.Module, optimizer) -> tuple[dict, dict | None]:
    """``state_dicts`` as if the optimizer had not stepped: every parameter that takes gradients has state, of the
    shapes and dtypes this optimizer keeps. Its own state is put aside meanwhile and then back, unchanged."""
    if optimizer is None:
        return state_dicts(model, None)
    kept, optimizer.state = optimizer.state, defaultdict(dict)
    try:
        return state_dicts(model, optimizer)
    finally:
        optimizer.state = kept


def save_checkpoint(path: str | Path, model: nn.Module, optimizer=None, scheduler=None, *,
                    scaler: torch.amp.GradScaler | None = None, progress: Progress | None = None,
                    per_process: list | None = None, labels: tuple[str, ...] | None = None) -> Path:
    """Write the checkpoint folder ``path`` atomically (helpers.atomic): it appears complete or not at all.

    Call it on every process: a sharded model's processes each write their own shards; otherwise rank 0
    writes everything and the others return at once. ``scaler`` is fp16 training's gradient scaler (its scale
    and how many steps it has gone without inf or nan); ``per_process`` holds what differs between processes
    (their random states); ``labels``, the names of the model's outputs, go into ``model.safetensors``.
    A failed write raises CheckpointError; with a sharded model, on every process.
    """
    path, sharded = Path(path), is_sharded(model)
    if not sharded and rank() != 0:
        return path
    stepped = optimizer is not None and bool(optimizer.state)
    model_state, optimizer_state = state_dicts(model, optimizer)
    if optimizer is not None and not stepped:  # no step yet: Adam has no moments to save
        optimizer_state["state"] = {}
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


def read_labels(path: str | Path) -> tuple[str, ...] | None:
    """The label names saved with the model in checkpoint folder ``path``, or None if it was saved without
    them (as every checkpoint from before names were saved: those models use the bundled labels)."""
    file = Path(path) / MODEL_FILE
    read_weights(file)  # a missing or damaged file: its CheckpointError
    with safe_open(file, "pt") as weights:
        saved = (weights.metadata() or {}).get("labels")
    if saved is None:
        return None
    try:
        labels = json.loads(saved)
    except json.JSONDecodeError:
        labels = None
    if not isinstance(labels, list) or not all(isinstance(name, str) for name in labels):
        raise CheckpointError(f"{file}: its \"labels\" metadata is not a JSON list of names: {saved[:80]!r}")
    return tuple(labels)


# --- reading: check everything first, change nothing on failure ---------------------------------------------

STATE_PARTS = ("optimizer", "scheduler", "scaler", "progress", "per_process")
"""What ``state.pt`` holds (``save_checkpoint``); a new part joins here and in ``check_state``."""
ADDED_LATER = {"scaler": None}
"""Parts a ``state.pt`` saved before they existed lacks, read as what that run had: no gradient scaler."""
PROGRESS_ADDED_LATER = {"skipped_steps": 0}
"""The same for the fields of ``progress``: a run without a gradient scaler skips no step."""
SCALER_STATE = {"scale": float, "growth_factor": float, "backoff_factor": float, "growth_interval": int,
                "_growth_tracker": int}
"""``torch.amp.GradScaler.state_dict()``: its entries and the type of each."""


class BadState(Exception):
    """What ``check_state`` found wrong in ``state.pt``; it becomes a CheckpointError naming the file."""


def expect(condition: bool, problem: str, *values) -> None:
    """Raise BadState(``problem`` formatted with ``values``, each shortened) unless ``condition``."""
    if not condition:
        raise BadState(problem.format(*(reprlib.repr(value) for value in values)))


def within(where: str, check: Callable, value) -> None:
    """``check(value)``; whatever it raises becomes BadState naming ``where``, with the error as its cause."""
    try:
        check(value)
    except Exception as error:
        raise BadState(f"{where}: {reason(error)}") from error


def is_count(value) -> bool:
    return type(value) is int and value >= 0


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
    writes, its random states included (tried on new generators): a crafted or damaged file fails here, before
    anything is loaded, and not halfway through a resume."""
    try:
        expect(type(state) is dict and set(state) == set(STATE_PARTS), "holds {}, not the parts {}",
               list(state) if isinstance(state, dict) else type(state).__name__, STATE_PARTS)
        check_saved_optimizer(state["optimizer"])
        check_saved_scaler(state["scaler"])
        scheduler = state["scheduler"]
        expect(scheduler is None or type(scheduler) is dict and all(type(key) is str for key in scheduler),
               "scheduler: {} is not a scheduler's state_dict", type(scheduler).__name__)
        progress, shared = state["progress"], [name for name in Progress.__dataclass_fields__ if name not in PER_PROCESS]
        expect(type(progress) is dict and set(progress) == set(shared), "progress: holds {}, not {}",
               list(progress) if isinstance(progress, dict) else type(progress).__name__, shared)
        expect(all(is_count(progress[name]) for name in ("step", "epoch", "batch", "skipped_steps")),
               "progress: step, epoch, batch and skipped_steps are not counts: {}", progress)
        expect(type(progress["history"]) is list and all(type(row) is dict for row in progress["history"]),
               "progress: history is not a list of rows")
        expect(type(state["per_process"]) is list, "per_process is a {}", type(state["per_process"]).__name__)
        for index, mine in enumerate(state["per_process"]):
            check_per_process(f"per_process[{index}]", mine)
    except BadState as error:
        raise CheckpointError(f"{file}: not a checkpoint's state as save_checkpoint writes it: {error}") from error


def check_saved_optimizer(optimizer) -> None:
    """None, or a state dict by parameter name: settings in ``param_groups``, tensors in ``state`` (absent where
    they went into sharded/)."""
    if optimizer is None:
        return
    expect(type(optimizer) is dict and set(optimizer) in ({"param_groups"}, {"param_groups", "state"}),
           "optimizer: holds {}, not param_groups and state", list(optimizer) if isinstance(optimizer, dict) else
           type(optimizer).__name__)
    groups = optimizer["param_groups"]
    expect(type(groups) is list and all(type(group) is dict and type(group.get("params")) is list
                                        and all(type(name) is str for name in group["params"]) for group in groups),
           "optimizer: its param_groups are not lists of parameter names with their settings")
    entries = optimizer.get("state", {})
    expect(type(entries) is dict and all(type(name) is str and type(stats) is dict
                                         and all(type(stat) is str for stat in stats)
                                         for name, stats in entries.items()),
           "optimizer: its state is not a dict from parameter names to their state")


def check_saved_scaler(scaler) -> None:
    """None, or a GradScaler's state: its scale, factors and counts, each a finite number of its kind."""
    if scaler is None:
        return
    expect(type(scaler) is dict and set(scaler) == set(SCALER_STATE), "scaler: holds {}, not a GradScaler's {}",
           list(scaler) if isinstance(scaler, dict) else type(scaler).__name__, list(SCALER_STATE))
    numbers = all(type(scaler[key]) in ((int, float) if kind is float else (int,)) and math.isfinite(scaler[key])
                  for key, kind in SCALER_STATE.items())
    expect(numbers and min(scaler["scale"], scaler["growth_factor"], scaler["backoff_factor"]) > 0
           and scaler["growth_interval"] >= 1 and scaler["_growth_tracker"] >= 0,
           "scaler: not a GradScaler's scale, factors and counts: {}", scaler)


def check_per_process(where: str, mine) -> None:
    """One process's part: random states, its losses of the epoch so far, where the epoch started."""
    expect(type(mine) is dict and set(mine) == {"rng", *PER_PROCESS}, "{}: holds {}, not rng, {}", where,
           list(mine) if isinstance(mine, dict) else type(mine).__name__, PER_PROCESS)
    within(f"{where}: rng", check_rng_state, mine["rng"])
    losses = mine["batch_losses"]
    expect(type(losses) is list and all(type(loss) in (int, float) for loss in losses),
           "{}: batch_losses is not a list of numbers", where)
    start = mine["epoch_start"]
    if start is not None:
        expect(type(start) is dict and set(start) == {"rng", "loader"}, "{}: epoch_start holds {}", where,
               list(start) if isinstance(start, dict) else type(start).__name__)
        within(f"{where}: epoch_start: rng", check_rng_state, start["rng"])
        if start["loader"] is not None:
            within(f"{where}: epoch_start: loader", torch.Generator().set_state, start["loader"])


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


def kind(value, depth: int = 0):
    """What a setting is, to compare a saved one with the live one: None and booleans are flags, ints and floats
    numbers; sequences and dicts by their items; tensors by dtype and shape."""
    if depth > 8:
        return "nested too deeply"
    if value is None or isinstance(value, bool):
        return "flag"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, torch.Tensor):
        return "tensor", value.dtype, tuple(value.shape)
    if isinstance(value, (list, tuple)):
        return "sequence", tuple(kind(item, depth + 1) for item in value)
    if isinstance(value, dict):
        return "dict", tuple((str(key), kind(item, depth + 1)) for key, item in value.items())
    return type(value).__name__


def different_settings(saved: dict, mine: dict, extra_allowed: bool) -> str | None:
    """The first setting whose saved value is not of the kind of the live one (or, unless ``extra_allowed``, that
    the live one lacks); None if all fit."""
    for key, value in saved.items():
        if key == "params":
            continue
        if key not in mine:
            if not extra_allowed:
                return f"{key!r} saved, which it does not have"
        elif kind(value) != kind(mine[key]):
            return f"{key!r} saved as {reprlib.repr(value)}, it has {reprlib.repr(mine[key])}"
    return None


def entries_of(state: dict) -> dict[str, object]:
    """An optimizer state's entries by 'parameter.name': (shape, dtype) of a tensor, the type of anything else."""
    return {f"{parameter}.{name}": (tuple(value.shape), value.dtype) if isinstance(value, torch.Tensor)
            else type(value).__name__ for parameter, stats in state.items() for name, value in stats.items()}


def by_parameter(entries: dict[str, object]) -> dict[str, dict[str, object]]:
    grouped: dict[str, dict[str, object]] = {}
    for key, entry in entries.items():
        parameter, _, name = key.rpartition(".")
        grouped.setdefault(parameter, {})[name] = entry
    return grouped


def check_optimizer(file: Path, saved: dict | None, entries_file: Path, entries: dict[str, object],
                    model: nn.Module, optimizer, every: dict) -> None:
    """Raise CheckpointError if the optimizer state ``saved`` (settings) and ``entries`` (its tensors, read from
    ``entries_file``) do not fit ``optimizer``, whose state with every entry is ``every`` (``every_entry``), and
    the parameters of ``model``.

    A parameter may have no saved state at all (Adam makes none for one that never had a gradient, as Net's unused
    pooler); one that has must have exactly what this optimizer keeps for it, in shape and dtype.
    """
    if saved is None:
        raise CheckpointError(f"{file}: holds no optimizer state (it was saved without an optimizer)")
    saved_groups = [group["params"] for group in saved["param_groups"]]
    names = {id(p): name for name, p in unwrap(model).named_parameters()}
    stranger = f"a tensor that is not a parameter of {type(unwrap(model)).__name__}"
    groups = [[names.get(id(p), stranger) for p in group["params"]] for group in optimizer.param_groups]
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
        different = different_settings(theirs, group, extra_allowed=True)  # e.g. a scheduler's initial_lr
        if different:
            raise CheckpointError(f"{file}: the optimizer's settings differ in group {index}: {different}")
    expected = by_parameter(entries_of(every["state"]))
    shapes = {name: tuple(p.shape) for name, p in unwrap(model).named_parameters()}
    problems = []
    for parameter, stats in by_parameter(entries).items():
        if parameter not in shapes:
            problems.append(f"{parameter} is not a parameter of {type(unwrap(model)).__name__}")
        elif parameter in expected and stats != expected[parameter]:
            problems.append(f"{parameter}: saved {describe_stats(stats)}, this optimizer keeps "
                            f"{describe_stats(expected[parameter])}")
        elif parameter not in expected and any(entry[0] not in ((), shapes[parameter]) for entry in stats.values()
                                               if isinstance(entry, tuple)):
            problems.append(f"{parameter}: saved {describe_stats(stats)} for a parameter of shape {shapes[parameter]}")
    if problems:
        raise CheckpointError(f"{entries_file}: the optimizer state saved does not fit this optimizer: "
                              f"{abbreviate(problems, 3)}")


def describe_stats(stats: dict[str, object]) -> str:
    return ", ".join(f"{name} {entry[0]} {entry[1]}" if isinstance(entry, tuple) else f"{name} ({entry})"
                     for name, entry in sorted(stats.items())) or "nothing"


def check_scheduler(file: Path, saved: dict | None, scheduler) -> None:
    """Raise CheckpointError unless ``saved`` is a state of ``scheduler``'s kind: no setting it lacks, each of the
    kind of its own (``load_state_dict`` sets every saved key as an attribute)."""
    if saved is None:
        raise CheckpointError(f"{file}: holds no scheduler state (it was saved without a scheduler)")
    different = different_settings(saved, scheduler.state_dict(), extra_allowed=False)
    if different:
        raise CheckpointError(f"{file}: the scheduler state differs from this {type(scheduler).__name__}'s: "
                              f"{different}")


def check_scaler(file: Path, saved: dict | None, scaler: torch.amp.GradScaler | None) -> None:
    """Raise CheckpointError unless the run resumes with a gradient scaler exactly when it was saved with one
    (fp16 mixed precision), and the saved state is of ``scaler``'s kind. A disabled scaler counts as none."""
    scaler = scaler if scaler is not None and scaler.is_enabled() else None
    if saved is not None and scaler is None:
        raise CheckpointError(f"{file}: saved with a gradient scaler (fp16 mixed precision, --amp fp16), resumed "
                              f"without one; resume with one to continue exactly (its weights alone load without: "
                              f"leave out the optimizer)")
    if saved is None and scaler is not None:
        raise CheckpointError(f"{file}: saved without a gradient scaler (in fp32 or bf16), resumed with one (fp16 "
                              f"mixed precision, --amp fp16); resume with the precision it was saved with")
    different = different_settings(saved, scaler.state_dict(), extra_allowed=False) if saved is not None else None
    if different:
        raise CheckpointError(f"{file}: the gradient scaler's state differs from this GradScaler's: {different}")


# Names and shapes are checked before loading (check_weights, check_optimizer); strict=False then only lets
# parameters without optimizer state stay without it, as Adam leaves those that never got a gradient (an unused
# pooler), and as the saved optimizer had them.
CHECKED = StateDictOptions(strict=False)


@dataclass
class OpenCheckpoint:
    """A checkpoint folder whose files were all read and checked against a model; ``load_into`` changes it."""

    path: Path
    state: dict  # state.pt's contents ({} when neither optimizer nor scheduler needs it and it is absent)
    weights: dict[str, torch.Tensor] | None  # model.safetensors' tensors; None for a sharded checkpoint
    shards: Metadata | None  # sharded/'s metadata, read safely; None for full weights
    every: tuple[dict, dict | None] | None = None  # every_entry of the model and optimizer it was checked against

    def load_into(self, model: nn.Module, optimizer=None, scheduler=None,
                  scaler: torch.amp.GradScaler | None = None) -> dict:
        """Load weights (and optimizer, scheduler and scaler state, if given) into ``model`` in any wrapping: the ones
        ``open_checkpoint`` checked. Returns ``state.pt``'s contents. With a sharded checkpoint or model, call it on
        every process.

        DCP reads the shards into new tensors, which replace the model's and the optimizer's only once all are
        read: a shard DCP fails to read (CheckpointError) leaves both as they were. That costs one more copy of
        this process's part of the checkpoint while loading.
        """
        target = unwrap(model)
        if self.shards is None:
            if optimizer is None:  # a sharded model takes full weights too: each process keeps its shard
                options = StateDictOptions(full_state_dict=is_sharded(target))
                set_model_state_dict(target, self.weights, options=options)
            else:
                set_state_dict(target, optimizer, model_state_dict=self.weights,
                               optim_state_dict=self.state["optimizer"], options=CHECKED)
        else:  # read into copies of the model's own state dicts (they give each process's shards their places)
            model_state, optimizer_state = self.every if optimizer is not None else every_entry(target, None)
            saved = saved_tensors(self.shards, "optimizer.state.")
            tensors = {"model": {key: torch.empty_like(value) for key, value in model_state.items()}}
            if optimizer is not None:  # only what was saved: Adam saved nothing for a parameter without gradients
                moments = {parameter: {name: torch.empty_like(value) for name, value in stats.items()
                                       if f"{parameter}.{name}" in saved}
                           for parameter, stats in optimizer_state["state"].items()}
                tensors["optimizer"] = {"state": {parameter: stats for parameter, stats in moments.items() if stats}}
            try:
                with warnings.catch_warnings():  # without a process group: "assuming the intent is to load in a
                    warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)  # single process"
                    dcp.load(tensors, storage_reader=CheckedShardReader(self.path / SHARDED_DIR, self.shards))
            except FAILURES as error:  # DCP's CheckpointException is a BaseException, raised on every process alike
                raise CheckpointError(f"{self.path / SHARDED_DIR}: torch.distributed.checkpoint could not read it "
                                      f"({summary(error)})") from error
            if optimizer is not None:
                optimizer_state = {"state": tensors["optimizer"]["state"],
                                   "param_groups": self.state["optimizer"]["param_groups"]}
            set_state_dict(target, optimizer if optimizer is not None else [], model_state_dict=tensors["model"],
                           optim_state_dict=optimizer_state or {}, options=CHECKED)
        if scheduler is not None:
            scheduler.load_state_dict(self.state["scheduler"])
        if scaler is not None and self.state["scaler"] is not None:
            scaler.load_state_dict(self.state["scaler"])
        return self.state


def open_checkpoint(path: str | Path, model: nn.Module, optimizer=None, scheduler=None,
                    scaler: torch.amp.GradScaler | None = None) -> OpenCheckpoint:
    """Read every file of checkpoint folder ``path`` and check it against ``model`` (and ``optimizer``,
    ``scheduler``, ``scaler``); raises CheckpointError naming the file and the cause. Changes nothing.

    With an optimizer (resuming), a gradient scaler must be given exactly when the checkpoint holds one."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint folder")
    weights, shards, every = None, None, None
    if (path / SHARDED_DIR).is_dir():
        shards = read_shard_metadata(path / SHARDED_DIR)
        check_weights(path / SHARDED_DIR, saved_tensors(shards, "model."), model)
        others = [key for key in shards.state_dict_metadata if not key.startswith(("model.", "optimizer.state."))]
        if others:
            raise CheckpointError(f"{path / SHARDED_DIR / '.metadata'}: holds entries that are neither weights nor "
                                  f"optimizer state: {abbreviate(others, 3)}")
    else:
        weights = read_weights(path / MODEL_FILE)
        check_weights(path / MODEL_FILE, {key: (value.shape, value.dtype) for key, value in weights.items()}, model)
    needs_state = optimizer is not None or scheduler is not None or scaler is not None
    state = completed(read_state(path / STATE_FILE)) if needs_state or (path / STATE_FILE).exists() else {}
    if state:
        check_state(path / STATE_FILE, state)
    if optimizer is not None:
        if (shards is not None) != is_sharded(model):
            saved, given = ("a sharded", "an unsharded") if shards is not None else ("an unsharded", "a sharded")
            raise CheckpointError(f"{path}: saved from {saved} model, loaded with its optimizer into {given} one; "
                                  f"training continues exactly only as it was saved (sharded or not); its weights "
                                  f"alone load into either (leave the optimizer out)")
        if shards is not None:
            entries_file = path / SHARDED_DIR / ".metadata"
            entries = {key: (tuple(shape), dtype) for key, (shape, dtype)
                       in saved_tensors(shards, "optimizer.state.").items()}
        else:
            entries_file, entries = path / STATE_FILE, entries_of((state["optimizer"] or {}).get("state", {}))
        every = every_entry(model, optimizer)  # a step of learning rate 0: made once, for the check and the load
        check_optimizer(path / STATE_FILE, state["optimizer"], entries_file, entries, model, optimizer, every[1])
    if scheduler is not None:
        check_scheduler(path / STATE_FILE, state["scheduler"], scheduler)
    if optimizer is not None or scaler is not None:
        check_scaler(path / STATE_FILE, state["scaler"], scaler)
    return OpenCheckpoint(path, state, weights, shards, every if shards is not None else None)  # DCP's targets


def load_checkpoint(path: str | Path, model: nn.Module, optimizer=None, scheduler=None,
                    scaler: torch.amp.GradScaler | None = None) -> dict:
    """Load the checkpoint folder ``path`` into ``model`` (plain, wrapped or sharded) and, if given, the
    optimizer, scheduler and gradient scaler; returns the rest of the checkpoint (``progress``, ``per_process``).

    Every file is read and checked before anything is changed, so on a CheckpointError the model, the
    optimizer and the scheduler are exactly as they were. A sharded checkpoint loads into any number of
    processes (each reads the parts its own shards cover), or into a plain model without a process group.
    """
    return open_checkpoint(path, model, optimizer, scheduler, scaler).load_into(model, optimizer, scheduler, scaler)


def checkpoint_layout(path: Path) -> str:
    """"sharded" for a checkpoint folder a sharded model wrote (``sharded/``), else "full"."""
    return "sharded" if (Path(path) / SHARDED_DIR).is_dir() else "full"


# --- a folder of checkpoints for one run --------------------------------------------------------------------

class Checkpoints:
    """The checkpoints of one run in ``directory``: ``fit`` saves one every ``every`` optimizer steps (0: only
    at the end of each epoch), keeps the newest ``keep`` plus the best, and resumes from ``latest``.

    With a process group (DDP, FSDP2) call every method on every process: each saves and gets back its own
    random state; rank 0 writes the pointers.
    """

    def __init__(self, directory: str | Path, every: int = 0, keep: int = 3, labels: tuple[str, ...] | None = None):
        if every < 0 or keep < 1:
            raise ValueError(f"Checkpoints: every must be >= 0 and keep >= 1, got every={every}, keep={keep}")
        self.directory = Path(directory)
        self.every = every
        self.keep = keep
        self.labels = labels  # saved with every full checkpoint's weights (see read_labels)

    def latest(self) -> Path | None:
        """The newest complete checkpoint, or None when the run has saved none yet."""
        return self.pointer("latest")

    def best(self) -> Path | None:
        """The checkpoint saved at the end of the epoch with the lowest validation loss, or None."""
        return self.pointer("best")

    def pointer(self, name: str) -> Path | None:
        file = self.directory / name
        if not file.exists():
            return None
        try:
            target = file.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as error:
            raise CheckpointError(f"{file}: not readable as the name of a checkpoint folder ({error})") from error
        if not NAME.fullmatch(target):
            raise CheckpointError(
                f"{file}: expected the name of a checkpoint folder like 'step-000012', got {target!r}")
        if not (self.directory / target).is_dir():
            raise CheckpointError(f"{file}: names {target!r}, which is not in {self.directory}")
        return self.directory / target

    def save(self, model: nn.Module, optimizer, scheduler, progress: Progress, *, best: bool = False,
             scaler: torch.amp.GradScaler | None = None) -> None:
        """Save where the run stands into a new folder, then point ``latest`` (and, if ``best``, ``best``) at it.

        A folder is never replaced: a step saved again (a run started afresh in the same directory) goes into
        ``step-NNNNNN-2``, and the older folder of that step is removed once no pointer names it. So a kill at
        any moment leaves ``latest`` naming a checkpoint that loads. If writing fails on any process, every
        process raises CheckpointError at once, the failed one with its error as the cause.
        """
        per_process = gather({"rng": rng_state()} | {key: getattr(progress, key) for key in PER_PROCESS})
        path, error = self.directory / f"step-{progress.step:06d}", None
        try:
            path = self.directory / self.free_name(progress.step)
            save_checkpoint(path, model, optimizer, scheduler, scaler=scaler, progress=progress,
                            per_process=per_process, labels=self.labels)
            if rank() == 0:
                write_text_atomic(self.directory / "latest", path.name + "\n")
                if best:
                    write_text_atomic(self.directory / "best", path.name + "\n")
                self.remove_old()
        except FAILURES as caught:
            error = caught
        failed = f"{path}: not saved ({summary(error)})" if error is not None else None
        problem = agree_on_problem(str(error) if isinstance(error, CheckpointError) else failed)  # all learn of it
        if isinstance(error, CheckpointError):
            raise error
        if error is not None:
            raise CheckpointError(failed) from error
        if problem is not None:
            raise CheckpointError(problem)

    def free_name(self, step: int) -> str:
        """The name of the next checkpoint of ``step``: ``step-NNNNNN``, then ``-2``, ``-3`` ... for later saves.

        A collective: rank 0 clears what a killed save left (the other processes write into the directory only
        after that) and picks the name; every process gets it."""
        name, error = None, None
        if rank() == 0:
            try:
                self.directory.mkdir(parents=True, exist_ok=True)
                remove_temporaries(self.directory)
                again = 1 + max((order(path)[1] for path in self.directory.iterdir()
                                 if NAME.fullmatch(path.name) and order(path)[0] == step), default=0)
                name = f"step-{step:06d}" + (f"-{again}" if again > 1 else "")
            except OSError as caught:
                error = caught
        same_outcome(error)
        return gather(name)[0]

    def remove_old(self) -> None:
        """Remove all but the newest ``keep`` steps, and the older folders of a step saved again; never a folder
        a pointer names."""
        kept = {self.latest(), self.best()}
        saved = sorted((p for p in self.directory.iterdir() if NAME.fullmatch(p.name)), key=order)
        newest = {int(NAME.fullmatch(p.name).group(1)): p for p in saved}  # of each step, its last save
        old = [p for p in saved if p not in newest.values()] + sorted(newest.values(), key=order)[:-self.keep]
        for path in old:
            if path not in kept:
                remove_folder(path)

    def resume(self, model: nn.Module, optimizer, scheduler, loader, check: Callable[[Progress], None] | None = None,
               scaler: torch.amp.GradScaler | None = None) -> tuple[Progress, dict | None]:
        """Load the latest checkpoint, if any, and return where the run stands (a fresh Progress if there is
        none) and the random state to restore once the batches already trained have been skipped.

        The random state is put back to the start of the interrupted epoch, so the loader draws the same
        order again; ``train_epoch`` skips the first ``progress.batch`` batches and then restores the state
        of the moment of saving, so that dropout draws the same masks as the uninterrupted run. ``check`` may
        refuse where the checkpoint stands (CheckpointError). A checkpoint that one process cannot load raises
        the same CheckpointError on every process, before any loads.
        """
        barrier()  # every process reads only once rank 0 has finished writing
        error, path, checked, progress = None, None, None, None
        try:
            path = self.latest()
            if path is not None:
                checked, progress = self.open_to_resume(path, model, optimizer, scheduler, loader, check, scaler)
        except CheckpointError as caught:
            error = caught
        seen = gather(None if path is None else path.name)
        if error is None and len(set(seen)) > 1:
            error = CheckpointError(f"{self.directory}: the processes see different latest checkpoints ({seen}, in "
                                    f"rank order); every process must read the same folder (a shared file system)")
        problem = agree_on_problem(None if error is None else str(error))
        if error is not None:
            raise error
        if problem is not None:
            raise CheckpointError(problem)
        if checked is None:
            return Progress(), None
        state = checked.load_into(model, optimizer, scheduler, scaler)
        mine = state["per_process"][rank()]
        set_epoch_start_state(loader, mine["epoch_start"])
        return progress, mine["rng"] if progress.batch else None

    def open_to_resume(self, path: Path, model: nn.Module, optimizer, scheduler, loader,
                       check: Callable[[Progress], None] | None = None,
                       scaler: torch.amp.GradScaler | None = None) -> tuple[OpenCheckpoint, Progress]:
        """Checkpoint ``path``, read and checked for resuming (as many processes as saved it, a loader like the
        one that drew its data order, ``check``), and where this process stands in it."""
        checked = open_checkpoint(path, model, optimizer, scheduler, scaler)
        state = checked.state or {"per_process": read_state(path / STATE_FILE)}  # a missing state.pt: its error
        saved_by = len(state["per_process"])
        if saved_by != world_size():
            raise CheckpointError(f"{path / STATE_FILE}: saved by {saved_by} process(es), resumed with {world_size()}; "
                                  f"resume with the same number to continue exactly (its weights alone load into "
                                  f"any number: load_checkpoint without an optimizer)")
        mine = state["per_process"][rank()]
        if mine["epoch_start"] is None:
            raise CheckpointError(f"{path / STATE_FILE}: saved without the random state its epoch started from, so "
                                  f"the data order cannot be drawn again (save with Checkpoints inside fit)")
        if mine["epoch_start"]["loader"] is not None and getattr(loader, "generator", None) is None:
            raise CheckpointError(f"{path / STATE_FILE}: saved with a data loader that has its own random generator; "
                                  f"this loader has none")
        progress = Progress(**state["progress"], **{key: mine[key] for key in PER_PROCESS})
        if check is not None:
            try:
                check(progress)
            except CheckpointError as error:
                raise CheckpointError(f"{path / STATE_FILE}: {error}") from error
        return checked, progress


def order(path: Path) -> tuple[int, int]:
    """Where the checkpoint folder ``path`` comes in a run: its step, then which save of that step."""
    step, again = NAME.fullmatch(path.name).groups()
    return int(step), int(again or 1)


def epoch_start_state(loader) -> dict:
    """The random state an epoch's data order is drawn from: the generators, and ``loader``'s own, if any."""
    generator = getattr(loader, "generator", None)
    return {"rng": rng_state(), "loader": generator.get_state() if generator is not None else None}


def set_epoch_start_state(loader, state: dict) -> None:
    set_rng_state(state["rng"])
    if state["loader"] is not None:
        loader.generator.set_state(state["loader"])


def set_sampler_epoch(loader, epoch: int) -> None:
    """Tell a DistributedSampler which epoch starts: its shuffled order depends on it."""
    if hasattr(getattr(loader, "sampler", None), "set_epoch"):
        loader.sampler.set_epoch(epoch)
