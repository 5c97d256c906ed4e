import json
import re
from pathlib import Path

import pytest
import torch
from torch import nn

from helpers.devices import available_device_ids, has_gpus
from helpers.checks.notebook_env import lessons_then_solutions

ROOT = Path(__file__).resolve().parents[1]


def test_zero_gpus_are_always_there():
    assert has_gpus(0) is True


def test_missing_gpus_print_the_skip_line(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert has_gpus(1) is False
    assert has_gpus(2) is False
    assert capsys.readouterr().out == (
        "skipped: needs 1 CUDA GPU, torch sees 0\n"
        "skipped: needs 2 CUDA GPUs, torch sees 0\n"
    )


def test_this_machine_without_cuda(capsys):
    if torch.cuda.device_count():
        pytest.skip("this machine has CUDA GPUs")
    assert has_gpus(1) is False
    assert capsys.readouterr().out == "skipped: needs 1 CUDA GPU, torch sees 0\n"


def test_enough_gpus_print_nothing(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert has_gpus(2) is True
    assert has_gpus(1) is True
    assert capsys.readouterr().out == ""
    assert has_gpus(3) is False
    assert capsys.readouterr().out == "skipped: needs 3 CUDA GPUs, torch sees 2\n"


@pytest.mark.parametrize(("gpus", "expected"), [(0, []), (1, [0]), (2, [0, 1]), (8, [0, 1])])
def test_device_ids_are_the_gpus_the_machine_has_up_to_the_memos_two(monkeypatch, gpus, expected):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    assert available_device_ids() == expected


def test_device_ids_beyond_two_when_asked(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    assert available_device_ids(at_most=4) == [0, 1, 2]
    with pytest.raises(ValueError, match="at_most=0"):
        available_device_ids(at_most=0)


def test_this_machines_device_ids_wrap_without_error():
    net = nn.Linear(2, 2)
    wrapped = nn.DataParallel(net, device_ids=available_device_ids())
    assert wrapped.module is net and wrapped.device_ids == available_device_ids()


MEMO_LITERAL = re.compile(r"device_ids=\[\s*\d+\s*,[^\]]*\]")  # a literal list of two or more GPUs


def code_cells(notebook: Path):
    for index, cell in enumerate(json.loads(notebook.read_text(encoding="utf-8"))["cells"]):
        if cell["cell_type"] == "code":
            yield index, re.sub(r"#.*", "", "".join(cell["source"]))  # comments may quote the memo


@pytest.mark.parametrize("notebook", lessons_then_solutions(ROOT / "notebooks"), ids=lambda path: path.name)
def test_a_literal_list_of_gpus_runs_only_where_it_cannot_stop_a_one_gpu_reader(notebook):
    """The memo's device_ids=[0, 1] stops a one-GPU machine; a cell may show it only inside a try that reports the
    AssertionError, or behind has_gpus(n). Every other cell wraps with the machine's own DEVICE_IDS."""
    unguarded = [index for index, source in code_cells(notebook)
                 if MEMO_LITERAL.search(source) and not re.search(r"except \(?[\w, ]*AssertionError", source) and "has_gpus(" not in source]
    assert not unguarded, f"{notebook.name}: cells {unguarded} use a literal device_ids list unguarded"
