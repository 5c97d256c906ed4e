"""examples/slurm/ without a cluster: the sbatch scripts run in bash with Slurm's environment and stand-ins for srun,
scontrol and scancel that record what they are asked, so the commands the scripts generate are checked here (torchrun's
and helpers.finetune's own parsers read them), and so is what the batch shell does with Slurm's signals. `make
slurm-check` runs the CPU script on a real Slurm (CONTRIBUTING.md records its last run)."""

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from torch.distributed.run import get_args_parser

from helpers.finetune import parse_args
from helpers.preemption import EXIT_STATUS

ROOT = Path(__file__).resolve().parent.parent
STUBS = {
    "srun": """echo "$$" > "$STUB_LOG/srun.pid"
printf '%s\\n' "$@" > "$STUB_LOG/srun.args"
if [ -n "${STUB_SRUN_WAITS:-}" ]; then trap 'kill "$sleeper"; exit 75' TERM; sleep 600 & sleeper=$!; wait; fi
""",
    "scontrol": """if [ "$1 $2" = "show hostnames" ]; then printf '%s\\n' $STUB_HOSTS; else echo "scontrol $*" >> "$STUB_LOG/calls"; fi
""",
    "scancel": """echo "scancel $*" >> "$STUB_LOG/calls"
if [ "$1" = --signal=TERM ]; then kill -TERM "$(cat "$STUB_LOG/srun.pid")"; fi
""",
}
JOB = {"SLURM_JOB_ID": "4321", "SLURM_JOB_NAME": "bert-ja", "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_NNODES": "2",
       "STUB_HOSTS": "gpu07 gpu08"}


@pytest.fixture
def slurm(tmp_path):
    """Run a script of examples/slurm/ from the repository's folder, as sbatch does, with the stand-ins first on PATH;
    returns a function that starts it and the folder the stand-ins log into."""
    for name, body in STUBS.items():
        (tmp_path / name).write_text("#!/bin/bash\n" + body)
        (tmp_path / name).chmod(0o755)

    def start(script: str, *args: str, **env: str) -> subprocess.Popen:
        environment = {key: value for key, value in os.environ.items() if not key.startswith("SLURM_")}
        environment |= JOB | env | {"PATH": f"{tmp_path}:{os.environ['PATH']}", "STUB_LOG": str(tmp_path)}
        return subprocess.Popen(["bash", f"examples/slurm/{script}", *args], cwd=ROOT, env=environment,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return start, tmp_path


def srun_args(log: Path) -> list[str]:
    return (log / "srun.args").read_text().splitlines()


def test_each_node_gets_one_torchrun_meeting_on_the_first_node_with_finetunes_flags(slurm):
    start, log = slurm
    run = start("finetune.sbatch", "--epochs", "3", SLURM_GPUS_ON_NODE="4")
    assert run.wait(30) == 0, run.stdout.read()
    assert srun_args(log) == ["--ntasks-per-node=1", "--kill-on-bad-exit=1", ".venv/bin/python", "-m",
                              "torch.distributed.run", "--nnodes=2", "--nproc_per_node=4", "--rdzv-backend=c10d",
                              "--rdzv-endpoint=gpu07:29821", "--rdzv-id=4321", "-m", "helpers.finetune",
                              "--checkpoint-dir", "checkpoints/bert-ja", "--save-every", "200", "--epochs", "3"]
    torchrun = get_args_parser().parse_args(srun_args(log)[5:])  # what torchrun makes of it
    assert (torchrun.nnodes, torchrun.nproc_per_node, torchrun.module) == ("2", "4", True)
    finetune = parse_args(torchrun.training_script_args)
    assert (finetune.checkpoint_dir, finetune.save_every, finetune.epochs, finetune.resume) == (
        Path("checkpoints/bert-ja"), 200, 3, False)
    assert not (log / "calls").exists()  # nothing requeued


def test_a_requeued_job_resumes_and_the_cpu_variant_runs_one_process_per_node_over_gloo(slurm):
    start, log = slurm
    run = start("finetune-cpu.sbatch", "--save-every", "4", SLURM_RESTART_COUNT="1", CHECKPOINT_DIR="/shared/ck")
    assert run.wait(30) == 0, run.stdout.read()
    args = srun_args(log)
    assert "--nproc_per_node=1" in args and "job 4321, run 2, on gpu[07-08]" in run.stdout.read()
    finetune = parse_args(args[args.index("helpers.finetune") + 1:])
    assert (finetune.device, finetune.resume, finetune.checkpoint_dir, finetune.save_every) == (
        "cpu", True, Path("/shared/ck"), 4)


def test_without_gpus_the_gpu_script_names_the_way_out(slurm):
    start, log = slurm
    run = start("finetune.sbatch")
    assert run.wait(30) != 0
    assert "no GPU on this node: ask for some (--gpus-per-node) or set NPROC_PER_NODE" in run.stdout.read()
    assert not (log / "srun.pid").exists()


@pytest.mark.parametrize("notice", ["USR1", "TERM"])
def test_the_batch_shell_passes_a_stop_on_and_requeues_only_before_the_time_limit(slurm, notice):
    """USR1 (--signal=B:USR1@...): the shell has the processes signalled, then requeues the job itself. TERM (a
    preemption or scontrol requeue): Slurm signals every process and requeues the job; the shell only waits."""
    start, log = slurm
    run = start("finetune-cpu.sbatch", STUB_SRUN_WAITS="1")
    deadline = time.monotonic() + 30
    while not (log / "srun.args").exists():
        assert run.poll() is None and time.monotonic() < deadline, run.stdout.read() if run.poll() is not None else ""
        time.sleep(0.05)
    run.send_signal(getattr(signal, f"SIG{notice}"))
    if notice == "TERM":  # what Slurm does to every process of the job
        time.sleep(0.3)
        os.kill(int((log / "srun.pid").read_text()), signal.SIGTERM)
    assert run.wait(30) == EXIT_STATUS
    calls = (log / "calls").read_text().splitlines() if (log / "calls").exists() else []
    assert calls == (["scancel --signal=TERM 4321", "scontrol requeue 4321"] if notice == "USR1" else [])
    assert f"{notice}: every process saves its next step into checkpoints/bert-ja and stops" in run.stdout.read()
