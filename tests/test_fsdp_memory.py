"""FSDP memory predictions: the stored table is what the tracker computes now, the layer extrapolation equals a
trace, FSDP shards what it should, and the GPU check says why it skips on a machine without 2 GPUs."""

import contextlib

import pytest
import torch
from torch.utils.checkpoint import CheckpointError

from helpers.checks.gpu_check import check_fsdp
from helpers.memory import (GIB, GPUS, MODELS, activation_formula, bert_base_config, fsdp_categories, load_table,
                            per_device, parameters, predict_fsdp, trace_fsdp, workspaces)
from helpers.memory.fsdp2 import LEVERS
from helpers.memory.kernels import CudaLikeKernels
from helpers.memory.tracer import build_model
from helpers.torch_private import FakeTensorMode


def test_stored_table_equals_a_fresh_prediction():
    """Drift: the stored file against its generator."""
    assert load_table()["models"]["BERT-base"]["fsdp"]["2"] == predict_fsdp(bert_base_config(), 8, 512, 2, environ={})


def test_the_stored_fsdp2_ranks_hold_the_shards_and_gathered_weights_the_models_shapes_give():
    """Against counts from BERT-base's parameter shapes alone, for 2, 4 and 8 ranks: rank 0 keeps the first
    ceil(rows / N) rows of every parameter (FSDP2 shards dim 0, padding it to N equal shards) and the buffers whole;
    Adam's two moments of those of the trained parameters (all but the pooler) plus one 4-byte step count each; and
    at the peak the gathered weights (padding included) of the root, kept after forward, and of two layers (the one
    computing, the next one prefetched)."""
    model = build_model(bert_base_config())
    named = dict(model.named_parameters())
    trained = [p for name, p in named.items() if ".pooler." not in name]
    root = [p for name, p in named.items() if ".encoder.layer." not in name]
    layer = list(model.bert.encoder.layer[0].parameters())
    buffers = sum(buffer.numel() * buffer.element_size() for buffer in model.buffers())
    rows = load_table()["models"]["BERT-base"]["fsdp"]
    assert sorted(rows, key=int) == ["2", "4", "8"]
    for ranks, row in rows.items():
        def shard(parameters, gathered=False):  # fp32 bytes of rank 0's rows, or of all ranks' rows, padding included
            rows_of = (lambda p: -(-p.shape[0] // int(ranks)) * (int(ranks) if gathered else 1))
            return sum(4 * rows_of(p) * (p.numel() // p.shape[0]) for p in parameters)

        assert row["weights"] == shard(named.values()) + buffers, ranks
        assert row["optimizer"] == 2 * shard(trained) + 4 * len(trained), ranks
        assert row["gathered"] == shard(root, gathered=True) + 2 * shard(layer, gathered=True), ranks


def test_extrapolation_from_three_and_four_layers_equals_the_trace_of_five():
    five = bert_base_config(num_hidden_layers=5)
    held = sum(workspaces(GPUS["H200"].capability, {}).values())
    assert predict_fsdp(five, 8, 512, 2, environ={}) == fsdp_categories(trace_fsdp(five, 8, 512, 2), held=held)


def test_checkpointing_keeps_each_layers_input_and_recomputes_under_the_forwards_kernels(monkeypatch):
    """With activation checkpointing the activations at the peak stay within what it keeps by the closed form (what
    lies outside the layers, and each layer's input: B x L x hidden fp32), while without it they exceed that. The
    recomputation in backward runs under the forward's CUDA-like kernels: PyTorch's checkpoint compares what the
    recomputation saves with what the forward saved, and refuses one under the CPU's kernels (float dropout masks
    where the forward kept 1-byte ones)."""
    small = bert_base_config(num_hidden_layers=3, hidden_size=64, num_attention_heads=4, intermediate_size=128,
                             vocab_size=512)  # a small vocabulary, so that activations make the peak
    outside = activation_formula(small.__class__(**(small.to_dict() | {"num_hidden_layers": 0})), 4, 128)
    kept_by_checkpointing = outside + small.num_hidden_layers * 4 * 128 * small.hidden_size * 4
    kept, recomputed = (trace_fsdp(small, 4, 128, 2, checkpointing=flag) for flag in (False, True))
    assert recomputed["Activation"] <= kept_by_checkpointing < kept["Activation"]
    monkeypatch.setattr(CudaLikeKernels, "for_recomputation", classmethod(lambda cls: contextlib.nullcontext()))
    with pytest.raises(CheckpointError, match="saved during the original forward and recomputation"):
        trace_fsdp(small, 4, 128, 2, checkpointing=True, seed=1)  # another seed: not the trace kept above


def test_a_trace_does_not_depend_on_what_the_process_traced_before():
    """FakeTensorMode's dispatch cache is shared by the whole process; traced cold, this checkpointed 2-layer model
    once held 1 MiB more at its peak than the same trace run second (a reader re-running a cell saw new numbers)."""
    small = bert_base_config(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128,
                             vocab_size=512)
    FakeTensorMode.cache_clear()
    cold, warm = (trace_fsdp(small, 8, 512, 2, checkpointing=True, seed=seed) for seed in (0, 1))
    assert cold == warm


def test_table_shards_weights_and_adam_state_but_not_activations():
    table = load_table()
    assert set(table["models"]) == set(MODELS) and set(table["levers"]["fsdp"]) == set(LEVERS)
    assert 0.9e9 < parameters(MODELS["1B encoder"]()) < 1.1e9
    for entry in table["models"].values():
        two, eight = entry["fsdp"]["2"], entry["fsdp"]["8"]
        assert abs(two["optimizer"] / eight["optimizer"] - 4) < 0.01  # 1/N of Adam's state
        assert two["activations"] == eight["activations"]  # the same per-rank batch
        assert eight["total"] < two["total"] < entry["ddp"]["total"]
    levers = table["levers"]["fsdp"]
    assert levers["CPU offload"]["optimizer"] == 0 and levers["CPU offload"]["weights"] < 2**20  # buffers stay
    assert levers["checkpointing"]["total"] < levers["mixed precision"]["total"] < levers["none"]["total"]
    assert levers["none"]["total"] / GIB > 1


def test_every_strategy_reads_the_workspace_variables_of_this_process(monkeypatch):
    """Without ``environ``, FSDP2's prediction, like the others, takes the workspaces this process's environment sets
    (here ``CUBLAS_WORKSPACE_CONFIG=:16:8``: three workspaces of 128 KiB)."""
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    tiny = bert_base_config(num_hidden_layers=1, hidden_size=64, num_attention_heads=4, intermediate_size=128,
                            vocab_size=512)
    for strategy, gpus in (("single", 1), ("ddp", 2), ("fsdp2", 2)):
        assert per_device(tiny, 4, 64, strategy=strategy, gpus=gpus, gpu=GPUS["H200"])[0]["workspaces"] == 3 * 2**17


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="this machine has 2 GPUs: check_fsdp runs for real")
def test_check_fsdp_skips_with_the_reason_without_two_gpus():
    ((ok, line),) = check_fsdp()
    assert ok and line.startswith("skip FSDP check: needs 2 CUDA GPUs")
