"""An optimizer's state under its parameters' names, and the state an optimizer of its class keeps for each one.

torch's optimizers number their parameters (0, 1, ... in the order of ``param_groups``); a checkpoint names them as
the model does, so that the state loads into the same model in any wrapping. DCP's ``get_state_dict`` names them too,
but first gives an optimizer that has not stepped its state with a step of learning rate 0, which runs the
optimizer's step hooks and creates state on it: these functions touch nothing but what they are asked about.
"""

from __future__ import annotations

import torch
from torch import nn

from helpers.torch_private import step_without_hooks
from helpers.wrapping import unwrap

KERNEL_SETTINGS = {"foreach": False, "fused": False, "capturable": False, "differentiable": False}
"""Settings that choose how a step is computed (which kernel, on which device), not what state it keeps: a step on
shapes alone (the meta device) runs only with these off."""


def parameter_names(model: nn.Module, optimizer) -> list[list[str]]:
    """The name in ``model`` (any wrapping) of each tensor of ``optimizer``, group by group; ValueError naming the
    groups where a tensor is not a parameter of the model."""
    names = {id(p): name for name, p in unwrap(model).named_parameters()}
    found = [[names.get(id(p)) for p in group["params"]] for group in optimizer.param_groups]
    strangers = [index for index, group in enumerate(found) if None in group]
    if strangers:
        raise ValueError(f"the optimizer's groups {strangers} hold tensors that are not parameters of "
                         f"{type(unwrap(model)).__name__}")
    return found


def named_state(model: nn.Module, optimizer) -> dict:
    """``optimizer.state_dict()`` with each parameter's name in ``model`` in place of its number: the optimizer state a
    checkpoint holds. An optimizer that has not stepped has an empty ``state``."""
    numbered = optimizer.state_dict()
    name_of = {number: name for packed, names in zip(numbered["param_groups"], parameter_names(model, optimizer))
               for number, name in zip(packed["params"], names)}
    return {"state": {name_of[number]: stats for number, stats in numbered["state"].items()},
            "param_groups": [group | {"params": [name_of[number] for number in group["params"]]}
                             for group in numbered["param_groups"]]}


def numbered_state(saved: dict, model: nn.Module, optimizer) -> dict:
    """The ``named_state`` ``saved`` with numbers again, as ``optimizer.load_state_dict`` takes it; its groups hold the
    parameters of ``optimizer``'s, in that order (the checks before loading made sure)."""
    number_of: dict[str, int] = {}
    for name in (name for group in parameter_names(model, optimizer) for name in group):
        number_of.setdefault(name, len(number_of))
    return {"state": {number_of[name]: stats for name, stats in saved["state"].items()},
            "param_groups": [group | {"params": [number_of[name] for name in group["params"]]}
                             for group in saved["param_groups"]]}


def describe(value) -> tuple | type:
    """A state entry as the checks compare it: a tensor's ("tensor", shape, dtype), or the type of anything else."""
    if isinstance(value, torch.Tensor):
        return "tensor", tuple(value.shape), value.dtype
    return type(value)


def kept_state(optimizer) -> list[list[dict[str, tuple | type]]]:
    """What ``optimizer``'s class keeps for each of its parameters once it has stepped, group by group: each entry
    ``describe``d.

    Learnt from a new optimizer of the same class and settings over copies of the parameters that have only a shape
    and a dtype (the meta device), given zero gradients and stepped once without hooks (``step_without_hooks``):
    ``optimizer``, its parameters and every hook stay untouched. One copy stands for all parameters of a group with
    the same shape and dtype.
    """
    groups, stands_for = [], []
    for group in optimizer.param_groups:
        copies: dict[tuple, torch.Tensor] = {}
        for p in group["params"]:
            key = (tuple(p.shape), p.dtype)
            if key not in copies:
                copies[key] = torch.empty(key[0], dtype=p.dtype, device="meta", requires_grad=p.dtype.is_floating_point)
                if p.dtype.is_floating_point:
                    copies[key].grad = torch.zeros_like(copies[key])
        groups.append(group | {"params": list(copies.values())}
                      | {name: off for name, off in KERNEL_SETTINGS.items() if name in group})
        stands_for.append([copies[(tuple(p.shape), p.dtype)] for p in group["params"]])
    private = type(optimizer)(groups)
    step_without_hooks(private)
    return [[{name: describe(value) for name, value in private.state.get(copy, {}).items()} for copy in group]
            for group in stands_for]
