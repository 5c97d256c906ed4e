"""Reach the model inside DataParallel, DistributedDataParallel and torch.compile wrappers; tell a sharded one."""

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


def is_sharded(model: nn.Module) -> bool:
    """Whether FSDP2's ``fully_shard`` sharded ``model`` (inside any wrapper): its class was swapped in place for
    a subclass of FSDPModule, and each process holds only its shard of every parameter."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(unwrap(model), FSDPModule)
