"""Real ``helpers.finetune`` runs that check a claim: DDP against one process, and kill-and-resume, bitwise.

``make gpu-check`` runs them on the GPUs; the tests run the same code on the CPU over gloo.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from helpers.checkpoint import STATE_FILE, Checkpoints, read_state
from helpers.equivalence import EQUIVALENCE_TOLERANCE
from helpers.launch import kill_launch, last_json, still_running

RUN_ENV = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
TIMEOUT = 300
BATCHES_PER_EPOCH, SAVE_EVERY = 8, 3
RESUME_RUN = ["--train-examples", str(8 * BATCHES_PER_EPOCH), "--global-batch-size", "8", "--epochs", "2"]
"""Two epochs of 8 steps at global batch 8: a kill after the first checkpoint (step 3) lands mid-epoch."""
NCCL_GUESS = "using the device under current context"
"""What torch.distributed.barrier warns under NCCL when the group is not bound to a device."""


class RunFailed(Exception):
    """A ``helpers.finetune`` run did not do what the check needs (failed, ended early, hung); the message says
    what happened and where its output is."""


def finetune_command(processes: int, *args: str) -> list[str]:
    """``torchrun --standalone --nproc_per_node=processes -m helpers.finetune *args``, with this interpreter."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}",
            "-m", "helpers.finetune", *args]


def run(command: list[str], timeout: float = TIMEOUT) -> subprocess.CompletedProcess:
    """Run ``command`` to its end with RUN_ENV added; a hang becomes subprocess.TimeoutExpired."""
    return subprocess.run(command, env=os.environ | RUN_ENV, capture_output=True, text=True, timeout=timeout)


def summary_of(run_: subprocess.CompletedProcess) -> dict:
    """The JSON summary a successful run printed last; RunFailed with its stderr otherwise."""
    if run_.returncode != 0:
        raise RunFailed(f"exit status {run_.returncode}: {run_.stderr.strip()[-2000:]}")
    return last_json(run_.stdout)


def kill_and_resume(command: list[str], directory: Path, log: Path, timeout: float = TIMEOUT,
                    stop: signal.Signals = signal.SIGKILL, uninterrupted: dict | None = None) -> dict:
    """Start ``command`` saving checkpoints into ``directory``, send ``stop`` to it (launcher and workers) once the
    first checkpoint is complete, resume it, then run it once more uninterrupted (``uninterrupted``: that run's
    summary, when it is known already). SIGKILL is a machine that dies (``kill_launch``: torchrun starts its workers
    in sessions of their own, out of reach of a signal to its group); SIGTERM a scheduler's notice, sent as Slurm
    sends it, to every process of the run, which helpers.finetune answers by saving the next step on every process
    (helpers.preemption).

    Returns where it stopped (the latest checkpoint's state, read once no process of the run is left), the step
    the resumed run says it started from, both summaries, and whether the resumed run ends with bitwise the same
    weights on every rank as the uninterrupted one.
    """
    saving = ["--checkpoint-dir", str(directory), "--save-every", str(SAVE_EVERY)]
    with open(log, "w") as output:
        launcher = subprocess.Popen([*command, *saving], env=os.environ | RUN_ENV, stdout=output, stderr=output)
        deadline = time.monotonic() + timeout
        while not (directory / "latest").exists():
            if launcher.poll() is not None:
                raise RunFailed(f"the run ended (status {launcher.returncode}) before its first checkpoint: {log}")
            if time.monotonic() > deadline:
                kill_launch(launcher)
                raise RunFailed(f"no checkpoint within {timeout} s: {log}")
            time.sleep(0.01)
        processes = stop_launch(launcher, stop, timeout)
        status = launcher.returncode
        if status == 0 or (stop == signal.SIGKILL and status != -signal.SIGKILL):
            raise RunFailed(f"the run had finished before it could be stopped (status {status}): {log}")
        if left := still_running(processes):
            raise RunFailed(f"{len(left)} process(es) of the stopped run still running: {log}")
    state = read_state(Checkpoints(directory).latest() / STATE_FILE)
    resumed_run = run([*command, *saving, "--resume"], timeout)
    resumed = summary_of(resumed_run)
    started = re.search(r"^resumed at step (\d+):", resumed_run.stdout, re.MULTILINE)
    uninterrupted = uninterrupted or summary_of(run(command, timeout))
    return {"stopped_at": state["progress"], "processes_saved": len(state["per_process"]), "status": status,
            "processes_stopped": len(processes), "resumed_from": int(started[1]) if started else None,
            "resumed": resumed, "uninterrupted": uninterrupted,
            "bitwise": resumed["weights_sha256"] == uninterrupted["weights_sha256"]
                       and len(set(resumed["weights_sha256"])) == 1}


def stop_launch(launcher: subprocess.Popen, stop: signal.Signals, timeout: float) -> list[psutil.Process]:
    """Send ``stop`` to torchrun and every process it started, wait for torchrun to end, and return them all."""
    if stop == signal.SIGKILL:
        return kill_launch(launcher, timeout)
    processes = [psutil.Process(launcher.pid), *psutil.Process(launcher.pid).children(recursive=True)]
    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.send_signal(stop)
    launcher.wait(timeout)
    deadline = time.monotonic() + timeout
    while still_running(processes) and time.monotonic() < deadline:
        time.sleep(0.01)
    return processes


def check_kill_and_resume(processes: int, scratch: Path, *args: str) -> tuple[bool, str]:
    """One report line: a run of ``processes`` killed mid-epoch and resumed ends bitwise like an uninterrupted one."""
    label = f"kill-and-resume, {processes} process(es) {' '.join(args)}".strip()
    scratch.mkdir(parents=True, exist_ok=True)
    try:
        result = kill_and_resume(finetune_command(processes, *RESUME_RUN, *args), scratch / "checkpoints",
                                 scratch / "killed.log")
    except (RunFailed, subprocess.TimeoutExpired) as error:
        return False, f"{label}: {error}"
    ok, line = resume_line(result)
    return ok, f"{label}: {line}"


def resume_line(result: dict) -> tuple[bool, str]:
    """(ok, words) for ``kill_and_resume``'s result: killed mid-epoch with no process left, resumed from where it
    stopped, and bitwise equal weights everywhere."""
    step, batch = result["stopped_at"]["step"], result["stopped_at"]["batch"]
    ok = result["bitwise"] and 0 < batch < BATCHES_PER_EPOCH and result["resumed_from"] == step
    return ok, (f"killed at step {step} (batch {batch} of {BATCHES_PER_EPOCH}; {result['processes_stopped']} "
                f"processes, none left), resumed from step {result['resumed_from']}, weights bitwise equal to an "
                f"uninterrupted run on every rank: {result['bitwise']}")


EQUIVALENCE_RUN = ["--train-examples", "32", "--global-batch-size", "8", "--epochs", "1", "--check-equivalence"]


def check_ddp_equivalence(processes: int = 2, *args: str) -> tuple[bool, str]:
    """One report line: DDP gradients vs one process, equal weights on all ranks, and no device warning."""
    label = f"DDP {processes} processes {' '.join(args)}".strip()
    try:
        finished = run(finetune_command(processes, *EQUIVALENCE_RUN, *args))
    except subprocess.TimeoutExpired as error:
        return False, f"{label}: {error}"
    return judge_ddp_equivalence(finished, label)


def judge_ddp_equivalence(finished: subprocess.CompletedProcess, label: str) -> tuple[bool, str]:
    """(ok, line) for a finished ``--check-equivalence`` run."""
    try:
        result = summary_of(finished)
    except (RunFailed, ValueError) as error:
        return False, f"{label}: {error}"
    check = result["equivalence"]
    backend = next((line.split("backend ")[1].split(",")[0] for line in finished.stdout.splitlines()
                    if "backend " in line), "?")
    equal = check["weights_identical_on_all_ranks"] and len(set(result["weights_sha256"])) == 1
    warned = NCCL_GUESS in finished.stderr
    gradient, weights = check["max_abs_grad_diff"], check["max_abs_weight_diff_after_sgd"]
    ok = max(gradient, weights) <= EQUIVALENCE_TOLERANCE and equal and not warned
    return ok, (f"{label} over {backend}: max |DDP - one process| gradient {gradient:.1e}, weights after one SGD "
                f"step {weights:.1e} (<= {EQUIVALENCE_TOLERANCE:g}), weights bitwise equal on all ranks after a step "
                f"and after training: {equal}" + (f"; stderr has the warning '{NCCL_GUESS}'" if warned else ""))


def check_two_processes_on_one_gpu() -> list[tuple[bool, str]]:
    """What notebook 06's two-process run meets on a machine with one GPU: `torchrun --nproc_per_node=2` is
    refused before anything starts, with advice; with --device cpu the two processes train over gloo."""
    try:
        refused = run(finetune_command(2, "--train-examples", "16", "--global-batch-size", "8", "--epochs", "1"))
    except subprocess.TimeoutExpired as error:
        return [(False, f"2 processes on 1 GPU: {error}")]
    said = next((line for line in refused.stderr.splitlines() if line.startswith("error:")), refused.stderr[-300:])
    ok = refused.returncode != 0 and "--device cpu" in said  # torchrun exits 1 when a worker exits 2
    return [(ok, f"2 processes on 1 GPU: exit status {refused.returncode}, {said.strip()}"),
            check_ddp_equivalence(2, "--device", "cpu")]
