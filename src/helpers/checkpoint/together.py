"""What the processes of a group do together fails together. Once each has tried its part (writing its files,
checking or loading a checkpoint), they agree: if any failed, every one raises at once, instead of the others
waiting for it at their next collective until the process group's timeout (30 minutes by default)."""

from __future__ import annotations

from collections.abc import Callable

from torch.distributed.checkpoint import CheckpointException

from helpers.distributed import agree_on_problem

FAILURES = (Exception, CheckpointException)
"""What a write or a read can raise; torch.distributed.checkpoint's CheckpointException is a BaseException."""


class OtherProcessFailed(RuntimeError):
    """Raised on every process of a collective where another process's part of it failed."""


def first_failure(error: BaseException) -> tuple[int | None, BaseException]:
    """The rank and the exception behind ``error``: for DCP's CheckpointException, which gathers every failed rank's,
    the first failed rank's; else (None, ``error``)."""
    if isinstance(error, CheckpointException) and error.failures:
        where, (failure, _) = min(error.failures.items())
        return where, failure
    return None, error


def summary(error: BaseException) -> str:
    """One line for ``error``: its type and message (for DCP's CheckpointException, the first failed rank's)."""
    where, error = first_failure(error)
    if where is not None:
        return f"rank {where}: {summary(error)}"
    if isinstance(error, OtherProcessFailed):  # its message names the process, the type and the cause
        return str(error)
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


def fail_together(error: BaseException | None, describe: Callable[[BaseException], str] = summary,
                  elsewhere: Callable[[str], BaseException] = OtherProcessFailed) -> None:
    """Agree on the outcome, then raise if any process failed: a collective, called on every process with what its
    part raised (None: it succeeded). A failed process raises its own ``error``; the others raise
    ``elsewhere(problem)``, where ``problem`` is ``describe`` of the first failed process's error (with its rank and
    machine where the processes' problems differ). Without a process group: raises ``error``, if any."""
    problem = agree_on_problem(None if error is None else describe(error))
    if error is not None:
        raise error
    if problem is not None:
        raise elsewhere(problem)
