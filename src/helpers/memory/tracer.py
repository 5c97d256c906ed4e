"""Trace the memory of one fine-tuning step, on fake tensors or real ones.

Under ``FakeTensorMode`` tensors have shapes but no data, so a BERT-base step is traced on a laptop in a second
or two without allocating its gigabytes. Two ways to count, both resting on private PyTorch code
(helpers.torch_private):

- PyTorch's own tracker, ``MemTracker`` (helpers.memory.tracker): it files every tensor under parameters,
  gradients, optimizer state, activations or temporaries and reports the peak of the bytes tensors ask for. It
  runs on real tensors too, so tests check it against the profiler and real runs.
- a simulated GPU (``helpers.memory.simulated_gpu``): the same step replayed into PyTorch's caching allocator
  with the GPU's workspaces and kernel buffers, giving the peak that ``torch.cuda.max_memory_allocated``
  reports. This is the prediction notebook 05's appendix checks against a real GPU.

``CudaLikeKernels`` (helpers.memory.kernels) makes either keep what a CUDA step keeps (1-byte dropout masks, the
GPU's attention kernel, autocast's dtypes).
"""

from __future__ import annotations

import contextlib
import gc
from dataclasses import dataclass

import torch
from torch import nn

from helpers.memory.gpu_facts import GPUS, GpuModel
from helpers.memory.kernels import CudaLikeKernels
from helpers.memory.simulated_gpu import SimulatedGpu
from helpers.torch_private import FakeTensorMode
from helpers.memory.tracker import tracking
from helpers.net import Net
from helpers.step import train_step

ATTENTION_KERNELS = ("sdpa", "eager")


class NetFromConfig(Net):
    """The memo's ``Net`` with a randomly initialised body built from a config: same modules, no download."""

    def __init__(self, config, num_labels: int = 2):
        nn.Module.__init__(self)  # Net.__init__ would load pretrained weights; the memory is the same
        from transformers import BertModel

        self.bert = BertModel(config)
        self.linear = nn.Linear(config.hidden_size, num_labels)


@dataclass(frozen=True)
class StepMemory:
    """Bytes of one training step by category, at three moments, on one device."""

    after_forward: dict[str, int]   # what is held when backward starts: the activations saved for it
    backward_peak: dict[str, int]   # the highest point of forward + backward
    optimizer_peak: dict[str, int]  # the highest point of optimizer.step()
    requested_peak: int | None = None  # on a simulated GPU: the highest requested bytes of the step, which
    #                                     memory_stats()["requested_bytes.all.peak"] reports

    @property
    def peak(self) -> dict[str, int]:
        return max(self.backward_peak, self.optimizer_peak, key=lambda snap: snap["total"])


def trace_step(model: nn.Module, batch_size: int, seq_len: int, *, vocab_size: int, accumulation: int = 1,
               cuda_dropout: bool = True, fused_attention: bool = False, amp_dtype: torch.dtype | None = None,
               seed: int = 0, device: SimulatedGpu | None = None,
               gpu: GpuModel = GPUS["H200"]) -> StepMemory:
    """Run one Adam step of ``model`` under MemTracker, after a warm-up that creates Adam's state: the step training
    takes (``helpers.step.train_step``), each of its parts filed under the category of what it makes.

    Works on real tensors and, inside ``FakeTensorMode``, on fake ones. ``accumulation`` micro-batches of
    ``batch_size // accumulation`` examples each add their gradients before the single optimizer step.
    The batch has no padding: its attention mask is all ones, which transformers drops before attention on
    real tensors, so none is passed (fake tensors hide the values, and transformers would keep the mask).
    With ``amp_dtype`` the forward and the loss run under (emulated) CUDA autocast, backward outside it; the
    attention kernel is the one ``gpu`` picks. In fp16, a ``torch.amp.GradScaler`` scales each loss and unscales the
    gradients once before the optimizer step, as ``--amp fp16`` trains: its tensors (the scale, the growth
    tracker, the scaled loss, the inverse scale and found_inf with their per-device copies) are traced with the
    optimizer's state. ``scaler.step`` would also read found_inf on the host (``.item()``), which a fake tensor
    cannot and which allocates nothing on the GPU, so the step reads no value (``host_reads=False``): ``unscale_``,
    ``optimizer.step``, ``update``.

    With a ``device`` (a ``SimulatedGpu`` that has seen the model made), the step is replayed into it instead of
    MemTracker, and each peak is the moment its allocated bytes (``max_memory_allocated``) are highest.
    """
    if batch_size % accumulation:
        raise ValueError(f"batch_size={batch_size} is not a multiple of accumulation={accumulation}")
    model.train()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, foreach=True)  # CUDA's default implementation
    generator = torch.Generator().manual_seed(seed)
    kernels = CudaLikeKernels(cuda_dropout, fused_attention, amp_dtype, gpu)
    scaler = torch.amp.GradScaler("cpu") if amp_dtype == torch.float16 else None  # fake tensors live on the CPU
    watch = _DeviceWatch(device, model) if device else _TrackerWatch(model, optimizer)
    phases = _StepPhases(watch, kernels)

    def batch(size, length):
        with watch.phase("batch"):
            return {"input_ids": torch.randint(0, vocab_size, (size, length), generator=generator),
                    "labels": torch.randint(0, 2, (size,), generator=generator)}

    # Warm-up on a small batch: Adam creates its two moments at the first step, for the parameters that got
    # a gradient (not the pooler, which Net's loss does not use).
    train_step(model, [batch(1, 8)], optimizer, scaler=scaler, phase=phases, host_reads=False)
    micro_batch = batch(batch_size // accumulation, seq_len)
    with phases.measuring():
        train_step(model, [micro_batch] * accumulation, optimizer, scaler=scaler, phase=phases, host_reads=False)
    return StepMemory(phases.after_forward, phases.peaks["micro-batches"], phases.peaks["update"],
                      device.allocator.peak_requested if device else None)


class _StepPhases:
    """train_step's parts as trace_step sees them: each under the category of what it makes, the forward under
    CUDA-like kernels (which emulate CUDA's autocast, so train_step's own stays off). While ``measuring``, the
    micro-batches and the update are traced as two parts with a peak each, and what is held when the first backward
    starts is kept (``after_forward``)."""

    CATEGORIES = {"forward": "activations", "scale": "scaler", "backward": "temporaries", "unscale": "scaler",
                  "optimizer": "optimizer", "update": "scaler"}

    def __init__(self, watch, kernels: CudaLikeKernels):
        self.watch, self.kernels = watch, kernels
        self.part, self.parts = None, contextlib.ExitStack()  # while measuring: the part traced now
        self.peaks, self.after_forward = {}, None

    @contextlib.contextmanager
    def measuring(self):
        self.part = "start"
        try:
            yield
        finally:
            self.begin(None)

    def begin(self, part: str | None) -> None:
        """End the part traced now (keeping its peak), and trace ``part`` with a fresh watch of its own."""
        if self.part in ("micro-batches", "update"):
            self.parts.close()
            self.peaks[self.part] = self.watch.peak
        self.part = part
        if part is not None:
            self.parts.enter_context(self.watch.step())

    @contextlib.contextmanager
    def __call__(self, name: str):
        if self.part is not None:
            part = "update" if name in ("unscale", "optimizer", "update") else "micro-batches"
            if part != self.part:
                self.begin(part)
            if name == "scale" and self.after_forward is None:
                self.after_forward = self.watch.now()
        with self.watch.phase(self.CATEGORIES[name], backward=name == "backward"):
            with self.kernels if name == "forward" else contextlib.nullcontext():
                yield


class _TrackerWatch:
    """trace_step's view through PyTorch's MemTracker (real or fake tensors, no GPU model): categories at its
    peak, which counts the bytes tensors ask for."""

    def __init__(self, model, optimizer):
        self.model, self.optimizer, self.tracking, self.peak = model, optimizer, None, None

    @contextlib.contextmanager
    def phase(self, name, backward=False):
        yield

    def now(self) -> dict[str, int]:
        return self.tracking.categories("current")

    @contextlib.contextmanager
    def step(self):
        with tracking(self.model, self.optimizer) as self.tracking:  # a fresh tracker for each part: its own peak
            yield
        self.peak = self.tracking.categories("peak")


class _DeviceWatch:
    """trace_step's view through a SimulatedGpu: everything, warm-up included, is replayed into the device;
    a peak is the device's state when its allocated bytes were highest (since the step's start, as
    ``torch.cuda.reset_peak_memory_stats`` before the measured step does)."""

    def __init__(self, device: SimulatedGpu, model):
        self.device, self.peak = device, None
        for parameter in model.parameters():
            parameter.register_post_accumulate_grad_hook(lambda p: device.gradient(p.grad))

    @contextlib.contextmanager
    def phase(self, name, backward=False):
        device = self.device
        before = device.phase, device.backward
        device.phase, device.backward = name, backward
        try:
            with device.replay():
                yield
        finally:
            device.phase, device.backward = before

    def now(self) -> dict[str, int]:
        return self.device.now()

    @contextlib.contextmanager
    def step(self):
        if self.peak is None:
            self.device.allocator.reset_peaks()
            gc.collect()  # garbage freed in mid-step would free blocks at an arbitrary point
        self.device.watch()
        gc.disable()
        try:
            yield
        finally:
            gc.enable()
        self.peak = self.device.peak


def build_model(config, attention: str = "sdpa", checkpointing: bool = False, device: str = "meta") -> NetFromConfig:
    """``NetFromConfig`` with the attention code path and checkpointing set; on ``meta`` it has shapes only.

    ``attention="sdpa"`` (transformers' default) calls ``scaled_dot_product_attention``, traced as the kernel
    the GPU picks (``helpers.memory.gpu_facts.sdpa_kernel``); ``"eager"`` (the memo's era) computes softmax(QK^T)
    in Python and keeps the probabilities for backward. ``checkpointing`` recomputes each encoder layer's forward during
    backward instead of keeping it; the recomputation runs under the ``CudaLikeKernels`` settings the forward
    ran under (``CudaLikeKernels.for_recomputation``), so that it saves what the forward saved.
    """
    if attention not in ATTENTION_KERNELS:
        raise ValueError(f"attention={attention!r}: expected one of {ATTENTION_KERNELS}")
    config = config.__class__(**(config.to_dict() | {"attn_implementation": attention}))
    with torch.device(device):
        model = NetFromConfig(config)
    if checkpointing:
        def contexts():  # called at each checkpointed layer's forward; the second runs its recomputation
            return contextlib.nullcontext(), _recomputation(CudaLikeKernels.for_recomputation(),
                                                            SimulatedGpu.replaying[-1:])

        model.bert.activation_checkpointing_enable({"use_reentrant": False, "context_fn": contexts})
    return model


@contextlib.contextmanager
def _recomputation(kernels, devices):
    with kernels, contextlib.ExitStack() as stack:
        for device in devices:
            stack.enter_context(device.recomputation())
        yield


def trace_fake(config, batch_size: int, seq_len: int, *, attention: str = "sdpa", checkpointing: bool = False,
               cuda_dropout: bool = True, amp_dtype: torch.dtype | None = None, gpu: GpuModel | None = None,
               environ: dict[str, str] | None = None, **options) -> StepMemory:
    """``trace_step`` on fake tensors: the model is built on ``meta`` (no memory) and given fake storage
    with ``to_empty`` inside ``FakeTensorMode``. With a ``gpu``, attention is traced as the kernel that GPU picks
    and the step is replayed into its simulated allocator (``SimulatedGpu``, workspaces from ``environ``)."""
    model = build_model(config, attention, checkpointing)
    device = SimulatedGpu(gpu, environ) if gpu else None
    with FakeTensorMode(allow_non_fake_inputs=True):
        with device.replay() if device else contextlib.nullcontext():  # the weights
            model.to_empty(device="cpu")
        return trace_step(model, batch_size, seq_len, vocab_size=config.vocab_size, cuda_dropout=cuda_dropout,
                          fused_attention=attention == "sdpa", amp_dtype=amp_dtype, device=device,
                          gpu=gpu or GPUS["H200"], **options)
