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


class StopAtStepBoundary:
    """Inside ``with``, SIGTERM and SIGUSR1 are noted instead of ending the process (the handlers before are put back
    after it, so a notebook's kernel keeps its own). Called after each optimizer step as ``helpers.train.fit``'s
    ``on_step``, it stops the run there once the ranks agree that a signal came: every rank saves this step into
    ``checkpoints`` and raises Preempted. The epoch's last step is left to ``fit``, which saves it after the
    evaluation; the stop then comes one step later."""

    def __init__(self, checkpoints, model, optimizer, scheduler, loader, device: torch.device, scaler=None,
                 signals: tuple[signal.Signals, ...] = SIGNALS):
        self.checkpoints, self.model, self.optimizer, self.scheduler = checkpoints, model, optimizer, scheduler
        self.loader, self.device, self.scaler, self.signals = loader, device, scaler, signals
        self.received = 0  # the number of the first signal this process got, 0 for none
        self.before = {}

    def __enter__(self) -> StopAtStepBoundary:
        self.before = {number: signal.signal(number, self.note) for number in self.signals}
        return self

    def __exit__(self, *exception) -> None:
        for number, handler in self.before.items():
            signal.signal(number, handler)

    def note(self, number: int, frame) -> None:
        self.received = self.received or number

    def agreed(self) -> str | None:
        """The name of a signal some rank received (the highest number, if they differ), or None. A collective:
        every rank calls it at the same step."""
        received = self.received
        if with_others():
            flag = torch.tensor(received, device=self.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            received = int(flag.item())
        return signal.Signals(received).name if received else None

    def __call__(self, progress) -> None:
        if progress.batch >= len(self.loader):
            return
        received = self.agreed()
        if received:
            self.checkpoints.save(self.model, self.optimizer, self.scheduler, progress, scaler=self.scaler)
            raise Preempted(f"stopped by {received} after step {progress.step} (epoch {progress.epoch + 1}, batch "
                            f"{progress.batch}): every process saved it in {self.checkpoints.latest()}; the same "
                            f"command with --resume continues from there")
