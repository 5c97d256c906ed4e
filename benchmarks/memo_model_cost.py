"""What the memo's model costs next to the bundled tiny one: parameters, training memory, time per step.

Both models are measured side by side in one run, on this machine's CPU, with notebook 02's batches
(32 sentences of the bundled training split, padded to the longest). Times are CPU seconds of this
process, which stay meaningful on a machine shared with other jobs; with one thread (the default) they
are what one core needs. The memo's model is stood in for
by a randomly initialised model of its exact shape (helpers.build.memo_shape; the cost does not depend on
the weights), so nothing is downloaded.

    python benchmarks/memo_model_cost.py [--repeats 3] [--layers 12] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
from torch import nn

import common  # benchmarks/common.py: the machine and its load
from helpers.data import load_split, make_loader
from helpers.build.memo_shape import build_memo_shaped_bert
from helpers.models import DEFAULT_MODEL, load_tokenizer
from helpers.net import Net
from helpers.optim import learning_rates_for, two_lr_adam

ADAM_BYTES_PER_PARAM = 16  # fp32: weights 4 + gradients 4 + Adam's two moments 8
STEPS_IN_02 = 2 * 77  # notebook 02: 2 epochs of 77 batches


def saved_activation_bytes(net: nn.Module, batch: dict) -> int:
    """Bytes autograd keeps for the backward pass of one training forward (parameters left out)."""
    parameters = {p.untyped_storage().data_ptr() for p in net.parameters()}
    storages = {}

    def keep(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    net.train()
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        net(batch["input_ids"], batch["attention_mask"]).sum()
    return sum(storages.values())


def cpu_seconds(action) -> float:
    """CPU time of ``action`` in this process: unlike wall time, it does not grow when other jobs share the CPU."""
    start = time.process_time()
    action()
    return time.process_time() - start


def measure(model: str, repeats: int) -> dict:
    torch.manual_seed(0)
    tokenizer, net = load_tokenizer(model), Net(model)
    batch = next(iter(make_loader(load_split("train")[:32], tokenizer, batch_size=32)))
    optimizer = two_lr_adam(net, *learning_rates_for(net.bert.config))

    def forward_backward():
        nn.functional.cross_entropy(net(batch["input_ids"], batch["attention_mask"]), batch["labels"]).backward()

    forward_backward()  # warm-up
    optimizer.step()  # creates Adam's state
    optimizer.zero_grad()
    times = {"forward_backward_s": [], "optimizer_s": []}
    for _ in range(repeats):
        times["forward_backward_s"].append(cpu_seconds(forward_backward))
        times["optimizer_s"].append(cpu_seconds(optimizer.step))
        optimizer.zero_grad()
    n_params = sum(p.numel() for p in net.parameters())
    return {
        "params": n_params,
        "train_state_gib": n_params * ADAM_BYTES_PER_PARAM / 2**30,
        "activations_gib": saved_activation_bytes(net, batch) / 2**30,
        "tokens": tuple(batch["input_ids"].shape),
        **{key: statistics.median(values) for key, values in times.items()},
    }


def step_seconds(row: dict) -> float:
    return row["forward_backward_s"] + row["optimizer_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layers", type=int, default=12, help="layers of the memo-shaped model (the real one: 12)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: CPU seconds = one core's seconds)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"machine: {common.machine()}")
    print(f"CPU seconds, medians of {args.repeats}")
    with tempfile.TemporaryDirectory() as scratch:
        memo = str(build_memo_shaped_bert(scratch, num_layers=args.layers))
        rows = {"tiny": measure(DEFAULT_MODEL, args.repeats),
                f"memo-shaped ({args.layers} layers)": measure(memo, args.repeats)}
    print(f"{'model':<26}{'params':>13}{'weights+grads+Adam':>20}{'activations':>13}{'batch':>10}"
          f"{'fwd+bwd':>10}{'Adam step':>11}{'02 training':>13}  (CPU time)")
    for name, r in rows.items():
        step = step_seconds(r)
        print(f"{name:<26}{r['params']:>13,}{r['train_state_gib']:>16.2f} GiB{r['activations_gib']:>9.2f} GiB"
              f"{str(r['tokens']):>10}{r['forward_backward_s']:>9.2f}s{r['optimizer_s']:>10.2f}s"
              f"{step * STEPS_IN_02 / 60:>9.1f} min")
    tiny, memo = rows.values()
    print(f"ratio memo/tiny: params {memo['params'] / tiny['params']:.0f}x, "
          f"step time {step_seconds(memo) / step_seconds(tiny):.0f}x")
    print(f"load average at end {common.load_average()}")


if __name__ == "__main__":
    main()
