"""A training run killed mid-epoch (SIGKILL, in a real child process) and resumed ends bitwise where an
uninterrupted run ends: same weights, same losses.

Run as a script (``python tests/test_resume.py DIR``) this file is the child: the same run, checkpointing to DIR.
"""

import json
import os
import signal
import subprocess
import sys
import time

from transformers import get_linear_schedule_with_warmup, set_seed

from helpers.checkpoint import STATE_FILE, Checkpoints, read_state, state_dicts_equal
from helpers.data import load_split, make_loader
from helpers.models import load_tokenizer
from helpers.net import Net
from helpers.optim import two_lr_adam
from helpers.train import fit

EPOCHS, BATCHES_PER_EPOCH, SAVE_EVERY = 2, 8, 3


def run(directory=None):
    """Notebook 02's setup in miniature: shuffled data, two learning rates, a warm-up schedule, dropout on."""
    set_seed(0)
    tokenizer = load_tokenizer()
    train_loader = make_loader(load_split("train")[:4 * BATCHES_PER_EPOCH], tokenizer, batch_size=4, shuffle=True)
    val_loader = make_loader(load_split("validation")[:8], tokenizer, batch_size=8)
    net = Net()
    optimizer = two_lr_adam(net, 1e-3, 1e-3)
    scheduler = get_linear_schedule_with_warmup(optimizer, 2, EPOCHS * BATCHES_PER_EPOCH)
    checkpoints = Checkpoints(directory, every=SAVE_EVERY) if directory else None
    history = fit(net, train_loader, val_loader, optimizer, scheduler, epochs=EPOCHS, checkpoints=checkpoints)
    return net, history


def start_and_kill_after_first_checkpoint(directory, log):
    """Start the run in a child process and SIGKILL it as soon as its first checkpoint is complete."""
    env = os.environ | {"TQDM_DISABLE": "1"}
    child = subprocess.Popen([sys.executable, __file__, str(directory)], stdout=log, stderr=log, env=env)
    deadline = time.monotonic() + 300
    while not (directory / "latest").exists():
        assert child.poll() is None, f"the child ended before its first checkpoint:\n{log.name}"
        assert time.monotonic() < deadline, "no checkpoint within 300 s"
        time.sleep(0.01)
    child.send_signal(signal.SIGKILL)
    assert child.wait() == -signal.SIGKILL  # it was still running: killed, not finished


def test_killed_mid_epoch_and_resumed_ends_bitwise_like_an_uninterrupted_run(tmp_path):
    directory = tmp_path / "checkpoints"
    with open(tmp_path / "child.log", "w") as log:
        start_and_kill_after_first_checkpoint(directory, log)
    stopped_at = read_state(Checkpoints(directory).latest() / STATE_FILE)["progress"]
    assert 0 < stopped_at["batch"] < BATCHES_PER_EPOCH, stopped_at  # killed in the middle of an epoch

    resumed, resumed_history = run(directory)
    uninterrupted, history = run()
    assert state_dicts_equal(resumed.state_dict(), uninterrupted.state_dict())
    assert resumed_history == history  # every batch loss and every evaluation, bit for bit
    assert len(history) == EPOCHS and all(len(row["batch_losses"]) == BATCHES_PER_EPOCH for row in history)


if __name__ == "__main__":
    run(sys.argv[1])


TORCHRUN_ENV = os.environ | {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1",
                             "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
FINETUNE = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "helpers.finetune",
            "--train-examples", str(8 * BATCHES_PER_EPOCH), "--global-batch-size", "8", "--epochs", str(EPOCHS)]


def finetune(*args):
    run = subprocess.run([sys.executable, *FINETUNE, *args], env=TORCHRUN_ENV, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_torchrun_killed_mid_epoch_and_resumed_ends_bitwise_like_an_uninterrupted_run(tmp_path):
    directory = tmp_path / "checkpoints"
    saving = ["--checkpoint-dir", str(directory), "--save-every", str(SAVE_EVERY)]
    with open(tmp_path / "torchrun.log", "w") as log:
        # its own process group, so that one SIGKILL reaches torchrun and both workers, as when a machine dies
        launcher = subprocess.Popen([sys.executable, *FINETUNE, *saving], env=TORCHRUN_ENV, stdout=log, stderr=log,
                                    start_new_session=True)
        deadline = time.monotonic() + 300
        while not (directory / "latest").exists():
            assert launcher.poll() is None, f"torchrun ended before its first checkpoint: {log.name}"
            assert time.monotonic() < deadline, "no checkpoint within 300 s"
            time.sleep(0.01)
        os.killpg(launcher.pid, signal.SIGKILL)
        assert launcher.wait() == -signal.SIGKILL
    stopped_at = read_state(Checkpoints(directory).latest() / STATE_FILE)
    assert 0 < stopped_at["progress"]["batch"] < BATCHES_PER_EPOCH, stopped_at["progress"]
    assert len(stopped_at["per_process"]) == 2

    resumed = finetune(*saving, "--resume")
    uninterrupted = finetune()
    assert resumed["weights_sha256"] == uninterrupted["weights_sha256"]
    assert len(set(resumed["weights_sha256"])) == 1  # and the two ranks agree
    for mine, theirs in zip(resumed["history"], uninterrupted["history"], strict=True):
        assert (mine["train_loss"], mine["val_loss"]) == (theirs["train_loss"], theirs["val_loss"])
