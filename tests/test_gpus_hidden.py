"""`make test` on a machine with GPUs: the stored outputs are a CPU's, so the comparison runs with every GPU hidden
from CUDA and says so in one line; `make gpu-check` is the test on the GPUs. Checked here without a GPU: the Makefile's
commands (`make -n`, with and without an nvidia-smi on PATH), the line for both kinds of machine, and two stored
notebooks compared strictly while NVML answers like Kaggle's two T4s (tests/fixtures/two_t4_nvml/pynvml.py)."""

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.checks.notebook_env import CPU, NOTEBOOK_ENV, compared_line, nvml_gpu_count

ROOT = Path(__file__).resolve().parent.parent
FAKE_NVML = ROOT / "tests" / "fixtures" / "two_t4_nvml"
needs_make = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")


def test_the_line_names_what_was_compared_and_the_gpus_it_hid():
    assert compared_line(19, "strict", 0) == ("19 notebook(s) compared (strict) with their stored outputs; "
                                              "run on the CPU (no NVIDIA GPU here), as the stored outputs were")
    on_kaggle = compared_line(19, "strict", 2)
    assert on_kaggle.startswith("19 notebook(s) compared (strict) with their stored outputs; run on the CPU with this "
                                "machine's 2 GPU(s) hidden (CUDA_VISIBLE_DEVICES=)")
    assert on_kaggle.endswith("`make gpu-check` is the test on the GPUs")
    assert compared_line(0, "strict", 1).startswith("no notebook compared; run on the CPU with this machine's 1 GPU(s)")


def test_the_gpu_count_is_nvmls_and_0_without_a_driver(monkeypatch):
    spec = importlib.util.spec_from_file_location("pynvml", FAKE_NVML / "pynvml.py")
    fake = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fake)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    assert nvml_gpu_count() == 2

    def no_driver():
        raise fake.NVMLError("NVML Shared Library Not Found")

    monkeypatch.setattr(fake, "nvmlInit", no_driver)
    assert nvml_gpu_count() == 0
    monkeypatch.setitem(sys.modules, "pynvml", None)  # nvidia-ml-py not installed: import fails
    assert nvml_gpu_count() == 0


def dry_run(target: str, *variables: str, path: str) -> list[str]:
    """The commands `make -n` would run for ``target``, with this interpreter as make's PYTHON."""
    run = subprocess.run(["make", "-n", target, f"PYTHON={sys.executable}", *variables], cwd=ROOT, capture_output=True,
                         text=True, timeout=60, env=os.environ | {"PATH": path})
    assert run.returncode == 0, run.stderr
    return run.stdout.splitlines()


@needs_make
def test_make_test_unit_and_notebooks_hide_the_gpus_and_gpu_check_and_lab_do_not(tmp_path):
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "nvidia-smi").write_text("#!/bin/sh\necho 'GPU 0: Tesla T4'\necho 'GPU 1: Tesla T4'\n")
    (fake_bin / "nvidia-smi").chmod(0o755)
    hidden = " ".join(f"{name}={value}" for name, value in (NOTEBOOK_ENV | CPU).items())
    visible = " ".join(f"{name}={value}" for name, value in NOTEBOOK_ENV.items())
    for path in (os.environ["PATH"], f"{fake_bin}:{os.environ['PATH']}"):  # without, then with a driver's nvidia-smi
        for target, variables, program in (("test", (), "-m pytest"), ("test", ("NB=00",), "-m pytest"),
                                           ("unit", (), "-m pytest"), ("notebooks", (), "jupyter nbconvert")):
            (command,) = [line for line in dry_run(target, *variables, path=path) if program in line][:1]
            assert command.strip().startswith(hidden + " "), (target, command)
        (gpu_check,) = [line for line in dry_run("gpu-check", path=path) if "helpers.checks.gpu_check" in line]
        assert gpu_check.startswith(visible + " .venv/bin/python")
        assert not any("CUDA_VISIBLE_DEVICES" in line for line in dry_run("lab", path=path))


PROBE = """
import os, subprocess, sys

def test_a_test_and_the_processes_it_starts_see_no_gpu_and_compute_with_one_thread():
    import torch
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "" and torch.get_num_threads() == 1
    child = [sys.executable, "-c",
             "import os, torch; print(repr(os.environ['CUDA_VISIBLE_DEVICES']), torch.get_num_threads())"]
    assert subprocess.run(child, capture_output=True, text=True, check=True).stdout == "'' 1\\n"
"""


def test_a_pytest_run_hides_the_gpus_the_shell_names_from_its_tests_and_their_kernels(tmp_path):
    """A shell that names two GPUs and two threads starts pytest: the repository's conftest.py (loaded by name here,
    since the probe lies outside the repository) hides the GPUs and sets one thread for the run's tests and for every
    process they start, as nbval's kernels are."""
    (tmp_path / "test_probe.py").write_text(PROBE, encoding="utf-8")
    env = os.environ | {"CUDA_VISIBLE_DEVICES": "0,1", "OMP_NUM_THREADS": "2",
                        "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "src")])}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "conftest",
                          str(tmp_path / "test_probe.py")], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stdout[-3000:]
    assert "1 passed" in run.stdout


def test_stored_outputs_compare_strictly_while_nvml_reports_two_t4s(tmp_path):
    """Notebooks 00 and 05 read NVML, which ignores CUDA_VISIBLE_DEVICES: with a driver reporting two T4s, their
    kernels must see CUDA hidden (even when the reader's shell names GPUs) and their stored outputs still compare."""
    log = tmp_path / "nvml.log"
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(FAKE_NVML), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
                        "FAKE_NVML_LOG": str(log), "CUDA_VISIBLE_DEVICES": "0,1"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbval",
                          "notebooks/00_setup.ipynb", "notebooks/05_gpu_memory.ipynb"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:]
    reads = log.read_text().splitlines()
    assert len(reads) >= 3 and set(reads) == {"CUDA_VISIBLE_DEVICES=''"}  # 00's summary, 05's table and its command
    assert re.search(r"^2 notebook\(s\) compared \(strict\) with their stored outputs; run on the CPU with this "
                     r"machine's 2 GPU\(s\) hidden \(CUDA_VISIBLE_DEVICES=\)", run.stdout, re.MULTILINE)
