"""Every private PyTorch surface the package rests on, in one place: the memory predictor's (fake tensors, the
trackers, the fused attention operators), notebook 09's collective counter (``seeing_fsdp2_collectives``) and the
memory snapshot of notebook 05's appendix (``recording_memory_history``). Nothing else in ``src/`` touches a private
name of torch (tests/test_layout.py).

None of these is public API: a torch release may move, rename or change any of them without notice. So each use
in the package goes through this module, which names the torch it was written against (``TESTED``) and the releases
every notebook ran on (``NEEDED`` to ``NEWEST``, `make torch-range`). On a torch outside them it warns once, on
import; where a surface is really gone, or an operator called with positional arguments has changed its signature,
it raises ``TorchSurfaceMissing``, one line naming the torch the series needs. The cheap surfaces are checked on
import; the trackers, whose modules import TorchDynamo (about 1.5 s), and the CUDA-only functions when they are
first used. CONTRIBUTING.md ("Upgrading torch") says what to re-read in PyTorch's source and which test pins which
fact.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import warnings
from contextlib import contextmanager

import torch

TESTED = "2.13.0"  # the torch requirements.txt pins: the stored notebook outputs are made with it
NEEDED = "2.10"    # the oldest torch every notebook runs on (make torch-range): pyproject.toml's floor, the Colab cell's
NEWEST = "2.14"    # the newest torch every notebook ran on; from NEEDED to NEWEST, nothing is said on import


class UntestedTorchWarning(UserWarning):
    """This torch is outside the range the series ran on; its private surfaces may behave otherwise."""


class TorchSurfaceMissing(ImportError):
    """A private PyTorch surface the predictor needs is missing, or its signature changed, in this torch."""


def missing(what: str) -> TorchSurfaceMissing:
    return TorchSurfaceMissing(f"helpers needs torch {NEEDED} or newer (tested with {TESTED}); torch "
                               f"{torch.__version__} has no {what}")


def release(version: str) -> tuple[int, int]:
    """(major, minor) of a torch version such as '2.10.0+cu128'."""
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def untested(version: str) -> str | None:
    """The warning for torch ``version``, or None where the series ran on its release (local builds such as +cpu and
    patch releases count)."""
    if release(NEEDED) <= release(version) <= release(NEWEST):
        return None
    where = "older than" if release(version) < release(NEEDED) else "newer than"
    return (f"helpers runs on torch {NEEDED} to {NEWEST} (pinned {TESTED}); torch {version} is {where} any it ran on: "
            f"parts of it rest on private PyTorch code that may differ (CONTRIBUTING.md, 'Upgrading torch')")


def attribute(module: str, name: str):
    """``module.name``, or TorchSurfaceMissing naming it (the import error kept as the cause)."""
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as error:
        raise missing(f"{module}.{name}") from error


def aten(name: str, overload: str = "default"):
    """The ATen operator overload ``aten.name.overload`` as a dispatch mode sees it."""
    try:
        return getattr(getattr(torch.ops.aten, name), overload)
    except (AttributeError, RuntimeError) as error:
        raise missing(f"aten.{name}.{overload}") from error


def positional_operator(name: str, positional: tuple[str, ...]):
    """``torch.ops.aten.<name>``, checked to take ``positional`` as its leading positional arguments (the calls
    below pass them by position, so a reordered or inserted argument would silently mean something else)."""
    schema = aten(name)._schema
    found = tuple(argument.name for argument in schema.arguments if not argument.kwarg_only)
    if found[:len(positional)] != positional:
        raise missing(f"aten.{name}({', '.join(positional)}, ...); it takes ({', '.join(found)})")
    return getattr(torch.ops.aten, name)


warning = untested(torch.__version__)
if warning:
    warnings.warn(warning, UntestedTorchWarning, stacklevel=2)

# --- fake tensors and dispatch: checked on import -----------------------------------------------------------------

FakeTensorMode = attribute("torch._subclasses.fake_tensor", "FakeTensorMode")  # shapes without data
if not hasattr(FakeTensorMode, "cache_clear"):
    raise missing("FakeTensorMode.cache_clear (its dispatch cache, emptied before an FSDP2 trace)")
TorchDispatchMode = attribute("torch.utils._python_dispatch", "TorchDispatchMode")  # sees every ATen call
tree_leaves = attribute("torch.utils._pytree", "tree_leaves")
WeakIdKeyDictionary = attribute("torch.utils.weak", "WeakIdKeyDictionary")
native_dropout = attribute("torch", "native_dropout")  # CUDA's fused dropout: a 1-byte mask
GEMMS = frozenset(aten(name) for name in ("addmm", "mm", "bmm", "baddbmm"))
"""The matrix products as a dispatch mode sees them: each takes a cuBLAS workspace on CUDA."""
BIAS_GEMM = aten("addmm")  # a linear layer with a bias: cuBLASLt, with its own workspace
SUM_OVER_DIMS = aten("sum", "dim_IntList")  # a bias gradient's sum, as a dispatch mode sees it

# The fused attention kernels, called with positional arguments in the order of their schemas
_FLASH = positional_operator("_scaled_dot_product_flash_attention",
                             ("query", "key", "value", "dropout_p", "is_causal", "return_debug_mask"))
_CUDNN = positional_operator("_scaled_dot_product_cudnn_attention",
                             ("query", "key", "value", "attn_bias", "compute_log_sumexp", "dropout_p", "is_causal",
                              "return_debug_mask"))
_EFFICIENT = positional_operator("_scaled_dot_product_efficient_attention",
                                 ("query", "key", "value", "attn_bias", "compute_log_sumexp", "dropout_p", "is_causal"))


def fused_attention(kernel: str, query, key, value, attn_bias, dropout_p: float, is_causal: bool, scale):
    """The output of ``kernel`` ("flash", "cuDNN" or "memory-efficient") in training, as SDPA calls it; what it
    keeps for backward (one fp32 log-sum-exp per query, never the L x L probabilities) comes with it."""
    if kernel == "flash":
        return _FLASH(query, key, value, dropout_p, is_causal, False, scale=scale)[0]
    if kernel == "cuDNN":
        return _CUDNN(query, key, value, None, True, dropout_p, is_causal, False, scale=scale)[0]
    if kernel != "memory-efficient":
        raise ValueError(f"kernel={kernel!r}: expected flash, cuDNN or memory-efficient")
    return _EFFICIENT(query, key, value, attn_bias, True, dropout_p, is_causal, scale=scale)[0]


# --- the trackers and the fake process group: checked when first used ------------------------------------------

@functools.cache
def mem_tracker():
    """PyTorch's ``MemTracker`` class (torch/distributed/_tools/mem_tracker.py)."""
    tracker = attribute("torch.distributed._tools.mem_tracker", "MemTracker")
    for method in ("track_external", "reset_mod_stats", "get_tracker_snapshot"):
        if not hasattr(tracker, method):
            raise missing(f"MemTracker.{method}")
    return tracker


@functools.cache
def fsdp_mem_tracker():
    """``FSDPMemTracker`` (torch/distributed/_tools/fsdp2_mem_tracker.py): MemTracker with FSDP2's own kinds."""
    mem_tracker()
    return attribute("torch.distributed._tools.fsdp2_mem_tracker", "FSDPMemTracker")


def tracker_kinds() -> dict[str, tuple[str, ...]]:
    """The kinds each tracker files bytes under (its private enums' values), by tracker class name."""
    kinds = attribute("torch.distributed._tools.mem_tracker", "_MemRefType")
    fsdp_kinds = attribute("torch.distributed._tools.fsdp2_mem_tracker", "_FSDPRefType")
    return {"MemTracker": tuple(kind.value for kind in kinds),
            "FSDPMemTracker": tuple(kind.value for kind in fsdp_kinds)}


def fake_store():
    """A store for ``init_process_group("fake", ...)``: a process group whose collectives return at once
    (torch/testing/_internal/distributed/fake_pg.py). Inside FakeTensorMode those collectives need fake kernels for
    c10d's operators, which torch registers on import from torch/distributed/_meta_registrations.py; torch 2.10
    has no such module (c10d._allgather_base_ then raises UnsupportedOperatorException), so there it is refused."""
    if importlib.util.find_spec("torch.distributed._meta_registrations") is None:
        raise TorchSurfaceMissing(f"torch {torch.__version__} cannot trace FSDP2 on fake tensors: it has no fake "
                                  f"kernels for c10d's collectives (torch.distributed._meta_registrations, which "
                                  f"torch {TESTED} has)")
    return attribute("torch.testing._internal.distributed.fake_pg", "FakeStore")()


# --- on a CUDA GPU ------------------------------------------------------------------------------------------------

def clear_cublas_workspaces() -> None:
    """Free the cuBLAS workspaces torch keeps per (handle, stream), so that the next step allocates them afresh."""
    if not hasattr(torch._C, "_cuda_clearCublasWorkspaces"):
        raise missing("torch._C._cuda_clearCublasWorkspaces (CUDA builds only)")
    torch._C._cuda_clearCublasWorkspaces()


def fused_sdp_choice(query, key, value, dropout_p: float) -> int:
    """The ``SDPBackend`` value ``scaled_dot_product_attention`` picks on this GPU for an unmasked, non-causal call."""
    if not hasattr(torch, "_fused_sdp_choice"):
        raise missing("torch._fused_sdp_choice")
    return torch._fused_sdp_choice(query, key, value, None, dropout_p, False)


# --- FSDP2's collectives ------------------------------------------------------------------------------------------

FSDP2_COLLECTIVES = {"all-gather": ("all_gather_single", "all_gather_into_tensor"),
                     "reduce-scatter": ("reduce_scatter_single", "reduce_scatter_tensor")}
"""The functions of torch.distributed that FSDP2 calls from Python for each collective, the one it calls now first
(torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py: ``dist.all_gather_single``, ``dist.reduce_scatter_single``;
none of them is in torch.distributed's public list), then the one of torches that lack it (their
_fsdp_collectives.py: ``dist.all_gather_into_tensor(output_tensor=..., input_tensor=...)``,
``dist.reduce_scatter_tensor(output, input, ...)``). Each pair takes the same leading arguments."""


def fsdp2_collective_names(dist) -> dict[str, str]:
    """The function FSDP2 calls for each collective in this torch: the first of ``FSDP2_COLLECTIVES`` that
    ``dist`` (torch.distributed) has; TorchSurfaceMissing where it has none."""
    names = {}
    for kind, candidates in FSDP2_COLLECTIVES.items():
        found = [name for name in candidates if hasattr(dist, name)]
        if not found:
            raise missing(f"torch.distributed.{' or '.join(candidates)} (FSDP2's {kind})")
        names[kind] = found[0]
    return names


@contextmanager
def seeing_fsdp2_collectives(add):
    """Inside the block, each all-gather and reduce-scatter of FSDP2 first calls ``add(kind, tensor)`` with the
    tensor it moves on this process: the whole gathered output, the whole input to reduce-scatter. The functions
    watched are this torch's (``fsdp2_collective_names``)."""
    import torch.distributed as dist

    names = fsdp2_collective_names(dist)
    originals = {kind: getattr(dist, name) for kind, name in names.items()}
    gather, scatter = originals["all-gather"], originals["reduce-scatter"]

    def all_gather(output_tensor, input_tensor, *args, **kwargs):
        add("all-gather", output_tensor)
        return gather(output_tensor, input_tensor, *args, **kwargs)

    def reduce_scatter(output, input, *args, **kwargs):
        add("reduce-scatter", input)
        return scatter(output, input, *args, **kwargs)

    setattr(dist, names["all-gather"], all_gather)
    setattr(dist, names["reduce-scatter"], reduce_scatter)
    try:
        yield
    finally:
        for kind, name in names.items():
            setattr(dist, name, originals[kind])


# --- a CUDA memory snapshot ---------------------------------------------------------------------------------------

@contextmanager
def recording_memory_history(path: str, max_entries: int = 100_000):
    """Inside the block, CUDA's caching allocator records each allocation and free with the Python stack that made
    it (``torch.cuda.memory._record_memory_history``); when the block ends, the record is written to ``path``
    (``torch.cuda.memory._dump_snapshot``: drag the file into https://pytorch.org/memory_viz) and recording stops."""
    record = attribute("torch.cuda.memory", "_record_memory_history")
    dump = attribute("torch.cuda.memory", "_dump_snapshot")
    taken = inspect.signature(record).parameters
    if not {"enabled", "max_entries"} <= set(taken):
        raise missing(f"torch.cuda.memory._record_memory_history(enabled=..., max_entries=...); it takes "
                      f"({', '.join(taken)})")
    record(max_entries=max_entries)
    try:
        yield
        dump(path)
    finally:
        record(enabled=None)
