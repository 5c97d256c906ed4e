"""tools/torch_build.py: which torch build `make` installs, and the report on an existing .venv."""

import importlib.util
import socket
import stat
import sys
import time

import pytest

from conftest import ROOT

spec = importlib.util.spec_from_file_location("torch_build", ROOT / "tools" / "torch_build.py")
torch_build = importlib.util.module_from_spec(spec)
spec.loader.exec_module(torch_build)


@pytest.mark.parametrize(("system", "driver", "expected"), [
    ("Linux", False, "cpu"), ("Linux", True, "pypi"), ("Darwin", False, "pypi"), ("Windows", False, "pypi")])
def test_auto_picks_cpu_only_on_linux_without_a_driver(monkeypatch, system, driver, expected):
    monkeypatch.setattr(torch_build.platform, "system", lambda: system)
    monkeypatch.setattr(torch_build, "nvidia_driver", lambda: driver)
    assert torch_build.choose("auto")[0] == expected
    assert torch_build.choose("pypi" if expected == "cpu" else "cpu")[0] != expected  # an option forces either way


def test_an_unreachable_index_is_noticed_at_once():
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    start = time.monotonic()
    problem = torch_build.reachable(f"http://127.0.0.1:{port}/whl/cpu")
    assert problem and "refused" in problem.lower()
    assert time.monotonic() - start < torch_build.PROBE_TIMEOUT_S


def fake_python(tmp_path, version: str):
    """A stand-in for .venv/bin/python whose torch has this version (it prints it, whatever it is asked)."""
    path = tmp_path / "python"
    path.write_text(f"#!{sys.executable}\nprint({version!r})\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def test_an_existing_venv_with_the_other_build_is_reported(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch_build.platform, "system", lambda: "Linux")
    monkeypatch.setattr(torch_build, "nvidia_driver", lambda: False)
    python = fake_python(tmp_path, "2.13.0")  # PyPI's build on a machine that asks for the CPU one
    torch_build.check(python, "auto")
    assert "PyPI's build" in capsys.readouterr().out  # said, and kept
    with pytest.raises(SystemExit, match="make clean, then make lab TORCH=cpu"):
        torch_build.check(python, "cpu")  # asked for explicitly: refused
    torch_build.check(fake_python(tmp_path, "2.13.0+cpu"), "cpu")
    assert capsys.readouterr().out == ""
