"""Every private PyTorch surface the package rests on, in one place: the memory predictor's (fake tensors, the
trackers, the fused attention operators), notebook 09's collective counter (``seeing_fsdp2_collectives``), the
memory snapshot of notebook 05's appendix (``recording_memory_history``), the checkpoints' (the private names in
DCP's pickled metadata, CPython's pure-Python unpickler that reads it, an optimizer's step without its hooks, the
state keys torch names privately), what holds a process group after it is destroyed (``release_ddp``,
``release_meshes``: helpers.distributed) and torch.compile's wrapper (``compiled_inner``: helpers.wrapping), and whether a transformers model implements sdpa
(``supports_sdpa``). Nothing else in ``src/`` touches a private name of torch, transformers or CPython
(tests/test_layout.py).

None of these is public API: a torch release may move, rename or change any of them without notice. So each use
in the package goes through this module, which names the torch it was written against (``TESTED``) and the releases
every notebook ran on (``NEEDED`` to ``NEWEST``, `make torch-range`). On a torch outside them it warns once, on
import; where a surface is really gone, or an operator called with positional arguments has changed its signature,
it raises ``TorchSurfaceMissing``, one line naming the torch the series needs. The cheap surfaces are checked on
import; the trackers, whose modules import TorchDynamo (about 1.5 s), the CUDA-only functions and the process
groups' holders when they are first used. CONTRIBUTING.md ("Upgrading torch") says what to re-read in PyTorch's
source and which test pins which fact.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import importlib
import importlib.util
import inspect
import pickle
import sys
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

# --- checkpoints: DCP's pickled metadata, the unpickler that reads it, state keys torch names privately -------------
# Checked when first used (importing torch.distributed.checkpoint costs time the memory predictor does not need),
# except the unpickler, which is CPython's and checked on import.

DCP_PRIVATE_GLOBALS = (("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
                       ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
                       ("torch.serialization", "_get_layout"))
"""The private names a pickle of DCP's ``.metadata`` refers to (torch/distributed/checkpoint/metadata.py,
filesystem.py; torch/serialization.py): where a chunk's bytes lie in a data file, a tensor's memory format, and the
function that looks a ``torch.layout`` up by its name."""


@functools.cache
def dcp_private_globals() -> dict[tuple[str, str], object]:
    """The objects of ``DCP_PRIVATE_GLOBALS`` by (module, name), as ``find_class`` is asked for them; the place of a
    chunk checked to have the fields the checkpoint code reads."""
    found = {(module, name): attribute(module, name) for module, name in DCP_PRIVATE_GLOBALS}
    fields = {field.name for field in dataclasses.fields(found[DCP_PRIVATE_GLOBALS[0]])}
    if not {"relative_path", "offset", "length", "transform_descriptors"} <= fields:
        raise missing(f"{'.'.join(DCP_PRIVATE_GLOBALS[0])}(relative_path, offset, length, transform_descriptors); "
                      f"it has ({', '.join(sorted(fields))})")
    return found


def dcp_chunk_place() -> type:
    """DCP's class for where one chunk's bytes lie: ``relative_path`` (a data file), ``offset``, ``length``."""
    return dcp_private_globals()[DCP_PRIVATE_GLOBALS[0]]


PATH_MODULES = ("pathlib", "pathlib._local")
"""The modules a pickled path names: ``pathlib``, and from Python 3.13 on CPython's private ``pathlib._local``."""


def _pure_python_unpickler() -> type:
    """CPython's pure-Python unpickler, checked to read each opcode through its ``dispatch`` table."""
    unpickler = getattr(pickle, "_Unpickler", None)
    table = getattr(unpickler, "dispatch", None)
    opcodes = (pickle.BUILD, pickle.APPEND, pickle.APPENDS, pickle.SETITEM, pickle.SETITEMS, pickle.ADDITEMS,
               pickle.BYTEARRAY8, pickle.NEWOBJ, pickle.NEWOBJ_EX, pickle.REDUCE, pickle.OBJ, pickle.INST)
    if not isinstance(table, dict) or not all(opcode[0] in table for opcode in opcodes):
        raise TorchSurfaceMissing(f"helpers needs CPython's pure-Python unpickler (pickle._Unpickler, with a dispatch "
                                  f"table by opcode); Python {sys.version.split()[0]} has none")
    return unpickler


_Unpickler = _pure_python_unpickler()


class HookedUnpickler(_Unpickler):
    """CPython's pure-Python unpickler (``pickle._Unpickler``), which calls a method of its own before each opcode
    that changes an object and after each one that makes an object, so that a subclass can refuse them. The C
    unpickler (``pickle.Unpickler``) offers only ``find_class``; a subclass overrides that one as documented, and:

    - ``made(obj)``: NEWOBJ, NEWOBJ_EX, REDUCE, OBJ or INST made ``obj``;
    - ``building(target, state)``: BUILD is about to set ``state`` on ``target``;
    - ``adding_items(target)``: APPEND(S), SETITEM(S) or ADDITEMS are about to add items to ``target``;
    - ``making_bytearray()``: BYTEARRAY8 is about to allocate a bytearray of the size it read.
    """

    dispatch = dict(_Unpickler.dispatch)

    def made(self, obj) -> None:
        pass

    def building(self, target, state) -> None:
        pass

    def adding_items(self, target) -> None:
        pass

    def making_bytearray(self) -> None:
        pass


def _after_making(load):
    def load_then_tell(unpickler: HookedUnpickler) -> None:
        load(unpickler)
        unpickler.made(unpickler.stack[-1])
    return load_then_tell


def _before_changing(load, tell):
    def tell_then_load(unpickler: HookedUnpickler) -> None:
        tell(unpickler)
        load(unpickler)
    return tell_then_load


for _opcode in (pickle.NEWOBJ, pickle.NEWOBJ_EX, pickle.REDUCE, pickle.OBJ, pickle.INST):
    HookedUnpickler.dispatch[_opcode[0]] = _after_making(_Unpickler.dispatch[_opcode[0]])
for _opcode, _tell in (
        (pickle.BUILD, lambda u: u.building(u.stack[-2], u.stack[-1])),
        (pickle.APPEND, lambda u: u.adding_items(u.stack[-2])),
        (pickle.SETITEM, lambda u: u.adding_items(u.stack[-3])),
        (pickle.APPENDS, lambda u: u.adding_items(u.metastack[-1][-1])),  # the object below the MARK
        (pickle.SETITEMS, lambda u: u.adding_items(u.metastack[-1][-1])),
        (pickle.ADDITEMS, lambda u: u.adding_items(u.metastack[-1][-1])),
        (pickle.BYTEARRAY8, lambda u: u.making_bytearray())):
    HookedUnpickler.dispatch[_opcode[0]] = _before_changing(_Unpickler.dispatch[_opcode[0]], _tell)


def step_without_hooks(optimizer) -> None:
    """``optimizer.step()`` without any step hook, the optimizer's own or the global ones
    (``torch.optim.optimizer.register_optimizer_step_pre_hook``): torch wraps each optimizer class's ``step`` once in
    ``Optimizer.profile_hook_step`` (torch/optim/optimizer.py), which runs the hooks around the original and keeps
    it, through functools.wraps, as ``__wrapped__``."""
    step = type(optimizer).step
    original = getattr(step, "__wrapped__", None)
    if not getattr(step, "hooked", False) or original is None:
        raise missing(f"{type(optimizer).__name__}.step.__wrapped__ (the step inside the wrapper that runs its hooks)")
    original(optimizer)


GRAD_SCALER_STATE = {"scale": float, "growth_factor": float, "backoff_factor": float, "growth_interval": int,
                     "_growth_tracker": int}
"""``torch.amp.GradScaler.state_dict()``: each entry and its type; ``_growth_tracker``, the steps since the scale last
grew or shrank, is a private name (torch/amp/grad_scaler.py)."""
GRAD_SCALER_POSITION = ("scale", "_growth_tracker")
"""The entries of ``GRAD_SCALER_STATE`` that change as training goes; the others are the scaler's settings."""
SCHEDULE_POSITION = ("last_epoch", "_step_count", "_last_lr", "_is_initial", "_get_lr_called_within_step")
"""The entries of an ``LRScheduler``'s state_dict that say where the schedule stands and change as it steps; the others
describe the schedule. All but ``last_epoch`` are private names (torch/optim/lr_scheduler.py)."""


@functools.cache
def grad_scaler_state() -> dict[str, type]:
    """``GRAD_SCALER_STATE``, checked against this torch's GradScaler."""
    keys = set(torch.amp.GradScaler("cpu").state_dict())
    if keys != set(GRAD_SCALER_STATE):
        raise missing(f"GradScaler.state_dict() entries {sorted(GRAD_SCALER_STATE)}; it has {sorted(keys)}")
    return GRAD_SCALER_STATE


@functools.cache
def schedule_position() -> tuple[str, ...]:
    """``SCHEDULE_POSITION``, checked against the state of this torch's LambdaLR."""
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    keys = set(torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0).state_dict())
    if not set(SCHEDULE_POSITION) <= keys:
        raise missing(f"LRScheduler.state_dict() entries {sorted(SCHEDULE_POSITION)}; it has {sorted(keys)}")
    return SCHEDULE_POSITION


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


def makes_new_tensors(operator) -> bool:
    """Whether an ATen operator overload, by its schema, changes no argument in place and returns no view of one
    (no alias annotation; ``_unsafe_view`` is unannotated and still a view, which callers must check)."""
    schema = operator._schema
    return not schema.is_mutable and all(returned.alias_info is None for returned in schema.returns)


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


# --- process groups: what holds one after destroy_process_group (helpers.distributed) -----------------------------

DDP_GROUP_HOLDERS = ("logger", "reducer", "process_group")
"""What a DistributedDataParallel model keeps of its process group (torch/nn/parallel/distributed.py): the group, the
C++ reducer (which holds the group and the communication hook's state) and the logger that holds the reducer."""
MESH_INFO_GROUPS = ("shard_process_group", "replicate_process_group", "reduce_scatter_process_group")
"""The groups FSDP2's per-module view of a device mesh keeps (torch/distributed/fsdp/_fully_shard/_fsdp_common.py,
``FSDPMeshInfo``, ``DDPMeshInfo``): its collectives run through them."""


def release_ddp(model) -> None:
    """Drop what the DistributedDataParallel ``model`` holds of its process group; its ``.module`` stays usable, the
    wrapper no longer communicates."""
    held = vars(model)
    if "process_group" in held and not {"reducer", "logger"} <= held.keys():
        raise missing(f"DistributedDataParallel.{' and .'.join(sorted({'reducer', 'logger'} - held.keys()))} "
                      f"(what holds its process group besides .process_group)")
    for name in DDP_GROUP_HOLDERS:
        held.pop(name, None)


def live_process_groups() -> list:
    """Every process group this process has not destroyed yet: the ones ``destroy_process_group()`` destroys."""
    c10d = importlib.import_module("torch.distributed.distributed_c10d")
    world = getattr(c10d, "_world", None)
    if not isinstance(getattr(world, "pg_map", None), dict):
        raise missing("torch.distributed.distributed_c10d._world.pg_map (the registry of process groups)")
    return list(world.pg_map)


def release_meshes(groups: list) -> None:
    """Empty the registry of groups of every device mesh that holds one of ``groups``, and drop ``groups`` from
    FSDP2's per-module views of the meshes (``DataParallelMeshInfo``): found among all live objects, since torch's
    caches of sharding plans keep a mesh long after the models that used it."""
    from torch.distributed.device_mesh import DeviceMesh

    mesh_info = attribute("torch.distributed.fsdp._fully_shard._fsdp_common", "DataParallelMeshInfo")
    ids = {id(group) for group in groups}
    for obj in gc.get_objects():  # type(), not isinstance(): some objects warn when asked for their __class__
        kind = type(obj)
        if issubclass(kind, DeviceMesh):
            registry = getattr(obj, "_pg_registry", None)
            if not isinstance(registry, dict):
                raise missing("DeviceMesh._pg_registry (the process groups a device mesh holds)")
            if any(id(group) in ids for group in registry.values()):
                registry.clear()
        elif issubclass(kind, mesh_info):
            names = [name for name in MESH_INFO_GROUPS if hasattr(obj, name)]
            if not names:
                raise missing(f"DataParallelMeshInfo.{' or .'.join(MESH_INFO_GROUPS)}")
            for name in names:
                if id(getattr(obj, name)) in ids:
                    setattr(obj, name, None)


# --- torch.compile's wrapper (helpers.wrapping) ------------------------------------------------------------------

def compiled_inner(model):
    """The model inside ``model`` where it is torch.compile's wrapper, else None. The wrapper's class,
    ``torch._dynamo.eval_frame.OptimizedModule``, has no public name, and keeps the model as its child module
    ``_orig_mod``. torch._dynamo is asked only where it is loaded already (no wrapper exists before; importing it
    takes a second or more)."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    if eval_frame is None:
        return None
    wrapper = getattr(eval_frame, "OptimizedModule", None)
    if wrapper is None:
        raise missing("torch._dynamo.eval_frame.OptimizedModule (torch.compile's wrapper)")
    if not isinstance(model, wrapper):
        return None
    inner = dict(model.named_children()).get("_orig_mod")
    if inner is None:
        raise missing("OptimizedModule._orig_mod (the model inside torch.compile's wrapper)")
    return inner


# --- transformers' private attributes (helpers.memory.tracer) -------------------------------------------------------

def supports_sdpa(model_class) -> bool:
    """Whether transformers' ``model_class`` implements torch's scaled-dot-product attention: its private class
    attribute ``_supports_sdpa`` (transformers' own default is False)."""
    return bool(getattr(model_class, "_supports_sdpa", False))
