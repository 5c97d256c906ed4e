"""Predict what each GPU holds during one fine-tuning step: one device, DataParallel, DDP, FSDP2, and the levers;
what nvidia-smi will show for it; and the largest batch that fits.

The prediction traces the step on meta tensors and replays it into a simulated GPU
(``helpers.memory.simulated_gpu``): PyTorch's caching allocator with the GPU's cuBLAS workspaces and kernel
buffers. Each GPU's figure is the moment its allocated bytes are highest (what ``torch.cuda.max_memory_allocated``
reports), split by category, and the segments the allocator has reserved by then (``memory_reserved``), which with
the CUDA context and NCCL's buffers (``helpers.memory.nvidia_smi``) is what nvidia-smi shows. Checked against 24
settings measured on an H200 and that run's memory snapshot (tests/test_memory.py).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

from helpers.memory import nvidia_smi
from helpers.memory.gpu_facts import GPUS, GpuModel, amp_precision
from helpers.memory.kernels import DTYPES
from helpers.memory.nvidia_smi import Term
from helpers.memory.step_logs import BatchLine, gradient_bytes, replica, reserved, step_memory, with_buckets
from helpers.memory.tracer import StepMemory, build_model, memory_of_log, trace_fake_steps, trace_step
from helpers.torch_private import FakeTensorMode

PREDICTED_STRATEGIES = ("single", "dataparallel", "ddp", "fsdp2")
_steps: dict[tuple, StepMemory] = {}
_shown: dict[tuple, object] = {}


def default_gpu() -> GpuModel:
    """This machine's GPU 0 (with the attention kernels it picks) when there is one, else the H200 the series was
    measured on."""
    if torch.cuda.is_available():
        from helpers.memory.cuda_step import this_gpu

        return this_gpu(0)
    return GPUS["H200"]


def predict_step(config, batch_size: int, seq_len: int, **options) -> StepMemory:
    """One device's step with ``batch_size`` examples (``accumulation`` micro-batches), traced and replayed into a
    simulated ``gpu`` (default: ``default_gpu()``) whose workspaces follow ``environ`` (default: this process's
    environment). ``amp``: None for fp32, "bf16" or "fp16" (``--amp``), or True for the mixed precision ``gpu``
    supports (``helpers.memory.gpu_facts.mixed_precision``); bf16 is refused on a GPU without it, as
    helpers.finetune refuses it. ``optimizer_impl`` and ``set_to_none``: how Adam runs and what ``zero_grad`` is called
    with (``helpers.memory.tracer.trace_steps``). Results are kept, so a question asked twice costs nothing."""
    return predict_steps(config, (batch_size,), seq_len, **options)[0]


def predict_steps(config, batch_sizes: tuple[int, ...], seq_len: int, *, gpu: GpuModel | None = None,
                  environ: dict[str, str] | None = None, attention: str = "sdpa", checkpointing: bool = False,
                  amp: bool | str | None = None, accumulation: int = 1, optimizer_impl: str = "foreach",
                  set_to_none: bool = True, num_labels: int | None = None) -> list[StepMemory]:
    """``predict_step`` for each of ``batch_sizes``; those not traced before are traced together, after one
    warm-up (``helpers.memory.tracer.trace_steps``)."""
    gpu = gpu or default_gpu()
    precision = amp_precision(gpu, amp)
    environ = dict(os.environ if environ is None else environ)
    relevant = tuple(sorted((k, v) for k, v in environ.items() if "CUBLAS" in k))
    keys = {size: (config.to_json_string(), size, seq_len, gpu, relevant, attention, checkpointing, precision,
                   accumulation, optimizer_impl, set_to_none, num_labels) for size in batch_sizes}
    missing = tuple(size for size, key in keys.items() if key not in _steps)
    if missing:
        steps = trace_fake_steps(config, missing, seq_len, attention=attention, checkpointing=checkpointing,
                                 amp_dtype=None if precision == "fp32" else DTYPES[precision],
                                 accumulation=accumulation, gpu=gpu, environ=environ, optimizer_impl=optimizer_impl,
                                 set_to_none=set_to_none, num_labels=num_labels)
        _steps.update({keys[size]: step for size, step in zip(missing, steps)})
    return [_steps[keys[size]] for size in batch_sizes]


def per_device(config, batch_size: int, seq_len: int, *, strategy: str = "single", gpus: int = 1,
               accumulation: int = 1, checkpointing: bool = False, amp: bool | str | None = None,
               attention: str = "sdpa",
               gradient_as_bucket_view: bool = False, gpu: GpuModel | None = None,
               environ: dict[str, str] | None = None, optimizer_impl: str = "foreach", set_to_none: bool = True,
               num_labels: int | None = None) -> list[dict[str, int]]:
    """Peak bytes per GPU of one step with global batch ``batch_size``, by category, one dict per GPU.

    - single: the traced step on one GPU.
    - dataparallel: GPU 0 runs the master model on its B/N share, so it holds what one device holds at B/N
      (weights, gradients reduced onto it, Adam state); every other GPU holds a fresh replica of the weights,
      the activations of its B/N share and, at the end of backward, the replica's gradients, but no Adam state
      and, with accumulation, none of the earlier micro-batches' gradients (they were added into GPU 0's ``.grad``).
      A model of DataParallel's mechanics, not a trace of it.
    - ddp: every GPU runs a full copy at B/N with its own Adam state, plus gradient buckets of the size of the
      parameters DDP reduces (those that get a gradient: not the pooler, which the project drops for DDP,
      ``Net(pooler=False)``); with ``gradient_as_bucket_view`` the gradients live in the buckets.
    - fsdp2: ``helpers.memory.fsdp2.predict_fsdp`` (FSDPMemTracker on a fake process group), one lever at a time.
    - amp (``predict_step``'s): CUDA autocast's rules (``helpers.memory.kernels.CudaLikeKernels``): weights,
      gradients and Adam state stay fp32; linear layers and attention save 16-bit tensors and 16-bit copies of
      their weights, while softmax, layer_norm and the loss keep fp32. fp16 holds what bf16 holds, byte for byte,
      plus the GradScaler's few tensors; where the two differ, it is by the attention kernel the GPU picks.
    """
    settings = _Setting.of(strategy, gpus, batch_size, gpu, amp, accumulation=accumulation,
                           checkpointing=checkpointing, attention=attention, environ=environ,
                           optimizer_impl=optimizer_impl, set_to_none=set_to_none, num_labels=num_labels)
    if settings.strategy == "fsdp2":
        return _fsdp2(config, batch_size // settings.gpus, seq_len, settings.gpus, accumulation, checkpointing,
                      settings.precision, attention, settings.gpu, environ)
    per_gpu = batch_size // settings.gpus
    replica_step = (settings.step(config, per_gpu, seq_len, set_to_none=True)
                    if settings.has_replicas and not settings.set_to_none else None)
    return _categories(settings.step(config, per_gpu, seq_len), settings, gradient_as_bucket_view, replica_step)


@dataclass(frozen=True)
class GpuMemory:
    """One GPU's predicted memory in a step: bytes by category at its allocated peak (``parts``, as ``per_device``
    gives them, 'total' being ``max_memory_allocated``), the caching allocator's reserved peak (``memory_reserved``;
    None where the step is not replayed into the allocator: FSDP2), and the terms nvidia-smi adds to it."""

    parts: dict[str, int]
    reserved: int | None
    context: Term
    communication: Term

    @property
    def allocated(self) -> int:
        return self.parts["total"]

    @property
    def nvidia_smi(self) -> tuple[int, int | None]:
        """(low, high) bytes nvidia-smi will show for the process on this GPU (high None where unknown)."""
        return nvidia_smi.shown(self.reserved, self.allocated, (self.context, self.communication))

    def fits(self, capacity: tuple[int, int]) -> str:
        """"yes", "maybe" or "NO": the nvidia-smi figure against the GPU's (smallest, largest) total."""
        return nvidia_smi.fits(self.nvidia_smi, capacity)


def gpu_memory(config, batch_size: int, seq_len: int, *, strategy: str = "single", gpus: int = 1,
               module_loading: str = "lazy", gpu: GpuModel | None = None, amp: bool | str | None = None,
               **options) -> list[GpuMemory]:
    """What each GPU holds in the step of ``per_device`` (same arguments) and what nvidia-smi will show for it:
    ``GpuMemory`` per GPU. The reserved peak comes from the replayed step: one GPU's as traced; under DDP with its
    bucket allocated after the weights (``step_logs.with_buckets``); under DataParallel, GPU 0's as one device at its
    share and every other GPU's from the same step as a replica runs it (``step_logs.replica``). ``module_loading``
    ("lazy" or "eager", ``helpers.memory.nvidia_smi.MODULE_LOADINGS``) decides the CUDA context's figures."""
    settings = _Setting.of(strategy, gpus, batch_size, gpu, amp, module_loading=module_loading, **options)
    if settings.strategy == "fsdp2":
        parts = per_device(config, batch_size, seq_len, strategy=strategy, gpus=gpus, gpu=settings.gpu, amp=amp,
                           **options)
        return [GpuMemory(device, None, *settings.terms()) for device in parts]
    per_gpu = batch_size // settings.gpus
    step = settings.step(config, per_gpu, seq_len)
    replica_step = settings.step(config, per_gpu, seq_len, set_to_none=True) if settings.has_replicas else None
    return settings.memories(step, replica_step)


def largest_batch(config, seq_len: int, capacity: int | tuple[int, int] | None = None, *, known: int | None = None,
                  certain: bool = True, traced: bool = False, **options) -> int:
    """The largest global batch (a multiple of gpus x accumulation) that fits every GPU by ``gpu_memory`` (same
    options), or 0 where even one example per GPU and micro-batch does not: nvidia-smi's figure within the GPU's
    total, ``capacity`` (bytes, or the (smallest, largest) published totals; default the GPU's). ``certain``: even
    at the largest figures of the context and NCCL and the smallest total ("yes"); else possibly ("maybe" too).

    Two traces, at the batch ``known`` (default: 2 micro-batches per GPU) and twice that, give a ``BatchLine``,
    which gives the step at every other batch without tracing; where the two logs do not align on a line, and with
    ``traced`` (as tests compare), every batch is traced. The search aims where the line through the traced batches
    crosses the limit, a little past it while everything fits; between a batch that fits and one that does not, where
    the line between them crosses the limit and halfway, in turn; it stops at a batch that fits next to one that does
    not. FSDP2 is traced (FSDPMemTracker, no replay); without a reserved figure it never fits for certain."""
    settings = _Setting.of(options.pop("strategy", "single"), options.pop("gpus", 1), None, options.pop("gpu", None),
                           options.pop("amp", None), **options)
    capacity = settings.gpu.capacity if capacity is None else (
        (capacity, capacity) if isinstance(capacity, int) else tuple(capacity))
    unit = settings.gpus * settings.accumulation
    first = max(1, (known or 2 * unit) // unit)
    shown = _shown_by_count(config, seq_len, settings, first, traced)
    limit = capacity[0] if certain else capacity[1]
    figures: dict[int, int] = {}

    def figure(count: int) -> int:  # the fullest GPU's nvidia-smi figure: its largest if certain, else its smallest
        if count not in figures:
            ends = [(low, high) for low, high in shown(count)]
            figures[count] = max(low if not certain else high if high is not None else limit + 1 for low, high in ends)
        return figures[count]

    ends = _line_ends(first)  # the traced batches: the line through them gives the first guess
    slope = max(1.0, (figure(ends[1]) - figure(ends[0])) / (ends[1] - ends[0]))
    fitting = max((seen for seen in figures if figures[seen] <= limit), default=0)
    failing = min((seen for seen in figures if figures[seen] > limit), default=None)
    halve = False
    count = max(1, first + int((limit - figure(first)) // slope))
    while failing is None or failing > fitting + 1:
        if figure(count) <= limit:
            fitting = max(fitting, count)
        else:
            failing = count if failing is None else min(failing, count)
        if failing == 1:
            break
        if failing is None:  # everything fits so far: aim past where the line through the two largest crosses
            below = sorted(seen for seen in figures if figures[seen] <= limit)[-2:]
            if len(below) == 2 and figures[below[1]] > figures[below[0]]:
                slope = (figures[below[1]] - figures[below[0]]) / (below[1] - below[0])
            count = max(fitting + 1, fitting + int((limit - figure(fitting)) // slope * 1.05) + 1)
        elif fitting == 0 or halve:  # between a fit and a failure: halve the interval every other time
            count, halve = (fitting + failing) // 2 or 1, False
        else:  # where the line between them crosses the limit
            slope = max(1.0, (figure(failing) - figure(fitting)) / (failing - fitting))
            count = min(max(fitting + int((limit - figure(fitting)) // slope), fitting + 1), failing - 1)
            halve = True
    return fitting * unit


def _line_ends(first: int) -> tuple[int, int]:
    """The counts a batch line is traced at for a search from ``first``: one example per micro-batch is left out,
    where size-1 dimensions take other paths (a broadcast needs no copy) and the log does not align with larger ones."""
    start = max(2, first)
    return start, 2 * start


def _shown_by_count(config, seq_len: int, settings: _Setting, first: int, traced: bool):
    """count (examples per GPU and micro-batch) -> each GPU's nvidia-smi (low, high) in that setting: from a
    ``BatchLine`` through traces at ``first`` and ``2 * first`` counts (for DataParallel's replicas of a step that
    keeps its gradients, a second line, through steps that free them), else traced at each count. Kept, so that
    the searches for certain and possible fits share it."""
    key = (config.to_json_string(), seq_len, repr(settings), first, traced)
    if key not in _shown:
        _shown[key] = _counted(config, seq_len, settings, first, traced)
    return _shown[key]


def _counted(config, seq_len: int, settings: _Setting, first: int, traced: bool):
    examples = settings.accumulation  # examples per GPU in one count
    if settings.strategy == "fsdp2":
        return lambda count: [memory.nvidia_smi for memory in gpu_memory(
            config, count * examples * settings.gpus, seq_len, **settings.options(strategy="fsdp2",
                                                                                  gpus=settings.gpus))]
    changes = {"step": {}} | ({"replica": {"set_to_none": True}} if settings.has_replicas else {})
    ends = _line_ends(first)
    lines = {}
    for name, change in changes.items():
        counts = tuple(dict.fromkeys((first, *ends)))  # traced together, after one warm-up
        steps = dict(zip(counts, settings.steps(config, tuple(count * examples for count in counts), seq_len,
                                                **change)))
        if not traced:
            lines[name] = BatchLine.through(*((count, steps[count].log) for count in ends))

    def log(count: int, name: str) -> list:
        line = lines.get(name)
        if line is None or count < ends[0]:
            return settings.step(config, count * examples, seq_len, **changes[name]).log
        return line.at(count)

    @functools.cache
    def shown(count: int) -> list[tuple[int, int | None]]:
        held = settings.held(lambda: step_memory(settings.gpu, log(count, "step")), lambda: log(count, "step"),
                             lambda: log(count, "replica"))
        context, communication = settings.terms()
        return [nvidia_smi.shown(segments, 0, (context, communication)) for segments in held]

    return shown


@dataclass(frozen=True)
class _Setting:
    """A strategy on some GPUs and the step's options, checked: what ``per_device``, ``gpu_memory`` and
    ``largest_batch`` share."""

    strategy: str
    gpus: int
    gpu: GpuModel
    precision: str
    module_loading: str
    step_options: tuple

    @classmethod
    def of(cls, strategy: str, gpus: int, batch_size: int | None, gpu: GpuModel | None, amp,
           module_loading: str = "lazy", gradient_as_bucket_view: bool = False, **step_options) -> _Setting:
        if strategy not in PREDICTED_STRATEGIES:
            raise ValueError(f"strategy={strategy!r}: expected one of {PREDICTED_STRATEGIES}")
        if module_loading not in nvidia_smi.MODULE_LOADINGS:
            raise ValueError(f"module_loading={module_loading!r}: expected one of {nvidia_smi.MODULE_LOADINGS}")
        gpus = 1 if strategy == "single" else gpus
        if batch_size is not None and batch_size % gpus:
            raise ValueError(f"batch_size={batch_size} does not split evenly over gpus={gpus}")
        gpu = gpu or default_gpu()
        step_options = {key: value for key, value in step_options.items() if value is not None}
        return cls(strategy, gpus, gpu, amp_precision(gpu, amp), module_loading,
                   tuple(sorted((step_options | {"bucket_view": gradient_as_bucket_view}).items())))

    @property
    def _options(self) -> dict:
        return dict(self.step_options)

    @property
    def accumulation(self) -> int:
        return self._options.get("accumulation", 1)

    @property
    def set_to_none(self) -> bool:
        return self._options.get("set_to_none", True)

    @property
    def has_replicas(self) -> bool:
        return self.strategy == "dataparallel" and self.gpus > 1

    def options(self, **more) -> dict:
        """The options of ``per_device`` and ``gpu_memory`` this setting was made of."""
        options = self._options
        bucket_view = options.pop("bucket_view")
        return options | {"gpu": self.gpu, "amp": self.precision, "module_loading": self.module_loading,
                          "gradient_as_bucket_view": bucket_view} | more

    def step(self, config, batch_size: int, seq_len: int, **change) -> StepMemory:
        return self.steps(config, (batch_size,), seq_len, **change)[0]

    def steps(self, config, batch_sizes: tuple[int, ...], seq_len: int, **change) -> list[StepMemory]:
        options = {key: value for key, value in self._options.items() if key != "bucket_view"} | change
        return predict_steps(config, batch_sizes, seq_len, gpu=self.gpu, amp=self.precision, **options)

    def terms(self) -> tuple[Term, Term]:
        return (nvidia_smi.cuda_context(self.gpu, self.module_loading),
                nvidia_smi.communication(self.strategy, self.gpus))

    def memories(self, step: StepMemory, replica_step: StepMemory | None) -> list[GpuMemory]:
        """``GpuMemory`` per GPU from the step on one device (and the step a replica's log comes from)."""
        parts = _categories(step, self, self._options["bucket_view"], replica_step)
        held = self.held(lambda: step, lambda: step.log, lambda: replica_step.log)
        return [GpuMemory(device, segments, *self.terms()) for device, segments in zip(parts, held)]

    def held(self, step, log, replica_log) -> list[int | None]:
        """Each GPU's reserved peak, from callables giving the step on one device, its log, and the log a replica's
        comes from (each called only where needed). Reserved segments cover the allocated blocks; a replica's
        allocated bytes are modelled (``per_device``), not replayed, so its reserved figure is at least those."""
        if self.strategy == "single":
            return [step().reserved_peak]
        if self.strategy == "ddp":
            if self._options["bucket_view"]:
                return [None] * self.gpus
            steps_log = log()
            return [reserved(self.gpu, with_buckets(steps_log, gradient_bytes(steps_log)))] * self.gpus
        one = step()
        if not self.has_replicas:
            return [one.reserved_peak]
        logged = replica_log()
        modelled = _categories(one, self, False, memory_of_log(self.gpu, logged) if not self.set_to_none
                               else None)[1]["total"]
        return [one.reserved_peak] + [max(modelled, reserved(self.gpu, replica(logged)))] * (self.gpus - 1)


def _bucket_bytes(step: StepMemory) -> int:
    """The bytes of DDP's buckets: every gradient the step makes (not the pooler's, which gets none)."""
    return step.optimizer_peak["gradients"]


def _categories(step: StepMemory, settings: _Setting, gradient_as_bucket_view: bool,
                replica_step: StepMemory | None = None) -> list[dict[str, int]]:
    """``per_device``'s dicts from the step on one device (its docstring says how each strategy is modelled), and
    for DataParallel's replicas from ``replica_step`` where given: the step freeing its gradients at ``zero_grad``, as
    a replica's are new at each backward whatever ``set_to_none`` is."""
    peak = _parts(step.peak)
    gpus = settings.gpus
    if settings.strategy == "single":
        return [_total(peak)]
    if settings.strategy == "dataparallel":
        step = replica_step or step
        backward = _parts(step.backward_peak)
        replica_compute = backward | {"optimizer": 0}
        if settings.accumulation > 1:  # earlier micro-batches' gradients went into GPU 0's .grad: a replica holds none
            replica_compute["gradients"] = max(0, backward["gradients"] - step.optimizer_peak["gradients"])
        replica_grads = dict.fromkeys(backward, 0) | {"weights": backward["weights"], "workspaces": backward["workspaces"],
                                                      "gradients": step.optimizer_peak["gradients"]}
        replica = max(replica_compute, replica_grads, key=lambda parts: sum(parts.values()))
        return [_total(peak)] + [_total(replica) for _ in range(gpus - 1)]
    rank = peak | {"buckets": _bucket_bytes(step)}
    if gradient_as_bucket_view:
        rank["gradients"] = 0
    return [_total(rank) for _ in range(gpus)]


def _fsdp2(config, per_rank, seq_len, gpus, accumulation, checkpointing, precision, attention, gpu, environ):
    from helpers.memory.fsdp2 import predict_fsdp  # FSDP2's modules take a second to import: only where asked

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
                           cuda_dropout=False, fused_attention=False, amp_dtype=DTYPES[amp] if amp else None)
    return trace.peak
