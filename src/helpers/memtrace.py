"""Trace the memory of one fine-tuning step, on fake tensors or real ones.

Under ``FakeTensorMode`` tensors have shapes but no data, so a BERT-base step is traced on a laptop in a second
or two without allocating its gigabytes. Two ways to count, both private PyTorch or emulation (hence the pinned
torch):

- PyTorch's own tracker, ``torch.distributed._tools.mem_tracker.MemTracker``: it files every tensor under
  parameters, gradients, optimizer state, activations or temporaries and reports the peak of the bytes tensors
  ask for. It runs on real tensors too, so tests check it against the profiler and real runs.
- a simulated GPU (``helpers.simulated_gpu``): the same step replayed into PyTorch's caching allocator with the
  GPU's workspaces and kernel buffers, giving the peak that ``torch.cuda.max_memory_allocated`` reports.
  This is the prediction notebook 05 checks against a real GPU.

``CudaLikeKernels`` makes either keep what a CUDA step keeps (1-byte dropout masks, the GPU's attention kernel,
autocast's dtypes).
"""

from __future__ import annotations

import contextlib
import gc
from dataclasses import dataclass

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from helpers.gpu_facts import GPUS, GpuModel, attention_kernel
from helpers.net import Net
from helpers.simulated_gpu import SimulatedGpu

# MemTracker's categories, in the words the notebook uses.
CATEGORIES = {"Parameter": "weights", "Buffer": "weights", "Gradient": "gradients", "Optstate": "optimizer",
              "Activation": "activations", "Temp": "temporaries", "Other": "temporaries"}
ORDER = ("weights", "gradients", "optimizer", "activations", "temporaries")
ATTENTION_KERNELS = ("sdpa", "eager")


class NetFromConfig(Net):
    """The memo's ``Net`` with a randomly initialised body built from a config: same modules, no download."""

    def __init__(self, config, num_labels: int = 2):
        nn.Module.__init__(self)  # Net.__init__ would load pretrained weights; the memory is the same
        from transformers import BertModel

        self.bert = BertModel(config)
        self.linear = nn.Linear(config.hidden_size, num_labels)


def bert_base_config(num_hidden_layers: int = 12, **overrides):
    """The memo's model, ``bert-base-japanese-whole-word-masking`` (v1): hidden 768, 12 layers, vocab 32000."""
    from transformers import BertConfig

    settings = dict(vocab_size=32000, hidden_size=768, num_hidden_layers=num_hidden_layers, num_attention_heads=12,
                    intermediate_size=3072, max_position_embeddings=512, use_cache=False)
    return BertConfig(**(settings | overrides))


def bundled_config():
    """The bundled tiny model's config (4 layers, hidden 128): small enough to trace on real tensors too."""
    from transformers import BertConfig

    from helpers.models import bundled_model_dir

    return BertConfig.from_pretrained(bundled_model_dir())


# What CUDA autocast does to the functions Net calls (aten/src/ATen/autocast_mode.cpp, KERNEL_CUDA lists):
# linear, matmul and scaled_dot_product_attention run in the low-precision type; layer_norm, softmax,
# log_softmax (inside cross_entropy) run in fp32; everything else (gelu, dropout, add) keeps its input's type.
_LOWER_PRECISION = {nn.functional.linear, torch.matmul, nn.functional.scaled_dot_product_attention}
_FP32 = {nn.functional.layer_norm, nn.functional.softmax, nn.functional.log_softmax, nn.functional.cross_entropy}


class CudaLikeKernels(TorchFunctionMode):
    """Make a CPU trace keep what a CUDA step keeps for backward.

    Dropout: CPU dropout saves a float mask (4 bytes per element), CUDA's fused kernel a 1-byte mask;
    ``torch.native_dropout`` is that fused form. Attention (``fused_attention=True``): route
    ``scaled_dot_product_attention`` to the kernel ``gpu`` picks (``helpers.gpu_facts.attention_kernel``); its meta registration (torch/_meta_registrations.py) gives the exact
    shapes it keeps. Flash, cuDNN and memory-efficient attention all keep the output and one fp32
    log-sum-exp per query (the log of each softmax row's sum, from which backward rebuilds the probabilities),
    never the L x L probabilities. ``amp_dtype``: cast as CUDA autocast does, including its cache of the
    parameters' low-precision copies, which lives until the ``with`` block ends.
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
        return torch.native_dropout(input, p, True)[0] if training and p > 0 else input

    def fused(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **_):
        kernel = attention_kernel(self.gpu, query.dtype in (torch.float16, torch.bfloat16), attn_mask is not None)
        if kernel == "flash":
            return torch.ops.aten._scaled_dot_product_flash_attention(
                query, key, value, dropout_p, is_causal, False, scale=scale)[0]
        if kernel == "cuDNN":
            return torch.ops.aten._scaled_dot_product_cudnn_attention(
                query, key, value, None, True, dropout_p, is_causal, False, scale=scale)[0]
        if attn_mask is not None and attn_mask.dtype == torch.bool:  # as aten's convert_boolean_attn_mask
            bias = torch.zeros(attn_mask.shape, dtype=query.dtype).masked_fill(~attn_mask, float("-inf"))
            attn_mask = bias.expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2])
        return torch.ops.aten._scaled_dot_product_efficient_attention(
            query, key, value, attn_mask, True, dropout_p, is_causal, scale=scale)[0]


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


def tracker_categories(snapshot: dict) -> dict[str, int]:
    """One device's MemTracker snapshot as {category: bytes} in ORDER, plus 'total'."""
    (per_device,) = snapshot.values() if snapshot else ({},)
    result = dict.fromkeys(ORDER, 0)
    for kind, nbytes in per_device.items():
        if kind != "Total":
            result[CATEGORIES[getattr(kind, "value", kind)]] += nbytes
    result["total"] = sum(result[name] for name in ORDER)
    return result


def trace_step(model: nn.Module, batch_size: int, seq_len: int, *, vocab_size: int, accumulation: int = 1,
               cuda_dropout: bool = True, fused_attention: bool = False, amp_dtype: torch.dtype | None = None,
               seed: int = 0, device: SimulatedGpu | None = None,
               gpu: GpuModel = GPUS["H200"]) -> StepMemory:
    """Run one Adam step of ``model`` under MemTracker, after a warm-up that creates Adam's state.

    Works on real tensors and, inside ``FakeTensorMode``, on fake ones. ``accumulation`` micro-batches of
    ``batch_size // accumulation`` examples each add their gradients before the single optimizer step.
    The batch has no padding: its attention mask is all ones, which transformers drops before attention on
    real tensors, so none is passed (fake tensors hide the values, and transformers would keep the mask).
    With ``amp_dtype`` the forward and the loss run under (emulated) CUDA autocast, backward outside it; the
    attention kernel is the one ``gpu`` picks.

    With a ``device`` (a ``SimulatedGpu`` that has seen the model made), the step is replayed into it instead of
    MemTracker, and each peak is the moment its allocated bytes (``max_memory_allocated``) are highest.
    """
    if batch_size % accumulation:
        raise ValueError(f"batch_size={batch_size} is not a multiple of accumulation={accumulation}")
    model.train()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, foreach=True)  # CUDA's default implementation
    generator = torch.Generator().manual_seed(seed)
    kernels = CudaLikeKernels(cuda_dropout, fused_attention, amp_dtype, gpu)
    watch = _DeviceWatch(device, model) if device else _TrackerWatch(model, optimizer)

    def batch(size, length):
        with watch.phase("batch"):
            return (torch.randint(0, vocab_size, (size, length), generator=generator),
                    torch.randint(0, 2, (size,), generator=generator))

    def forward_backward(input_ids, labels, record=False):
        with watch.phase("activations"), kernels:
            loss = nn.functional.cross_entropy(model(input_ids), labels) / accumulation
        after_forward = watch.now() if record else None
        with watch.phase("temporaries", backward=True):
            loss.backward()
        return after_forward

    def optimizer_step():
        with watch.phase("optimizer"):
            optimizer.step()
            optimizer.zero_grad()

    # Warm-up on a small batch: Adam creates its two moments at the first step, for the parameters that got
    # a gradient (not the pooler, which Net's loss does not use).
    forward_backward(*batch(1, 8))
    optimizer_step()
    input_ids, labels = batch(batch_size // accumulation, seq_len)
    with watch.step():
        after_forward = forward_backward(input_ids, labels, record=True)
        for _ in range(accumulation - 1):
            watch.next_micro_batch()
            forward_backward(input_ids, labels)
    backward_peak = watch.peak
    with watch.step():
        optimizer_step()
    return StepMemory(after_forward, backward_peak, watch.peak, device.allocator.peak_requested if device else None)


class _TrackerWatch:
    """trace_step's view through PyTorch's MemTracker (real or fake tensors, no GPU model): categories at its
    peak, which counts the bytes tensors ask for."""

    def __init__(self, model, optimizer):
        self.model, self.optimizer, self.tracker, self.peak = model, optimizer, None, None

    @contextlib.contextmanager
    def phase(self, name, backward=False):
        yield

    def now(self) -> dict[str, int]:
        return tracker_categories(self.tracker.get_tracker_snapshot("current"))

    def next_micro_batch(self) -> None:
        self.tracker.reset_mod_stats()  # MemTracker refuses a second forward of the same modules otherwise

    @contextlib.contextmanager
    def step(self):
        from torch.distributed._tools.mem_tracker import MemTracker

        self.tracker = MemTracker()  # a fresh tracker for each part, so that its peak is that part's own
        self.tracker.track_external(self.model, self.optimizer)
        gc.collect()
        gc.disable()  # a garbage collection in mid-step would free cyclic garbage at an arbitrary point
        try:
            with self.tracker:
                yield
        finally:
            gc.enable()
        self.peak = tracker_categories(self.tracker.get_tracker_snapshot("peak"))


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

    def next_micro_batch(self) -> None:
        pass

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
    the GPU picks (``helpers.gpu_facts.sdpa_kernel``); ``"eager"`` (the memo's era) computes softmax(QK^T) in Python and
    keeps the probabilities for backward. ``checkpointing`` recomputes each encoder layer's forward during
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
    from torch._subclasses.fake_tensor import FakeTensorMode

    model = build_model(config, attention, checkpointing)
    device = SimulatedGpu(gpu, environ) if gpu else None
    with FakeTensorMode(allow_non_fake_inputs=True):
        with device.replay() if device else contextlib.nullcontext():  # the weights
            model.to_empty(device="cpu")
        return trace_step(model, batch_size, seq_len, vocab_size=config.vocab_size, cuda_dropout=cuda_dropout,
                          fused_attention=attention == "sdpa", amp_dtype=amp_dtype, device=device,
                          gpu=gpu or GPUS["H200"], **options)
