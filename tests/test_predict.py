"""predict(): labels and probabilities that agree with the model's own logits, in any batch size."""

import pytest
import torch

from helpers.data import LABELS, load_split
from helpers.models import load_tokenizer
from helpers.net import Net
from helpers.predict import predict


def test_predictions_match_the_logits_whatever_the_batch_size():
    torch.manual_seed(0)
    net, tokenizer = Net(), load_tokenizer()
    texts = [example.text for example in load_split("test")[:10]]
    one_by_one = predict(net, tokenizer, texts, batch_size=1)
    batched = predict(net, tokenizer, texts, batch_size=4)
    assert [label for label, _ in one_by_one] == [label for label, _ in batched]
    assert [p for _, p in one_by_one] == pytest.approx([p for _, p in batched], abs=1e-5)
    with torch.no_grad():
        encoded = tokenizer(texts[:1], return_tensors="pt")
        probabilities = net(encoded["input_ids"], encoded["attention_mask"]).softmax(-1)[0]
    assert one_by_one[0] == (LABELS[probabilities.argmax()], pytest.approx(probabilities.max().item(), abs=1e-6))
    assert all(0.5 <= p <= 1.0 for _, p in batched)
    assert not net.training


def test_one_string_instead_of_a_list_is_refused():
    with pytest.raises(TypeError, match=r"^predict: texts must be a list of sentences, got one str; write \['良い'\]"):
        predict(Net(), load_tokenizer(), "良い")
