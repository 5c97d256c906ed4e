"""fp16 mixed precision (``--amp fp16``): autocast with a gradient scaler, in one process, under 2-process DDP and
under 2-process FSDP2, with gradient accumulation; skipped steps counted and logged; the scaler's state carried
through a resume; which precision a device gets and why.

The gradients are compared with one process in fp32 within a tolerance derived, not picked. To first order,
mixed precision perturbs the gradients by rounding errors proportional to the unit roundoff u of the type
(fp16 2**-11, bf16 2**-8), made at the same places for both (autocast's lists of operations do not depend on the
type; FSDP2's policy rounds the same weights): |g - g_fp32| ~= c x u x |g_fp32| (norms over every gradient
together), with c set by the model, the batch and the strategy. The same step in bf16 measures c; fp16 passes if
its c is at most twice that (two different draws of rounding errors: measured fp16/bf16 ratios of c 0.75-1.15),
that is if err_fp16 <= 2 x (2**-11 / 2**-8) x err_bf16 = err_bf16 / 4. A mistake in the scaler, the accumulation
or the averaging adds an error that does not shrink with u, which then fails by far (measured: err_fp16 / err_bf16
0.09-0.14; errors 0.7-5.6 u_fp16, the larger under FSDP2, whose policy also rounds layer norms and embeddings).
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from transformers import get_linear_schedule_with_warmup, set_seed

from amp_worker import EXAMPLES, gradient_errors
from helpers import distributed, levers
from helpers.checkpoint import STATE_FILE, Checkpoints, state_dicts_equal
from helpers.data import PadToLongest, load_split, make_loader
from helpers.launch import last_json
from helpers.models import load_tokenizer
from helpers.net import Net
from helpers.optim import two_lr_adam
from helpers.step import train_step
from helpers.train import fit, train_epoch

UNIT_ROUNDOFF = {"fp16": 2.0**-11, "bf16": 2.0**-8}
SAME_ERROR_DRAW = 2  # how much fp16's c may exceed bf16's (module docstring)
TOLERANCE_OVER_BF16 = SAME_ERROR_DRAW * UNIT_ROUNDOFF["fp16"] / UNIT_ROUNDOFF["bf16"]  # err_fp16 <= this x err_bf16
WORKER = Path(__file__).parent / "amp_worker.py"
ENV = os.environ | {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1",
                    "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
OVERFLOWING_SCALE = 2.0**20
"""An initial scale at which the bundled model's first fp16 steps overflow (its gradients fit below about 2**17)."""


def within_fp16_rounding(result: dict) -> None:
    assert result["fp16"] <= TOLERANCE_OVER_BF16 * result["bf16"], result
    assert result["fp16"] > 2.0**-16, result  # fp16 really rounded: fp32 alone differs by about 2**-23


def test_fp16_gradients_in_one_process_are_fp32s_within_fp16s_rounding():
    distributed.init_process_group(torch.device("cpu"))  # a group of one, for the batch's share
    try:
        result = gradient_errors("plain", load_split("train")[:EXAMPLES], PadToLongest(load_tokenizer()),
                                 torch.device("cpu"))
    finally:
        dist.destroy_process_group()
    assert (result["micro_batches"], result["skipped"], result["scale"]) == (2, 0, 2.0**16)
    within_fp16_rounding(result)


def test_fp16_gradients_under_two_process_ddp_and_fsdp2_are_fp32s_within_fp16s_rounding():
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(WORKER)]
    run = subprocess.run(command, env=ENV, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    results = last_json(run.stdout)["strategies"]
    assert [(r["strategy"], r["world_size"], r["micro_batches"]) for r in results] == [("ddp", 2, 2), ("fsdp", 2, 2)]
    for result in results:
        within_fp16_rounding(result)
        assert result["scale"] == 2.0**16 / 2 ** result["skipped"]  # each skip halved it, on both ranks alike


def small_run(scale: float = OVERFLOWING_SCALE, examples: int = 32):
    """Net, two-learning-rate Adam with a linear schedule and a gradient scaler, on batches of 4."""
    set_seed(0)
    loader = make_loader(load_split("train")[:examples], load_tokenizer(), 4, shuffle=True)
    net = Net(pooler=False)
    optimizer = two_lr_adam(net)
    scheduler = get_linear_schedule_with_warmup(optimizer, 0, 2 * len(loader))  # no warm-up: no step of lr 0
    return net, loader, optimizer, scheduler, torch.amp.GradScaler("cpu", init_scale=scale)


def test_a_step_whose_fp16_gradients_overflow_is_skipped_and_changes_no_weight():
    net, loader, optimizer, scheduler, scaler = small_run()
    taken, steps = [], []
    optimizer.register_step_post_hook(lambda *_: taken.append(len(steps)))  # Adam really stepped
    before = {name: p.detach().clone() for name, p in net.named_parameters()}

    def after_step(loss, batches, updated):
        now = {name: p.detach().clone() for name, p in net.named_parameters()}
        steps.append({"updated": updated, "weights changed": not state_dicts_equal(now, steps[-1]["weights"] if steps
                                                                                     else before), "weights": now})

    train_epoch(net, loader, optimizer, scheduler, amp=torch.float16, scaler=scaler, after_step=after_step)
    skipped = [index for index, step in enumerate(steps) if not step["updated"]]
    assert 0 < len(skipped) < len(steps) == 8  # some skipped, some taken
    assert [step["weights changed"] for step in steps] == [step["updated"] for step in steps]
    assert taken == [index for index in range(len(steps)) if index not in skipped]
    assert scaler.get_scale() == OVERFLOWING_SCALE / 2 ** len(skipped)  # halved at each skip, never grown
    assert scheduler.last_epoch == len(taken)  # the schedule moved on with the updates only


def test_fit_counts_and_logs_skipped_steps(capsys):
    net, loader, optimizer, scheduler, scaler = small_run()
    history = fit(net, loader, loader, optimizer, scheduler, epochs=2, amp=torch.float16, scaler=scaler)
    lines = capsys.readouterr().out.splitlines()
    skips = [re.fullmatch(r"step (\d+): inf or nan in the gradients, update skipped; gradient scale lowered to "
                          r"(\d+) \((\d+) skipped so far\)", line) for line in lines if not line.startswith("epoch")]
    assert all(skips), lines
    skipped = sum(row["skipped_steps"] for row in history)
    assert 0 < skipped == len(skips)
    assert [int(skip[3]) for skip in skips] == list(range(1, skipped + 1))
    assert [int(skip[2]) for skip in skips] == [OVERFLOWING_SCALE / 2**count for count in range(1, skipped + 1)]
    assert scaler.get_scale() == OVERFLOWING_SCALE / 2**skipped
    for row, line in zip(history, (line for line in lines if line.startswith("epoch")), strict=True):
        assert line.endswith(f"  {row['skipped_steps']} step(s) skipped") == (row["skipped_steps"] > 0), line


def test_fit_refuses_fp16_without_a_gradient_scaler():
    net, loader, optimizer, scheduler, _ = small_run()
    with pytest.raises(ValueError, match=r"^fit: amp=torch.float16 needs a gradient scaler"):
        fit(net, loader, loader, optimizer, scheduler, epochs=1, amp=torch.float16)


class Stopped(Exception):
    pass


class StopAfterFirstSave(Checkpoints):
    """Checkpoints that stop the run right after its first save, as a kill would."""

    def save(self, *args, **kwargs):
        super().save(*args, **kwargs)
        raise Stopped


def test_a_resumed_fp16_run_goes_on_with_the_saved_scale_and_ends_bitwise(tmp_path):
    """The first steps are skipped (the initial scale overflows) before the checkpoint: a resumed run that started
    from a fresh scaler again would skip them again, and end elsewhere."""
    def run(checkpoints):
        net, loader, optimizer, scheduler, scaler = small_run(examples=24)
        history = fit(net, loader, loader, optimizer, scheduler, epochs=2, checkpoints=checkpoints,
                      amp=torch.float16, scaler=scaler)
        return net, history, scaler

    with pytest.raises(Stopped):
        run(StopAfterFirstSave(tmp_path, every=3))
    saved = torch.load(Checkpoints(tmp_path).latest() / STATE_FILE, weights_only=True)
    assert saved["progress"]["skipped_steps"] > 0 and saved["scaler"]["scale"] < OVERFLOWING_SCALE
    resumed, resumed_history, resumed_scaler = run(Checkpoints(tmp_path, every=3))
    net, history, scaler = run(None)
    assert state_dicts_equal(resumed.state_dict(), net.state_dict())
    assert [row["skipped_steps"] for row in resumed_history] == [row["skipped_steps"] for row in history]
    assert [row["train_loss"] for row in resumed_history] == [row["train_loss"] for row in history]
    assert resumed_scaler.state_dict() == scaler.state_dict()


class Product(torch.nn.Module):
    """One weight per input feature, no bias: ``input_ids`` is a float batch here, and logits are its products."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 1, bias=False)

    def forward(self, input_ids, attention_mask=None):
        return self.linear(input_ids)


def test_fp16_keeps_a_gradient_below_its_range_only_with_the_scaler_it_gets_and_bf16_and_fp32_need_none():
    """A loss of 2**-26 x the sum of 4 logits, in fp32 as autocast computes losses, gives each weight the gradient
    4 x 2**-26 = 2**-24, computed here by hand. Into fp16's matrix product the logits' gradient, 2**-26, is below
    fp16's smallest number (2**-24) and rounds to zero, unless the scaler ``gradient_scaler("fp16")`` gives
    multiplies the loss first (and divides the gradient again before the update); bf16, with fp32's range, and fp32
    keep it without the scaler they get (none). Seen by the optimizer, in a real ``train_step`` on this CPU."""
    batch = {"input_ids": torch.ones(4, 4), "labels": torch.zeros(4)}
    stepped_with = {}
    for name, choice in (("fp32", None), ("bf16", "bf16"), ("fp16", "fp16"), ("fp16 without its scaler", "fp16")):
        model = Product()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        optimizer.register_step_pre_hook(lambda *_, name=name, model=model: stepped_with.update(
            {name: model.linear.weight.grad.unique().tolist()}))
        scaler = None if name.endswith("without its scaler") else levers.gradient_scaler(choice, torch.device("cpu"))
        train_step(model, [batch], optimizer, loss_fn=lambda logits, labels: logits.float().sum() * 2.0**-26,
                   amp=levers.amp_dtype(choice), scaler=scaler)
    assert stepped_with == {"fp32": [2.0**-24], "bf16": [2.0**-24], "fp16": [2.0**-24],
                            "fp16 without its scaler": [0.0]}
