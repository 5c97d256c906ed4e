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
    assert not net.training
    with torch.no_grad():  # every text alone, without padding, softmax written out by hand
        for text, (label, probability) in zip(texts, batched):
            encoded = tokenizer([text], return_tensors="pt")
            logits = net(encoded["input_ids"], encoded["attention_mask"])[0]
            exp = (logits - logits.max()).exp()
            assert (label, probability) == (LABELS[logits.argmax()], pytest.approx((exp / exp.sum()).max().item(),
                                                                                 abs=1e-5))


def test_one_string_instead_of_a_list_is_refused():
    with pytest.raises(TypeError, match=r"^predict: texts must be a list of sentences, got one str; write \['良い'\]"):
        predict(Net(), load_tokenizer(), "良い")


def test_load_classifier_takes_label_names_from_the_checkpoint_and_old_ones_get_the_bundled_labels(tmp_path):
    from helpers.checkpoint import Checkpoints, Progress, read_labels, save_checkpoint
    from helpers.predict import load_classifier

    torch.manual_seed(0)
    three = Net(num_labels=3, pooler=False)
    save_checkpoint(tmp_path / "three", three, labels=("犬", "猫", "鳥"))
    net, labels = load_classifier(tmp_path / "three")
    assert labels == ("犬", "猫", "鳥") and net.linear.out_features == 3 and net.bert.pooler is None
    assert torch.equal(net.linear.weight, three.linear.weight)
    with torch.no_grad():  # the label the saved network itself gives, read from its logits without predict
        encoded = load_tokenizer()(["にゃあ"], return_tensors="pt")
        expected = ("犬", "猫", "鳥")[three.eval()(encoded["input_ids"], encoded["attention_mask"]).argmax()]
    assert [label for label, _ in predict(net, load_tokenizer(), ["にゃあ"], labels=labels)] == [expected]

    save_checkpoint(tmp_path / "old", Net())  # saved without names, as every checkpoint before they were saved
    assert read_labels(tmp_path / "old") is None
    net, labels = load_classifier(tmp_path / "old")
    assert labels == LABELS and net.linear.out_features == 2 and net.bert.pooler is not None

    Checkpoints(tmp_path / "run", labels=("a", "b", "c")).save(three, None, None, Progress(step=1))
    assert read_labels(tmp_path / "run" / "step-000001") == ("a", "b", "c")
