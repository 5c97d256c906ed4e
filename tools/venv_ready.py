"""Before `make` runs `python3 -m venv DIR`: stop with the fix where it cannot work, and remove a DIR it left broken.

Debian and Ubuntu ship Python's ensurepip apart, in the package python3-venv. Without it, `python3 -m venv .venv`
fails half-way and leaves a .venv without pip, which every later `make lab` would reuse (`No module named pip`).
So this checks that the Python can make a venv with pip, and removes a DIR whose Python has no pip. Runs on the
system's Python (standard library only), before DIR exists.

    python3 tools/venv_ready.py .venv
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path


def venv_problem() -> str | None:
    """Why ``python3 -m venv`` (this Python's) would make a venv without pip, or None."""
    probe = subprocess.run([sys.executable, "-c", "import ensurepip, venv"], capture_output=True, text=True)
    if probe.returncode == 0:
        return None
    version = ".".join(map(str, sys.version_info[:2]))
    cause = (probe.stderr.strip().splitlines() or ["no output"])[-1]
    return (f"{sys.executable} -m venv cannot make a venv with pip ({cause}). On Debian or Ubuntu: sudo apt install "
            f"python3-venv (for this Python {version}: python{version}-venv), then make again; elsewhere, another "
            f"Python: make lab PYTHON=/path/to/python3")


def without_pip(folder: Path) -> bool:
    """True if ``folder`` exists but its Python cannot run pip (a venv that stopped half-way)."""
    python = folder / ("Scripts/python.exe" if sys.platform == "win32" else "bin/python")
    if not folder.exists():
        return False
    try:
        return subprocess.run([str(python), "-m", "pip", "--version"], capture_output=True).returncode != 0
    except OSError:  # no Python in it at all
        return True


def main(folder: Path) -> int:
    if without_pip(folder):
        print(f"{folder}: its Python has no pip (an earlier `python3 -m venv` stopped half-way); removing it to "
              f"make it again", flush=True)
        shutil.rmtree(folder)
    if not folder.exists():
        problem = venv_problem()
        if problem:
            print(f"error: {problem}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    sys.exit(main(Path(sys.argv[1])))
