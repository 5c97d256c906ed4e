"""Two of the memory levers notebook 05 predicts, as helpers.finetune applies them: bf16 autocast (``--amp bf16``)
and activation checkpointing (``--gradient-checkpointing``). The third, gradient accumulation, is a loop:
helpers.train.accumulate.

- bf16 autocast runs the forward and the loss with matrix products in bf16 (helpers.train.forward_backward);
  the weights, their gradients and Adam's state stay fp32. Under FSDP2, ``MixedPrecisionPolicy`` also gathers
  the weights in bf16 (half the all-gather traffic and the gathered copies) and reduces gradients in fp32.
- activation checkpointing keeps only each encoder layer's input for backward and computes the layer's forward
  again there: less memory, about one more forward of compute.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

AMP_DTYPES = {"bf16": torch.bfloat16}  # --amp choices


def amp_dtype(choice: str | None) -> torch.dtype | None:
    """The autocast type of ``--amp choice``; None trains in fp32."""
    return None if choice is None else AMP_DTYPES[choice]


def amp_problem(choice: str | None, device: torch.device) -> str | None:
    """Why ``--amp choice`` cannot run on ``device``, or None. CPUs compute bf16 in any case (torch converts where
    the CPU has no bf16 instructions); a CUDA GPU needs bf16 support (compute capability 8.0 or later)."""
    if choice is None or device.type != "cuda" or torch.cuda.is_bf16_supported(including_emulation=False):
        return None
    name = torch.cuda.get_device_name(device)
    major, minor = torch.cuda.get_device_capability(device)
    return (f"--amp {choice}: {name} (compute capability {major}.{minor}) has no bf16 support; train in fp32 "
            f"(leave out --amp), or use a GPU of compute capability 8.0 or later")


def enable_checkpointing(net: nn.Module) -> nn.Module:
    """Recompute each encoder layer of ``net.bert`` in backward instead of keeping its activations; returns ``net``.

    transformers' own switch (``activation_checkpointing_enable``, formerly ``gradient_checkpointing_enable``),
    with PyTorch's non-reentrant checkpoint, which restores the random state for the recomputation: dropout draws
    the same masks again, so the gradients are those of the step without it. Call it before DDP or FSDP2 wraps
    ``net``. ``use_cache`` is switched off, which BERT as an encoder never uses and transformers would warn about.
    """
    net.bert.config.use_cache = False
    net.bert.activation_checkpointing_enable({"use_reentrant": False})
    return net


def fsdp_mixed_precision(choice: str | None) -> dict:
    """``fully_shard`` options for ``--amp choice``: bf16 gathered weights and compute, fp32 gradient reduction."""
    if choice is None:
        return {}
    return {"mp_policy": MixedPrecisionPolicy(param_dtype=AMP_DTYPES[choice], reduce_dtype=torch.float32)}

