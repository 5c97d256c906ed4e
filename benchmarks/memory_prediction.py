"""How long ``python -m helpers.memory`` takes to answer the README's example (BERT-base, L=128, DDP on two T4s, fp16)
against importing what it needs, ``python -c "import torch, transformers; from transformers import BertModel"``: a
fresh interpreter each time, as a reader types it, the two interleaved so that the machine's load falls on both alike,
after one round left out (it warms the file cache for both). The target is a ratio: at most 1.5 times the import."""

from __future__ import annotations

import subprocess
import sys
import time

import common

COMMAND = ["--gpu", "T4", "--gpus", "2", "--strategy", "ddp", "--global-batch-size", "32", "--seq-len", "128", "--amp",
           "fp16"]
"""The README's example (tests/test_memory_cli.py checks that the two agree)."""
IMPORT = ["-c", "import torch, transformers; from transformers import BertModel"]
LABEL = "BERT-base, L=128, DDP on 2 T4s, fp16: the README's example"
TARGET = 1.5
"""At most this many times the import's time, in every repetition."""


def _timed(args: list[str]) -> tuple[float, str]:
    start = time.perf_counter()
    done = subprocess.run([sys.executable, *args], capture_output=True, text=True, check=True)
    return time.perf_counter() - start, done.stdout


def run(repeats: int) -> dict:
    seconds: dict[str, list[float]] = {"import": [], "command": []}
    output = ""
    for round_ in range(repeats + 1):
        imported, _ = _timed(IMPORT)
        answered, output = _timed(["-m", "helpers.memory", *COMMAND])
        if round_:  # the first round only warms the file cache
            seconds["import"].append(imported)
            seconds["command"].append(answered)
    return {"seconds": seconds, "output": output}


def ratios(result: dict) -> list[float]:
    """The command's time over the import's, per repetition."""
    return common.ratios(result["seconds"]["command"], result["seconds"]["import"])


def report(result: dict) -> list[str]:
    seconds = result["seconds"]
    return [f"python -m helpers.memory {' '.join(COMMAND)}", result["output"].rstrip(),
            f"command: median {common.median(seconds['command']):.1f} s; import of torch and transformers' BertModel: "
            f"median {common.median(seconds['import']):.1f} s; ratio {common.median(ratios(result)):.2f}x "
            f"({common.spread(ratios(result))}; target <= {TARGET:.1f}x)"]
