"""tools/venv_ready.py, which `make` runs before `python3 -m venv`: a Python that cannot make a venv with pip (Debian and
Ubuntu without python3-venv) stops with the package to install, and a .venv an earlier failure left without pip is
removed so that make builds it again, instead of failing on `No module named pip` forever."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOOL = ROOT / "tools" / "venv_ready.py"


def test_a_python_without_ensurepip_is_stopped_before_a_venv_is_made(tmp_path):
    shadow = tmp_path / "shadow"  # what Debian's python3 is without python3-venv: no ensurepip
    shadow.mkdir()
    (shadow / "ensurepip.py").write_text("raise ModuleNotFoundError(\"No module named 'ensurepip'\")\n")
    run = subprocess.run([sys.executable, str(TOOL), str(tmp_path / ".venv")], capture_output=True, text=True,
                         env=os.environ | {"PYTHONPATH": str(shadow)})
    version = f"{sys.version_info[0]}.{sys.version_info[1]}"
    assert run.returncode == 1 and not (tmp_path / ".venv").exists()
    assert run.stderr.startswith(f"error: {sys.executable} -m venv cannot make a venv with pip (ModuleNotFoundError: "
                                 f"No module named 'ensurepip'). On Debian or Ubuntu: sudo apt install python3-venv "
                                 f"(for this Python {version}: python{version}-venv)")
    fine = subprocess.run([sys.executable, str(TOOL), str(tmp_path / ".venv")], capture_output=True, text=True)
    assert (fine.returncode, fine.stdout, fine.stderr) == (0, "", "")


def test_a_venv_left_without_pip_is_removed_and_a_whole_one_kept(tmp_path):
    broken = tmp_path / ".venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(broken)], check=True)
    run = subprocess.run([sys.executable, str(TOOL), str(broken)], capture_output=True, text=True)
    assert run.returncode == 0 and not broken.exists()
    assert run.stdout == (f"{broken}: its Python has no pip (an earlier `python3 -m venv` stopped half-way); removing "
                          f"it to make it again\n")
    whole = Path(sys.prefix)  # this test's own venv, which has pip
    assert subprocess.run([sys.executable, str(TOOL), str(whole)], capture_output=True).returncode == 0
    assert (whole / "bin").exists() or (whole / "Scripts").exists()


def test_make_checks_before_it_makes_a_venv():
    run = subprocess.run(["make", "-n", "-B", ".venv/.installed"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    lines = run.stdout.splitlines()
    check = next(i for i, line in enumerate(lines) if "tools/venv_ready.py .venv" in line)
    assert check < next(i for i, line in enumerate(lines) if "-m venv .venv" in line)
