"""One process per device: join the process group torchrun describes, or form a group of one without it; leave it
so that the process exits cleanly."""

from __future__ import annotations

import gc
import os
import socket
import sys

import torch
import torch.distributed as dist
from torch import nn

from helpers import torch_private

DEVICE_CHOICES = ("auto", "cpu", "cuda")


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


def device_problem(choice: str = "auto") -> str | None:
    """Why this process cannot have a device of its own for ``--device choice``, or None.

    torchrun starts LOCAL_WORLD_SIZE processes on each machine, numbered by LOCAL_RANK; each takes the GPU of
    that number. Counting the machine's processes, not only this one's number, makes every process of the
    machine find the same problem, so they all stop before joining a group that one of them cannot join.
    """
    if choice == "cpu":
        return None
    if choice == "cuda" and not torch.cuda.is_available():
        return "--device cuda: torch sees no CUDA device on this machine; use --device cpu (or auto)"
    if not torch.cuda.is_available():
        return None
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    processes = max(int(os.environ.get("LOCAL_WORLD_SIZE", 1)), local_rank + 1)
    gpus = torch.cuda.device_count()
    if processes > gpus:
        return (f"{processes} processes on this machine but torch sees {gpus} CUDA GPU(s), and each process needs "
                f"a GPU of its own (LOCAL_RANK {processes - 1} has none): start at most {gpus} "
                f"(torchrun --nproc_per_node={gpus}), or add --device cpu to run all {processes} on the CPU over gloo")
    return None


def device_for_this_process(choice: str = "auto") -> torch.device:
    """One process per device: the GPU numbered LOCAL_RANK on this machine, or the CPU where there is none.

    ``choice`` "cpu" keeps the processes on the CPU even where there are GPUs; check ``device_problem`` first.
    """
    if choice != "cpu" and torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def init_process_group(device: torch.device) -> None:
    """Join the group: NCCL between GPUs, gloo between CPU processes.

    Under torchrun the rendezvous address comes from the environment; a plain process forms a group of
    one in memory (HashStore), so the same DDP code runs unchanged with one process. Under NCCL,
    ``device_id`` binds the group to this process's GPU: barriers then know which GPU to use instead of
    warning that they guess.
    """
    backend, options = "gloo", {}
    if device.type == "cuda":
        backend, options = "nccl", {"device_id": device}
        torch.cuda.set_device(device)
    if launched_by_torchrun():
        dist.init_process_group(backend, **options)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **options)


def leave_process_group(*models: nn.Module) -> None:
    """Leave the group so that the process exits cleanly: every rank calls it after its last collective, with the
    DDP models of this run that it still holds (``leave_process_group(model)``); those stop communicating, and
    their ``.module`` stays usable. A DDP model not handed over keeps its group and still trains (even after the group
    is gone: its C++ reducer keeps the group's object), so nothing of another run changes here.

    ``destroy_process_group`` only unregisters the group. Its C++ object, with gloo's worker threads, lives on
    while anything else holds it: a DDP model's reducer, a device mesh, FSDP2's state. Kept alive to interpreter
    exit, a worker thread that drops the tensors of a finished collective there needs the GIL; Python ends that
    thread, and the C++ runtime aborts: "terminate called without an active exception" (SIGABRT), after all the
    output. Destroyed later by a reducer, its last owner, as a function returns, the group joins those threads under
    the GIL, which one of them may be waiting for: a hang.

    So every rank waits until all are done, and drops what holds the group: the DDP models it is given, and the
    meshes of the groups being destroyed with FSDP2's views of them (``torch_private.release_meshes``): torch's
    caches keep a mesh out of the caller's reach long after its model, and an FSDP2 model of this group kept past
    it no longer communicates. Garbage collection frees what only cycles kept (FSDP2's module states; a model whose
    communication hook held it would stay, so hooks here hold no model: helpers.accumulation.CollectiveCounter).
    Then the group is destroyed: its last owner gone, it joins its threads there, with the GIL released, while
    Python is whole.
    """
    barrier()
    for model in models:
        release(model)
    gc.collect()
    torch_private.release_meshes(torch_private.live_process_groups())
    dist.destroy_process_group()


def release(model: nn.Module) -> None:
    """Drop what ``model`` holds of its process group, if it is DistributedDataParallel: it no longer communicates,
    its ``.module`` stays usable (a plain or FSDP2 model holds its group through meshes: ``leave_process_group``)."""
    if isinstance(model, nn.parallel.DistributedDataParallel):
        torch_private.release_ddp(model)


def with_others() -> bool:
    """True in a process group of more than one process: only then do collectives have anyone to wait for."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def barrier() -> None:
    """Wait until every process gets here; nothing to wait for without other processes."""
    if with_others():
        dist.barrier()


def gather(value) -> list:
    """``value`` of every process, in rank order (``[value]`` without other processes)."""
    if not with_others():
        return [value]
    values = [None] * world_size()
    dist.all_gather_object(values, value)
    return values


def agree_on_problem(problem: str | None) -> str | None:
    """The first problem any rank found (lowest rank first), or None; every rank gets the same answer.

    Checks that depend on one machine (a model in its cache, a folder on its disk) can fail on one rank
    only; without this collective the others would wait for it forever. A problem that not every rank
    found is named with the rank and the machine that found it. Without a process group: ``problem``.
    """
    found = gather(None if problem is None else (socket.gethostname(), problem))
    first = next(((where, report) for where, report in enumerate(found) if report is not None), None)
    if first is None:
        return None
    where, (host, text) = first
    if all(report is not None and report[1] == text for report in found):
        return text
    return f"rank {where} on {host}: {text}"


def stop_everywhere(problem: str, *models: nn.Module, exit_code: int = 2) -> None:
    """Rank 0 prints ``problem``; then every rank leaves the group, releasing ``models`` (as in
    ``leave_process_group``), and exits with ``exit_code``.

    The barrier lets rank 0 finish printing before any rank exits, since torchrun stops all workers as
    soon as the first one fails.
    """
    if dist.get_rank() == 0:
        print(f"error: {problem}", file=sys.stderr, flush=True)
    leave_process_group(*models)
    sys.exit(exit_code)


def stop_before_joining(problem: str, exit_code: int = 2) -> None:
    """Exit with ``exit_code`` without joining the group; the machine's first process (LOCAL_RANK 0) prints.

    For problems every process of the machine finds by itself (``device_problem``), so none waits for another.
    """
    if int(os.environ.get("LOCAL_RANK", 0)) == 0:
        print(f"error: {problem}", file=sys.stderr, flush=True)
    sys.exit(exit_code)
