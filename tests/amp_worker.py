"""Mixed precision against fp32: the gradients of one optimizer step in fp16 (with helpers.finetune's gradient scaler)
and in bf16, each against one process in fp32 on the whole batch. tests/test_amp.py calls ``gradient_errors`` in a
group of one, and starts this file under torchrun for DDP and FSDP2:

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/amp_worker.py

Rank 0 prints one JSON line: ``{"strategies": [gradient_errors of each]}``.
"""

import copy
import json
import math

import torch
import torch.distributed as dist

from helpers import distributed
from helpers.data import PadToLongest, load_split
from helpers.equivalence import gradients, loss_and_backward, reference_net, share
from helpers.fsdp import prepare, wrap
from helpers.levers import amp_dtype, fsdp_mixed_precision, gradient_scaler
from helpers.models import load_tokenizer
from helpers.step import train_step
from helpers.wrapping import unwrap

EXAMPLES, MICRO_BATCHES = 16, 2
"""One global batch of the first 16 training examples; each rank adds up the gradients of 2 micro-batches."""


def relative_error(mine: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    """||mine - reference|| / ||reference||, every gradient tensor together as one vector."""
    difference = sum((mine[name].double() - reference[name].double()).square().sum().item() for name in reference)
    size = sum(reference[name].double().square().sum().item() for name in reference)
    return math.sqrt(difference / size)


def gradient_errors(strategy: str, examples: list, collate, device: torch.device, seed: int = 0) -> dict:
    """For ``strategy`` ("plain": the model unwrapped, in one process; "ddp"; "fsdp"): one optimizer step on this
    rank's share of ``examples`` in MICRO_BATCHES micro-batches, under ``--amp fp16`` and ``--amp bf16`` as
    helpers.finetune trains (``train_step``: autocast, FSDP2's MixedPrecisionPolicy, fp16's gradient scaler), and the
    gradients the optimizer steps with (seen by a step pre-hook), each as its relative error against one process in
    fp32 on the whole batch (dropout off). Every rank must call it.

    A step whose fp16 gradients overflow is skipped as training skips it (the scaler halves its scale; the optimizer
    never sees it) and taken again; ``skipped`` counts those, ``scale`` is the scale of the step compared. Every rank
    must agree on a skip (FSDP2: the scaler finds inf in any rank's shard on every rank), or they would part ways.
    """
    mine = share(examples, MICRO_BATCHES)
    fp32 = reference_net(None, device, seed)
    loss_and_backward(fp32, collate(mine.examples))
    reference = {name: p.grad for name, p in fp32.named_parameters()}
    result = {"strategy": strategy, "world_size": dist.get_world_size(), "micro_batches": mine.micro_batches,
              "skipped": 0}
    for amp in ("fp16", "bf16"):
        twin = copy.deepcopy(fp32)
        twin.zero_grad(set_to_none=True)
        model = twin if strategy == "plain" else wrap(prepare(twin, strategy, **fsdp_mixed_precision(amp)), strategy,
                                                      device)
        scaler, optimizer = gradient_scaler(amp, device), torch.optim.SGD(unwrap(model).parameters(), lr=0.0)
        stepped_with = {}
        optimizer.register_step_pre_hook(lambda *_: stepped_with.update(gradients(model)))  # lr 0: weights stay
        while True:
            if scaler is not None:
                result["scale"] = scaler.get_scale()
            if train_step(model, mine.batches(collate, device), optimizer, amp=amp_dtype(amp), scaler=scaler)[1]:
                break
            result["skipped"] += 1
        result[amp] = relative_error(stepped_with, reference)  # whole tensors: FSDP2's shards gathered
    return result


def main() -> None:
    device = torch.device("cpu")
    distributed.init_process_group(device)
    examples, collate = load_split("train")[:EXAMPLES], PadToLongest(load_tokenizer())
    results = [gradient_errors(strategy, examples, collate, device) for strategy in ("ddp", "fsdp")]
    if dist.get_rank() == 0:
        print(json.dumps({"strategies": results}), flush=True)
    distributed.leave_process_group()  # its barrier: rank 0 has printed; no gloo thread outlives the group


if __name__ == "__main__":
    main()
