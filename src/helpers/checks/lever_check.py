"""``make gpu-check``'s lever lines: each memory lever's measured peak on a GPU against notebook 05's prediction.

For BERT-base (random weights) at one batch size and sequence length, one real step per lever as helpers.finetune
applies it (helpers.lever_memory.cuda_step_peak) against ``helpers.memory.per_device`` with the same lever, and
the saving against the step without a lever, measured and predicted. Register it in gpu_check's checks as
``checks["levers"] = check_levers``.
"""

from __future__ import annotations

import torch

from helpers.lever_memory import LEVERS, cuda_step_peak
from helpers.memory import per_device
from helpers.memtrace import bert_base_config

TOLERANCE = 0.05
GIB = 2**30


def check_levers(batch_size: int = 8, seq_len: int = 512) -> list[tuple[bool, str]]:
    """[(ok, line), ...]: per lever, measured peak within TOLERANCE of the prediction, and both savings."""
    if not torch.cuda.is_available():
        return [(True, "skip lever check: no CUDA device on this machine")]
    config, results, none = bert_base_config(), [], {}
    for name, options in LEVERS.items():
        if options.get("amp") and not torch.cuda.is_bf16_supported():
            results.append((True, f"skip lever {name}: this GPU does not support bf16"))
            continue
        accumulation, checkpointing = options.get("accumulation", 1), bool(options.get("checkpointing"))
        (predicted,) = per_device(config, batch_size, seq_len, accumulation=accumulation,
                                  checkpointing=checkpointing, amp=bool(options.get("amp")))
        measured = cuda_step_peak(config, batch_size, seq_len, accumulation=accumulation,
                                  checkpointing=checkpointing, amp=options.get("amp")).peak
        gap = measured / predicted["total"] - 1
        line = (f"lever {name:<14} BERT-base 1 GPU, B={batch_size}, L={seq_len}: predicted "
                f"{predicted['total'] / GIB:6.2f} GiB  measured {measured / GIB:6.2f} GiB  gap {gap:+.1%}")
        if name == "none":
            none = {"predicted": predicted["total"], "measured": measured}
        elif none:
            line += (f"; saving vs none: predicted {1 - predicted['total'] / none['predicted']:.0%}, "
                     f"measured {1 - measured / none['measured']:.0%}")
        results.append((abs(gap) <= TOLERANCE, line))
    return results
