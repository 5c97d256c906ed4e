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

import pytest
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


def defined_at_top_level(path: Path) -> set[str]:
    """The names a module's own source defines at its top level: functions, classes and assignments."""
    names = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {name.id for target in targets for name in ast.walk(target) if isinstance(name, ast.Name)}
    return names


def test_the_front_door_hands_out_each_name_from_the_module_that_defines_it():
    """Each exported name is the very object of the module ``EXPORTS`` files it under, and that module's source
    defines it (a name filed under a module that only imports it, or under none, fails here); unknown names raise."""
    for key, names in helpers.memory.EXPORTS.items():
        module = helpers.memory.module_of(key)
        assert set(names) <= defined_at_top_level(MODULES[module]), (module, set(names) - defined_at_top_level(
            MODULES[module]))
        for name in names:
            assert getattr(helpers.memory, name) is getattr(sys.modules[module], name), name
    assert helpers.memory.__all__ == sorted(name for names in helpers.memory.EXPORTS.values() for name in names)
    with pytest.raises(AttributeError, match="module 'helpers.memory' has no attribute 'trace_step'"):
        helpers.memory.trace_step  # defined in helpers.memory.tracer, not exported


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


ALLOWED_PRIVATE_ACCESS = PACKAGE / "torch_private.py"


def is_private(name: str) -> bool:
    """``_x``, not ``__x__`` (dunder names are Python's protocol, not private)."""
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def own_private_names(trees) -> set[str]:
    """The private names the package defines itself: its functions, classes, parameters, and every name or attribute
    it assigns (``self._x = ...``, ``Class._x = ...``); reading those is no private access of anyone else's."""
    names = set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
    return {name for name in names if is_private(name)}


def private_accesses(tree: ast.AST, own: set[str]) -> list[tuple[int, str]]:
    """(line, what) for each reach into someone else's private code: an import of a private module or name
    (``torch.distributed._tools``, ``from pickle import _Unpickler``), a private attribute (``torch._C``,
    ``pickle._Unpickler``, ``model._orig_mod``) of anything but ``self``/``cls``, a string naming a private module
    (``"torch._subclasses.fake_tensor"``) or a private name (``getattr(x, "_pg_registry")``). Names the package
    defines itself (``own``) and dunder names are not private accesses."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, f"import {alias.name}") for alias in node.names
                      if any(map(is_private, alias.name.split(".")))]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.module.startswith("helpers"):
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            found += [(node.lineno, f"from {name}") for name in names if any(map(is_private, name.split(".")))][:1]
        elif isinstance(node, ast.Attribute) and is_private(node.attr) and node.attr not in own:
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                found.append((node.lineno, f"{ast.unparse(node.value)}.{node.attr}"))
    for node in names_in_strings(tree):
        if not node.value.startswith("helpers.") and any(map(is_private, set(node.value.split(".")) - own)):
            found.append((node.lineno, repr(node.value)))
    return found


def names_in_strings(tree: ast.AST) -> list[ast.Constant]:
    """The strings that may name code: each argument of a call (``getattr(x, "_y")``, ``import_module("m")``), each
    subscript (``state["_y"]``), dict key and item of a tuple, list or set; not a piece of an f-string or a
    substring test."""
    places = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            places += node.args + [keyword.value for keyword in node.keywords]
        elif isinstance(node, ast.Subscript):
            places.append(node.slice)
        elif isinstance(node, ast.Dict):
            places += [key for key in node.keys if key is not None]
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            places += node.elts
    return [node for node in places if isinstance(node, ast.Constant) and isinstance(node.value, str)
            and all(part.isidentifier() for part in node.value.split("."))]


def private_accesses_in_the_package() -> list[str]:
    trees = {path: ast.parse(path.read_text(encoding="utf-8")) for path in sorted(PACKAGE.rglob("*.py"))}
    own = own_private_names(trees.values())
    return [f"{path.relative_to(PACKAGE)}:{line}: {what}" for path, tree in trees.items()
            if path != ALLOWED_PRIVATE_ACCESS for line, what in private_accesses(tree, own)]


def test_the_private_access_finder_sees_torch_and_cpython_and_not_the_package_itself():
    source = ("import torch.distributed._tools.mem_tracker\n"
              "from torch.distributed.fsdp._fully_shard._fsdp_common import DataParallelMeshInfo\n"
              "from pickle import _Unpickler\n"
              "from helpers.memory import _lazy\n"
              "from __future__ import annotations\n"
              "class Reader(pickle._Unpickler):\n"
              "    _cache = {}\n"
              "    def __init__(self, _hidden):\n"
              "        self._seen = torch._C._cuda_clearCublasWorkspaces\n"
              "        Reader._cache.clear(); self.__dict__; type(self).__name__\n"
              "        model._orig_mod, mesh._pg_registry, watch._seen, _hidden\n"
              "        attribute('torch.testing._internal.distributed.fake_pg', 'FakeStore')\n"
              "        getattr(mesh, '_pg_registry'), getattr(self, '_seen'), print('torch._C and more words')\n"
              "        state['_growth_tracker'], {'_key': 1}, f'{name}_accuracy', '_appendix' in name\n"
              "        allowed = {('torch.serialization', '_get_layout'), 'pathlib._local', 'a.b', 'helpers.x._y'}\n")
    assert sorted(private_accesses(ast.parse(source), own_private_names([ast.parse(source)]))) == [
        (1, "import torch.distributed._tools.mem_tracker"),
        (2, "from torch.distributed.fsdp._fully_shard._fsdp_common"), (3, "from pickle._Unpickler"),
        (6, "pickle._Unpickler"), (9, "torch._C"), (9, "torch._C._cuda_clearCublasWorkspaces"),
        (11, "mesh._pg_registry"), (11, "model._orig_mod"),
        (12, "'torch.testing._internal.distributed.fake_pg'"), (13, "'_pg_registry'"), (14, "'_growth_tracker'"),
        (14, "'_key'"), (15, "'_get_layout'"), (15, "'pathlib._local'")]


def test_no_module_but_torch_private_reaches_into_private_torch_or_python():
    """helpers.torch_private is the one module that touches private PyTorch (and CPython) code, where a torch that
    changed one raises TorchSurfaceMissing; anywhere else such a reach would fail silently or obscurely."""
    assert private_accesses_in_the_package() == []


def dropped_causes(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, what) for each ``raise`` that loses the exception it handles: ``raise ... from None`` anywhere, and a
    new exception raised inside an ``except`` block without ``from`` (Python keeps only ``__context__`` then, which
    the traceback shows as "During handling ... another exception occurred", not as the cause). Re-raising the
    handled exception itself, and raising in a function defined inside the block, do not count."""
    found = []

    def visit(node: ast.AST, handler: ast.ExceptHandler | None) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
                visit(child, None)
                continue
            if isinstance(child, ast.Raise):
                if isinstance(child.cause, ast.Constant) and child.cause.value is None:
                    found.append((child.lineno, "from None"))
                elif handler is not None and child.exc is not None and child.cause is None and not (
                        isinstance(child.exc, ast.Name) and child.exc.id == handler.name):
                    found.append((child.lineno, f"raise {ast.unparse(child.exc)} without from"))
            visit(child, child if isinstance(child, ast.ExceptHandler) else handler)

    visit(tree, None)
    return found


def test_the_cause_finder_sees_a_lost_cause_and_lets_a_kept_one_pass():
    source = ("try:\n    f()\nexcept OSError as error:\n    raise ValueError('x') from error\n"  # kept
              "try:\n    f()\nexcept OSError as error:\n    raise error\n"  # re-raised
              "try:\n    f()\nexcept OSError:\n    raise\n"  # re-raised
              "try:\n    f()\nexcept OSError:\n    raise ValueError('x')\n"  # lost: line 16
              "try:\n    f()\nexcept OSError as error:\n    raise ValueError('x') from None\n"  # hidden: line 20
              "try:\n    f()\nexcept OSError:\n    def later():\n        raise ValueError('y')\n"
              "raise ValueError('z')\n")  # outside any block
    assert dropped_causes(ast.parse(source)) == [(16, "raise ValueError('x') without from"), (20, "from None")]


def test_no_error_drops_its_cause():
    """Bad input gets an error naming its cause that keeps the original exception as its cause (``raise ... from
    error``): the traceback then shows what really went wrong."""
    dropped = [f"{path.relative_to(PACKAGE)}:{line}: {what}" for path in sorted(PACKAGE.rglob("*.py"))
               for line, what in dropped_causes(ast.parse(path.read_text(encoding="utf-8")))]
    assert dropped == []
