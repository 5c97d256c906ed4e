"""examples/ddp_minimal.py, the script notebook 06 walks through, under torchrun with 2 CPU processes."""

import os
import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parents[1] / "examples" / "ddp_minimal.py"
ENV = os.environ | {"OMP_NUM_THREADS": "1"}


def test_two_processes_train_to_the_same_weights_and_only_rank_0_prints():
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(SCRIPT)]
    run = subprocess.run(command, env=ENV, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[0] == "2 processes, backend gloo, device cpu"
    losses = [float(m.group(1)) for m in map(re.compile(r"epoch \d: .*: ([\d.]+)$").match, lines) if m]
    assert len(losses) == 5  # printed once per epoch: by rank 0 only
    assert losses[-1] < 0.05 < losses[0]
    assert "weights identical on all ranks: True" in lines


def test_without_torchrun_it_says_how_to_start_it():
    run = subprocess.run([sys.executable, str(SCRIPT)], env=ENV, capture_output=True, text=True, timeout=60)
    assert run.returncode == 1
    assert "start this script with torchrun" in run.stderr
