"""The package's layout is its architecture: the top level of ``helpers`` is what the notebooks and the training
entry point use; ``helpers.build`` (the bundled model) and ``helpers.checks`` (gpu-check, shared test runs) sit
apart, and nothing at the top level imports them."""

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

from helpers.checks.notebook_env import lessons_then_solutions

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "helpers"
SEPARATE = ("helpers.build", "helpers.checks")


def imported_modules(source: str) -> set[str]:
    """Every ``helpers...`` module a piece of Python source imports (``from helpers import x`` counts as helpers.x)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("helpers")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("helpers"):
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return {name for name in found if (PACKAGE.parent / (name.replace(".", "/") + ".py")).exists()}


def top_level_modules() -> dict[str, Path]:
    return {f"helpers.{path.stem}": path for path in PACKAGE.glob("*.py") if path.stem != "__init__"}


def notebook_sources() -> list[str]:
    """The code of every notebook and solution as Python (IPython's ``!`` and ``%`` lines turned into calls), and
    ``import M`` for each module a shell line runs with ``-m M`` or through ``helpers.launch`` (``module="M"``)."""
    from IPython.core.inputtransformer2 import TransformerManager

    sources = []
    for notebook in lessons_then_solutions(ROOT / "notebooks"):
        for cell in json.loads(notebook.read_text(encoding="utf-8"))["cells"]:
            if cell["cell_type"] == "code":
                source = "".join(cell["source"])
                sources.append(TransformerManager().transform_cell(source))
                sources += [f"import {module}" for module in re.findall(r"(?:-m |module=[\"'])(helpers[\w.]*)", source)]
    return sources


def test_no_top_level_module_imports_build_or_check_code():
    for name, path in top_level_modules().items():
        wrong = {module for module in imported_modules(path.read_text(encoding="utf-8"))
                 if module.startswith(SEPARATE)}
        assert not wrong, f"{name} imports {sorted(wrong)}"


def test_every_top_level_module_is_used_by_a_notebook_or_the_entry_point():
    """Reachable through imports from the notebooks, the solutions or ``python -m helpers.finetune``."""
    modules = top_level_modules()
    reached, queue = set(), ["helpers.finetune"]
    for source in notebook_sources():
        queue += sorted(imported_modules(source))
    while queue:
        name = queue.pop()
        if name in reached or name not in modules:
            continue
        reached.add(name)
        queue += sorted(imported_modules(modules[name].read_text(encoding="utf-8")))
    assert set(modules) - reached == set(), "top-level modules no notebook or entry point uses"


def test_importing_a_light_module_loads_no_torch():
    """``helpers/__init__.py`` imports nothing, so gpu.py's deferred import of torch holds, and conftest.py reads
    the notebook environment without torch."""
    probe = ("import sys, helpers.gpu, helpers.checks.notebook_env; "
             "print(sorted(m for m in ('torch', 'safetensors', 'tqdm') if m in sys.modules))")
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True)
    assert run.stdout.strip() == "[]"


def test_the_makefile_reads_the_one_notebook_environment():
    from helpers.checks.notebook_env import NOTEBOOK_ENV

    run = subprocess.run(["make", "-s", "-pn", "unit"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    line = next(line for line in run.stdout.splitlines() if line.startswith("NB_ENV :="))
    assert line.split(":=", 1)[1].split() == [f"{name}={value}" for name, value in NOTEBOOK_ENV.items()]


def test_the_series_is_the_lessons_then_their_solutions_not_jupyterlabs_copies(tmp_path):
    for name in ("01_b.ipynb", "00_a.ipynb", "solutions/01_s.ipynb", ".ipynb_checkpoints/00_a-checkpoint.ipynb",
                 "scratch-08/run.ipynb"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("{}")
    found = [path.relative_to(tmp_path).as_posix() for path in lessons_then_solutions(tmp_path)]
    assert found == ["00_a.ipynb", "01_b.ipynb", "solutions/01_s.ipynb"]
