"""Net: the head's width follows the config, and padding does not change a sentence's logits."""

import torch
from transformers import BertModel

from helpers.models import load_tokenizer, resolve_model
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


def test_without_pooler_net_holds_what_add_pooling_layer_false_builds_and_computes_the_same():
    torch.manual_seed(0)
    with_pooler = Net()
    torch.manual_seed(0)
    without = Net(pooler=False)
    assert without.bert.pooler is None
    expected = BertModel.from_pretrained(resolve_model().source, add_pooling_layer=False)
    assert [name for name, _ in without.bert.named_parameters()] == [name for name, _ in expected.named_parameters()]
    pooler = sum(p.numel() for p in with_pooler.bert.pooler.parameters())
    assert sum(p.numel() for p in without.parameters()) == sum(p.numel() for p in with_pooler.parameters()) - pooler
    batch = load_tokenizer()(["二度と行かない。", "最高でした！"], padding="longest", return_tensors="pt")
    with torch.no_grad():  # forward never used the pooler, so dropping it changes no logit
        assert torch.equal(with_pooler.eval()(batch["input_ids"], batch["attention_mask"]),
                           without.eval()(batch["input_ids"], batch["attention_mask"]))
