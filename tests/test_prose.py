"""The series' Japanese prose (helpers.checks.prose): textlint finds nothing and every lesson fits its slot.

textlint needs Node.js. Where it is missing, the tests that run textlint skip, in one line, on a developer's machine;
in CI, which installs Node.js and the pinned textlint (``npm ci``) and sets HELPERS_REQUIRE_TEXTLINT=1 (.ci/run),
they fail instead: a CI without them would check no prose at all.
"""

import json
import os
from pathlib import Path

import pytest
from helpers.checks import prose

SUMMARY = "*An English summary line, long enough that textlint's sentence-length rule would flag it: " + "x" * 80 + "*"
LONG = ("次の名前を順に並べます: alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi "
        "rho sigma tau upsilon。")  # 119 characters: over sentence-length's 100, and breaks no other rule


def notebook(path: Path, *cells: tuple[str, str]) -> Path:
    """A notebook at ``path`` with (cell type, source) cells."""
    path.parent.mkdir(parents=True, exist_ok=True)
    body = [{"cell_type": kind, "metadata": {}, "source": source} | ({"outputs": [], "execution_count": None}
                                                                      if kind == "code" else {})
            for kind, source in cells]
    path.write_text(json.dumps({"cells": body, "metadata": {}, "nbformat": 4, "nbformat_minor": 5}), encoding="utf-8")
    return path


REQUIRED = os.environ.get("HELPERS_REQUIRE_TEXTLINT") == "1"
"""Set by .ci/run: textlint must run (module docstring)."""


def needs_node():
    missing = prose.node_missing()
    if missing and REQUIRED:
        pytest.fail(f"HELPERS_REQUIRE_TEXTLINT=1 (CI), but textlint cannot run: {missing}")
    if missing:
        pytest.skip(f"textlint skipped: {missing}")


def test_a_finding_is_named_by_notebook_cell_and_line(tmp_path):
    """The summary line is not linted, a disable comment with its reason silences one rule in its cell, and the
    glossary's finding in the third cell is reported there, at its own line and column."""
    needs_node()
    notebook(tmp_path / "notebooks" / "00_intro.ipynb",
             ("markdown", f"# 00 はじめに\n{SUMMARY}\n\nこのノートブックでは準備をします。"),
             ("code", "print(1)"),
             ("markdown", "## 予測\n前向き計算を偽のテンソルで実行します。\n\n"
                          "<!-- textlint-disable ja-technical-writing/sentence-length -- 長さを確かめる例 -->\n"
                          f"{LONG}\n<!-- textlint-enable ja-technical-writing/sentence-length -->"))
    report = prose.check(tmp_path)
    assert report.findings == [prose.Finding("notebooks/00_intro.ipynb", 2, 2, 7, "prh", "偽のテンソル => フェイクテンソル")]


def test_a_long_sentence_in_a_solution_is_found(tmp_path):
    needs_node()
    notebook(tmp_path / "notebooks" / "solutions" / "00_solutions.ipynb",
             ("markdown", f"# 00 解答例\n{SUMMARY}"), ("markdown", f"短い文です。\n{LONG}"))
    report = prose.check(tmp_path)
    assert [(f.notebook, f.cell, f.line, f.rule) for f in report.findings] == [
        ("notebooks/solutions/00_solutions.ipynb", 1, 2, "ja-technical-writing/sentence-length")]


def test_a_disable_comment_names_its_rule_gives_a_reason_and_ends_in_its_cell():
    cells = {3: "<!-- textlint-disable prh -->\nA\n<!-- textlint-enable prh -->",
             5: "<!-- textlint-disable -- なぜなら -->\nB",
             7: "<!-- textlint-disable prh, ja-technical-writing/max-ten -- 引用 -->\nC\n<!-- textlint-enable prh -->",
             9: "<!-- textlint-disable prh -- 引用 -->\nD\n<!-- textlint-enable prh -->"}
    found = [(f.cell, f.line, f.message) for f in prose.misused_directives("nb.ipynb", cells)]
    assert found == [(3, 1, "<!-- textlint-disable prh --> gives no reason after '--'"),
                     (5, 1, "<!-- textlint-disable -- なぜなら --> names no rule"),
                     (7, 3, "not enabled again in the same cell: ja-technical-writing/max-ten")]


def test_a_lesson_is_counted_without_its_summary_and_comments(tmp_path):
    notebook(tmp_path / "notebooks" / "01_a.ipynb", ("markdown", f"# 01 題\n{SUMMARY}\n本文。"),
             ("code", "x = 1"), ("markdown", "<!-- textlint-disable prh -- 例 -->\n日本語"))
    notebook(tmp_path / "notebooks" / "05_appendix_allocator.ipynb", ("markdown", "# 付録"))
    notebook(tmp_path / "notebooks" / "solutions" / "01_solutions.ipynb", ("markdown", "# 解答"))
    # "# 01 題" (6) + two newlines around the emptied summary line + "本文。" (3); then "\n日本語" (4)
    assert prose.lesson_sizes(tmp_path) == [prose.Size("notebooks/01_a.ipynb", 6 + 2 + 3 + 4, 3)]


def test_textlint_finds_nothing_in_the_series():
    needs_node()
    report = prose.check()
    assert not report.findings, "\n".join(map(str, report.findings)) + "\n" + "\n".join(prose.summary(report))


def test_every_lesson_fits_its_slot():
    sizes = prose.lesson_sizes()
    assert len(sizes) == 10
    over = [f"{s.notebook}: {s.characters:,} characters, {s.cells} cells" for s in sizes if s.over]
    assert not over, f"over {prose.MAX_CHARACTERS:,} characters or {prose.MAX_CELLS} cells: {over}"
