"""WORKSHOP.md's times: each lesson's reading time is its markdown at 400 characters a minute, as the page says, and
each plan's slots follow one another without gap or overlap to the plan's length."""

import re
from pathlib import Path

import pytest

from helpers.checks.prose import lesson_sizes

ROOT = Path(__file__).resolve().parents[1]
PAGE = (ROOT / "WORKSHOP.md").read_text(encoding="utf-8")
LESSON_ROW = re.compile(r"^\| (\d\d) [^|]+\| ([\d,]+) 字 \| (\d+) 分 \| [^|]+\|$", re.MULTILINE)
SLOT = re.compile(r"^\| (\d):(\d\d)–(\d):(\d\d) \|", re.MULTILINE)


def minutes(hours: str, mins: str) -> int:
    return 60 * int(hours) + int(mins)


def test_every_lesson_has_its_characters_and_reading_time_in_the_table():
    rows = {number: (int(characters.replace(",", "")), int(reading)) for number, characters, reading
            in LESSON_ROW.findall(PAGE)}
    sizes = {Path(size.notebook).name[:2]: size.characters for size in lesson_sizes(ROOT)}
    assert {number: characters for number, (characters, _) in rows.items()} == sizes
    assert {number: reading for number, (_, reading) in rows.items()} == {
        number: round(characters / 400) for number, characters in sizes.items()}


@pytest.mark.parametrize(("heading", "length"), [("## 90 分版", 90), ("## 半日版", 210)])
def test_a_plans_slots_follow_one_another_to_its_length(heading, length):
    plan = PAGE.split(heading, 1)[1].split("\n## ", 1)[0]
    slots = [(minutes(a, b), minutes(c, d)) for a, b, c, d in SLOT.findall(plan)]
    assert slots and slots[0][0] == 0 and slots[-1][1] == length, slots
    assert all(start < end for start, end in slots), slots
    assert all(end == start for (_, end), (start, _) in zip(slots, slots[1:])), slots
