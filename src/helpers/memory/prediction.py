"""Predict what each GPU holds during one fine-tuning step: one device, DataParallel, DDP, FSDP2, and the levers;
and the largest batch that fits.

The prediction traces the step on fake tensors and replays it into a simulated GPU
(``helpers.memory.simulated_gpu``): PyTorch's caching allocator with the GPU's cuBLAS workspaces and kernel
buffers. Each GPU's figure is the moment its allocated bytes are highest (what ``torch.cuda.max_memory_allocated``
reports), split by category. Checked against 24 settings measured on an H200 (tests/test_memory.py).
"""

from __future__ import annotations

import os

import torch

from helpers.levers import amp_dtype
from helpers.memory.cuda_step import this_gpu
from helpers.memory.formulas import parameter_bytes
from helpers.memory.fsdp2 import predict_fsdp
from helpers.memory.gpu_facts import GPUS, GpuModel, amp_precision
from helpers.memory.kernels import DTYPES
from helpers.torch_private import FakeTensorMode
from helpers.memory.tracer import StepMemory, build_model, trace_fake, trace_step

PREDICTED_STRATEGIES = ("single", "dataparallel", "ddp", "fsdp2")
FITS = 0.9  # a peak "fits" when it is at most this share of the GPU's memory: the CUDA context (several hundred
#             MiB) and the allocator's cached, unused blocks take the rest
_steps: dict[tuple, StepMemory] = {}


def default_gpu() -> GpuModel:
    """This machine's GPU 0 (with the attention kernels it picks) when there is one, else the H200 the series was
    measured on."""
    return this_gpu(0) if torch.cuda.is_available() else GPUS["H200"]


def predict_step(config, batch_size: int, seq_len: int, *, gpu: GpuModel | None = None,
                 environ: dict[str, str] | None = None, attention: str = "sdpa", checkpointing: bool = False,
                 amp: bool | str | None = None, accumulation: int = 1) -> StepMemory:
    """One device's step with ``batch_size`` examples (``accumulation`` micro-batches), traced and replayed into a
    simulated ``gpu`` (default: ``default_gpu()``) whose workspaces follow ``environ`` (default: this process's
    environment). ``amp``: None for fp32, "bf16" or "fp16" (``--amp``), or True for the mixed precision ``gpu``
    supports (``helpers.memory.gpu_facts.mixed_precision``); bf16 is refused on a GPU without it, as
    helpers.finetune refuses it. Results are kept, so a question asked twice costs nothing."""
    gpu = gpu or default_gpu()
    precision = amp_precision(gpu, amp)
    environ = dict(os.environ if environ is None else environ)
    relevant = tuple(sorted((k, v) for k, v in environ.items() if "CUBLAS" in k))
    key = (config.to_json_string(), batch_size, seq_len, gpu, relevant, attention, checkpointing, precision,
           accumulation)
    if key not in _steps:
        _steps[key] = trace_fake(config, batch_size, seq_len, attention=attention, checkpointing=checkpointing,
                                 amp_dtype=None if precision == "fp32" else DTYPES[precision],
                                 accumulation=accumulation, gpu=gpu, environ=environ)
    return _steps[key]


def per_device(config, batch_size: int, seq_len: int, *, strategy: str = "single", gpus: int = 1,
               accumulation: int = 1, checkpointing: bool = False, amp: bool | str | None = None,
               attention: str = "sdpa",
               gradient_as_bucket_view: bool = False, gpu: GpuModel | None = None,
               environ: dict[str, str] | None = None) -> list[dict[str, int]]:
    """Peak bytes per GPU of one step with global batch ``batch_size``, by category, one dict per GPU.

    - single: the traced step on one GPU.
    - dataparallel: GPU 0 runs the master model on its B/N share, so it holds what one device holds at B/N
      (weights, gradients reduced onto it, Adam state); every other GPU holds a fresh replica of the weights,
      the activations of its B/N share and, at the end of backward, the replica's gradients, but no Adam state
      and, with accumulation, none of the earlier micro-batches' gradients (they were added into GPU 0's ``.grad``).
      A model of DataParallel's mechanics, not a trace of it.
    - ddp: every GPU runs a full copy at B/N with its own Adam state, plus gradient buckets of the size of the
      parameters DDP reduces (all but the pooler, which the project drops for DDP: ``Net(pooler=False)``); with
      ``gradient_as_bucket_view`` the gradients live in the buckets.
    - fsdp2: ``helpers.memory.fsdp2.predict_fsdp`` (FSDPMemTracker on a fake process group), one lever at a time.
    - amp (``predict_step``'s): CUDA autocast's rules (``helpers.memory.kernels.CudaLikeKernels``): weights,
      gradients and Adam state stay fp32; linear layers and attention save 16-bit tensors and 16-bit copies of
      their weights, while softmax, layer_norm and the loss keep fp32. fp16 holds what bf16 holds, byte for byte,
      plus the GradScaler's few tensors; where the two differ, it is by the attention kernel the GPU picks.
    """
    if strategy not in PREDICTED_STRATEGIES:
        raise ValueError(f"strategy={strategy!r}: expected one of {PREDICTED_STRATEGIES}")
    gpus = 1 if strategy == "single" else gpus
    if batch_size % gpus:
        raise ValueError(f"batch_size={batch_size} does not split evenly over gpus={gpus}")
    gpu = gpu or default_gpu()
    amp = amp_precision(gpu, amp)
    if strategy == "fsdp2":
        return _fsdp2(config, batch_size // gpus, seq_len, gpus, accumulation, checkpointing, amp, attention, gpu,
                      environ)
    step = predict_step(config, batch_size // gpus, seq_len, gpu=gpu, environ=environ, attention=attention,
                        checkpointing=checkpointing, amp=amp, accumulation=accumulation)
    peak = _parts(step.peak)
    if strategy == "single":
        return [_total(peak)]
    if strategy == "dataparallel":
        backward = _parts(step.backward_peak)
        replica_compute = backward | {"optimizer": 0}
        if accumulation > 1:  # earlier micro-batches' gradients went into GPU 0's .grad: a replica holds none of them
            replica_compute["gradients"] = max(0, backward["gradients"] - step.optimizer_peak["gradients"])
        replica_grads = dict.fromkeys(backward, 0) | {"weights": backward["weights"], "workspaces": backward["workspaces"],
                                                      "gradients": step.optimizer_peak["gradients"]}
        replica = max(replica_compute, replica_grads, key=lambda parts: sum(parts.values()))
        return [_total(peak)] + [_total(replica) for _ in range(gpus - 1)]
    rank = peak | {"buckets": parameter_bytes(config, pooler=False)}  # Net(pooler=False): DDP needs every gradient
    if gradient_as_bucket_view:
        rank["gradients"] = 0
    return [_total(rank) for _ in range(gpus)]


def _fsdp2(config, per_rank, seq_len, gpus, accumulation, checkpointing, precision, attention, gpu, environ):
    mixed = precision != "fp32"
    if accumulation != 1 or attention != "sdpa" or (mixed and checkpointing):
        raise ValueError("strategy='fsdp2' predicts sdpa attention with at most one lever (amp or checkpointing), "
                         "without accumulation")
    lever = "mixed precision" if mixed else "checkpointing" if checkpointing else "none"
    rank = predict_fsdp(config, per_rank, seq_len, gpus, lever, gpu=gpu, environ=environ,
                        **({"precision": precision} if mixed else {}))
    return [dict(rank) for _ in range(gpus)]


def _parts(snapshot: dict[str, int]) -> dict[str, int]:
    return {key: value for key, value in snapshot.items() if key != "total"}


def _total(parts: dict[str, int]) -> dict[str, int]:
    return parts | {"total": sum(parts.values())}


def peak_per_gpu(config, batch_size: int, seq_len: int, **options) -> int:
    """The highest predicted peak over the GPUs of a setting (``per_device``'s options)."""
    return max(device["total"] for device in per_device(config, batch_size, seq_len, **options))


def largest_batch(config, seq_len: int, capacity: int, *, known: int | None = None, **options) -> int:
    """The largest global batch (a multiple of gpus x accumulation) whose predicted peak fits FITS x ``capacity``
    on every GPU, or 0. What grows with the batch (activations, temporaries, buffers) grows almost linearly, so
    the batch ``known`` (already predicted; default 2 micro-batches per GPU) gives a first guess, and a few
    traces around it settle the boundary. The allocator's blocks make the peak a little uneven (a few MiB up or
    down from one batch to the next), so each guess aims just past where the line through the last two traces
    crosses the limit, further each time it lands on the same side, and halves the interval where that leaves it;
    the answer is a batch that fits next to one that does not."""
    gpus = options.get("gpus", 1) if options.get("strategy", "single") != "single" else 1
    unit = gpus * options.get("accumulation", 1)
    limit = FITS * capacity
    traced: dict[int, int] = {}

    def peak(count: int) -> int:  # count micro-batches of ``unit`` examples
        if count not in traced:
            traced[count] = peak_per_gpu(config, count * unit, seq_len, **options)
        return traced[count]

    count = max(1, (known or 2 * unit) // unit)
    device = max(per_device(config, count * unit, seq_len, **options), key=lambda d: d["total"])
    fixed = sum(device.get(name, 0) for name in ("weights", "gradients", "optimizer", "workspaces", "buckets"))
    slope = max(device["total"] - fixed, 1) / count
    fits, fails = 0, None  # the largest count known to fit, the smallest known not to
    count = max(1, int((limit - fixed) // slope))
    last, side, past = None, None, 1  # the count traced before; whether it fitted; how far past the line to aim
    while fails is None or fails > fits + 1:
        fitted = peak(count) <= limit
        if fitted:
            fits = max(fits, count)
        else:
            fails = count if fails is None else min(fails, count)
        if fails == 1:
            return 0
        past = 2 * past if fitted == side else 1  # landing on the same side again: aim further past
        if last is not None and last != count and peak(last) != peak(count):  # the line through the last two
            slope = (peak(count) - peak(last)) / (count - last)
        crossing = count + int((limit - peak(count)) // max(slope, 1))
        guess = crossing + past if fitted else crossing - past  # just past the line, so as to bracket the limit
        if fails is not None and not fits < guess < fails:
            guess = (fits + fails) // 2
        last, side, count = count, fitted, max(fits + 1, guess)
        if count in traced:
            count = (fits + fails) // 2 if fails else count + 1
    return fits * unit


def predict_cpu_step(config, batch_size: int, seq_len: int, *, accumulation: int = 1, checkpointing: bool = False,
                     amp: str | None = None) -> dict[str, int]:
    """The peak bytes by category of one step on the CPU, traced on fake tensors with MemTracker: ``Net`` as
    helpers.finetune builds it (no pooler), float dropout masks, and the attention PyTorch computes there (in
    training, with dropout, step by step, keeping its probabilities). ``amp`` as helpers.finetune's ``--amp``.
    helpers.lever_memory tracks the same step for real."""
    config = config.__class__(**(config.to_dict() | {"use_cache": False}))  # as enable_checkpointing sets it
    model = build_model(config, "sdpa", checkpointing)
    model.bert.pooler = None  # as Net(pooler=False), which helpers.finetune trains
    with FakeTensorMode(allow_non_fake_inputs=True):
        model.to_empty(device="cpu")
        trace = trace_step(model, batch_size, seq_len, vocab_size=config.vocab_size, accumulation=accumulation,
                           cuda_dropout=False, fused_attention=False, amp_dtype=amp_dtype(amp))
    return trace.peak
