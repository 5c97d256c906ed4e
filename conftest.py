"""Loaded by every pytest run in this repository, before any notebook's kernel starts.

Sets the environment the stored notebook outputs were made in, so that the obvious
`pytest --nbval notebooks/X.ipynb` compares outputs as `make test` does: without it, the model-loading
progress bar is an output the notebook does not hold. Kernels started by nbval inherit this process's
environment; they are this environment's Python (as with --nbval-current-env) unless a kernel is named.
"""

import os

from helpers.checks.notebook_env import NOTEBOOK_ENV

os.environ.update(NOTEBOOK_ENV)


def pytest_configure(config):
    option = config.option
    if getattr(option, "nbval", False) or getattr(option, "nbval_lax", False):
        if not getattr(option, "nbval_kernel_name", None) and not getattr(option, "current_env", False):
            option.nbval_current_env = True
