"""Adam with one learning rate for the pre-trained body and another for the new head, and an audit of it."""

from __future__ import annotations

import torch
from torch import nn


class ParamGroupError(ValueError):
    """An optimizer's parameter groups miss a trainable parameter, repeat one, or hold a stranger."""


def two_lr_adam(net: nn.Module, body_lr: float = 5e-5, head_lr: float = 1e-4) -> torch.optim.Adam:
    """The memo's optimizer: ``net.bert`` at ``body_lr``, ``net.linear`` at ``head_lr``.

    Pass the plain model (``unwrap(net)`` for a wrapped one); each group carries a "name" for audits.
    """
    return torch.optim.Adam([
        {"params": net.bert.parameters(), "lr": body_lr, "name": "bert"},
        {"params": net.linear.parameters(), "lr": head_lr, "name": "linear"},
    ])


def learning_rates_for(config) -> tuple[float, float]:
    """``(body_lr, head_lr)`` for fine-tuning a BERT with this ``config``: the memo's rates from BERT-base's width up.

    The memo's 5e-5 / 1e-4 are for BERT-base (hidden size 768), pre-trained on a large corpus. Adam's step is
    set by the learning rate, not by the gradient's size: about the rate at the first step (for a gradient well
    above eps), then against the sign of the gradient's moving average, and at times larger (at the default betas
    about 3x after a long run of zero gradients, 7.3x at most). An output sums ``hidden_size`` such moves, so a
    narrower model's outputs move less at the same rate: narrower models (the bundled tiny one: 128) get ten
    times both, a rule of thumb that notebook 02's exercise 1 checks, not a derivation. The head always learns
    twice as fast.
    """
    if config.hidden_size >= 768:
        return 5e-5, 1e-4
    return 5e-4, 1e-3


def groups_by_tensor(optimizer: torch.optim.Optimizer) -> dict[int, list[int]]:
    """The indices of the groups holding each tensor of ``optimizer``, keyed by ``id`` (``==`` compares values)."""
    groups: dict[int, list[int]] = {}
    for index, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            groups.setdefault(id(p), []).append(index)
    return groups


def param_group_problems(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """What is wrong with the groups: trainable parameters of ``model`` in no group or in two, and strangers."""
    names = {id(p): name for name, p in model.named_parameters()}
    groups_of = groups_by_tensor(optimizer)
    missing = [name for name, p in model.named_parameters() if p.requires_grad and id(p) not in groups_of]
    repeated = [f"{names.get(key, '?')} (groups {where})" for key, where in groups_of.items() if len(where) > 1]
    strangers = sum(key not in names for key in groups_of)
    problems = [f"not in any group: {abbreviate(missing)}"] if missing else []
    if repeated:
        problems.append(f"in more than one group: {abbreviate(repeated)}")
    if strangers:
        problems.append(f"{strangers} tensor(s) that are not parameters of {type(model).__name__}")
    return problems


def audit_param_groups(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[dict]:
    """Check that every trainable parameter of ``model`` sits in exactly one group; returns param_group_rows.
    Raises ParamGroupError naming the parameters that are missing, in two groups, or not the model's."""
    problems = param_group_problems(model, optimizer)
    if problems:
        raise ParamGroupError("; ".join(problems))
    return param_group_rows(optimizer)


def param_group_rows(optimizer: torch.optim.Optimizer) -> list[dict]:
    """One row per group: its name (or index), how many tensors and parameters it holds, and its learning rate."""
    return [{"group": group.get("name", str(index)), "tensors": len(group["params"]),
             "params": sum(p.numel() for p in group["params"]), "lr": group["lr"]}
            for index, group in enumerate(optimizer.param_groups)]


def format_param_groups(rows: list[dict]) -> str:
    """The rows of ``param_group_rows`` (``audit_param_groups`` returns them) as a fixed-width table."""
    lines = [f"{'group':<10}{'tensors':>8}{'params':>12}{'lr':>10}"]
    lines += [f"{r['group']:<10}{r['tensors']:>8}{r['params']:>12,}{r['lr']:>10.0e}" for r in rows]
    lines.append(f"{'total':<10}{sum(r['tensors'] for r in rows):>8}{sum(r['params'] for r in rows):>12,}")
    return "\n".join(lines)


def abbreviate(names: list[str], limit: int = 5) -> str:
    """The first ``limit`` names, and how many more there are."""
    more = f" ... and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more
