"""A GPU run kept for the site: the series' notebooks as one GPU machine executed them, and what that machine was.

One folder per run, e.g. ``docs/gpu-runs/2026-12-04-h200/``::

    run.json     machine, GPU names (one per GPU), torch, CUDA, driver, Python, date, the project commit, a note
    notebooks/   the executed notebooks at their paths under notebooks/ (solutions/ included), nothing else:
                 their code cells and outputs (a page shows the stored notebook's prose), without the output of a
                 cell that failed (its traceback holds that machine's paths, and no page shows it)

``make gpu-check GPU_CHECK_ARGS="--keep DIR"`` writes one under DIR/gpu-runs/; ``make docs`` shows the outputs of
every folder in docs/gpu-runs/ beside the stored ones. Reading a folder needs neither torch nor a GPU.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import shutil
import subprocess
from dataclasses import dataclass, fields
from pathlib import Path

from helpers.checks.notebook_env import lessons_then_solutions

ROOT = Path(__file__).resolve().parents[3]


@dataclass(frozen=True)
class GpuRun:
    folder: Path
    machine: str  # what else the machine had, e.g. "16 CPU cores, Linux x86_64"
    gpus: list[str]  # one name per GPU, in CUDA's order
    torch: str
    cuda: str
    driver: str | None  # None where it was not recorded
    python: str
    date: str  # YYYY-MM-DD
    commit: str  # the project's commit that ran
    note: str

    @property
    def label(self) -> str:
        """A tab's label: 'NVIDIA H200, torch 2.11' (or '2× NVIDIA A100-SXM4-80GB, torch 2.13')."""
        names = sorted(set(self.gpus))
        gpus = f"{len(self.gpus)}× {names[0]}" if len(names) == 1 and len(self.gpus) > 1 else " + ".join(names)
        return f"{gpus}, torch {'.'.join(self.torch.split('+')[0].split('.')[:2])}"

    def notebooks(self) -> dict[str, Path]:
        """Each executed notebook by its path under notebooks/, e.g. 'solutions/05_solutions.ipynb'."""
        folder = self.folder / "notebooks"
        return {path.relative_to(folder).as_posix(): path for path in lessons_then_solutions(folder)}

    def notebook(self, relative: str) -> dict | None:
        """The executed notebook at ``relative`` (a path under notebooks/) as JSON, or None if the run lacks it."""
        path = self.folder / "notebooks" / relative
        return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


METADATA = [field.name for field in fields(GpuRun) if field.name != "folder"]


def valid(name: str, value: object) -> bool:
    if name == "gpus":
        return isinstance(value, list) and bool(value) and all(isinstance(gpu, str) and gpu for gpu in value)
    return isinstance(value, str) or (name == "driver" and value is None)


def check_metadata(data: object, where: str) -> dict:
    """``data`` as run.json must hold it, else ValueError naming ``where`` and the field."""
    if not isinstance(data, dict):
        raise ValueError(f"{where}: must be a JSON object with the fields {', '.join(METADATA)}")
    missing, unknown = [name for name in METADATA if name not in data], sorted(set(data) - set(METADATA))
    problems = ([f"missing field(s) {', '.join(missing)}"] if missing else []) + (
        [f"unknown field(s) {', '.join(unknown)}"] if unknown else [])
    if problems:
        raise ValueError(f"{where}: {'; '.join(problems)}")
    for name in METADATA:
        if not valid(name, data[name]):
            wanted = {"gpus": "a non-empty list of GPU names", "driver": "a string or null"}.get(name, "a string")
            raise ValueError(f"{where}: field {name!r} must be {wanted}, found {data[name]!r}")
    if not re.fullmatch(r"\d{4}-\d{2}-\d{2}", data["date"]):
        raise ValueError(f"{where}: field 'date' must be YYYY-MM-DD, found {data['date']!r}")
    return data


def read(folder: Path) -> GpuRun:
    """The run in ``folder``; a ValueError names the file and what is wrong with it."""
    folder = Path(folder)
    path = folder / "run.json"
    if not path.is_file():
        raise ValueError(f"{path}: missing; a GPU run folder holds run.json and notebooks/ (see {__name__})")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: not valid JSON ({error})") from error
    run = GpuRun(folder, **check_metadata(data, str(path)))
    if not run.notebooks():
        raise ValueError(f"{folder / 'notebooks'}: no executed notebooks (*.ipynb or solutions/*.ipynb) in it")
    return run


def raised_unexpectedly(cell: dict, outputs: list[dict]) -> bool:
    """Whether ``outputs`` hold an error though ``cell`` is not meant to raise (no ``raises-exception`` tag)."""
    return ("raises-exception" not in cell.get("metadata", {}).get("tags", [])
            and any(output["output_type"] == "error" for output in outputs))


def write(folder: Path, executed: Path, metadata: dict) -> GpuRun:
    """Write a run folder from the notebooks executed into ``executed`` (same layout as notebooks/): their code
    cells and outputs, without per-cell execution timestamps, the outputs of cells that raised unexpectedly, or
    anything else found there (data, checkpoints, logs)."""
    folder = Path(folder)
    check_metadata(metadata, "run metadata")
    shutil.rmtree(folder / "notebooks", ignore_errors=True)
    for path in lessons_then_solutions(executed):
        notebook = json.loads(path.read_text(encoding="utf-8"))
        notebook["cells"] = [cell for cell in notebook["cells"] if cell["cell_type"] == "code"]
        for cell in notebook["cells"]:
            cell.get("metadata", {}).pop("execution", None)
            if raised_unexpectedly(cell, cell["outputs"]):
                cell["outputs"] = []
        target = folder / "notebooks" / path.relative_to(executed)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps(notebook, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    (folder / "run.json").write_text(json.dumps(metadata, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    return read(folder)


def folder_name(metadata: dict) -> str:
    """'2026-12-04-h200' for one NVIDIA H200 that day; '2027-01-10-2x-a100-sxm4-80gb' for two A100s."""
    gpus = metadata["gpus"]
    gpu = re.sub(r"[^a-z0-9]+", "-", gpus[0].lower().removeprefix("nvidia ")).strip("-")
    return f"{metadata['date']}-" + (f"{len(gpus)}x-" if len(gpus) > 1 else "") + gpu


def this_machine(note: str) -> dict:
    """run.json's fields for the machine this runs on (CUDA needed), the project's commit and today's date."""
    import torch

    import pynvml  # nvidia-ml-py, pinned in requirements.txt

    try:
        pynvml.nvmlInit()
        driver = pynvml.nvmlSystemGetDriverVersion()
    except pynvml.NVMLError:  # no driver library, or it does not answer: the driver is then not recorded
        driver = None
    git = ["git", "-C", str(ROOT)]
    commit = subprocess.run(git + ["rev-parse", "--short=7", "HEAD"], capture_output=True, text=True).stdout.strip()
    changed = subprocess.run(git + ["status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True)
    return {"machine": f"{os.cpu_count()} CPU cores, {platform.system()} {platform.machine()}",
            "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
            "torch": torch.__version__, "cuda": torch.version.cuda, "driver": driver,
            "python": platform.python_version(), "date": datetime.date.today().isoformat(),
            "commit": (commit or "unknown") + (" with local changes" if changed.stdout.strip() else ""), "note": note}


def save(executed: Path, parent: Path, note: str) -> GpuRun:
    """The notebooks executed into ``executed`` on this machine, as a run folder under ``parent`` named by date
    and GPU: copy it into docs/gpu-runs/ to show it on the site."""
    metadata = this_machine(note)
    return write(Path(parent) / folder_name(metadata), Path(executed), metadata)

