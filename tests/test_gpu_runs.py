"""The folder a GPU run leaves for the site (helpers.checks.gpu_runs): written from executed notebooks with only the
notebooks kept, read back with its metadata, and refused with the file and field named when it is malformed."""

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from helpers.checks import gpu_runs

ROOT = Path(__file__).resolve().parents[1]
H200 = {"machine": "16 CPU cores", "gpus": ["NVIDIA H200"], "torch": "2.11.0+cu130", "cuda": "13.0",
        "driver": "580.159.04", "python": "3.12.3", "date": "2026-12-04", "commit": "a7c4c7c", "note": "a test"}


def executed_notebook(path: Path, text: str) -> None:
    cell = {"cell_type": "code", "execution_count": 1, "id": "a", "source": "print(1)",
            "metadata": {"tags": ["x"], "execution": {"iopub.execute_input": "2026-12-04T16:51:08Z"}},
            "outputs": [{"output_type": "stream", "name": "stdout", "text": text}]}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"cells": [cell], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))


@pytest.fixture
def executed(tmp_path) -> Path:
    """A scratch folder as gpu-check leaves it: notebooks, one-GPU edited copies, data a notebook wrote."""
    scratch = tmp_path / "scratch" / "notebooks"
    executed_notebook(scratch / "00_setup.ipynb", "cuda\n")
    executed_notebook(scratch / "solutions/05_solutions.ipynb", "solution on cuda\n")
    executed_notebook(scratch / "edited/03_dataparallel_attributeerror.ipynb", "not executed\n")
    (scratch / "snapshot.pickle").write_bytes(b"\x80\x04")
    (scratch / "scratch-08").mkdir()
    return scratch


def test_a_written_run_holds_only_the_notebooks_at_their_paths_and_reads_back(executed, tmp_path):
    run = gpu_runs.write(tmp_path / "runs/2026-12-04-h200", executed, H200)
    files = sorted(str(path.relative_to(run.folder)) for path in run.folder.rglob("*") if path.is_file())
    assert files == ["notebooks/00_setup.ipynb", "notebooks/solutions/05_solutions.ipynb", "run.json"]
    again = gpu_runs.read(tmp_path / "runs/2026-12-04-h200")
    assert again == run and again.gpus == ["NVIDIA H200"] and again.driver == "580.159.04"
    assert list(again.notebooks()) == ["00_setup.ipynb", "solutions/05_solutions.ipynb"]
    cell = again.notebook("solutions/05_solutions.ipynb")["cells"][0]
    assert cell["outputs"][0]["text"] == "solution on cuda\n" and cell["metadata"] == {"tags": ["x"]}
    assert again.notebook("01_define_network.ipynb") is None


def test_labels_and_folder_names_say_which_gpus_and_torch():
    run = gpu_runs.GpuRun(Path("x"), **H200)
    assert run.label == "NVIDIA H200, torch 2.11"
    two = {**H200, "gpus": ["NVIDIA A100-SXM4-80GB"] * 2, "torch": "2.13.0", "date": "2027-01-10"}
    assert gpu_runs.GpuRun(Path("x"), **two).label == "2× NVIDIA A100-SXM4-80GB, torch 2.13"
    assert gpu_runs.folder_name(H200) == "2026-12-04-h200"
    assert gpu_runs.folder_name(two) == "2027-01-10-2x-a100-sxm4-80gb"


@pytest.mark.parametrize("change, message", [
    ({"torch": None}, "field 'torch' must be a string, found None"),
    ({"gpus": "NVIDIA H200"}, "field 'gpus' must be a non-empty list of GPU names"),
    ({"gpus": []}, "field 'gpus' must be a non-empty list"),
    ({"date": "4.12.2026"}, "field 'date' must be YYYY-MM-DD"),
    ({"driver": None, "colour": "green"}, "unknown field\\(s\\) colour"),
])
def test_a_malformed_run_json_is_refused_naming_the_file_and_field(executed, tmp_path, change, message):
    run = gpu_runs.write(tmp_path / "run", executed, H200)
    (run.folder / "run.json").write_text(json.dumps({**H200, **change}))
    with pytest.raises(ValueError, match=f"run.json: {message}"):
        gpu_runs.read(run.folder)


def test_a_folder_without_metadata_or_notebooks_is_refused(executed, tmp_path):
    with pytest.raises(ValueError, match="run.json: missing"):
        gpu_runs.read(tmp_path)
    run = gpu_runs.write(tmp_path / "run", executed, H200)
    (run.folder / "run.json").write_text("{")
    with pytest.raises(ValueError, match="run.json: not valid JSON"):
        gpu_runs.read(run.folder)
    (run.folder / "run.json").write_text(json.dumps({key: H200[key] for key in H200 if key != "cuda"}))
    with pytest.raises(ValueError, match="missing field\\(s\\) cuda"):
        gpu_runs.read(run.folder)
    shutil.rmtree(run.folder / "notebooks")
    (run.folder / "run.json").write_text(json.dumps(H200))
    with pytest.raises(ValueError, match="no executed notebooks"):
        gpu_runs.read(run.folder)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_without_a_gpu_this_machine_cannot_describe_a_gpu_run():
    metadata = gpu_runs.this_machine("note")
    assert metadata["gpus"] == [] and re.match(r"([0-9a-f]{7}|unknown)( with local changes)?$", metadata["commit"])
    with pytest.raises(ValueError, match="field 'gpus' must be a non-empty list of GPU names, found \\[\\]"):
        gpu_runs.check_metadata(metadata, "run metadata")


def test_every_committed_run_reads_and_holds_notebooks_of_the_series():
    folders = sorted(path for path in (ROOT / "docs/gpu-runs").iterdir() if path.is_dir())
    assert folders, "docs/gpu-runs/ holds the H200 run of 2026-12-04"
    for folder in folders:
        run = gpu_runs.read(folder)
        assert folder.name == gpu_runs.folder_name(gpu_runs.check_metadata(
            json.loads((folder / "run.json").read_text()), "run.json"))
        extra = {path.relative_to(folder).as_posix() for path in folder.rglob("*") if path.is_file()} - {
            "run.json", *(f"notebooks/{name}" for name in run.notebooks())}
        assert not extra, f"{folder.name} holds more than run.json and notebooks: {sorted(extra)}"
        assert all((ROOT / "notebooks" / name).is_file() for name in run.notebooks())


def test_gpu_check_keep_leaves_the_executed_notebooks_as_a_run_folder(executed, monkeypatch, capsys):
    """What ``make gpu-check GPU_CHECK_ARGS="--keep DIR"`` does after its checks, on a stand-in one-GPU machine
    (no check runs here: they need CUDA; the notebooks are those of the ``executed`` fixture)."""
    from helpers.checks import gpu_check

    monkeypatch.setattr(gpu_check.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu_check.torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(gpu_check, "gpu_checks", lambda gpus, scratch, notebooks: {})  # no check: CUDA is a stand-in
    monkeypatch.setattr(gpu_check, "machine", lambda: {"gpus": 1, "names": ["NVIDIA H200"], "torch": "2.11.0",
                                                       "cuda": "13.0", "python": "3.12.3"})
    monkeypatch.setattr(gpu_runs, "this_machine", lambda note: {**H200, "note": note})
    keep = executed.parent
    assert gpu_check.main(["--keep", str(keep)]) == 0
    run = gpu_runs.read(keep / "gpu-runs" / "2026-12-04-h200")
    assert list(run.notebooks()) == ["00_setup.ipynb", "solutions/05_solutions.ipynb"]
    assert run.note == "make gpu-check --keep"
    assert f"executed notebooks for the site: {run.folder}" in capsys.readouterr().out


def test_a_written_run_keeps_code_cells_and_leaves_out_what_failed(tmp_path):
    """A page shows the stored notebook's prose and never a traceback from a cell not meant to raise (it would
    show that machine's paths); a cell tagged raises-exception keeps its error."""
    error = {"output_type": "error", "ename": "RuntimeError", "evalue": "x", "traceback": ["/opt/venv/x.py"]}
    printed = {"output_type": "stream", "name": "stdout", "text": "before the error\n"}
    cells = [{"cell_type": "markdown", "id": "m", "metadata": {}, "source": "# 00 on that machine"},
             {"cell_type": "code", "execution_count": 1, "id": "a", "metadata": {}, "source": "fail()",
              "outputs": [printed, error]},
             {"cell_type": "code", "execution_count": 2, "id": "b", "metadata": {"tags": ["raises-exception"]},
              "source": "net.bert", "outputs": [error]}]
    notebook = tmp_path / "executed/00_setup.ipynb"
    notebook.parent.mkdir()
    notebook.write_text(json.dumps({"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))
    kept = gpu_runs.write(tmp_path / "run", notebook.parent, H200).notebook("00_setup.ipynb")["cells"]
    assert [(cell["id"], cell["outputs"]) for cell in kept] == [("a", []), ("b", [error])]
