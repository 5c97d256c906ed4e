"""Where a run stands (``Progress``) and the random state it goes on from, so that a resumed run draws exactly the
data order and dropout masks the uninterrupted one would have drawn."""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field

import numpy as np
import torch


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
SHARED = tuple(name for name in Progress.__dataclass_fields__ if name not in PER_PROCESS)


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
