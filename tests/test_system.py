"""What the machine offers: versions, and NVML's answer with or without a driver."""

from importlib.metadata import PackageNotFoundError

import pynvml
import torch

from helpers.system import device_summary, japanese_fonts, library_versions, nvml_status, shows_japanese


def test_versions_name_the_series_libraries():
    versions = library_versions()
    assert {"python", "torch", "transformers", "fugashi", "unidic-lite", "ipadic", "nvidia-ml-py"} <= set(versions)
    assert versions["torch"].startswith("2.13.0")


def test_a_library_without_package_metadata_is_reported_not_raised(monkeypatch):
    import helpers.system

    def version(name):
        if name == "unidic-lite":
            raise PackageNotFoundError(name)
        return "1.0"

    monkeypatch.setattr(helpers.system, "version", version)
    versions = library_versions()
    assert versions["unidic-lite"] == "no package metadata" and versions["torch"] == "1.0"


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


def test_a_latin_font_cannot_show_japanese(tmp_path):
    import matplotlib
    from pathlib import Path

    dejavu = Path(matplotlib.get_data_path()) / "fonts" / "ttf" / "DejaVuSans.ttf"  # ships with matplotlib
    assert dejavu.exists()
    assert shows_japanese(str(dejavu)) is False
    (tmp_path / "broken.ttf").write_bytes(b"not a font")
    assert shows_japanese(str(tmp_path / "broken.ttf")) is False


def test_japanese_fonts_are_the_ones_with_the_glyphs(monkeypatch):
    from matplotlib import font_manager

    found = japanese_fonts()
    assert all(shows_japanese(path) for path in found.values())
    monkeypatch.setattr(font_manager, "findSystemFonts", lambda: [])
    assert japanese_fonts() == {}
