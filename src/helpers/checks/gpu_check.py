"""``make gpu-check``: on a CUDA machine, check every GPU claim of the series. One report, as text and as JSON
(``--json FILE``); exit 1 on any failure.

- memory: the predictions against what CUDA's allocator reports for real BERT-base-size steps;
- one GPU: a run killed mid-epoch and resumed with ``--deterministic`` ends bitwise like an uninterrupted one;
  what notebook 06's two-process run meets there (refused, then ``--device cpu`` over gloo);
- two or more GPUs: DDP over NCCL with 2 processes against one process, bitwise equal weights on all ranks,
  and kill-and-resume under torchrun with ``--deterministic``, bitwise;
- every notebook and solution executed with its GPU cells active, in a scratch copy; a failing cell is
  named by notebook and cell index.

Without CUDA it says so in one line and exits 0: there is nothing to check on such a machine.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from helpers.fsdp_memory import check_fsdp
from helpers.memory import per_device, trace_by_layers
from helpers.checks import gpu_runs
from helpers.checks.notebook_env import NOTEBOOK_ENV
from helpers.cuda_step import CudaPeak, gpu_sdpa_kernel, measure_cuda_step
from helpers.memtrace import bert_base_config, cuda_sdpa_kernel

TOLERANCE = 0.05
ROOT = Path(__file__).resolve().parents[3]
GIB = 2**30


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


def series_notebooks() -> list[Path]:
    """The lessons in order, then their solutions."""
    return sorted(ROOT.glob("notebooks/*.ipynb")) + sorted(ROOT.glob("notebooks/solutions/*.ipynb"))


def execute_copy(notebook: Path, target: Path, env: dict | None = None,
                 allow_errors: bool = False) -> subprocess.CompletedProcess:
    """Execute a copy of ``notebook`` at ``target``, in target's folder, as ``make notebooks`` does (``env`` added).

    It stops at the first error in a cell not tagged raises-exception, unless ``allow_errors``: then every
    cell runs and the errors stay in the copy's outputs. The committed notebook is untouched.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(notebook, target)
    return subprocess.run([sys.executable, "-m", "jupyter", "nbconvert", "--to", "notebook", "--execute",
                           "--inplace", "--ExecutePreprocessor.timeout=1200", str(target)]
                          + (["--allow-errors"] if allow_errors else []),
                          cwd=target.parent, env=os.environ | NOTEBOOK_ENV | (env or {}), capture_output=True, text=True)


def first_failing_cell(executed: Path) -> str | None:
    """``cell N: Error: message`` for the first cell of an executed notebook that raised without being tagged
    raises-exception (N counts every cell from 0, as nbformat does), or None."""
    cells = json.loads(executed.read_text(encoding="utf-8"))["cells"]
    for index, cell in enumerate(cells):
        if cell["cell_type"] != "code" or "raises-exception" in cell.get("metadata", {}).get("tags", []):
            continue
        for output in cell.get("outputs", []):
            if output["output_type"] == "error":
                return f"cell {index}: {output['ename']}: {output['evalue']}".splitlines()[0][:300]
    return None


ONE_GPU_EDIT = ("device_ids=[0, 1]", "device_ids=[0]")
"""What notebooks 03 and 04 tell a reader with one GPU to change before running them."""


def one_gpu_copy(notebook: Path, target: Path) -> bool:
    """Write ``notebook`` to ``target`` with ONE_GPU_EDIT made in its code cells; True if anything changed."""
    data = json.loads(notebook.read_text(encoding="utf-8"))
    changed = False
    for cell in data["cells"]:
        source = "".join(cell["source"])
        if cell["cell_type"] == "code" and ONE_GPU_EDIT[0] in source:
            cell["source"], changed = source.replace(*ONE_GPU_EDIT), True
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(data, ensure_ascii=False, indent=1), encoding="utf-8")
    return changed


def execute_notebooks(scratch: Path, gpus: int) -> list[tuple[bool, str]]:
    """Execute every notebook into ``scratch`` (the committed notebooks are left untouched), every cell even
    after an error, so that the report names the first failing cell. With one GPU, ``device_ids=[0, 1]`` is
    first changed to ``[0]``, as 03 and 04 tell such a reader to do."""
    results = []
    for notebook in series_notebooks():
        target = scratch / notebook.relative_to(ROOT / "notebooks")
        source, edited = notebook, False
        if gpus == 1:
            source = scratch / "edited" / notebook.relative_to(ROOT / "notebooks")
            edited = one_gpu_copy(notebook, source)
        run = execute_copy(source, target, allow_errors=True)
        failure = first_failing_cell(target) if run.returncode == 0 else (run.stderr.strip().splitlines() or [""])[-1]
        results.append((failure is None, f"notebook {notebook.relative_to(ROOT)}"
                        + (f" (with {ONE_GPU_EDIT[0]} -> {ONE_GPU_EDIT[1]})" if edited else "")
                        + (f": {failure}" if failure else "")))
    return results


def run_checks(checks: dict[str, callable]) -> list[dict]:
    """Run every check (section name -> function returning [(ok, line), ...]); a check that raises is a failure
    with its exception, and the others still run."""
    rows = []
    for section, check in checks.items():
        try:
            results = check()
        except Exception as error:  # the report must come out whatever one check does
            results = [(False, f"raised {type(error).__name__}: {error}")]
        # the row carries ok: a line's own leading "ok  " or "FAIL" is dropped
        rows += [{"section": section, "ok": bool(ok), "line": re.sub(r"^(ok  |FAIL) ", "", line)} for ok, line in results]
    return rows


def report(rows: list[dict], machine: dict) -> tuple[str, dict]:
    """The report as text and as JSON: the machine, then one line per check, then the verdict."""
    failures = sum(not row["ok"] for row in rows)
    verdict = f"gpu-check: {'FAILED' if failures else 'passed'} ({failures} failure(s) of {len(rows)} checks)"
    lines = [f"gpu-check on {machine['gpus']} GPU(s): {', '.join(machine['names'])}; torch {machine['torch']}, "
             f"CUDA {machine['cuda']}"]
    lines += [f"{'ok  ' if row['ok'] else 'FAIL'} [{row['section']}] {row['line']}" for row in rows]
    lines.append(verdict)
    return "\n".join(lines), {"result": "failed" if failures else "passed", "failures": failures, "machine": machine,
                              "checks": rows}


def machine() -> dict:
    count = torch.cuda.device_count()
    return {"gpus": count, "names": [torch.cuda.get_device_name(i) for i in range(count)],
            "torch": torch.__version__, "cuda": torch.version.cuda, "python": sys.version.split()[0]}


def gpu_checks(gpus: int, scratch: Path, notebooks: bool) -> dict[str, callable]:
    """The checks for a machine with ``gpus`` CUDA GPUs, in the order they run."""
    from helpers.checks import training_checks as runs
    from helpers.checks.lever_check import check_levers

    checks = {"memory": check_memory, "levers": check_levers}
    if gpus == 1:
        checks["resume"] = lambda: [runs.check_kill_and_resume(1, scratch / "resume-1", "--deterministic")]
        checks["two processes on one GPU"] = runs.check_two_processes_on_one_gpu
    else:
        checks["ddp"] = lambda: [runs.check_ddp_equivalence(2)]
        checks["resume"] = lambda: [runs.check_kill_and_resume(2, scratch / "resume-2", "--deterministic")]
        checks["fsdp"] = check_fsdp
    if notebooks:
        checks["notebooks"] = lambda: execute_notebooks(scratch / "notebooks", gpus)
    return checks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m helpers.checks.gpu_check", description=__doc__.splitlines()[0])
    parser.add_argument("--skip-notebooks", action="store_true", help="do not execute the notebooks")
    parser.add_argument("--keep", type=Path, metavar="DIR", help="run in this folder (executed notebooks, checkpoints, "
                        "logs) and keep it; the executed notebooks also go into DIR/gpu-runs/ as a folder for the site")
    parser.add_argument("--json", type=Path, metavar="FILE", help="also write the report as JSON into FILE")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        line = "gpu-check: skipped, no CUDA device on this machine (nothing to check here)"
        print(line)
        if args.json:
            args.json.write_text(json.dumps({"result": "skipped", "failures": 0, "reason": line}, indent=1) + "\n")
        return 0
    print(f"gpu-check on {torch.cuda.device_count()} GPU(s); one line per check follows when all have run", flush=True)
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as temporary:
        scratch = args.keep or Path(temporary)
        rows = run_checks(gpu_checks(torch.cuda.device_count(), scratch, not args.skip_notebooks))
    if args.keep and not args.skip_notebooks:  # the executed notebooks as the site shows them (docs/gpu-runs/)
        one_gpu = f" with {ONE_GPU_EDIT[0]} -> {ONE_GPU_EDIT[1]} in 03 and 04" if torch.cuda.device_count() == 1 else ""
        run = gpu_runs.save(args.keep / "notebooks", args.keep / "gpu-runs", f"make gpu-check --keep{one_gpu}")
        print(f"executed notebooks for the site: {run.folder} (copy it into docs/gpu-runs/ to show them)")
    text, data = report(rows, machine())
    print(text)
    if args.json:
        args.json.write_text(json.dumps(data, indent=1) + "\n")
    if data["failures"] and any(row["section"] == "memory" and not row["ok"] for row in rows):
        print("A memory gap beyond the tolerance means the model misses something this GPU keeps: compare "
              "torch.cuda.memory_summary() with the predicted categories (notebook 05).")
    return 1 if data["failures"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
