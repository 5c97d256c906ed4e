"""A notebook cell that teaches a helper holds exactly the helper's code, so the two never drift apart.

Such a cell starts with a comment naming the object, e.g. ``# helpers.net.Net``; the rest of the cell
must equal the object's source in src/helpers.
"""

import importlib
import inspect
import json
import re
from pathlib import Path

import pytest
from helpers.checks.notebook_env import lessons_then_solutions

NOTEBOOKS = lessons_then_solutions(Path(__file__).parents[1] / "notebooks")
MARKER = re.compile(r"^# (helpers\.[\w.]+)\n")


def teaching_cells():
    for notebook in NOTEBOOKS:
        for cell in json.loads(notebook.read_text(encoding="utf-8"))["cells"]:
            source = "".join(cell["source"])
            match = MARKER.match(source)
            if cell["cell_type"] == "code" and match:
                yield pytest.param(match.group(1), source[match.end():], id=f"{notebook.name}:{match.group(1)}")


def resolve(dotted):
    module_name, _, attribute = dotted.rpartition(".")
    return getattr(importlib.import_module(module_name), attribute)


@pytest.mark.parametrize(("dotted", "code"), list(teaching_cells()))
def test_cell_matches_helper(dotted, code):
    assert code.strip() == inspect.getsource(resolve(dotted)).strip()


def test_there_are_teaching_cells():
    assert len(list(teaching_cells())) >= 1
