"""Which torch build `make` puts into .venv or wheelhouse/, said in one line, and a check of an existing .venv.

PyPI's Linux torch is the CUDA build (several GB with its nvidia-* wheels); PyTorch's CPU-only wheels live
only on PyTorch's own index. So on Linux without an NVIDIA driver the CPU build is the default; TORCH=cpu or
TORCH=pypi forces either way. Runs on the system's Python (standard library only), before .venv exists.

    python3 tools/torch_build.py install .venv/bin/python [--torch auto|cpu|pypi] [--wheelhouse DIR]
    python3 tools/torch_build.py download DIR [--torch ...]     # into a wheelhouse
    python3 tools/torch_build.py check .venv/bin/python [--torch ...]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
PROBE_TIMEOUT_S = 5


def torch_pin() -> str:
    """The exact torch requirement of requirements.txt (one source of truth)."""
    for line in (ROOT / "requirements.txt").read_text(encoding="utf-8").splitlines():
        if line.startswith("torch=="):
            return line.strip()
    raise SystemExit(f"{ROOT / 'requirements.txt'}: no line 'torch==...'")


def nvidia_driver() -> bool:
    return Path("/proc/driver/nvidia/version").exists() or shutil.which("nvidia-smi") is not None


def choose(request: str) -> tuple[str, str]:
    """('cpu' or 'pypi', why), for TORCH=auto|cpu|pypi."""
    if request != "auto":
        return request, f"TORCH={request}"
    if platform.system() != "Linux":
        return "pypi", f"{platform.system()}: PyPI's torch is a CPU{' + MPS' if sys.platform == 'darwin' else ''} build there"
    if nvidia_driver():
        return "pypi", "Linux with an NVIDIA driver"
    return "cpu", "Linux, no NVIDIA driver found"


def reachable(index: str) -> str | None:
    """None when the index answers within a few seconds, else why not (proxies come from HTTPS_PROXY)."""
    try:
        urllib.request.urlopen(index.rstrip("/") + "/torch/", timeout=PROBE_TIMEOUT_S).close()
        return None
    except OSError as error:  # URLError, timeouts, refused connections
        return str(getattr(error, "reason", error))


def size_of(url: str) -> int | None:
    """Bytes at ``url``: a local file's size, or the Content-Length a web server answers a HEAD request with."""
    if url.startswith("file://"):
        path = urllib.request.url2pathname(urllib.parse.urlparse(url).path)
        return os.path.getsize(path) if os.path.exists(path) else None
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=PROBE_TIMEOUT_S) as answer:
            return int(answer.headers["Content-Length"])
    except (OSError, TypeError, ValueError):
        return None


def what_pip_installs(python: str, requirement: str, *options: str) -> str:
    """What pip would install for ``requirement`` with ``options``, asked of pip (a dry run, dependencies included):
    the torch wheel and where it comes from, how many packages come with it, how many of them are CUDA's libraries
    (nvidia-*), and how much there is to download."""
    done = subprocess.run([python, "-m", "pip", "install", "--dry-run", "--quiet", "--ignore-installed", "--report",
                           "-", *options, requirement], capture_output=True, text=True)
    try:
        packages = json.loads(done.stdout)["install"]
    except (ValueError, KeyError):
        return f"pip could not say what it would install ({(done.stderr.strip().splitlines() or ['no answer'])[-1]})"
    urls = [package["download_info"]["url"] for package in packages]
    torch = next(url for package, url in zip(packages, urls) if package["metadata"]["name"].lower() == "torch")
    local = torch.startswith("file://")
    where = urllib.parse.urlparse(torch)
    source = os.path.dirname(urllib.request.url2pathname(where.path)) if local else where.netloc
    cuda = sum(package["metadata"]["name"].lower().startswith("nvidia-") for package in packages)
    with ThreadPoolExecutor(8) as pool:
        sizes = list(pool.map(size_of, urls))
    known = sum(size for size in sizes if size is not None)
    return (f"pip will install {urllib.parse.unquote(torch.rsplit('/', 1)[-1])} from {source}"
            + (f" and {len(packages) - 1} more package(s), {cuda} of them CUDA's libraries (nvidia-*)" if cuda else
               f" and {len(packages) - 1} more package(s), none of them CUDA's" if len(packages) > 1 else "")
            + f"; {'at least ' if None in sizes else ''}{known / 1e9:.1f} GB to {'copy' if local else 'download'}")


def pip(python: str, *args: str) -> None:
    subprocess.run([python, "-m", "pip", *args], check=True)


def install(python: str, request: str, index: str, wheelhouse: str | None) -> None:
    pin = torch_pin()
    if wheelhouse:
        wheels = sorted(p.name for p in Path(wheelhouse).glob("torch-*.whl"))
        build = "cpu" if wheels and all("+cpu" in name for name in wheels) else "pypi"
        if request != "auto" and request != build:
            raise SystemExit(f"torch: TORCH={request}, but {wheelhouse}/ holds {', '.join(wheels) or 'no torch wheel'}")
        print(f"torch: {', '.join(wheels) or 'no torch wheel'} from {wheelhouse}/")
        pip(python, "install", "--quiet", "--no-index", "--find-links", wheelhouse, "--no-deps", pin)
        return
    build, why = choose(request)
    if build == "pypi":
        print(f"torch: {pin} from your package index ({why}; TORCH=cpu forces the CPU build): "
              f"{what_pip_installs(python, pin)}", flush=True)
        return  # requirements.txt installs it
    problem = reachable(index)
    if problem:
        if request == "cpu":
            raise SystemExit(f"torch: TORCH=cpu, but {index} cannot be reached ({problem}); see README, 'Installing'")
        print(f"torch: {index} cannot be reached ({problem}), so {pin} comes from your package index: "
              f"{what_pip_installs(python, pin)} (README, 'Installing')", flush=True)
        return
    print(f"torch: the CPU build of {pin} from {index} ({why}; TORCH=pypi forces PyPI's build)")
    pip(python, "install", "--quiet", "--no-deps", "--index-url", index, pin)


def download(dest: str, request: str, index: str) -> None:
    build, why = choose(request)
    if build == "cpu":
        problem = reachable(index)
        if problem:
            raise SystemExit(f"torch: the CPU build ({why}) comes from {index}, which cannot be reached ({problem}); "
                             f"TORCH=pypi downloads PyPI's build instead")
        print(f"torch: the CPU build of {torch_pin()} from {index} ({why}; TORCH=pypi forces PyPI's build)")
        pip(sys.executable, "download", "--quiet", "--no-deps", "--index-url", index, "-d", dest, torch_pin())
    else:
        print(f"torch: {torch_pin()} from your package index ({why}; TORCH=cpu forces the CPU build)")


def check(python: str, request: str) -> None:
    """Report, before .venv is reused, a torch build other than the one this machine or TORCH asks for."""
    if not Path(python).exists():
        return
    done = subprocess.run([python, "-c", "import importlib.metadata as m; print(m.version('torch'))"],
                          capture_output=True, text=True)
    if done.returncode:
        return  # no torch yet: the install step will put one there
    version = done.stdout.strip()
    have = "cpu" if version.endswith("+cpu") else "pypi"
    want, why = choose(request)
    if have != want:
        names = {"cpu": "the CPU build", "pypi": "PyPI's build"}
        message = (f"torch: .venv has torch {version} ({names[have]}), but {why} asks for {names[want]}; "
                   f"to switch: make clean, then make lab{' TORCH=' + request if request != 'auto' else ''}")
        if request != "auto":
            raise SystemExit(message)
        print(message + f" (or TORCH={have} to keep it quietly)")


def main() -> None:
    paragraphs = __doc__.split("\n\n")
    parser = argparse.ArgumentParser(description="\n\n".join(paragraphs[:2]), epilog=paragraphs[2],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=["install", "download", "check"])
    parser.add_argument("target", help="the venv's python (install, check) or the wheelhouse folder (download)")
    parser.add_argument("--torch", default="auto", choices=["auto", "cpu", "pypi"])
    parser.add_argument("--cpu-index", default=CPU_INDEX, help=f"PyTorch's CPU wheel index (default {CPU_INDEX})")
    parser.add_argument("--wheelhouse", help="install from this folder only, without network")
    args = parser.parse_args()
    if args.action == "install":
        install(args.target, args.torch, args.cpu_index, args.wheelhouse)
    elif args.action == "download":
        download(args.target, args.torch, args.cpu_index)
    else:
        check(args.target, args.torch)


if __name__ == "__main__":
    main()
