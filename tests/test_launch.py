"""helpers.launch decides how a notebook starts N processes: GPUs where there is one per process, else the CPU."""

import subprocess
import sys

import pytest

from helpers.launch import plan_launch


@pytest.mark.parametrize(("gpus", "device"), [(0, "cpu"), (1, "cpu"), (2, "cuda"), (8, "cuda")])
def test_two_processes_use_gpus_only_when_each_gets_one(gpus, device):
    launch = plan_launch(2, gpus=gpus)
    assert (launch.processes, launch.device) == (2, device)
    assert launch.torchrun("--epochs", "1")[-5:] == ["helpers.finetune", "--device", device, "--epochs", "1"]


def test_one_process_takes_the_one_gpu():
    assert plan_launch(1, gpus=1).device == "cuda"


def test_the_choice_is_printed_with_its_reason():
    assert str(plan_launch(2, gpus=1)) == "CUDA GPUs: 1; 2 processes on the CPU (gloo; one GPU per process needs 2 GPUs)"
    assert str(plan_launch(2, gpus=2)) == "CUDA GPUs: 2; 2 processes on one GPU each (NCCL)"


def test_no_processes_is_refused():
    with pytest.raises(ValueError, match="processes=0"):
        plan_launch(0, gpus=0)


def test_the_command_runs_here():
    """The command it builds starts real processes on this machine (torch sees no GPU here: the CPU)."""
    launch = plan_launch(2)
    run = subprocess.run(launch.torchrun("--help"), env=launch.env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "--device" in run.stdout
    assert launch.shell("--help").startswith(sys.executable)
