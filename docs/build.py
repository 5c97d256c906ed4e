"""Build the static site from the notebooks' stored outputs: ``python docs/build.py [OUT_DIR]``.

Sphinx reads one source folder, so the notebooks are staged next to ``docs/`` (copied, never run) and the
index gets its learning path from the notebooks themselves: each one's ``# title`` and the italic English
summary under it. A new notebook therefore appears on the site without editing anything here.

Notebooks executed on a GPU elsewhere (folders in docs/gpu-runs/, see helpers.checks.gpu_runs) add their outputs
beside the stored ones, in tabs (docs/_ext/gpu_outputs.py); ``--gpu-runs`` picks the folders, every one by default,
and ``--gpu-runs`` with none builds the site from the stored outputs alone.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from sphinx.cmd.build import build_main

from helpers.checks import gpu_runs
from helpers.checks.notebook_env import lessons_then_solutions
from helpers.checks.prose import SUMMARY

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "docs" / "_ext"))
import gpu_outputs  # noqa: E402  (docs/_ext is Sphinx's extension folder, not a package)

MAX_GPU_RUNS = 5  # tabs per cell: the stored output and up to this many runs (docs/_ext/gpu_outputs.css)
MARKER = "<!-- NOTEBOOK LIST: filled in by docs/build.py from each notebook's title and English summary -->"


@dataclass
class Page:
    path: str  # relative to the repository root, e.g. notebooks/solutions/02_solutions.ipynb
    title: str
    summary: str

    @property
    def number(self) -> str:
        return Path(self.path).name.split("_")[0]


def notebooks(root: Path = ROOT) -> list[Path]:
    """Every notebook and solution the site shows, in learning order."""
    return lessons_then_solutions(root / "notebooks")


def describe(notebook: Path, root: Path = ROOT) -> Page:
    """Title and English summary from the notebook's first cell (``# title`` then ``*summary*``)."""
    cells = json.loads(notebook.read_text(encoding="utf-8"))["cells"]
    lines = "".join(cells[0]["source"]).splitlines() if cells and cells[0]["cell_type"] == "markdown" else []
    title = next((line[2:].strip() for line in lines if line.startswith("# ")), None)
    summary = next((m.group(1) for line in lines if (m := SUMMARY.fullmatch(line))), None)
    if title is None or summary is None:
        raise ValueError(f"{notebook}: the first cell must be markdown with a '# title' line and an "
                         f"'*English summary*' line (found title={title!r}, summary={summary!r})")
    return Page(str(notebook.relative_to(root)), title, summary)


def learning_path(pages: list[Page]) -> str:
    """The index's list of notebooks (each with its solutions) and the site's table of contents."""
    lessons = [p for p in pages if "/solutions/" not in p.path]  # appendices too (NN_appendix_*), after their lesson
    solutions = [p for p in pages if "/solutions/" in p.path]
    lines = []
    for lesson in lessons:
        if "_appendix_" in lesson.path:  # under its lesson, beside the solutions
            lines.append(f"  - [{lesson.title}]({lesson.path}) — *{lesson.summary}*")
            continue
        lines.append(f"- **[{lesson.title}]({lesson.path})**  \n  *{lesson.summary}*")
        for solution in (s for s in solutions if s.number == lesson.number):
            lines.append(f"  - [{solution.title}]({solution.path}) — *{solution.summary}*")
    orphans = [s for s in solutions if s.number not in {lesson.number for lesson in lessons}]
    lines += [f"- [{s.title}]({s.path})  \n  *{s.summary}*" for s in orphans]
    for caption, group in (("ノートブック — Notebooks", lessons), ("解答例 — Solutions", solutions)):
        entries = "\n".join(f"{page.title} <{page.path.removesuffix('.ipynb')}>" for page in group)
        lines.append(f"\n```{{toctree}}\n:hidden:\n:caption: {caption}\n\n{entries}\n```")
    return "\n".join(lines)


def all_gpu_runs(root: Path = ROOT) -> list[Path]:
    """Every folder in docs/gpu-runs/, oldest first (their names start with the date)."""
    return sorted(path for path in (root / "docs" / "gpu-runs").glob("*") if path.is_dir())


def stage_notebook(source: Path, target: Path, runs: list[gpu_runs.GpuRun], relative: str) -> None:
    """Copy one notebook, with the runs' outputs merged in where a page should show them."""
    if not runs:
        shutil.copy2(source, target)
        return
    notebook = gpu_outputs.merge(json.loads(source.read_text(encoding="utf-8")),
                                 [(run, run.notebook(relative)) for run in runs])
    target.write_text(json.dumps(notebook, ensure_ascii=False, indent=1), encoding="utf-8")


def stage(stage_dir: Path, root: Path = ROOT, gpu_run_folders: list[Path] | None = None) -> list[Page]:
    """Copy docs/ and the notebooks into ``stage_dir``, with the learning path written into the index and the GPU
    runs' outputs merged into the notebooks (``None``: every folder in docs/gpu-runs/)."""
    folders = all_gpu_runs(root) if gpu_run_folders is None else gpu_run_folders
    if len(folders) > MAX_GPU_RUNS:
        raise ValueError(f"{len(folders)} GPU runs given; a cell shows at most {MAX_GPU_RUNS} beside its stored output")
    runs = [gpu_runs.read(folder) for folder in folders]
    shutil.rmtree(stage_dir, ignore_errors=True)
    shutil.copytree(root / "docs", stage_dir, ignore=shutil.ignore_patterns("build.py", "__pycache__", "gpu-runs"))
    pages = [describe(nb, root) for nb in notebooks(root)]
    for page in pages:
        (stage_dir / page.path).parent.mkdir(parents=True, exist_ok=True)
        stage_notebook(root / page.path, stage_dir / page.path, runs, page.path.removeprefix("notebooks/"))
    index = stage_dir / "index.md"
    text = index.read_text(encoding="utf-8")
    if MARKER not in text:
        raise ValueError(f"{root / 'docs/index.md'}: the line {MARKER!r} is missing")
    index.write_text(text.replace(MARKER, learning_path(pages)), encoding="utf-8")
    return pages


def build(out_dir: Path, root: Path = ROOT, gpu_run_folders: list[Path] | None = None) -> list[Page]:
    """Build the HTML site into ``out_dir``; any Sphinx warning (a broken link, say) fails the build."""
    stage_dir = out_dir.parent / f"{out_dir.name}-src"
    pages = stage(stage_dir, root, gpu_run_folders)
    status = build_main(["-b", "html", "-E", "-W", "--keep-going", "-q", str(stage_dir), str(out_dir)])
    if status != 0:
        raise SystemExit(f"sphinx-build failed (exit {status}); see the warnings above")
    return pages


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", type=Path, default=ROOT / "build" / "site")
    parser.add_argument("--gpu-runs", nargs="*", type=Path, metavar="DIR",
                        help="GPU run folders to show (default: every folder in docs/gpu-runs/; none: no GPU outputs)")
    args = parser.parse_args()
    built = build(args.out.resolve(), gpu_run_folders=args.gpu_runs)
    print(f"{len(built)} notebook pages + index -> {args.out / 'index.html'}")
