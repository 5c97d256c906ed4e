"""The folder of one run's checkpoints: ``step-NNNNNN`` folders, and the pointers ``latest`` (the newest) and
``best`` (the lowest validation loss), small text files naming one of them.

A pointer is read only once it is known to be a small regular file inside the run folder (a FIFO would make every
process wait forever, ``/dev/zero`` never ends), and the folder it names must lie inside the run folder too.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from helpers.checkpoint.atomic import remove_folder, remove_temporaries, write_text_atomic
from helpers.checkpoint.files import STATE_FILE, CheckpointError, caused, missing, read_capped, status_of
from helpers.checkpoint.loading import OpenCheckpoint, open_checkpoint
from helpers.checkpoint.progress import PER_PROCESS, Progress, rng_state
from helpers.checkpoint.together import FAILURES, fail_together, summary
from helpers.checkpoint.writing import save_checkpoint
from helpers.distributed import barrier, gather, rank, world_size

NAME = re.compile(r"step-(\d+)(?:-(\d+))?")
"""A checkpoint folder: ``step-000012``, or ``step-000012-2`` for the second save of that step."""
POINTER_BYTES = 256
"""The largest pointer file read: a folder's name and a newline take about 20 bytes."""


class Checkpoints:
    """The checkpoints of one run in ``directory``: ``fit`` saves one every ``every`` optimizer steps (0: only
    at the end of each epoch), keeps the newest ``keep`` plus the best, and resumes from ``latest``.

    With a process group (DDP, FSDP2) call every method on every process: each saves and gets back its own
    random state; rank 0 writes the pointers.
    """

    def __init__(self, directory: str | Path, every: int = 0, keep: int = 3, labels: tuple[str, ...] | None = None):
        if every < 0 or keep < 1:
            raise ValueError(f"Checkpoints: every must be >= 0 and keep >= 1, got every={every}, keep={keep}")
        self.directory = Path(directory)
        self.every = every
        self.keep = keep
        self.labels = labels  # saved with every full checkpoint's weights (see read_labels)

    def latest(self) -> Path | None:
        """The newest complete checkpoint, or None when the run has saved none yet."""
        return self.pointer("latest")

    def best(self) -> Path | None:
        """The checkpoint saved at the end of the epoch with the lowest validation loss, or None."""
        return self.pointer("best")

    def pointer(self, name: str) -> Path | None:
        """The checkpoint folder the pointer file ``name`` names, or None where there is no such file."""
        file = self.directory / name
        if not os.path.lexists(file):
            return None
        data = read_capped(file, self.directory, POINTER_BYTES)
        try:
            target = data.decode("utf-8").strip()
        except UnicodeDecodeError as error:
            raise CheckpointError(f"{file}: not readable as the name of a checkpoint folder ({error})") from error
        if not NAME.fullmatch(target):
            raise CheckpointError(
                f"{file}: expected the name of a checkpoint folder like 'step-000012', got {target!r}")
        if not os.path.lexists(self.directory / target):
            raise CheckpointError(f"{file}: names {target!r}, which is not in {self.directory}")
        status_of(self.directory / target, self.directory, "folder")
        return self.directory / target

    def save(self, model: nn.Module, optimizer, scheduler, progress: Progress, *, best: bool = False,
             scaler: torch.amp.GradScaler | None = None) -> None:
        """Save where the run stands into a new folder, then point ``latest`` (and, if ``best``, ``best``) at it.

        A folder is never replaced: a step saved again (a run started afresh in the same directory) goes into
        ``step-NNNNNN-2``, and the older folder of that step is removed once no pointer names it. So a kill at
        any moment leaves ``latest`` naming a checkpoint that loads. If writing fails on any process, every
        process raises CheckpointError at once, the failed one with its error as the cause.
        """
        per_process = gather({"rng": rng_state()} | {key: getattr(progress, key) for key in PER_PROCESS})
        path, error = self.directory / f"step-{progress.step:06d}", None
        try:
            path = self.directory / self.free_name(progress.step)
            save_checkpoint(path, model, optimizer, scheduler, scaler=scaler, progress=progress,
                            per_process=per_process, labels=self.labels)
            if rank() == 0:
                write_text_atomic(self.directory / "latest", path.name + "\n")
                if best:
                    write_text_atomic(self.directory / "best", path.name + "\n")
                self.remove_old()
        except CheckpointError as caught:
            error = caught
        except FAILURES as caught:
            error = caused(CheckpointError(f"{path}: not saved ({summary(caught)})"), caught)
        fail_together(error, describe=str, elsewhere=CheckpointError)

    def free_name(self, step: int) -> str:
        """The name of the next checkpoint of ``step``: ``step-NNNNNN``, then ``-2``, ``-3`` ... for later saves.

        A collective: rank 0 clears what a killed save left (the other processes write into the directory only
        after that) and picks the name; every process gets it."""
        name, error = None, None
        if rank() == 0:
            try:
                self.directory.mkdir(parents=True, exist_ok=True)
                remove_temporaries(self.directory)
                again = 1 + max((order(path)[1] for path in self.directory.iterdir()
                                 if NAME.fullmatch(path.name) and order(path)[0] == step), default=0)
                name = f"step-{step:06d}" + (f"-{again}" if again > 1 else "")
            except OSError as caught:
                error = caught
        fail_together(error)
        return gather(name)[0]

    def remove_old(self) -> None:
        """Remove all but the newest ``keep`` steps, and the older folders of a step saved again; never a folder
        a pointer names."""
        kept = {self.latest(), self.best()}
        saved = sorted((p for p in self.directory.iterdir() if NAME.fullmatch(p.name)), key=order)
        newest = {int(NAME.fullmatch(p.name).group(1)): p for p in saved}  # of each step, its last save
        old = [p for p in saved if p not in newest.values()] + sorted(newest.values(), key=order)[:-self.keep]
        for path in old:
            if path not in kept:
                remove_folder(path)

    def resume(self, model: nn.Module, optimizer, scheduler, loader, check: Callable[[Progress], None] | None = None,
               scaler: torch.amp.GradScaler | None = None) -> tuple[Progress, dict | None]:
        """Load the latest checkpoint, if any, and return where the run stands (a fresh Progress if there is
        none) and the random state to restore once the batches already trained have been skipped.

        The random state is put back to the start of the interrupted epoch, so the loader draws the same
        order again; ``train_epoch`` skips the first ``progress.batch`` batches and then restores the state
        of the moment of saving, so that dropout draws the same masks as the uninterrupted run. ``check`` may
        refuse where the checkpoint stands (CheckpointError). All or nothing, on every process: a checkpoint that
        one process cannot check raises the same CheckpointError on every process before any loads, and one that
        fails to load on any process leaves every process's model, optimizer, scheduler, scaler and random state
        as they were.
        """
        barrier()  # every process reads only once rank 0 has finished writing
        error, path, checked, progress = None, None, None, None
        try:
            path = self.latest()
            if path is not None:
                checked, progress = self.open_to_resume(path, model, optimizer, scheduler, loader, check, scaler)
        except CheckpointError as caught:
            error = caught
        seen = gather(None if path is None else path.name)
        if error is None and len(set(seen)) > 1:
            error = CheckpointError(f"{self.directory}: the processes see different latest checkpoints ({seen}, in "
                                    f"rank order); every process must read the same folder (a shared file system)")
        fail_together(error, describe=str, elsewhere=CheckpointError)
        if checked is None:
            return Progress(), None
        mine = checked.state["per_process"][rank()]
        error, undo = None, None
        try:
            undo = checked.apply(model, optimizer, scheduler, scaler, epoch_start=(loader, mine["epoch_start"]))
        except CheckpointError as caught:
            error = caught
        try:
            fail_together(error, describe=str, elsewhere=CheckpointError)
        except CheckpointError:
            if undo is not None:  # another process failed to load: this one goes back too
                undo()
            raise
        return progress, mine["rng"] if progress.batch else None

    def open_to_resume(self, path: Path, model: nn.Module, optimizer, scheduler, loader,
                       check: Callable[[Progress], None] | None = None,
                       scaler: torch.amp.GradScaler | None = None) -> tuple[OpenCheckpoint, Progress]:
        """Checkpoint ``path``, read and checked for resuming (as many processes as saved it, a loader like the
        one that drew its data order, ``check``), and where this process stands in it."""
        checked = open_checkpoint(path, model, optimizer, scheduler, scaler)
        if not checked.state:  # read wherever it exists
            raise missing(path / STATE_FILE)
        state = checked.state
        saved_by = len(state["per_process"])
        if saved_by != world_size():
            raise CheckpointError(f"{path / STATE_FILE}: saved by {saved_by} process(es), resumed with {world_size()}; "
                                  f"resume with the same number to continue exactly (its weights alone load into "
                                  f"any number: load_checkpoint without an optimizer)")
        mine = state["per_process"][rank()]
        if mine["epoch_start"] is None:
            raise CheckpointError(f"{path / STATE_FILE}: saved without the random state its epoch started from, so "
                                  f"the data order cannot be drawn again (save with Checkpoints inside fit)")
        if mine["epoch_start"]["loader"] is not None and getattr(loader, "generator", None) is None:
            raise CheckpointError(f"{path / STATE_FILE}: saved with a data loader that has its own random generator; "
                                  f"this loader has none")
        progress = Progress(**state["progress"], **{key: mine[key] for key in PER_PROCESS})
        if check is not None:
            try:
                check(progress)
            except CheckpointError as error:
                raise CheckpointError(f"{path / STATE_FILE}: {error}") from error
        return checked, progress


def order(path: Path) -> tuple[int, int]:
    """Where the checkpoint folder ``path`` comes in a run: its step, then which save of that step."""
    step, again = NAME.fullmatch(path.name).groups()
    return int(step), int(again or 1)
