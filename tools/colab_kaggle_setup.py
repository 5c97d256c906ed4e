"""Set up the series in a Google Colab or Kaggle notebook; the README's first cell runs it with IPython's ``%run``.

These platforms keep their own torch, Jupyter and plotting stack, built for their GPUs. This installs the package
(editable, without its dependencies) and, at the versions of requirements.txt, what the notebooks need besides them;
makes the package importable in the running kernel; and says in a few lines what the notebooks will find: the
platform's torch against the tested one, the GPUs torch sees, and whether the session must be restarted first.
Run again, it installs nothing that is already there.
"""

from __future__ import annotations

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
TRANSFORMERS_NEEDS = (2, 6)
"""transformers 5.24 switches PyTorch off below this torch (its import_utils: 'PyTorch >= 2.6 is required')."""
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
    importlib.invalidate_caches()
    return {normalize(dist.metadata["Name"]): dist.version for dist in metadata.distributions() if dist.metadata["Name"]}


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


def version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", version.split("+")[0])[:2])


def report(torch_version: str, tested: str, gpus: list[str], stale: list[str]) -> list[str]:
    """What the notebooks will find, one line each; the last line says what to do next."""
    lines = [f"torch {torch_version} (the platform's; the series is tested with {tested})"]
    too_old = version_tuple(torch_version) < TRANSFORMERS_NEEDS
    if too_old:
        lines.append(f"transformers needs torch {'.'.join(map(str, TRANSFORMERS_NEEDS))} or newer and switches "
                     f"PyTorch off below it: pip install torch=={tested} (a download of several GB), then restart the "
                     f"session ({RESTART}) and run this cell again")
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
    wanted = pins(root / "requirements.txt")
    before = installed()
    requirements = missing({name: wanted[name] for name in HOSTED}, before)
    for command in pip_commands(root, requirements, "bert-ja-multigpu-helpers" in before):
        subprocess.run(command, check=True)
    after = installed()
    if str(root / "src") not in sys.path:  # pip's editable install is read when a Python starts, not in this kernel
        sys.path.insert(0, str(root / "src"))
    import torch

    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    stale = stale_modules(before, after, set(sys.modules), metadata.packages_distributions())
    return report(torch.__version__, wanted["torch"], gpus, stale)


if __name__ == "__main__":
    print("\n".join(main()))
