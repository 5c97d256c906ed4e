"""The environment the stored notebook outputs are made and compared in: no progress bars, no hub look-ups, every
example of the bundled data whatever the reader's shell says. One definition for ``make notebooks``/``make test``
(``python -m helpers.checks.notebook_env`` prints it as shell assignments), pytest's conftest.py and gpu-check.
Also which files are the series. Imports nothing heavy, so that conftest.py can read it before any kernel starts."""

from pathlib import Path

NOTEBOOK_ENV = {"TQDM_DISABLE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1", "HF_HUB_OFFLINE": "1", "PYTHONHASHSEED": "0",
                "HELPERS_MAX_EXAMPLES": ""}

GPUS_HIDDEN = {"CUDA_VISIBLE_DEVICES": ""}
"""The stored outputs are a CPU's, so they are made and compared with every GPU hidden from CUDA (``make notebooks``,
``make test``, any pytest run through conftest.py); ``make gpu-check`` runs the same notebooks with the GPUs visible.
NVML ignores this variable: cells that read NVML (00's device summary, 05's table) keep their outputs out of the
comparison, and print the machine's GPUs beside a torch that sees none."""

ONE_THREAD = {"OMP_NUM_THREADS": "1"}
"""The stored outputs are a one-thread CPU's, as torchrun's workers compute: the same on a machine of any number of
cores (every compared output was the same with 1 and 2 threads, 2026-12-07), and ``make test``'s two workers share
2 cores without waiting on each other. Two processes of two threads each on 2 cores once slowed a training cell
from 14 s to 239 s: a parallel region stalls until all its threads get a core."""

CPU = GPUS_HIDDEN | ONE_THREAD
"""Where the stored outputs are made and compared: ``make notebooks``, ``make test``, any pytest run (conftest.py)."""


def lessons_then_solutions(folder: Path) -> list[Path]:
    """The series in ``folder`` (notebooks/, or a GPU run's copy of it): the lessons in order, each followed by its
    appendices (``NN_appendix_*``, which a plain sort would put before ``NN_gpu_memory``), then the solutions.
    Never the copies JupyterLab keeps in .ipynb_checkpoints/, which a reader's `make lab` leaves beside them."""
    def reading_order(path: Path) -> tuple:
        return path.name[:2], "_appendix" in path.name, path.name

    return sorted(folder.glob("*.ipynb"), key=reading_order) + sorted(folder.glob("solutions/*.ipynb"))


def nvml_gpu_count() -> int:
    """How many GPUs the NVIDIA driver reports, whatever CUDA_VISIBLE_DEVICES says; 0 without a driver."""
    try:
        import pynvml
    except ImportError:
        return 0
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return 0
    try:
        return pynvml.nvmlDeviceGetCount()
    finally:
        pynvml.nvmlShutdown()


def compared_line(notebooks: int, mode: str, gpus: int) -> str:
    """The one line a test run ends with: how many notebooks' outputs it compared (``mode`` strict or lax; 0 for
    none) and that it ran on the CPU, naming the GPUs it hid and the command that tests them."""
    what = f"{notebooks} notebook(s) compared ({mode}) with their stored outputs" if notebooks else "no notebook compared"
    if not gpus:
        return f"{what}; run on the CPU (no NVIDIA GPU here), as the stored outputs were"
    return (f"{what}; run on the CPU with this machine's {gpus} GPU(s) hidden (CUDA_VISIBLE_DEVICES=), since the stored "
            f"outputs are a CPU's; `make gpu-check` is the test on the GPUs")


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(prog="python -m helpers.checks.notebook_env",
                                     description="Print the notebooks' environment as shell assignments.")
    parser.add_argument("--cpu", action="store_true",
                        help="add CUDA_VISIBLE_DEVICES= and OMP_NUM_THREADS=1 (make notebooks, make test: the stored "
                             "outputs are a one-thread CPU's)")
    environment = NOTEBOOK_ENV | (CPU if parser.parse_args().cpu else {})
    print(" ".join(f"{name}={value}" for name, value in environment.items()))
