"""Stop a training run when the scheduler says so, with a checkpoint every rank saved at the same step.

Slurm, like most schedulers and clouds, asks a job to stop before it kills it: SIGTERM when it preempts or
requeues the job (SIGKILL follows after a grace period), or SIGUSR1 a while before the time limit when the job
asked for it (``sbatch --signal=USR1@120``). The signal reaches each process at its own moment, in the middle of
some step, but a checkpoint must hold one step on every rank. So a process only notes the signal; at each step
boundary the ranks agree whether any of them was told (an all-reduce of one number), and if so they save that step
together and stop with ``EXIT_STATUS``, which the job script turns into a requeue. The requeued job runs the same
command with ``--resume`` and ends bitwise like a run never stopped (examples/slurm/).
"""

from __future__ import annotations

import signal

import torch
import torch.distributed as dist

from helpers.distributed import with_others

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
EXIT_STATUS = 75
"""What a stopped run exits with: EX_TEMPFAIL of sysexits.h, a temporary failure, to be run again."""


class Preempted(Exception):
    """Every rank saved the same step and the run stops there; the message says where it stopped and how to go on."""


class StopSignals:
    """Note SIGTERM and SIGUSR1 instead of dying of them; ``agreed`` tells every rank at once whether any was told."""

    def __init__(self, signals: tuple[signal.Signals, ...] = SIGNALS):
        self.received = 0  # the number of the signal this process got, 0 for none
        for number in signals:
            signal.signal(number, self.note)

    def note(self, number: int, frame) -> None:
        self.received = self.received or number

    def agreed(self, device: torch.device) -> str | None:
        """The name of a signal some rank received (the highest number, if they differ), or None. A collective:
        call it on every rank at the same step."""
        received = self.received
        if with_others():
            flag = torch.tensor(received, device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            received = int(flag.item())
        return signal.Signals(received).name if received else None


def stop_at_step_boundary(signals: StopSignals, checkpoints, model, optimizer, scheduler, loader,
                          device: torch.device, scaler=None):
    """The callback ``helpers.train.fit`` calls after each optimizer step (``on_step``): once the ranks agree that a
    stop signal came, every rank saves this step into ``checkpoints`` and raises Preempted. The epoch's last step is
    left to ``fit``, which saves it after the evaluation; the stop then comes one step later."""
    def on_step(progress) -> None:
        if progress.batch >= len(loader):
            return
        received = signals.agreed(device)
        if received:
            checkpoints.save(model, optimizer, scheduler, progress, scaler=scaler)
            raise Preempted(f"stopped by {received} after step {progress.step} (epoch {progress.epoch + 1}, batch "
                            f"{progress.batch}): every process saved it in {checkpoints.latest()}; the same command "
                            f"with --resume continues from there")
    return on_step
