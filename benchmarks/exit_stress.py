"""`make stress N=50`: start every multi-process entry point N times in a row; count the runs that failed.

Each run has 2 processes on the CPU. Not part of `make test`: 50 runs of each take hours on 2 cores.

A run fails when it exits with anything but 0 (a worker that aborts at exit, -6 for SIGABRT, counts though its
output was complete) or does not end within its time limit (a hang). Issue 39: ``helpers.lever_checks`` aborted at
exit in about 1 run in 9 ("terminate called without an active exception") before helpers.distributed's teardown.

    python benchmarks/exit_stress.py --runs 50                      # every entry point
    python benchmarks/exit_stress.py --runs 30 --only lever_checks  # one of them (names: --list)
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import common

ROOT = Path(__file__).resolve().parent.parent
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
FINETUNE = [*TORCHRUN, "-m", "helpers.finetune", "--device", "cpu", "--train-examples", "32", "--val-examples", "16",
            "--global-batch-size", "8", "--epochs", "1"]
LEVERS = ["--grad-accum-steps", "2", "--amp", "bf16", "--gradient-checkpointing"]
CHECKS = ["--check-equivalence", "--checkpoint-dir", "{tmp}/checkpoints", "--save-every", "2", "--output-dir", "{tmp}/out"]
# test_memory's worker, started as that test starts it: torch.multiprocessing.spawn, a file rendezvous
SPAWN_WORKER = """import sys, tempfile
import torch.multiprocessing as mp
sys.path.insert(0, {tests!r})
from ddp_buckets_worker import measure_ddp
with tempfile.TemporaryDirectory() as tmpdir, mp.Manager() as manager:
    mp.spawn(measure_ddp, args=(2, tmpdir + "/rendezvous", manager.dict()), nprocs=2)
"""

# name: the command ({tmp}: a fresh folder for each run)
ENTRY_POINTS = {
    "lever_checks": [*TORCHRUN, "-m", "helpers.lever_checks", "--device", "cpu"],  # notebook 09's launch
    "finetune ddp": FINETUNE,
    "finetune fsdp": [*FINETUNE, "--strategy", "fsdp"],
    "finetune ddp levers": [*FINETUNE, *LEVERS],
    "finetune fsdp levers": [*FINETUNE, "--strategy", "fsdp", *LEVERS],
    "finetune ddp checks": [*FINETUNE, *CHECKS],
    "finetune fsdp checks": [*FINETUNE, "--strategy", "fsdp", *CHECKS],  # tests/test_fsdp.py's runs
    "examples/ddp_minimal.py": [*TORCHRUN, str(ROOT / "examples" / "ddp_minimal.py")],
    "tests/ddp_buckets_worker.py": [sys.executable, "-c", SPAWN_WORKER.format(tests=str(ROOT / "tests"))],
    "tests/checkpoint_worker.py failing-save": [*TORCHRUN, str(ROOT / "tests" / "checkpoint_worker.py"),
                                                "failing-save", "{tmp}"],
    "tests/checkpoint_worker.py layouts": [*TORCHRUN, str(ROOT / "tests" / "checkpoint_worker.py"), "layouts", "{tmp}"],
    "tests/amp_worker.py": [*TORCHRUN, str(ROOT / "tests" / "amp_worker.py")],
}


WORKER_SIGNAL = re.compile(r"\((SIG[A-Z]+)\)|terminated with signal (SIG[A-Z]+)")  # torchrun's report; mp.spawn's


def how_it_ended(returncode: int | None, output: str) -> str:
    """'ok', 'timeout', the signal that ended a worker ('SIGABRT': torchrun then exits 1 and names it in its report,
    beside the SIGTERM it sent the other workers), else 'exit N'."""
    if returncode == 0:
        return "ok"
    if returncode is None:
        return "timeout"
    signals = [a or b for a, b in WORKER_SIGNAL.findall(output)]
    if signals:
        return next((name for name in signals if name != "SIGTERM"), signals[0])
    return signal.Signals(-returncode).name if returncode < 0 else f"exit {returncode}"


def run_once(command: list[str], timeout: float) -> tuple[int | None, str]:
    """Run ``command`` in a fresh folder; its exit status (None: killed after ``timeout`` s) and its output."""
    with tempfile.TemporaryDirectory() as tmp:
        args = [part.replace("{tmp}", tmp) for part in command]
        env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
            filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))}
        try:
            done = subprocess.run(args, env=env, cwd=tmp, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as expired:
            return None, f"{expired.stdout or ''}{expired.stderr or ''}"
        return done.returncode, done.stdout + done.stderr


def stress(names: list[str], runs: int, timeout: float, log, keep: Path | None = None) -> dict[str, collections.Counter]:
    """Run each entry point ``runs`` times in a row; per entry point, how its runs ended ('ok', 'SIGABRT', ...).
    The output of a failed run goes to ``keep``/<entry point>-<run>.log."""
    outcomes = {}
    for name in names:
        outcomes[name] = collections.Counter()
        started = time.monotonic()
        for number in range(1, runs + 1):
            returncode, output = run_once(ENTRY_POINTS[name], timeout)
            outcome = how_it_ended(returncode, output)
            outcomes[name][outcome] += 1
            if outcome != "ok":
                print(f"  {name} run {number}: {outcome}", file=log, flush=True)
                if keep is not None:
                    keep.mkdir(parents=True, exist_ok=True)
                    (keep / f"{re.sub(r'[^a-z0-9]+', '-', name)}-{number}.log").write_text(output, encoding="utf-8")
        print(f"{name}: {runs - outcomes[name]['ok']} of {runs} failed ({time.monotonic() - started:.0f} s)",
              file=log, flush=True)
    return outcomes


def table(outcomes: dict[str, collections.Counter], runs: int) -> str:
    lines = ["| entry point (2 processes, CPU) | runs | failed | how the failures ended |", "|---|---|---|---|"]
    for name, counts in outcomes.items():
        failures = {outcome: count for outcome, count in counts.items() if outcome != "ok"}
        lines.append(f"| {name} | {runs} | {sum(failures.values())} | "
                     f"{', '.join(f'{outcome} x{count}' for outcome, count in sorted(failures.items())) or '-'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--runs", type=int, default=10, metavar="N", help="runs of each entry point (default 10)")
    parser.add_argument("--only", nargs="+", choices=list(ENTRY_POINTS), metavar="NAME",
                        help="these entry points only (default: all)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds before a run counts as a hang (600)")
    parser.add_argument("--keep", type=Path, metavar="DIR", help="write the output of each failed run into DIR")
    parser.add_argument("--list", action="store_true", help="print the entry points and their commands, and stop")
    args = parser.parse_args(argv)
    if args.list:
        for name, command in ENTRY_POINTS.items():
            print(f"{name}: {' '.join(command)}".replace("\n", "; "))
        return 0
    if args.runs < 1:
        parser.error(f"--runs {args.runs}: must be at least 1")
    print(f"Measured on {common.machine(torch_threads=False)}", flush=True)
    outcomes = stress(args.only or list(ENTRY_POINTS), args.runs, args.timeout, sys.stdout, args.keep)
    print(f"\n{table(outcomes, args.runs)}\n\nload average at end {common.load_average()}")
    return 1 if any(counts["ok"] < args.runs for counts in outcomes.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
