"""The fine-tuning loop of the series, for one process or many: ``fit`` trains epochs and evaluates after each (with
checkpoints), ``train_epoch`` takes one pass of optimizer steps (``helpers.step.train_step``) with the run's progress
kept at each step boundary; and a step's cost."""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
from torch import nn
from tqdm.auto import tqdm

from helpers.checkpoint import (CheckpointError, Checkpoints, Progress, epoch_start_state, set_rng_state,
                                set_sampler_epoch)
from helpers.distributed import barrier, rank, with_others
from helpers.step import train_step
from helpers.wrapping import is_sharded, unwrap


def input_device(model: nn.Module) -> torch.device:
    """The device a batch must be on before ``model(...)``: where its output and the labels meet.

    DataParallel scatters inputs from ``device_ids[0]`` (and gathers outputs there); a plain, compiled or
    DDP-wrapped model computes where its parameters are. On a machine without CUDA, DataParallel keeps
    ``device_ids`` empty and simply calls the model, so the parameters' device is right there too.
    """
    if isinstance(model, nn.DataParallel) and model.device_ids:
        return torch.device("cuda", model.device_ids[0])
    return next(model.parameters()).device


def to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """Every tensor of ``batch`` on ``device``; ``non_blocking`` lets a pinned-memory copy overlap compute."""
    return {key: value.to(device, non_blocking=True) for key, value in batch.items()}


def train_epoch(model: nn.Module, loader, optimizer, scheduler=None, loss_fn=None, *, progress: Progress | None = None,
                checkpoints: Checkpoints | None = None, resume_rng: dict | None = None, accumulation: int = 1,
                amp: torch.dtype | None = None, scaler: torch.amp.GradScaler | None = None,
                after_step=None) -> list[float]:
    """Train ``model`` (plain or wrapped) for one pass over ``loader``, ``accumulation`` batches per optimizer step
    (``train_step``; the epoch's last step on those that are left); returns the loss of every step of the epoch.

    ``progress`` (``Checkpoints.resume``'s, or a fresh ``Progress()``) is kept up to date after every step: steps,
    skipped steps (each printed), the epoch's batches trained and their losses; ``checkpoints`` are saved every
    ``checkpoints.every`` steps (the epoch's last by ``fit``, with its evaluation). A resumed epoch skips the
    ``progress.batch`` batches it trained, drawing them all the same, and then restores the random state
    ``resume_rng`` saved with the checkpoint. ``after_step(loss, batches, updated)`` is called at each step boundary.
    """
    progress = progress or Progress()
    skip = progress.batch
    if skip % accumulation:
        raise ValueError(f"train_epoch: skip={skip} batches is not a whole number of optimizer steps of "
                         f"accumulation={accumulation} batches each")
    progress.epoch_start = epoch_start_state(loader)
    model.train()
    device, batches = input_device(model), []
    # tqdm's notebook bar ignores TQDM_DISABLE, which `make notebooks` sets to keep bars out of stored outputs;
    # under torchrun only rank 0 draws one (N processes would draw N bars over each other on one terminal line)
    for index, batch in enumerate(tqdm(loader, desc="train", leave=False,
                                       disable=os.environ.get("TQDM_DISABLE") == "1" or rank() != 0)):
        if index < skip:
            continue
        if index == skip and resume_rng is not None:
            set_rng_state(resume_rng)
        batches.append(to_device(batch, device))
        if len(batches) < accumulation and index + 1 < len(loader):
            continue
        loss, updated = train_step(model, batches, optimizer, loss_fn=loss_fn, amp=amp, scaler=scaler,
                                   scheduler=scheduler)
        batches = []
        # the step boundary: the run's progress, and a checkpoint every N steps
        progress.step, progress.batch = progress.step + 1, index + 1
        progress.batch_losses.append(loss)
        if not updated:  # the same on every process: DDP's gradients are equal, FSDP2's scaler asks every shard
            progress.skipped_steps += 1
            say(f"step {progress.step}: inf or nan in the gradients, update skipped; gradient scale lowered to "
                f"{scaler.get_scale():g} ({progress.skipped_steps} skipped so far)")
        last = progress.batch == len(loader)  # the epoch's last step is saved by fit, with the epoch's evaluation
        if checkpoints and checkpoints.every and progress.step % checkpoints.every == 0 and not last:
            checkpoints.save(model, optimizer, scheduler, progress, scaler=scaler)
        if after_step is not None:
            after_step(loss, index + 1, updated)
    if progress.batch == skip:
        raise ValueError("train_epoch: the loader yielded no batches; is its data set empty, or smaller than "
                         "batch_size with drop_last=True?")
    return progress.batch_losses


def time_training_step(model: nn.Module, batch: dict[str, torch.Tensor], loss_fn=None) -> float:
    """Seconds one forward and backward pass of ``model`` on ``batch`` takes here: most of a training step.

    Call it before training, to see what an epoch will cost on this machine with this model. An untimed
    pass runs first (the first one allocates memory and picks kernels). The random state, the train/eval
    mode and the empty gradients are restored, so training afterwards goes exactly as without the
    measurement. The optimizer's update is not timed. Build ``batch`` without a DataLoader (for example
    with ``PadToLongest``): starting to iterate a DataLoader draws from the global random state.
    """
    loss_fn = loss_fn or nn.CrossEntropyLoss()
    device = input_device(model)
    batch = to_device(batch, device)
    was_training = model.training
    model.train()
    with torch.random.fork_rng(devices=range(torch.cuda.device_count())):  # every GPU: DataParallel uses them all
        for _ in range(2):
            start = time.perf_counter()
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
            loss_fn(logits, batch["labels"]).backward()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            seconds = time.perf_counter() - start
    model.zero_grad(set_to_none=True)
    model.train(was_training)
    return seconds


@torch.no_grad()
def evaluate(model: nn.Module, loader, loss_fn=None) -> dict[str, float]:
    """Mean loss and accuracy of ``model`` on ``loader``, in eval mode (no dropout)."""
    loss_fn = loss_fn or nn.CrossEntropyLoss()
    model.eval()
    device = input_device(model)
    total, correct, count = 0.0, 0, 0
    for batch in loader:
        batch = to_device(batch, device)
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        total += loss_fn(logits, batch["labels"]).item() * len(batch["labels"])
        correct += (logits.argmax(dim=-1) == batch["labels"]).sum().item()
        count += len(batch["labels"])
    if count == 0:
        raise ValueError("evaluate: the loader yielded no examples; is its data set empty?")
    return {"loss": total / count, "accuracy": correct / count}


def fit(model: nn.Module, train_loader, val_loader, optimizer, scheduler=None, epochs: int = 3,
        checkpoints: Checkpoints | None = None, *, resume: bool = True, timed: bool = False, accumulation: int = 1,
        amp: torch.dtype | None = None, scaler: torch.amp.GradScaler | None = None, on_step=None) -> list[dict]:
    """Train for ``epochs``, evaluating after each; returns one row per epoch and prints it.

    ``train_loss`` is the mean of the epoch's step losses, which are kept in ``batch_losses`` for plots;
    ``timed`` adds the epoch's training ``seconds``. ``accumulation`` and ``amp``: as in ``train_epoch``; the
    scheduler steps once per optimizer step. fp16 (``amp=torch.float16``) needs a gradient ``scaler``
    (``torch.amp.GradScaler``, see helpers.step): each step it skips is printed, and counted in the row's
    ``skipped_steps``; the checkpoints keep its state. With ``checkpoints`` the run is saved as it goes (every
    ``checkpoints.every`` steps and after each epoch), and a run started again continues from the latest
    checkpoint to exactly the weights it would have reached uninterrupted (``resume=False``: it starts afresh
    and saves over the old checkpoints). ``on_step(progress)``, if given, is called after every optimizer step
    (and its checkpoint), on every process: a step boundary (helpers.preemption stops a run there).

    With other processes (DDP, FSDP2: call it on every one), ``train_loss`` is the mean over all of them and
    rank 0 evaluates and prints while the others wait; a sharded model is evaluated by every process, since its
    forward needs them all.
    """
    if amp == torch.float16 and scaler is None:
        raise ValueError("fit: amp=torch.float16 needs a gradient scaler, or small gradients round to zero in fp16: "
                         "pass scaler=torch.amp.GradScaler(device.type) (helpers.levers.gradient_scaler)")
    progress, resume_rng = Progress(), None
    if checkpoints is not None and resume:
        progress, resume_rng = checkpoints.resume(  # checked before anything is loaded
            model, optimizer, scheduler, train_loader, scaler=scaler,
            check=lambda saved: check_steps(saved, len(train_loader), accumulation))
        if progress.step:
            say(f"resumed at step {progress.step}: epoch {progress.epoch + 1}, batch {progress.batch}")
    for epoch in range(progress.epoch + 1, epochs + 1):
        set_sampler_epoch(train_loader, epoch)
        start = time.perf_counter()
        batch_losses = train_epoch(model, train_loader, optimizer, scheduler, progress=progress,
                                   checkpoints=checkpoints, resume_rng=resume_rng, accumulation=accumulation, amp=amp,
                                   scaler=scaler,
                                   after_step=None if on_step is None else lambda *_: on_step(progress))
        resume_rng = None
        row = {"epoch": epoch, "train_loss": mean_over_processes(batch_losses, input_device(model))}
        row |= ({"seconds": time.perf_counter() - start} if timed else {}) | {"batch_losses": batch_losses}
        if scaler is not None:  # the run's skipped steps less those of the epochs before
            row["skipped_steps"] = progress.skipped_steps - sum(r.get("skipped_steps", 0) for r in progress.history)
        if rank() == 0 or is_sharded(model):
            val = evaluate(unwrap(model) if with_others() else model, val_loader)  # DDP's forward needs every rank
            row |= {"val_loss": val["loss"], "val_accuracy": val["accuracy"]}
            say(f"epoch {epoch}: train loss {row['train_loss']:.2f}  val loss {val['loss']:.2f}  "
                f"val accuracy {val['accuracy']:.2f}" + (f"  ({row['seconds']:.1f} s)" if timed else "")
                + (f"  {row['skipped_steps']} step(s) skipped" if row.get("skipped_steps") else ""))
        barrier()  # the others wait for rank 0's evaluation
        progress.history.append(row)
        progress.epoch, progress.batch, progress.batch_losses = progress.epoch + 1, 0, []
        if checkpoints is not None:  # marked best if its val_loss is the lowest so far (rows without one never are)
            progress.epoch_start = epoch_start_state(train_loader)  # where the next epoch starts
            best = "val_loss" in row and row["val_loss"] <= min(r["val_loss"] for r in progress.history
                                                                 if "val_loss" in r)
            checkpoints.save(model, optimizer, scheduler, progress, best=best, scaler=scaler)
    return progress.history


def check_steps(progress: Progress, batches: int, accumulation: int) -> None:
    """Raise CheckpointError if a run of ``batches`` per epoch and ``accumulation`` per optimizer step cannot
    have reached ``progress``: the checkpoint was saved with other data, batch size or gradient accumulation."""
    steps = progress.epoch * -(-batches // accumulation) + progress.batch // accumulation
    if progress.batch % accumulation or progress.step != steps:
        raise CheckpointError(f"the checkpoint stands at optimizer step {progress.step} (epoch {progress.epoch + 1}, "
                              f"batch {progress.batch}), where a run of {batches} batches per epoch and "
                              f"{accumulation} per optimizer step never stands: resume with the data, batch size "
                              f"and gradient accumulation it was saved with")


def say(line: str) -> None:
    """Print on rank 0 only, so N processes do not print every line N times."""
    if rank() == 0:
        print(line, flush=True)


def mean_over_processes(values: list[float], device: torch.device) -> float:
    """The mean of every process's mean of ``values`` (the mean of ``values`` without other processes)."""
    mean = sum(values) / len(values)
    if not with_others():
        return mean
    total = torch.tensor(mean, dtype=torch.float64, device=device)
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()
