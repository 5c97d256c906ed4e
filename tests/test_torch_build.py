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


def reporting_python(tmp_path, packages: list[tuple[str, str]]) -> str:
    """A stand-in for .venv/bin/python whose pip answers a dry run with this report: (name, url) per package."""
    report = {"install": [{"metadata": {"name": name}, "download_info": {"url": url}} for name, url in packages]}
    path = tmp_path / "python"
    path.write_text(f"#!{sys.executable}\nimport json\nprint(json.dumps({report!r}))\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def test_the_torch_line_says_what_pip_would_install_asked_of_pip(tmp_path):
    wheel = tmp_path / "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl"
    with open(wheel, "wb") as sparse:  # 250 MB as the file system counts it, nothing written
        sparse.truncate(250_000_000)
    python = reporting_python(tmp_path, [("torch", wheel.as_uri()), ("sympy", (tmp_path / "gone.whl").as_uri())])
    assert torch_build.what_pip_installs(python, "torch==2.13.0") == (
        f"pip will install {wheel.name} from {tmp_path} and 1 more package(s), none of them CUDA's; at least 0.2 GB "
        f"to copy")
    with socket.socket() as sock:  # an index that answers nothing: sizes unknown
        sock.bind(("127.0.0.1", 0))
        index = f"http://127.0.0.1:{sock.getsockname()[1]}/packages"
    python = reporting_python(tmp_path, [("torch", f"{index}/torch-2.13.0-cp311-cp311-manylinux_2_28_x86_64.whl"),
                                         ("nvidia-cublas", f"{index}/nvidia_cublas.whl"), ("filelock", f"{index}/f.whl")])
    assert torch_build.what_pip_installs(python, "torch==2.13.0") == (
        "pip will install torch-2.13.0-cp311-cp311-manylinux_2_28_x86_64.whl from 127.0.0.1:"
        f"{index.split(':')[2].split('/')[0]} and 2 more package(s), 1 of them CUDA's libraries (nvidia-*); at least "
        f"0.0 GB to download")
