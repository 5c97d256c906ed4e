"""Checkpoints that survive a kill, load safely into any wrapping, and let a run continue exactly.

A checkpoint is a folder holding two files: ``model.safetensors`` (the unwrapped model's weights, plain
tensors) and ``state.pt`` (optimizer and scheduler state, where the run stands, the random number
generators), which is only ever read with ``torch.load(..., weights_only=True)``: it can hold tensors,
numbers, strings, lists and dicts, never code. A folder of checkpoints has a text file ``latest`` naming the
newest one and ``best`` naming the one with the lowest validation loss. A classifier trained on your own
files also carries its label names, in index order, in ``model.safetensors``'s metadata (``read_labels``).
"""

from __future__ import annotations

import json
import os
import pickle
import random
import re
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from helpers.distributed import rank, world_size
from helpers.wrapping import unwrap

MODEL_FILE = "model.safetensors"
STATE_FILE = "state.pt"
NAME = re.compile(r"step-(\d+)")
TEMPORARY_PREFIX = ".tmp-"


class CheckpointError(Exception):
    """A checkpoint that cannot be loaded; the message names the file and the cause."""


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


# --- one process or many: rank 0 writes, every rank reads ----------------------------------------------------

def barrier() -> None:
    """Wait until every process gets here; nothing to wait for without a process group."""
    if world_size() > 1:
        dist.barrier()


def gather(value) -> list:
    """``value`` of every process, in rank order (``[value]`` without a process group)."""
    if world_size() == 1:
        return [value]
    values = [None] * world_size()
    dist.all_gather_object(values, value)
    return values


# --- writing: atomic, so a kill at any moment leaves the previous checkpoint intact -------------------------

def fsync_dir(path: Path) -> None:
    """Make a rename or a new file in ``path`` survive a power cut (the folder's entry is data too)."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def fsync_file(path: Path) -> None:
    with open(path, "rb") as file:
        os.fsync(file.fileno())


def write_text_atomic(path: Path, text: str) -> None:
    """Replace ``path`` by a file holding ``text``: readers see the old file or the new one, never half of it."""
    with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=TEMPORARY_PREFIX, delete=False) as file:
        file.write(text)
        file.flush()
        os.fsync(file.fileno())
    os.replace(file.name, path)
    fsync_dir(path.parent)


def save_checkpoint(path: str | Path, model: nn.Module, optimizer=None, scheduler=None, *,
                    progress: Progress | None = None, per_process: list | None = None,
                    labels: tuple[str, ...] | None = None) -> Path:
    """Write the checkpoint folder ``path`` atomically: it appears complete or not at all.

    The files are written into a temporary folder next to it, flushed to disk, and renamed into place.
    ``per_process`` holds what differs between processes (their random number generators); ``labels``, the
    names of the model's outputs in index order, go into the weights file's metadata.
    """
    path = Path(path)
    weights = {key: value.detach().cpu().contiguous() for key, value in unwrap(model).state_dict().items()}
    state = {
        "optimizer": optimizer.state_dict() if optimizer is not None else None,
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "progress": (progress or Progress()).shared(),
        "per_process": per_process or [],
    }
    temporary = Path(tempfile.mkdtemp(prefix=TEMPORARY_PREFIX, dir=path.parent))
    metadata = {"labels": json.dumps(list(labels), ensure_ascii=False)} if labels else None
    save_file(weights, temporary / MODEL_FILE, metadata=metadata)
    torch.save(state, temporary / STATE_FILE)
    for name in (MODEL_FILE, STATE_FILE):
        fsync_file(temporary / name)
    fsync_dir(temporary)
    old = None
    if path.exists():  # the same name again (a run restarted from scratch): move the old one out of the way
        old = Path(tempfile.mkdtemp(prefix=TEMPORARY_PREFIX, dir=path.parent))
        path.rename(old / path.name)
    temporary.rename(path)
    fsync_dir(path.parent)
    if old is not None:
        shutil.rmtree(old)
    return path


# --- reading: check everything first, change nothing on failure ---------------------------------------------

def read_weights(file: Path) -> dict[str, torch.Tensor]:
    if not file.is_file():
        raise CheckpointError(f"{file}: missing; a checkpoint folder holds {MODEL_FILE} and {STATE_FILE}")
    try:
        return load_file(file)
    except (SafetensorError, OSError) as error:
        raise CheckpointError(
            f"{file}: not a readable safetensors file, it may be truncated or damaged ({error})") from None


def read_state(file: Path) -> dict:
    if not file.is_file():
        raise CheckpointError(f"{file}: missing; a checkpoint folder holds {MODEL_FILE} and {STATE_FILE}")
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        found = re.search(r"WeightsUnpickler error: (.*?)(?: Please|\n|$)", str(error))  # names what was refused
        cause = found.group(1) if found else str(error)
        raise CheckpointError(f"{file}: refused to load: it holds more than tensors and plain data, which could run "
                              f"code when unpickled ({cause})") from None
    except (EOFError, RuntimeError, OSError) as error:
        raise CheckpointError(
            f"{file}: not a readable torch.save file, it may be truncated or damaged ({error})") from None


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


def check_weights(file: Path, weights: dict, model: nn.Module) -> None:
    """Raise CheckpointError if ``weights`` do not fit ``model`` exactly (names, shapes and dtypes)."""
    expected = unwrap(model).state_dict()
    missing = [key for key in expected if key not in weights]
    unexpected = [key for key in weights if key not in expected]
    different = [f"{key} {tuple(weights[key].shape)} {weights[key].dtype} (the model has "
                 f"{tuple(value.shape)} {value.dtype})"
                 for key, value in expected.items() if key in weights
                 and (weights[key].shape != value.shape or weights[key].dtype != value.dtype)]
    problems = [f"{label}: {abbreviate(names)}" for label, names in
                (("missing", missing), ("unexpected", unexpected), ("different shape or dtype", different)) if names]
    if problems:
        raise CheckpointError(f"{file}: saved from a different model than {type(unwrap(model)).__name__}; "
                              + "; ".join(problems))


def check_optimizer(file: Path, saved: dict | None, optimizer) -> None:
    if saved is None:
        raise CheckpointError(f"{file}: holds no optimizer state (it was saved without an optimizer)")
    saved_sizes = [len(group["params"]) for group in saved["param_groups"]]
    sizes = [len(group["params"]) for group in optimizer.param_groups]
    if saved_sizes != sizes:
        raise CheckpointError(f"{file}: the optimizer's parameter groups differ: saved {saved_sizes} tensors per "
                              f"group, this optimizer has {sizes}")


def load_checkpoint(path: str | Path, model: nn.Module, optimizer=None, scheduler=None) -> dict:
    """Load the checkpoint folder ``path`` into ``model`` (plain or wrapped) and, if given, the optimizer and
    scheduler; returns the rest of the checkpoint (``progress``, ``per_process``).

    Every file is read and checked before anything is changed, so on a CheckpointError the model, the
    optimizer and the scheduler are exactly as they were.
    """
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint folder")
    weights = read_weights(path / MODEL_FILE)
    check_weights(path / MODEL_FILE, weights, model)
    needs_state = optimizer is not None or scheduler is not None
    state = read_state(path / STATE_FILE) if needs_state or (path / STATE_FILE).exists() else {}
    if optimizer is not None:
        check_optimizer(path / STATE_FILE, state.get("optimizer"), optimizer)
    if scheduler is not None and state.get("scheduler") is None:
        raise CheckpointError(f"{path / STATE_FILE}: holds no scheduler state (it was saved without a scheduler)")

    unwrap(model).load_state_dict(weights)
    if optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])
    if scheduler is not None:
        scheduler.load_state_dict(state["scheduler"])
    return state


def abbreviate(names: list[str], limit: int = 3) -> str:
    """The first ``limit`` names, and how many more there are."""
    more = f" ... and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


# --- a folder of checkpoints for one run --------------------------------------------------------------------

class Checkpoints:
    """The checkpoints of one run in ``directory``: ``fit`` saves one every ``every`` optimizer steps (0: only
    at the end of each epoch), keeps the newest ``keep`` plus the best, and resumes from ``latest``.

    With a process group (DDP), rank 0 writes, every process reads, and each gets its own random state back.
    """

    def __init__(self, directory: str | Path, every: int = 0, keep: int = 3, labels: tuple[str, ...] | None = None):
        if every < 0 or keep < 1:
            raise ValueError(f"Checkpoints: every must be >= 0 and keep >= 1, got every={every}, keep={keep}")
        self.directory = Path(directory)
        self.every = every
        self.keep = keep
        self.labels = labels  # saved with every checkpoint's weights (see read_labels)

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
        """Save where the run stands; call it on every process. ``best`` points ``best`` at it too."""
        per_process = gather({"rng": rng_state()} | {key: getattr(progress, key) for key in PER_PROCESS})
        if rank() == 0:
            self.directory.mkdir(parents=True, exist_ok=True)
            for stale in self.directory.glob(TEMPORARY_PREFIX + "*"):  # left by a save that was killed
                shutil.rmtree(stale) if stale.is_dir() else stale.unlink()
        path = self.write(self.directory / f"step-{progress.step:06d}", model, optimizer, scheduler, progress,
                          per_process)
        if rank() == 0:
            write_text_atomic(self.directory / "latest", path.name + "\n")
            if best:
                write_text_atomic(self.directory / "best", path.name + "\n")
            self.remove_old()
        barrier()

    def write(self, path: Path, model: nn.Module, optimizer, scheduler, progress: Progress,
              per_process: list) -> Path:
        """Rank 0 writes the whole checkpoint: under DDP every process holds the same weights."""
        if rank() == 0:
            save_checkpoint(path, model, optimizer, scheduler, progress=progress, per_process=per_process,
                            labels=self.labels)
        return path

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
        of the moment of saving, so that dropout draws the same masks as the uninterrupted run.
        """
        barrier()  # every process reads only once rank 0 has finished writing
        path = self.latest()
        if path is None:
            return Progress(), None
        state = self.load(path, model, optimizer, scheduler)
        mine = state["per_process"][rank()]
        progress = Progress(**state["progress"], **{key: mine[key] for key in PER_PROCESS})
        set_epoch_start_state(loader, mine["epoch_start"])
        return progress, mine["rng"] if progress.batch else None

    def load(self, path: Path, model: nn.Module, optimizer, scheduler) -> dict:
        """Load checkpoint ``path`` into a run with as many processes as saved it; returns its state."""
        state = load_checkpoint(path, model, optimizer, scheduler)
        check_process_count(path, state)
        return state


def check_process_count(path: Path, state: dict, hint: str = "") -> None:
    """Resuming exactly needs every process's own random state back, so as many processes as saved it."""
    if len(state["per_process"]) != world_size():
        raise CheckpointError(f"{path / STATE_FILE}: saved by {len(state['per_process'])} process(es), resumed "
                              f"with {world_size()}; resume with the same number to continue exactly{hint}")


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
