"""Time of every notebook under nbval, as `make test` runs it: its cells (what a reader waits for once the kernel
is up) and the whole pytest run (kernel start and collection included), one pytest and one kernel per notebook."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

import common
from helpers.checks.notebook_env import NOTEBOOK_ENV, lessons_then_solutions

ROOT = Path(__file__).resolve().parent.parent


def cell_seconds(junit_xml: Path) -> float:
    """The sum of nbval's per-cell times in a JUnit report: one test case per cell."""
    return sum(float(case.get("time", 0)) for case in ET.parse(junit_xml).iter("testcase"))


def run(repeats: int = 1, pattern: str = "*.ipynb") -> dict:
    names = [str(nb.relative_to(ROOT)) for nb in lessons_then_solutions(ROOT / "notebooks") if nb.match(pattern)]
    wall, cells = ({name: [] for name in names} for _ in range(2))
    failed = []
    with tempfile.TemporaryDirectory() as scratch:
        report_xml = Path(scratch) / "cells.xml"
        for _ in range(repeats):
            for name in names:
                with common.stopwatch(wall[name]):
                    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbval",
                                           "--nbval-current-env", f"--junitxml={report_xml}", name], cwd=ROOT,
                                          env={**os.environ, **NOTEBOOK_ENV}, capture_output=True, text=True)
                cells[name].append(cell_seconds(report_xml))
                if done.returncode != 0:
                    failed.append(name)
    median = {name: common.median(values) for name, values in cells.items()}
    return {"cells": median, "worst": {name: max(values) for name, values in cells.items()},
            "wall": {name: common.median(values) for name, values in wall.items()},
            "total": sum(median.values()), "wall_total": sum(common.median(values) for values in wall.values()),
            "failed": sorted(set(failed)), "repeats": repeats}


def report(result: dict) -> list[str]:
    lines = [f"{'notebook':50s} {'cells':>8s} {'worst':>8s} {'pytest':>8s}"]
    lines += [f"{name:50s} {seconds:6.1f} s {result['worst'][name]:6.1f} s {result['wall'][name]:6.1f} s" +
              ("  FAILED" if name in result["failed"] else "") for name, seconds in result["cells"].items()]
    lines.append(f"{'total':50s} {result['total']:6.1f} s {'':8s} {result['wall_total']:6.1f} s")
    return lines


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--pattern", default="*.ipynb", help="which notebooks, e.g. '03_*'")
    args = parser.parse_args()
    print(f"machine: {common.machine(torch_threads=False)}", flush=True)
    print("\n".join(report(run(args.repeats, args.pattern))))
    print(f"load average at end {common.load_average()}")
