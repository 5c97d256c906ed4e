"""Run a GPU-only demonstration only where the machine has the GPUs it needs."""

from __future__ import annotations

import torch


def has_gpus(n: int) -> bool:
    """True if torch sees at least ``n`` CUDA devices; otherwise print one line saying why and return False.

    Notebooks guard their multi-GPU cells with it, so the same notebook runs on a laptop and on a GPU server.
    """
    count = torch.cuda.device_count()
    if count >= n:
        return True
    print(f"skipped: needs {n} CUDA GPU{'s' if n != 1 else ''}, torch sees {count}")
    return False
