"""A notebook cell that teaches a helper holds exactly the helper's code, so the two never drift apart, and no
notebook defines a helper anywhere else ("teach in the notebook, reuse from the package").

Such a cell starts with a comment naming the object, e.g. ``# helpers.net.Net``; the rest of the cell
must equal the object's source in src/helpers.
"""

import ast
import importlib
import inspect
import json
import re
from pathlib import Path

import pytest
from helpers.checks.notebook_env import lessons_then_solutions

ROOT = Path(__file__).parents[1]
NOTEBOOKS = lessons_then_solutions(ROOT / "notebooks")
MARKER = re.compile(r"^# (helpers\.[\w.]+)\n")


def code_cells():
    """(notebook, source) of every code cell of the series."""
    for notebook in NOTEBOOKS:
        for cell in json.loads(notebook.read_text(encoding="utf-8"))["cells"]:
            if cell["cell_type"] == "code":
                yield notebook, "".join(cell["source"])


def teaching_cells():
    for notebook, source in code_cells():
        match = MARKER.match(source)
        if match:
            yield pytest.param(match.group(1), source[match.end():], id=f"{notebook.name}:{match.group(1)}")


def resolve(dotted):
    module_name, _, attribute = dotted.rpartition(".")
    return getattr(importlib.import_module(module_name), attribute)


@pytest.mark.parametrize(("dotted", "code"), list(teaching_cells()))
def test_cell_matches_helper(dotted, code):
    assert code.strip() == inspect.getsource(resolve(dotted)).strip()


def test_every_cell_that_names_a_helper_on_its_first_line_is_compared():
    """A header the marker does not match (a space before the name, no newline after it) would leave its cell out of
    the comparison above without a word."""
    headed = [(notebook.name, source.splitlines()[0]) for notebook, source in code_cells()
              if source.lstrip().startswith("# helpers")]
    assert headed and [header for _, header in headed if not MARKER.match(header + "\n")] == []
    assert len(headed) == len(list(teaching_cells()))


def test_no_notebook_defines_a_helper_outside_the_cell_that_teaches_it():
    """Each function or class a code cell defines under the name of one in src/helpers is that cell's helper."""
    from IPython.core.inputtransformer2 import TransformerManager

    helpers = {node.name for path in (ROOT / "src" / "helpers").rglob("*.py")
               for node in ast.parse(path.read_text(encoding="utf-8")).body
               if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
    redefined = []
    for notebook, source in code_cells():
        match = MARKER.match(source)
        taught = match.group(1).rpartition(".")[2] if match else None
        tree = ast.parse(TransformerManager().transform_cell(source))
        redefined += [f"{notebook.name}: {node.name}" for node in tree.body
                      if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name in helpers - {taught}]
    assert redefined == []
