"""``make gpu-check``: on a CUDA machine, check every GPU claim of the series. Each check prints its line as soon
as it is done; the report is also written as JSON (``--json FILE``, rewritten after every line, so a run cut
short keeps what finished); exit 1 on any failure.

- memory: the predictions of helpers.memory against what CUDA's caching allocator reports for real
  BERT-base-size steps, allocated and requested peaks side by side, each step in a clean state;
- one GPU: a run killed mid-epoch and resumed with ``--deterministic`` ends bitwise like an uninterrupted one;
  what notebook 06's two-process run meets there (refused, then ``--device cpu`` over gloo);
- two or more GPUs: DDP over NCCL with 2 processes against one process, bitwise equal weights on all ranks,
  kill-and-resume under torchrun with ``--deterministic``, bitwise, and FSDP2's per-rank memory;
- every notebook and solution executed with its GPU cells active, in a scratch copy; a failing cell is
  named by notebook and cell index.

``--only memory,resume`` runs some sections; ``--notebooks "08*"`` executes only the notebooks whose path under
notebooks/ matches. Without CUDA it says so in one line and exits 0: there is nothing to check on such a machine.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from helpers.checks import gpu_runs
from helpers.checks.notebook_env import NOTEBOOK_ENV, lessons_then_solutions
from helpers.launch import last_json
from helpers.memory import (GIB, CudaPeak, GpuModel, attention_kernel, bert_base_config, load_table, measure_cuda_step,
                            mixed_precision, per_device, predict_step, sdpa_kernel, this_gpu, workspaces)

ROOT = Path(__file__).resolve().parents[3]
MIB = 2**20
MEMORY_TOLERANCE = {"relative": 0.02, "fp32": 16 * MIB, "bf16": 48 * MIB, "fp16": 48 * MIB}
"""A measured allocated peak agrees with its prediction when it is within 2 % and within 16 MiB (fp32) or 48 MiB
(bf16 autocast) of it: the targets the prediction met on the 24 settings measured on an H200. fp16 autocast, which
holds what bf16 holds (helpers.memory.per_device), gets bf16's."""
ENVIRONMENT = ("CUBLAS_WORKSPACE_CONFIG", "CUBLASLT_WORKSPACE_SIZE", "TORCH_CUBLASLT_UNIFIED_WORKSPACE",
               "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
"""The variables that change what the allocator holds; the report records them."""


@dataclass(frozen=True)
class MemoryCase:
    """One measured step: a global batch, a sequence length and the settings ``per_device`` and
    ``measure_cuda_step`` share. A check of a lever is one more case (``accumulation=2``, ...)."""

    batch_size: int
    seq_len: int
    attention: str = "sdpa"
    amp: str | None = None  # "bf16" or "fp16": autocast (fp16 with a GradScaler); None: fp32
    accumulation: int = 1
    checkpointing: bool = False
    gpus: int = 1  # more than one: DataParallel over them

    def label(self, kernel: str) -> str:
        where = f"{self.gpus} GPU" if self.gpus == 1 else f"DataParallel x{self.gpus}"
        levers = (f", accumulation {self.accumulation}" if self.accumulation > 1 else "") + (
            ", checkpointing" if self.checkpointing else "")
        return (f"{where}, {kernel}, {self.amp or 'fp32'}, B={self.batch_size}, L={self.seq_len}"
                + levers)


def memory_cases(gpus: int, mixed: str) -> list[MemoryCase]:
    """The grid: B 8/16/32 x L 128/512, sdpa and eager, fp32 and the GPU's ``mixed`` precision (bf16 autocast, or
    fp16 autocast with a GradScaler on a GPU without native bf16); the two other levers of helpers.finetune at
    B=16, L=512 (2 micro-batches; activation checkpointing); DataParallel over two GPUs in the memo's setting
    where there are two."""
    cases = [MemoryCase(batch, length, attention, amp) for amp in (None, mixed)
             for attention in ("sdpa", "eager") for length in (128, 512) for batch in (8, 16, 32)]
    cases += [MemoryCase(16, 512, accumulation=2), MemoryCase(16, 512, checkpointing=True)]
    if gpus >= 2:
        cases += [MemoryCase(32, 512, attention, gpus=2) for attention in ("sdpa", "eager")]
    return cases


def within_tolerance(predicted: int, measured: int, amp: str | None) -> bool:
    gap = abs(measured - predicted)
    return gap <= MEMORY_TOLERANCE[amp or "fp32"] and gap <= MEMORY_TOLERANCE["relative"] * predicted


def gap_causes(predicted: dict[str, int], predicted_requested: int, measured: CudaPeak, traced_kernel: str,
               gpu_kernel: str) -> list[str]:
    """What a gap between a predicted and a measured allocated peak can be traced to, each as one sentence."""
    causes = []
    if measured.leftover:
        causes.append(f"{measured.leftover / MIB:,.1f} MiB were allocated before the model was built: earlier code "
                      f"still holds tensors")
    if gpu_kernel != traced_kernel:
        causes.append(f"this GPU runs the {gpu_kernel} attention kernel; the prediction traced {traced_kernel}")
    held = measured.held_after - measured.leftover
    if held != predicted["workspaces"]:
        causes.append(f"after the step this GPU keeps {held / MIB:,.1f} MiB (cuBLAS/cuBLASLt workspaces); the "
                      f"prediction has {predicted['workspaces'] / MIB:,.1f} MiB")
    requested_gap = measured.requested - predicted_requested
    if abs(requested_gap) <= MIB:
        causes.append(f"the requested bytes agree ({requested_gap / MIB:+.1f} MiB): the blocks differ, i.e. the "
                      f"allocator rounded or reused blocks otherwise than simulated")
    elif not causes:
        causes.append(f"the requested bytes differ by {requested_gap / MIB:+,.1f} MiB: the step allocates something the "
                      f"trace does not; record a snapshot (torch.cuda.memory._record_memory_history, notebook "
                      f"05_appendix_allocator)")
    return causes


def check_memory_case(config, case: MemoryCase, gpu: GpuModel) -> list[tuple[bool, str]]:
    """Predict and measure one case on ``gpu`` (this machine's GPU 0, with the kernels it picks); one line per GPU."""
    precision = case.amp or "fp32"
    traced = attention_kernel(gpu, precision) if case.attention == "sdpa" else "eager"
    measured_kernel = dict(gpu.kernels)[precision] if case.attention == "sdpa" else "eager"
    options = dict(attention=case.attention, amp=case.amp, accumulation=case.accumulation,
                   checkpointing=case.checkpointing, gpu=gpu, environ=dict(os.environ))
    strategy = "single" if case.gpus == 1 else "dataparallel"
    predicted = per_device(config, case.batch_size, case.seq_len, strategy=strategy, gpus=case.gpus, **options)
    label = case.label(traced)
    capacity = min(torch.cuda.get_device_properties(i).total_memory for i in range(case.gpus))
    if max(device["total"] for device in predicted) > 0.9 * capacity:
        return [(True, f"skip {label}: predicted {predicted[0]['total'] / 2**30:.1f} GiB does not fit 90% of this GPU")]
    step = predict_step(config, case.batch_size // case.gpus, case.seq_len, **options)
    measured = measure_cuda_step(config, case.batch_size, case.seq_len, list(range(case.gpus)),
                                 attention=case.attention, amp=case.amp, accumulation=case.accumulation,
                                 checkpointing=case.checkpointing)
    lines = []
    requested = step.requested_peak if case.gpus == 1 else None  # DataParallel's replicas are not traced
    for index, (prediction, peak) in enumerate(zip(predicted, measured)):
        ok = within_tolerance(prediction["total"], peak.peak, case.amp) and not peak.leftover
        line = (f"{label + (f', GPU{index}' if case.gpus > 1 else ''):<46} allocated: predicted "
                f"{prediction['total'] / MIB:>8,.0f} MiB  measured {peak.peak / MIB:>8,.0f} MiB  "
                f"gap {(peak.peak - prediction['total']) / MIB:+7.1f} MiB ({peak.peak / prediction['total'] - 1:+.2%})"
                f"  | requested: predicted {f'{requested / MIB:,.0f}' if requested else 'n/a':>8}  "
                f"measured {peak.requested / MIB:>8,.0f}")
        if not ok:
            line += "".join(f"\n       cause: {cause}" for cause in
                            gap_causes(prediction, requested or peak.requested, peak, traced, measured_kernel))
        lines.append((ok, line))
    return lines


def check_memory(cases: list[MemoryCase] | None = None):
    """Yield the memory lines: first the kernels and workspaces of this GPU, then one line per case and GPU."""
    config = bert_base_config()
    gpu = this_gpu(0)
    mixed, why = mixed_precision(gpu)
    held = workspaces(gpu.capability, os.environ)
    yield True, ("info " + gpu.name + f" ({gpu.sm}, {gpu.sm_count} SMs); attention (sdpa, unmasked): "
                 + ", ".join(f"{precision} -> {kernel} (by compute capability: "
                             f"{sdpa_kernel(gpu.capability, precision)})" for precision, kernel in gpu.kernels)
                 + "; workspaces predicted: " + ", ".join(f"{name} {size / MIB:g} MiB" for name, size in held.items()))
    yield True, f"info AMP checks in {mixed}: {why}"
    for case in cases or memory_cases(torch.cuda.device_count(), mixed):
        yield from check_memory_case(config, case, gpu)
    if torch.cuda.device_count() < 2:
        yield True, "skip DataParallel per-device check: needs 2 CUDA GPUs"

# --- FSDP2 ------------------------------------------------------------------------------------------------------

FSDP_GPUS = 2
FSDP_TOLERANCE = 0.05


def check_fsdp() -> list[tuple[bool, str]]:
    """The FSDP lines: on 2 CUDA GPUs over NCCL, each rank's measured peak (``helpers.memory.cuda_step``) for
    BERT-base at the per-rank batch of notebook 08's stored table, against that table's prediction. Skips, with the
    reason, where there are fewer than 2 GPUs or no NCCL."""
    import torch.distributed as dist

    gpus = FSDP_GPUS
    if not torch.cuda.is_available() or torch.cuda.device_count() < gpus:
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return [(True, f"skip FSDP check: needs {gpus} CUDA GPUs, this machine has {count}")]
    if not dist.is_nccl_available():
        return [(True, "skip FSDP check: this torch build has no NCCL")]
    table = load_table()
    size, length = table["batch_size"], table["seq_len"]
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={gpus}",
                          "-m", "helpers.memory.cuda_step", "--fsdp", "--batch-size", str(size),
                          "--seq-len", str(length)], capture_output=True, text=True, timeout=900)
    try:
        measured = last_json(run.stdout)
    except ValueError:
        measured = None
    if run.returncode != 0 or measured is None:
        return [(False, f"FAIL FSDP run on {gpus} GPUs (exit {run.returncode}): {run.stderr.strip()[-500:]}")]
    predicted = table["models"]["BERT-base"]["fsdp"][str(gpus)]["total"]
    results = [(measured["backend"] == "nccl", f"{'ok  ' if measured['backend'] == 'nccl' else 'FAIL'} FSDP "
                                                f"backend {measured['backend']}")]
    for rank, peak in enumerate(measured["peaks"]):
        gap = (peak - predicted) / predicted
        ok = abs(gap) <= FSDP_TOLERANCE
        results.append((ok, f"{'ok  ' if ok else 'FAIL'} FSDP rank {rank}, BERT-base, {gpus} GPUs, "
                            f"B={size}/rank, L={length}  predicted {predicted / GIB:7.2f} GiB  measured "
                            f"{peak / GIB:7.2f} GiB  gap {gap:+.1%}"))
    return results


# --- notebooks ----------------------------------------------------------------------------------------------------

def series_notebooks(pattern: str = "*") -> list[Path]:
    """The lessons in order, then their solutions; only those whose path under notebooks/ matches ``pattern``."""
    notebooks = lessons_then_solutions(ROOT / "notebooks")
    return [path for path in notebooks if fnmatch.fnmatch(str(path.relative_to(ROOT / "notebooks")), pattern)]


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


def execute_notebooks(scratch: Path, pattern: str = "*"):
    """Execute the notebooks matching ``pattern`` into ``scratch`` (the committed notebooks are left untouched),
    every cell even after an error, so that the report names the first failing cell; one line per notebook, as
    each finishes. Notebooks run as they are: each picks its devices from the machine (helpers.devices,
    helpers.launch)."""
    for notebook in series_notebooks(pattern):
        target = scratch / notebook.relative_to(ROOT / "notebooks")
        run = execute_copy(notebook, target, allow_errors=True)
        failure = first_failing_cell(target) if run.returncode == 0 else (run.stderr.strip().splitlines() or [""])[-1]
        yield failure is None, f"notebook {notebook.relative_to(ROOT)}" + (f": {failure}" if failure else "")


# --- the report ---------------------------------------------------------------------------------------------------

def run_checks(checks: dict[str, callable], emit=None) -> list[dict]:
    """Run every check (section name -> function returning or yielding (ok, line) pairs), calling ``emit(row)``
    for each row as soon as it exists. A check that raises is a failure with its exception, after the rows it
    gave, and the others still run."""
    rows = []

    def add(section, ok, line):
        # the row carries ok: a line's own leading "ok  " or "FAIL" is dropped
        rows.append({"section": section, "ok": bool(ok), "line": re.sub(r"^(ok  |FAIL) ", "", line)})
        if emit:
            emit(rows[-1])

    for section, check in checks.items():
        try:
            for ok, line in check():
                add(section, ok, line)
        except Exception as error:  # the report must come out whatever one check does
            add(section, False, f"raised {type(error).__name__}: {error}")
    return rows


def format_row(row: dict) -> str:
    return f"{'ok  ' if row['ok'] else 'FAIL'} [{row['section']}] {row['line']}"


def report(rows: list[dict], machine: dict) -> tuple[str, dict]:
    """The report as text and as JSON: the machine, then one line per check, then the verdict."""
    failures = sum(not row["ok"] for row in rows)
    verdict = f"gpu-check: {'FAILED' if failures else 'passed'} ({failures} failure(s) of {len(rows)} checks)"
    lines = [header(machine)] + [format_row(row) for row in rows] + [verdict]
    return "\n".join(lines), {"result": "failed" if failures else "passed", "failures": failures, "machine": machine,
                              "checks": rows}


def header(machine: dict) -> str:
    return (f"gpu-check on {machine['gpus']} GPU(s): {', '.join(machine['names'])}; torch {machine['torch']}, "
            f"CUDA {machine['cuda']}")


def machine() -> dict:
    """What the report records about this machine: GPUs, versions, and the settings that change memory."""
    count = torch.cuda.device_count()
    gpu = this_gpu(0)
    return {"gpus": count, "names": [torch.cuda.get_device_name(i) for i in range(count)],
            "capability": ".".join(map(str, gpu.capability)), "sm_count": gpu.sm_count,
            "torch": torch.__version__, "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
            "python": sys.version.split()[0],
            "environment": {name: os.environ.get(name) for name in ENVIRONMENT},
            "workspaces_predicted": workspaces(gpu.capability, os.environ)}


SECTIONS = ("memory", "resume", "two processes on one GPU", "ddp", "fsdp", "notebooks")


def gpu_checks(gpus: int, scratch: Path, notebooks: str | None) -> dict[str, callable]:
    """The checks for a machine with ``gpus`` CUDA GPUs, in the order they run; ``notebooks`` is the pattern of
    notebooks to execute, or None."""
    from helpers.checks import training_checks as runs

    checks = {"memory": check_memory}
    if gpus == 1:
        checks["resume"] = lambda: [runs.check_kill_and_resume(1, scratch / "resume-1", "--deterministic")]
        checks["two processes on one GPU"] = runs.check_two_processes_on_one_gpu
    else:
        checks["ddp"] = lambda: [runs.check_ddp_equivalence(2)]
        checks["resume"] = lambda: [runs.check_kill_and_resume(2, scratch / "resume-2", "--deterministic")]
        checks["fsdp"] = check_fsdp
    if notebooks:
        checks["notebooks"] = lambda: execute_notebooks(scratch / "notebooks", notebooks)
    return checks


def arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m helpers.checks.gpu_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--skip-notebooks", action="store_true", help="do not execute the notebooks")
    parser.add_argument("--notebooks", default="*", metavar="GLOB",
                        help='execute only the notebooks whose path under notebooks/ matches, e.g. "08*" or "solutions/*"')
    parser.add_argument("--only", type=lambda text: [part.strip() for part in text.split(",")], metavar="SECTIONS",
                        help=f"run only these sections, comma-separated, of: {', '.join(SECTIONS)}")
    parser.add_argument("--keep", type=Path, metavar="DIR", help="run in this folder (executed notebooks, checkpoints, "
                        "logs) and keep it; the executed notebooks also go into DIR/gpu-runs/ as a folder for the site")
    parser.add_argument("--json", type=Path, metavar="FILE", help="also write the report as JSON into FILE")
    args = parser.parse_args(argv)
    unknown = [name for name in args.only or () if name not in SECTIONS]
    if unknown:
        parser.error(f"--only: unknown section(s) {', '.join(map(repr, unknown))}; choose from {', '.join(SECTIONS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = arguments(argv)
    if not torch.cuda.is_available():
        line = "gpu-check: skipped, no CUDA device on this machine (nothing to check here)"
        print(line)
        if args.json:
            args.json.write_text(json.dumps({"result": "skipped", "failures": 0, "reason": line}, indent=1) + "\n")
        return 0
    about = machine()
    print(header(about), flush=True)
    rows: list[dict] = []

    def emit(row):
        rows.append(row)
        print(format_row(row), flush=True)
        if args.json:  # rewritten after every line: a run cut short keeps what finished
            args.json.write_text(json.dumps(report(rows, about)[1], indent=1) + "\n")

    with tempfile.TemporaryDirectory(prefix="gpu-check-") as temporary:
        scratch = args.keep or Path(temporary)
        checks = gpu_checks(torch.cuda.device_count(), scratch, None if args.skip_notebooks else args.notebooks)
        run_checks({name: check for name, check in checks.items() if not args.only or name in args.only}, emit)
    if args.keep and not args.skip_notebooks and (not args.only or "notebooks" in args.only):
        run = gpu_runs.save(args.keep / "notebooks", args.keep / "gpu-runs", "make gpu-check --keep")
        print(f"executed notebooks for the site: {run.folder} (copy it into docs/gpu-runs/ to show them)")
    print(report(rows, about)[0].splitlines()[-1])
    if any(row["section"] == "memory" and not row["ok"] for row in rows):
        print("A memory gap beyond the tolerance means the prediction misses something this GPU does: each FAIL line "
              "names what differs; a memory snapshot (notebook 05's appendix) shows every block.")
    return 1 if any(not row["ok"] for row in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
