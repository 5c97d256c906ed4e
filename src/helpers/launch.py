"""Start N training processes from a notebook on whatever machine it runs: one GPU each where there are enough
GPUs, else all N on the CPU over gloo. One place decides, so every multi-process command of the series runs
unchanged on a laptop, on a one-GPU machine and on a GPU server, and prints what it chose.

NCCL cannot put two processes on one GPU, and a process without a GPU of its own is refused before it joins
the group (helpers.distributed.device_problem); on one GPU, two processes therefore go to the CPU.
"""

from __future__ import annotations

import os
import shlex
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Launch:
    """``processes`` processes on ``device`` ("cuda": one GPU each; "cpu": all on the CPU), on a machine with ``gpus``."""

    processes: int
    device: str
    gpus: int

    def __str__(self) -> str:
        where = ("one GPU each (NCCL)" if self.device == "cuda"
                 else f"the CPU (gloo; one GPU per process needs {self.processes} GPUs)")
        return f"CUDA GPUs: {self.gpus}; {self.processes} processes on {where}"

    def torchrun(self, *args: str, module: str = "helpers.finetune") -> list[str]:
        """The command: ``torchrun --standalone --nproc_per_node=N -m module --device D *args``, with this Python."""
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={self.processes}",
                "-m", module, "--device", self.device, *args]

    def shell(self, *args: str, module: str = "helpers.finetune") -> str:
        """``torchrun`` as one line for a notebook's ``!`` (arguments quoted for the shell)."""
        return shlex.join(self.torchrun(*args, module=module))

    @property
    def env(self) -> dict[str, str]:
        """The environment to run it in: one thread per process, so N processes share the cores without contention."""
        return os.environ | {"OMP_NUM_THREADS": "1"}


def plan_launch(processes: int = 2, gpus: int | None = None) -> Launch:
    """``processes`` processes, each on a GPU of its own if this machine has that many (``gpus`` overrides the
    count torch sees), otherwise all of them on the CPU."""
    if processes < 1:
        raise ValueError(f"processes={processes}: start at least 1")
    if gpus is None:
        import torch

        gpus = torch.cuda.device_count()
    return Launch(processes, "cuda" if gpus >= processes else "cpu", gpus)
