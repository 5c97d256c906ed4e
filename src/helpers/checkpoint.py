"""Checkpoints that survive a kill, load safely into any wrapping, and let a run continue exactly.

One mechanism for every wrapping: torch.distributed.checkpoint's state-dict API (``get_state_dict``,
``set_state_dict``) gives the weights and the optimizer state of a plain, DDP-wrapped, compiled or FSDP2-sharded
model under the same plain names (``unwrap`` first removes DataParallel, which it does not know). Where the
tensors go depends on whether the model is sharded:

- not sharded (plain, DataParallel, DDP, torch.compile): rank 0 writes ``model.safetensors`` (the full weights)
  and ``state.pt`` (optimizer, scheduler, where the run stands, every process's random state);
- sharded (FSDP2): every process writes its own shards of the weights and of the optimizer state into
  ``sharded/`` (torch.distributed.checkpoint's files), so no process ever holds the whole model; rank 0 writes
  the rest into ``state.pt``.

Reading never runs code (helpers.checkpoint_files). Weights load into any model of the same shape, across
wrappings, layouts and numbers of processes (a sharded checkpoint into a plain ``Net``); resuming, which loads
the optimizer too, needs the layout and the number of processes that saved it. A folder of checkpoints has a
text file ``latest`` naming the newest one and ``best`` naming the one with the lowest validation loss. A
classifier trained on your own files carries its label names in ``model.safetensors``'s metadata.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import shutil
import warnings
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

from helpers.atomic import atomic_folder, fsync_file, remove_temporaries, write_text_atomic
from helpers.checkpoint_files import (MODEL_FILE, SHARDED_DIR, STATE_FILE, CheckedShardReader, CheckpointError,
                                      read_shard_metadata, read_state, read_weights, saved_tensors)
from helpers.distributed import agree_on_problem, barrier, gather, rank, world_size
from helpers.optim import abbreviate
from helpers.wrapping import is_sharded, unwrap

NAME = re.compile(r"step-(\d+)")


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
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    numpy = state["numpy"]
    np.random.set_state({"bit_generator": "MT19937", "has_gauss": numpy["has_gauss"], "gauss": numpy["gauss"],
                         "state": {"key": numpy["key"].numpy().astype(np.uint32), "pos": numpy["pos"]}})
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# --- writing: atomic, so a kill at any moment leaves the previous checkpoint intact -------------------------

def write_weights(file: Path, weights: dict[str, torch.Tensor], labels: tuple[str, ...] | None) -> None:
    """Full weights into a safetensors file; ``labels``, the output names in index order, into its metadata."""
    metadata = {"labels": json.dumps(list(labels), ensure_ascii=False)} if labels else None
    save_file({key: value.detach().cpu().contiguous() for key, value in weights.items()}, file, metadata=metadata)
    fsync_file(file)


def save_checkpoint(path: str | Path, model: nn.Module, optimizer=None, scheduler=None, *,
                    progress: Progress | None = None, per_process: list | None = None,
                    labels: tuple[str, ...] | None = None) -> Path:
    """Write the checkpoint folder ``path`` atomically (helpers.atomic): it appears complete or not at all.

    Call it on every process: a sharded model's processes each write their own shards; otherwise rank 0
    writes everything and the others return at once. ``per_process`` holds what differs between processes
    (their random states); ``labels``, the names of the model's outputs, go into ``model.safetensors``.
    """
    path, sharded = Path(path), is_sharded(model)
    if not sharded and rank() != 0:
        return path
    untouched = optimizer is not None and not optimizer.state  # no step yet: Adam has no moments to save
    model_state, optimizer_state = get_state_dict(unwrap(model), optimizer if optimizer is not None else [])
    if untouched:  # get_state_dict made them with a step of learning rate 0 (_init_optim_state): remove them, or
        optimizer.state.clear()  # the next real step would count as Adam's second
        optimizer_state["state"] = {}
    state = {"optimizer": optimizer_state if optimizer is not None else None,
             "scheduler": scheduler.state_dict() if scheduler is not None else None,
             "progress": (progress or Progress()).shared(), "per_process": per_process or []}
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


def check_optimizer(file: Path, saved: dict | None, model: nn.Module, optimizer) -> None:
    """Raise CheckpointError if the optimizer state ``saved`` is not for ``optimizer``'s groups of parameters."""
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

    def load_into(self, model: nn.Module, optimizer=None, scheduler=None) -> dict:
        """Load weights (and optimizer and scheduler state, if given) into ``model`` in any wrapping; returns
        ``state.pt``'s contents. With a sharded checkpoint or model, call it on every process."""
        target = unwrap(model)
        if self.shards is None:
            if optimizer is None:  # a sharded model takes full weights too: each process keeps its shard
                options = StateDictOptions(full_state_dict=is_sharded(target))
                set_model_state_dict(target, self.weights, options=options)
            else:
                set_state_dict(target, optimizer, model_state_dict=self.weights,
                               optim_state_dict=self.state["optimizer"], options=CHECKED)
        else:  # read into the model's own state dicts (they give each process's shards their places)
            moments = optimizer is not None and any(key.startswith("optimizer.")
                                                    for key in self.shards.state_dict_metadata)
            model_state, optimizer_state = get_state_dict(target, optimizer if optimizer is not None else [])
            tensors = {"model": model_state} | ({"optimizer": {"state": optimizer_state["state"]}} if moments else {})
            with warnings.catch_warnings():  # without a process group: "assuming the intent is to load in a
                warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)  # single process"
                dcp.load(tensors, storage_reader=CheckedShardReader(self.path / SHARDED_DIR, self.shards))
            if optimizer is not None:  # saved before its first step, it has no moments: none come back
                optimizer_state = {"state": tensors["optimizer"]["state"] if moments else {},
                                   "param_groups": self.state["optimizer"]["param_groups"]}
            set_state_dict(target, optimizer if optimizer is not None else [], model_state_dict=tensors["model"],
                           optim_state_dict=optimizer_state, options=CHECKED)
        if scheduler is not None:
            scheduler.load_state_dict(self.state["scheduler"])
        return self.state


def open_checkpoint(path: str | Path, model: nn.Module, optimizer=None, scheduler=None) -> OpenCheckpoint:
    """Read every file of checkpoint folder ``path`` and check it against ``model`` (and ``optimizer``,
    ``scheduler``); raises CheckpointError naming the file and the cause. Changes nothing."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint folder")
    weights, shards = None, None
    if (path / SHARDED_DIR).is_dir():
        shards = read_shard_metadata(path / SHARDED_DIR)
        check_weights(path / SHARDED_DIR, saved_tensors(shards, "model."), model)
    else:
        weights = read_weights(path / MODEL_FILE)
        check_weights(path / MODEL_FILE, {key: (value.shape, value.dtype) for key, value in weights.items()}, model)
    needs_state = optimizer is not None or scheduler is not None
    state = read_state(path / STATE_FILE) if needs_state or (path / STATE_FILE).exists() else {}
    if optimizer is not None:
        if (shards is not None) != is_sharded(model):
            saved, given = ("a sharded", "an unsharded") if shards is not None else ("an unsharded", "a sharded")
            raise CheckpointError(f"{path}: saved from {saved} model, loaded with its optimizer into {given} one; "
                                  f"training continues exactly only as it was saved (sharded or not); its weights "
                                  f"alone load into either (leave the optimizer out)")
        check_optimizer(path / STATE_FILE, state.get("optimizer"), model, optimizer)
    if scheduler is not None and state.get("scheduler") is None:
        raise CheckpointError(f"{path / STATE_FILE}: holds no scheduler state (it was saved without a scheduler)")
    return OpenCheckpoint(path, state, weights, shards)


def load_checkpoint(path: str | Path, model: nn.Module, optimizer=None, scheduler=None) -> dict:
    """Load the checkpoint folder ``path`` into ``model`` (plain, wrapped or sharded) and, if given, the
    optimizer and scheduler; returns the rest of the checkpoint (``progress``, ``per_process``).

    Every file is read and checked before anything is changed, so on a CheckpointError the model, the
    optimizer and the scheduler are exactly as they were. A sharded checkpoint loads into any number of
    processes (each reads the parts its own shards cover), or into a plain model without a process group.
    """
    return open_checkpoint(path, model, optimizer, scheduler).load_into(model, optimizer, scheduler)


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
        target = file.read_text(encoding="utf-8").strip()
        if not NAME.fullmatch(target):
            raise CheckpointError(
                f"{file}: expected the name of a checkpoint folder like 'step-000012', got {target!r}")
        if not (self.directory / target).is_dir():
            raise CheckpointError(f"{file}: names {target!r}, which is not in {self.directory}")
        return self.directory / target

    def save(self, model: nn.Module, optimizer, scheduler, progress: Progress, *, best: bool = False) -> None:
        """Save where the run stands. ``best`` points ``best`` at it too."""
        per_process = gather({"rng": rng_state()} | {key: getattr(progress, key) for key in PER_PROCESS})
        if rank() == 0:
            self.directory.mkdir(parents=True, exist_ok=True)
            remove_temporaries(self.directory)  # left by a save that was killed
        barrier()  # a sharded model's processes write into the directory only once it is clean
        path = save_checkpoint(self.directory / f"step-{progress.step:06d}", model, optimizer, scheduler,
                               progress=progress, per_process=per_process, labels=self.labels)
        if rank() == 0:
            write_text_atomic(self.directory / "latest", path.name + "\n")
            if best:
                write_text_atomic(self.directory / "best", path.name + "\n")
            self.remove_old()
        barrier()

    def remove_old(self) -> None:
        kept = {self.latest(), self.best()}
        saved = sorted((p for p in self.directory.iterdir() if NAME.fullmatch(p.name)),
                       key=lambda p: int(NAME.fullmatch(p.name).group(1)))
        for path in saved[:-self.keep]:
            if path not in kept:
                shutil.rmtree(path)

    def resume(self, model: nn.Module, optimizer, scheduler, loader) -> tuple[Progress, dict | None]:
        """Load the latest checkpoint, if any, and return where the run stands (a fresh Progress if there is
        none) and the random state to restore once the batches already trained have been skipped.

        The random state is put back to the start of the interrupted epoch, so the loader draws the same
        order again; ``train_epoch`` skips the first ``progress.batch`` batches and then restores the state
        of the moment of saving, so that dropout draws the same masks as the uninterrupted run. A checkpoint
        that one process cannot load raises the same CheckpointError on every process, before any loads.
        """
        barrier()  # every process reads only once rank 0 has finished writing
        problem, path, checked = None, None, None
        try:
            path = self.latest()
            checked = None if path is None else self.open_to_resume(path, model, optimizer, scheduler)
        except CheckpointError as error:
            problem = str(error)
        seen = gather(None if path is None else path.name)
        if problem is None and len(set(seen)) > 1:
            problem = (f"{self.directory}: the processes see different latest checkpoints ({seen}, in rank order); "
                       f"every process must read the same folder (a shared file system)")
        problem = agree_on_problem(problem)
        if problem:
            raise CheckpointError(problem)
        if checked is None:
            return Progress(), None
        state = checked.load_into(model, optimizer, scheduler)
        mine = state["per_process"][rank()]
        progress = Progress(**state["progress"], **{key: mine[key] for key in PER_PROCESS})
        set_epoch_start_state(loader, mine["epoch_start"])
        return progress, mine["rng"] if progress.batch else None

    def open_to_resume(self, path: Path, model: nn.Module, optimizer, scheduler) -> OpenCheckpoint:
        """Checkpoint ``path``, read and checked for resuming: as many processes as saved it."""
        checked = open_checkpoint(path, model, optimizer, scheduler)
        saved_by = len(checked.state["per_process"])
        if saved_by != world_size():
            raise CheckpointError(f"{path / STATE_FILE}: saved by {saved_by} process(es), resumed with {world_size()}; "
                                  f"resume with the same number to continue exactly (its weights alone load into "
                                  f"any number: load_checkpoint without an optimizer)")
        return checked


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
