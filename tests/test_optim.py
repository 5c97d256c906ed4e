"""Two learning rates: every trainable parameter in exactly one group, and clear errors otherwise."""

import pytest
import torch
from torch import nn
from transformers import BertConfig

from helpers.optim import ParamGroupError, audit_param_groups, format_param_groups, learning_rates_for, two_lr_adam


class Small(nn.Module):
    """The shape of Net (a body ``bert`` and a head ``linear``) without loading a model."""

    def __init__(self):
        super().__init__()
        self.bert = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 4))
        self.linear = nn.Linear(4, 2)
        self.extra = nn.Linear(4, 4)  # a module two_lr_adam does not know about


def test_two_groups_with_their_rates():
    net = Small()
    del net.extra
    optimizer = two_lr_adam(net)
    rows = audit_param_groups(net, optimizer)
    assert [(r["group"], r["tensors"], r["params"], r["lr"]) for r in rows] == [
        ("bert", 3, 40 + 20, 5e-5), ("linear", 2, 10, 1e-4)]
    table = format_param_groups(rows)
    assert table.splitlines()[-1].split() == ["total", "5", "70"]


def test_forgotten_module_is_named():
    net = Small()
    with pytest.raises(ParamGroupError, match=r"not in any group: extra\.weight, extra\.bias"):
        audit_param_groups(net, two_lr_adam(net))


def test_frozen_parameters_may_stay_out():
    net = Small()
    net.extra.requires_grad_(False)
    assert len(audit_param_groups(net, two_lr_adam(net))) == 2


def test_parameter_in_two_groups_is_named():
    net = Small()
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-3)
    optimizer.param_groups.append({**optimizer.param_groups[0], "params": [net.linear.bias]})
    with pytest.raises(ParamGroupError, match=r"in more than one group: linear\.bias \(groups \[0, 1\]\)"):
        audit_param_groups(net, optimizer)


def test_tensor_from_another_model_is_reported():
    net, other = Small(), nn.Linear(2, 2)
    optimizer = torch.optim.Adam(list(net.parameters()) + [other.weight])
    with pytest.raises(ParamGroupError, match=r"1 tensor\(s\) that are not parameters of Small"):
        audit_param_groups(net, optimizer)


def test_learning_rates_follow_the_width():
    assert learning_rates_for(BertConfig(hidden_size=768)) == (5e-5, 1e-4)  # BERT-base: the memo's rates
    assert learning_rates_for(BertConfig(hidden_size=1024)) == (5e-5, 1e-4)
    assert learning_rates_for(BertConfig(hidden_size=128)) == (5e-4, 1e-3)  # the bundled tiny model
