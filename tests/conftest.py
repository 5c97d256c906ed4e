"""Fixtures shared by the site and browser tests."""

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
