"""Trace the memory of one fine-tuning step, on fake tensors or real ones.

Under ``FakeTensorMode`` tensors have shapes but no data, so a BERT-base step is traced on a laptop in a second
or two without allocating its gigabytes; tensors on PyTorch's ``meta`` device have shapes too, run the same ATen
operators (FakeTensorMode computes its shapes with their meta kernels) and cost several times less, so a step
replayed into a simulated GPU runs on ``meta`` (tests compare the two event by event). Two ways to count, both
resting on private PyTorch code (helpers.torch_private):

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
from dataclasses import dataclass, field

import torch
from torch import nn

from helpers.memory.gpu_facts import GPUS, GpuModel
from helpers.memory.kernels import CudaLikeKernels
from helpers.memory.simulated_gpu import SimulatedGpu
from helpers.torch_private import FakeTensorMode, supports_sdpa
from helpers.memory.tracker import tracking
from helpers.net import Net
from helpers.step import train_step

ATTENTION_KERNELS = ("sdpa", "eager")
OPTIMIZER_IMPLS = {"foreach": {"foreach": True}, "fused": {"fused": True}, "for-loop": {"foreach": False}}
"""How Adam runs its update, as the arguments of its construction: foreach (torch's default on CUDA since 2.0: a
few kernels over lists of tensors, with parameter-sized temporaries), fused (one kernel, no temporaries, its step
counts on the GPU) or for-loop (one tensor at a time, torch 1.x's only implementation)."""


class NetFromConfig(Net):
    """The memo's ``Net`` with a randomly initialised body built from a config: same modules, no download."""

    def __init__(self, config, num_labels: int = 2):
        nn.Module.__init__(self)  # Net.__init__ would load pretrained weights; the memory is the same
        from transformers import BertModel

        self.bert = BertModel(config)
        self.linear = nn.Linear(config.hidden_size, num_labels)

    @property
    def encoder(self) -> nn.Module:
        return self.bert


class ClassifierFromConfig(nn.Module):
    """transformers' sequence-classification model of any other encoder, randomly initialised from its config
    (``AutoModelForSequenceClassification.from_config``, its ``num_labels``); ``forward`` returns the logits."""

    def __init__(self, config):
        super().__init__()
        from transformers import AutoModelForSequenceClassification, PreTrainedModel

        self.encoder = AutoModelForSequenceClassification.from_config(config)
        for module in self.encoder.modules():  # the check reads two token ids on the host (.item()), which meta
            if isinstance(module, PreTrainedModel):  # tensors have not: the same tensors, without reading them
                module.warn_if_padding_and_no_attention_mask = _padding_check_without_reading(config.pad_token_id)

    def forward(self, input_ids, attention_mask=None):
        return self.encoder(input_ids=input_ids, attention_mask=attention_mask).logits


def _padding_check_without_reading(pad_token_id):
    """transformers' ``warn_if_padding_and_no_attention_mask``, which a model without a mask calls on its ids: the
    same comparison on the GPU, without reading its answer (a warning), so that meta tensors trace it."""
    def check(input_ids, attention_mask):
        if attention_mask is None and pad_token_id is not None:
            (input_ids[:, [-1, 0]] == pad_token_id).any()
    return check


@dataclass(frozen=True)
class StepMemory:
    """Bytes of one training step by category, at three moments, on one device."""

    after_forward: dict[str, int]   # what is held when backward starts: the activations saved for it
    backward_peak: dict[str, int]   # the highest point of forward + backward
    optimizer_peak: dict[str, int]  # the highest point of optimizer.step()
    requested_peak: int | None = None  # on a simulated GPU: the highest requested bytes of the step, which
    #                                     memory_stats()["requested_bytes.all.peak"] reports
    reserved_peak: int | None = None  # on a simulated GPU: the segments reserved by the end of the step, its peak
    #                                   (memory_stats()["reserved_bytes.all.peak"]: nothing empties the cache)
    log: list | None = field(default=None, compare=False, repr=False)  # the simulated GPU's events

    @property
    def peak(self) -> dict[str, int]:
        return max(self.backward_peak, self.optimizer_peak, key=lambda snap: snap["total"])


def trace_step(model: nn.Module, batch_size: int, seq_len: int, **options) -> StepMemory:
    """``trace_steps`` with one batch size: one Adam step of ``model`` after a warm-up."""
    return trace_steps(model, (batch_size,), seq_len, **options)[0]


def trace_steps(model: nn.Module, batch_sizes: tuple[int, ...], seq_len: int, *, vocab_size: int,
                accumulation: int = 1, cuda_dropout: bool = True, fused_attention: bool = False,
                amp_dtype: torch.dtype | None = None, seed: int = 0, device: SimulatedGpu | None = None,
                gpu: GpuModel = GPUS["H200"], optimizer_impl: str = "foreach",
                set_to_none: bool = True) -> list[StepMemory]:
    """Run one Adam step of ``model`` under MemTracker, after a warm-up that creates Adam's state, for each of
    ``batch_sizes``: the step training takes (``helpers.step.train_step``), each of its parts filed under the category
    of what it makes. Each step after the first starts from what the warm-up left (the step before leaves the model,
    Adam and the scaler as the warm-up did), so one warm-up serves several batch sizes. On a ``device``, each step's
    log is the warm-up's events followed by its own, as if it had been traced alone (tests compare the two).

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

    ``optimizer_impl`` (one of ``OPTIMIZER_IMPLS``) says how Adam is built; ``set_to_none`` is what
    ``optimizer.zero_grad`` is called with: True frees the gradients (torch 2.x's default), False zeroes them in place
    and keeps them through the next step's forward and backward (torch 1.x's default).
    """
    for batch_size in batch_sizes:
        if batch_size % accumulation:
            raise ValueError(f"batch_size={batch_size} is not a multiple of accumulation={accumulation}")
    if optimizer_impl not in OPTIMIZER_IMPLS:
        raise ValueError(f"optimizer_impl={optimizer_impl!r}: expected one of {', '.join(OPTIMIZER_IMPLS)}")
    model.train()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, **OPTIMIZER_IMPLS[optimizer_impl])
    generator = torch.Generator().manual_seed(seed)
    kernels = CudaLikeKernels(cuda_dropout, fused_attention, amp_dtype, gpu)
    scaler = torch.amp.GradScaler("cpu") if amp_dtype == torch.float16 else None  # fake tensors live on the CPU
    watch = _DeviceWatch(device, model) if device else _TrackerWatch(model, optimizer)

    def batch(size, length):
        with watch.phase("batch"):
            return {"input_ids": _random_ids(vocab_size, (size, length), generator, model),
                    "labels": _random_ids(2, (size,), generator, model)}

    def step(micro_batches: list[dict], phases: _StepPhases) -> None:
        train_step(model, micro_batches, optimizer, scaler=scaler, set_to_none=set_to_none, phase=phases,
                   host_reads=False)

    # Warm-up on a small batch: Adam creates its two moments at the first step, for the parameters that got
    # a gradient (not the pooler, which Net's loss does not use).
    step([batch(1, 8)], _StepPhases(watch, kernels))
    watch.warmed_up()
    steps = []
    for batch_size in batch_sizes:
        watch.restart()
        micro_batch, phases = batch(batch_size // accumulation, seq_len), _StepPhases(watch, kernels)
        with phases.measuring():
            step([micro_batch] * accumulation, phases)
        steps.append(watch.result(phases.after_forward, phases.peaks["micro-batches"]))
        del micro_batch
    return steps


def memory_of_log(gpu: GpuModel, log: list) -> StepMemory:
    """The ``StepMemory`` a simulated GPU's log (``SimulatedGpu.log``) gives when it runs on a fresh ``gpu``."""
    device = SimulatedGpu.run(gpu, log)
    readings = device.readings
    return StepMemory(readings["after_forward"], readings["backward_peak"], readings["optimizer_peak"],
                      device.allocator.peak_requested, device.allocator.reserved, log)


def _random_ids(high: int, shape: tuple[int, ...], generator: torch.Generator, model: nn.Module) -> torch.Tensor:
    """Random ids below ``high`` on the device of ``model``'s weights; on ``meta``, where there are no values, a tensor
    of the same shape and dtype."""
    if next(model.parameters()).device.type == "meta":
        return torch.empty(shape, dtype=torch.long, device="meta")
    return torch.randint(0, high, shape, generator=generator)


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

    def warmed_up(self) -> None:
        pass

    def restart(self) -> None:
        pass  # step() starts a fresh tracker

    def result(self, after_forward, backward_peak) -> StepMemory:
        return StepMemory(after_forward, backward_peak, self.peak)

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
        self.warm_up, self.start = 0, 0  # where the warm-up's events end, and the step's begin, in the device's log
        for parameter in model.parameters():
            parameter.register_post_accumulate_grad_hook(lambda p: device.gradient(p.grad))

    @contextlib.contextmanager
    def phase(self, name, backward=False):
        device = self.device
        before = device.phase, device.backward
        device.enter(name, backward)
        try:
            with device.replay():
                yield
        finally:
            device.enter(*before)

    def now(self) -> dict[str, int]:
        return self.device.read("after_forward")

    def warmed_up(self) -> None:
        self.warm_up = len(self.device.log)

    def restart(self) -> None:
        """The next ``step()`` starts as the first after the warm-up does."""
        self.peak, self.start = None, len(self.device.log)
        self.device.readings.clear()

    def result(self, after_forward, backward_peak) -> StepMemory:
        """The step since ``restart()``: its readings, and the warm-up's events with its own."""
        log = self.device.log[:self.warm_up] + self.device.log[self.start:]
        if self.start == self.warm_up:
            allocator = self.device.allocator
            return StepMemory(after_forward, backward_peak, self.peak, allocator.peak_requested, allocator.reserved,
                              log)
        return memory_of_log(self.device.gpu, log)

    @contextlib.contextmanager
    def step(self):
        if self.peak is None:
            self.device.reset_peaks()
            gc.collect()  # garbage freed in mid-step would free blocks at an arbitrary point
        self.device.watch()
        with _no_automatic_collection():
            yield
        self.peak = self.device.keep_peak("optimizer_peak" if "backward_peak" in self.device.readings
                                          else "backward_peak")


def build_model(config, attention: str = "sdpa", checkpointing: bool = False, device: str = "meta",
                num_labels: int | None = None) -> nn.Module:
    """The model of ``config`` with the attention code path and checkpointing set; on ``meta`` it has shapes only.

    A BERT config gives ``NetFromConfig`` (the project's ``Net``, which helpers.finetune trains: BERT with its pooler
    and a linear head on [CLS], ``num_labels`` outputs, default 2); any other encoder gives ``ClassifierFromConfig``
    (transformers' own head, the config's ``num_labels`` unless ``num_labels`` is given).

    ``attention="sdpa"`` (transformers' default) calls ``scaled_dot_product_attention``, traced as the kernel
    the GPU picks (``helpers.memory.gpu_facts.sdpa_kernel``); ``"eager"`` (the memo's era) computes softmax(QK^T)
    in Python and keeps the probabilities for backward. ``checkpointing`` recomputes each encoder layer's forward during
    backward instead of keeping it; the recomputation runs under the ``CudaLikeKernels`` settings the forward
    ran under (``CudaLikeKernels.for_recomputation``), so that it saves what the forward saved.
    """
    if attention not in ATTENTION_KERNELS:
        raise ValueError(f"attention={attention!r}: expected one of {ATTENTION_KERNELS}")
    settings = {"attn_implementation": attention} | ({"num_labels": num_labels} if num_labels else {})
    config = config.__class__(**(config.to_dict() | settings))
    with torch.device(device):
        model = (NetFromConfig(config, num_labels or 2) if config.model_type == "bert"
                 else ClassifierFromConfig(config))
    if checkpointing:
        def contexts():  # called at each checkpointed layer's forward; the second runs its recomputation
            return contextlib.nullcontext(), _recomputation(CudaLikeKernels.for_recomputation(),
                                                            SimulatedGpu.replaying[-1:])

        model.encoder.activation_checkpointing_enable({"use_reentrant": False, "context_fn": contexts})
    return model


def classifier_class(config) -> type | None:
    """transformers' sequence-classification class for ``config``'s model type, or None where it has none."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING

    return MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING.get(type(config), None)


def default_attention(config) -> str:
    """The attention transformers picks for ``config``'s model by default: sdpa where the model implements it
    (BERT, RoBERTa, DistilBERT, ModernBERT), else eager (DeBERTa-v2)."""
    if config.model_type == "bert":
        return "sdpa"
    model = classifier_class(config)
    return "sdpa" if model is not None and supports_sdpa(model) else "eager"


@contextlib.contextmanager
def _recomputation(kernels, devices):
    with kernels, contextlib.ExitStack() as stack:
        for device in devices:
            stack.enter_context(device.recomputation())
        yield


def trace_fake(config, batch_size: int, seq_len: int, **options) -> StepMemory:
    """``trace_fake_steps`` of one batch size."""
    return trace_fake_steps(config, (batch_size,), seq_len, **options)[0]


def trace_fake_steps(config, batch_sizes: tuple[int, ...], seq_len: int, *, attention: str = "sdpa",
                     checkpointing: bool = False, cuda_dropout: bool = True, amp_dtype: torch.dtype | None = None,
                     gpu: GpuModel | None = None, environ: dict[str, str] | None = None, num_labels: int | None = None,
                     optimizer_impl: str = "foreach", fake: bool = False, **options) -> list[StepMemory]:
    """``trace_steps`` without real memory: the model is built on ``meta`` and given storage there.

    With a ``gpu``, attention is traced as the kernel that GPU picks and the step is replayed into its simulated
    allocator (``SimulatedGpu``, workspaces from ``environ``), on meta tensors; fused Adam, which refuses them, and
    PyTorch's MemTracker (no ``gpu``) run on fake ones (``FakeTensorMode``, the storage fake CPU tensors; ``fake``:
    those for a simulated GPU too, as tests compare). The
    garbage collector is paused for the whole trace, so that what it frees, and when, does not depend on what the
    process did before; objects older than the trace are left out of its collections (``gc.freeze``), which keeps
    them cheap."""
    model = build_model(config, attention, checkpointing, num_labels=num_labels)
    step = dict(vocab_size=config.vocab_size, cuda_dropout=cuda_dropout, fused_attention=attention == "sdpa",
                amp_dtype=amp_dtype, gpu=gpu or GPUS["H200"], optimizer_impl=optimizer_impl, **options)
    with _collector_paused():
        if gpu and optimizer_impl != "fused" and not fake:
            device = SimulatedGpu(gpu, environ)
            with device.replay():  # the weights
                model.to_empty(device="meta")
            return trace_steps(model, batch_sizes, seq_len, device=device, **step)
        device = SimulatedGpu(gpu, environ, step_counts_on_gpu=optimizer_impl == "fused") if gpu else None
        with FakeTensorMode(allow_non_fake_inputs=True):
            with device.replay() if device else contextlib.nullcontext():  # the weights
                model.to_empty(device="cpu")
            return trace_steps(model, batch_sizes, seq_len, device=device, **step)


@contextlib.contextmanager
def _no_automatic_collection():
    """The garbage collector switched off inside, and back on after if it was on."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@contextlib.contextmanager
def _collector_paused():
    """No automatic collection inside; objects made before are frozen (left out of collections) unless something
    froze objects already."""
    freeze = gc.get_freeze_count() == 0
    if freeze:
        gc.freeze()
    try:
        with _no_automatic_collection():
            yield
    finally:
        if freeze:
            gc.unfreeze()
