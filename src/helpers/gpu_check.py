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
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from helpers.memory import per_device, trace_by_layers
from helpers.memtrace import bert_base_config, build_model, cuda_sdpa_kernel

TOLERANCE = 0.05
ROOT = Path(__file__).resolve().parents[2]
GIB = 2**30


@dataclass(frozen=True)
class CudaPeak:
    """One device's ``torch.cuda`` figures for a measured step: what it held before, and its peak."""

    before: int  # memory_allocated when the step starts (weights and Adam state, or nothing on a replica)
    peak: int    # max_memory_allocated during the step


def measure_cuda_step(config, batch_size: int, seq_len: int, devices: list[int], *, attention: str = "sdpa",
                      amp: bool = False) -> list[CudaPeak]:
    """``torch.cuda.max_memory_allocated`` per device over one Adam step of ``Net`` with random weights.

    One device: the model on it. Several: ``nn.DataParallel`` over them. A first step creates Adam's state
    (as in the prediction), then the peaks are reset and the measured step runs with the same shapes, its
    forward and loss under ``torch.autocast("cuda", dtype=torch.bfloat16)`` when ``amp``.
    """
    torch.manual_seed(0)
    model = build_model(config, attention=attention, device="cpu").to(f"cuda:{devices[0]}")
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    net = nn.DataParallel(model, device_ids=devices) if len(devices) > 1 else model
    net.train()

    def step(size, length):
        input_ids = torch.randint(0, config.vocab_size, (size, length), device=f"cuda:{devices[0]}")
        labels = torch.randint(0, 2, (size,), device=f"cuda:{devices[0]}")
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
            loss = nn.functional.cross_entropy(net(input_ids, torch.ones_like(input_ids)), labels)
        loss.backward()
        del loss
        optimizer.step()
        optimizer.zero_grad()

    step(len(devices), 8)
    before = []
    for device in devices:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before.append(torch.cuda.memory_allocated(device))
    step(batch_size, seq_len)
    peaks = [CudaPeak(held, torch.cuda.max_memory_allocated(device)) for held, device in zip(before, devices)]
    del net, model, optimizer
    torch.cuda.empty_cache()
    return peaks


def gpu_sdpa_kernel(config, batch_size: int, seq_len: int, dtype: torch.dtype) -> str:
    """The kernel this GPU's ``scaled_dot_product_attention`` picks for BERT's unmasked training call, asked
    with ``torch._fused_sdp_choice`` on tensors laid out as BERT lays them out ((B, L, A, d) transposed)."""
    from torch.nn.attention import SDPBackend

    heads = config.num_attention_heads
    query = torch.empty(batch_size, seq_len, heads, config.hidden_size // heads, device="cuda", dtype=dtype,
                        requires_grad=True).transpose(1, 2)
    choice = torch._fused_sdp_choice(query, query, query, None, config.attention_probs_dropout_prob, False)
    names = {int(member.value): name for name, member in SDPBackend.__members__.items()}
    return {"EFFICIENT_ATTENTION": "memory-efficient", "FLASH_ATTENTION": "flash",
            "CUDNN_ATTENTION": "cuDNN", "MATH": "math"}.get(names.get(choice), str(names.get(choice, choice)))


def compare(label: str, predicted: int, measured: int, causes: list[str] = ()) -> tuple[bool, str]:
    """One line: ok within TOLERANCE, else FAIL with the gap and each cause found for it."""
    gap = (measured - predicted) / predicted
    ok = abs(gap) <= TOLERANCE
    line = (f"{'ok  ' if ok else 'FAIL'} {label:<44} predicted {predicted / GIB:7.2f} GiB  "
            f"measured {measured / GIB:7.2f} GiB  gap {gap:+.1%}")
    if not ok:
        line += "".join(f"\n       cause: {cause}" for cause in causes or
                        ["not identified; compare torch.cuda.memory_summary() with the predicted categories"])
    return ok, line


def gap_causes(predicted: dict[str, int], before_predicted: int, measured: CudaPeak, traced_kernel: str,
               gpu_kernel: str) -> list[str]:
    """What a measured gap can be traced to: a different attention kernel, or memory held before the step."""
    causes = []
    if gpu_kernel != traced_kernel and {gpu_kernel, traced_kernel} != {"flash", "cuDNN"}:  # those two keep alike
        causes.append(f"this GPU runs the {gpu_kernel} attention kernel; the prediction traced {traced_kernel}")
    held = measured.before - before_predicted
    if abs(held) > 0.5 * abs(measured.peak - predicted["total"]):
        causes.append(f"{held / 2**20:+,.0f} MiB held before the step that the trace does not have "
                      f"(measured {measured.before / 2**20:,.0f}, predicted {before_predicted / 2**20:,.0f} MiB: "
                      f"cuBLAS/cuDNN workspaces, allocator rounding)")
    return causes


def check_memory(batch_sizes=(8, 16, 32), seq_lens=(128, 512)) -> list[tuple[bool, str]]:
    """Predicted vs measured peaks on one GPU for each batch size and sequence length, with the default
    attention (sdpa) and eager, in fp32 and with bf16 autocast where supported; DataParallel per device
    in the memo's setting where 2+ GPUs exist. A leading line names the kernels this GPU picks."""
    config = bert_base_config()
    capacity = 0.9 * min(torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count()))
    precisions = (False, True) if torch.cuda.is_bf16_supported() else (False,)
    kernels = {amp: gpu_sdpa_kernel(config, batch_sizes[0], seq_lens[0], torch.bfloat16 if amp else torch.float32)
               for amp in precisions}
    results = [(True, "info attention on this GPU (sdpa, unmasked): "
                + ", ".join(f"{'bf16' if amp else 'fp32'} -> {kernel}" for amp, kernel in kernels.items())
                + "; predictions trace " + ", ".join(
                    f"{'bf16' if amp else 'fp32'} -> {cuda_sdpa_kernel(torch.bfloat16 if amp else torch.float32)}"
                    for amp in precisions))]
    if not torch.cuda.is_bf16_supported():
        results.append((True, "skip AMP checks: this GPU does not support bf16"))

    def check(devices, batch_size, seq_len, attention, amp, strategy="single"):
        dtype = torch.bfloat16 if amp else torch.float32
        traced = cuda_sdpa_kernel(dtype) if attention == "sdpa" else "eager"
        gpu = kernels[amp] if attention == "sdpa" else "eager"
        predicted = per_device(config, batch_size, seq_len, strategy=strategy, gpus=len(devices),
                               attention=attention, amp=amp)
        where = f"{len(devices)} GPU" if strategy == "single" else "DataParallel"
        label = f"{where}, {traced}, {'bf16' if amp else 'fp32'}, B={batch_size}, L={seq_len}"
        if max(device["total"] for device in predicted) > capacity:
            return [(True, f"skip {label}: predicted {predicted[0]['total'] / GIB:.1f} GiB does not fit 90% of "
                           f"this GPU")]
        step = trace_by_layers(config, batch_size // len(devices), seq_len, attention=attention,
                               amp_dtype=dtype if amp else None)
        before = [step.after_forward["weights"] + step.after_forward["optimizer"]] + [0] * (len(devices) - 1)
        measured = measure_cuda_step(config, batch_size, seq_len, devices, attention=attention, amp=amp)
        return [compare(label + (f", GPU{i}" if len(devices) > 1 else ""), predicted[i]["total"], measured[i].peak,
                        gap_causes(predicted[i], before[i], measured[i], traced, gpu)) for i in range(len(devices))]

    for amp in precisions:
        for attention in ("sdpa", "eager"):
            for seq_len in seq_lens:
                for batch_size in batch_sizes:
                    results += check([0], batch_size, seq_len, attention, amp)
    if torch.cuda.device_count() >= 2:  # the memo's setting: DataParallel over two GPUs, fp32
        for attention in ("sdpa", "eager"):
            results += check([0, 1], 2 * batch_sizes[1], seq_lens[-1], attention, False, strategy="dataparallel")
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
