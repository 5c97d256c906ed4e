"""``make gpu-check``: on a CUDA machine, run every notebook with its GPU cells active and check the memory
predictions against what CUDA's allocator reports for real BERT-base-size steps. One report; exit 1 on failure.

Without CUDA it says so in one line and exits 0: there is nothing to check on such a machine.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from torch import nn

from helpers.memory import per_device
from helpers.memtrace import bert_base_config, build_model

TOLERANCE = 0.05
ROOT = Path(__file__).resolve().parents[2]
GIB = 2**30


def measure_cuda_step(config, batch_size: int, seq_len: int, devices: list[int]) -> list[int]:
    """``torch.cuda.max_memory_allocated`` per device over one Adam step of ``Net`` with random weights.

    One device: the model on it. Several: ``nn.DataParallel`` over them. A first step creates Adam's state
    (as in the prediction), then the peaks are reset and the measured step runs with the same shapes.
    """
    torch.manual_seed(0)
    model = build_model(config, device="cpu").to(f"cuda:{devices[0]}")
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    net = nn.DataParallel(model, device_ids=devices) if len(devices) > 1 else model
    net.train()

    def step(size, length):
        input_ids = torch.randint(0, config.vocab_size, (size, length), device=f"cuda:{devices[0]}")
        labels = torch.randint(0, 2, (size,), device=f"cuda:{devices[0]}")
        loss = nn.functional.cross_entropy(net(input_ids, torch.ones_like(input_ids)), labels)
        loss.backward()
        del loss
        optimizer.step()
        optimizer.zero_grad()

    step(len(devices), 8)
    for device in devices:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    step(batch_size, seq_len)
    peaks = [torch.cuda.max_memory_allocated(device) for device in devices]
    del net, model, optimizer
    torch.cuda.empty_cache()
    return peaks


def compare(label: str, predicted: int, measured: int) -> tuple[bool, str]:
    gap = (measured - predicted) / predicted
    ok = abs(gap) <= TOLERANCE
    return ok, (f"{'ok  ' if ok else 'FAIL'} {label:<40} predicted {predicted / GIB:7.2f} GiB  "
                f"measured {measured / GIB:7.2f} GiB  gap {gap:+.1%}")


def check_memory(batch_sizes=(8, 16, 32), seq_len: int = 512) -> list[tuple[bool, str]]:
    """Predicted vs measured peaks: one GPU at several batch sizes, and DataParallel where 2+ GPUs exist."""
    config = bert_base_config()
    capacity = 0.9 * min(torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count()))
    results = []
    for batch_size in batch_sizes:
        (predicted,) = per_device(config, batch_size, seq_len)
        if predicted["total"] > capacity:
            results.append((True, f"skip 1 GPU, B={batch_size}: predicted {predicted['total'] / GIB:.1f} GiB does "
                                  f"not fit 90% of this GPU"))
            continue
        (measured,) = measure_cuda_step(config, batch_size, seq_len, [0])
        results.append(compare(f"1 GPU, B={batch_size}, L={seq_len}", predicted["total"], measured))
    if torch.cuda.device_count() >= 2:
        batch_size = 2 * batch_sizes[0]
        predicted = per_device(config, batch_size, seq_len, strategy="dataparallel", gpus=2)
        measured = measure_cuda_step(config, batch_size, seq_len, [0, 1])
        for gpu in (0, 1):
            results.append(compare(f"DataParallel GPU{gpu}, B={batch_size}, L={seq_len}",
                                   predicted[gpu]["total"], measured[gpu]))
    else:
        results.append((True, "skip DataParallel per-device check: needs 2 CUDA GPUs"))
    return results


NOTEBOOK_ENV = {"TQDM_DISABLE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1", "HF_HUB_OFFLINE": "1", "PYTHONHASHSEED": "0"}


def series_notebooks() -> list[Path]:
    """The lessons in order, then their solutions."""
    return sorted(ROOT.glob("notebooks/*.ipynb")) + sorted(ROOT.glob("notebooks/solutions/*.ipynb"))


def execute_copy(notebook: Path, target: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    """Execute a copy of ``notebook`` at ``target``, in target's folder, as ``make notebooks`` does (``env`` added).

    It stops at the first error in a cell not tagged raises-exception; the committed notebook is untouched.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(notebook, target)
    return subprocess.run([sys.executable, "-m", "jupyter", "nbconvert", "--to", "notebook", "--execute",
                           "--inplace", "--ExecutePreprocessor.timeout=1200", str(target)],
                          cwd=target.parent, env=os.environ | NOTEBOOK_ENV | (env or {}), capture_output=True, text=True)


def execute_notebooks(scratch: Path) -> list[tuple[bool, str]]:
    """Execute every notebook into ``scratch`` (the committed notebooks are left untouched)."""
    results = []
    for notebook in series_notebooks():
        run = execute_copy(notebook, scratch / notebook.relative_to(ROOT / "notebooks"))
        last = (run.stderr.strip().splitlines() or [""])[-1]
        results.append((run.returncode == 0, f"{'ok  ' if run.returncode == 0 else 'FAIL'} notebook "
                                             f"{notebook.relative_to(ROOT)}" + ("" if run.returncode == 0 else f": {last}")))
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m helpers.gpu_check", description=__doc__.splitlines()[0])
    parser.add_argument("--skip-notebooks", action="store_true", help="only check the memory predictions")
    parser.add_argument("--keep", type=Path, help="execute the notebooks into this folder and keep it")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu-check: skipped, no CUDA device on this machine (nothing to check here)")
        return 0
    names = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
    print(f"gpu-check on {torch.cuda.device_count()} GPU(s): {names}; torch {torch.__version__}")
    print(f"memory: prediction (helpers.memory, eager attention, fp32 Adam) vs torch.cuda.max_memory_allocated, "
          f"tolerance {TOLERANCE:.0%}")
    results = check_memory()
    if not args.skip_notebooks:
        if args.keep:
            results += execute_notebooks(args.keep)
        else:
            with tempfile.TemporaryDirectory(prefix="gpu-check-") as scratch:
                results += execute_notebooks(Path(scratch))
    for _, line in results:
        print(line)
    failures = sum(not ok for ok, _ in results)
    print(f"gpu-check: {'FAILED' if failures else 'passed'} ({failures} failure(s) of {len(results)} checks)")
    if failures:
        print("A memory gap beyond the tolerance means the model misses something this GPU keeps: compare "
              "torch.cuda.memory_summary() with the predicted categories (notebook 05).")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
