"""How long ``python -m helpers.memory`` takes to answer for BERT-base at L=512: a fresh interpreter each time, as a
reader types it (imports, the traces of the asked setting, and the search for the largest batch that fits)."""

from __future__ import annotations

import subprocess
import sys
import time

import common

COMMAND = ["--model", "tohoku-nlp/bert-base-japanese-v3", "--batch-size", "32", "--seq-len", "512", "--gpus", "2",
           "--strategy", "ddp", "--amp", "bf16", "--gpu-memory", "16GiB"]
TARGET_S = 10.0


def run(repeats: int) -> dict:
    seconds, output = [], ""
    for _ in range(repeats):
        start = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "helpers.memory", *COMMAND], capture_output=True, text=True,
                              check=True)
        seconds.append(time.perf_counter() - start)
        output = done.stdout
    return {"seconds": seconds, "output": output}


def report(result: dict) -> list[str]:
    seconds = result["seconds"]
    return [f"python -m helpers.memory {' '.join(COMMAND)}", result["output"].rstrip(),
            f"median {common.median(seconds):.1f} s, worst {max(seconds):.1f} s over {len(seconds)} runs "
            f"(target <= {TARGET_S:.0f} s)"]
