"""One training step, written once: forward and backward over the micro-batches of one batch, then the update.
``helpers.train`` trains with it, the memory predictor traces it (helpers.memory.tracer, on fake tensors), and the
two-process mixed-precision test checks it (tests/amp_worker.py), so what one of them sees the others see too.

Each micro-batch's loss (a mean over its examples) is weighted by its share of all the examples, so micro-batches
of unequal size (an epoch's last) give the mean over every example, as one batch would; padding is no example.
DDP and FSDP2 average the ranks with equal weights: the mean over every rank's examples needs as many examples on
each rank per step (DistributedSampler gives each rank as many). Every micro-batch but the last runs its forward
and backward inside ``no_gradient_sync`` (DDP decides in forward whether backward communicates), so DDP and FSDP2
communicate once per optimizer step. ``amp`` (torch.bfloat16 or torch.float16) runs the forward and the loss under
autocast: matrix products in that type, while the weights, their gradients and the optimizer stay fp32. fp16 needs
a gradient ``scaler`` (``torch.amp.GradScaler``): it multiplies the loss by its scale before backward, so that
fp16's small gradients do not round to zero, divides the gradients once before the update, and skips an update
whose gradients hold inf or nan (the scaled loss overflowed): it then halves its scale, and doubles it after
``growth_interval`` steps without one (2000 by default). The learning-rate schedule moves on only with an update.
"""

from __future__ import annotations

import math
from contextlib import nullcontext

import torch
from torch import nn

from helpers.wrapping import no_gradient_sync


def train_step(model: nn.Module, batches: list[dict], optimizer=None, *, loss_fn=None, amp: torch.dtype | None = None,
               scaler: torch.amp.GradScaler | None = None, scheduler=None, set_to_none: bool = True, phase=None,
               host_reads: bool = True) -> tuple[float, bool]:
    """One optimizer step on ``batches`` (micro-batches): their mean loss, and whether it updated. No ``optimizer``:
    the gradients only, kept in ``.grad``. ``phase(name)``: a context per part; ``host_reads=False``: no value read.

        loss, updated = train_step(model, micro_batches, optimizer, amp=torch.float16, scaler=GradScaler("cuda"))
    """
    loss_fn, phase = loss_fn or nn.CrossEntropyLoss(), phase or (lambda name: nullcontext())
    examples, mean = sum(len(batch["labels"]) for batch in batches), 0.0
    for index, batch in enumerate(batches):  # DDP and FSDP2 communicate in the last backward only
        with nullcontext() if index == len(batches) - 1 else no_gradient_sync(model):
            with phase("forward"), torch.autocast(batch["labels"].device.type, dtype=amp) if amp else nullcontext():
                loss = loss_fn(model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask")),
                               batch["labels"]) * (len(batch["labels"]) / examples)  # the mean of all, as one batch
            with phase("scale"):
                scaled = loss if scaler is None else scaler.scale(loss)  # fp16: small gradients stay above zero
            with phase("backward"):
                scaled.backward()
        mean += loss.item() if host_reads else math.nan
        del loss, scaled  # nothing of a micro-batch outlives it (the memory tracer counts every block)
    if optimizer is None:
        return mean, False
    scale = scaler.get_scale() if scaler is not None and host_reads else None
    with phase("unscale"):
        if scaler is not None:
            scaler.unscale_(optimizer)  # the true gradients from here on: clip them here
    with phase("optimizer"):
        if scale is None:
            optimizer.step()
        else:
            scaler.step(optimizer)  # skipped where a gradient holds inf or nan
        optimizer.zero_grad(set_to_none=set_to_none)
    with phase("update"):
        if scaler is not None:
            scaler.update()  # halved after a skipped step, doubled after growth_interval steps without one
    updated = scale is None or scaler.get_scale() >= scale
    if scheduler is not None and updated:
        scheduler.step()
    return mean, updated
