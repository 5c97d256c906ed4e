"""The environment the stored notebook outputs are made and compared in: no progress bars, no hub look-ups, every
example of the bundled data whatever the reader's shell says. One definition for ``make notebooks``/``make test``
(``python -m helpers.checks.notebook_env`` prints it as shell assignments), pytest's conftest.py and gpu-check.
Also which files are the series. Imports nothing heavy, so that conftest.py can read it before any kernel starts."""

from pathlib import Path

NOTEBOOK_ENV = {"TQDM_DISABLE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1", "HF_HUB_OFFLINE": "1", "PYTHONHASHSEED": "0",
                "HELPERS_MAX_EXAMPLES": ""}


def lessons_then_solutions(folder: Path) -> list[Path]:
    """The series in ``folder`` (notebooks/, or a GPU run's copy of it): the lessons in order, then their solutions.
    Never the copies JupyterLab keeps in .ipynb_checkpoints/, which a reader's `make lab` leaves beside them."""
    return sorted(folder.glob("*.ipynb")) + sorted(folder.glob("solutions/*.ipynb"))


if __name__ == "__main__":
    print(" ".join(f"{name}={value}" for name, value in NOTEBOOK_ENV.items()))
