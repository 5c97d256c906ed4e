"""Loaded by every pytest run in this repository, before any notebook's kernel starts.

Sets the environment the stored notebook outputs were made in, so that the obvious
`pytest --nbval notebooks/X.ipynb` compares outputs as `make test` does: without it, the model-loading
progress bar is an output the notebook does not hold. The stored outputs are a one-thread CPU's, so every GPU is
hidden from CUDA as well (`make gpu-check` is the test on GPUs), and every process computes with one thread.
Kernels started by nbval inherit this process's environment; they are this environment's Python (as with
--nbval-current-env) unless a kernel is named.
The run ends with one line saying what it compared, and where.
"""

import os

import pytest

from helpers.checks.notebook_env import CPU, NOTEBOOK_ENV, compared_line, nvml_gpu_count

os.environ.update(NOTEBOOK_ENV | CPU)  # before torch is imported: OpenMP reads its thread count when it loads

SHARED_FIXTURES = {"tests/test_preemption.py": "tests/test_resume.py",  # uninterrupted_ddp_run
                   "tests/test_browser.py": "tests/test_docs.py"}  # site


def pytest_configure(config):
    option = config.option
    if getattr(option, "nbval", False) or getattr(option, "nbval_lax", False):
        if not getattr(option, "nbval_kernel_name", None) and not getattr(option, "current_env", False):
            option.nbval_current_env = True


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Workers (pytest-xdist, ``make test``) take a whole file at a time, so that a notebook's cells run in order in
    one kernel and a module's fixtures are made once; files that share a session fixture go to the same worker."""
    from xdist.scheduler import LoadFileScheduling

    class SharedFixtures(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = super()._split_scope(nodeid)
            return SHARED_FIXTURES.get(path, path)

    return SharedFixtures(config, log)


def pytest_terminal_summary(terminalreporter, config):
    """Counted from the reports, which reach this process also when workers (pytest-xdist) ran the notebooks."""
    paths = {getattr(report, "nodeid", "").partition("::")[0]
             for reports in terminalreporter.stats.values() for report in reports}
    notebooks, gpus = {path for path in paths if path.endswith(".ipynb")}, nvml_gpu_count()
    if notebooks or gpus:
        mode = "strict" if getattr(config.option, "nbval", False) else "lax"
        terminalreporter.write_line(compared_line(len(notebooks), mode, gpus))
