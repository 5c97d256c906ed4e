"""``make torch-range TORCH_VERSION=X.Y.Z``: every notebook of the series, executed under one torch release.

Colab and Kaggle keep their own torch, often older than the pinned one; the series claims a range of releases
(README, "Which torch"), and this is how a release joins it. The Makefile builds a venv for the release outside the
repository (PyPI's torch is the CUDA build, several GB), everything else at its pins, and runs this module there
with the repository's src/ on PYTHONPATH. Each notebook is executed top to bottom into a scratch copy, on the CPU
with the GPUs hidden, in the environment of ``make notebooks``, every cell even after an error. Outputs are not
compared (numbers may differ in their last digits between releases); what counts is an error in a cell not tagged
raises-exception, and a warning a cell writes to stderr. One line per notebook, then the totals; exit 1 on an error.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

from helpers.checks.notebook_env import CPU, NOTEBOOK_ENV, lessons_then_solutions

ROOT = Path(__file__).resolve().parents[3]


def problems(notebook) -> tuple[list[str], list[str]]:
    """(errors, warnings) of an executed notebook: ``cell N: Name: message`` for each cell not tagged
    raises-exception that raised, ``cell N: first line`` for each cell whose stderr holds a warning (N counts every
    cell from 0, as nbformat does)."""
    errors, warnings = [], []
    for index, cell in enumerate(notebook.cells):
        if cell.cell_type != "code":
            continue
        for output in cell.get("outputs", []):
            if output.output_type == "error" and "raises-exception" not in cell.metadata.get("tags", []):
                errors.append(f"cell {index}: {output.ename}: {output.evalue}".splitlines()[0][:300])
            if output.output_type == "stream" and output.name == "stderr" and "Warning" in output.text:
                first = next(line for line in output.text.splitlines() if "Warning" in line)
                warnings.append(f"cell {index}: {first.strip()[:200]}")
    return errors, warnings


def execute(source: Path, scratch: Path) -> tuple[list[str], list[str], float]:
    """Execute a copy of ``source`` in ``scratch`` (its folder is the kernel's working folder)."""
    target = scratch / source.relative_to(ROOT / "notebooks")
    target.parent.mkdir(parents=True, exist_ok=True)
    notebook = nbformat.read(source, as_version=4)
    start = time.monotonic()
    with open(scratch / "kernels.log", "ab") as log:  # what kernels write outside any cell (C++ logs, notices)
        NotebookClient(notebook, timeout=1200, allow_errors=True, record_timing=False,
                       resources={"metadata": {"path": str(target.parent)}}).execute(stdout=log, stderr=log)
    nbformat.write(notebook, target)
    return *problems(notebook), time.monotonic() - start


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m helpers.checks.torch_range", description=__doc__.split("\n\n")[0])
    parser.add_argument("--notebooks", nargs="*", type=Path, help="only these (default: the whole series)")
    parser.add_argument("--keep", type=Path, help="execute into this folder and keep it (default: a temporary one, "
                                                   "kept only when a notebook fails)")
    args = parser.parse_args()
    os.environ.update(NOTEBOOK_ENV | CPU)  # before torch is imported, here and in every kernel
    import torch

    notebooks = [path.resolve() for path in args.notebooks] if args.notebooks else lessons_then_solutions(ROOT / "notebooks")
    scratch = args.keep or Path(tempfile.mkdtemp(prefix=f"torch-{torch.__version__.split('+')[0]}-"))
    print(f"torch {torch.__version__}, Python {platform.python_version()}, on the CPU (GPUs hidden), "
          f"{time.strftime('%Y-%m-%d')}: {len(notebooks)} notebooks into {scratch}", flush=True)
    failed = warned = 0
    for notebook in notebooks:
        errors, warnings, seconds = execute(notebook, scratch)
        failed += bool(errors)
        warned += bool(warnings)
        said = errors and f"{len(errors)} error(s): {'; '.join(errors)}" or "ok"
        print(f"{notebook.relative_to(ROOT)}: {said} ({seconds:.0f} s)"
              + (f"; warnings: {'; '.join(warnings)}" if warnings else ""), flush=True)
    print(f"torch {torch.__version__}: {len(notebooks) - failed} of {len(notebooks)} notebooks ran without an error "
          f"outside raises-exception cells; {warned} wrote a warning", flush=True)
    if failed and not args.keep:
        print(f"the executed notebooks stay in {scratch}", flush=True)
    elif not args.keep:
        shutil.rmtree(scratch)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
