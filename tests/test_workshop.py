"""WORKSHOP.md's times are arithmetic: each lesson's characters (prose and code) and reading time are what
helpers.checks.workshop counts in the notebooks now, and each slot of a plan holds the reading of the parts it
names, their lesson's run time and its one exercise, the slots following one another to the plan's length."""

import math
import re
from pathlib import Path

import pytest

from helpers.checks.workshop import lesson_parts

ROOT = Path(__file__).resolve().parents[1]
PAGE = (ROOT / "WORKSHOP.md").read_text(encoding="utf-8")
LESSON_ROW = re.compile(r"^\| (\d\d) [^|]+\| ([\d,]+) 字 \| ([\d,]+) 字 \| (\d+) 分 \| (\d+) 秒 \| ([^|]*)\|$",
                        re.MULTILINE)
SLOT = re.compile(r"^\| (\d):(\d\d)–(\d):(\d\d) \| ([^|]*)\| ([^|]*)\|", re.MULTILINE)
PARTS = re.compile(r"(\d\d) (全体|§[\d–, §]+)")
EXERCISE = re.compile(r"演習 \d（(\d+) 分）")
PLANS = [("## 90 分版", 90), ("## 半日版", 210), ("## 続きの半日版", 160)]


def minutes(hours: str, mins: str) -> int:
    return 60 * int(hours) + int(mins)


def lesson_rows() -> dict[str, tuple[int, int, int, int, str]]:
    return {number: (int(prose.replace(",", "")), int(code.replace(",", "")), int(reading), int(seconds), exercise)
            for number, prose, code, reading, seconds, exercise in LESSON_ROW.findall(PAGE)}


def named_parts(text: str) -> list[tuple[str, list[int]]]:
    """``01 §0–3`` -> [("01", [0, 1, 2, 3])]; ``00 §1, §10`` -> [("00", [1, 10])]; ``02 全体`` -> every part."""
    found = []
    for lesson, which in PARTS.findall(text):
        if which == "全体":
            found.append((lesson, [part.number for part in lesson_parts(ROOT)[lesson]]))
            continue
        numbers = []
        for item in which.replace("§", "").split(","):
            first, _, last = item.strip().partition("–")
            numbers += range(int(first), int(last or first) + 1)
        found.append((lesson, numbers))
    return found


def test_every_lesson_has_its_characters_and_reading_time_in_the_table():
    parts = lesson_parts(ROOT)
    assert {number: row[:3] for number, row in lesson_rows().items()} == {
        number: (sum(p.prose for p in found), sum(p.code for p in found), round(sum(p.minutes for p in found)))
        for number, found in parts.items()}
    exercises = {number: EXERCISE.search(row[4]) is not None for number, row in lesson_rows().items()}
    assert exercises == {number: number != "00" for number in parts}  # one each, with its minutes; 00 has none


def test_the_parts_reader_understands_ranges_and_lists():
    assert named_parts("01 §0–2 と 03 §4, §6") == [("01", [0, 1, 2]), ("03", [4, 6])]


@pytest.mark.parametrize(("heading", "length"), PLANS)
def test_each_slot_holds_its_reading_run_and_exercise_and_the_slots_add_up(heading, length):
    assert heading in PAGE
    plan = PAGE.split(heading, 1)[1].split("\n## ", 1)[0]
    slots = SLOT.findall(plan)
    times = [(minutes(a, b), minutes(c, d)) for a, b, c, d, _, _ in slots]
    assert times and times[0][0] == 0 and times[-1][1] == length, times
    assert all(end == start for (_, end), (start, _) in zip(times, times[1:])), times
    parts, rows = lesson_parts(ROOT), lesson_rows()
    for (start, end), (*_, reading, exercise) in zip(times, slots):
        named = named_parts(reading)
        needed = sum(parts[lesson][number].minutes for lesson, numbers in named for number in numbers)
        needed += sum(rows[lesson][3] for lesson in {lesson for lesson, _ in named}) / 60
        needed += sum(int(found) for found in EXERCISE.findall(exercise))
        assert end - start >= math.ceil(needed), (reading, exercise, end - start, needed)
