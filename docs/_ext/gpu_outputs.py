"""What a GPU printed, beside what the CPU printed: the site's tabs for notebooks executed on a GPU elsewhere.

Two halves, joined by marker outputs (HTML comments):

- ``merge`` (docs/build.py, when notebooks are staged): for each code cell whose source a GPU run executed unchanged
  (cells are matched by source, not index) and whose output there differs, the run's outputs are appended to the
  cell's, each group after a tab marker. An output with an error is left out where the cell is not meant to raise
  (no ``raises-exception`` tag); so is one that shows nothing. A cell that took the place of one the run executed
  with other code gets a one-line note instead, when that run's output differed. A page with tabs gets a note
  saying which machine and versions they come from.
- the Sphinx extension (``setup``): after myst-nb has turned every output into nodes, each marked cell output
  becomes CSS-only tabs (radio buttons: no script, nothing from another host), and the page links the tabs' CSS.

Without GPU runs nothing is merged and no page changes.
"""

from __future__ import annotations

import difflib
import html
import re
import shutil
from pathlib import Path

from docutils import nodes
from sphinx.transforms.post_transforms import SphinxPostTransform

from helpers.checks.gpu_runs import raised_unexpectedly

CPU_LABEL = "CPU（保存済み）"
MARKER = re.compile(r"<!-- gpu-outputs: (tab|end)(?: (.*))? -->")
CSS = Path(__file__).with_name("gpu_outputs.css")


def marker(kind: str, label: str = "") -> dict:
    text = f"<!-- gpu-outputs: {kind}{' ' + html.escape(label) if label else ''} -->"
    return {"output_type": "display_data", "metadata": {}, "data": {"text/html": text}}


def text(value) -> str:
    return "".join(value) if isinstance(value, list) else value


def visible(outputs: list[dict]) -> list[dict]:
    """The outputs as a page shows them: consecutive stream chunks joined (a run's chunks split by timing), streams
    of only whitespace dropped."""
    joined = []
    for output in outputs:
        if output["output_type"] == "stream" and joined and joined[-1].get("name") == output["name"] \
                and joined[-1]["output_type"] == "stream":
            joined[-1] = {**joined[-1], "text": joined[-1]["text"] + text(output["text"])}
        elif output["output_type"] == "stream":
            joined.append({**output, "text": text(output["text"])})
        else:
            joined.append(output)
    return [output for output in joined if output["output_type"] != "stream" or output["text"].strip()]


def has_figure(output: dict) -> bool:
    return any(mime.startswith("image/") for mime in output.get("data", {}))


def key(output: dict) -> tuple:
    """What a reader sees of one output (no execution counts, no metadata)."""
    if output["output_type"] == "stream":
        return ("stream", output["name"], output["text"])
    if output["output_type"] == "error":
        return ("error", output["ename"], output["evalue"])
    return ("data", tuple(sorted((mime, text(value)) for mime, value in output.get("data", {}).items())))


def gpu_outputs(cell: dict, run_cell: dict) -> list[dict] | None:
    """The run's outputs for ``cell`` if a page should show them, else None: they show something, differ from the
    stored ones (a run that saved no figures is compared without the stored figures), and hold no error unless the
    cell is meant to raise."""
    shown = visible(run_cell.get("outputs", []))
    stored = visible(cell.get("outputs", []))
    if not any(has_figure(output) for output in shown):
        stored = [output for output in stored if not has_figure(output)]
    if not shown or [key(o) for o in shown] == [key(o) for o in stored]:
        return None
    return None if raised_unexpectedly(cell, shown) else shown


def pair(current: list[str], run: list[str]) -> dict[int, tuple[int, bool]]:
    """For each current code cell (by position) the run's code cell it corresponds to, and whether the source is
    the same: equal sources first (in order, so repeated ones pair in turn, moved ones too), then cells that took
    the place of one the run executed with other code."""
    opcodes = difflib.SequenceMatcher(None, current, run, autojunk=False).get_opcodes()
    pairs = {i1 + k: (j1 + k, True) for tag, i1, i2, j1, _ in opcodes if tag == "equal" for k in range(i2 - i1)}
    unused = [j for j in range(len(run)) if j not in {j for j, _ in pairs.values()}]
    for i, source in enumerate(current):
        if i not in pairs and (j := next((j for j in unused if run[j] == source), None)) is not None:
            pairs[i] = (j, True)
            unused.remove(j)
    for tag, i1, i2, j1, j2 in opcodes:
        for i, j in zip(range(i1, i2), range(j1, j2)):
            if tag == "replace" and i not in pairs and j in unused:
                pairs[i] = (j, False)
                unused.remove(j)
    return pairs


def merge(notebook: dict, runs: list[tuple[object, dict | None]]) -> dict:
    """``notebook`` with each run's outputs (``runs``: a GpuRun and its executed copy of this notebook, or None)
    where a page should show them, and a note on the page naming the runs shown."""
    cells = [cell for cell in notebook["cells"] if cell["cell_type"] == "code"]
    tabs, notes = {}, {}
    for run, executed in runs:
        run_cells = [cell for cell in (executed or {"cells": []})["cells"] if cell["cell_type"] == "code"]
        for i, (j, same) in pair([text(c["source"]) for c in cells], [text(c["source"]) for c in run_cells]).items():
            shown = gpu_outputs(cells[i], run_cells[j])
            if shown is not None:
                (tabs if same else notes).setdefault(i, []).append((run, shown))
    for i, cell in enumerate(cells):
        outputs = cell.get("outputs", [])
        if i in tabs:
            outputs = [marker("tab", CPU_LABEL), *outputs]
            for run, shown in tabs[i]:
                outputs += [marker("tab", run.label), *shown]
            outputs.append(marker("end"))
        for run, _ in notes.get(i, []):
            outputs.append({"output_type": "display_data", "metadata": {}, "data": {"text/html": (
                f'<p class="gpu-outputs-note">このセルのコードは {html.escape(run.label)}（{run.date}）で実行したものと'
                f'異なるため、GPU での出力は表示していません。</p>')}})
        cell["outputs"] = outputs
    shown_runs = [run for run, _ in runs if any(run is r for row in tabs.values() for r, _ in row)]
    if shown_runs:
        notebook["cells"].insert(1, {"cell_type": "markdown", "id": "gpu-outputs-note", "metadata": {},
                                     "source": page_note(shown_runs)})
    return notebook


def machine(run) -> str:
    names = sorted(set(run.gpus))
    gpus = "、".join(f"{name} {run.gpus.count(name)} 基" for name in names)
    driver = f"、ドライバー {run.driver}" if run.driver else ""
    return (f"{gpus}（CUDA {run.cuda}{driver}）、torch {run.torch}、Python {run.python}、{run.machine}。"
            f"{run.date} にこのチュートリアルのコミット {run.commit} を実行")


def page_note(runs: list) -> str:
    """The note at the top of a page with tabs, in the page's language (Japanese)."""
    lines = [f"- 「{run.label}」: {machine(run)}" for run in runs]
    return "\n".join([
        "```{admonition} GPU で実行したときの出力", ":class: note", "",
        f"タブのあるセルでは、保存されている CPU での出力（「{CPU_LABEL}」）と、GPU で実行したときの出力を切り替えて見られます。",
        "", *lines, "",
        "数値は GPU の種類や torch・CUDA のバージョンによって変わります。タブのないセルは保存済みの出力だけです"
        "（GPU でも同じ出力だったセル、GPU では予定外のエラーになったセル、その実行で図が保存されなかったセルなど）。"
        "自分の GPU では `make gpu-check GPU_CHECK_ARGS=\"--keep DIR\"` が全ノートブックを実行し、"
        "このサイトに載せられる形のフォルダーを DIR/gpu-runs/ に残します。",
        "```"])


class GpuTabs(SphinxPostTransform):
    """Each cell output with tab markers becomes tabs: a radio button and label per group, then the groups."""

    default_priority = 5  # after myst-nb's SelectMimeType (4) has turned each output into its nodes
    formats = ("html",)

    def run(self, **kwargs) -> None:
        for output in list(self.document.findall(nodes.container)):
            if output.get("nb_element") != "cell_code_output":
                continue
            marks = [(k, MARKER.search(child.astext())) for k, child in enumerate(output.children)
                     if isinstance(child, nodes.raw)]
            marks = [(k, found) for k, found in marks if found]
            if not marks:
                continue
            name = f"gpu-tab-{output.parent['cell_index']}"
            tabs = nodes.container(classes=["gpu-tabs"])
            for n, (_, found) in enumerate(marks[:-1]):
                label = html.escape(html.unescape(found.group(2)))
                tabs += nodes.raw("", f'<input type="radio" name="{name}" id="{name}-{n}"{" checked" * (n == 0)}>'
                                      f'<label for="{name}-{n}">{label}</label>', format="html")
            for (start, _), (end, _) in zip(marks, marks[1:]):
                tabs += nodes.container("", *output.children[start + 1:end], classes=["gpu-tab-panel"])
            output[:] = output.children[:marks[0][0]] + [tabs] + output.children[marks[-1][0] + 1:]


def add_css(app, pagename, templatename, context, doctree) -> None:
    """Link the tabs' CSS from the pages that have tabs (only those), and copy it into the site once."""
    if doctree is not None and any("gpu-tabs" in node["classes"] for node in doctree.findall(nodes.container)):
        target = Path(app.outdir) / "_static" / CSS.name
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(CSS, target)
        app.add_css_file(CSS.name)


def setup(app):
    app.add_post_transform(GpuTabs)
    app.connect("html-page-context", add_css)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
