"""The private PyTorch surfaces of helpers.torch_private: the version check warns once on another torch and
stays silent on the tested one, a missing surface or changed signature fails in one line naming the torch the
series needs, and the facts the predictor maps (the trackers' kinds, FSDP2's collectives) and what holds a process
group are this torch's."""

import io
import json
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from helpers import torch_private
from helpers.memory import categories
from helpers.torch_private import NEEDED, NEWEST, TESTED, TorchSurfaceMissing, attribute, positional_operator, untested

IMPORT_EVERYTHING = ("import helpers.memory.command, helpers.memory.fsdp2_table, helpers.lever_memory, "
                     "helpers.accumulation")


def untested_warnings(version: str | None) -> list[str]:
    """The UntestedTorchWarning messages of a fresh interpreter that imports the predictor and 09's counter, its
    ``torch.__version__`` set to ``version`` first (None: as installed)."""
    probe = ("import json, warnings, torch\n"
             + (f"torch.__version__ = {version!r}\n" if version else "")
             + "with warnings.catch_warnings(record=True) as caught:\n"
             + "    warnings.simplefilter('always')\n"
             + f"    {IMPORT_EVERYTHING}\n"
             + "print(json.dumps([str(w.message) for w in caught if w.category.__name__ == 'UntestedTorchWarning']))\n")
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_the_tested_torch_is_the_pinned_one_and_gets_no_warning():
    assert torch.__version__.split("+")[0] == TESTED
    assert untested("2.13.0+cpu") is None and untested("2.13.0+cu128") is None
    assert untested_warnings(None) == []


def test_a_torch_the_series_ran_on_is_not_warned_about_and_one_outside_is_once():
    """make torch-range ran every notebook on 2.10.0 and 2.14.1: Colab's 2.10.0+cu128 imports in silence."""
    assert (NEEDED, NEWEST) == ("2.10", "2.14")
    assert [untested(version) for version in ("2.10.0+cu128", "2.12.1", "2.14.1")] == [None, None, None]
    (message,) = untested_warnings("2.15.0")  # on import, once: the predictor and 09's counter import it
    assert message == ("helpers runs on torch 2.10 to 2.14 (pinned 2.13.0); torch 2.15.0 is newer than any it ran on: "
                       "parts of it rest on private PyTorch code that may differ (CONTRIBUTING.md, 'Upgrading torch')")
    assert "torch 2.9.1+cu126 is older than any it ran on" in untested("2.9.1+cu126")


def test_the_package_metadata_and_the_colab_cell_read_the_floor_stated_here():
    """pyproject.toml cannot import it, so a test holds it to NEEDED; the cell reads it without importing torch."""
    import importlib.util
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    dependencies = tomllib.loads((root / "pyproject.toml").read_text())["project"]["dependencies"]
    assert f"torch>={NEEDED}" in dependencies
    spec = importlib.util.spec_from_file_location("cell", root / "tools" / "colab_kaggle_setup.py")
    cell = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cell)
    assert cell.torch_range() == {"TESTED": TESTED, "NEEDED": NEEDED, "NEWEST": NEWEST}


def test_a_missing_surface_fails_in_one_line_naming_the_torch_needed():
    with pytest.raises(TorchSurfaceMissing) as raised:
        attribute("torch.distributed._tools.no_such_tracker", "MemTracker")
    message = str(raised.value)
    assert isinstance(raised.value, ImportError) and "\n" not in message
    assert message == (f"helpers needs torch 2.10 or newer (tested with 2.13.0); torch {torch.__version__} has no "
                       f"torch.distributed._tools.no_such_tracker.MemTracker")
    assert isinstance(raised.value.__cause__, ModuleNotFoundError)
    with pytest.raises(TorchSurfaceMissing, match=r"has no torch\.FakeTensorModeThatIsNot$"):
        attribute("torch", "FakeTensorModeThatIsNot")


def test_an_operator_whose_positional_arguments_moved_is_refused():
    """The fused attention kernels are called with positional arguments: an argument inserted before dropout_p
    would silently take its value, so the schema is checked."""
    positional_operator("_scaled_dot_product_efficient_attention", ("query", "key", "value", "attn_bias"))
    with pytest.raises(TorchSurfaceMissing, match=r"aten\._scaled_dot_product_flash_attention\(query, key, value, "
                                                  r"attn_bias, \.\.\.\); it takes \(query, key, value, dropout_p"):
        positional_operator("_scaled_dot_product_flash_attention", ("query", "key", "value", "attn_bias"))


def test_every_kind_the_trackers_file_under_has_a_word():
    kinds = torch_private.tracker_kinds()
    assert set(kinds["MemTracker"]) == set(categories.MEMTRACKER)
    assert set(kinds["FSDPMemTracker"]) == set(categories.FSDP_MEMTRACKER)
    with pytest.raises(ValueError, match=r"the tracker reports kinds \['Swap'\] that helpers.memory.categories"):
        categories.in_words({"Parameter": 4, "Swap": 8}, categories.MEMTRACKER)


def test_fsdp2_calls_the_collectives_the_counter_watches():
    """FSDP2's own module calls each function by name; the counter wraps exactly those."""
    import torch.distributed.fsdp._fully_shard._fsdp_collectives as collectives

    source = open(collectives.__file__, encoding="utf-8").read()
    names = torch_private.fsdp2_collective_names(dist)
    assert names == {"all-gather": "all_gather_single", "reduce-scatter": "reduce_scatter_single"}  # torch 2.13
    for name in names.values():
        assert callable(getattr(dist, name)) and f"dist.{name}(" in source
    seen = []
    original = dist.all_gather_single
    with torch_private.seeing_fsdp2_collectives(lambda kind, tensor: seen.append(kind)):
        assert dist.all_gather_single is not original
    assert dist.all_gather_single is original and seen == []


@pytest.fixture
def fake_group():
    """A process group of 2 ranks in this process (rank 0): collectives return at once, with the right shapes."""
    dist.init_process_group("fake", store=torch_private.fake_store(), rank=0, world_size=2)
    yield
    dist.destroy_process_group()


def test_on_a_torch_without_the_single_collectives_the_counter_watches_the_older_ones(monkeypatch, fake_group):
    """Older torches have no all_gather_single/reduce_scatter_single, and their FSDP2 calls
    ``dist.all_gather_into_tensor(output_tensor=..., input_tensor=...)`` and ``dist.reduce_scatter_tensor(output,
    input, ...)``: the counter sees those, as FSDP2 calls them, and puts them back afterwards."""
    monkeypatch.delattr(dist, "all_gather_single")
    monkeypatch.delattr(dist, "reduce_scatter_single")
    originals = dist.all_gather_into_tensor, dist.reduce_scatter_tensor
    assert torch_private.fsdp2_collective_names(dist) == {"all-gather": "all_gather_into_tensor",
                                                          "reduce-scatter": "reduce_scatter_tensor"}
    seen = []
    gathered, shard, grads = torch.zeros(8), torch.ones(4), torch.ones(6)
    with torch_private.seeing_fsdp2_collectives(lambda kind, tensor: seen.append((kind, tensor))):
        with pytest.warns(FutureWarning, match="is deprecated"):  # in torch 2.13, which has the new ones
            dist.all_gather_into_tensor(output_tensor=gathered, input_tensor=shard, async_op=False)
            dist.reduce_scatter_tensor(torch.zeros(3), grads, op=dist.ReduceOp.SUM)
    assert [(kind, tensor is expected) for (kind, tensor), expected in zip(seen, (gathered, grads))] == [
        ("all-gather", True), ("reduce-scatter", True)]
    assert (dist.all_gather_into_tensor, dist.reduce_scatter_tensor) == originals


def test_a_torch_with_neither_collective_fails_in_one_line_naming_the_torch_needed(monkeypatch):
    monkeypatch.delattr(dist, "reduce_scatter_single")
    monkeypatch.delattr(dist, "reduce_scatter_tensor")
    with pytest.raises(TorchSurfaceMissing) as raised:
        with torch_private.seeing_fsdp2_collectives(lambda kind, tensor: None):
            pass
    assert str(raised.value) == (f"helpers needs torch 2.10 or newer (tested with 2.13.0); torch {torch.__version__} has "
                                 f"no torch.distributed.reduce_scatter_single or reduce_scatter_tensor (FSDP2's "
                                 f"reduce-scatter)")
    assert hasattr(dist, "all_gather_single")  # nothing was left wrapped


def test_a_memory_snapshot_is_recorded_written_and_stopped(monkeypatch, tmp_path):
    """Notebook 05's snapshot goes through torch_private (a CUDA build records; here the functions are stand-ins
    with torch's signatures)."""
    import torch.cuda.memory as cuda_memory

    calls = []

    def record(enabled="all", context="all", stacks="all", max_entries=2**63 - 1, device=None):
        calls.append(("record", enabled, max_entries))

    monkeypatch.setattr(cuda_memory, "_record_memory_history", record)
    monkeypatch.setattr(cuda_memory, "_dump_snapshot", lambda filename: calls.append(("dump", filename)))
    with torch_private.recording_memory_history(str(tmp_path / "snapshot.pickle")):
        calls.append("step")
    assert calls == [("record", "all", 100_000), "step", ("dump", str(tmp_path / "snapshot.pickle")),
                     ("record", None, 2**63 - 1)]
    monkeypatch.delattr(cuda_memory, "_dump_snapshot")
    with pytest.raises(TorchSurfaceMissing, match=r"needs torch 2\.10 or newer .* has no torch\.cuda\.memory\._dump_snapshot$"):
        with torch_private.recording_memory_history("snapshot.pickle"):
            pass


# --- the checkpoints' surfaces ------------------------------------------------------------------------------------

def test_a_step_without_hooks_steps_and_runs_no_hook():
    """How a checkpoint learns the state an optimizer keeps, without touching the caller's optimizer or hooks."""
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    weight = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.Adam([weight], lr=0.5)
    fired = []
    handles = [register_optimizer_step_pre_hook(lambda *args: fired.append("global")),
               optimizer.register_step_post_hook(lambda *args: fired.append("own"))]
    try:
        weight.grad = torch.ones(3)
        torch_private.step_without_hooks(optimizer)
    finally:
        for handle in handles:
            handle.remove()
    reference = torch.nn.Parameter(torch.ones(3))
    reference.grad = torch.ones(3)
    torch.optim.Adam([reference], lr=0.5).step()
    assert fired == [] and torch.equal(weight.detach(), reference.detach()) and weight[0] < 0.51  # it stepped
    assert sorted(optimizer.state[weight]) == ["exp_avg", "exp_avg_sq", "step"]

    class Unwrapped:
        def step(self):
            pass
    with pytest.raises(TorchSurfaceMissing, match=r"has no Unwrapped\.step\.__wrapped__ \(the step inside the "
                                                  r"wrapper that runs its hooks\)$"):
        torch_private.step_without_hooks(Unwrapped())


def test_the_unpickler_asks_before_it_changes_an_object_and_tells_what_it_made():
    import pickle

    class Watching(torch_private.HookedUnpickler):
        def __init__(self, data):
            super().__init__(io.BytesIO(data))
            self.seen = []

        def made(self, obj):
            self.seen.append(("made", type(obj).__name__))

        def building(self, target, state):
            self.seen.append(("building", type(target).__name__, state))

        def adding_items(self, target):
            self.seen.append(("adding", type(target).__name__))

    data = pickle.dumps([torch.Size([2, 3]), {"a": 1}], protocol=4)
    watching = Watching(data)
    assert watching.load() == [torch.Size([2, 3]), {"a": 1}]
    assert ("made", "Size") in watching.seen and ("adding", "list") in watching.seen and ("adding", "dict") in \
        watching.seen
    refusing = type("Refusing", (torch_private.HookedUnpickler,), {"building": lambda self, target, state: 1 / 0})
    with pytest.raises(ZeroDivisionError):  # BUILD asks first: nothing is set
        refusing(io.BytesIO(b"\x80\x04cpathlib\nPurePath\nN}\x8c\x01xNs\x86b.")).load()
    import pathlib
    assert "x" not in vars(pathlib.PurePath)


def test_the_checkpoints_private_names_are_this_torchs():
    """DCP's metadata pickles these names, and the checkpoints read the scaler's and a schedule's state by them."""
    found = torch_private.dcp_private_globals()
    assert [f"{module}.{name}" for module, name in found] == [
        "torch.distributed.checkpoint.filesystem._StorageInfo", "torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING",
        "torch.serialization._get_layout"]
    assert found[("torch.serialization", "_get_layout")]("torch.strided") is torch.strided
    assert torch_private.dcp_chunk_place()("__0_0.distcp", 0, 10).length == 10
    assert set(torch.amp.GradScaler("cpu").state_dict()) == set(torch_private.grad_scaler_state())
    scheduler = torch.optim.lr_scheduler.LambdaLR(torch.optim.SGD([torch.zeros(1, requires_grad=True)]), lambda _: 1)
    assert set(torch_private.schedule_position()) <= set(scheduler.state_dict())
    assert set(torch_private.GRAD_SCALER_POSITION) < set(torch_private.GRAD_SCALER_STATE)


# --- what holds a process group; torch.compile's wrapper ------------------------------------------------------

def test_what_holds_a_process_group_is_where_the_release_looks():
    """DDP keeps its group in ``reducer``, ``logger`` and ``process_group``; a device mesh in its registry; FSDP2's
    view of the mesh in its own attributes. Releasing drops each, and only the groups it is given."""
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from helpers import distributed

    distributed.init_process_group(torch.device("cpu"))
    try:
        (group,) = torch_private.live_process_groups()
        assert group is dist.group.WORLD
        ddp = nn.parallel.DistributedDataParallel(nn.Linear(2, 2))
        torch_private.release_ddp(ddp)
        assert not set(torch_private.DDP_GROUP_HOLDERS) & vars(ddp).keys()
        mesh = init_device_mesh("cpu", (1,))
        sharded = fully_shard(nn.Linear(2, 2), mesh=mesh)
        info = sharded._get_fsdp_state()._fsdp_param_group.mesh_info
        assert list(mesh._pg_registry.values()) == [group] and info.shard_process_group is group
        torch_private.release_meshes([])  # none of its groups: nothing changes
        assert list(mesh._pg_registry.values()) == [group] and info.shard_process_group is group
        torch_private.release_meshes([group])
        assert mesh._pg_registry == {} and info.shard_process_group is None
    finally:
        distributed.leave_process_group()


def test_a_torch_that_moved_what_holds_a_group_fails_in_one_line(monkeypatch):
    """Where a torch renamed one of them, the release says so instead of leaving the group alive (which brings back
    issue 39's abort at exit)."""
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh

    from helpers import distributed

    distributed.init_process_group(torch.device("cpu"))
    try:
        ddp = nn.parallel.DistributedDataParallel(nn.Linear(2, 2))
        del ddp.reducer
        with pytest.raises(TorchSurfaceMissing, match=r"has no DistributedDataParallel\.reducer \(what holds its"):
            torch_private.release_ddp(ddp)
        mesh = init_device_mesh("cpu", (1,))
        monkeypatch.delattr(mesh, "_pg_registry")
        with pytest.raises(TorchSurfaceMissing, match=r"has no DeviceMesh\._pg_registry"):
            torch_private.release_meshes(torch_private.live_process_groups())
        monkeypatch.undo()
    finally:
        distributed.leave_process_group()
    compiled = torch.compile(nn.Linear(2, 2))
    assert torch_private.compiled_inner(compiled) is compiled._orig_mod
    monkeypatch.delattr(sys.modules["torch._dynamo.eval_frame"], "OptimizedModule")
    with pytest.raises(TorchSurfaceMissing, match=r"has no torch\._dynamo\.eval_frame\.OptimizedModule"):
        torch_private.compiled_inner(compiled)
