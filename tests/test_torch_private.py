"""The private PyTorch surfaces of helpers.torch_private: the version check warns once on another torch and
stays silent on the tested one, a missing surface or changed signature fails in one line naming the torch the
series needs, and the facts the predictor maps (the trackers' kinds, FSDP2's collectives) are this torch's."""

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
