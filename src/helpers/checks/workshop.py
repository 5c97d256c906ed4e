"""How long a workshop needs to read each part of a lesson, so that WORKSHOP.md's plans are arithmetic, not guesses.

A part is what a ``## `` heading opens (§1 is the first; what comes before it, the title and its introduction, is
§0). Its reading time counts the prose at ``PROSE_PER_MINUTE`` characters a minute (the English summary and HTML
comments left out, as the character budget counts it) and the code at ``CODE_PER_MINUTE``: a reader follows code
line by line but a line holds few characters, about half of them spaces and punctuation.

``python -m helpers.checks.workshop`` prints every lesson's parts with their characters and minutes.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from helpers.checks.notebook_env import lessons_then_solutions
from helpers.checks.prose import COMMENT, ROOT, is_lesson, markdown_cells

PROSE_PER_MINUTE = 400  # Japanese prose, characters a minute
CODE_PER_MINUTE = 800  # code, characters a minute
SECTION = re.compile(r"^## (.+)$", re.MULTILINE)


@dataclass(frozen=True)
class Part:
    number: int  # 0: before the first "## " heading
    title: str
    prose: int  # characters
    code: int

    @property
    def minutes(self) -> float:
        return self.prose / PROSE_PER_MINUTE + self.code / CODE_PER_MINUTE


def parts(notebook: Path) -> list[Part]:
    """The parts of ``notebook`` in order, each with the characters of its markdown and of its code cells."""
    cells = json.loads(notebook.read_text(encoding="utf-8"))["cells"]
    markdown = markdown_cells(notebook)
    found = [[0, "", 0, 0]]
    for index, cell in enumerate(cells):
        if cell["cell_type"] == "code":
            found[-1][3] += len("".join(cell["source"]))
            continue
        text = COMMENT.sub("", markdown.get(index, ""))
        start = 0
        for heading in SECTION.finditer(text):
            found[-1][2] += len(text[start:heading.start()])
            found.append([len(found), heading.group(1).strip(), 0, 0])
            start = heading.start()
        found[-1][2] += len(text[start:])
    return [Part(*values) for values in found]


def lesson_parts(root: Path = ROOT) -> dict[str, list[Part]]:
    """Each lesson's parts by its two-digit number."""
    return {notebook.name[:2]: parts(notebook)
            for notebook in filter(is_lesson, lessons_then_solutions(root / "notebooks"))}


def main() -> int:
    for lesson, found in lesson_parts().items():
        total = sum(part.minutes for part in found)
        print(f"{lesson}: {sum(p.prose for p in found):,} prose + {sum(p.code for p in found):,} code characters, "
              f"{total:.1f} min")
        for part in found:
            print(f"  §{part.number:<2d} {part.minutes:5.1f} min  {part.prose:5,d} + {part.code:5,d}  {part.title}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
