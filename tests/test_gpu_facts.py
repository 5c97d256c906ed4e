"""The GPU facts the memory prediction adds to a trace, pinned to PyTorch's source and to the H200 snapshot.

The snapshot (tests/fixtures/h200-snapshot-b8-l512-fp32.pickle.gz) is the CUDA memory history of notebook 05's
cell 29 on an NVIDIA H200 (torch 2.11.0+cu130, 2026-12-04): one BERT-base Adam step, B=8, L=512, fp32.
"""

import dataclasses
import gzip
import pickle
from collections import Counter
from pathlib import Path

import pytest

from helpers.memory.gpu_facts import (GPUS, amp_precision, attention_kernel, bf16_refusal, cublas_workspace_size,
                                      cublaslt_workspace_size, mixed_precision, parse_memory, reduce_buffers,
                                      sdpa_kernel, workspaces)

SNAPSHOT = Path(__file__).parent / "fixtures" / "h200-snapshot-b8-l512-fp32.pickle.gz"
KIB, MIB = 2**10, 2**20


def snapshot() -> dict:
    with gzip.open(SNAPSHOT) as file:
        return pickle.load(file)


def test_cublas_workspace_is_32_mib_on_sm90_and_8_mib_128_kib_elsewhere():
    assert cublas_workspace_size((9, 0), {}) == 32 * MIB
    for capability in ((8, 0), (8, 9), (7, 5), (10, 0), (9, 1)):
        assert cublas_workspace_size(capability, {}) == 8 * MIB + 128 * KIB  # 8,519,680 bytes


def test_cublas_workspace_config_overrides_the_default():
    assert cublas_workspace_size((8, 0), {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}) == 32 * MIB
    assert cublas_workspace_size((9, 0), {"CUBLAS_WORKSPACE_CONFIG": ":16:8"}) == 128 * KIB
    assert cublas_workspace_size((9, 0), {"CUBLAS_WORKSPACE_CONFIG": ":4096:2:16:8"}) == 8 * MIB + 128 * KIB
    assert cublas_workspace_size((9, 0), {"CUBLAS_WORKSPACE_CONFIG": "nonsense"}) == 32 * MIB  # warned, default


def test_cublaslt_workspace_default_override_clamp_and_unified():
    assert cublaslt_workspace_size((9, 0), {}) == 1 * MIB
    assert cublaslt_workspace_size((9, 0), {"CUBLASLT_WORKSPACE_SIZE": "4096"}) == 4 * MIB
    assert cublaslt_workspace_size((9, 0), {"CUBLASLT_WORKSPACE_SIZE": "4096", "CUBLAS_WORKSPACE_CONFIG": ":16:8"}) \
        == 128 * KIB  # never more than the cuBLAS workspace
    assert cublaslt_workspace_size((9, 0), {"TORCH_CUBLASLT_UNIFIED_WORKSPACE": "1"}) == 0


def test_deterministic_sets_the_workspace_unless_it_is_set():
    assert workspaces((8, 0), {}, deterministic=True)["cuBLAS (forward thread)"] == 32 * MIB
    assert workspaces((8, 0), {"CUBLAS_WORKSPACE_CONFIG": ":16:8"}, deterministic=True)[
        "cuBLAS (forward thread)"] == 128 * KIB


def test_the_snapshot_holds_exactly_the_predicted_workspaces():
    """The blocks of 1 MiB or more allocated before the recorded cell and still held at its end: the predicted
    workspaces (two cuBLAS, one cuBLASLt), and the bundled tiny model's word embeddings left by cell 8 (weights
    and Adam's two moments)."""
    from helpers.memory.configs import bundled_config

    held = [block["size"] for segment in snapshot()["segments"] for block in segment["blocks"]
            if block["state"] == "active_allocated" and not block["frames"] and block["size"] >= MIB]
    tiny = bundled_config()
    embeddings = 4 * tiny.vocab_size * tiny.hidden_size
    assert sorted(held) == sorted([*workspaces((9, 0), {}).values(), embeddings, embeddings, embeddings])


def test_reduce_buffers_match_every_bias_gradient_sum_of_the_snapshot():
    """Each staging buffer and semaphore block the reduction kernel took in the measured step (4096 tokens), by
    size: 60 sums of 768 columns (5 per layer) and 12 of 3072 (the feed-forward layer)."""
    data = snapshot()
    start = data["external_annotations"][3]["time_us"]  # the warm-up step's zero_grad ends
    taken = Counter(event["size"] for event in data["device_traces"][0]
                    if event["action"] == "alloc" and event["time_us"] > start
                    and any("gpu_reduce_kernel" in frame["name"] for frame in event["frames"]))
    h200 = GPUS["H200"]
    (staging_768, flags_768), (staging_3072, flags_3072) = (reduce_buffers(4096, columns, h200) for columns in (768, 3072))
    assert taken == {staging_768: 60, flags_768: 60, staging_3072: 12, flags_3072: 12}
    assert (staging_768, staging_3072) == (24 * MIB, 96 * MIB)


def test_reduce_buffer_grows_with_the_rows_until_the_gpu_is_full():
    h200 = GPUS["H200"]
    assert reduce_buffers(512, 768, h200) == (0, 0)  # few rows: one block per column group, no staging
    assert reduce_buffers(2048, 768, h200)[0] == 8 * 768 * 2048  # 8 bytes per element while blocks are few
    assert reduce_buffers(16384, 3072, h200)[0] == reduce_buffers(65536, 3072, h200)[0]  # capped by 132 SMs
    assert reduce_buffers(65536, 3072, GPUS["A100-80GB"])[0] < reduce_buffers(65536, 3072, h200)[0]  # 108 SMs


def test_attention_kernel_by_compute_capability_and_dtype():
    assert sdpa_kernel((9, 0), "bf16") == "cuDNN"  # measured on the H200
    assert sdpa_kernel((9, 0), "fp32") == "memory-efficient"  # measured on the H200
    assert sdpa_kernel((9, 0), "bf16", masked=True) == "memory-efficient"
    assert sdpa_kernel((8, 0), "bf16") == sdpa_kernel((8, 9), "fp16") == "flash"
    assert sdpa_kernel((8, 6), "bf16", masked=True) == "memory-efficient"  # flash refuses a mask
    with pytest.raises(ValueError, match="precision='half'"):
        sdpa_kernel((9, 0), "half")


@pytest.mark.parametrize("capability", [(7, 5), (7, 0)])  # the T4, the V100
def test_below_sm80_attention_is_memory_efficient_in_fp32_and_fp16_and_math_in_bf16(capability):
    """sdp_utils.cpp: flash and cuDNN need sm80 (check_flash_attention_hardware_support,
    check_cudnn_hardware_support), and the memory-efficient kernel takes fp16 and fp32 only below sm80
    (less_than_sm80_mem_efficient_dtypes); so bf16 falls to the math kernel, masked or not."""
    for masked in (False, True):
        assert [sdpa_kernel(capability, precision, masked) for precision in ("fp32", "fp16", "bf16")] == \
            ["memory-efficient", "memory-efficient", "math"]


def test_a_gpu_without_native_bf16_mixes_in_fp16_and_refuses_bf16_naming_fp16():
    t4, v100, h200 = GPUS["T4"], GPUS["V100-16GB"], GPUS["H200"]
    assert (t4.native_bf16, v100.native_bf16, h200.native_bf16, GPUS["A100-40GB"].native_bf16) == (False, False,
                                                                                                   True, True)
    assert mixed_precision(t4)[0] == mixed_precision(v100)[0] == "fp16" and mixed_precision(h200)[0] == "bf16"
    assert "no native bf16" in mixed_precision(t4)[1] and "--amp fp16" in mixed_precision(t4)[1]
    assert bf16_refusal(h200) is None
    assert bf16_refusal(t4) == ("--amp bf16: T4 (sm75) has no native bf16 (it needs compute capability 8.0 or "
                                "later); use --amp fp16 (fp16 autocast with a gradient scaler), or leave out --amp "
                                "for fp32")
    assert [amp_precision(t4, amp) for amp in (None, False, True, "fp16")] == ["fp32", "fp32", "fp16", "fp16"]
    assert [amp_precision(h200, amp) for amp in (True, "bf16", "fp16")] == ["bf16", "bf16", "fp16"]
    with pytest.raises(ValueError, match=r"^--amp bf16: V100-16GB \(sm70\) has no native bf16.*use --amp fp16"):
        amp_precision(v100, "bf16")
    with pytest.raises(ValueError, match="amp='fp8'"):
        amp_precision(h200, "fp8")


def test_a_gpu_that_was_asked_answers_with_what_it_picked():
    asked = dataclasses.replace(GPUS["T4"], kernels=(("fp32", "memory-efficient"), ("fp16", "flash"),
                                                     ("bf16", "math")))
    assert attention_kernel(asked, "fp16") == "flash"  # what it said, even where the table says otherwise
    assert attention_kernel(asked, "fp16", masked=True) == attention_kernel(GPUS["T4"], "fp16") == "memory-efficient"


@pytest.mark.parametrize(("text", "expected"), [("16GiB", 16 * 2**30), ("24GB", 24 * 10**9), ("40960MiB", 40 * 2**30),
                                                ("80", 80 * 2**30), ("1.5 GiB", 3 * 2**29)])
def test_memory_sizes_as_people_write_them(text, expected):
    assert parse_memory(text) == expected


def test_an_unreadable_memory_size_says_what_to_write():
    with pytest.raises(ValueError, match="cannot read '16 gigs' as a memory size: write e.g. 16GiB"):
        parse_memory("16 gigs")
