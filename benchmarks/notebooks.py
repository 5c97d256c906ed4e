"""Wall time of every notebook under nbval, as `make test` runs it (one pytest and one kernel per notebook)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import common

ROOT = Path(__file__).resolve().parent.parent
NB_ENV = {"TQDM_DISABLE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1", "HF_HUB_OFFLINE": "1", "PYTHONHASHSEED": "0"}


def notebooks(pattern: str = "*.ipynb") -> list[Path]:
    return sorted((ROOT / "notebooks").glob(pattern)) + sorted((ROOT / "notebooks/solutions").glob(pattern))


def run(repeats: int = 1, pattern: str = "*.ipynb") -> dict:
    times = {str(nb.relative_to(ROOT)): [] for nb in notebooks(pattern)}
    failed = []
    for _ in range(repeats):
        for name, values in times.items():
            with common.stopwatch(values):
                done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbval",
                                       "--nbval-current-env", name], cwd=ROOT, env={**os.environ, **NB_ENV},
                                      capture_output=True, text=True)
            if done.returncode != 0:
                failed.append(name)
    seconds = {name: common.median(values) for name, values in times.items()}
    return {"seconds": seconds, "worst": {name: max(values) for name, values in times.items()},
            "total": sum(seconds.values()), "worst_total": sum(max(values) for values in times.values()),
            "failed": sorted(set(failed)), "repeats": repeats}


def report(result: dict) -> list[str]:
    lines = [f"{name:50s} {seconds:6.1f} s (worst {result['worst'][name]:6.1f} s)" +
             ("  FAILED" if name in result["failed"] else "") for name, seconds in result["seconds"].items()]
    lines.append(f"{'total':50s} {result['total']:6.1f} s (worst {result['worst_total']:6.1f} s)")
    return lines


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--pattern", default="*.ipynb", help="which notebooks, e.g. '03_*'")
    args = parser.parse_args()
    print(f"machine: {common.machine(torch_threads=False)}", flush=True)
    print("\n".join(report(run(args.repeats, args.pattern))))
    print(f"load average at end {common.load_average()}")
