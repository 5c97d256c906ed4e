"""Fixtures shared by several test files: the site (site and browser tests), and one uninterrupted two-process training
run (the kill-and-resume and preemption tests)."""

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def load_docs_build():
    """docs/build.py as a module (docs/ is not a package: it is Sphinx's source folder)."""
    spec = importlib.util.spec_from_file_location("docs_build", ROOT / "docs" / "build.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def docs_build():
    return load_docs_build()


@pytest.fixture(scope="session")
def site(docs_build, tmp_path_factory) -> Path:
    """The static site, built once per test session from the committed notebooks."""
    out = tmp_path_factory.mktemp("docs") / "site"
    docs_build.build(out)
    return out


@pytest.fixture(scope="session")
def uninterrupted_ddp_run() -> dict:
    """The summary of ``helpers.finetune`` under torchrun, 2 processes, ``RESUME_RUN``, never stopped: what a run
    killed (test_resume) or preempted (test_preemption) and resumed must end with, bitwise. Run once per session."""
    from helpers.checks.training_checks import RESUME_RUN, finetune_command, run, summary_of

    return summary_of(run(finetune_command(2, *RESUME_RUN, "--deterministic")))
