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
- aten/src/ATen/native/transformers/cuda/sdp_utils.cpp (commit 001f694) and aten/src/ATen/Context.h: which
  kernel ``scaled_dot_product_attention`` picks (``sdpa_kernel`` below names the functions, one rule each).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

KIB, MIB, GIB = 2**10, 2**20, 2**30


@dataclass(frozen=True)
class GpuModel:
    """What the prediction needs to know about a GPU (``torch.cuda.get_device_properties`` gives the same).

    ``memory`` is the total the device reports (``total_memory``, what ``torch.cuda.mem_get_info`` gives as total
    and nvidia-smi as its total), not the size it is sold as: the most a process can reserve. Where published
    figures of one model differ (ECC on or off, driver), ``memory`` is the smallest and ``memory_high`` the largest;
    ``memory_source`` says where the figures come from."""

    name: str
    capability: tuple[int, int]   # compute capability (major, minor)
    sm_count: int                 # multiProcessorCount
    max_threads_per_sm: int       # maxThreadsPerMultiProcessor
    memory: int                   # bytes: the total the device reports (the smallest published one, see above)
    kernels: tuple[tuple[str, str], ...] | None = None  # (precision, attention kernel) pairs this GPU was seen to
    #                                                     pick, where it was asked (``cuda_step.this_gpu``)
    memory_high: int | None = None  # bytes: the largest published total, where published totals differ
    memory_source: str = "this GPU: torch.cuda.get_device_properties(i).total_memory"

    @property
    def sm(self) -> str:
        return f"sm{self.capability[0]}{self.capability[1]}"

    @property
    def capacity(self) -> tuple[int, int]:
        """(smallest, largest) total in bytes: one figure twice where it is known exactly."""
        return self.memory, self.memory_high or self.memory

    @property
    def native_bf16(self) -> bool:
        """Whether the GPU computes bf16 itself (compute capability 8.0 or later), which is what
        ``torch.cuda.is_bf16_supported(including_emulation=False)`` asks and ``helpers.finetune --amp bf16`` needs.
        The T4 (sm75) and the V100 (sm70) have fp16 tensor cores and no bf16."""
        return tuple(self.capability) >= (8, 0)


def _gib(text: str, edge: float) -> int:
    """Bytes at one edge of a total printed rounded to 0.01 GiB (torch's OutOfMemoryError message): ``edge`` -1
    for the smallest value that prints so, +1 for the largest."""
    return int((float(text) + edge * 0.005) * GIB)


# One row per GPU model. Compute capability, SM count (each product's datasheet) and threads per SM (the CUDA C++
# Programming Guide's table of compute capabilities) are NVIDIA's. Memory: the total the device reports, from a
# recorded run or a published nvidia-smi / torch figure, the source named in each row; MODAL is the list of
# nvidia-smi totals in github.com/modal-labs/modal-client/pull/2797 (2025-01-23). Not here: AWS's A10G, whose SM
# count and reported total were found published nowhere (on one, the command asks the GPU itself).
MODAL = "nvidia-smi total listed in github.com/modal-labs/modal-client/pull/2797"
GPUS = {gpu.name: gpu for gpu in (
    GpuModel("H200", (9, 0), 132, 2048, 143_771 * MIB,
             memory_source="nvidia-smi 143,771 MiB in the recorded run (gpu-runs/2026-12-04-h200/env.txt)"),
    GpuModel("H100", (9, 0), 132, 2048, 81_559 * MIB,  # SXM5 80GB
             memory_source=f"{MODAL}: 81,559 MiB (85,520,809,984 bytes)"),
    GpuModel("A100-80GB", (8, 0), 108, 2048, 81_251 * MIB, memory_high=81_920 * MIB,
             memory_source=f"nvidia-smi 81,251 MiB (A100-SXM4-80GB, driver 495; github.com/NVIDIA/mig-parted/"
                           f"issues/31); {MODAL}: 81,920 MiB"),
    GpuModel("A100-40GB", (8, 0), 108, 2048, 40_536 * MIB, memory_high=40_960 * MIB,
             memory_source=f"nvidia-smi 40,536 MiB (A100-SXM, driver 470; github.com/nanopool/phoenix-miner/"
                           f"issues/17); {MODAL}: 40,960 MiB"),
    GpuModel("L4", (8, 9), 58, 1536, 23_034 * MIB, memory_source=f"{MODAL}: 23,034 MiB"),
    GpuModel("RTX4090", (8, 9), 128, 1536, 24_564 * MIB,
             memory_source="nvidia-smi 24,564 MiB (driver 550; github.com/RLinf/RLinf/issues/255)"),
    GpuModel("A10", (8, 6), 72, 1536, 23_028 * MIB,
             memory_source=f"{MODAL}: 23,028 MiB; NVML total 24,146,608,128 bytes (github.com/mayooot/detect-gpu/"
                           f"issues/3)"),
    GpuModel("V100-16GB", (7, 0), 80, 2048, 16_160 * MIB,
             memory_source="nvidia-smi 16,160 MiB (V100-SXM2, driver 440; github.com/4paradigm/k8s-vgpu-scheduler/"
                           "issues/7)"),
    GpuModel("V100-32GB", (7, 0), 80, 2048, _gib("31.74", -1), memory_high=32_768 * MIB,
             memory_source="torch: '31.74 GiB total capacity' (github.com/liucongg/ChatGLM-Finetuning/issues/73); "
                           "nvidia-smi 32,768 MiB (V100-SXM2, driver 525; github.com/Wan-Video/Wan2.1/issues/5)"),
    GpuModel("T4", (7, 5), 40, 1024, _gib("14.56", -1), memory_high=15_360 * MIB,
             memory_source=f"torch on Colab: 'a total capacity of 14.56 GiB' (github.com/facebookresearch/tribev2/"
                           f"issues/28) and 14.75 GiB (github.com/yifanlu0227/MIT-6.5940/issues/1), ECC on; "
                           f"{MODAL}: 15,360 MiB"),
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


# --- mixed precision -------------------------------------------------------------------------------------------

PRECISIONS = ("fp32", "fp16", "bf16")
"""What a step computes its matrix products in: fp32, or autocast's fp16 or bf16 (``--amp`` of helpers.finetune)."""


def mixed_precision(gpu: GpuModel) -> tuple[str, str]:
    """The autocast type mixed precision uses on ``gpu``, and why, in words a notebook prints: bf16 where the GPU
    computes it, else fp16, which needs a gradient scaler (``--amp fp16`` of helpers.finetune)."""
    if gpu.native_bf16:
        return "bf16", f"{gpu.name} ({gpu.sm}) computes bf16 natively"
    return "fp16", (f"{gpu.name} ({gpu.sm}) has fp16 tensor cores and no native bf16, so fp16 autocast with a "
                    f"gradient scaler (--amp fp16)")


def bf16_refusal(gpu: GpuModel) -> str | None:
    """Why ``--amp bf16`` cannot run on ``gpu`` (as helpers.finetune refuses it there), naming ``--amp fp16``; None
    where it can."""
    if gpu.native_bf16:
        return None
    return (f"--amp bf16: {gpu.name} ({gpu.sm}) has no native bf16 (it needs compute capability 8.0 or later); use "
            f"--amp fp16 (fp16 autocast with a gradient scaler), or leave out --amp for fp32")


def amp_precision(gpu: GpuModel, amp: bool | str | None) -> str:
    """What ``amp`` means on ``gpu``, as one of PRECISIONS: None or False fp32; True the GPU's own mixed precision
    (``mixed_precision``); "bf16" or "fp16" that type, bf16 refused where the GPU lacks it (``bf16_refusal``)."""
    if amp is None or amp is False or amp == "fp32":
        return "fp32"
    if amp is True:
        return mixed_precision(gpu)[0]
    if amp not in PRECISIONS:
        raise ValueError(f"amp={amp!r}: expected None, True, 'bf16' or 'fp16'")
    if amp == "bf16" and not gpu.native_bf16:
        raise ValueError(bf16_refusal(gpu))
    return amp


# --- attention kernels ----------------------------------------------------------------------------------------

FLASH_CAPABILITIES = ((8, 0), (12, 1))             # check_flash_attention_hardware_support: [sm80, sm121]
CUDNN_CAPABILITIES = ((8, 0), (12, 1))             # check_cudnn_hardware_support: [sm80, sm121]
MEMORY_EFFICIENT_CAPABILITIES = ((5, 0), (12, 1))  # check_mem_efficient_hardware_support: [sm50, sm121]
CUDNN_FIRST = ((9, 0), (10, 0), (10, 3))           # check_prefer_cudnn_attention, CUDA 12 wheels
DEFAULT_ORDER = ("flash", "memory-efficient", "math", "cuDNN")  # Context.h, sdp_priority_order
CUDNN_ORDER = ("cuDNN", "flash", "memory-efficient", "math")    # priority_order, where cuDNN is preferred


def _within(capability: tuple[int, int], bounds: tuple[tuple[int, int], tuple[int, int]]) -> bool:
    return bounds[0] <= capability <= bounds[1]  # check_sm_version: inclusive at both ends


def _can_use(kernel: str, capability: tuple[int, int], precision: str, masked: bool) -> bool:
    """Whether ``kernel`` passes the checks of sdp_utils.cpp that depend on the GPU, the dtype and a mask (BERT's
    head size 64, dense tensors and dropout pass the others)."""
    sm80_or_later = capability >= (8, 0)
    if kernel in ("flash", "cuDNN"):
        # can_use_flash_attention, can_use_cudnn_attention: check_dtypes_low_precision takes fp16 and bf16 from
        # sm80 on and fp16 only below; check_for_attn_mask (flash) refuses a mask, and so does the cuDNN path here
        bounds = FLASH_CAPABILITIES if kernel == "flash" else CUDNN_CAPABILITIES
        dtypes = ("fp16", "bf16") if sm80_or_later else ("fp16",)
        return _within(capability, bounds) and precision in dtypes and not masked
    if kernel == "memory-efficient":
        # can_use_mem_efficient_attention: greater_than_or_equal_sm80_mem_efficient_dtypes (fp16, fp32, bf16),
        # less_than_sm80_mem_efficient_dtypes (fp16, fp32); masks are taken
        dtypes = PRECISIONS if sm80_or_later else ("fp32", "fp16")
        return _within(capability, MEMORY_EFFICIENT_CAPABILITIES) and precision in dtypes
    return True  # math: any GPU, any dtype


def sdpa_kernel(capability: tuple[int, int], precision: str, masked: bool = False) -> str:
    """The kernel ``scaled_dot_product_attention`` picks for BERT's training call (head size 64, dropout) on a GPU
    of this compute capability, with inputs in ``precision`` (one of PRECISIONS; autocast's type under --amp), and
    ``masked`` with a padding mask.

    ``select_sdp_backend`` (sdp_utils.cpp) walks ``priority_order`` and takes the first kernel whose checks pass:
    flash, memory-efficient, math, cuDNN (``sdp_priority_order`` in aten/src/ATen/Context.h), or cuDNN first on
    ``CUDNN_FIRST`` (``check_prefer_cudnn_attention``: sm90, sm100 and sm103 with cuDNN newer than 9.15, as the
    CUDA 12 wheels ship it; any sm9x/sm10x with CUDA 13). The checks (``_can_use``): flash and cuDNN need sm80 to
    sm121 and fp16/bf16, and no mask; the memory-efficient kernel needs sm50 to sm121 and takes fp32, fp16 and,
    from sm80 on, bf16; the math kernel, which keeps the L x L probabilities, takes anything. So on the T4 (sm75)
    and the V100 (sm70): fp32 and fp16 memory-efficient, bf16 math. Measured on the H200 with torch 2.11: fp32
    memory-efficient, bf16 cuDNN. On a GPU, ``helpers.memory.cuda_step.gpu_sdpa_kernel`` asks torch instead.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r}: expected one of {PRECISIONS}")
    capability = tuple(capability)
    order = CUDNN_ORDER if capability in CUDNN_FIRST else DEFAULT_ORDER
    return next(kernel for kernel in order if _can_use(kernel, capability, precision, masked))


def attention_kernel(gpu: GpuModel, precision: str, masked: bool = False) -> str:
    """The kernel ``gpu`` runs BERT's attention with in ``precision``: what it was seen to pick where it was asked
    (an unmasked batch), else ``sdpa_kernel`` by its compute capability."""
    if gpu.kernels and not masked and precision in dict(gpu.kernels):
        return dict(gpu.kernels)[precision]
    return sdpa_kernel(gpu.capability, precision, masked)


MEMORY_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*(GiB|GB|MiB|MB|G|M)?\s*$", re.IGNORECASE)
UNITS = {"gib": GIB, "g": GIB, "gb": 10**9, "mib": MIB, "m": MIB, "mb": 10**6}


def parse_memory(text: str) -> int:
    """Bytes of a memory size as people write it: ``16GiB``, ``24GB`` (10^9 bytes), ``40960MiB``, ``80`` (GiB)."""
    match = MEMORY_SIZE.match(text)
    if not match:
        raise ValueError(f"cannot read {text!r} as a memory size: write e.g. 16GiB, 24GB or 40960MiB")
    number, unit = match.groups()
    return int(float(number) * UNITS[(unit or "GiB").lower()])
