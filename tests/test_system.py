"""What the machine offers: versions, and NVML's answer with or without a driver."""

import platform
import re
from importlib.metadata import PackageNotFoundError
from pathlib import Path

import pynvml
import pytest
import torch
import transformers

from helpers.system import LIBRARIES, device_summary, japanese_fonts, library_versions, nvml_status, shows_japanese

REQUIREMENTS = Path(__file__).parents[1] / "requirements.txt"


def test_versions_are_the_imported_libraries_and_their_pins():
    """What the summary reports against what the libraries say of themselves and what requirements.txt pins."""
    versions = library_versions()
    pins = dict(re.findall(r"^([\w-]+)==(\S+)$", REQUIREMENTS.read_text(encoding="utf-8"), re.MULTILINE))
    assert list(versions) == ["python", *LIBRARIES]
    assert versions["python"] == platform.python_version()
    assert (versions["torch"], versions["transformers"]) == (torch.__version__, transformers.__version__)
    assert {name: versions[name].split("+")[0] for name in LIBRARIES} == {name: pins[name] for name in LIBRARIES}


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


def test_device_summary_describes_the_machine_it_is_given(monkeypatch):
    """A made-up machine (2 GPUs, 16 cores, 4 threads, NVML answering), and the summary written out by hand."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index: f"Fake GPU {index}")
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    monkeypatch.setattr("os.cpu_count", lambda: 16)
    for name, value in (("nvmlInit", None), ("nvmlShutdown", None), ("nvmlSystemGetDriverVersion", "580.65"),
                        ("nvmlDeviceGetCount", 2)):
        monkeypatch.setattr(pynvml, name, lambda value=value: value)
    assert device_summary() == {"cpu_cores": 16, "torch_threads": 4, "cuda_available": True,
                                "cuda_devices": ["Fake GPU 0", "Fake GPU 1"], "nvml": "available (driver 580.65, 2 GPUs)"}


def test_a_cpu_build_of_torch_sees_no_gpu_even_where_nvml_counts_two(monkeypatch):
    """The other side: the CPU wheel (no CUDA compiled in) lists no device, whatever the machine has; here the
    driver (NVML, made up) counts 2 GPUs and the summary still shows torch's own answer beside it."""
    if torch.version.cuda is not None:
        pytest.skip("this torch is a CUDA build")
    for name, value in (("nvmlInit", None), ("nvmlShutdown", None), ("nvmlSystemGetDriverVersion", "580.65"),
                        ("nvmlDeviceGetCount", 2)):
        monkeypatch.setattr(pynvml, name, lambda value=value: value)
    summary = device_summary()
    assert (summary["cuda_available"], summary["cuda_devices"]) == (False, [])
    assert summary["nvml"] == "available (driver 580.65, 2 GPUs)"


def test_a_latin_font_cannot_show_japanese(tmp_path):
    import matplotlib
    from pathlib import Path

    dejavu = Path(matplotlib.get_data_path()) / "fonts" / "ttf" / "DejaVuSans.ttf"  # ships with matplotlib
    assert dejavu.exists()
    assert shows_japanese(str(dejavu)) is False
    (tmp_path / "broken.ttf").write_bytes(b"not a font")
    assert shows_japanese(str(tmp_path / "broken.ttf")) is False


def font_with(tmp_path, name: str, characters: str) -> str:
    """A TrueType file named ``name`` whose character map holds exactly ``characters`` (and the Latin 'A')."""
    from fontTools.fontBuilder import FontBuilder
    from fontTools.pens.ttGlyphPen import TTGlyphPen

    glyphs = [".notdef", "A", *(f"uni{ord(char):04X}" for char in characters)]
    builder = FontBuilder(1000, isTTF=True)
    builder.setupGlyphOrder(glyphs)
    builder.setupCharacterMap({ord("A"): "A"} | {ord(char): f"uni{ord(char):04X}" for char in characters})
    pen = TTGlyphPen(None)
    pen.moveTo((0, 0)), pen.lineTo((0, 500)), pen.lineTo((500, 0)), pen.closePath()
    builder.setupGlyf({glyph: pen.glyph() for glyph in glyphs})
    builder.setupHorizontalMetrics({glyph: (500, 0) for glyph in glyphs})
    builder.setupHorizontalHeader(ascent=800, descent=-200)
    builder.setupNameTable({"familyName": name, "styleName": "Regular"})
    builder.setupOS2(), builder.setupPost()
    path = tmp_path / f"{name}.ttf"
    builder.save(str(path))
    return str(path)


def test_japanese_fonts_are_the_ones_with_all_three_glyphs(tmp_path, monkeypatch):
    """Fonts made here, so the answer is known: 日本語 all present, two of three, none, and a broken file."""
    from matplotlib import font_manager

    full = font_with(tmp_path, "HasAll", "日本語")
    fonts = [full, font_with(tmp_path, "HasTwo", "日本"), font_with(tmp_path, "LatinOnly", ""), str(tmp_path / "x.ttf")]
    (tmp_path / "x.ttf").write_bytes(b"not a font")
    monkeypatch.setattr(font_manager, "findSystemFonts", lambda: fonts)
    registered = []  # what it registers with matplotlib, kept out of this session's font list
    monkeypatch.setattr(font_manager.fontManager, "addfont", registered.append)
    assert japanese_fonts() == {"HasAll": full}
    assert registered == [full]
    monkeypatch.setattr(font_manager, "findSystemFonts", lambda: [])
    assert japanese_fonts() == {}
