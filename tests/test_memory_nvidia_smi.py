"""What nvidia-smi will show: the reserved peak of the replayed step against the H200's memory snapshot, the terms
added to it and their sources, the step's options (Adam's implementation, zero_grad), any encoder transformers builds
from a config, and the shortcuts that make the command fast (meta tensors, one warm-up for several batch sizes,
remembered meta outputs, a batch line), each against the slow way it replaces."""

import gzip
import json
import pickle
import re
from pathlib import Path

import pytest
import torch
from transformers import BertConfig, DebertaV2Config, DistilBertConfig, ModernBertConfig, RobertaConfig

from helpers.memory import GPUS, bert_base_config, gpu_memory, largest_batch, per_device, predict_step
from helpers.memory import nvidia_smi, step_logs
from helpers.memory.allocator import segment_size
from helpers.memory.gpu_facts import reduce_buffers
from helpers.memory.configs import PRESETS, bundled_config, preset_config
from helpers.memory.simulated_gpu import SimulatedGpu, _MetaOutputs
from helpers.memory.tracer import (OPTIMIZER_IMPLS, build_model, default_attention, trace_fake, trace_fake_steps,
                                   trace_step)

ROOT = Path(__file__).resolve().parents[1]
SNAPSHOT = ROOT / "tests" / "fixtures" / "h200-snapshot-b8-l512-fp32.pickle.gz"
MIB = 2**20
H200, T4 = GPUS["H200"], GPUS["T4"]
SMALL = dict(vocab_size=1000, hidden_size=64, num_hidden_layers=1, num_attention_heads=4, intermediate_size=128,
             max_position_embeddings=64)
ENCODERS = {  # a tiny config of each model type, the fields its Japanese preset sets
    "roberta": RobertaConfig(**SMALL, pad_token_id=1),
    "deberta-v2": DebertaV2Config(**SMALL, relative_attention=True, position_buckets=16, pos_att_type=["p2c", "c2p"],
                                  position_biased_input=False, type_vocab_size=0, norm_rel_ebd="layer_norm",
                                  share_att_key=True, max_relative_positions=-1),
    "distilbert": DistilBertConfig(vocab_size=1000, dim=64, n_layers=1, n_heads=4, hidden_dim=128,
                                   max_position_embeddings=64, sinusoidal_pos_embds=True),
    "modernbert": ModernBertConfig(**(SMALL | {"num_hidden_layers": 2}), pad_token_id=0, bos_token_id=1,
                                   eos_token_id=2, cls_token_id=1, sep_token_id=2, local_attention=8),  # a global
    #                                                         layer, then a local one (every third layer is global)
}


def snapshot() -> dict:
    with gzip.open(SNAPSHOT) as file:
        return pickle.load(file)


def snapshot_start(data: dict) -> dict:
    """The segments that existed when the snapshot began (address -> (size, blocks held since before the cell))."""
    trace = data["device_traces"][0]
    created = {event["addr"] for event in trace if event["action"] == "segment_alloc"}
    segments = {event["addr"]: (event["size"], []) for event in trace
                if event["action"] == "segment_free" and event["addr"] not in created}
    for segment in data["segments"]:
        if segment["address"] not in created:
            segments[segment["address"]] = (segment["total_size"], [
                (("held", block["address"]), block["address"], block["size"], block["requested_size"])
                for block in segment["blocks"] if block["state"] == "active_allocated" and not block["frames"]])
    return segments


def test_the_predicted_step_reserves_what_the_h200_reserved():
    """The snapshot's step (B=8, L=512, fp32, notebook 05's cell) reserved 4,400 MiB at its peak (memory_summary;
    its segment events add up to the same). The predicted step, run on an allocator holding the segments and blocks
    the snapshot began with (the workspaces among them, so the log's own are left out), reserves exactly that; from a
    clean process it reserves what those 136 MiB of earlier segments do not cover."""
    data = snapshot()
    trace = data["device_traces"][0]
    start = snapshot_start(data)
    reserved, peak = sum(size for size, _ in start.values()), 0
    for event in trace:
        reserved += {"segment_alloc": event["size"], "segment_free": -event["size"]}.get(event["action"], 0)
        peak = max(peak, reserved)
    assert peak == 4400 * MIB and sum(size for size, _ in start.values()) == 136 * MIB
    step = predict_step(bert_base_config(), 8, 512, gpu=H200, environ={})
    device = SimulatedGpu(H200, {})
    for address, (size, held) in start.items():
        device.allocator.add_segment(address, size, small=size == 2 * MIB, held=held)
    for event in step.log:
        if not (event[0] == "malloc" and event[3] == "workspaces"):
            device.apply(event)
    assert device.allocator.peak_reserved == 4400 * MIB
    assert step.reserved_peak == 4364 * MIB  # 4,400 less the 36 MiB of earlier, empty segments the real step reused


def test_the_h200_context_is_the_training_peak_less_idle_and_reserved_memory():
    """748 MiB: notebook 05's appendix quotes the H200's NVML peak while training (887 MiB) and the GPU with no process
    (3 MiB used); the snapshot began with 136 MiB reserved, all the training left (nothing ran on the GPU in between)."""
    markdown = "".join("".join(cell["source"]) for name in ("05_gpu_memory", "05_appendix_allocator") for cell in
                       json.loads((ROOT / "notebooks" / f"{name}.ipynb").read_text(encoding="utf-8"))["cells"])
    assert "{0: '887 MiB'}" in markdown and re.search(r"NVIDIA H200\s+3 MiB 143,771 MiB", markdown)
    reserved = sum(size for size, _ in snapshot_start(snapshot()).values())
    assert nvidia_smi.H200_TRAINING_CONTEXT == 887 * MIB - 3 * MIB - reserved == 748 * MIB
    assert nvidia_smi.cuda_context(H200) == nvidia_smi.H200 and nvidia_smi.cuda_context(T4) == nvidia_smi.LAZY
    assert nvidia_smi.cuda_context(H200, "eager") == nvidia_smi.EAGER


def test_every_gpu_row_names_where_its_total_comes_from():
    assert GPUS["H200"].capacity == (143_771 * MIB, 143_771 * MIB)  # its own nvidia-smi, as notebook 05 quotes
    for gpu in GPUS.values():
        low, high = gpu.capacity
        assert 0 < low <= high and ("MiB" in gpu.memory_source or "GiB" in gpu.memory_source), gpu.name
        assert re.search(r"github\.com|gpu-runs", gpu.memory_source), gpu.name  # a run, or a page to check
    for term in (nvidia_smi.LAZY, nvidia_smi.EAGER, nvidia_smi.NCCL, nvidia_smi.H200):
        assert term.low <= term.high and term.source


@pytest.mark.parametrize(("process", "verdict"), [((90, 100), "yes"), ((90, 101), "maybe"), ((110, 120), "maybe"),
                                                  ((111, 120), "NO"), ((90, None), "maybe")])
def test_fits_is_certain_only_at_both_ends(process, verdict):
    assert nvidia_smi.fits(process, (100, 110)) == verdict


def test_ddp_reserves_its_bucket_and_a_replica_no_adam_state():
    """DDP's bucket (every gradient's bytes) takes a segment of its own before the step: a whole one where it is
    large (one BERT-base layer and the embeddings: 121 MiB), while a small one's segment has room the step uses; a
    DataParallel replica holds no Adam state and frees its gradients when backward ends, so it reserves less than
    GPU 0."""
    options = dict(gpu=H200, environ={})
    for config in (bert_base_config(num_hidden_layers=1), bundled_config()):
        (single,) = gpu_memory(config, 16, 64, **options)
        ddp = gpu_memory(config, 32, 64, strategy="ddp", gpus=2, **options)
        step = predict_step(config, 16, 64, **options)
        bucket = step_logs.gradient_bytes(step.log)
        assert bucket == step.optimizer_peak["gradients"] == per_device(config, 32, 64, strategy="ddp", gpus=2,
                                                                        **options)[0]["buckets"]
        added = ddp[0].reserved - single.reserved
        assert added == segment_size(bucket) if bucket > 100 * MIB else 0 <= added < segment_size(bucket)
    config = bundled_config()
    gpu0, gpu1 = gpu_memory(config, 32, 64, strategy="dataparallel", gpus=2, **options)
    assert gpu0.reserved == single.reserved and gpu1.allocated <= gpu1.reserved < gpu0.reserved
    replica = step_logs.replica(step.log)
    assert not [event for event in replica if event[0] == "malloc" and event[3] == "optimizer"]
    for device in (*ddp, gpu0, gpu1):
        low, high = device.nvidia_smi
        assert low == device.reserved + device.context.low + device.communication.low and high > low
    assert single.communication == nvidia_smi.NONE and ddp[0].communication == nvidia_smi.NCCL


def test_the_optimizer_implementation_and_zero_grad_change_what_the_step_holds():
    """Keeping the gradients (torch 1.x's zero_grad) holds them through the next forward: 4 bytes per trained
    parameter when backward starts. Fused Adam makes no parameter-sized temporaries: its optimizer step peaks at the
    state, the one-tensor-at-a-time loop a little above it, foreach (a whole list at once) highest."""
    config = bundled_config()
    trained = predict_step(config, 8, 64, gpu=H200, environ={}).optimizer_peak["gradients"]
    kept, freed = (predict_step(config, 8, 64, gpu=H200, environ={}, set_to_none=keep) for keep in (False, True))
    assert (kept.after_forward["gradients"], freed.after_forward["gradients"]) == (trained, 0)
    peaks = {impl: predict_step(config, 8, 64, gpu=H200, environ={}, optimizer_impl=impl).optimizer_peak["optimizer"]
             for impl in OPTIMIZER_IMPLS}
    assert 2 * trained < peaks["fused"] < peaks["for-loop"] < peaks["foreach"]


@pytest.mark.parametrize("options", [dict(amp_dtype=torch.float16), dict(attention="eager", set_to_none=False,
                                                                         optimizer_impl="for-loop"),
                                     dict(accumulation=2, checkpointing=True), dict(amp_dtype=torch.bfloat16)])
def test_meta_tensors_one_warm_up_and_remembered_outputs_trace_what_fake_tensors_do(options):
    """The command's shortcuts against the slow way: a step on meta tensors (with remembered meta outputs) logs the
    same events as on fake tensors (which remember none), and a second batch size after the first, sharing the
    warm-up, logs what it logs traced alone."""
    config, gpu = bundled_config(), T4 if options.get("amp_dtype") == torch.float16 else H200
    both = trace_fake_steps(config, (4, 8), 32, gpu=gpu, environ={}, **options)
    for batch_size, step in zip((4, 8), both):
        alone = trace_fake(config, batch_size, 32, gpu=gpu, environ={}, fake=True, **options)
        assert step == alone and step_logs.same(step.log, alone.log)
    assert _MetaOutputs.outputs  # they were used


def test_a_batch_line_gives_the_step_at_every_batch_size():
    """Two traces give the log at any batch, event for event, the reduction's staging buffer included where it
    starts (a bias gradient over enough rows, on the T4's 40 SMs); logs of different settings do not align."""
    config = bert_base_config(num_hidden_layers=1)
    one, a, b = trace_fake_steps(config, (1, 2, 4), 128, gpu=T4, environ={})
    line = step_logs.BatchLine.through((2, a.log), (4, b.log))
    assert step_logs.BatchLine.through((1, one.log), (2, a.log)) is None  # one example: other paths (no copies)
    for count in (3, 7, 16):
        traced = trace_fake(config, count, 128, gpu=T4, environ={})
        assert step_logs.same(line.at(count), traced.log) and step_logs.step_memory(T4, line.at(count)) == traced
    staged = [[event for event in line.at(count) if event[0] == "reduce" and reduce_buffers(*event[1:], T4)[0]]
              for count in (2, 16)]
    assert not staged[0] and staged[1]
    other = trace_fake(config, 4, 128, gpu=T4, environ={}, attention="eager")
    assert step_logs.BatchLine.through((2, a.log), (4, other.log)) is None


@pytest.mark.parametrize(("capacity", "options"), [(850, dict(strategy="single")),
                                                  (2500, dict(strategy="ddp", gpus=2, accumulation=2)),
                                                  (2500, dict(strategy="dataparallel", gpus=2, set_to_none=False))])
def test_the_search_on_the_line_answers_what_tracing_every_batch_answers(capacity, options):
    """Same answers to the byte: the search on a batch line and the search that traces every batch it looks at,
    for certain and possible fits; the answer fits and one micro-batch per GPU more does not."""
    config, capacity = bundled_config(), capacity * MIB
    for certain in (True, False):
        found = largest_batch(config, 64, capacity, gpu=T4, environ={}, certain=certain, **options)
        assert found == largest_batch(config, 64, capacity, gpu=T4, environ={}, certain=certain, traced=True,
                                      **options)
        unit = options.get("gpus", 1) * options.get("accumulation", 1)
        verdicts = {"yes"} if certain else {"yes", "maybe"}
        assert found > 0
        fits = [all(device.fits((capacity, capacity)) in verdicts
                    for device in gpu_memory(config, batch, 64, gpu=T4, environ={}, **options))
                for batch in (found, found + unit)]
        assert fits == [True, False]


@pytest.mark.parametrize("model_type", ENCODERS)
def test_each_encoder_is_traced_as_the_cpu_tracker_counts_it(model_type):
    """On a tiny config of each type: PyTorch's tracker on fake tensors equals the step on real CPU tensors (as for
    BERT), and the simulated GPU's activations are the tracker's, in transformers' default attention."""
    config = ENCODERS[model_type]
    attention = default_attention(config)
    torch.manual_seed(0)
    real = trace_step(build_model(config, "eager", device="cpu"), 2, 16, vocab_size=config.vocab_size)
    assert trace_fake(config, 2, 16, attention="eager") == real
    tracked = trace_fake(config, 2, 16, attention=attention)
    simulated = trace_fake(config, 2, 16, attention=attention, gpu=H200, environ={})
    assert simulated.after_forward["activations"] == tracked.after_forward["activations"]


def test_the_presets_build_each_model_type():
    counts = {name: sum(p.numel() for p in build_model(preset_config(name), default_attention(preset_config(name)))
                        .parameters()) for name in PRESETS}
    types = {name: preset_config(name).model_type for name in PRESETS}
    assert {"bert", "roberta", "deberta-v2", "distilbert", "modernbert"} <= set(types.values())
    assert counts["tohoku-nlp/bert-base-japanese-whole-word-masking"] == 110_618_882  # 05's count
    assert round(counts["sbintuitions/modernbert-ja-130m"] / 1e6) == 132  # its model card: 132M
    assert default_attention(preset_config("ku-nlp/deberta-v2-base-japanese")) == "eager"  # transformers has no sdpa
