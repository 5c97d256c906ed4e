"""Use a trained classifier on new sentences."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from helpers.checkpoint import MODEL_FILE, load_checkpoint, read_labels
from helpers.data import LABELS, MAX_LENGTH
from helpers.net import Net
from helpers.train import input_device, to_device


@torch.no_grad()
def predict_batch(model: nn.Module, tokenizer, texts: list[str],
                  labels: tuple[str, ...] = LABELS) -> list[tuple[str, float]]:
    """One batch: tokenized together, padded to its longest text, computed where ``model`` is."""
    batch = tokenizer(list(texts), padding="longest", truncation=True, max_length=MAX_LENGTH, return_tensors="pt")
    batch = to_device(dict(batch), input_device(model))
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    probabilities, ids = logits.softmax(dim=-1).max(dim=-1)
    return [(labels[i], p) for i, p in zip(ids.tolist(), probabilities.tolist())]


def predict(model: nn.Module, tokenizer, texts: list[str], batch_size: int = 32,
            labels: tuple[str, ...] = LABELS) -> list[tuple[str, float]]:
    """The most probable label of each text and its probability, ``batch_size`` texts at a time.

    Eval mode turns dropout off, so the same sentence always gets the same answer.
    """
    if isinstance(texts, str):
        raise TypeError(f"predict: texts must be a list of sentences, got one str; write [{texts!r}]")
    model.eval()
    return [prediction for start in range(0, len(texts), batch_size)
            for prediction in predict_batch(model, tokenizer, texts[start:start + batch_size], labels)]


def load_classifier(path: str | Path, model: str | None = None) -> tuple[Net, tuple[str, ...]]:
    """The ``Net`` saved in checkpoint folder ``path`` (by ``python -m helpers.finetune --output-dir``) and its
    label names, for ``predict(net, tokenizer, texts, labels=labels)``.

    The head is sized from the saved names; a checkpoint saved without names (as before they were saved)
    gets the bundled LABELS. ``model`` names the BERT body it was trained from (default: as ``Net``).
    """
    path = Path(path)
    labels = read_labels(path) or LABELS
    with safe_open(path / MODEL_FILE, "pt") as weights:
        pooler = any(key.startswith("bert.pooler.") for key in weights.keys())
    net = Net(model, num_labels=len(labels), pooler=pooler)
    load_checkpoint(path, net)
    return net, labels
