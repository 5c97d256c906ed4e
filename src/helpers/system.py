"""What this machine offers the series: library versions, CPUs, GPUs, and whether NVML answers."""

from __future__ import annotations

import os
import platform
from importlib.metadata import version

import torch

LIBRARIES = ("torch", "transformers", "tokenizers", "fugashi", "unidic-lite", "ipadic", "nvidia-ml-py")


def library_versions() -> dict[str, str]:
    """Python and the versions of the libraries the series depends on."""
    return {"python": platform.python_version()} | {name: version(name) for name in LIBRARIES}


def nvml_status() -> str:
    """'available (driver X, N GPUs)' or 'unavailable (reason)': NVML is how we read per-GPU memory."""
    import pynvml

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as error:  # NVMLError_LibraryNotFound where no NVIDIA driver is installed
        return f"unavailable ({error})"
    try:
        return f"available (driver {pynvml.nvmlSystemGetDriverVersion()}, {pynvml.nvmlDeviceGetCount()} GPUs)"
    finally:
        pynvml.nvmlShutdown()


def device_summary() -> dict[str, object]:
    """CPU cores, the CUDA devices torch sees (by name), and NVML's status."""
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return {
        "cpu_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda_available": torch.cuda.is_available(),
        "cuda_devices": gpus,
        "nvml": nvml_status(),
    }
