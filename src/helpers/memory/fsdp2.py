"""Predict what each GPU holds in one FSDP2 training step, with PyTorch's FSDPMemTracker on fake tensors.

``FSDPMemTracker`` (helpers.memory.tracker) extends ``MemTracker`` with FSDP's own categories: sharded and
unsharded (all-gathered) weights, sharded and unsharded gradients, the all-gather and reduce-scatter buffers. A
fake process group of N ranks lets one process trace what rank 0 of N holds: collectives return at once, with the
right shapes. The model is built on ``meta`` and sharded there, then given fake storage inside ``FakeTensorMode``;
nothing is allocated.

Like notebook 05's prediction, the traces keep what CUDA keeps: 1-byte dropout masks and the attention kernel of
the GPU (``helpers.memory.gpu_facts.sdpa_kernel``; default the H200's: memory-efficient in fp32, cuDNN in bf16),
on a batch without padding, whose all-ones attention mask transformers drops on real tensors (so none is passed).
To the tracker's bytes each prediction adds the GPU's cuBLAS workspaces (``helpers.memory.gpu_facts.workspaces``).
Unlike notebook 05's single-GPU prediction, this one is not replayed into the caching allocator: it counts the
bytes tensors ask for, not whole blocks, and FSDPMemTracker's module hooks keep each module's input gradients
until all of them have arrived, which a plain step does not. helpers.memory.fsdp2_table stores notebook 08's table.
"""

from __future__ import annotations

import contextlib
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy

from helpers.fsdp import shard
from helpers.memory.categories import FSDP_MEMTRACKER, in_order, in_words
from helpers.memory.gpu_facts import GPUS, GpuModel, amp_precision, workspaces
from helpers.memory.kernels import DTYPES, CudaLikeKernels
from helpers.torch_private import FakeTensorMode, fake_store
from helpers.memory.tracer import build_model
from helpers.memory.tracker import tracking

FSDP2_CATEGORIES = in_order([*FSDP_MEMTRACKER.values(), "workspaces"])
"""The words of an FSDP2 prediction, in ORDER: FSDPMemTracker's kinds, and the GPU's workspaces."""
HOST_RESIDENT = ("Sharded Param", "Sharded Grad", "OptState")  # what CPUOffloadPolicy keeps in host memory
LEVERS = ("none", "mixed precision", "CPU offload", "checkpointing")
_traces: dict[tuple, dict[str, int]] = {}


@contextlib.contextmanager
def fake_process_group(world_size: int):
    """A process group of ``world_size`` ranks that exists only in this process (this one is rank 0), and a
    device mesh over it. The mesh is made here, outside FakeTensorMode: inside, it would fail on ``.tolist()``."""
    if dist.is_initialized():
        raise RuntimeError("fake_process_group: a process group already exists in this process; destroy it first")
    dist.init_process_group("fake", store=fake_store(), rank=0, world_size=world_size)
    try:
        yield init_device_mesh("cpu", (world_size,))
    finally:
        dist.destroy_process_group()


def trace_fsdp(config, batch_size: int, seq_len: int, world_size: int, *, mixed_precision: str | None = None,
               checkpointing: bool = False, gpu: GpuModel = GPUS["H200"], seed: int = 0) -> dict[str, int]:
    """Peak bytes of rank 0 of ``world_size`` over one Adam step, by FSDPMemTracker's own categories.

    ``batch_size`` is the per-rank batch. ``Net`` is sharded as helpers.fsdp.shard does (each BertLayer, then
    the root); ``mixed_precision`` ("bf16" or "fp16") computes in that type (``MixedPrecisionPolicy``; fp32
    weights, gradients reduced in fp32; a GradScaler's few bytes under fp16 are left out). Attention is traced as
    the CUDA SDPA kernel the GPU picks for that type, as in helpers.memory's default; the
    recomputation of ``checkpointing`` runs under the same kernels. A warm-up step on a small batch creates
    Adam's state first. FakeTensorMode's dispatch cache is shared by the whole process, and a 2-layer
    checkpointed model held one more hidden state at its peak when traced with it empty than after another
    trace; it is emptied first, so that a trace does not depend on what the process traced before.
    """
    key = (config.to_json_string(), batch_size, seq_len, world_size, mixed_precision, checkpointing, gpu, seed)
    if key in _traces:
        return _traces[key]
    options = {"mp_policy": MixedPrecisionPolicy(DTYPES[mixed_precision], torch.float32)} if mixed_precision else {}
    generator = torch.Generator().manual_seed(seed)
    FakeTensorMode.cache_clear()
    with fake_process_group(world_size) as mesh:
        model = shard(build_model(config, "sdpa", checkpointing), mesh, **options)
        with FakeTensorMode(allow_non_fake_inputs=True):
            model.to_empty(device="cpu")
            optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, foreach=True)

            def step(size, length):
                input_ids = torch.randint(0, config.vocab_size, (size, length), generator=generator)
                labels = torch.randint(0, 2, (size,), generator=generator)
                with CudaLikeKernels(fused_attention=True, gpu=gpu):
                    loss = nn.functional.cross_entropy(model(input_ids), labels)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()

            step(1, 8)
            # The collector runs during the step, as it always has here: paused, it would leave one more hidden
            # state (B x L x hidden x 4 bytes) alive in cyclic garbage at the peak than the stored table holds.
            with tracking(model, optimizer, pause_gc=False) as watch:
                step(batch_size, seq_len)
    _traces[key] = watch.kinds("peak")
    return _traces[key]


def trace_fsdp_by_layers(config, batch_size: int, seq_len: int, world_size: int, **options) -> dict[str, int]:
    """``trace_fsdp`` of the full model from traces of the model cut to three and four layers.

    Every encoder layer is the same, so from the third layer on each category grows by the same bytes per
    layer (with two layers the peak falls elsewhere; notebook 08 checks the extrapolation against a trace).
    """
    if config.num_hidden_layers <= 4:
        return trace_fsdp(config, batch_size, seq_len, world_size, **options)
    three, four = (trace_fsdp(config.__class__(**(config.to_dict() | {"num_hidden_layers": n})), batch_size,
                              seq_len, world_size, **options) for n in (3, 4))
    return {kind: three[kind] + (config.num_hidden_layers - 3) * (four[kind] - three[kind]) for kind in three}


def fsdp_categories(peak: dict[str, int], offload: bool = False, held: int = 0) -> dict[str, int]:
    """A trace (FSDPMemTracker's kinds) in our words, with ``held`` bytes of workspaces, plus 'total'. ``offload``
    leaves out what CPUOffloadPolicy keeps in host memory (sharded weights, sharded gradients, Adam's state), a
    prediction by subtraction, not a trace."""
    kept = {kind: nbytes for kind, nbytes in peak.items() if not (offload and kind in HOST_RESIDENT)}
    return in_words(kept, FSDP_MEMTRACKER, workspaces=held)


def predict_fsdp(config, batch_size: int, seq_len: int, gpus: int, lever: str = "none", *,
                 gpu: GpuModel = GPUS["H200"], environ: dict[str, str] | None = None,
                 precision: str | None = None) -> dict[str, int]:
    """Rank 0's predicted peak bytes by category, for FSDP over ``gpus`` with a per-rank batch of ``batch_size``,
    on ``gpu`` (its attention kernel, and its workspaces under ``environ``; default: this process's environment,
    as for ``helpers.memory.predict_step``). The "mixed precision" lever computes in ``precision`` ("bf16" or
    "fp16"; default: the GPU's own, ``helpers.memory.gpu_facts.mixed_precision``)."""
    if lever not in LEVERS:
        raise ValueError(f"lever={lever!r}: expected one of {LEVERS}")
    precision = amp_precision(gpu, precision or True)
    options = {"mixed_precision": precision if lever == "mixed precision" else None,
               "checkpointing": lever == "checkpointing", "gpu": gpu}
    held = sum(workspaces(gpu.capability, os.environ if environ is None else environ).values())
    return fsdp_categories(trace_fsdp_by_layers(config, batch_size, seq_len, gpus, **options),
                           offload=lever == "CPU offload", held=held)
