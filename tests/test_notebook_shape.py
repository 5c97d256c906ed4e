"""Every notebook stays readable in one sitting: at most 35 cells, and no code cell over 25 lines (the guide's limits)."""

import json
from pathlib import Path

import pytest
from helpers.checks.notebook_env import lessons_then_solutions

NOTEBOOKS = lessons_then_solutions(Path(__file__).parents[1] / "notebooks")


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda path: path.relative_to(path.parents[1]).as_posix())
def test_cells_and_code_lines_stay_within_the_limits(notebook):
    cells = json.loads(notebook.read_text(encoding="utf-8"))["cells"]
    assert len(cells) <= 35, f"{notebook.name} has {len(cells)} cells"
    long = {index: len("".join(cell["source"]).splitlines()) for index, cell in enumerate(cells)
            if cell["cell_type"] == "code" and len("".join(cell["source"]).splitlines()) > 25}
    assert not long, f"{notebook.name}: code cells over 25 lines (cell: lines): {long}"


def test_there_are_notebooks():
    assert len(NOTEBOOKS) >= 10
