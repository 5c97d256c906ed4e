"""What a CUDA GPU holds besides the step's tensors, and which attention kernel it picks: facts read in PyTorch's
source, written as a table of GPUs and pure functions of a GPU and the environment (no torch, no CUDA), so that a
prediction can include them on any machine. ``helpers.memory.cuda_step.this_gpu`` asks a real GPU the same.

Sources (C++, not part of the installed wheel; read on github.com/pytorch/pytorch, commit named per fact):

- aten/src/ATen/cuda/CublasHandlePool.cpp (commit 26a3905): ``parseChosenWorkspaceSize``,
  ``parseCUDABlasLtWorkspaceSize``, ``getCUDABlasLtWorkspaceSize``, ``setWorkspaceForHandle``,
  ``getCUDABlasLtWorkspace``: one cuBLAS workspace per (handle, stream) and one cuBLASLt workspace per
  (handle, stream), both taken from the caching allocator (so ``memory_allocated`` counts them) and kept.
  Handles are per thread: the thread that runs forward and autograd's device thread each get one.
- aten/src/ATen/native/cuda/Reduce.cuh (``setReduceConfig``, ``ReduceConfig::global_memory_size``,
  ``gpu_reduce_kernel``): a sum over the rows of an (N, C) tensor splits each column over several blocks when N
  is large, and the blocks meet in a staging buffer taken from the caching allocator for the kernel's duration.
- aten/src/ATen/native/transformers/cuda/sdp_utils.cpp (commit 001f694): which fused attention kernel
  ``scaled_dot_product_attention`` may use (``check_flash_attention_hardware_support``: sm80 to sm121;
  ``check_prefer_cudnn_attention``: cuDNN first on sm90, sm100 and sm103 with cuDNN newer than 9.15 (CUDA 12
  wheels; any sm9x/sm10x with CUDA 13); fp16/bf16 only for flash and cuDNN).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

KIB, MIB, GIB = 2**10, 2**20, 2**30


@dataclass(frozen=True)
class GpuModel:
    """What the prediction needs to know about a GPU (``torch.cuda.get_device_properties`` gives the same)."""

    name: str
    capability: tuple[int, int]   # compute capability (major, minor)
    sm_count: int                 # multiProcessorCount
    max_threads_per_sm: int       # maxThreadsPerMultiProcessor
    memory: int                   # bytes, as sold (nvidia-smi shows a little less)
    kernels: tuple[str, str] | None = None  # the attention kernels (fp32, bf16) this GPU was seen to pick, if asked

    @property
    def sm(self) -> str:
        return f"sm{self.capability[0]}{self.capability[1]}"


# One row per GPU model. NVIDIA's published figures (SM counts from each product's datasheet; threads per SM from the CUDA C++
# Programming Guide's table of compute capabilities). Memory as sold: GB = 10^9 bytes.
GPUS = {gpu.name: gpu for gpu in (
    GpuModel("H200", (9, 0), 132, 2048, 141 * 10**9),     # the GPU of the recorded run (gpu-runs/2026-12-04-h200)
    GpuModel("H100", (9, 0), 132, 2048, 80 * 10**9),      # SXM5
    GpuModel("A100-80GB", (8, 0), 108, 2048, 80 * 10**9),
    GpuModel("A100-40GB", (8, 0), 108, 2048, 40 * 10**9),
    GpuModel("L4", (8, 9), 58, 1536, 24 * 10**9),
    GpuModel("RTX4090", (8, 9), 128, 1536, 24 * 10**9),
    GpuModel("A10", (8, 6), 72, 1536, 24 * 10**9),
    GpuModel("V100", (7, 0), 80, 2048, 16 * 10**9),
    GpuModel("T4", (7, 5), 40, 1024, 16 * 10**9),
)}


# --- cuBLAS and cuBLASLt workspaces ------------------------------------------------------------------------------

def cublas_workspace_size(capability: tuple[int, int], environ: dict[str, str]) -> int:
    """Bytes of one cuBLAS workspace (``parseChosenWorkspaceSize``).

    ``CUBLAS_WORKSPACE_CONFIG=:SIZE:COUNT[:SIZE:COUNT...]`` gives the sum of SIZE KiB x COUNT (``--deterministic``
    sets ``:4096:8``); a value without any ``:SIZE:COUNT`` is ignored (with a warning) like an unset one. Default:
    4096 KiB x 8 = 32 MiB on sm90 (exactly 9.0), else 4096 KiB x 2 + 16 KiB x 8.
    """
    pairs = re.findall(r":([0-9]+):([0-9]+)", environ.get("CUBLAS_WORKSPACE_CONFIG", ""))
    if pairs:
        return sum(int(size) * KIB * int(count) for size, count in pairs)
    return 4096 * KIB * 8 if tuple(capability) == (9, 0) else 4096 * KIB * 2 + 16 * KIB * 8


def cublaslt_workspace_size(capability: tuple[int, int], environ: dict[str, str]) -> int:
    """Bytes of one cuBLASLt workspace (``getCUDABlasLtWorkspaceSize``): ``CUBLASLT_WORKSPACE_SIZE`` KiB, default
    1024, never more than the cuBLAS workspace; 0 when ``TORCH_CUBLASLT_UNIFIED_WORKSPACE=1`` makes cuBLASLt use the
    cuBLAS workspace itself (``getCUDABlasLtWorkspace``)."""
    if environ.get("TORCH_CUBLASLT_UNIFIED_WORKSPACE", "").lower() in ("1", "true", "on", "yes", "y"):
        return 0
    value = environ.get("CUBLASLT_WORKSPACE_SIZE", "")
    size = int(value) * KIB if value.strip().isdigit() else 1024 * KIB  # anything else: warned about, default
    return min(size, cublas_workspace_size(capability, environ))


def workspaces(capability: tuple[int, int], environ: dict[str, str], deterministic: bool = False) -> dict[str, int]:
    """The workspaces a training step leaves allocated, by name, in bytes.

    Two cuBLAS workspaces: the forward's thread and autograd's device thread each hold a handle on the current
    stream. One cuBLASLt workspace: the forward's linear layers with a bias run as cuBLASLt GEMMs with the bias
    fused (``addmm``), the backward's matrix products as plain cuBLAS GEMMs. This is what the H200 snapshot
    shows (2 x 32 MiB + 1 MiB). ``deterministic`` is what ``--deterministic`` sets: ``CUBLAS_WORKSPACE_CONFIG``
    ``:4096:8`` unless it is set already.
    """
    if deterministic:
        environ = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"} | dict(environ)
    return {"cuBLAS (forward thread)": cublas_workspace_size(capability, environ),
            "cuBLAS (autograd thread)": cublas_workspace_size(capability, environ),
            "cuBLASLt (forward thread)": cublaslt_workspace_size(capability, environ)}


# --- the reduction kernel's staging buffer ----------------------------------------------------------------------

def _last_pow2(n: int) -> int:
    return max(1, 1 << (n.bit_length() - 1))


def reduce_buffers(rows: int, columns: int, gpu: GpuModel, *, accumulate_bytes: int = 4,
                   max_threads: int = 512) -> tuple[int, int]:
    """Bytes of the staging buffer and of the semaphores (one int per block column) that ``gpu_reduce_kernel``
    takes to sum a contiguous (rows, columns) tensor over its rows (a bias gradient); (0, 0) when it needs none.
    This follows ``setReduceConfig`` for that case.

    The columns are the fastest dimension, so threads of a warp take neighbouring columns, four at a time
    ("vectorize along output", when ``columns`` is a multiple of 4); warps split the rows. When each thread
    would still sum 256 values or more, the rows are split over ``ctas_per_output`` blocks as well, and the
    blocks add up their partial sums through a buffer of ``accumulate_bytes`` (fp32 for fp32 and bf16 inputs)
    per column, per block, per thread of a warp row. The number of blocks is bounded by what fills the GPU
    (SMs x blocks per SM), so the buffer stops growing with ``rows`` on large batches.
    """
    vector = 4 if columns % 4 == 0 else 2 if columns % 2 == 0 else 1
    dim0, dim1 = columns // vector, rows
    threads = max_threads // vector
    width = min(_last_pow2(dim0) if dim0 < threads else threads, 32)
    height = min(_last_pow2(dim1) if dim1 < threads else threads, threads // width)
    width = min(_last_pow2(dim0) if dim0 < threads else threads, threads // height)
    step_output, step_input = width, 1
    if -(-rows // step_input) >= min(height * 16, 256):   # split the rows across warps
        step_input *= height
    else:
        return 0, 0
    grid = -(-(columns // vector) // step_output)
    values_per_thread = -(-rows // step_input)
    target_grid = gpu.sm_count * (gpu.max_threads_per_sm // (width * height))
    if values_per_thread < 256 or grid > target_grid:
        return 0, 0
    ctas = max(min(-(-target_grid // grid), -(-values_per_thread // 16)), -(-values_per_thread // 256))
    if ctas <= 1:
        return 0, 0
    return accumulate_bytes * columns * ctas * width * vector, 4 * grid


# --- attention kernels ----------------------------------------------------------------------------------------

FLASH_CAPABILITIES = ((8, 0), (12, 1))             # check_flash_attention_hardware_support: [sm80, sm121]
MEMORY_EFFICIENT_CAPABILITIES = ((5, 0), (12, 1))  # check_mem_efficient_hardware_support: [sm50, sm121]
CUDNN_FIRST = ((9, 0), (10, 0), (10, 3))           # check_prefer_cudnn_attention, CUDA 12 wheels


def sdpa_kernel(capability: tuple[int, int], half: bool, masked: bool = False) -> str:
    """The kernel ``scaled_dot_product_attention`` picks for BERT's training call (head size 64, dropout) on a GPU
    of this compute capability: ``half`` for fp16/bf16 inputs (autocast), ``masked`` with a padding mask.

    Flash and cuDNN attention take fp16/bf16 only, and no arbitrary mask. Where PyTorch prefers cuDNN
    (``CUDNN_FIRST``) it comes first; else flash, on ``FLASH_CAPABILITIES``; else the memory-efficient kernel,
    on ``MEMORY_EFFICIENT_CAPABILITIES``; else the math kernel, which keeps the L x L probabilities (read in
    sdp_utils.cpp, priority order; measured on the H200 with torch 2.11: fp32 memory-efficient, bf16 cuDNN). On a
    GPU, ``helpers.memory.cuda_step.gpu_sdpa_kernel`` asks torch instead.
    """
    capability = tuple(capability)
    if half and not masked:
        if capability in CUDNN_FIRST:
            return "cuDNN"
        if FLASH_CAPABILITIES[0] <= capability <= FLASH_CAPABILITIES[1]:
            return "flash"
    if MEMORY_EFFICIENT_CAPABILITIES[0] <= capability <= MEMORY_EFFICIENT_CAPABILITIES[1]:
        return "memory-efficient"
    return "math"


def attention_kernel(gpu: GpuModel, half: bool, masked: bool = False) -> str:
    """The kernel ``gpu`` runs BERT's attention with: what it was seen to pick where it was asked (an unmasked
    batch), else ``sdpa_kernel`` by its compute capability."""
    if gpu.kernels and not masked:
        return gpu.kernels[half]
    return sdpa_kernel(gpu.capability, half, masked)


MEMORY_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*(GiB|GB|MiB|MB|G|M)?\s*$", re.IGNORECASE)
UNITS = {"gib": GIB, "g": GIB, "gb": 10**9, "mib": MIB, "m": MIB, "mb": 10**6}


def parse_memory(text: str) -> int:
    """Bytes of a memory size as people write it: ``16GiB``, ``24GB`` (10^9 bytes), ``40960MiB``, ``80`` (GiB)."""
    match = MEMORY_SIZE.match(text)
    if not match:
        raise ValueError(f"cannot read {text!r} as a memory size: write e.g. 16GiB, 24GB or 40960MiB")
    number, unit = match.groups()
    return int(float(number) * UNITS[(unit or "GiB").lower()])
