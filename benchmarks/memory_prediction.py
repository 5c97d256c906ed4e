"""How long ``python -m helpers.memory`` takes to answer the README's example (BERT-base, L=128, DDP on two T4s, fp16):
a fresh interpreter each time, as a reader types it (imports, the traces of the asked setting, and the search for the
largest batch that fits)."""

from __future__ import annotations

import subprocess
import sys
import time

import common

COMMAND = ["--gpu", "T4", "--gpus", "2", "--strategy", "ddp", "--global-batch-size", "32", "--seq-len", "128", "--amp",
           "fp16"]
"""The README's example (tests/test_memory_cli.py checks that the two agree)."""
LABEL = "BERT-base, L=128, DDP on 2 T4s, fp16: the README's example"
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
