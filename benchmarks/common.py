"""What every benchmark shares: medians of repeated timings, and a description of the machine."""

from __future__ import annotations

import os
import platform
import statistics
import time
from contextlib import contextmanager

# Progress bars and hub look-ups would only add noise to the timings.
os.environ.setdefault("TQDM_DISABLE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


@contextmanager
def stopwatch(times: list[float]):
    """Append the wall time of the ``with`` block to ``times``."""
    start = time.perf_counter()
    yield
    times.append(time.perf_counter() - start)


def set_threads(threads: int | None) -> None:
    """Pin torch's intra-op threads; on a machine shared with other jobs, 1 avoids threads waiting for each other."""
    if threads:
        import torch

        torch.set_num_threads(threads)


def median(values: list[float]) -> float:
    return statistics.median(values)


def machine() -> str:
    """CPU model, cores this process may use, versions, and the load when the run started."""
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            cpu = next(line.split(":", 1)[1].strip() for line in info if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    load = ", ".join(f"{value:.1f}" for value in os.getloadavg())
    return (f"{cpu}, {cores} cores, {torch.get_num_threads()} torch threads, Python {platform.python_version()}, "
            f"torch {torch.__version__}; load average at start {load}")
