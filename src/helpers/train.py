"""A plain fine-tuning loop: one epoch of training, an evaluation, both together per epoch, and a step's cost."""

from __future__ import annotations

import os
import time

import torch
from torch import nn
from tqdm.auto import tqdm


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


def train_epoch(model: nn.Module, loader, optimizer, scheduler=None, loss_fn=None) -> list[float]:
    """Train ``model`` (plain or wrapped) for one pass over ``loader``; returns the loss of every batch."""
    loss_fn = loss_fn or nn.CrossEntropyLoss()
    model.train()
    device = input_device(model)
    losses = []
    # tqdm's notebook bar ignores TQDM_DISABLE, which `make notebooks` sets to keep bars out of stored outputs
    for batch in tqdm(loader, desc="train", leave=False, disable=os.environ.get("TQDM_DISABLE") == "1"):
        batch = to_device(batch, device)
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        loss = loss_fn(logits, batch["labels"])
        loss.backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


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
    return {"loss": total / count, "accuracy": correct / count}


def fit(model: nn.Module, train_loader, val_loader, optimizer, scheduler=None, epochs: int = 3) -> list[dict]:
    """Train for ``epochs``, evaluating after each; returns one row per epoch and prints it.

    ``train_loss`` is the mean of the epoch's batch losses, which are kept in ``batch_losses`` for plots.
    """
    history = []
    for epoch in range(1, epochs + 1):
        batch_losses = train_epoch(model, train_loader, optimizer, scheduler)
        train_loss = sum(batch_losses) / len(batch_losses)
        val = evaluate(model, val_loader)
        history.append({"epoch": epoch, "train_loss": train_loss, "batch_losses": batch_losses,
                        "val_loss": val["loss"], "val_accuracy": val["accuracy"]})
        print(f"epoch {epoch}: train loss {train_loss:.2f}  val loss {val['loss']:.2f}  "
              f"val accuracy {val['accuracy']:.2f}")
    return history
