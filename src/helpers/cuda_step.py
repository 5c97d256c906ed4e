"""Measure one training step on a real CUDA GPU: the allocator's peaks, and the attention kernel the GPU picks.

Notebook 05 compares these measurements with the predictions of helpers.memory; ``make gpu-check`` runs
them over a grid of batch sizes, sequence lengths and levers.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass

import torch
from torch import nn

from helpers.levers import enable_checkpointing
from helpers.memtrace import build_model


@dataclass(frozen=True)
class CudaPeak:
    """One device's ``torch.cuda.memory_stats`` figures for a measured step."""

    leftover: int   # allocated before the model was built: tensors of earlier code still alive (0 when clean)
    before: int     # allocated when the measured step starts (weights, Adam state, workspaces; or a replica's)
    peak: int       # allocated_bytes.all.peak during the step: whole blocks (max_memory_allocated)
    requested: int  # requested_bytes.all.peak during the step: the bytes code asked for
    held_after: int  # allocated once the model and optimizer are gone: the workspaces (and any leftover)


def clean_state(device: int = 0) -> int:
    """Free what earlier code left in the caching allocator: garbage, the cuBLAS workspaces (so that the step
    allocates them afresh, as the prediction does) and cached blocks. Returns the bytes still allocated after
    that: tensors earlier code still holds."""
    gc.collect()
    torch.cuda.synchronize(device)
    torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated(device)


def measure_cuda_step(config, batch_size: int, seq_len: int, devices: list[int], *, attention: str = "sdpa",
                      amp: bool = False, accumulation: int = 1, checkpointing: bool = False) -> list[CudaPeak]:
    """The allocator's peaks per device over one Adam step of ``Net`` with random weights.

    One device: the model on it. Several: ``nn.DataParallel`` over them. A first step creates Adam's state
    (as in the prediction), then the peaks are reset and the measured step runs with ``batch_size`` examples in
    ``accumulation`` micro-batches, its forward and loss under ``torch.autocast("cuda", dtype=torch.bfloat16)``
    when ``amp``, each encoder layer recomputed in backward when ``checkpointing``.
    """
    leftovers = [clean_state(device) for device in devices]
    torch.manual_seed(0)
    model = build_model(config, attention=attention, device="cpu")
    if checkpointing:  # as helpers.finetune --gradient-checkpointing applies it
        enable_checkpointing(model)
    model = model.to(f"cuda:{devices[0]}")
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    net = nn.DataParallel(model, device_ids=devices) if len(devices) > 1 else model
    net.train()

    def step(size, length, micro_batches=1):
        for _ in range(micro_batches):
            input_ids = torch.randint(0, config.vocab_size, (size // micro_batches, length), device=f"cuda:{devices[0]}")
            labels = torch.randint(0, 2, (size // micro_batches,), device=f"cuda:{devices[0]}")
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
                loss = nn.functional.cross_entropy(net(input_ids, torch.ones_like(input_ids)), labels) / micro_batches
            loss.backward()
            del loss, input_ids, labels
        optimizer.step()
        optimizer.zero_grad()

    step(len(devices), 8)
    before = []
    for device in devices:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before.append(torch.cuda.memory_allocated(device))
    step(batch_size, seq_len, accumulation)
    stats = [torch.cuda.memory_stats(device) for device in devices]
    del net, model, optimizer
    gc.collect()
    return [CudaPeak(leftover, held, stat["allocated_bytes.all.peak"], stat["requested_bytes.all.peak"],
                     torch.cuda.memory_allocated(device))
            for leftover, held, stat, device in zip(leftovers, before, stats, devices)]


def gpu_sdpa_kernel(config, batch_size: int, seq_len: int, dtype: torch.dtype) -> str:
    """The kernel this GPU's ``scaled_dot_product_attention`` picks for BERT's unmasked training call, asked
    with ``torch._fused_sdp_choice`` on tensors laid out as BERT lays them out ((B, L, A, d) transposed)."""
    from torch.nn.attention import SDPBackend

    heads = config.num_attention_heads
    query = torch.empty(batch_size, seq_len, heads, config.hidden_size // heads, device="cuda", dtype=dtype,
                        requires_grad=True).transpose(1, 2)
    choice = torch._fused_sdp_choice(query, query, query, None, config.attention_probs_dropout_prob, False)
    names = {int(member.value): name for name, member in SDPBackend.__members__.items()}
    return {"EFFICIENT_ATTENTION": "memory-efficient", "FLASH_ATTENTION": "flash",
            "CUDNN_ATTENTION": "cuDNN", "MATH": "math"}.get(names.get(choice), str(names.get(choice, choice)))
