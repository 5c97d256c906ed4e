"""Start N training processes from a notebook on whatever machine it runs: one GPU each where there are enough
GPUs, else all N on the CPU over gloo. One place decides, so every multi-process command of the series runs
unchanged on a laptop, on a one-GPU machine and on a GPU server, and prints what it chose.

NCCL cannot put two processes on one GPU, and a process without a GPU of its own is refused before it joins
the group (helpers.distributed.device_problem); on one GPU, two processes therefore go to the CPU.
A run that fails raises with the lines that say why, so a notebook cell never ends blank or half-filtered;
``last_json`` reads the summary a run prints last. ``Launch.start`` starts a run without waiting, and
``kill_launch`` kills it as a crash would: torchrun and every worker, which torchrun puts out of its reach.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

REPOSITORY = Path(__file__).resolve().parents[2]  # examples/ lives here when helpers is installed from a clone
THREADS = {"OMP_NUM_THREADS": "1"}  # what torchrun would set anyway, with a warning, when the variable is unset
RANK_PREFIX = re.compile(r"^\[rank(\d+)\]:? ?")  # what a worker's uncaught exception lines start with


class LaunchFailed(RuntimeError):
    """A torchrun run that exited with an error. ``output`` is everything it printed; the message is the part
    that says why: helpers.finetune's ``error:`` lines, or else the exception of the lowest rank that raised."""

    def __init__(self, returncode: int, output: str):
        self.returncode, self.output = returncode, output
        super().__init__(f"exit status {returncode}: {why_it_failed(output)}")


def why_it_failed(output: str) -> str:
    """The lines of a failed run's output that say why (see LaunchFailed)."""
    lines = output.splitlines()
    said = [line for line in lines if line.startswith("error:")]
    if said:
        return "\n".join(said)
    # torchrun's own report ("failed (exitcode: ...)", its traceback, the Failures table) comes after the workers'
    end = next((i for i, line in enumerate(lines) if "failed (exitcode" in line), len(lines))
    workers = lines[:end]
    ranks = sorted({int(match.group(1)) for match in map(RANK_PREFIX.match, workers) if match})
    if ranks:
        workers = [line for line in workers if line.startswith(f"[rank{ranks[0]}]")]
    frames = [i for i, line in enumerate(workers) if RANK_PREFIX.sub("", line).startswith("  ")]
    exception = workers[frames[-1] + 1:] if frames else []
    return "\n".join(exception or lines[-10:])


@dataclass(frozen=True)
class Launch:
    """``processes`` processes on ``device`` ("cuda": one GPU each; "cpu": all on the CPU), on a machine with ``gpus``."""

    processes: int
    device: str
    gpus: int

    def __str__(self) -> str:
        where = ("one GPU each (NCCL)" if self.device == "cuda"
                 else f"the CPU (gloo; one GPU per process needs {self.processes} GPUs)")
        return f"CUDA GPUs: {self.gpus}; {self.processes} processes on {where}"

    def torchrun(self, *args: str, module: str = "helpers.finetune", script: str | Path | None = None) -> list[str]:
        """The command: ``torchrun --standalone --nproc_per_node=N -m module --device D *args``, with this Python.

        ``script`` runs a file instead, without ``--device``: a script that picks its device itself by this same
        rule (examples/ddp_minimal.py: one GPU per process, else the CPU; tests/test_launch.py checks the rule).
        """
        target = [str(script)] if script is not None else ["-m", module, "--device", self.device]
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={self.processes}",
                *target, *args]

    def typed(self, *args: str, module: str = "helpers.finetune", script: str | Path | None = None) -> str:
        """The same command as a reader types it in a terminal at the repository root, for a notebook to print
        before ``run``: ``torchrun`` for this Python's ``-m torch.distributed.run``, a script of the repository by
        its relative path, the environment ``run`` adds in front. No path of this machine, so the line is the same
        everywhere."""
        command = ["torchrun", *self.torchrun(*args, module=module, script=script)[3:]]
        if script is not None and Path(script).resolve().is_relative_to(REPOSITORY):
            command[command.index(str(script))] = Path(script).resolve().relative_to(REPOSITORY).as_posix()
        return shlex.join([f"{name}={value}" for name, value in THREADS.items()] + command)

    @property
    def env(self) -> dict[str, str]:
        """The environment to run it in: one thread per process, so N processes share the cores without contention.
        Only the started processes get it: the notebook's own process keeps its threads."""
        return os.environ | THREADS

    def run(self, *args: str, module: str = "helpers.finetune", script: str | Path | None = None) -> str:
        """Start the processes, wait for them, and return what they printed (stdout and stderr, in order).

        A run that fails raises LaunchFailed with the lines that say why.
        """
        done = subprocess.run(self.torchrun(*args, module=module, script=script), env=self.env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        if done.returncode:
            raise LaunchFailed(done.returncode, done.stdout)
        return done.stdout

    def start(self, *args: str, log: str | Path, module: str = "helpers.finetune",
              script: str | Path | None = None) -> subprocess.Popen:
        """Start the processes and return at once, torchrun's ``Popen``; what they print goes to the file ``log``.
        Stop them with ``kill_launch``: ``Popen.kill`` alone kills torchrun and leaves its workers running."""
        with open(log, "w") as out:  # the started processes keep their own handle on it
            return subprocess.Popen(self.torchrun(*args, module=module, script=script), env=self.env, stdout=out,
                                    stderr=subprocess.STDOUT)


def plan_launch(processes: int = 2, gpus: int | None = None) -> Launch:
    """``processes`` processes, each on a GPU of its own if this machine has that many (``gpus`` overrides the
    count torch sees), otherwise all of them on the CPU."""
    if processes < 1:
        raise ValueError(f"processes={processes}: start at least 1")
    if gpus is None:
        import torch

        gpus = torch.cuda.device_count()
    return Launch(processes, "cuda" if gpus >= processes else "cpu", gpus)


def kill_launch(launcher: subprocess.Popen, timeout: float = 30) -> list[psutil.Process]:
    """Kill torchrun and every process it started, as a crash would (SIGKILL; TerminateProcess on Windows).

    A signal reaches only its target, so ``launcher.kill()`` spares the workers; they run in sessions of their own,
    so a signal to torchrun's process group misses them too. Each process is suspended before its children are
    listed, so none starts another unseen; then all are killed. Returns them once none runs (``still_running``).
    """
    suspended, found = [], [psutil.Process(launcher.pid)] if launcher.poll() is None else []
    while found:
        process = found.pop()
        with contextlib.suppress(psutil.NoSuchProcess):  # it may have ended on its own meanwhile
            process.suspend()
            suspended.append(process)
            found += process.children()
    for process in suspended:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    launcher.wait(timeout)
    deadline = time.monotonic() + timeout
    while still_running(suspended):
        if time.monotonic() > deadline:
            raise TimeoutError(f"kill_launch: still running {timeout} s after SIGKILL: {still_running(suspended)}")
        time.sleep(0.01)
    return suspended


def still_running(processes: list[psutil.Process]) -> list[psutil.Process]:
    """Those of ``processes`` that still run: neither gone nor a zombie (ended, its exit status not yet read)."""
    def runs(process: psutil.Process) -> bool:
        try:
            return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    return [process for process in processes if runs(process)]


def run_finetune(launch: Launch, *args: str, output_dir: str | Path) -> dict:
    """``helpers.finetune`` under ``launch``, writing into ``output_dir``: prints what it said without its seconds
    (they differ from run to run) and its JSON line, and returns ``metrics.json`` (the summary and every loss)."""
    output = launch.run(*args, "--output-dir", str(output_dir))  # a failed run raises, saying why
    print("\n".join(re.sub(r"  \([\d.]+ s\)$", "", line) for line in output.splitlines() if not line.startswith("{")))
    return json.loads((Path(output_dir) / "metrics.json").read_text())


def last_json(text: str) -> dict:
    """The last line of ``text`` that is a JSON object, e.g. the summary in a run's output; lines after it
    (warnings printed at exit) are ignored."""
    for line in reversed(text.splitlines()):
        if line.lstrip().startswith("{"):
            try:
                value = json.loads(line)
            except ValueError:
                continue
            if isinstance(value, dict):
                return value
    raise ValueError(f"no line of this output is a JSON object ({len(text.splitlines())} lines); did the run "
                     f"fail before its summary? Its last line: {(text.strip().splitlines() or [''])[-1]!r}")
