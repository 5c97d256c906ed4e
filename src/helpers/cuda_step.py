"""Measure one training step on a real CUDA GPU: the allocator's peak, and the attention kernel the GPU picks.

Notebook 05 compares these measurements with the predictions of helpers.memory; ``make gpu-check`` runs
them over a grid of batch sizes and sequence lengths.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from helpers.memtrace import build_model


@dataclass(frozen=True)
class CudaPeak:
    """One device's ``torch.cuda`` figures for a measured step: what it held before, and its peak."""

    before: int  # memory_allocated when the step starts (weights and Adam state, or nothing on a replica)
    peak: int    # max_memory_allocated during the step


def measure_cuda_step(config, batch_size: int, seq_len: int, devices: list[int], *, attention: str = "sdpa",
                      amp: bool = False) -> list[CudaPeak]:
    """``torch.cuda.max_memory_allocated`` per device over one Adam step of ``Net`` with random weights.

    One device: the model on it. Several: ``nn.DataParallel`` over them. A first step creates Adam's state
    (as in the prediction), then the peaks are reset and the measured step runs with the same shapes, its
    forward and loss under ``torch.autocast("cuda", dtype=torch.bfloat16)`` when ``amp``.
    """
    torch.manual_seed(0)
    model = build_model(config, attention=attention, device="cpu").to(f"cuda:{devices[0]}")
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    net = nn.DataParallel(model, device_ids=devices) if len(devices) > 1 else model
    net.train()

    def step(size, length):
        input_ids = torch.randint(0, config.vocab_size, (size, length), device=f"cuda:{devices[0]}")
        labels = torch.randint(0, 2, (size,), device=f"cuda:{devices[0]}")
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
            loss = nn.functional.cross_entropy(net(input_ids, torch.ones_like(input_ids)), labels)
        loss.backward()
        del loss
        optimizer.step()
        optimizer.zero_grad()

    step(len(devices), 8)
    before = []
    for device in devices:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before.append(torch.cuda.memory_allocated(device))
    step(batch_size, seq_len)
    peaks = [CudaPeak(held, torch.cuda.max_memory_allocated(device)) for held, device in zip(before, devices)]
    del net, model, optimizer
    torch.cuda.empty_cache()
    return peaks


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
