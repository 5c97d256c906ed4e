"""helpers.launch decides how a notebook starts N processes: GPUs where there is one per process, else the CPU;
every multi-process command of every notebook goes through it, and a failed run says why."""

import ast
import io
import json
import os
import re
import signal
import subprocess
import sys
import time
import tokenize
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest

from helpers.checks.notebook_env import lessons_then_solutions
from helpers.launch import LaunchFailed, kill_launch, plan_launch, still_running, why_it_failed

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = lessons_then_solutions(ROOT / "notebooks")
SCRIPT = ROOT / "examples" / "ddp_minimal.py"


@pytest.mark.parametrize(("gpus", "device"), [(0, "cpu"), (1, "cpu"), (2, "cuda"), (8, "cuda")])
def test_two_processes_use_gpus_only_when_each_gets_one(gpus, device):
    launch = plan_launch(2, gpus=gpus)
    assert (launch.processes, launch.device) == (2, device)
    assert launch.torchrun("--epochs", "1")[-5:] == ["helpers.finetune", "--device", device, "--epochs", "1"]


def test_one_process_takes_the_one_gpu():
    assert plan_launch(1, gpus=1).device == "cuda"


def test_the_choice_is_printed_with_its_reason():
    assert str(plan_launch(2, gpus=1)) == "CUDA GPUs: 1; 2 processes on the CPU (gloo; one GPU per process needs 2 GPUs)"
    assert str(plan_launch(2, gpus=2)) == "CUDA GPUs: 2; 2 processes on one GPU each (NCCL)"


def test_no_processes_is_refused():
    with pytest.raises(ValueError, match="processes=0"):
        plan_launch(0, gpus=0)


def test_the_command_runs_here():
    """The command it builds starts real processes on this machine (torch sees no GPU here: the CPU)."""
    launch = plan_launch(2)
    assert "--device" in launch.run("--help")
    assert launch.torchrun("--help")[:3] == [sys.executable, "-m", "torch.distributed.run"]


def test_the_printed_command_is_the_one_a_reader_types():
    """What 06 prints before running: torchrun, the repository's script by its relative path, the environment."""
    launch = plan_launch(2, gpus=0)
    assert launch.typed(script=SCRIPT) == "OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 examples/ddp_minimal.py"
    assert launch.typed("--seed", "a b") == ("OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 "
                                             "-m helpers.finetune --device cpu --seed 'a b'")
    assert launch.typed(script="/elsewhere/train.py").endswith(" /elsewhere/train.py")


def test_only_the_started_processes_get_one_thread(monkeypatch):
    """The notebook's own process keeps its threads; each started process computes on one (what run() gives them)."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    child = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
                           env=plan_launch(2, gpus=0).env, capture_output=True, text=True, check=True)
    assert child.stdout.strip() == "1"
    assert "OMP_NUM_THREADS" not in os.environ


def test_a_script_gets_no_device_option():
    command = plan_launch(2, gpus=0).torchrun("--x", script=SCRIPT)
    assert command[-2:] == [str(SCRIPT), "--x"] and "--device" not in command


def script_rule():
    """The condition with which examples/ddp_minimal.py chooses a GPU, compiled from the script's own source."""
    tree = ast.parse(SCRIPT.read_text(encoding="utf-8"))
    (test,) = [node.test for node in ast.walk(tree) if isinstance(node, ast.If) and "device_count" in ast.unparse(node.test)]
    return compile(ast.Expression(test), str(SCRIPT), "eval")


@pytest.mark.parametrize("processes", [1, 2, 3])
@pytest.mark.parametrize("gpus", [0, 1, 2, 4])
def test_ddp_minimal_picks_its_device_by_the_same_rule(gpus, processes):
    """06 launches the script without --device: the script's own choice must be the one plan_launch prints."""
    torch = SimpleNamespace(cuda=SimpleNamespace(device_count=lambda: gpus))
    os = SimpleNamespace(environ={"LOCAL_WORLD_SIZE": str(processes)})  # torchrun: processes on this machine
    on_gpu = eval(script_rule(), {"torch": torch, "os": os})
    assert ("cuda" if on_gpu else "cpu") == plan_launch(processes, gpus=gpus).device


def test_a_refused_run_raises_with_the_refusal():
    """What a one-GPU machine showed when 08 asked for two CUDA processes, here by asking for CUDA without one."""
    with pytest.raises(LaunchFailed, match=r"^exit status 1: error: --device cuda: torch sees no CUDA device") as failed:
        plan_launch(2, gpus=2).run("--epochs", "1")
    assert failed.value.returncode == 1  # torchrun's own status when a worker fails (each worker exited with 2)
    assert "Failures:" in failed.value.output  # its report, kept whole


WORKER_EXCEPTION = """\
2 process(es), backend gloo, device cpu; batch 16 per rank x 2 = global batch 32
[rank1]: Traceback (most recent call last):
[rank1]:   File "train.py", line 54, in train_epoch
[rank1]:     logits = model(batch)
[rank1]: RuntimeError: Expected to have finished reduction in the prior iteration.
[rank1]: Parameter indices which did not receive grad for rank 1: 69 70
[rank0]: Traceback (most recent call last):
[rank0]:   File "train.py", line 54, in train_epoch
[rank0]:     logits = model(batch)
[rank0]:              ^^^^^^^^^^^^
[rank0]: RuntimeError: Expected to have finished reduction in the prior iteration.
[rank0]: Parameter indices which did not receive grad for rank 0: 69 70
[rank0]:  In addition, you can set the environment variable TORCH_DISTRIBUTED_DEBUG
E1204 18:43:36.642000 17232 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: 1) local_rank: 0
Traceback (most recent call last):
  File "run.py", line 1032, in <module>
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
"""


def test_a_worker_exception_is_told_by_the_lowest_rank():
    assert why_it_failed(WORKER_EXCEPTION).splitlines() == [
        "[rank0]: RuntimeError: Expected to have finished reduction in the prior iteration.",
        "[rank0]: Parameter indices which did not receive grad for rank 0: 69 70",
        "[rank0]:  In addition, you can set the environment variable TORCH_DISTRIBUTED_DEBUG"]


def test_a_run_killed_without_a_traceback_shows_the_end_of_its_output():
    output = "step 1\n" + "\n".join(f"line {i}" for i in range(20)) + "\n  exitcode  : -9 (pid: 1)"
    assert why_it_failed(output).splitlines()[-1] == "  exitcode  : -9 (pid: 1)"
    assert len(why_it_failed(output).splitlines()) == 10


def code_cells():
    """(notebook, cell index, code without comments and prose) of every code cell, IPython's ``!`` lines turned into
    calls. Comments and strings with a space in them (docstrings, printed text) may name torchrun; a command's words
    (``"torchrun"``, ``"--nproc_per_node=2"``) have none, so they stay and count."""
    from IPython.core.inputtransformer2 import TransformerManager

    for notebook in NOTEBOOKS:
        for index, cell in enumerate(json.loads(notebook.read_text(encoding="utf-8"))["cells"]):
            if cell["cell_type"] == "code":
                code = TransformerManager().transform_cell("".join(cell["source"]))
                starts = [0, *(i + 1 for i, char in enumerate(code) if char == "\n")]  # offset of each line
                chars = list(code)
                for token in tokenize.generate_tokens(io.StringIO(code).readline):
                    if token.type == tokenize.COMMENT or (token.type == tokenize.STRING and " " in token.string):
                        first, last = (starts[row - 1] + column for row, column in (token.start, token.end))
                        chars[first:last] = [char if char == "\n" else " " for char in chars[first:last]]
                yield notebook, index, "".join(chars)


# a launcher spelled out (in code or a shell line), not the Launch method of that name
STARTS_PROCESSES = re.compile(r"torch\.distributed\.run|(?<![.\w])torchrun\b|nproc_per_node|\bspawn\(|multiprocessing")


def test_every_multi_process_command_of_every_notebook_is_built_by_launch():
    """No cell spells a launcher itself: each gets its command (and device) from helpers.launch."""
    spelled = [f"{notebook.relative_to(ROOT)} cell {index}" for notebook, index, code in code_cells()
               if STARTS_PROCESSES.search(code)]
    assert spelled == []
    launching = {notebook.relative_to(ROOT).as_posix() for notebook, _, code in code_cells()
                 if re.search(r"launch\.(run|shell|start|torchrun)\(|run_finetune\(launch,", code)}
    assert {"notebooks/06_ddp_torchrun.ipynb", "notebooks/08_fsdp2.ipynb", "notebooks/solutions/06_solutions.ipynb",
            "notebooks/solutions/08_solutions.ipynb"} <= launching


def test_every_notebook_that_launches_says_where():
    """Its stored outputs show the plan (as printed on a machine without CUDA, where they were made)."""
    planning = {notebook for notebook, _, code in code_cells() if "plan_launch" in code}
    assert planning
    for notebook in planning:
        outputs = "".join("".join(output.get("text", "")) for cell in json.loads(notebook.read_text(encoding="utf-8"))["cells"]
                          for output in cell.get("outputs", []))
        assert str(plan_launch(2, gpus=0)) in outputs, notebook.name


def test_no_notebook_captures_a_shell_commands_output():
    """``x = !command`` never raises: a failed command would leave only what a later filter lets through."""
    captured = [f"{notebook.relative_to(ROOT)} cell {index}" for notebook, index, code in code_cells()
                if "getoutput" in code]
    assert captured == []


SLEEPER = """\
import os, pathlib, sys, time
pathlib.Path(sys.argv[1], os.environ["RANK"]).write_text(str(os.getpid()))  # then train on, as it were
time.sleep(600)
"""


def start_sleepers(folder: Path):
    """torchrun with two workers that write their pids into ``folder`` and sleep: (torchrun's Popen, the workers)."""
    folder.mkdir()
    script = folder / "sleeper.py"
    script.write_text(SLEEPER)
    launcher = plan_launch(2, gpus=0).start(str(folder), log=folder / "log", script=script)
    deadline = time.monotonic() + 60
    while len(pids := sorted(folder.glob("[0-9]"))) < 2:
        assert launcher.poll() is None and time.monotonic() < deadline, (folder / "log").read_text()
        time.sleep(0.05)
    return launcher, [psutil.Process(int(pid.read_text())) for pid in pids]


def test_kill_launch_kills_the_workers_too(tmp_path):
    """torchrun's workers run in sessions of their own: killing torchrun alone leaves them running (they would
    train on), kill_launch leaves none. About 6 s: two torchrun starts of workers that only sleep."""
    alone, workers = start_sleepers(tmp_path / "alone")
    try:
        alone.kill()
        alone.wait(30)
        assert len(still_running(workers)) == 2  # why kill_launch exists
    finally:
        for worker in still_running(workers):
            worker.kill()
    launcher, workers = start_sleepers(tmp_path / "all")
    killed = kill_launch(launcher)
    assert launcher.returncode == -signal.SIGKILL
    assert {worker.pid for worker in workers} <= {process.pid for process in killed}
    assert still_running(killed) == [] and still_running(workers) == []
