"""Gradient accumulation under DDP and FSDP2, checked: the loop most examples use, the collectives each loop makes
(counted for real), and the gradients of N micro-batches against one process on one batch of all of them.

The right loop is helpers.step.train_step's: it pauses the gradient communication (``no_gradient_sync``) on all
micro-batches but the last, so DDP all-reduces and FSDP2 reduce-scatters once per optimizer step instead of
once per micro-batch. Both loops compute the same gradients; only the traffic differs.
"""

from __future__ import annotations

from collections import Counter
from contextlib import ExitStack, nullcontext

import torch
import torch.distributed as dist
from torch import nn

from helpers.equivalence import (EQUIVALENCE_TOLERANCE, largest_difference, loss_and_backward, parallel_copy,
                                 reference_net, share)
from helpers.memory import tracking
from helpers.torch_private import seeing_fsdp2_collectives
from helpers.step import train_step
from helpers.wrapping import is_sharded


def accumulate_naively(model: nn.Module, batches: list[dict], loss_fn=None) -> float:
    """Gradient accumulation as most examples write it: loss / N and backward on each of N micro-batches.

    The gradients are right when the micro-batches are of equal size, but DDP all-reduces (FSDP2 reduce-scatters)
    in every backward: N times the communication of one batch, where only the last one was needed.
    """
    loss_fn = loss_fn or nn.CrossEntropyLoss()
    total = 0.0
    for batch in batches:
        loss = loss_fn(model(batch["input_ids"], batch["attention_mask"]), batch["labels"]) / len(batches)
        loss.backward()
        total += loss.item()
    return total


class CollectiveCounter:
    """Count the collectives a DDP or FSDP2 model makes while a ``with counter:`` block runs, and their bytes.

    DDP all-reduces its gradient buckets from C++, where Python cannot see them, so a communication hook counts
    each bucket it is handed and then all-reduces it as DDP does (``allreduce_hook``); a DDP model takes one hook
    in its life, so build one counter per model and reuse it. FSDP2 calls its collectives from Python; they are
    watched during the block (``helpers.torch_private.seeing_fsdp2_collectives``). Bytes are
    those of the tensor handed to the collective on this process: a bucket, the full gradients to reduce-scatter,
    the full gathered weights. A group of one process: DDP still all-reduces; FSDP2 skips its collectives.
    The counter keeps no reference to the model: DDP's C++ reducer holds the hook's state (this counter), a
    cycle the garbage collector cannot see, so a counter holding its model would keep it alive after ``del``.
    """

    def __init__(self, model: nn.Module):
        self.sharded = is_sharded(model)
        self.calls, self.bytes = Counter(), Counter()
        self.active = False
        self._watching = ExitStack()
        if isinstance(model, nn.parallel.DistributedDataParallel):
            model.register_comm_hook(self, count_and_all_reduce)

    def add(self, name: str, tensor: torch.Tensor) -> None:
        self.calls[name] += 1
        self.bytes[name] += tensor.numel() * tensor.element_size()

    def __enter__(self) -> CollectiveCounter:
        self.calls.clear()
        self.bytes.clear()
        self.active = True
        if self.sharded:
            self._watching.enter_context(seeing_fsdp2_collectives(self.add))
        return self

    def __exit__(self, *exc) -> None:
        self.active = False
        self._watching.close()

    def summary(self) -> dict:
        return {name: {"calls": self.calls[name], "bytes": self.bytes[name]} for name in sorted(self.calls)}


def count_and_all_reduce(counter, bucket):  # no annotations: DDP checks them, and this module's are strings
    """DDP communication hook: count the bucket (while the counter is active), then all-reduce it as DDP would."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    if counter.active:
        counter.add("all-reduce", bucket.buffer())
    return allreduce_hook(None, bucket)


LOOPS = {"no_gradient_sync": train_step, "naive": accumulate_naively}
"""Each loop called as ``loop(model, batches)``: train_step without an optimizer leaves the gradients in ``.grad``."""


def compare_accumulation(model: str | None, examples: list, collate, device: torch.device, strategy: str = "ddp",
                         accumulation: int = 4, seed: int = 0) -> dict:
    """One optimizer step's gradients from ``accumulation`` micro-batches per rank, added up by each loop of
    LOOPS under ``strategy``, against one process on all ``examples`` in one batch (dropout off, as in
    helpers.equivalence); with the collectives each loop made and, for FSDP2, the bytes by category this rank holds
    as the second micro-batch begins (gradients: whole while the sync is paused). Every rank must call it.

    Each rank takes len(examples) // world_size of them (a remainder is left out), in equal micro-batches.
    """
    mine = share(examples, accumulation, equal=True)
    one_process = reference_net(model, device, seed)
    loss_and_backward(one_process, collate(mine.examples))
    reference = {name: p.grad for name, p in one_process.named_parameters()}
    batches = mine.batches(collate, device)
    result = {"strategy": strategy, "world_size": dist.get_world_size(), "micro_batches": accumulation,
              "micro_batch_size": mine.micro_batch_size, "global_batch_size": len(mine.examples),
              "parameters": sum(p.numel() for p in one_process.parameters())}
    for loop, run in LOOPS.items():
        parallel = parallel_copy(one_process, strategy, device)
        counter, sharded = CollectiveCounter(parallel), is_sharded(parallel)
        if not sharded:  # after a first step, DDP has ordered its buckets as backward fills them
            run(parallel, batches)
            parallel.zero_grad(set_to_none=True)
        held = tracking(parallel) if sharded else nullcontext()  # FSDP2: what a micro-batch leaves held
        with counter, held as watch:
            run(parallel, batches)
        result[loop] = {"max_abs_grad_diff": largest_difference(parallel, reference),
                        "collectives": counter.summary()}
        if sharded:  # what FSDP2 holds from one micro-batch to the next: whole gradients while the sync is paused
            result[loop]["between_micro_batches"] = watch.starts[1]
    return result


def describe_collectives(collectives: dict, gradient_bytes: int) -> str:
    """A ``CollectiveCounter.summary()`` in words: each kind's calls and MiB, and for those that carry gradients,
    how many times the gradients' bytes that is (the rounds over all of them)."""
    return "; ".join(f"{kind} {entry['calls']} calls, {entry['bytes'] / 2**20:.2f} MiB" + (
        "" if kind == "all-gather" else f" = {entry['bytes'] / gradient_bytes:.1f} x the gradients")
        for kind, entry in collectives.items()) or "no collectives"


def accumulation_lines(result: dict) -> list[str]:
    """``compare_accumulation``'s result in words, at a precision that does not depend on the CPU: per loop, whether
    the gradients are those of one batch, the collectives, and (FSDP2) the gradients held between micro-batches."""
    name, tolerance = result["strategy"].upper(), EQUIVALENCE_TOLERANCE
    lines = [f"{name}: {result['world_size']} process(es) x {result['micro_batches']} micro-batches of "
             f"{result['micro_batch_size']} = global batch {result['global_batch_size']}, one optimizer step"]
    for loop in LOOPS:
        row = result[loop]
        held = row.get("between_micro_batches")
        lines.append(f"  {loop:<17} gradients = one batch (<= {tolerance:g}): {row['max_abs_grad_diff'] <= tolerance}"
                     f" | {describe_collectives(row['collectives'], 4 * result['parameters'])}"
                     + (f" | gradients held between micro-batches: {held['gradients'] / 2**20:.2f} MiB"
                        if held else ""))
    return lines
