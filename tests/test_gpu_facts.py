"""The GPU facts the memory prediction adds to a trace, pinned to PyTorch's source and to the H200 snapshot.

The snapshot (tests/fixtures/h200-snapshot-b8-l512-fp32.pickle.gz) is the CUDA memory history of notebook 05's
cell 29 on an NVIDIA H200 (torch 2.11.0+cu130, 2026-12-04): one BERT-base Adam step, B=8, L=512, fp32.
"""

import gzip
import pickle
from collections import Counter
from pathlib import Path

import pytest

from helpers.memory.gpu_facts import (GPUS, cublas_workspace_size, cublaslt_workspace_size, parse_memory,
                                      reduce_buffers, sdpa_kernel, workspaces)

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
    assert sdpa_kernel((9, 0), half=True) == "cuDNN"  # measured on the H200
    assert sdpa_kernel((9, 0), half=False) == "memory-efficient"  # measured on the H200
    assert sdpa_kernel((8, 0), half=True) == "flash"
    assert sdpa_kernel((7, 5), half=True) == "memory-efficient"
    assert sdpa_kernel((9, 0), half=True, masked=True) == "memory-efficient"


@pytest.mark.parametrize(("text", "expected"), [("16GiB", 16 * 2**30), ("24GB", 24 * 10**9), ("40960MiB", 40 * 2**30),
                                                ("80", 80 * 2**30), ("1.5 GiB", 3 * 2**29)])
def test_memory_sizes_as_people_write_them(text, expected):
    assert parse_memory(text) == expected


def test_an_unreadable_memory_size_says_what_to_write():
    with pytest.raises(ValueError, match="cannot read '16 gigs' as a memory size: write e.g. 16GiB"):
        parse_memory("16 gigs")
