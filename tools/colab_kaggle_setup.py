"""Set up the series in a Google Colab or Kaggle notebook; the README's first cell runs it with IPython's ``%run``.

These platforms keep their own torch, Jupyter and plotting stack, built for their GPUs. This installs the package
(editable, without its dependencies) and, at the versions of requirements.txt, what the notebooks need besides them;
makes the package importable in the running kernel; and says in a few lines what the notebooks will find: the
platform's torch against the releases the series ran on, the GPUs torch sees, and whether the session must be
restarted first. Run again, it installs nothing that is already there.

What the kernel had imported is read before anything runs: pip, and torch, which imports nvidia-ml-py's pynvml, add
modules of their own, and only those imported before the cell make a restart necessary. Below the oldest torch the
series runs on (helpers.torch_private.NEEDED, read here without importing torch), nothing is installed: the cell
says which torch to install instead, so that pip's own complaint about the package's torch>= never comes first.
"""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HOSTED = ("transformers", "tokenizers", "safetensors", "huggingface-hub", "fugashi", "unidic-lite", "ipadic",
          "nvidia-ml-py")
"""What the notebooks import that Colab and Kaggle lack or hold at other versions (never torch: theirs is built for
their GPUs; never the Jupyter stack: it runs the notebook)."""
SWITCH_RUNTIME = "Colab: Runtime > Change runtime type > T4 GPU; Kaggle: Settings > Accelerator > GPU T4 x2"
RESTART = "Colab: Runtime > Restart session; Kaggle: Run > Restart & clear cell outputs"


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(requirements: Path = ROOT / "requirements.txt") -> dict[str, str]:
    """{name: exact version} of requirements.txt, names normalized."""
    found = {}
    for line in requirements.read_text(encoding="utf-8").splitlines():
        if "==" in line and not line.lstrip().startswith("#"):
            name, version = line.split("#")[0].strip().split("==")
            found[normalize(name)] = version
    return found


def installed() -> dict[str, str]:
    """{name: version} of every installed distribution; where a name is installed twice, the one imports find."""
    importlib.invalidate_caches()
    found = {}
    for dist in metadata.distributions():
        if dist.metadata["Name"]:
            found.setdefault(normalize(dist.metadata["Name"]), dist.version)
    return found


def torch_range(root: Path = ROOT) -> dict[str, str]:
    """TESTED (the pinned torch), NEEDED (the oldest every notebook runs on) and NEWEST (the newest they ran on), as
    helpers.torch_private states them; read from its source, since importing it imports torch."""
    tree = ast.parse((root / "src" / "helpers" / "torch_private.py").read_text(encoding="utf-8"))
    return {node.targets[0].id: node.value.value for node in tree.body if isinstance(node, ast.Assign)
            and isinstance(node.targets[0], ast.Name) and node.targets[0].id in ("TESTED", "NEEDED", "NEWEST")}


def missing(wanted: dict[str, str], have: dict[str, str]) -> list[str]:
    """The ``name==version`` requirements ``have`` does not satisfy."""
    return [f"{name}=={version}" for name, version in wanted.items() if have.get(name) != version]


def pip_commands(root: Path, requirements: list[str], package_installed: bool) -> list[list[str]]:
    commands = [] if package_installed else [[sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "-e",
                                              str(root)]]
    if requirements:
        commands.append([sys.executable, "-m", "pip", "install", "--quiet", *requirements])
    return commands


def stale_modules(before: dict[str, str], after: dict[str, str], loaded: set[str],
                  owners: dict[str, list[str]]) -> list[str]:
    """Modules this kernel already imported whose distribution pip has just changed: only a restart loads the new
    ones. ``owners`` maps a top-level module to its distributions (``importlib.metadata.packages_distributions``)."""
    changed = {name for name, version in after.items() if before.get(name) != version}
    return sorted(module for module in loaded & set(owners) if changed & {normalize(d) for d in owners[module]})


def release(version: str) -> tuple[int, ...]:
    """(major, minor) of a version such as '2.10.0+cu128'."""
    return tuple(int(part) for part in re.findall(r"\d+", version.split("+")[0])[:2])


def report(torch_version: str, versions: dict[str, str], gpus: list[str], stale: list[str]) -> list[str]:
    """What the notebooks will find, one line each; the last line says what to do next. ``versions``: torch_range()."""
    ran = f"the series ran on torch {versions['NEEDED']} to {versions['NEWEST']}"
    too_old = release(torch_version) < release(versions["NEEDED"])
    if too_old:
        lines = [f"torch {torch_version} (the platform's; {ran}): older than {versions['NEEDED']}, so nothing was "
                 f"installed; pip install torch=={versions['TESTED']} (a download of several GB), then restart the "
                 f"session ({RESTART}) and run this cell again"]
    else:
        newer = release(torch_version) > release(versions["NEWEST"])
        lines = [f"torch {torch_version} (the platform's, kept; {ran}" + (", not on this newer one yet)" if newer
                                                                           else ")")]
    lines.append(f"GPUs torch sees: {len(gpus)}" + (f" ({', '.join(gpus)})" if gpus else
                                                    f"; for a GPU, switch the runtime ({SWITCH_RUNTIME}) and run "
                                                    f"this cell again"))
    if stale:
        lines.append(f"restart the session now ({RESTART}): this kernel imported {', '.join(stale)} before pip "
                     f"changed it; then run this cell again")
    elif not too_old:
        lines.append("ready: run the notebook from its next cell")
    return lines


def main(root: Path = ROOT) -> list[str]:
    loaded = set(sys.modules)  # what the kernel imported before this cell: pip and torch import more below
    wanted, versions = pins(root / "requirements.txt"), torch_range(root)
    before = installed()
    if "torch" not in before:
        return [f"no torch here: pip install torch=={versions['TESTED']}, then run this cell again"]
    if release(before["torch"]) >= release(versions["NEEDED"]):
        requirements = missing({name: wanted[name] for name in HOSTED}, before)
        for command in pip_commands(root, requirements, "bert-ja-multigpu-helpers" in before):
            subprocess.run(command, check=True)
    after = installed()
    if str(root / "src") not in sys.path:  # pip's editable install is read when a Python starts, not in this kernel
        sys.path.insert(0, str(root / "src"))
    import torch

    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    stale = stale_modules(before, after, loaded, metadata.packages_distributions())
    return report(torch.__version__, versions, gpus, stale)


if __name__ == "__main__":
    print("\n".join(main()))
