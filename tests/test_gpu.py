"""helpers.gpu: the command without a driver (for real, here), and the NVML logic through a small stand-in
for the pynvml module (the same functions, answering like a two-GPU machine)."""

import json
import subprocess
import sys
import threading
from types import SimpleNamespace

import pytest

from helpers.gpu import (NvmlUnavailable, PeakSampler, format_table, map_cuda_to_nvml, nvml_snapshot,
                         snapshot_json)

GIB = 2**30


class FakeNvml:
    """Answers like pynvml on a machine with two GPUs (PCI order A, B); process memory may be unknown."""

    class NVMLError(Exception):
        pass

    nvmlMemory_v2 = 0x02000028

    def __init__(self, v2: bool = True, fail_init: str | None = None):
        self.v2, self.fail_init, self.initialised = v2, fail_init, False
        self.gpus = [
            dict(uuid="GPU-aaaa0000-0000-0000-0000-000000000000", bus="00000000:17:00.0", name="GPU A",
                 used=39057 * 2**20, procs=[SimpleNamespace(pid=101, usedGpuMemory=None)]),
            dict(uuid="GPU-bbbb0000-0000-0000-0000-000000000000", bus="00000000:65:00.0", name="GPU B",
                 used=23485 * 2**20, procs=[SimpleNamespace(pid=202, usedGpuMemory=3 * GIB)]),
        ]

    def nvmlInit(self):
        if self.fail_init:
            raise self.NVMLError(self.fail_init)
        self.initialised = True

    def nvmlShutdown(self):
        self.initialised = False

    def nvmlDeviceGetCount(self):
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index):
        return self.gpus[index]

    def nvmlDeviceGetUUID(self, handle):
        return handle["uuid"]

    def nvmlDeviceGetName(self, handle):
        return handle["name"].encode()  # older pynvml versions answer bytes

    def nvmlDeviceGetPciInfo(self, handle):
        return SimpleNamespace(busId=handle["bus"])

    def nvmlDeviceGetMemoryInfo(self, handle, version=None):
        if version is not None and not self.v2:
            raise self.NVMLError("Function Not Found")
        reserved = 0 if version else 300 * 2**20  # v1 counts driver-reserved memory as used
        return SimpleNamespace(used=handle["used"] + reserved, total=80 * GIB, free=80 * GIB - handle["used"])

    def nvmlDeviceGetUtilizationRates(self, handle):
        return SimpleNamespace(gpu=97)

    def nvmlDeviceGetComputeRunningProcesses(self, handle):
        return handle["procs"]

    def nvmlSystemGetProcessName(self, pid):
        if pid == 202:
            raise self.NVMLError("No Permission")
        return b"python"


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "helpers.gpu", *args], capture_output=True, text=True, timeout=60)


def test_command_without_a_driver_says_why_in_one_line_and_exits_0():
    pytest.importorskip("pynvml")
    import pynvml

    try:
        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        pytest.skip("this machine has an NVIDIA driver")
    except pynvml.NVMLError:
        pass
    for args in ((), ("--watch", "0.1")):
        result = run_cli(*args)
        assert result.returncode == 0 and result.stderr == ""
        assert result.stdout.startswith("NVML unavailable: ") and result.stdout.count("\n") == 1
    data = json.loads(run_cli("--json").stdout)
    assert data["gpus"] == [] and data["error"].startswith("NVML unavailable: ")


def test_init_failure_becomes_nvml_unavailable_with_nvmls_reason():
    with pytest.raises(NvmlUnavailable, match="Driver Not Loaded"):
        nvml_snapshot(FakeNvml(fail_init="Driver Not Loaded"), cuda=[])


def test_cuda_numbers_follow_cuda_visible_devices_by_uuid():
    nvml = ["GPU-aaaa0000-0000-0000-0000-000000000000", "GPU-bbbb0000-0000-0000-0000-000000000000"]
    # CUDA_VISIBLE_DEVICES=1,0: torch's GPU 0 is NVML's GPU 1; torch prints UUIDs without the 'GPU-' prefix
    assert map_cuda_to_nvml([nvml[1][4:], nvml[0][4:]], nvml) == {0: 1, 1: 0}
    assert map_cuda_to_nvml([nvml[1][4:]], nvml) == {0: 1}  # CUDA_VISIBLE_DEVICES=1


def test_snapshot_reads_v2_memory_processes_and_the_cuda_number():
    fake = FakeNvml()
    rows = nvml_snapshot(fake, cuda=["bbbb0000-0000-0000-0000-000000000000"])
    assert not fake.initialised  # shut down again
    assert [(row.index, row.cuda_index, row.name) for row in rows] == [(0, None, "GPU A"), (1, 0, "GPU B")]
    assert rows[0].used == 39057 * 2**20  # v2: without the driver-reserved part
    assert rows[0].processes[0].used is None and rows[1].processes[0].name is None
    assert nvml_snapshot(FakeNvml(v2=False), cuda=[])[0].used == (39057 + 300) * 2**20


def test_table_shows_na_for_unknown_process_memory():
    table = format_table(nvml_snapshot(FakeNvml(), cuda=[]))
    assert "39,057 MiB" in table and "23,485 MiB" in table
    line = next(line for line in table.splitlines() if "pid 101" in line)
    assert line.rstrip().endswith("n/a")
    assert "3,072 MiB" in next(line for line in table.splitlines() if "pid 202" in line)


def test_json_has_one_entry_per_gpu_with_integers_and_nulls():
    data = json.loads(snapshot_json(nvml_snapshot(FakeNvml(), cuda=["aaaa0000-0000-0000-0000-000000000000"]),
                                    [{"cuda_index": 0, "allocated": 1, "reserved": 2, "peak_allocated": 3}]))
    assert [gpu["cuda_index"] for gpu in data["gpus"]] == [0, None]
    assert set(data["gpus"][0]) == {"index", "cuda_index", "name", "uuid", "pci_bus_id", "used", "total", "free",
                                    "utilization", "processes"}
    assert data["gpus"][0]["processes"] == [{"pid": 101, "name": "python", "used": None}]
    assert data["torch"][0]["reserved"] == 2


def test_peak_sampler_keeps_the_highest_reading_and_stops_its_thread():
    readings = iter([{0: 5, 1: 1}, {0: 9, 1: 2}] + [{0: 7, 1: 3}] * 10_000)
    seen_twice = threading.Event()

    def read():
        value = next(readings)
        if value[0] == 7:
            seen_twice.set()
        return value

    with PeakSampler(read, interval=0.001) as sampler:
        assert sampler._thread.is_alive()
        assert seen_twice.wait(10)
    assert not sampler._thread.is_alive()
    assert sampler.peaks == {0: 9, 1: 3} and sampler.samples >= 3


def test_gpu_check_without_cuda_says_so_in_one_line_and_exits_0():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA; make gpu-check runs the real check")
    result = subprocess.run([sys.executable, "-m", "helpers.checks.gpu_check"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stderr == ""
    assert result.stdout == "gpu-check: skipped, no CUDA device on this machine (nothing to check here)\n"
