"""Which GPUs a notebook's DataParallel uses, and running a GPU-only demonstration only where the GPUs exist."""

from __future__ import annotations

import torch


def available_device_ids(at_most: int = 2) -> list[int]:
    """The CUDA GPUs this machine has, at most ``at_most`` (the memo's two): ``[0, 1]``, ``[0]``, or ``[]`` without CUDA.

    The memo's literal ``device_ids=[0, 1]`` stops a one-GPU machine at wrapping time: DataParallel reads GPU 1's
    properties and gets ``AssertionError: Invalid device id``. Without CUDA, DataParallel ignores ``device_ids``.
    """
    if at_most < 1:
        raise ValueError(f"at_most={at_most}: DataParallel needs at least one device id")
    return list(range(min(torch.cuda.device_count(), at_most)))


def has_gpus(n: int) -> bool:
    """True if torch sees at least ``n`` CUDA devices; otherwise print one line saying why and return False.

    Notebooks guard their multi-GPU cells with it, so the same notebook runs on a laptop and on a GPU server.
    """
    count = torch.cuda.device_count()
    if count >= n:
        return True
    print(f"skipped: needs {n} CUDA GPU{'s' if n != 1 else ''}, torch sees {count}")
    return False
