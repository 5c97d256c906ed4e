"""One process per device: join the process group torchrun describes, or form a group of one without it."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist


def launched_by_torchrun() -> bool:
    """torchrun (and every launcher built on torch.distributed.elastic) sets RANK, WORLD_SIZE and LOCAL_RANK."""
    return "RANK" in os.environ


def world_size() -> int:
    """How many processes train together: the group's size once it exists, else what torchrun announced.

    1 for a plain ``python`` run or a notebook. Reading the environment lets a process check its input
    before joining the group.
    """
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", 1))


def rank() -> int:
    """This process's number among all processes on all machines; 0 speaks for the group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", 0))


def device_for_this_process() -> torch.device:
    """One process per device: the GPU numbered LOCAL_RANK on this machine, or the CPU where there is none."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def init_process_group(device: torch.device) -> None:
    """Join the group: NCCL between GPUs, gloo between CPU processes.

    Under torchrun the rendezvous address comes from the environment; a plain process forms a group of
    one in memory (HashStore), so the same DDP code runs unchanged with one process.
    """
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if launched_by_torchrun():
        dist.init_process_group(backend)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def agree_on_problem(problem: str | None) -> str | None:
    """The first problem any rank found (lowest rank first), or None; every rank gets the same answer.

    Checks that depend on one machine (a model in its cache, a folder on its disk) can fail on one rank
    only; without this collective the others would wait for it forever.
    """
    problems = [None] * dist.get_world_size()
    dist.all_gather_object(problems, problem)
    return next((p for p in problems if p is not None), None)


def stop_everywhere(problem: str, exit_code: int = 2) -> None:
    """Rank 0 prints ``problem``; then every rank leaves the group and exits with ``exit_code``.

    The barrier lets rank 0 finish printing before any rank exits, since torchrun stops all workers as
    soon as the first one fails.
    """
    if dist.get_rank() == 0:
        print(f"error: {problem}", file=sys.stderr, flush=True)
    dist.barrier()
    dist.destroy_process_group()
    sys.exit(exit_code)
