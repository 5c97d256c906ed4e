"""The memory predictor: what each GPU holds during one fine-tuning step, by category, for one GPU, DataParallel, DDP
and FSDP2, with the levers; checked against a real H200. ``python -m helpers.memory`` answers for a reader's own
setting. This module is its front door: it exports what the notebooks and the entry points use, each name loaded
from its module when first asked for, so that importing one module of the package (``gpu_facts``, a table that
needs no torch) or running one (``python -m helpers.memory.cuda_step``) loads only what that module needs.

Inside, one module per concern (each imports only those above it in this list):

- ``categories``: the words memory is split into (weights, gradients, ...), in one order;
- ``gpu_facts``: GPUs as a table (the total each reports, with its source), which mixed precision and attention
  kernel each runs, and what CUDA allocates besides tensors, read in PyTorch's C++ (pure: no torch);
- ``nvidia_smi``: what nvidia-smi shows beyond the allocator's segments, the CUDA context and NCCL, with sources;
- ``allocator`` and ``simulated_gpu``: PyTorch's caching allocator in Python, and a GPU replaying a traced step;
- ``configs``: the BERT shapes and the command's presets; ``formulas``: parameter and activation bytes in closed form;
- ``kernels``, ``tracker``, ``tracer``: a step traced on meta or fake tensors as CUDA runs it;
- ``step_logs``: a traced step's events re-run (DDP's bucket, a DataParallel replica, another batch size);
- ``cuda_step``: measuring on a real GPU, the only CUDA code;
- ``fsdp2``: FSDP2's per-rank memory; ``prediction``: per-GPU peaks of every strategy, what nvidia-smi will show, and
  the largest batch;
- ``record`` (the H200 measurements), ``fsdp2_table`` (notebook 08's stored table), ``charts``, ``command``.

Nothing here imports the training loop, the entry point or the checkpoints, and no module of the package imports
this front door (tests/test_layout.py).
"""

from __future__ import annotations

import importlib

EXPORTS = {
    "categories": ("ORDER",),
    "charts": ("plot_per_device", "plot_per_rank"),
    "configs": ("MODELS", "bert_base_config"),
    "cuda_step": ("CudaPeak", "gpu_sdpa_kernel", "measure_cuda_step", "this_gpu"),
    "formulas": ("activation_formula", "layer_activation_bytes", "parameter_bytes", "parameters"),
    "fsdp2": ("FSDP2_CATEGORIES", "fake_process_group", "fsdp_categories", "predict_fsdp", "trace_fsdp"),
    "fsdp2_table": ("load_table",),
    "gpu_facts": ("GIB", "GPUS", "PRECISIONS", "GpuModel", "amp_precision", "attention_kernel", "mixed_precision",
                  "sdpa_kernel", "workspaces"),
    "prediction": ("GpuMemory", "default_gpu", "gpu_memory", "largest_batch", "per_device", "predict_cpu_step",
                   "predict_step"),
    "command": ("MEMO_ARGS", "MEMO_NVIDIA_SMI_MIB", "memo_prediction"),
    "nvidia_smi": ("cuda_context", "communication"),
    "record": ("h200_steps",),
    "tracer": ("trace_fake",),
    "helpers.torch_private": ("recording_memory_history",),  # every private PyTorch surface of the package
    "tracker": ("tracking",),
}
"""The front door's names, by the module that defines them (inside this package, or named in full)."""
_HOME = {name: module for module, names in EXPORTS.items() for name in names}
__all__ = sorted(_HOME)


def module_of(key: str) -> str:
    """The full name of an ``EXPORTS`` key: a module of this package, or one named in full."""
    return key if key.startswith("helpers.") else f"helpers.memory.{key}"


def __getattr__(name: str):
    if name not in _HOME:
        raise AttributeError(f"module 'helpers.memory' has no attribute {name!r}")
    return getattr(importlib.import_module(module_of(_HOME[name])), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOME))
