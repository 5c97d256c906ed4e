"""One CUDA device, simulated on the CPU: a traced training step's tensors replayed into PyTorch's caching
allocator, with what CUDA allocates that a CPU trace does not. This turns a trace on fake tensors into a
prediction of ``torch.cuda.max_memory_allocated``.

Each tensor is filed, when it is made, under what it is (the words of notebook 05): weights (made with the
model), the batch, activations (made in forward), temporaries (made in backward; a parameter's gradient is
moved to gradients once autograd stores it), optimizer (made inside ``optimizer.step()``: Adam's state and the
update's intermediates). What CUDA adds (``helpers.memory.gpu_facts``): the cuBLAS and cuBLASLt workspaces at the first
matrix product of each thread (workspaces), and the staging buffer of each large bias-gradient sum (reduction).
The allocator (``helpers.memory.allocator``) counts whole blocks; what they hold beyond the requested bytes is filed
under allocator.

Every change to the device is an event (``Event``) kept in ``log``: allocations and frees, a tensor filed under
gradients, a reduction's staging buffer (kept as the sum's rows and columns, sized when the event runs), and the
moments a step is read at. ``run(log)`` feeds a log to a fresh device and gives the same readings, so a log can be
re-run with changes (DDP's buckets before it, a DataParallel replica's share of it) or for another batch size
(``helpers.memory.batch_lines``) without tracing again.

PyTorch's own tracker (``MemTracker``) is not used here on purpose: its module hooks keep a module's input
gradients until every input of that module has its gradient (``register_multi_grad_hook`` in ModTracker), which
a plain step does not do; at the peak of BERT-base's backward that is one 48 MiB gradient too many.
"""

from __future__ import annotations

import contextlib
import os
import weakref

import torch

from helpers.memory.allocator import CachingAllocator
from helpers.memory.categories import ORDER
from helpers.memory.gpu_facts import GpuModel, reduce_buffers, workspaces
from helpers.torch_private import (BIAS_GEMM, GEMMS, SUM_OVER_DIMS, TorchDispatchMode, WeakIdKeyDictionary,
                                   makes_new_tensors, tree_leaves)

FILED = tuple(word for word in ORDER if word not in ("gathered", "buckets"))
"""What one simulated GPU files bytes under: no FSDP2 gathered weights, no DDP buckets (the prediction adds those)."""
FILED_AS = {"scaler": "optimizer"}
"""Phases whose tensors are filed under another word: the GradScaler's (fp16) go with the optimizer's state."""


Event = tuple
"""One change to the device: ("malloc", key, bytes, category), ("free", key), ("file", key, category),
("reduce", rows, columns), ("reset_peaks",), ("watch",), ("read", label), ("peak", label), or ("phase", name,
backward), which only marks where the step is (``enter``)."""


class SimulatedGpu:
    """A CUDA device's memory over traced code: run the code under ``replay()`` and say what it is doing with
    ``phase`` (what new tensors are: "weights", "batch", "activations", "temporaries", "optimizer", or "scaler": a
    GradScaler's, on the GPU even when 0-dimensional, filed under optimizer) and ``backward`` (autograd's thread,
    which holds its own cuBLAS workspace, is running).

    ``now()`` gives the bytes held by category, ``total`` being the allocated bytes; ``watch()`` starts a window
    whose ``peak`` is ``now()`` at the moment the allocated bytes were highest; ``read(label)`` and
    ``keep_peak(label)`` keep ``now()`` and ``peak`` under ``label`` in ``readings``. ``step_counts_on_gpu``:
    Adam's step counts are GPU tensors (fused or capturable Adam) rather than host ones.
    """

    replaying: list[SimulatedGpu] = []  # devices whose replay() is active, innermost last

    def __init__(self, gpu: GpuModel, environ: dict[str, str] | None = None, deterministic: bool = False,
                 step_counts_on_gpu: bool = False):
        self.gpu = gpu
        self.allocator = CachingAllocator()
        self.workspace_sizes = workspaces(gpu.capability, os.environ if environ is None else environ, deterministic)
        self.step_counts_on_gpu = step_counts_on_gpu
        self.phase = "weights"
        self.backward = False
        self.held = dict.fromkeys(FILED, 0)   # requested bytes by category
        self._category: dict[object, str] = {}     # key of each live allocation -> its category
        self._keys = WeakIdKeyDictionary()         # storage -> key
        self._next_key = 0
        self.peak: dict[str, int] | None = None
        self.readings: dict[str, dict[str, int]] = {}
        self.log: list[Event] = []

    @classmethod
    def run(cls, gpu: GpuModel, log: list[Event]) -> SimulatedGpu:
        """A fresh device (workspaces as the log allocates them) after every event of ``log``."""
        device = cls(gpu, {})
        for event in log:
            device.apply(event)
        return device

    # --- what the step does ---------------------------------------------------------------------------------
    @contextlib.contextmanager
    def replay(self):
        """Run traced code under this to replay its tensors into the device."""
        SimulatedGpu.replaying.append(self)
        try:
            with _Replay(self):
                yield self
        finally:
            SimulatedGpu.replaying.remove(self)

    @contextlib.contextmanager
    def recomputation(self):
        """A checkpointed layer's forward re-run in backward: what it saves counts as activations again."""
        phase, self.phase = self.phase, "activations"
        try:
            yield
        finally:
            self.phase = phase

    def enter(self, phase: str, backward: bool = False) -> None:
        """From now on, new tensors are ``phase``'s (see the class), made by autograd's thread if ``backward``."""
        self.phase, self.backward = phase, backward
        self.apply(("phase", phase, backward))

    def gradient(self, tensor: torch.Tensor) -> None:
        """``tensor`` became a parameter's ``.grad``: file its bytes under gradients."""
        key = self._keys.get(tensor.untyped_storage())
        if key is not None and self._category[key] != "gradients":
            self.apply(("file", key, "gradients"))

    def track(self, tensor: torch.Tensor) -> None:
        if self.phase == "optimizer" and tensor.dim() == 0 and not self.step_counts_on_gpu:
            return  # Adam's step counts: CPU tensors unless capturable or fused (torch/optim/adam.py, _init_group)
        storage = tensor.untyped_storage()
        if storage in self._keys:
            return
        key, self._next_key = self._next_key, self._next_key + 1
        self._keys[storage] = key
        weakref.finalize(storage, self.apply, ("free", key))
        self.apply(("malloc", key, storage.nbytes(), FILED_AS.get(self.phase, self.phase)))

    def after(self, func, args) -> None:
        """What the CUDA kernel of ``func`` allocates besides its outputs."""
        if func in GEMMS:
            thread = "autograd thread" if self.backward else "forward thread"
            names = [f"cuBLAS ({thread})"] + ([f"cuBLASLt ({thread})"] if func is BIAS_GEMM else [])
            for name in names:
                if name in self.workspace_sizes and name not in self._category:
                    self.apply(("malloc", name, self.workspace_sizes[name], "workspaces"))
        elif func is SUM_OVER_DIMS:
            source, dims = args[0], sorted(d % args[0].dim() for d in args[1])
            if source.is_contiguous() and source.dim() >= 2 and dims == list(range(source.dim() - 1)):
                self.apply(("reduce", source.numel() // source.shape[-1], source.shape[-1]))

    # --- the readings ---------------------------------------------------------------------------------------
    def now(self) -> dict[str, int]:
        allocator = self.allocator
        return self.held | {"allocator": allocator.allocated - allocator.requested, "total": allocator.allocated}

    def watch(self) -> None:
        """From now on, ``peak`` is the moment of the highest allocated bytes."""
        self.apply(("watch",))

    def reset_peaks(self) -> None:
        """As ``torch.cuda.reset_peak_memory_stats``."""
        self.apply(("reset_peaks",))

    def read(self, label: str) -> dict[str, int]:
        """``now()``, kept in ``readings`` under ``label``."""
        self.apply(("read", label))
        return self.readings[label]

    def keep_peak(self, label: str) -> dict[str, int]:
        """``peak``, kept in ``readings`` under ``label``."""
        self.apply(("peak", label))
        return self.readings[label]

    # --- events ---------------------------------------------------------------------------------------------
    def apply(self, event: Event) -> None:
        """Change the device by ``event`` (see ``Event``) and keep it in ``log``."""
        self.log.append(event)
        kind = event[0]
        if kind == "malloc":
            self._allocate(*event[1:])
        elif kind == "free":
            self._free(event[1])
        elif kind == "file":
            key, category = event[1:]
            size = self.allocator.size_of(key)
            self.held[self._category[key]] -= size
            self.held[category] += size
            self._category[key] = category
        elif kind == "reduce":
            staging, semaphores = reduce_buffers(event[1], event[2], self.gpu)
            if staging:  # taken for the kernel's duration; the semaphores are released first
                buffer, flags = object(), object()
                self._allocate(buffer, staging, "reduction")
                self._allocate(flags, semaphores, "reduction")
                self._free(flags)
                self._free(buffer)
        elif kind == "reset_peaks":
            self.allocator.reset_peaks()
        elif kind == "watch":
            self.peak = self.now()
        elif kind == "read":
            self.readings[event[1]] = self.now()
        elif kind == "peak":
            self.readings[event[1]] = dict(self.peak)
        elif kind != "phase":
            raise ValueError(f"unknown event {event!r}")

    def _allocate(self, key, size: int, category: str) -> None:
        if self.allocator.malloc(key, size) is None:
            return
        self._category[key] = category
        self.held[category] = self.held.get(category, 0) + size  # "buckets" only where a log adds DDP's
        if self.peak is not None and self.allocator.allocated > self.peak["total"]:
            self.peak = self.now()

    def _free(self, key) -> None:
        category = self._category.pop(key, None)
        if category is not None:
            self.held[category] -= self.allocator.size_of(key)
            self.allocator.free(key)


class _Replay(TorchDispatchMode):
    def __init__(self, device: SimulatedGpu):
        super().__init__()
        self.device = device

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = _MetaOutputs.call(func, args, kwargs or {})
        for tensor in (out,) if isinstance(out, torch.Tensor) else tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                self.device.track(tensor)
        self.device.after(func, args)
        return out


class _MetaOutputs:
    """What an operator returns on meta tensors, remembered by the operator and its arguments' shapes, strides and
    dtypes, so that the next call with the same ones makes its outputs directly (``torch.empty_strided``) instead of
    running the operator's meta kernel again, most of which are Python (torch._refs). A step calls the same operators
    with the same shapes in every encoder layer. Only operators that make new tensors qualify: no argument changed in
    place, no output a view of an input, every output a meta tensor of the size its shape and strides give (tests
    compare traces with and without this)."""

    outputs: dict[tuple, tuple] = {}
    fresh: dict[object, bool] = {}  # operator -> whether its schema makes new tensors only

    @classmethod
    def call(cls, func, args, kwargs):
        key = cls._key(func, args, kwargs)
        if key is not None and key in cls.outputs:
            made = [torch.empty_strided(shape, stride, dtype=dtype, device="meta")
                    for shape, stride, dtype in cls.outputs[key][1]]
            return made[0] if cls.outputs[key][0] else tuple(made)
        out = func(*args, **kwargs)
        if key is not None:
            inputs = {id(value.untyped_storage()) for value in tree_leaves((args, kwargs))
                      if isinstance(value, torch.Tensor)}
            described = cls._describe(out, inputs)
            if described is None:  # an output shares an input's storage (``_unsafe_view`` does, unannotated)
                cls.fresh[func] = False
            else:
                cls.outputs[key] = described
        return out

    @classmethod
    def _key(cls, func, args, kwargs) -> tuple | None:
        if func not in cls.fresh:
            cls.fresh[func] = makes_new_tensors(func)
        if not cls.fresh[func]:
            return None
        try:
            return func, cls._of(args), cls._of(tuple(sorted(kwargs.items())))
        except TypeError:  # a tensor off meta, or an argument that is not plain data
            return None

    @classmethod
    def _of(cls, value):
        if isinstance(value, torch.Tensor):
            if value.device.type != "meta":
                raise TypeError("not a meta tensor")
            return (tuple(value.shape), value.stride(), value.dtype, value.storage_offset())
        if isinstance(value, (tuple, list)):
            return tuple(cls._of(item) for item in value)
        if value is None or isinstance(value, (bool, int, float, str, torch.dtype, torch.device, torch.layout,
                                               torch.memory_format)):
            return value
        raise TypeError(f"{type(value).__name__} is not plain data")

    @staticmethod
    def _describe(out, inputs: set[int]) -> tuple | None:
        single = isinstance(out, torch.Tensor)
        outs = (out,) if single else out
        if not isinstance(outs, tuple) or not all(isinstance(t, torch.Tensor) and t.device.type == "meta"
                                                  for t in outs):
            return None
        described = []
        for tensor in outs:
            made = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device="meta")
            storage = tensor.untyped_storage()
            if id(storage) in inputs or tensor.storage_offset() or made.untyped_storage().nbytes() != storage.nbytes():
                return None
            described.append((tuple(tensor.shape), tensor.stride(), tensor.dtype))
        return single, tuple(described)
