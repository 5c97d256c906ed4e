"""A training run killed mid-epoch (SIGKILL, in a real child process) and resumed ends bitwise where an
uninterrupted run ends: same weights, same losses.

Run as a script (``python tests/test_resume.py DIR``) this file is the child: the same run, checkpointing to DIR.
"""

import os
import signal
import subprocess
import sys
import time

import torch
from transformers import get_linear_schedule_with_warmup, set_seed

from helpers.checkpoint import STATE_FILE, Checkpoints, read_state, state_dicts_equal
from helpers.data import load_split, make_loader
from helpers.models import load_tokenizer
from helpers.net import Net
from helpers.optim import two_lr_adam
from helpers.train import fit
from helpers.checks.training_checks import RESUME_RUN, finetune_command, kill_and_resume, resume_line

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
    env = os.environ | {"TQDM_DISABLE": "1", "OMP_NUM_THREADS": str(torch.get_num_threads())}  # sums alike
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


def test_torchrun_killed_mid_epoch_and_resumed_ends_bitwise_like_an_uninterrupted_run(tmp_path, uninterrupted_ddp_run):
    # make gpu-check runs the same with CUDA; --deterministic changes nothing on the CPU, which is deterministic
    result = kill_and_resume(finetune_command(2, *RESUME_RUN, "--deterministic"), tmp_path / "checkpoints",
                             tmp_path / "torchrun.log", uninterrupted=uninterrupted_ddp_run)
    assert 0 < result["stopped_at"]["batch"] < BATCHES_PER_EPOCH, result["stopped_at"]  # killed mid-epoch
    assert result["processes_saved"] == 2
    resumed, uninterrupted = result["resumed"], result["uninterrupted"]
    assert resumed["weights_sha256"] == uninterrupted["weights_sha256"] and result["bitwise"]
    assert len(set(resumed["weights_sha256"])) == 1  # and the two ranks agree
    for mine, theirs in zip(resumed["history"], uninterrupted["history"], strict=True):
        assert (mine["train_loss"], mine["val_loss"]) == (theirs["train_loss"], theirs["val_loss"])
    assert result["resumed_from"] == SAVE_EVERY  # the resumed run trained every step after the kill
    assert resume_line(result) == (True, f"killed at step {SAVE_EVERY} (batch {SAVE_EVERY} of 8; 3 processes, none "
                                         f"left), resumed from step {SAVE_EVERY}, weights bitwise equal to an "
                                         f"uninterrupted run on every rank: True")
