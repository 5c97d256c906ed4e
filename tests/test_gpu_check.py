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


def test_each_row_is_emitted_before_the_next_check_runs():
    order = []

    def slow_check():
        yield True, "first"
        order.append("second started")
        yield False, "second"

    run_checks({"memory": slow_check, "resume": lambda: [(True, "third")]},
               emit=lambda row: order.append(row["line"]))
    assert order == ["first", "second started", "second", "third"]


def test_a_memory_gap_names_its_causes():
    from helpers.checks.gpu_check import gap_causes, within_tolerance
    from helpers.memory import CudaPeak

    mib = 2**20
    predicted = {"workspaces": 65 * mib, "total": 3814 * mib}
    assert within_tolerance(3814 * mib, 3829 * mib, amp=None) and not within_tolerance(3814 * mib, 3831 * mib, amp=None)
    for amp in ("bf16", "fp16"):
        assert within_tolerance(3814 * mib, 3861 * mib, amp) and not within_tolerance(100 * mib, 103 * mib, amp)
    causes = gap_causes(predicted, 3810 * mib, CudaPeak(leftover=17 * mib, before=0, peak=3900 * mib,
                                                        requested=3880 * mib, held_after=17 * mib + 41 * mib),
                        "cuDNN", "flash")
    assert causes == ["17.0 MiB were allocated before the model was built: earlier code still holds tensors",
                      "this GPU runs the flash attention kernel; the prediction traced cuDNN",
                      "after the step this GPU keeps 41.0 MiB (cuBLAS/cuBLASLt workspaces); the prediction has 65.0 MiB"]
    rounding = gap_causes(predicted, 3810 * mib, CudaPeak(0, 0, 3900 * mib, 3810 * mib, 65 * mib), "cuDNN", "cuDNN")
    assert rounding == ["the requested bytes agree (+0.0 MiB): the blocks differ, i.e. the allocator rounded or "
                        "reused blocks otherwise than simulated"]
    unknown = gap_causes(predicted, 3810 * mib, CudaPeak(0, 0, 3900 * mib, 3890 * mib, 65 * mib), "cuDNN", "cuDNN")
    assert unknown[0].startswith("the requested bytes differ by +80.0 MiB")


def test_the_memory_grid_and_partial_runs():
    from helpers.checks.gpu_check import MemoryCase, arguments, memory_cases, series_notebooks

    assert len(memory_cases(1, "bf16")) == 26 and len(memory_cases(2, "fp16")) == 28  # with the 2 lever cases
    assert {case.amp for case in memory_cases(1, "fp16")} == {None, "fp16"}  # a T4: fp16 with a GradScaler
    assert MemoryCase(16, 512, amp="bf16", accumulation=2).label("cuDNN") == \
        "1 GPU, cuDNN, bf16, B=16, L=512, accumulation 2"
    assert [path.name for path in series_notebooks("08*")] == ["08_fsdp2.ipynb"]
    assert all(path.parent.name == "solutions" for path in series_notebooks("solutions/*"))
    assert arguments(["--only", "memory,resume"]).only == ["memory", "resume"]
    with pytest.raises(SystemExit):
        arguments(["--only", "memroy"])
