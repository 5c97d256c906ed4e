"""A plain fine-tuning loop: one epoch of training, an evaluation, and both together per epoch."""

from __future__ import annotations

import torch
from torch import nn
from tqdm.auto import tqdm


def train_epoch(model: nn.Module, loader, optimizer, scheduler=None, loss_fn=None) -> float:
    """Train ``model`` (plain or wrapped) for one pass over ``loader``; returns the mean training loss."""
    loss_fn = loss_fn or nn.CrossEntropyLoss()
    model.train()
    total, count = 0.0, 0
    for batch in tqdm(loader, desc="train", leave=False):
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        loss = loss_fn(logits, batch["labels"])
        loss.backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        optimizer.zero_grad()
        total += loss.item() * len(batch["labels"])
        count += len(batch["labels"])
    return total / count


@torch.no_grad()
def evaluate(model: nn.Module, loader, loss_fn=None) -> dict[str, float]:
    """Mean loss and accuracy of ``model`` on ``loader``, in eval mode (no dropout)."""
    loss_fn = loss_fn or nn.CrossEntropyLoss()
    model.eval()
    total, correct, count = 0.0, 0, 0
    for batch in loader:
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        total += loss_fn(logits, batch["labels"]).item() * len(batch["labels"])
        correct += (logits.argmax(dim=-1) == batch["labels"]).sum().item()
        count += len(batch["labels"])
    return {"loss": total / count, "accuracy": correct / count}


def fit(model: nn.Module, train_loader, val_loader, optimizer, scheduler=None, epochs: int = 3) -> list[dict]:
    """Train for ``epochs``, evaluating after each; returns one row per epoch and prints it."""
    history = []
    for epoch in range(1, epochs + 1):
        train_loss = train_epoch(model, train_loader, optimizer, scheduler)
        val = evaluate(model, val_loader)
        history.append({"epoch": epoch, "train_loss": train_loss, "val_loss": val["loss"],
                        "val_accuracy": val["accuracy"]})
        print(f"epoch {epoch}: train loss {train_loss:.2f}  val loss {val['loss']:.2f}  "
              f"val accuracy {val['accuracy']:.2f}")
    return history
