"""Every notebook and solution runs with a model of the memo's shape, as a reader who sets BERT_MODEL runs them.

The model is built here, offline, by helpers.build.memo_shape: hidden size 768, 12 heads and a tokenizer_config
that names no dictionary (so IPAdic is chosen), random weights. One layer instead of twelve, a feed-forward
width of 64 instead of 3072 and only the tokens the bundled sentences use instead of the v1 vocabulary of
32000 keep it fast, and so does HELPERS_MAX_EXAMPLES: every split is cut to its first 96 examples, so the
training runs of 02 and 06 to 08 take a few steps instead of a few hundred (what this checks is that every
cell runs at width 768, not what it prints: the accuracies are not compared). Each notebook is executed in a
temporary copy in a folder of its own (stored outputs are never touched): a cell meant to raise must raise
the exception type it raises with the bundled model, and no other cell may fail. Three notebooks that load
no model on a machine without a GPU are left out (see below), and so are the solutions that train (02, 06 to 09):
they train through the helpers their lessons run here at width 768 (fit, helpers.finetune, the launches), and
together they would add about 70 s to `make test` on 2 cores.
"""

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import nbformat
import pytest
from transformers import BertConfig

from helpers.checks.gpu_check import execute_copy, series_notebooks
from helpers.build.memo_shape import VOCAB_SIZE, build_memo_shaped_bert
from helpers.models import load_bert, load_tokenizer, resolve_model

NOTEBOOK_DIR = Path(__file__).parents[1] / "notebooks"
# On a machine without a GPU these never load the chosen model: the run would repeat the plain one exactly.
# test_model_independent_notebooks_load_no_model checks that claim.
MODEL_INDEPENDENT = {"05_gpu_memory.ipynb", "05_appendix_allocator.ipynb", "solutions/05_solutions.ipynb"}
# Solutions that train through the helpers their lessons already run with this model.
TRAIN_AS_THEIR_LESSONS = {f"solutions/{number}_solutions.ipynb" for number in ("02", "06", "07", "08", "09")}
NOTEBOOKS = [path for path in series_notebooks()
             if path.relative_to(NOTEBOOK_DIR).as_posix() not in MODEL_INDEPENDENT | TRAIN_AS_THEIR_LESSONS]
LOADS_A_MODEL = ("Net(", "load_tokenizer", "load_bert", "from_pretrained", "helpers.finetune", "BERT_MODEL")


@pytest.fixture(scope="session")
def memo_shaped_model(tmp_path_factory):
    """What ``python -m helpers.build.memo_shape`` writes, with one layer: the v1 vocabulary size included."""
    return build_memo_shaped_bert(tmp_path_factory.mktemp("memo-shaped-bert"), num_layers=1)


@pytest.fixture(scope="session")
def memo_shaped_model_for_notebooks(tmp_path_factory):
    """768 wide where it shows, cheap where it does not: one layer, a feed-forward part of 64, and only the
    vocabulary the bundled sentences use (the v1 size's 24.6 M placeholder embedding weights would be
    updated, and all-reduced between processes, at every step)."""
    return build_memo_shaped_bert(tmp_path_factory.mktemp("memo-shaped-bert-small"), num_layers=1,
                                  intermediate_size=64, pad_vocab=False)


def test_model_has_the_memo_shape_and_gets_ipadic(memo_shaped_model):
    config = BertConfig.from_pretrained(memo_shaped_model)
    assert (config.hidden_size, config.num_attention_heads, config.vocab_size) == (768, 12, VOCAB_SIZE)
    tokenizer_config = json.loads((memo_shaped_model / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert "mecab_kwargs" not in tokenizer_config
    choice = resolve_model(str(memo_shaped_model))
    tokenizer = load_tokenizer(choice)
    assert choice.mecab_dic == "ipadic" and len(tokenizer) == VOCAB_SIZE
    assert tokenizer.word_tokenizer.tokenize("東京大学") == ["東京大学"]
    assert tokenizer.unk_token not in tokenizer.tokenize("この店のラーメンは最高でした！")
    assert load_bert(choice).embeddings.word_embeddings.weight.shape == (VOCAB_SIZE, 768)


@pytest.mark.parametrize("name", sorted(MODEL_INDEPENDENT))
def test_model_independent_notebooks_load_no_model(name):
    """A cell that loads the chosen model runs only where a GPU is (its code is under ``if has_gpus(...)``)."""
    for cell in nbformat.read(NOTEBOOK_DIR / name, as_version=4).cells:
        if cell.cell_type == "code" and any(word in cell.source for word in LOADS_A_MODEL):
            assert "if has_gpus(" in cell.source, f"{name}, cell {cell.get('id')} loads a model on any machine"


def errors_of(cell) -> list[str]:
    return [output["ename"] for output in cell.get("outputs", []) if output["output_type"] == "error"]


@pytest.fixture(scope="session")
def executed(memo_shaped_model_for_notebooks, tmp_path_factory) -> dict:
    """Every notebook run with the stand-in, two at a time with one thread each: a small notebook's time is
    mostly one core starting a kernel and importing, so two side by side take about half as long on 2 cores."""
    env = {"BERT_MODEL": str(memo_shaped_model_for_notebooks), "HELPERS_MAX_EXAMPLES": "96",
           "OMP_NUM_THREADS": "1"}  # one core each: two kernels with two threads each would fight
    out_dir = tmp_path_factory.mktemp("executed")

    def run(path):
        target = out_dir / path.relative_to(NOTEBOOK_DIR)
        done = execute_copy(path, target, env)
        return nbformat.read(target, as_version=4) if done.returncode == 0 else None, done.stderr

    # Notebooks that train start first, so that no long one is left running alone at the end.
    order = sorted(NOTEBOOKS, key=lambda path: not any(word in path.read_text(encoding="utf-8")
                                                       for word in ("fit(", "helpers.finetune")))
    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(order, pool.map(run, order)))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.relative_to(NOTEBOOK_DIR).as_posix())
def test_notebook_runs_with_the_memo_shaped_model(path, executed):
    run, messages = executed[path]  # execution stops at the first error in a cell not meant to raise
    assert run is not None, f"{path.name}: a cell not meant to raise failed:\n{messages[-3000:]}"
    stored = nbformat.read(path, as_version=4)
    for before, after in zip(stored.cells, run.cells):
        if "raises-exception" in before.metadata.get("tags", []):
            assert errors_of(after) == errors_of(before), f"{path.name}, cell {before.get('id')}"
