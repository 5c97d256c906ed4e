"""Model choice: one setting selects the model, and the tokenizer gets the dictionary it was trained with."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from helpers.models import (DEFAULT_MODEL, SEED_MODEL, DictionaryNotInstalledError, ModelNotAvailableError,
                            bundled_model_dir, load_tokenizer, mecab_dic_from_config, resolve_model)

V1_CONFIG = {"do_lower_case": False, "word_tokenizer_type": "mecab", "subword_tokenizer_type": "wordpiece",
             "tokenizer_class": "BertJapaneseTokenizer"}  # as written before transformers 4.46: no dictionary named
V3_CONFIG = V1_CONFIG | {"mecab_kwargs": {"mecab_dic": "unidic_lite"}}


def fake_hub_cache(cache, repo_id, tokenizer_config):
    """A Hugging Face hub cache holding ``repo_id`` (the tiny model's files under another name)."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / ("0" * 40)
    shutil.copytree(bundled_model_dir(), snapshot)
    (snapshot / "tokenizer_config.json").write_text(json.dumps(tokenizer_config), encoding="utf-8")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)


def run_offline(code, cache, **env):
    """Run ``code`` in a fresh interpreter with the hub offline and ``cache`` as its cache."""
    env = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache), "PATH": "/usr/bin:/bin"} | env
    if "PYTHONPATH" in os.environ:  # a checkout's src/ given explicitly
        env.setdefault("PYTHONPATH", os.environ["PYTHONPATH"])
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)


def test_default_is_the_bundled_model_with_unidic_lite(monkeypatch):
    monkeypatch.delenv("BERT_MODEL", raising=False)
    choice = resolve_model()
    assert (choice.name, choice.mecab_dic) == (DEFAULT_MODEL, "unidic_lite")
    assert load_tokenizer().word_tokenizer.tokenize("東京大学") == ["東京", "大学"]


@pytest.mark.parametrize(("config", "expected"), [
    (V1_CONFIG, "ipadic"),
    (V3_CONFIG, "unidic_lite"),
    ({"word_tokenizer_type": "mecab", "mecab_kwargs": {"mecab_dic": None}}, "ipadic"),
    ({"tokenizer_class": "BertTokenizer"}, None),
    ({}, None),
])
def test_dictionary_from_tokenizer_config(config, expected):
    assert mecab_dic_from_config(config) == expected


def test_seed_model_from_cache_is_tokenized_with_ipadic(tmp_path):
    fake_hub_cache(tmp_path, SEED_MODEL, V1_CONFIG)
    code = ("from helpers.models import load_tokenizer, resolve_model\n"
            "print(resolve_model().mecab_dic, load_tokenizer().word_tokenizer.tokenize('東京大学'))")
    result = run_offline(code, tmp_path, BERT_MODEL=SEED_MODEL)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ipadic ['東京大学']"


def test_argument_overrides_environment(tmp_path):
    fake_hub_cache(tmp_path, "tohoku-nlp/bert-base-japanese-v3", V3_CONFIG)
    code = ("from helpers.models import resolve_model\n"
            "print(resolve_model('tohoku-nlp/bert-base-japanese-v3').mecab_dic)")
    result = run_offline(code, tmp_path, BERT_MODEL="someone/else")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "unidic_lite"


def test_missing_model_gives_one_clear_error(tmp_path):
    code = "from helpers.models import resolve_model\nresolve_model()"
    result = run_offline(code, tmp_path, BERT_MODEL=SEED_MODEL)
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line.startswith("helpers.models.ModelNotAvailableError: Model 'cl-tohoku/bert-base-japanese-whole")
    assert "unset BERT_MODEL to use the bundled offline model 'tiny-japanese-bert'" in last_line
    assert "Traceback" in result.stderr and result.stderr.count("Traceback") == 1  # no chained hub traceback


def test_a_path_that_does_not_exist_is_reported(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotAvailableError, match=r"Model '\./no/such/model' is not available here"):
        resolve_model("./no/such/model")


def test_a_missing_dictionary_names_the_model_and_the_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "unidic_lite", None)  # makes `import unidic_lite` fail as if not installed
    with pytest.raises(DictionaryNotInstalledError, match=(
            r"^Model 'tiny-japanese-bert' splits words with the MeCab dictionary 'unidic_lite', which is not "
            r"installed: `pip install unidic-lite`")):
        load_tokenizer()


def test_offline_the_message_says_the_hub_is_switched_off(tmp_path):
    code = "from helpers.models import resolve_model\nresolve_model()"
    result = run_offline(code, tmp_path, BERT_MODEL="no-such-org/no-such-model")
    assert (f"Model 'no-such-org/no-such-model' is not available here: it is not a local directory and not in the "
            f"Hugging Face cache ({tmp_path}), and the hub is switched off here (HF_HUB_OFFLINE=1).") in result.stderr


def test_an_unreachable_hub_fails_at_once_without_retries(tmp_path):
    code = "from helpers.models import resolve_model\nresolve_model()"
    # port 9 (discard) on loopback: nothing listens, the connection is refused at once
    result = run_offline(code, tmp_path, BERT_MODEL="no-such-org/no-such-model", HF_HUB_OFFLINE="0",
                         HF_ENDPOINT="http://127.0.0.1:9")
    assert ("is not available here: it is not a local directory, not in the Hugging Face cache, and the hub "
            "(http://127.0.0.1:9) could not be reached (ConnectError)") in result.stderr
    # huggingface_hub's download retries a refused connection 5 times, sleeping 1+2+4+8+8 s and logging 11 lines
    assert "Retry" not in result.stderr and "thrown while requesting" not in result.stderr
