"""The series' Japanese prose, checked: textlint finds nothing in any notebook's markdown, and each lesson fits its slot.

textlint runs with the versions pinned in package.json/package-lock.json and the rules of .textlintrc.json: the
technical-writing preset on its defaults (bulleted lists may be in です・ます), no-synonyms, and the project glossary
(glossary.yml, through prh). Each notebook's markdown cells go into one .md file, so that a finding can be named by
notebook and cell, and the English summary under each title is blanked (it is English on purpose). A rule that is
wrong for one sentence is switched off around it, inside its cell, with the reason:
``<!-- textlint-disable RULE -- why -->`` ... ``<!-- textlint-enable RULE -->``.

``python -m helpers.checks.prose`` prints each finding, the counts per rule and per notebook, and each lesson's
markdown characters and cells; it exits 1 when anything is over. Without Node.js it says so in one line and exits 0.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from helpers.checks.notebook_env import lessons_then_solutions

ROOT = Path(__file__).resolve().parents[3]
MAX_CHARACTERS = 7_000  # markdown of one lesson, English summary and HTML comments excluded (about 18 min to read)
MAX_CELLS = 35
SUMMARY = re.compile(r"\*([^*].*[^*])\*\s*")  # the italic English line under a notebook's title (docs/build.py too)
COMMENT = re.compile(r"<!--.*?-->", re.DOTALL)
DIRECTIVE = re.compile(r"<!--\s*textlint-(disable|enable)\b(.*?)-->", re.DOTALL)


@dataclass(frozen=True)
class Finding:
    notebook: str  # relative to the repository, e.g. notebooks/05_gpu_memory.ipynb
    cell: int  # index in the notebook, from 0
    line: int  # in the cell, from 1
    column: int
    rule: str
    message: str

    def __str__(self) -> str:
        return f"{self.notebook} cell {self.cell} line {self.line}:{self.column}  {self.message}  ({self.rule})"


@dataclass(frozen=True)
class Size:
    notebook: str
    characters: int
    cells: int

    @property
    def over(self) -> bool:
        return self.characters > MAX_CHARACTERS or self.cells > MAX_CELLS


@dataclass
class Report:
    findings: list[Finding]
    sizes: list[Size]  # the lessons only
    skipped: str = ""  # why textlint did not run


def markdown_cells(notebook: Path) -> dict[int, str]:
    """Each markdown cell's text by cell index; the first cell's English summary line is left empty, so that line
    numbers still match the cell."""
    cells = json.loads(notebook.read_text(encoding="utf-8"))["cells"]
    texts = {index: "".join(cell["source"]) for index, cell in enumerate(cells) if cell["cell_type"] == "markdown"}
    if 0 in texts:
        lines = texts[0].split("\n")
        summary = next((number for number, line in enumerate(lines) if SUMMARY.fullmatch(line)), None)
        if summary is not None:
            lines[summary] = ""
        texts[0] = "\n".join(lines)
    return texts


def is_lesson(notebook: Path) -> bool:
    """notebooks/NN_*.ipynb; not a solution, and not an appendix (a name holding 'appendix': no character budget)."""
    return (notebook.parent.name == "notebooks" and re.match(r"\d\d_", notebook.name) is not None
            and "appendix" not in notebook.name)


def lesson_sizes(root: Path = ROOT) -> list[Size]:
    """Each lesson's markdown characters (the English summary and HTML comments left out) and cells."""
    sizes = []
    for notebook in filter(is_lesson, lessons_then_solutions(root / "notebooks")):
        characters = sum(len(COMMENT.sub("", text)) for text in markdown_cells(notebook).values())
        cells = len(json.loads(notebook.read_text(encoding="utf-8"))["cells"])
        sizes.append(Size(notebook.relative_to(root).as_posix(), characters, cells))
    return sizes


def misused_directives(name: str, cells: dict[int, str]) -> list[Finding]:
    """A disable comment must name its rules, say why after ``--``, and be switched back on in the same cell."""
    findings = []
    for index, text in cells.items():
        open_rules: set[str] = set()
        for match in DIRECTIVE.finditer(text):
            rules, _, reason = match.group(2).partition("--")
            named = {rule.strip() for rule in rules.split(",") if rule.strip()}
            line = text.count("\n", 0, match.start()) + 1
            if match.group(1) == "disable":
                problem = ("names no rule" if not named else "gives no reason after '--'" if not reason.strip()
                           else "")
                open_rules |= named
            else:
                problem = "" if named else "names no rule"
                open_rules -= named
            if problem:
                findings.append(Finding(name, index, line, 1, "textlint-disable", f"{match.group(0)} {problem}"))
        if open_rules:
            findings.append(Finding(name, index, text.count("\n") + 1, 1, "textlint-disable",
                                    f"not enabled again in the same cell: {', '.join(sorted(open_rules))}"))
    return findings


def write_markdown(cells: dict[int, str], target: Path) -> list[tuple[int, int]]:
    """A notebook's markdown cells into ``target``, a blank line apart; returns each one's (first line, index)."""
    lines: list[str] = []
    starts = []
    for index, text in cells.items():
        starts.append((len(lines) + 1, index))
        lines += text.split("\n") + [""]
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text("\n".join(lines), encoding="utf-8")
    return starts


def node_missing() -> str:
    missing = [tool for tool in ("node", "npm") if shutil.which(tool) is None]
    return f"{' and '.join(missing)} not found" if missing else ""


def install_textlint() -> None:
    """``npm ci`` when node_modules is missing or older than package-lock.json (the pinned versions)."""
    installed = ROOT / "node_modules" / ".package-lock.json"
    if installed.exists() and installed.stat().st_mtime >= (ROOT / "package-lock.json").stat().st_mtime:
        return
    run = subprocess.run(["npm", "ci", "--no-audit", "--no-fund", "--silent"], cwd=ROOT, capture_output=True,
                         text=True)
    if run.returncode != 0:
        raise RuntimeError(f"npm ci in {ROOT} failed (exit {run.returncode}): {(run.stderr or run.stdout)[-2000:]}")


def textlint(files: list[Path]) -> list[dict]:
    """textlint's JSON report for ``files`` (the repository's pinned textlint and rules): one entry per file."""
    command = ["node", str(ROOT / "node_modules" / "textlint" / "bin" / "textlint.js"), "--format", "json",
               "--config", str(ROOT / ".textlintrc.json"), *map(str, files)]
    run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    try:
        if run.returncode not in (0, 1):  # 1: it found something
            raise ValueError("textlint stopped")
        return json.loads(run.stdout)
    except ValueError as error:  # json.JSONDecodeError too
        raise RuntimeError(f"textlint failed (exit {run.returncode}): {(run.stderr or run.stdout)[-2000:]}") from error


def first_line(message: str) -> str:
    """A rule's message without its advice, and without the line number in the .md file (sentence-length's)."""
    return re.sub(r"^Line \d+ ", "", message.strip().split("\n")[0])


def check(root: Path = ROOT) -> Report:
    """Every notebook under ``root``/notebooks through textlint, and the lessons' sizes."""
    report = Report([], lesson_sizes(root), skipped=node_missing())
    if report.skipped:
        return report
    install_textlint()
    notebooks = lessons_then_solutions(root / "notebooks")
    with tempfile.TemporaryDirectory(prefix="prose-") as folder:
        starts, names = {}, {}
        for notebook in notebooks:
            name = notebook.relative_to(root).as_posix()
            cells = markdown_cells(notebook)
            report.findings += misused_directives(name, cells)
            target = (Path(folder) / name).with_suffix(".md").resolve()
            starts[target], names[target] = write_markdown(cells, target), name
        for result in textlint(list(starts)):
            path = Path(result["filePath"]).resolve()
            text = path.read_text(encoding="utf-8")
            for message in result["messages"]:
                # from the offset: sentence-length's column is wrong for a sentence that spans lines
                index = message["range"][0]
                line, column = text.count("\n", 0, index) + 1, index - text.rfind("\n", 0, index)
                first, cell = max(start for start in starts[path] if start[0] <= line)
                report.findings.append(Finding(names[path], cell, line - first + 1, column, message["ruleId"],
                                               first_line(message["message"])))
    order = {name: position for position, name in enumerate(names.values())}
    report.findings.sort(key=lambda finding: (order[finding.notebook], finding.cell, finding.line, finding.column))
    return report


def summary(report: Report) -> list[str]:
    """The counts per rule and per notebook, and the lessons' sizes against their limits."""
    lines = []
    if report.skipped:
        lines.append(f"textlint skipped: {report.skipped} (install Node.js to check the prose)")
    else:
        lines.append(f"textlint: {len(report.findings)} findings")
        for title, key in (("by rule", lambda f: f.rule), ("by notebook", lambda f: f.notebook)):
            counts = Counter(map(key, report.findings)).most_common()
            lines += [f"  {title}:"] + [f"    {count:4d}  {name}" for name, count in counts]
    lines.append(f"lessons: markdown characters (at most {MAX_CHARACTERS:,}) and cells (at most {MAX_CELLS})")
    lines += [f"  {'OVER' if s.over else 'ok  '}  {s.characters:6,d}  {s.cells:3d}  {s.notebook}" for s in report.sizes]
    return lines


def main() -> int:
    started = time.monotonic()
    report = check()
    for finding in report.findings:
        print(finding)
    print("\n".join(summary(report)))
    print(f"({time.monotonic() - started:.1f} s)")
    return 1 if report.findings or any(s.over for s in report.sizes) else 0


if __name__ == "__main__":
    sys.exit(main())
