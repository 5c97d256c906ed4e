"""Reach the model inside DataParallel, DistributedDataParallel and torch.compile wrappers."""

from __future__ import annotations

from torch import nn


def unwrap(model: nn.Module) -> nn.Module:
    """The innermost model of any nesting of DataParallel, DistributedDataParallel and torch.compile.

    Parallel wrappers keep the model in ``.module``; torch.compile keeps it in ``._orig_mod``.
    """
    from torch._dynamo.eval_frame import OptimizedModule  # torch.compile's wrapper; importing it is slow

    while True:
        if isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
            model = model.module
        elif isinstance(model, OptimizedModule):
            model = model._orig_mod
        else:
            return model
