"""The private PyTorch surfaces of helpers.memory.torch_private: the version check warns once on another torch and
stays silent on the tested one, a missing surface or changed signature fails in one line naming the torch the
series needs, and the facts the predictor maps (the trackers' kinds, FSDP2's collectives) are this torch's."""

import json
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from helpers.memory import categories, torch_private
from helpers.memory.torch_private import TESTED, TorchSurfaceMissing, attribute, positional_operator, untested

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


def test_another_torch_is_warned_about_once_naming_the_tested_one():
    (message,) = untested_warnings("2.14.1")
    assert "tested with torch 2.13.0, this is torch 2.14.1" in message


def test_a_missing_surface_fails_in_one_line_naming_the_torch_needed():
    with pytest.raises(TorchSurfaceMissing) as raised:
        attribute("torch.distributed._tools.no_such_tracker", "MemTracker")
    message = str(raised.value)
    assert isinstance(raised.value, ImportError) and "\n" not in message
    assert message == (f"helpers.memory needs torch 2.13 (tested with 2.13.0); torch {torch.__version__} has no "
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
    for name in torch_private.FSDP2_COLLECTIVES.values():
        assert callable(getattr(dist, name)) and f"dist.{name}(" in source
    seen = []
    original = dist.all_gather_single
    with torch_private.seeing_fsdp2_collectives(lambda kind, tensor: seen.append(kind)):
        assert dist.all_gather_single is not original
    assert dist.all_gather_single is original and seen == []
