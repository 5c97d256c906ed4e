"""The memory of one real training step with each lever, tracked, beside what the prediction says for it.

tracked: PyTorch's MemTracker (FSDPMemTracker for a sharded model; helpers.memory.tracking) around one optimizer
step exactly as helpers.train runs it (``helpers.step.train_step``), with the lever applied as
helpers.finetune applies it (helpers.levers), on real tensors. predicted: helpers.memory's trace of the same step on
fake tensors (``predict_cpu_step``). Notebook 05 asks the trace what a CUDA GPU keeps (1-byte dropout masks, the
fused attention kernels); here it is asked what this step keeps where it runs, on the CPU: float dropout masks,
and PyTorch's own choice of attention computation (in training, with dropout, the CPU computes attention step by
step and keeps its probabilities for backward). Both steps start after a warm-up step that creates Adam's state,
on a batch of random tokens without padding.
"""

from __future__ import annotations

import statistics
import time

import torch

from helpers.levers import amp_dtype, enable_checkpointing
from helpers.memory import predict_cpu_step, tracking
from helpers.net import Net
from helpers.step import train_step
from helpers.train import input_device

LEVERS = {"none": {}, "accumulation": {"accumulation": 2}, "checkpointing": {"checkpointing": True},
          "bf16 autocast": {"amp": "bf16"}}
"""The three levers of notebook 05 as options of ``tracked_step`` and ``predict_cpu_step``; "none" for comparison."""


def random_batches(vocab_size: int, batch_size: int, seq_len: int, micro_batches: int = 1, seed: int = 0) -> list:
    """``batch_size`` examples of random tokens without padding, in ``micro_batches`` equal micro-batches."""
    generator = torch.Generator().manual_seed(seed)
    size = batch_size // micro_batches
    return [{"input_ids": torch.randint(0, vocab_size, (size, seq_len), generator=generator),
             "attention_mask": torch.ones(size, seq_len, dtype=torch.long),
             "labels": torch.randint(0, 2, (size,), generator=generator)} for _ in range(micro_batches)]


def step(model, optimizer, batches: list, amp: str | None = None) -> float:
    """One optimizer step as helpers.train takes it (``train_step``) on the micro-batches ``batches``: its loss."""
    return train_step(model, batches, optimizer, amp=amp_dtype(amp))[0]


def tracked_step(model, optimizer, batches: list, amp: str | None = None) -> dict[str, int]:
    """Peak bytes by category of a real step of ``model`` on ``batches`` (micro-batches), after a warm-up step."""
    device = input_device(model)
    batches = [{key: value.to(device) for key, value in batch.items()} for batch in batches]
    model.train()
    warm_up = {key: value[:1, :8] if value.dim() == 2 else value[:1] for key, value in batches[0].items()}
    step(model, optimizer, [warm_up], amp)  # creates Adam's state
    with tracking(model, optimizer) as watch:
        step(model, optimizer, batches, amp)
    return watch.categories("peak")


def seconds_per_step(model, optimizer, batches: list, amp: str | None = None, repeats: int = 3) -> float:
    """The median wall time of ``repeats`` real steps (after one untimed step) of ``model`` on ``batches``."""
    device = input_device(model)
    batches = [{key: value.to(device) for key, value in batch.items()} for batch in batches]
    model.train()
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        step(model, optimizer, batches, amp)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def measure_levers(batch_size: int = 16, seq_len: int = 64, levers: dict = LEVERS, seed: int = 0) -> dict[str, dict]:
    """For each lever: the predicted and tracked peak (bytes by category) and seconds per step on this machine's
    CPU of the model ``Net`` loads (the bundled one unless BERT_MODEL names another), at the same global batch of
    ``batch_size`` examples of ``seq_len`` tokens. The prediction traces that model's own config."""
    rows = {}
    for name, options in levers.items():
        accumulation, amp = options.get("accumulation", 1), options.get("amp")
        torch.manual_seed(seed)
        net = Net(pooler=False)
        config = net.bert.config
        if options.get("checkpointing"):
            enable_checkpointing(net)
        optimizer = torch.optim.Adam(net.parameters(), lr=1e-4, foreach=True)  # as the trace runs it
        batches = random_batches(config.vocab_size, batch_size, seq_len, accumulation, seed)
        rows[name] = {"predicted": predict_cpu_step(config, batch_size, seq_len, accumulation=accumulation,
                                                    checkpointing=bool(options.get("checkpointing")), amp=amp),
                      "tracked": tracked_step(net, optimizer, batches, amp),
                      "seconds": seconds_per_step(net, optimizer, batches, amp)}
    return rows
