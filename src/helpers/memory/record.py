"""The H200 record: the single-GPU steps ``make gpu-check`` measured on an NVIDIA H200 (torch 2.11.0+cu130,
2026-12-04), kept as that run's report (``helpers/data/h200/gpu-check.json``). CONTRIBUTING.md ("Upgrading
torch") says how to record it again."""

from __future__ import annotations

import json
import re
from importlib.resources import files
from pathlib import Path

H200_RECORD = Path(str(files("helpers") / "data" / "h200" / "gpu-check.json"))


def h200_steps() -> list[dict]:
    """The 24 single-GPU steps ``make gpu-check`` measured on an NVIDIA H200 (torch 2.11.0+cu130, 2026-12-04): each
    setting, the interval its measured ``max_memory_allocated`` lies in (the printed GiB, rounded to 0.01,
    intersected with the printed gap, rounded to 0.1 %, to the prediction of then) and that prediction: MemTracker's
    peak alone, without workspaces or the allocator's blocks."""
    steps = []
    for entry in json.loads(H200_RECORD.read_text(encoding="utf-8"))["settings"]:
        kernel, dtype, batch, length, gib, gap = re.match(
            r"1 GPU, (\S+), (fp32|bf16), B=(\d+), L=(\d+)\s+predicted\s+[\d.]+ GiB\s+measured\s+([\d.]+) GiB"
            r"\s+gap ([+-][\d.]+)%", entry["line"]).groups()
        then = entry["predicted_then"]
        low = max((float(gib) - 0.005) * 2**30, then * (1 + (float(gap) - 0.05) / 100))
        high = min((float(gib) + 0.005) * 2**30, then * (1 + (float(gap) + 0.05) / 100))
        steps.append(dict(attention="eager" if kernel == "eager" else "sdpa", amp=dtype == "bf16",
                          batch_size=int(batch), seq_len=int(length), low=int(low), high=int(high), then=then))
    return steps

