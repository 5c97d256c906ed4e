"""The package's layout is its architecture: the top level of ``helpers`` is what the notebooks and the training
entry point use; ``helpers.memory`` is the memory predictor, one module per concern behind one front door;
``helpers.build`` (the bundled model) and ``helpers.checks`` (gpu-check, shared test runs) sit apart. Imports run
one way: no cycle anywhere, counting imports inside functions, and none from a lower layer up."""

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import helpers.memory
from helpers.checks.notebook_env import lessons_then_solutions

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "helpers"
SEPARATE = ("helpers.build", "helpers.checks")
TRAINING = ("helpers.train", "helpers.finetune", "helpers.checkpoint")  # what the memory predictor never imports
MEMORY_LAYERS = ("categories", "gpu_facts", "nvidia_smi", "allocator", "simulated_gpu", "configs", "formulas",
                 "kernels", "tracker", "tracer", "step_logs", "cuda_step", "fsdp2", "prediction", "record", "fsdp2_table",
                 "charts",
                 "command", "__main__")
"""helpers.memory's modules in the order of its front door's docstring: each imports only modules before it."""


def all_modules() -> dict[str, Path]:
    """Every module of the package, subpackages and their ``__init__`` (as the package's name) included."""
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


MODULES = all_modules()


def resolve(name: str) -> str | None:
    """The module ``name`` loads: itself, or the package it is an attribute of; None outside the package."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imported_modules(source: str, importer: str = "") -> set[str]:
    """Every module of the package a piece of Python source imports, anywhere in it (inside functions too):
    ``import helpers.checks`` counts, and ``from helpers import x`` counts as helpers.x where that is a module."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {resolve(alias.name) for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{importer}: a relative import (from {'.' * node.level}{node.module or ''})"
            found |= {resolve(f"{node.module}.{alias.name}") for alias in node.names}
    return {name for name in found if name and name != importer}


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules it imports. The front door of helpers.memory imports its modules when a name is first
    asked for (``EXPORTS``): those count as its imports too."""
    graph = {name: imported_modules(path.read_text(encoding="utf-8"), name) for name, path in MODULES.items()}
    graph["helpers.memory"] |= {helpers.memory.module_of(key) for key in helpers.memory.EXPORTS}
    return graph


GRAPH = import_graph()


def reachable(start: str) -> set[str]:
    seen, queue = set(), [start]
    while queue:
        for name in GRAPH[queue.pop()] - seen:
            seen.add(name)
            queue.append(name)
    return seen


def top_level_modules() -> dict[str, Path]:
    return {name: path for name, path in MODULES.items() if name.count(".") == 1 and path.parent == PACKAGE
            and path.name != "__init__.py"}


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


def test_the_import_graph_sees_packages_and_imports_inside_functions():
    """The checks below are only as good as this graph: a package imported by name, a module imported as an
    attribute of its package, and an import inside a function are all edges."""
    source = ("import helpers.checks\nfrom helpers import launch\n"
              "def f():\n    from helpers.memory.tracer import trace_step\n")
    assert imported_modules(source) == {"helpers.checks", "helpers.launch", "helpers.memory.tracer"}
    assert "helpers.memory.cuda_step" in GRAPH["helpers.memory"]  # the front door's lazy names


def test_every_module_imports():
    """A name moved from one module to another leaves no import behind that still asks the old module for it."""
    import importlib

    for name in MODULES:
        if not name.endswith("__main__"):  # runs its command when imported
            importlib.import_module(name)


def test_there_is_no_import_cycle():
    cycles = [name for name in GRAPH if name in reachable(name)]
    assert cycles == [], f"modules that import themselves through others: {cycles}"


def test_nothing_outside_build_and_checks_imports_them():
    for name in MODULES:
        if not name.startswith(SEPARATE):
            wrong = {module for module in GRAPH[name] if module.startswith(SEPARATE)}
            assert not wrong, f"{name} imports {sorted(wrong)}"


def test_the_memory_predictor_stands_apart_from_training():
    """It imports neither the training loop, the entry point nor the checkpoints, and reaches neither the loop nor
    the entry point through anything else; its modules never import its front door (which loads them)."""
    for name in MODULES:
        if name.startswith("helpers.memory"):
            assert not GRAPH[name] & set(TRAINING), f"{name} imports {sorted(GRAPH[name] & set(TRAINING))}"
            reached = reachable(name) & set(TRAINING[:2])
            assert not reached, f"{name} reaches {sorted(reached)}"
            if name != "helpers.memory":
                assert "helpers.memory" not in GRAPH[name], f"{name} imports the front door helpers.memory"


def test_each_module_of_the_memory_predictor_imports_only_those_before_it():
    inside = {name.removeprefix("helpers.memory."): name for name in MODULES if name.startswith("helpers.memory.")}
    assert sorted(inside) == sorted(MEMORY_LAYERS), "add the new module to MEMORY_LAYERS (and the front door's list)"
    for index, module in enumerate(MEMORY_LAYERS):
        later = {f"helpers.memory.{other}" for other in MEMORY_LAYERS[index:]}
        assert not GRAPH[inside[module]] & later, f"{module} imports {sorted(GRAPH[inside[module]] & later)}"


def test_notebooks_use_the_memory_predictor_through_its_front_door():
    used = set().union(*(imported_modules(source) for source in notebook_sources()))
    assert "helpers.memory" in used
    assert {name for name in used if name.startswith("helpers.memory.")} == set()


def test_the_front_door_exports_names_that_exist():
    for name in helpers.memory.__all__:
        assert getattr(helpers.memory, name) is not None, name


def test_every_top_level_module_is_used_by_a_notebook_or_the_entry_point():
    """Reachable through imports from the notebooks, the solutions or ``python -m helpers.finetune``."""
    used = {"helpers.finetune"}.union(*(imported_modules(source) for source in notebook_sources()))
    reached = used.union(*(reachable(name) for name in used))
    assert set(top_level_modules()) - reached == set(), "top-level modules no notebook or entry point uses"


def test_importing_a_light_module_loads_no_torch():
    """``helpers/__init__.py`` imports nothing, so gpu.py's deferred import of torch holds, conftest.py reads the
    notebook environment without torch, and the GPU facts are a table any tool can read."""
    probe = ("import sys, helpers.gpu, helpers.checks.notebook_env, helpers.memory.gpu_facts; "
             "print(sorted(m for m in ('torch', 'safetensors', 'tqdm') if m in sys.modules))")
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True)
    assert run.stdout.strip() == "[]"


def test_the_makefile_reads_the_one_notebook_environment():
    from helpers.checks.notebook_env import NOTEBOOK_ENV

    run = subprocess.run(["make", "-s", "-pn", "unit"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    line = next(line for line in run.stdout.splitlines() if line.startswith("NB_ENV :="))
    assert line.split(":=", 1)[1].split() == [f"{name}={value}" for name, value in NOTEBOOK_ENV.items()]


def test_the_series_is_the_lessons_then_their_solutions_not_jupyterlabs_copies(tmp_path):
    for name in ("01_b.ipynb", "00_a.ipynb", "00_appendix_x.ipynb", "solutions/01_s.ipynb",
                 ".ipynb_checkpoints/00_a-checkpoint.ipynb", "scratch-08/run.ipynb"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("{}")
    found = [path.relative_to(tmp_path).as_posix() for path in lessons_then_solutions(tmp_path)]
    assert found == ["00_a.ipynb", "00_appendix_x.ipynb", "01_b.ipynb", "solutions/01_s.ipynb"]


def test_no_error_drops_its_cause():
    """`raise ... from None` hides the exception that says what really went wrong; keep it as the cause."""
    hiding = [f"{path.relative_to(PACKAGE)}:{number}" for path in sorted(PACKAGE.rglob("*.py"))
              for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1)
              if "from None" in line.split("#")[0]]
    assert hiding == []
