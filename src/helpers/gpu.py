"""Per-GPU memory as the driver sees it (NVML, what nvidia-smi shows) and as PyTorch sees it.

``python -m helpers.gpu`` prints a table once, ``--watch SECONDS`` refreshes it, ``--json`` prints it for
programs. Without an NVIDIA driver it prints one line with NVML's reason and exits 0.

NVML numbers GPUs in PCI order and ignores ``CUDA_VISIBLE_DEVICES``; CUDA numbers only the visible GPUs
(fastest first unless ``CUDA_DEVICE_ORDER=PCI_BUS_ID``). Rows are matched to CUDA device numbers by UUID.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from dataclasses import asdict, dataclass, field

MIB = 2**20


class NvmlUnavailable(RuntimeError):
    """NVML cannot answer on this machine; the message is NVML's own reason (e.g. no driver)."""


@dataclass
class GpuProcess:
    pid: int
    name: str | None
    used: int | None  # bytes; NVML answers None where it cannot tell (WDDM, WSL2, some containers)


@dataclass
class GpuRow:
    index: int              # NVML's number (PCI order)
    cuda_index: int | None  # torch's number for the same GPU, None if this process cannot see it
    name: str
    uuid: str
    pci_bus_id: str
    used: int
    total: int
    free: int
    utilization: int | None  # percent of time a kernel ran over the last sample period
    processes: list[GpuProcess] = field(default_factory=list)


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _normalize_uuid(uuid: str) -> str:
    """NVML says 'GPU-8f3a...', torch says '8f3a...'; compare the hexadecimal part."""
    uuid = uuid.lower()
    for prefix in ("gpu-", "mig-"):
        uuid = uuid.removeprefix(prefix)
    return uuid


def cuda_uuids() -> list[str]:
    """UUIDs of the GPUs this process sees, in torch's numbering (respects CUDA_VISIBLE_DEVICES)."""
    import torch

    return [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]


def map_cuda_to_nvml(cuda: list[str], nvml: list[str]) -> dict[int, int]:
    """{CUDA index: NVML index} for every visible GPU, matched by UUID."""
    by_uuid = {_normalize_uuid(uuid): index for index, uuid in enumerate(nvml)}
    return {cuda_index: by_uuid[_normalize_uuid(uuid)] for cuda_index, uuid in enumerate(cuda)
            if _normalize_uuid(uuid) in by_uuid}


def _memory(nvml, handle):
    """v2 memory info where the driver has it (used excludes driver-reserved memory, as nvidia-smi shows); a
    driver without ``nvmlDeviceGetMemoryInfo_v2`` answers NVMLError (Function Not Found), and then v1."""
    try:
        return nvml.nvmlDeviceGetMemoryInfo(handle, version=nvml.nvmlMemory_v2)
    except nvml.NVMLError:
        return nvml.nvmlDeviceGetMemoryInfo(handle)


def _processes(nvml, handle) -> list[GpuProcess]:
    try:
        running = nvml.nvmlDeviceGetComputeRunningProcesses(handle)
    except nvml.NVMLError:
        return []
    processes = []
    for process in running:
        try:
            name = _text(nvml.nvmlSystemGetProcessName(process.pid))
        except nvml.NVMLError:
            name = None
        processes.append(GpuProcess(process.pid, name, process.usedGpuMemory))
    return processes


def nvml_snapshot(nvml=None, cuda: list[str] | None = None) -> list[GpuRow]:
    """One row per GPU from NVML. ``nvml`` is the ``pynvml`` module (or an object with its functions);
    ``cuda`` the UUIDs torch sees, in its order. Raises ``NvmlUnavailable`` with NVML's reason."""
    if nvml is None:
        import pynvml as nvml
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as error:
        raise NvmlUnavailable(str(error)) from error
    try:
        handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
        uuids = [_text(nvml.nvmlDeviceGetUUID(handle)) for handle in handles]
        nvml_to_cuda = {v: k for k, v in map_cuda_to_nvml(cuda_uuids() if cuda is None else cuda, uuids).items()}
        rows = []
        for index, handle in enumerate(handles):
            memory = _memory(nvml, handle)
            try:
                utilization = nvml.nvmlDeviceGetUtilizationRates(handle).gpu
            except nvml.NVMLError:
                utilization = None
            rows.append(GpuRow(index, nvml_to_cuda.get(index), _text(nvml.nvmlDeviceGetName(handle)), uuids[index],
                               _text(nvml.nvmlDeviceGetPciInfo(handle).busId), memory.used, memory.total,
                               memory.free, utilization, _processes(nvml, handle)))
        return rows
    finally:
        nvml.nvmlShutdown()


def torch_memory() -> list[dict[str, int]]:
    """PyTorch's own view per CUDA device: bytes in live tensors, bytes its caching allocator holds, and
    the peak of the first since the last reset. nvidia-smi shows reserved + the CUDA context (a few
    hundred MiB) + every other process on that GPU."""
    import torch

    return [{"cuda_index": i, "allocated": torch.cuda.memory_allocated(i), "reserved": torch.cuda.memory_reserved(i),
             "peak_allocated": torch.cuda.max_memory_allocated(i)} for i in range(torch.cuda.device_count())]


def _mib(nbytes: int | None) -> str:
    return "n/a" if nbytes is None else f"{nbytes / MIB:,.0f} MiB"


def format_table(rows: list[GpuRow], torch_rows: list[dict[str, int]] = ()) -> str:
    """An nvidia-smi-like table: one line per GPU, its processes under it, then PyTorch's view."""
    lines = [f"{'nvml':>4} {'cuda':>4}  {'name':<28}{'used':>12}{'total':>12}{'util':>6}"]
    for row in rows:
        cuda = "-" if row.cuda_index is None else str(row.cuda_index)
        util = "n/a" if row.utilization is None else f"{row.utilization}%"
        lines.append(f"{row.index:>4} {cuda:>4}  {row.name[:27]:<28}{_mib(row.used):>12}{_mib(row.total):>12}{util:>6}")
        for process in row.processes:
            lines.append(f"{'':>11}pid {process.pid:<8} {(process.name or 'n/a')[-30:]:<31}{_mib(process.used):>12}")
    if torch_rows:
        lines.append(f"this process (torch): {'cuda':>4}{'allocated':>14}{'reserved':>14}{'peak':>14}")
        for stats in torch_rows:
            lines.append(f"{'':>22}{stats['cuda_index']:>4}{_mib(stats['allocated']):>14}"
                         f"{_mib(stats['reserved']):>14}{_mib(stats['peak_allocated']):>14}")
    return "\n".join(lines)


def snapshot_json(rows: list[GpuRow], torch_rows: list[dict[str, int]] = ()) -> str:
    """The same as JSON: {"gpus": [...], "torch": [...]}, bytes as integers, unknown values as null."""
    return json.dumps({"gpus": [asdict(row) for row in rows], "torch": list(torch_rows)}, indent=2)


class PeakSampler:
    """Record each GPU's highest memory use while a block runs, from a background thread.

    ``read`` returns {GPU label: bytes}; by default NVML's used memory per CUDA device, what nvidia-smi
    shows. Use it around ``fit``::

        with PeakSampler() as sampler:
            fit(...)
        sampler.peaks  # {0: ..., 1: ...}
    """

    def __init__(self, read=None, interval: float = 0.05):
        self.read = read or nvml_used_by_cuda_index
        self.interval = interval
        self.peaks: dict = {}
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        for gpu, used in self.read().items():
            self.peaks[gpu] = max(used, self.peaks.get(gpu, 0))
        self.samples += 1

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def __enter__(self) -> PeakSampler:
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()


def nvml_used_by_cuda_index() -> dict[int, int]:
    """{CUDA index: NVML used bytes} for the GPUs this process sees."""
    return {row.cuda_index: row.used for row in nvml_snapshot() if row.cuda_index is not None}


def plot_peaks(peaks: dict, title: str = "peak memory per GPU"):
    """A bar per GPU, in GiB."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(4, 3))
    labels = [f"GPU {gpu}" for gpu in peaks]
    ax.bar(labels, [used / 2**30 for used in peaks.values()], color="tab:blue")
    ax.set_ylabel("GiB")
    ax.set_title(title)
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m helpers.gpu", description=__doc__.splitlines()[0])
    parser.add_argument("--watch", type=float, metavar="SECONDS", help="refresh every SECONDS until Ctrl-C")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    # PyTorch's per-process view (torch_memory) is left out here: this command's own process holds nothing.
    try:
        while True:
            try:
                rows = nvml_snapshot()
            except NvmlUnavailable as reason:
                message = f"NVML unavailable: {reason}"
                print(json.dumps({"error": message, "gpus": [], "torch": []}) if args.json else message)
                return 0
            if args.watch and not args.json:
                print("\033[2J\033[H", end="")  # clear the terminal, like watch(1)
            print(snapshot_json(rows) if args.json else format_table(rows), flush=True)
            if not args.watch:
                return 0
            time.sleep(args.watch)
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
