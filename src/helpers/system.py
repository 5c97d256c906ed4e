"""What this machine offers the series: library versions, CPUs, GPUs, whether NVML answers, Japanese fonts."""

from __future__ import annotations

import os
import platform
from importlib.metadata import PackageNotFoundError, version

import torch

LIBRARIES = ("torch", "transformers", "tokenizers", "fugashi", "unidic-lite", "ipadic", "nvidia-ml-py")


def library_versions() -> dict[str, str]:
    """Python and the versions of the libraries the series depends on; "no package metadata" for a library pip
    does not know (missing, or its files copied in without the package's metadata), so the check itself never stops."""
    return {"python": platform.python_version()} | {name: installed_version(name) for name in LIBRARIES}


def installed_version(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "no package metadata"


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


def shows_japanese(path: str) -> bool:
    """Whether the font file has glyphs for all of 「日本語」 (a file FreeType cannot open counts as no)."""
    from matplotlib.ft2font import FT2Font

    try:
        font = FT2Font(path)
    except (OSError, RuntimeError):
        return False
    return all(font.get_char_index(ord(char)) for char in "日本語")


def japanese_fonts() -> dict[str, str]:
    """The installed fonts that can show Japanese, name: file, registered with matplotlib so charts can use them.

    The system's fonts are scanned at each call, so a font installed after matplotlib built its cache counts.
    """
    from matplotlib import font_manager

    found = {}
    for path in sorted(font_manager.findSystemFonts()):
        if shows_japanese(path):
            font_manager.fontManager.addfont(path)
            found.setdefault(font_manager.FontProperties(fname=path).get_name(), path)
    return found
