"""Loaded by every pytest run in this repository, before any notebook's kernel starts.

Sets the environment the stored notebook outputs were made in, so that the obvious
`pytest --nbval notebooks/X.ipynb` compares outputs as `make test` does: without it, the model-loading
progress bar is an output the notebook does not hold. The stored outputs are a CPU's, so every GPU is hidden
from CUDA as well (`make gpu-check` is the test on GPUs). Kernels started by nbval inherit this process's
environment; they are this environment's Python (as with --nbval-current-env) unless a kernel is named.
The run ends with one line saying what it compared, and where.
"""

import os

from helpers.checks.notebook_env import GPUS_HIDDEN, NOTEBOOK_ENV, compared_line, nvml_gpu_count

os.environ.update(NOTEBOOK_ENV | GPUS_HIDDEN)


def pytest_configure(config):
    option = config.option
    if getattr(option, "nbval", False) or getattr(option, "nbval_lax", False):
        if not getattr(option, "nbval_kernel_name", None) and not getattr(option, "current_env", False):
            option.nbval_current_env = True


def pytest_terminal_summary(terminalreporter, config):
    """Counted from the reports, which reach this process also when workers (pytest-xdist) ran the notebooks."""
    paths = {getattr(report, "nodeid", "").partition("::")[0]
             for reports in terminalreporter.stats.values() for report in reports}
    notebooks, gpus = {path for path in paths if path.endswith(".ipynb")}, nvml_gpu_count()
    if notebooks or gpus:
        mode = "strict" if getattr(config.option, "nbval", False) else "lax"
        terminalreporter.write_line(compared_line(len(notebooks), mode, gpus))
