"""What nvidia-smi shows for a training process beyond the caching allocator's reserved segments: the CUDA
context (the driver's state and the kernels the libraries load into it) and NCCL's buffers. Neither goes through
the caching allocator, so no trace sees them; each is a term with a range and its source, a figure measured on
the recorded H200 run or published figures, cited. Pure: no torch.

A process's line in nvidia-smi is what it has taken from the GPU: the reserved segments (whole cudaMalloc'd
blocks, ``torch.cuda.memory_reserved``), the context, and NCCL's own allocations. The per-GPU total above the
process lines adds the driver's own few MiB (3 MiB on the recorded H200 with no process) and other processes.
"""

from __future__ import annotations

from dataclasses import dataclass

from helpers.memory.gpu_facts import GpuModel

MIB, GIB = 2**20, 2**30


@dataclass(frozen=True)
class Term:
    """Bytes nvidia-smi shows for one cause, as a range (``low`` == ``high`` where one figure is known), and
    where the figures come from."""

    name: str
    low: int
    high: int
    source: str


MODULE_LOADINGS = ("lazy", "eager")
"""``CUDA_MODULE_LOADING``: lazy (CUDA 11.7 or later; torch sets it from 1.13 on) loads a kernel into the context when
it is first used; eager (older CUDA or torch, the memo's era) loads every kernel of a library when it is loaded."""

H200_RECORD = "gpu-runs/2026-12-04-h200"
H200_TRAINING_CONTEXT = (887 - 3 - 136) * MIB
"""748 MiB: the CUDA context and the libraries' kernels on the recorded H200 (torch 2.11.0+cu130, lazy loading) after
notebook 05 trained the bundled model for an epoch: NVML's peak during that training, 887 MiB (05's executed
notebook), less the 3 MiB the GPU showed with no process (env.txt), less the 136 MiB the caching allocator had
reserved when the memory snapshot began (tests/fixtures/h200-snapshot-b8-l512-fp32.pickle.gz: the segments freed by
its first empty_cache and those still there at its end). Reserved memory only grows until empty_cache, which the
training does not call, so 136 MiB is what the training left; nothing ran on the GPU in between."""

LAZY = Term("CUDA context", 287_047_680, H200_TRAINING_CONTEXT,
            "unknown for this GPU: from 287,047,680 bytes after a first tensor with CUDA_MODULE_LOADING=LAZY "
            "(github.com/pytorch/pytorch/pull/86509) to the 748 MiB the recorded H200 held after a training epoch "
            f"({H200_RECORD}); between them: about 300 MB and 400 MB (pytorch/pytorch#107667, #109888), 426 MiB on an "
            "RTX 6000 Ada with torch 2.10+cu130 (github.com/unslothai/unsloth-zoo/pull/1053)")
EAGER = Term("CUDA context", 200 * MIB, 1_687 * MIB,
             "unknown for this GPU: with every kernel loaded at start (CUDA before 11.7, torch before 1.13), from "
             "'200+mb' (torch 1.3, github.com/pytorch/pytorch/issues/28113) to 1,687 MiB (torch 1.8.2+cu111 on an RTX "
             "3090, pytorch/pytorch#55277); 666,632,192 bytes with CUDA_MODULE_LOADING=DEFAULT in pytorch/pytorch#86509")
H200 = Term("CUDA context", H200_TRAINING_CONTEXT, H200_TRAINING_CONTEXT,
            f"measured on the recorded H200 (torch 2.11.0+cu130, lazy loading; {H200_RECORD}): NVML's peak while "
            f"notebook 05 trained, 887 MiB, less 3 MiB idle and the 136 MiB reserved (helpers.memory.nvidia_smi)")
NCCL = Term("NCCL", 544 * 10**6, int(1.6 * GIB),
            "unknown for this setting: NCCL's buffers and kernels per GPU, from '544 MB' for a 2-GPU group on A100s "
            "with NVLink (github.com/NVIDIA/nccl/issues/964) to 'about 1.6GB' for one communicator "
            "(github.com/NVIDIA/nccl/issues/864), read as 10^6 and 2^30 bytes, the widest; DataParallel's broadcast "
            "and reduce go through NCCL too (torch/csrc/cuda/comm.cpp)")
NONE = Term("NCCL", 0, 0, "one GPU: no collective communication")


def cuda_context(gpu: GpuModel, module_loading: str = "lazy") -> Term:
    """The CUDA context on ``gpu`` after training has loaded its kernels: the recorded H200's own figure where that
    is the GPU and loading is lazy, else the range of published figures for ``module_loading``."""
    if module_loading not in MODULE_LOADINGS:
        raise ValueError(f"module_loading={module_loading!r}: expected one of {MODULE_LOADINGS}")
    if module_loading == "eager":
        return EAGER
    return H200 if gpu.name == "H200" else LAZY


def communication(strategy: str, gpus: int) -> Term:
    """NCCL's memory on each GPU: none on one GPU, the published range under DataParallel, DDP and FSDP2."""
    return NONE if strategy == "single" or gpus == 1 else NCCL


def shown(reserved: int | None, allocated: int, terms: tuple[Term, ...]) -> tuple[int, int | None]:
    """(low, high) bytes of a process's line in nvidia-smi: the reserved peak plus each term's range. Where the
    reserved peak is unknown (None), low starts from the allocated peak, which reserved memory always covers, and
    high is unknown (None)."""
    low = (allocated if reserved is None else reserved) + sum(term.low for term in terms)
    return low, None if reserved is None else reserved + sum(term.high for term in terms)


def fits(process: tuple[int, int | None], capacity: tuple[int, int]) -> str:
    """"yes" where even the largest figure of ``process`` (nvidia-smi, as ``shown`` gives it) is within the smallest
    total of the GPU, "NO" where even the smallest exceeds the largest total, else "maybe"."""
    low, high = process
    if low > capacity[1]:
        return "NO"
    return "yes" if high is not None and high <= capacity[0] else "maybe"
