"""`make torch-range`'s judgement of an executed notebook (helpers.checks.torch_range.problems): an error counts unless
its cell is tagged raises-exception, and a warning on stderr is listed with its cell. The run itself takes a venv of
several GB per torch release, so it is not part of `make test`; CONTRIBUTING.md records its last results."""

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook, new_output

from helpers.checks.torch_range import problems


def test_errors_outside_raises_exception_cells_count_and_warnings_are_named():
    notebook = new_notebook(cells=[
        new_markdown_cell("# a lesson"),
        new_code_cell("import helpers.memory", outputs=[new_output(
            "stream", name="stderr", text="/x/torch_private.py:56: UntestedTorchWarning: helpers runs on torch 2.10 "
                                          "to 2.14 (pinned 2.13.0); torch 2.15.0 is newer\n  warnings.warn(...)\n")]),
        new_code_cell("net.bert", metadata={"tags": ["raises-exception"]}, outputs=[new_output(
            "error", ename="AttributeError", evalue="'DataParallel' object has no attribute 'bert'", traceback=[])]),
        new_code_cell("trace()", outputs=[new_output(
            "error", ename="UnsupportedOperatorException", evalue="c10d._allgather_base_.default", traceback=[])]),
        new_code_cell("print(1)", outputs=[new_output("stream", name="stdout", text="Warning: only stdout\n")]),
    ])
    notebook = nbformat.reads(nbformat.writes(notebook), as_version=4)  # as read from a file
    errors, warnings = problems(notebook)
    assert errors == ["cell 3: UnsupportedOperatorException: c10d._allgather_base_.default"]
    assert warnings == ["cell 1: /x/torch_private.py:56: UntestedTorchWarning: helpers runs on torch 2.10 to 2.14 "
                        "(pinned 2.13.0); torch 2.15.0 is newer"]
