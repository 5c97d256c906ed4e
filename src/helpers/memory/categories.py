"""The words a step's memory is split into, in one order, and how PyTorch's trackers' own kinds map onto them.

The words are notebook 05's (08 adds "gathered", FSDP2's all-gathered weights). Every table of the package lists
them in ``ORDER``; a producer that never files under some word leaves it out (one simulated GPU has no gathered
weights, DDP's gradient buckets are added per rank by the prediction).
"""

from __future__ import annotations

ORDER = ("weights", "gathered", "gradients", "optimizer", "activations", "temporaries", "workspaces", "reduction",
         "batch", "allocator", "buckets")

MEMTRACKER = {"Parameter": "weights", "Buffer": "weights", "Gradient": "gradients", "Optstate": "optimizer",
              "Activation": "activations", "Temp": "temporaries", "Other": "temporaries"}
"""MemTracker's kinds (torch/distributed/_tools/mem_tracker.py, ``_MemRefType``) in our words."""
FSDP_MEMTRACKER = {"Sharded Param": "weights", "Buffer": "weights", "Unsharded Param": "gathered",
                   "All Gather": "gathered", "Sharded Grad": "gradients", "Unsharded Grad": "gradients",
                   "Reduce Scatter": "gradients", "OptState": "optimizer", "Activation": "activations",
                   "Temp": "temporaries", "Inputs": "temporaries"}
"""FSDPMemTracker's kinds (torch/distributed/_tools/fsdp2_mem_tracker.py, ``_FSDPRefType``) in our words."""


def in_order(words) -> tuple[str, ...]:
    """``words`` in ORDER; a word ORDER does not know is an error, not a silently dropped column."""
    words = set(words)
    unknown = words - set(ORDER)
    if unknown:
        raise ValueError(f"unknown memory categories {sorted(unknown)}; known: {', '.join(ORDER)}")
    return tuple(word for word in ORDER if word in words)


def in_words(kinds: dict[str, int], words: dict[str, str], **added: int) -> dict[str, int]:
    """A tracker's bytes by its own kinds, added up under our words: every word ``words`` maps to (0 where nothing
    was filed) and each of ``added``, in ORDER, and then 'total'."""
    unknown = set(kinds) - set(words)
    if unknown:
        raise ValueError(f"the tracker reports kinds {sorted(unknown)} that helpers.memory.categories does not map; "
                         f"add them there (a newer torch?)")
    result = dict.fromkeys(in_order({*words.values(), *added}), 0) | added
    for kind, nbytes in kinds.items():
        result[words[kind]] += nbytes
    return result | {"total": sum(result.values())}
