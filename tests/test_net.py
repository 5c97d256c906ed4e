"""Net: the head's width follows the config, and padding does not change a sentence's logits."""

import torch

from helpers.models import load_tokenizer
from helpers.net import Net


def test_head_width_comes_from_the_config():
    net = Net(num_labels=3)
    assert net.linear.in_features == net.bert.config.hidden_size
    assert net.linear.out_features == 3


def test_padding_does_not_change_the_logits():
    tokenizer, net = load_tokenizer(), Net().eval()
    alone = tokenizer(["二度と行かない。"], return_tensors="pt")
    padded = tokenizer(["二度と行かない。", "この店のラーメンは本当に最高でした！"], padding="longest", return_tensors="pt")
    assert (padded["attention_mask"][0] == 0).any()
    with torch.no_grad():
        expected = net(alone["input_ids"], alone["attention_mask"])[0]
        masked = net(padded["input_ids"], padded["attention_mask"])[0]
        unmasked = net(padded["input_ids"])[0]
    assert torch.allclose(masked, expected, atol=1e-5)
    assert not torch.allclose(unmasked, expected, atol=1e-3)
