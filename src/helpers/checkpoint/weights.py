"""A model's weights in any wrapping, whole and under plain names, and two ways to tell that weights are equal."""

from __future__ import annotations

import hashlib

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from helpers.wrapping import unwrap


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


def full_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The weights of ``model`` in any wrapping, whole and under plain names, as ``Net().state_dict()`` has them.

    A sharded model's are gathered from every process, so call it on every process.
    """
    return get_model_state_dict(unwrap(model), options=StateDictOptions(full_state_dict=True))


def weights_digest(model: nn.Module) -> str:
    """SHA-256 of the full weights (``full_weights``), in key order: equal digests mean bitwise equal weights."""
    digest = hashlib.sha256()
    for key, tensor in full_weights(model).items():
        digest.update(key.encode())
        digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()
