"""The memory model against measurement: MemTracker on fake tensors vs the closed form, vs real tensors,
vs the torch.profiler memory timeline, and DDP's buckets in a real two-process run."""

import contextlib
import tempfile

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn
from torch.profiler import ProfilerActivity, profile
from torch.profiler._memory_profiler import MemoryProfileTimeline

from ddp_buckets_worker import measure_ddp
from helpers.memory import activation_formula, parameter_bytes, per_device, trace_by_layers
from helpers.memtrace import (CudaLikeKernels, bert_base_config, build_model, bundled_config, cuda_sdpa_kernel,
                               trace_fake, trace_step)


def agreement(a: int, b: int) -> float:
    return abs(a - b) / b


@pytest.mark.parametrize(("batch_size", "seq_len", "attention"),
                         [(1, 512, "eager"), (4, 128, "eager"), (16, 64, "eager"), (8, 256, "sdpa")])
def test_activation_formula_matches_the_tracker_for_bert_base_layers(batch_size, seq_len, attention):
    config = bert_base_config(num_hidden_layers=2)  # hidden 768, 12 heads, vocab 32000; layers are identical
    traced = trace_fake(config, batch_size, seq_len, attention=attention).after_forward["activations"]
    assert agreement(activation_formula(config, batch_size, seq_len, attention=attention), traced) < 1e-3


def test_activation_formula_knows_cpu_dropout_keeps_float_masks():
    config = bert_base_config(num_hidden_layers=2)
    traced = trace_fake(config, 2, 128, attention="eager", cuda_dropout=False).after_forward["activations"]
    assert agreement(activation_formula(config, 2, 128, attention="eager", mask_bytes=4), traced) < 1e-3
    assert traced > trace_fake(config, 2, 128, attention="eager").after_forward["activations"]


def test_parameter_bytes_count_the_model():
    config = bert_base_config()
    assert parameter_bytes(config) == 4 * sum(p.numel() for p in build_model(config).parameters())


@pytest.mark.parametrize(("batch_size", "seq_len"), [(4, 128), (8, 256)])
def test_layer_extrapolation_matches_a_full_trace(batch_size, seq_len):
    config = bert_base_config(num_hidden_layers=5)
    full, extrapolated = trace_fake(config, batch_size, seq_len), trace_by_layers(config, batch_size, seq_len)
    assert extrapolated == full


def test_tracker_on_fake_tensors_equals_real_tensors():
    config = bundled_config()
    torch.manual_seed(0)
    # eager: the fused CUDA kernels that trace_fake uses for sdpa have no CPU implementation to run for real
    real = trace_step(build_model(config, attention="eager", device="cpu"), 4, 32, vocab_size=config.vocab_size)
    assert trace_fake(config, 4, 32, attention="eager") == real


def test_tracker_peak_matches_the_profiler_memory_timeline():
    config = bundled_config()
    torch.manual_seed(0)
    tracked = trace_step(build_model(config, device="cpu"), 8, 64, vocab_size=config.vocab_size, cuda_dropout=False)

    torch.manual_seed(0)
    model = build_model(config, device="cpu").train()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, foreach=True)  # as trace_step
    generator = torch.Generator().manual_seed(0)  # the same batches as trace_step draws

    def step(size, length):
        input_ids = torch.randint(0, config.vocab_size, (size, length), generator=generator)
        labels = torch.randint(0, 2, (size,), generator=generator)
        nn.functional.cross_entropy(model(input_ids, torch.ones_like(input_ids)), labels).backward()
        optimizer.step()
        optimizer.zero_grad()

    step(1, 8)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        step(8, 64)
    _, sizes = MemoryProfileTimeline(prof._memory_profile())._coalesce_timeline("cpu")
    assert agreement(tracked.peak["total"], max(sum(point) for point in sizes)) < 0.01


def test_ddp_buckets_in_a_real_two_process_run_match_the_prediction():
    with tempfile.TemporaryDirectory() as tmpdir, mp.Manager() as manager:
        results = manager.dict()
        # spawn, not fork: forking a process whose OpenMP threads already ran can deadlock the children
        mp.spawn(measure_ddp, args=(2, f"{tmpdir}/rendezvous", results), nprocs=2)
        results = dict(results)
    for rank in (0, 1):
        buckets, gradients, params = results[(rank, False)]
        assert buckets == params and agreement(gradients, params) < 1e-3
        buckets, gradients, params = results[(rank, True)]  # gradients are views into the buckets
        assert buckets == params and gradients < 1e-3 * params


def test_dataparallel_gpu0_carries_the_optimizer_state_and_ddp_adds_buckets():
    config = bert_base_config()
    single = per_device(config, 32, 512, strategy="single")[0]
    gpu0, gpu1 = per_device(config, 64, 512, strategy="dataparallel", gpus=2)
    assert gpu0 == single  # the master model runs its half of the batch like one device would
    assert gpu0["total"] - gpu1["total"] == single["optimizer"]
    for rank in per_device(config, 64, 512, strategy="ddp", gpus=2):
        assert rank["total"] == single["total"] + parameter_bytes(config)


def test_levers_lower_the_peak():
    config = bert_base_config()
    base = per_device(config, 32, 512)[0]
    for lever in (dict(accumulation=2), dict(checkpointing=True), dict(amp=True)):
        assert per_device(config, 32, 512, **lever)[0]["total"] < base["total"], lever
    assert per_device(config, 32, 512, attention="eager")[0]["total"] > base["total"]


def test_bad_settings_name_the_parameter():
    config = bert_base_config(num_hidden_layers=1)
    with pytest.raises(ValueError, match="strategy='fsdp'"):
        per_device(config, 8, 64, strategy="fsdp")
    with pytest.raises(ValueError, match="batch_size=9 does not split evenly over gpus=2"):
        per_device(config, 9, 64, strategy="ddp", gpus=2)
    with pytest.raises(ValueError, match="accumulation=2"):
        trace_fake(config, 3, 64, accumulation=2)
    with pytest.raises(ValueError, match="attention='flash'"):
        trace_fake(config, 2, 64, attention="flash")


def test_cuda_kernel_choice_follows_dtype_and_mask():
    assert cuda_sdpa_kernel(torch.float32) == "memory-efficient"
    assert cuda_sdpa_kernel(torch.bfloat16) == "flash"
    assert cuda_sdpa_kernel(torch.bfloat16, masked=True) == "memory-efficient"


def test_amp_emulation_keeps_autocast_dtypes_for_backward():
    """Under CUDA autocast's rules: linear inputs and weight copies in bf16, softmax and LayerNorm in fp32,
    1-byte dropout masks (read in aten/src/ATen/autocast_mode.cpp; checked here on real CPU tensors)."""
    config = bundled_config()
    torch.manual_seed(0)
    model = build_model(config, attention="eager", device="cpu").train()
    saved = []
    input_ids = torch.randint(0, config.vocab_size, (2, 16))
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        with CudaLikeKernels(byte_masks=True, amp_dtype=torch.bfloat16):
            logits = model(input_ids)
            loss = nn.functional.cross_entropy(logits, torch.tensor([0, 1]))
    loss.backward()
    heads, hidden = config.num_attention_heads, config.hidden_size
    kept = {(t.numel(), t.dtype) for t in saved}
    probabilities = 2 * heads * 16 * 16
    assert logits.dtype == torch.bfloat16 and loss.dtype == torch.float32
    assert (probabilities, torch.float32) in kept    # softmax output
    assert (probabilities, torch.bool) in kept       # attention dropout mask
    assert (probabilities, torch.bfloat16) in kept   # probabilities cast for the matmul with V
    assert (2 * 16 * hidden, torch.bfloat16) in kept   # a linear layer's input
    assert (hidden * hidden, torch.bfloat16) in kept   # a weight's autocast copy
    assert model.linear.weight.grad.dtype == torch.float32


def test_checkpointed_layers_recompute_under_the_kernels_of_their_forward():
    """Backward re-runs each checkpointed layer outside the forward's ``with`` block; checkpoint refuses a
    recomputation that saves other shapes or dtypes (CPU's float dropout masks against 1-byte ones)."""
    config = bundled_config()
    torch.manual_seed(0)
    model = build_model(config, attention="eager", checkpointing=True, device="cpu").train()
    input_ids = torch.randint(0, config.vocab_size, (2, 16))
    for kernels in (CudaLikeKernels(byte_masks=True), CudaLikeKernels(byte_masks=False), contextlib.nullcontext()):
        with kernels:
            loss = model(input_ids).sum()
        loss.backward()
    with CudaLikeKernels(byte_masks=False, fused_attention=True, amp_dtype=torch.bfloat16) as forward:
        again = CudaLikeKernels.for_recomputation()
    assert again is not forward and vars(again) == vars(forward)
    assert isinstance(CudaLikeKernels.for_recomputation(), contextlib.nullcontext)


def test_gpu_check_report_states_each_gap_with_its_cause():
    from helpers.checks.gpu_check import compare, gap_causes
    from helpers.cuda_step import CudaPeak

    gib = 2**30
    ok, line = compare("1 GPU, memory-efficient, fp32, B=8, L=128", 2 * gib, int(2.05 * gib))
    assert ok and line.startswith("ok ") and "gap +2.5%" in line
    causes = gap_causes({"total": 2 * gib}, gib, CudaPeak(before=int(1.25 * gib), peak=int(2.4 * gib)),
                        "memory-efficient", "math")
    ok, line = compare("1 GPU", 2 * gib, int(2.4 * gib), causes)
    assert not ok and "gap +20.0%" in line
    assert "runs the math attention kernel; the prediction traced memory-efficient" in line
    assert "+256 MiB held before the step" in line
    assert gap_causes({"total": 2 * gib}, gib, CudaPeak(gib, 2 * gib), "flash", "cuDNN") == []
    assert "not identified" in compare("1 GPU", 2 * gib, 3 * gib)[1]
