"""What the machine offers: versions, and NVML's answer with or without a driver."""

import pynvml
import torch

from helpers.system import device_summary, library_versions, nvml_status


def test_versions_name_the_series_libraries():
    versions = library_versions()
    assert {"python", "torch", "transformers", "fugashi", "unidic-lite", "ipadic", "nvidia-ml-py"} <= set(versions)
    assert versions["torch"].startswith("2.13.0")


def test_nvml_without_a_driver_says_why(monkeypatch):
    def no_library():
        raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    monkeypatch.setattr(pynvml, "nvmlInit", no_library)
    assert nvml_status() == "unavailable (NVML Shared Library Not Found)"


def test_nvml_with_a_driver_reports_it(monkeypatch):
    calls = []
    monkeypatch.setattr(pynvml, "nvmlInit", lambda: calls.append("init"))
    monkeypatch.setattr(pynvml, "nvmlShutdown", lambda: calls.append("shutdown"))
    monkeypatch.setattr(pynvml, "nvmlSystemGetDriverVersion", lambda: "580.65")
    monkeypatch.setattr(pynvml, "nvmlDeviceGetCount", lambda: 2)
    assert nvml_status() == "available (driver 580.65, 2 GPUs)"
    assert calls == ["init", "shutdown"]


def test_device_summary_matches_torch():
    summary = device_summary()
    assert summary["cuda_available"] == torch.cuda.is_available()
    assert len(summary["cuda_devices"]) == torch.cuda.device_count()
