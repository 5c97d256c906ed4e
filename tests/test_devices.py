import pytest
import torch

from helpers.devices import has_gpus


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
