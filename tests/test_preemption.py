"""A run told to stop (SIGTERM, SIGUSR1) saves the next step on every process, exits 75, and resumed with --resume ends
bitwise like a run never stopped: in one process (helpers.finetune called here, the signal sent to this process) and
under torchrun with 2 processes over gloo (the signal sent to torchrun and its workers, as Slurm sends it)."""

import os
import signal
import threading
import time

import pytest

from helpers import finetune
from helpers.checks.training_checks import BATCHES_PER_EPOCH, RESUME_RUN, SAVE_EVERY, finetune_command, kill_and_resume
from helpers.preemption import EXIT_STATUS, SIGNALS, StopAtStepBoundary


def test_inside_a_signal_is_noted_not_obeyed_and_the_handlers_before_come_back():
    """A notebook's kernel calls helpers.finetune.main: SIGTERM must end it again once the run is over."""
    before = {number: signal.getsignal(number) for number in SIGNALS}
    with StopAtStepBoundary(None, None, None, None, [], None) as stop:
        assert stop.agreed() is None
        os.kill(os.getpid(), signal.SIGUSR1)  # without the handler, this would end the test process
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.agreed() == "SIGUSR1"  # the first one; ranks that got different ones agree on the highest
    assert {number: signal.getsignal(number) for number in SIGNALS} == before


def signal_when_saved(latest, number: int) -> threading.Thread:
    """A thread that sends ``number`` to this process as soon as ``latest`` exists (the first checkpoint)."""
    def watch():
        deadline = time.monotonic() + 300
        while not latest.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(os.getpid(), number)
    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def test_one_process_stopped_by_sigusr1_saves_the_next_step_and_resumes_bitwise(tmp_path, capsys):
    training = [*RESUME_RUN, "--epochs", "1", "--val-examples", "16"]  # 8 steps, a short evaluation: three runs, cheap
    saving = [*training, "--checkpoint-dir", str(tmp_path), "--save-every", str(SAVE_EVERY)]
    watcher = signal_when_saved(tmp_path / "latest", signal.SIGUSR1)
    with pytest.raises(SystemExit) as stopped:
        finetune.main(saving)
    watcher.join()
    assert stopped.value.code == EXIT_STATUS and signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL  # put back
    said = capsys.readouterr().out
    step = int(said.split("stopped by SIGUSR1 after step ")[1].split()[0])
    assert SAVE_EVERY <= step < BATCHES_PER_EPOCH  # the first step boundary after the first checkpoint: mid-epoch
    assert (tmp_path / "latest").read_text().strip().startswith(f"step-{step:06d}")  # saved at the stop
    assert f"every process saved it in {tmp_path}/step-{step:06d}" in said

    resumed = finetune.main([*saving, "--resume"])
    assert f"resumed at step {step}: epoch 1, batch {step}" in capsys.readouterr().out
    uninterrupted = finetune.main(training)
    assert resumed["weights_sha256"] == uninterrupted["weights_sha256"]
    assert losses(resumed) == losses(uninterrupted)


def losses(summary: dict) -> list[tuple[float, float]]:
    return [(row["train_loss"], row["val_loss"]) for row in summary["history"]]


def test_torchrun_stopped_by_sigterm_saves_on_every_rank_and_resumes_bitwise(tmp_path, uninterrupted_ddp_run):
    result = kill_and_resume(finetune_command(2, *RESUME_RUN, "--deterministic"), tmp_path / "checkpoints",
                             tmp_path / "torchrun.log", stop=signal.SIGTERM, uninterrupted=uninterrupted_ddp_run)
    log = (tmp_path / "torchrun.log").read_text()
    stopped_at = result["stopped_at"]
    assert f"stopped by SIGTERM after step {stopped_at['step']}" in log  # rank 0's line, once
    assert log.count("stopped by SIGTERM") == 1 and SAVE_EVERY <= stopped_at["step"]
    assert result["resumed_from"] == stopped_at["step"] and result["processes_stopped"] == 3
    assert result["processes_saved"] == 2 and result["status"] == 1  # torchrun exits 1 when a worker does not exit 0
    assert result["bitwise"], (result["resumed"]["weights_sha256"], result["uninterrupted"]["weights_sha256"])
    assert losses(result["resumed"]) == losses(result["uninterrupted"])
