"""Compare checkpoints: the proof that a save/load round trip lost nothing."""

from __future__ import annotations

import torch


def state_dicts_equal(a: dict, b: dict) -> bool:
    """True if ``a`` and ``b`` have the same keys and every tensor is equal in dtype, shape and every value.

    Tensors on different devices are compared on the CPU, so a GPU checkpoint compares with a CPU model.
    """
    if a.keys() != b.keys():
        return False
    for key, x in a.items():
        y = b[key]
        if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x.cpu(), y.cpu()):
            return False
    return True
