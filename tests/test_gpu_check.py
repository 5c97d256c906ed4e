"""make gpu-check's report, exit status and notebook-cell reporting, checked on the CPU with given check results.

The GPU checks themselves run real processes (helpers.checks.training_checks); their CPU runs are in test_finetune.py and
test_resume.py. Nothing here pretends that a GPU exists.
"""

import json
import subprocess
import sys

import pytest
import torch

from helpers.checks.gpu_check import first_failing_cell, report, run_checks

MACHINE = {"gpus": 2, "names": ["GPU A", "GPU B"], "torch": "2.13.0", "cuda": "12.8", "python": "3.11.7"}


def test_a_failing_check_fails_the_report_and_a_raising_one_does_not_stop_the_others():
    def broken():
        raise RuntimeError("CUDA error: invalid device ordinal")

    rows = run_checks({"ddp": lambda: [(True, "DDP 2 processes over nccl: ...")], "resume": broken,
                       "notebooks": lambda: [(False, "notebook notebooks/06_ddp_torchrun.ipynb: cell 37: KeyError: x")]})
    text, data = report(rows, MACHINE)
    assert text.splitlines() == [
        "gpu-check on 2 GPU(s): GPU A, GPU B; torch 2.13.0, CUDA 12.8",
        "ok   [ddp] DDP 2 processes over nccl: ...",
        "FAIL [resume] raised RuntimeError: CUDA error: invalid device ordinal",
        "FAIL [notebooks] notebook notebooks/06_ddp_torchrun.ipynb: cell 37: KeyError: x",
        "gpu-check: FAILED (2 failure(s) of 3 checks)"]
    assert json.loads(json.dumps(data)) == {"result": "failed", "failures": 2, "machine": MACHINE, "checks": [
        {"section": "ddp", "ok": True, "line": "DDP 2 processes over nccl: ..."},
        {"section": "resume", "ok": False, "line": "raised RuntimeError: CUDA error: invalid device ordinal"},
        {"section": "notebooks", "ok": False,
         "line": "notebook notebooks/06_ddp_torchrun.ipynb: cell 37: KeyError: x"}]}


def test_all_passing_checks_pass_and_a_lines_own_status_word_is_not_repeated():
    text, data = report(run_checks({"memory": lambda: [(True, "ok   1 GPU, B=8 ..."), (True, "info kernels")]}), MACHINE)
    assert text.splitlines()[1:] == ["ok   [memory] 1 GPU, B=8 ...", "ok   [memory] info kernels",
                                     "gpu-check: passed (0 failure(s) of 2 checks)"]
    assert data["result"] == "passed"


def code_cell(outputs, tags=()):
    return {"cell_type": "code", "metadata": {"tags": list(tags)}, "outputs": outputs, "source": ""}


def error(name, value):
    return {"output_type": "error", "ename": name, "evalue": value, "traceback": []}


def test_the_first_unexpected_error_is_named_by_cell_index(tmp_path):
    notebook = tmp_path / "x.ipynb"
    cells = [{"cell_type": "markdown", "metadata": {}, "source": "# title"},
             code_cell([error("AttributeError", "'DataParallel' object has no attribute 'bert'")], ["raises-exception"]),
             code_cell([{"output_type": "stream", "name": "stdout", "text": "ok\n"}]),
             code_cell([error("JSONDecodeError", "Expecting value: line 1 column 1 (char 0)")]),
             code_cell([error("NameError", "name 'result' is not defined")])]
    notebook.write_text(json.dumps({"cells": cells}))
    assert first_failing_cell(notebook) == "cell 3: JSONDecodeError: Expecting value: line 1 column 1 (char 0)"
    notebook.write_text(json.dumps({"cells": cells[:3]}))
    assert first_failing_cell(notebook) is None


def test_without_cuda_the_json_report_says_skipped(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA; make gpu-check runs the real check")
    run = subprocess.run([sys.executable, "-m", "helpers.checks.gpu_check", "--json", str(tmp_path / "r.json")],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.count("\n") == 1
    assert json.loads((tmp_path / "r.json").read_text())["result"] == "skipped"
