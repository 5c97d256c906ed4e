"""Reach the model inside DataParallel, DistributedDataParallel and torch.compile wrappers; tell a sharded one;
pause a data-parallel model's gradient communication."""

from __future__ import annotations

from contextlib import contextmanager

from torch import nn

from helpers.torch_private import compiled_inner


def unwrap(model: nn.Module) -> nn.Module:
    """The innermost model of any nesting of DataParallel, DistributedDataParallel and torch.compile.

    Parallel wrappers keep the model in ``.module``; torch.compile's wrapper, a private class, keeps it as its child
    module ``_orig_mod`` (``helpers.torch_private.compiled_inner``).
    """
    while True:
        if isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
            model = model.module
        elif (inner := compiled_inner(model)) is not None:
            model = inner
        else:
            return model


def is_sharded(model: nn.Module) -> bool:
    """Whether FSDP2's ``fully_shard`` sharded ``model`` (inside any wrapper): its class was swapped in place for
    a subclass of FSDPModule, and each process holds only its shard of every parameter."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(unwrap(model), FSDPModule)


@contextmanager
def no_gradient_sync(model: nn.Module):
    """Run forward and backward inside the block: the gradients add up on this process only; the first forward and
    backward after it communicate.

    Gradient accumulation needs the gradients of all processes only once per optimizer step. DDP all-reduces
    every gradient bucket in every backward unless ``no_sync()`` was active when its forward ran (DDP decides in
    forward); FSDP2 reduce-scatters every backward unless ``set_requires_gradient_sync(False)``. Any other model
    has nothing to pause.
    """
    if isinstance(model, nn.parallel.DistributedDataParallel):
        with model.no_sync():
            yield
    elif is_sharded(model):
        sharded = unwrap(model)
        sharded.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            sharded.set_requires_gradient_sync(True)
    else:
        yield
