"""Notebook 01's MemoNet is the memo's Net as the memo wrote it, and runs as the notebook says.

The memo is not in the repository, so its class is copied below as it was received (its code had lost its
indentation, so lines are compared without it). Notebook 01 declares exactly two changes: the class name
(``Net`` -> ``MemoNet``, in ``super(...)`` too) and the model name taken as the argument ``source``.
"""

import ast
import json
from pathlib import Path

import pytest
import torch
from torch import nn

from helpers.build.memo_shape import build_memo_shaped_bert
from helpers.models import DEFAULT_MODEL, load_tokenizer, resolve_model

NOTEBOOK = Path(__file__).parents[1] / "notebooks" / "01_define_network.ipynb"
MEMO_NET = """\
class Net(nn.Module):
def __init__(self):
super(Net, self).__init__()
self.bert = BertModel.from_pretrained('cl-tohoku/bert-base-japanese-whole-word-masking')
# ２値分類タスクを仮定します。
self.linear = nn.Linear(768, 2)
def forward(self, input_ids):
vec = self.bert(input_ids)
vec = vec['last_hidden_state']
# 先頭トークンclsのベクトルだけ取得
vec = vec[:,0,:]
vec = vec.view(-1, 768)
vec = self.linear(vec)
# 分類確率を返すようにしてます。
return F.softmax(vec, dim=1)
"""
DECLARED_CHANGES = {
    "class Net(nn.Module):": "class MemoNet(nn.Module):",
    "def __init__(self):": "def __init__(self, source):",
    "super(Net, self).__init__()": "super(MemoNet, self).__init__()",
    "self.bert = BertModel.from_pretrained('cl-tohoku/bert-base-japanese-whole-word-masking')":
        "self.bert = BertModel.from_pretrained(source)",
}
SENTENCES = ["この店のラーメンは最高でした！", "安いけど美味しくない。", "二度と行かない。"]


def memo_cell() -> str:
    cells = json.loads(NOTEBOOK.read_text(encoding="utf-8"))["cells"]
    sources = ["".join(cell["source"]) for cell in cells if cell["cell_type"] == "code"]
    found = [source for source in sources if "class MemoNet(" in source]
    assert len(found) == 1, f"{NOTEBOOK.name}: {len(found)} cells define MemoNet"
    return found[0]


def class_lines(source: str) -> list[str]:
    """The lines of the class statement, unindented, without blank lines (imports above it are not the memo's)."""
    lines = source.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("class MemoNet("))
    return [line.strip() for line in lines[start:] if line.strip()]


def test_memo_net_is_the_memos_net_but_for_the_declared_changes():
    expected = [DECLARED_CHANGES.get(line, line) for line in MEMO_NET.splitlines()]
    assert class_lines(memo_cell()) == expected


def test_memo_net_runs_unchanged_at_the_memos_width_and_stops_at_view_on_the_bundled_model(tmp_path):
    """Notebook 01's trap 1: at width 128, ``view(-1, 768)`` stops for 3 sentences (384 values) and for 6 (768 values,
    but the [CLS] rows are not contiguous); ``reshape``, which the second message suggests, gives one row for six."""
    namespace = {"nn": nn}
    exec(compile(ast.parse(memo_cell()), str(NOTEBOOK), "exec"), namespace)
    memo_net = namespace["MemoNet"]
    build_memo_shaped_bert(tmp_path, num_layers=1, intermediate_size=64, pad_vocab=False)
    batch = load_tokenizer(str(tmp_path))(SENTENCES, padding="longest", return_tensors="pt")
    with torch.no_grad():
        probabilities = memo_net(str(tmp_path))(batch["input_ids"])
    assert probabilities.shape == (3, 2)
    assert torch.allclose(probabilities.sum(dim=1), torch.ones(3)) and (probabilities > 0).all()

    tiny = resolve_model(DEFAULT_MODEL)
    tiny_batch = load_tokenizer(tiny)(SENTENCES, padding="longest", return_tensors="pt")
    tiny_net = memo_net(tiny.source)
    with pytest.raises(RuntimeError, match=r"shape '\[-1, 768\]' is invalid for input of size 384"):
        tiny_net(tiny_batch["input_ids"])
    six = load_tokenizer(tiny)(SENTENCES * 2, padding="longest", return_tensors="pt")["input_ids"]
    with pytest.raises(RuntimeError, match="view size is not compatible with input tensor's size and stride"):
        tiny_net(six)
    with torch.no_grad():
        cls_vectors = tiny_net.bert(six).last_hidden_state[:, 0, :]
        assert tiny_net.linear(cls_vectors.reshape(-1, 768)).shape == (1, 2)
