"""Colab and Kaggle as pasted: the README's first cell (run by IPython, as a notebook runs it) fetches the repository
from a git URL, an uploaded .zip or an uploaded folder and runs tools/colab_kaggle_setup.py; the script's decisions
(what pip installs, when to restart, what it says about torch and the GPUs) without pip; WORKSHOP.md's two-GPU
pre-check cells, run here on the CPU, print what WORKSHOP says a machine without GPUs prints."""

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("colab_kaggle_setup", ROOT / "tools" / "colab_kaggle_setup.py")
setup = importlib.util.module_from_spec(spec)
spec.loader.exec_module(setup)


def python_blocks(markdown: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", markdown, re.DOTALL | re.MULTILINE)


def first_cell() -> str:
    (cell,) = [block for block in python_blocks((ROOT / "README.md").read_text(encoding="utf-8")) if "%run" in block]
    return cell


def run_ipython(code: str, cwd: Path, timeout: int = 120, env: dict | None = None) -> subprocess.CompletedProcess:
    script = cwd / "cell.ipy"  # .ipy: IPython's syntax, %run and {expansion} included
    script.write_text(code, encoding="utf-8")
    return subprocess.run([sys.executable, "-m", "IPython", "--quick", "--no-banner", "--colors=NoColor", str(script)],
                          cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)


def with_repo(cell: str, repo: str) -> str:
    assert cell.count('REPO = ""') == 1, "the cell sets REPO in one place, empty until the reader fills it"
    return cell.replace('REPO = ""', f"REPO = {repo!r}")


@pytest.fixture
def repository(tmp_path) -> Path:
    """A copy of this repository as GitHub's 'Download ZIP' unpacks it, with a stand-in setup script that records
    the folder it ran in and the sys.path it was given."""
    top = tmp_path / "upload" / "bert-ja-multigpu-main"
    (top / "tools").mkdir(parents=True)
    (top / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    (top / "node_modules" / "pkg").mkdir(parents=True)
    (top / "node_modules" / "pkg" / "pyproject.toml").write_text("")  # deeper: not the repository's root
    (top / "tools" / "colab_kaggle_setup.py").write_text(
        "from pathlib import Path\nPath('ran.txt').write_text(str(Path(__file__).resolve().parent.parent))\n")
    return top


def test_the_cell_refuses_to_run_until_repo_is_set(tmp_path):
    run = run_ipython(first_cell(), tmp_path)
    assert "ValueError: REPO is empty: set it to this repository's address" in run.stdout + run.stderr
    assert not (tmp_path / "bert-ja-multigpu").exists()


@pytest.mark.parametrize("source", ["zip", "folder", "git"])
def test_the_cell_fetches_the_repository_and_runs_the_setup(tmp_path, repository, source):
    work = tmp_path / "content"  # Colab's /content, Kaggle's /kaggle/working
    work.mkdir()
    if source == "zip":  # Colab: the .zip uploaded in the Files pane
        repo = shutil.make_archive(str(tmp_path / "bert-ja-multigpu-main"), "zip", repository.parent)
    elif source == "folder":  # Kaggle: a dataset, unpacked under /kaggle/input/NAME
        repo = str(repository.parent.parent)
    else:
        for command in (["init", "-q"], ["add", "."], ["-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "x"]):
            subprocess.run(["git", *command], cwd=repository, check=True, capture_output=True)
        repo = repository.as_uri()
    run = run_ipython(with_repo(first_cell(), repo), work)
    assert run.returncode == 0 and "Error" not in run.stdout + run.stderr, run.stdout + run.stderr
    home = work / "bert-ja-multigpu"
    assert (home / "pyproject.toml").exists() and (home / "tools" / "colab_kaggle_setup.py").exists()
    assert (work / "ran.txt").read_text() == str(home)  # %run ran the copy's own script, in the kernel's folder
    again = run_ipython(with_repo(first_cell(), str(tmp_path / "gone.zip")), work)  # a second run fetches nothing
    assert again.returncode == 0 and "Error" not in again.stdout + again.stderr


def test_a_folder_without_the_repository_is_named(tmp_path):
    (tmp_path / "empty").mkdir()
    run = run_ipython(with_repo(first_cell(), str(tmp_path / "empty")), tmp_path)
    assert f"ValueError: {tmp_path / 'empty'}: no pyproject.toml inside, so not a copy of this repository" in run.stdout + run.stderr


def test_it_installs_the_pinned_packages_the_platforms_lack_and_never_torch():
    pins = setup.pins()
    assert set(setup.HOSTED) <= set(pins) and "torch" not in setup.HOSTED and "jupyterlab" not in setup.HOSTED
    fresh = setup.missing({name: pins[name] for name in setup.HOSTED}, {"transformers": "4.57.1", "torch": "2.9.0"})
    assert "transformers==5.24.0" in fresh and len(fresh) == len(setup.HOSTED)
    commands = setup.pip_commands(ROOT, fresh, package_installed=False)
    assert commands[0][1:] == ["-m", "pip", "install", "--quiet", "--no-deps", "-e", str(ROOT)]
    assert commands[1][1:] == ["-m", "pip", "install", "--quiet", *fresh] and not any("torch==" in arg for arg in commands[1])
    everything = {name: pins[name] for name in setup.HOSTED}
    assert setup.pip_commands(ROOT, setup.missing(everything, everything), package_installed=True) == []


def test_a_restart_is_asked_for_only_where_the_kernel_holds_an_updated_module():
    owners = {"huggingface_hub": ["huggingface-hub"], "numpy": ["numpy"], "transformers": ["transformers"]}
    before, after = {"huggingface-hub": "0.36.0", "numpy": "2.0"}, {"huggingface-hub": "2.4.0", "numpy": "2.0",
                                                                     "transformers": "5.24.0"}
    assert setup.stale_modules(before, after, {"huggingface_hub", "numpy", "sys"}, owners) == ["huggingface_hub"]
    assert setup.stale_modules(before, after, {"numpy"}, owners) == []  # transformers is new but not imported yet


def test_the_report_names_torch_the_gpus_and_what_to_do_next():
    ready = setup.report("2.13.0+cu126", "2.13.0", ["Tesla T4", "Tesla T4"], [])
    assert ready == ["torch 2.13.0+cu126 (the platform's; the series is tested with 2.13.0)",
                     "GPUs torch sees: 2 (Tesla T4, Tesla T4)", "ready: run the notebook from its next cell"]
    no_gpu = setup.report("2.12.1+cu124", "2.13.0", [], [])
    assert "GPUs torch sees: 0; for a GPU, switch the runtime (Colab: Runtime > Change runtime type > T4 GPU; " \
           "Kaggle: Settings > Accelerator > GPU T4 x2)" in no_gpu[1]
    old = setup.report("2.5.1+cu121", "2.13.0", ["Tesla T4"], [])
    assert "pip install torch==2.13.0" in old[1] and not any(line.startswith("ready") for line in old)
    stale = setup.report("2.13.0", "2.13.0", ["Tesla T4"], ["huggingface_hub"])
    assert stale[-1].startswith("restart the session now (Colab: Runtime > Restart session")


def test_workshops_two_gpu_check_runs_as_notebook_cells(tmp_path):
    """The two cells of WORKSHOP.md's '先に確かめること', run on this machine (no GPU): they execute 03, 04 and
    solutions 04 and print the lines WORKSHOP says a machine without GPUs shows."""
    workshop = (ROOT / "WORKSHOP.md").read_text(encoding="utf-8")
    cells = python_blocks(workshop[workshop.index("**先に確かめること。**"):])
    assert len(cells) == 2 and not any(".venv" in cell or "<<" in cell for cell in cells)
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    run = run_ipython("\n".join(cells), tmp_path, timeout=900, env=env)
    lines = run.stdout.splitlines()
    assert run.returncode == 0 and lines[0] == f"executed into {tmp_path / 'dp-check'}: 3 notebooks", run.stdout + run.stderr
    assert "03_dataparallel_attributeerror.ipynb: CUDA GPUs: 0  DEVICE_IDS: []" in lines
    assert any(line.startswith("04_solutions.ipynb: ") and "71 of 73" in line for line in lines)
