"""What every benchmark shares: medians and spreads of repeated timings, and a description of the machine."""

from __future__ import annotations

import os
import platform
import socket
import statistics
import time
from contextlib import contextmanager

# Progress bars and hub look-ups would only add noise to the timings.
os.environ.setdefault("TQDM_DISABLE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def free_port() -> int:
    """A loopback port no one listens on now, for a benchmark's own process group."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def ratios(numerators: list[float], denominators: list[float]) -> list[float]:
    """One ratio per repetition: the sides of a repetition ran side by side, under the same load."""
    return [a / b for a, b in zip(numerators, denominators, strict=True)]


def spread(values: list[float], unit: str = "×", digits: int = 2) -> str:
    """'min–max over N repeats', the honest companion of a median."""
    return f"{min(values):.{digits}f}–{max(values):.{digits}f}{unit} over {len(values)} repeats"


def load_average() -> str:
    """The 1, 5 and 15 minute load averages: on 2 cores, anything near 2 or above means the timings were shared."""
    return ", ".join(f"{value:.1f}" for value in os.getloadavg())


def machine(torch_threads: bool = True) -> str:
    """CPU model, cores this process may use, versions, and the load when the run started."""
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            cpu = next(line.split(":", 1)[1].strip() for line in info if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    threads = f", {torch.get_num_threads()} torch threads" if torch_threads else ""
    return (f"{cpu}, {cores} cores{threads}, Python {platform.python_version()}, torch {torch.__version__}; "
            f"load average at start {load_average()}")
