"""PyTorch's own memory tracker around a step, in one wrapper: ``MemTracker`` for a plain or DDP model,
``FSDPMemTracker`` for a sharded one, on real tensors or fake ones.

The tracker files every tensor under a kind (parameters, gradients, optimizer state, activations, temporaries;
FSDP2's shards, gathered weights and buffers) and reports the peak of the bytes tensors ask for. The trace of a
step (helpers.memory.tracer), FSDP2's predictions (helpers.memory.fsdp2), the levers' real steps
(helpers.lever_memory) and notebook 09's FSDP2 accumulation check (helpers.accumulation) all track through it.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager

from torch import nn
from torch.nn.modules.module import register_module_forward_pre_hook

from helpers.memory.categories import FSDP_MEMTRACKER, MEMTRACKER, in_words
from helpers.torch_private import fsdp_mem_tracker, mem_tracker
from helpers.wrapping import is_sharded, unwrap


class Tracking:
    """What ``tracking`` yields: the tracker, and ``starts``, the bytes by category held as each forward of the
    model began (between micro-batches: what one micro-batch leaves for the next)."""

    def __init__(self, tracker):
        self.tracker = tracker
        self.sharded = type(tracker).__name__ == "FSDPMemTracker"
        self.starts: list[dict[str, int]] = []

    def kinds(self, moment: str = "peak") -> dict[str, int]:
        """The bytes at ``moment`` ("peak" or "current") by the tracker's own kinds, on the one device tracked."""
        (device,) = self.tracker.get_tracker_snapshot(moment).values() or ({},)
        return {getattr(kind, "value", kind): nbytes for kind, nbytes in device.items() if kind != "Total"}

    def categories(self, moment: str = "peak") -> dict[str, int]:
        """The bytes at ``moment`` in the words of notebook 05 (08's for a sharded model), and 'total'."""
        return in_words(self.kinds(moment), FSDP_MEMTRACKER if self.sharded else MEMTRACKER)


@contextmanager
def tracking(model: nn.Module, optimizer=None, *, pause_gc: bool = True):
    """Yield a ``Tracking`` whose tracker is active in the block: FSDPMemTracker for a sharded ``model``, else a
    MemTracker that also counts ``model`` and ``optimizer`` as they are when the block begins.

    Each forward of ``model`` starts the tracker's module statistics afresh, which it needs for a second forward
    of the same modules (a micro-batch). The block starts after a garbage collection; with ``pause_gc`` the next
    one waits until the block ends, so that it frees nothing at an arbitrary point of the step.
    """
    if is_sharded(model):
        tracker = fsdp_mem_tracker()(unwrap(model), optimizer)
    else:
        tracker = mem_tracker()()
        tracker.track_external(model, *([optimizer] if optimizer is not None else []))
    watch = Tracking(tracker)

    def forward_begins(module, _):  # a global hook runs before the tracker's own hooks on the module
        if module is model:  # the outermost module (a wrapper, if any) starts the forward
            watch.starts.append(watch.categories("current"))
            tracker.reset_mod_stats()

    handle = register_module_forward_pre_hook(forward_begins)
    gc.collect()
    paused = pause_gc and gc.isenabled()
    if paused:
        gc.disable()
    try:
        with tracker:
            yield watch
    finally:
        if paused:
            gc.enable()
        handle.remove()
