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
import sysconfig
import tomllib
import zipfile
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
    versions = {"TESTED": "2.13.0", "NEEDED": "2.10", "NEWEST": "2.14"}
    ready = setup.report("2.10.0+cu128", versions, ["Tesla T4", "Tesla T4"], [])
    assert ready == ["torch 2.10.0+cu128 (the platform's, kept; the series ran on torch 2.10 to 2.14)",
                     "GPUs torch sees: 2 (Tesla T4, Tesla T4)", "ready: run the notebook from its next cell"]
    no_gpu = setup.report("2.12.1+cu124", versions, [], [])
    assert "GPUs torch sees: 0; for a GPU, switch the runtime (Colab: Runtime > Change runtime type > T4 GPU; " \
           "Kaggle: Settings > Accelerator > GPU T4 x2)" in no_gpu[1]
    newer = setup.report("2.15.0+cu130", versions, ["Tesla T4"], [])
    assert newer[0].endswith("the series ran on torch 2.10 to 2.14, not on this newer one yet)") and newer[-1].startswith("ready")
    old = setup.report("2.9.1+cu126", versions, ["Tesla T4"], [])
    assert "older than 2.10, so nothing was installed; pip install torch==2.13.0" in old[0]
    assert not any(line.startswith("ready") for line in old)
    stale = setup.report("2.13.0", versions, ["Tesla T4"], ["huggingface_hub"])
    assert stale[-1].startswith("restart the session now (Colab: Runtime > Restart session")


def stand_in_wheel(folder: Path, name: str, version: str, module: str, code: str = "", requires=()) -> Path:
    """A wheel of ``name`` ``version`` holding ``module``/__init__.py with ``code`` and ``__version__``."""
    stem = f"{name.replace('-', '_')}-{version}"
    files = {f"{module}/__init__.py": f"{code}\n__version__ = {version!r}\n",
             f"{stem}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
                                           + "".join(f"Requires-Dist: {r}\n" for r in requires),
             f"{stem}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
             f"{stem}.dist-info/top_level.txt": f"{module}\n"}
    files[f"{stem}.dist-info/RECORD"] = "".join(f"{path},,\n" for path in files) + f"{stem}.dist-info/RECORD,,\n"
    wheel = folder / f"{stem}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for path, text in files.items():
            archive.writestr(path, text)
    return wheel


STAND_IN_TORCH = """import pynvml  # as torch.cuda does: importing torch imports nvidia-ml-py's module
class cuda:
    device_count = staticmethod(lambda: 1)
    get_device_name = staticmethod(lambda index: "Tesla T4")"""


def platform_runtime(tmp_path: Path, torch_version: str) -> Path:
    """A fresh Python whose own site holds stand-ins at the platform's versions (torch, transformers 4.57.1,
    nvidia-ml-py 12.535.161, and this package, with its real requirements), before this .venv's site (which gives
    IPython and pip); and a folder of stand-in wheels at the pinned versions, the only index pip is given."""
    runtime = tmp_path / "runtime"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(runtime)], check=True)
    site = Path(next(runtime.glob("lib/python*/site-packages")))
    (site / "zz-this-venv.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")  # after the stand-ins
    platform, wheels = tmp_path / "platform", tmp_path / "wheels"
    platform.mkdir(), wheels.mkdir()
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    for wheel in (stand_in_wheel(platform, "torch", torch_version, "torch", STAND_IN_TORCH),
                  stand_in_wheel(platform, "transformers", "4.57.1", "transformers"),
                  stand_in_wheel(platform, "nvidia-ml-py", "12.535.161", "pynvml"),
                  stand_in_wheel(platform, "bert-ja-multigpu-helpers", "0.1.0", "helpers_stand_in", requires=requires)):
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(site)
    pins = setup.pins()
    stand_in_wheel(wheels, "transformers", pins["transformers"], "transformers")
    stand_in_wheel(wheels, "nvidia-ml-py", pins["nvidia-ml-py"], "pynvml")
    repository = tmp_path / "repository"
    for path in ("tools/colab_kaggle_setup.py", "requirements.txt", "pyproject.toml", "src/helpers/torch_private.py"):
        (repository / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / path, repository / path)
    return runtime


@pytest.mark.parametrize("torch_version, before", [("2.10.0+cu128", ""), ("2.10.0+cu128", "import transformers"),
                                                   ("2.9.1+cu126", "")])
def test_the_pasted_cell_on_a_platform_runtime(tmp_path, torch_version, before):
    """The cell as pasted, in a fresh interpreter holding the platform's packages: on a fresh runtime it ends in
    ready, with no pip error about the platform's torch; where the kernel had imported transformers, pip changes
    it under the kernel and the cell asks for a restart; below the floor it installs nothing and names the torch."""
    runtime = platform_runtime(tmp_path, torch_version)
    work = tmp_path / "content"
    work.mkdir()
    env = os.environ | {"PIP_CONFIG_FILE": os.devnull, "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(tmp_path / "wheels"),
                        "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PYTHONNOUSERSITE": "1"}
    env.pop("PYTHONPATH", None)
    cell = before + "\n" + with_repo(first_cell(), str(tmp_path / "repository"))
    script = work / "cell.ipy"
    script.write_text(cell, encoding="utf-8")
    run = subprocess.run([str(runtime / "bin" / "python"), "-m", "IPython", "--quick", "--no-banner", "--colors=NoColor",
                          str(script)], cwd=work, capture_output=True, text=True, timeout=300, env=env)
    said = run.stdout.strip().splitlines()
    assert run.returncode == 0 and "ERROR" not in run.stderr and "Error" not in run.stdout, run.stdout + run.stderr
    assert said[1] == "GPUs torch sees: 1 (Tesla T4)"
    if torch_version.startswith("2.9"):
        assert said[0].startswith("torch 2.9.1+cu126 (the platform's; the series ran on torch 2.10 to 2.14): older "
                                  "than 2.10, so nothing was installed; pip install torch==2.13.0") and len(said) == 2
    elif before:
        assert said[-1].startswith("restart the session now (Colab: Runtime > Restart session; Kaggle: Run > Restart "
                                   "& clear cell outputs): this kernel imported transformers before pip changed it")
    else:
        assert said == ["torch 2.10.0+cu128 (the platform's, kept; the series ran on torch 2.10 to 2.14)",
                        "GPUs torch sees: 1 (Tesla T4)", "ready: run the notebook from its next cell"]


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
