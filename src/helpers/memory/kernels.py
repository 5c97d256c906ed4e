"""Make a trace on the CPU keep what a CUDA step keeps for backward: 1-byte dropout masks, the fused attention
kernel the GPU picks, and CUDA autocast's dtypes (``CudaLikeKernels``)."""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from helpers.memory.gpu_facts import GPUS, GpuModel, attention_kernel
from helpers.torch_private import fused_attention, native_dropout

# What CUDA autocast does to the functions the encoders call (aten/src/ATen/autocast_mode.cpp, KERNEL_CUDA lists):
# linear, the matrix products (matmul, mm, bmm, addmm, baddbmm: DeBERTa's attention calls bmm) and
# scaled_dot_product_attention run in the low-precision type; layer_norm, softmax, log_softmax (inside cross_entropy)
# run in fp32; everything else (gelu, dropout, add) keeps its input's type.
_LOWER_PRECISION = {nn.functional.linear, torch.matmul, torch.mm, torch.bmm, torch.addmm, torch.baddbmm,
                    nn.functional.scaled_dot_product_attention}
_FP32 = {nn.functional.layer_norm, nn.functional.softmax, nn.functional.log_softmax, nn.functional.cross_entropy}
PRECISION_OF = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
"""Each dtype a step computes in, by its name in helpers.memory.gpu_facts.PRECISIONS."""
DTYPES = {name: dtype for dtype, name in PRECISION_OF.items()}


class CudaLikeKernels(TorchFunctionMode):
    """Make a CPU trace keep what a CUDA step keeps for backward.

    Dropout: CPU dropout saves a float mask (4 bytes per element), CUDA's fused kernel a 1-byte mask;
    ``torch.native_dropout`` is that fused form. Attention (``fused_attention=True``): route
    ``scaled_dot_product_attention`` to the kernel ``gpu`` picks (``helpers.memory.gpu_facts.attention_kernel``);
    its meta registration (torch/_meta_registrations.py) gives the exact shapes it keeps. Flash, cuDNN and
    memory-efficient attention all keep the output and one fp32 log-sum-exp per query (the log of each softmax
    row's sum, from which backward rebuilds the probabilities), never the L x L probabilities. ``amp_dtype``: cast
    as CUDA autocast does, including its cache of the parameters' low-precision copies, which lives until the
    ``with`` block ends.
    """

    _active: list[CudaLikeKernels] = []  # the kernels entered and not yet left, innermost last

    def __init__(self, byte_masks: bool = True, fused_attention: bool = False, amp_dtype: torch.dtype | None = None,
                 gpu: GpuModel = GPUS["H200"]):
        super().__init__()
        self.byte_masks = byte_masks
        self.fused_attention = fused_attention
        self.amp_dtype = amp_dtype
        self.gpu = gpu
        self._casts = {}

    def __enter__(self):
        CudaLikeKernels._active.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        CudaLikeKernels._active.remove(self)
        self._casts.clear()
        return super().__exit__(*exc)

    @classmethod
    def for_recomputation(cls):
        """What a checkpointed layer's recomputation in backward runs under: fresh kernels with the settings of
        the innermost ``CudaLikeKernels`` active now, at its forward (CUDA's checkpoint likewise re-enters the
        forward's autocast state, with a new cast cache), or nothing where the forward runs under none.
        Backward runs outside the forward's ``with`` block, so the recomputation must re-enter it itself."""
        if not cls._active:
            return contextlib.nullcontext()
        forward = cls._active[-1]
        return cls(forward.byte_masks, forward.fused_attention, forward.amp_dtype, forward.gpu)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.amp_dtype is not None:
            if func in _LOWER_PRECISION:
                args, kwargs = self._cast_all(args, kwargs, self.amp_dtype)
            elif func in _FP32 and kwargs.get("dtype") is None:
                args, kwargs = self._cast_all(args, kwargs, torch.float32)
        if func is nn.functional.dropout and self.byte_masks:
            return self.dropout(*args, **kwargs)
        if func is nn.functional.scaled_dot_product_attention and self.fused_attention:
            return self.fused(*args, **kwargs)
        return func(*args, **kwargs)

    def _cast_all(self, args, kwargs, dtype):
        return (tuple(self._cast(arg, dtype) for arg in args),
                {key: self._cast(value, dtype) for key, value in kwargs.items()})

    def _cast(self, value, dtype):
        if not (isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != dtype):
            return value
        if value.is_leaf and value.requires_grad:  # a parameter: autocast casts it once per autocast block
            if id(value) not in self._casts:
                self._casts[id(value)] = value.to(dtype)
            return self._casts[id(value)]
        return value.to(dtype)

    @staticmethod
    def dropout(input, p=0.5, training=True, inplace=False):
        return native_dropout(input, p, True)[0] if training and p > 0 else input

    def fused(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **_):
        kernel = attention_kernel(self.gpu, PRECISION_OF[query.dtype], attn_mask is not None)
        if kernel == "math":  # the unfused computation as the CPU runs it: only bf16 below sm80, which helpers.memory
            #                   refuses as helpers.finetune does (gpu_facts.amp_precision)
            return nn.functional.scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal,
                                                              scale=scale)
        if kernel == "memory-efficient" and attn_mask is not None and attn_mask.dtype == torch.bool:
            bias = torch.zeros(attn_mask.shape, dtype=query.dtype, device=query.device).masked_fill(
                ~attn_mask, float("-inf"))
            attn_mask = bias.expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2])  # as aten's
            #                                                                           convert_boolean_attn_mask
        return fused_attention(kernel, query, key, value, attn_mask, dropout_p, is_causal, scale)
