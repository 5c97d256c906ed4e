"""Two of the memory levers notebook 05 predicts, as helpers.finetune applies them: mixed precision (``--amp bf16``
or ``--amp fp16``) and activation checkpointing (``--gradient-checkpointing``). The third, gradient accumulation, is
a loop: helpers.step.train_step's micro-batches.

- mixed precision runs the forward and the loss under autocast, with matrix products in bf16 or fp16
  (helpers.step.train_step); the weights, their gradients and Adam's state stay fp32. bf16 has fp32's range;
  fp16 has 3 more bits of precision but overflows above 65504 and loses gradients below about 6e-8, so fp16 trains
  with a gradient scaler (``torch.amp.GradScaler``): the loss is multiplied by a large scale before backward, the
  gradients divided by it before the optimizer step, and a step whose gradients hold inf or nan is skipped (the
  scale then halves). Under FSDP2, ``MixedPrecisionPolicy`` also gathers the weights in that type (half the
  all-gather traffic and the gathered copies) and reduces gradients in fp32. GPUs of compute capability 8.0 or
  later compute bf16; older ones (the T4, the V100) compute fp16 only (``amp_problem`` refuses bf16 there).
- activation checkpointing keeps only each encoder layer's input for backward and computes the layer's forward
  again there: less memory, about one more forward of compute.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}  # --amp choices


def amp_dtype(choice: str | None) -> torch.dtype | None:
    """The autocast type of ``--amp choice``; None trains in fp32."""
    return None if choice is None else AMP_DTYPES[choice]


def gradient_scaler(choice: str | None, device: torch.device) -> torch.amp.GradScaler | None:
    """The gradient scaler ``--amp choice`` trains with on ``device``: one for fp16, None for bf16 and fp32, whose
    range is fp32's."""
    return torch.amp.GradScaler(device.type) if choice == "fp16" else None


def native_bf16(device: torch.device) -> bool:
    """Whether ``device`` computes bf16 itself: any CPU (torch converts where it lacks bf16 instructions), a CUDA
    GPU of compute capability 8.0 or later (the rule helpers.memory's ``GpuModel.native_bf16`` applies to a
    GPU by name). Emulated bf16 on an older GPU does not count."""
    return device.type != "cuda" or torch.cuda.is_bf16_supported(including_emulation=False)


def describe_gpu(device: torch.device) -> str:
    major, minor = torch.cuda.get_device_capability(device)
    return f"{torch.cuda.get_device_name(device)} (compute capability {major}.{minor})"


def amp_problem(choice: str | None, device: torch.device) -> str | None:
    """Why ``--amp choice`` cannot run on ``device``, or None. fp16 runs everywhere; bf16 on any CPU and on CUDA GPUs
    of compute capability 8.0 or later."""
    if choice != "bf16" or native_bf16(device):
        return None
    return (f"--amp bf16: {describe_gpu(device)} has no native bf16; use --amp fp16 (fp16 autocast with a gradient "
            f"scaler), train in fp32 (leave out --amp), or use a GPU of compute capability 8.0 or later")


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
    """``fully_shard`` options for ``--amp choice``: weights gathered and computed in bf16 or fp16, gradients reduced
    in fp32, and kept in fp32 between micro-batches while the communication is paused (FSDP2 casts them to
    ``reduce_dtype``: torch/distributed/fsdp/_fully_shard/_fsdp_param.py, ``to_accumulated_grad_if_needed``). In
    fp16, a reduction would round every partial sum and could overflow the scaled gradients' sum over the ranks."""
    if choice is None:
        return {}
    return {"mp_policy": MixedPrecisionPolicy(param_dtype=AMP_DTYPES[choice], reduce_dtype=torch.float32)}
