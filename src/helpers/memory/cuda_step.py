"""Measure on a real CUDA GPU: one training step's allocator peaks (one GPU, DataParallel, FSDP2 over NCCL), the
attention kernel the GPU picks, and the GPU's own facts. The only module of helpers.memory that runs CUDA code.

Notebook 05 compares these measurements with the predictions of helpers.memory; ``make gpu-check`` runs
them over a grid of batch sizes, sequence lengths and levers, and FSDP2 on two GPUs:

    torchrun --nproc_per_node=2 -m helpers.memory.cuda_step --fsdp --batch-size 8 --seq-len 512
"""

from __future__ import annotations

import argparse
import gc
import json
import os
from dataclasses import dataclass

import torch
from torch import nn

from helpers.levers import enable_checkpointing
from helpers.memory.configs import bert_base_config
from helpers.memory.gpu_facts import PRECISIONS, GpuModel, amp_precision
from helpers.memory.kernels import DTYPES
from helpers.torch_private import clear_cublas_workspaces, fused_sdp_choice
from helpers.memory.tracer import build_model


@dataclass(frozen=True)
class CudaPeak:
    """One device's ``torch.cuda.memory_stats`` figures for a measured step."""

    leftover: int   # allocated before the model was built: tensors of earlier code still alive (0 when clean)
    before: int     # allocated when the measured step starts (weights, Adam state, workspaces; or a replica's)
    peak: int       # allocated_bytes.all.peak during the step: whole blocks (max_memory_allocated)
    requested: int  # requested_bytes.all.peak during the step: the bytes code asked for
    held_after: int  # allocated once the model and optimizer are gone: the workspaces (and any leftover)
    reserved: int | None = None  # reserved_bytes.all.peak during the step: the segments taken (max_memory_reserved)


def clean_state(device: int = 0) -> int:
    """Free what earlier code left in the caching allocator: garbage, the cuBLAS workspaces (so that the step
    allocates them afresh, as the prediction does) and cached blocks. Returns the bytes still allocated after
    that: tensors earlier code still holds."""
    gc.collect()
    torch.cuda.synchronize(device)
    clear_cublas_workspaces()
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated(device)


def measure_cuda_step(config, batch_size: int, seq_len: int, devices: list[int], *, attention: str = "sdpa",
                      amp: bool | str | None = None, accumulation: int = 1,
                      checkpointing: bool = False) -> list[CudaPeak]:
    """The allocator's peaks per device over one Adam step of ``Net`` with random weights.

    One device: the model on it. Several: ``nn.DataParallel`` over them. A first step creates Adam's state
    (as in the prediction), then the peaks are reset and the measured step runs with ``batch_size`` examples in
    ``accumulation`` micro-batches, each encoder layer recomputed in backward when ``checkpointing``. ``amp`` as
    ``helpers.memory.predict_step`` takes it (True: the GPU's own mixed precision): the forward and loss under
    ``torch.autocast("cuda", dtype=...)``; in fp16 with a ``torch.amp.GradScaler``, which scales each loss and
    unscales once before the optimizer step, as ``--amp fp16`` trains.
    """
    precision = amp_precision(_model(devices[0]), amp)
    leftovers = [clean_state(device) for device in devices]
    torch.manual_seed(0)
    model = build_model(config, attention=attention, device="cpu")
    if checkpointing:  # as helpers.finetune --gradient-checkpointing applies it
        enable_checkpointing(model)
    model = model.to(f"cuda:{devices[0]}")
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler("cuda", enabled=precision == "fp16")
    net = nn.DataParallel(model, device_ids=devices) if len(devices) > 1 else model
    net.train()

    def step(size, length, micro_batches=1):
        for _ in range(micro_batches):
            input_ids = torch.randint(0, config.vocab_size, (size // micro_batches, length), device=f"cuda:{devices[0]}")
            labels = torch.randint(0, 2, (size // micro_batches,), device=f"cuda:{devices[0]}")
            with torch.autocast("cuda", dtype=DTYPES[precision], enabled=precision != "fp32"):
                loss = nn.functional.cross_entropy(net(input_ids, torch.ones_like(input_ids)), labels) / micro_batches
            scaler.scale(loss).backward()
            del loss, input_ids, labels
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()

    step(len(devices), 8)
    before = []
    for device in devices:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before.append(torch.cuda.memory_allocated(device))
    step(batch_size, seq_len, accumulation)
    stats = [torch.cuda.memory_stats(device) for device in devices]
    del net, model, optimizer, scaler
    gc.collect()
    return [CudaPeak(leftover, held, stat["allocated_bytes.all.peak"], stat["requested_bytes.all.peak"],
                     torch.cuda.memory_allocated(device), stat["reserved_bytes.all.peak"])
            for leftover, held, stat, device in zip(leftovers, before, stats, devices)]


def gpu_sdpa_kernel(config, batch_size: int, seq_len: int, dtype: torch.dtype) -> str:
    """The kernel this GPU's ``scaled_dot_product_attention`` picks for BERT's unmasked training call, asked
    of torch (``torch._fused_sdp_choice``) on tensors laid out as BERT lays them out ((B, L, A, d) transposed)."""
    from torch.nn.attention import SDPBackend

    heads = config.num_attention_heads
    query = torch.empty(batch_size, seq_len, heads, config.hidden_size // heads, device="cuda", dtype=dtype,
                        requires_grad=True).transpose(1, 2)
    choice = fused_sdp_choice(query, query, query, config.attention_probs_dropout_prob)
    names = {int(member.value): name for name, member in SDPBackend.__members__.items()}
    return {"EFFICIENT_ATTENTION": "memory-efficient", "FLASH_ATTENTION": "flash",
            "CUDNN_ATTENTION": "cuDNN", "MATH": "math"}.get(names.get(choice), str(names.get(choice, choice)))


def _model(device: int, kernels: tuple[tuple[str, str], ...] | None = None) -> GpuModel:
    props = torch.cuda.get_device_properties(device)
    return GpuModel(props.name, (props.major, props.minor), props.multi_processor_count,
                    props.max_threads_per_multi_processor, props.total_memory, kernels)


def this_gpu(device: int = 0) -> GpuModel:
    """The model of a CUDA device of this machine, from ``torch.cuda.get_device_properties``, with the attention
    kernel it picks for BERT's training call in each precision (asked of torch, ``gpu_sdpa_kernel``; bf16 too on
    a GPU without native bf16, where torch emulates it)."""
    with torch.cuda.device(device):
        kernels = tuple((name, gpu_sdpa_kernel(bert_base_config(), 8, 128, DTYPES[name])) for name in PRECISIONS)
    return _model(device, kernels)


def measure_fsdp_rank(batch_size: int, seq_len: int) -> None:
    """One rank of ``torchrun -m helpers.memory.cuda_step --fsdp``: an Adam step of BERT-base-shaped ``Net`` (random
    weights) sharded over NCCL, ``batch_size`` examples of ``seq_len`` tokens per rank; rank 0 prints every rank's
    ``torch.cuda.max_memory_allocated`` as JSON."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from helpers import distributed
    from helpers.fsdp import shard

    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    distributed.init_process_group(device)  # NCCL, bound to this GPU
    config = bert_base_config()
    torch.manual_seed(0)
    model = shard(build_model(config, device="cpu").to(device), init_device_mesh("cuda", (dist.get_world_size(),)))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, foreach=True)

    def step(batch, tokens):
        input_ids = torch.randint(0, config.vocab_size, (batch, tokens), device=device)
        labels = torch.randint(0, 2, (batch,), device=device)
        nn.functional.cross_entropy(model(input_ids), labels).backward()
        optimizer.step()
        optimizer.zero_grad()

    step(1, 8)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    step(batch_size, seq_len)
    torch.cuda.synchronize(device)
    peaks = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, torch.cuda.max_memory_allocated(device))
    if dist.get_rank() == 0:
        print(json.dumps({"backend": dist.get_backend(), "peaks": peaks}), flush=True)
    distributed.leave_process_group(model)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="torchrun -m helpers.memory.cuda_step", description=measure_fsdp_rank.__doc__)
    parser.add_argument("--fsdp", action="store_true", required=True, help="measure one FSDP2 step (the only mode)")
    parser.add_argument("--batch-size", type=int, default=8, help="examples per rank")
    parser.add_argument("--seq-len", type=int, default=512)
    args = parser.parse_args()
    measure_fsdp_rank(args.batch_size, args.seq_len)
