"""Choose a BERT model by name or path, and load it with the tokenizer dictionary it was trained with.

One setting picks the model: the ``model`` argument, else the ``BERT_MODEL`` environment variable,
else the tiny Japanese BERT bundled with this package (offline, built by ``helpers.tiny_bert``).
"""

from __future__ import annotations

import importlib
import json
import os
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path

DEFAULT_MODEL = "tiny-japanese-bert"
"""Name of the bundled offline model; any other value is a hub id or a local directory."""

SEED_MODEL = "cl-tohoku/bert-base-japanese-whole-word-masking"
"""The model of the memo this series started from (also published as ``tohoku-nlp/...``)."""

ENV_VAR = "BERT_MODEL"


class ModelNotAvailableError(OSError):
    """The requested model is neither bundled, a local directory, nor reachable on the hub or in its cache."""


class DictionaryNotInstalledError(ModuleNotFoundError):
    """The MeCab dictionary a model's vocabulary was built with is not installed."""


DICTIONARY_PACKAGES = {"ipadic": "ipadic", "unidic_lite": "unidic-lite", "unidic": "unidic"}
"""MeCab dictionary name (as in tokenizer_config.json) -> the pip package that provides it."""


@dataclass(frozen=True)
class ModelChoice:
    """Where to load a model from, and the MeCab dictionary its vocabulary was built with."""

    name: str
    source: str  # what from_pretrained() receives: a hub id or a directory
    mecab_dic: str | None  # "ipadic", "unidic_lite", ... or None when the tokenizer does not use MeCab


def bundled_model_dir() -> Path:
    """Directory of the tiny Japanese BERT shipped inside the package."""
    return Path(str(files("helpers") / "assets" / DEFAULT_MODEL))


def mecab_dic_from_config(tokenizer_config: dict) -> str | None:
    """The MeCab dictionary a tokenizer_config.json implies.

    Configs that name no dictionary were written before transformers 4.46, whose default was IPAdic
    (the v1 Tohoku models). Newer transformers default to unidic-lite, so such models would silently
    be split into other words than they were trained on; we name IPAdic explicitly instead.
    """
    if tokenizer_config.get("word_tokenizer_type") != "mecab":
        return None
    mecab_kwargs = tokenizer_config.get("mecab_kwargs") or {}
    return mecab_kwargs.get("mecab_dic") or "ipadic"


def resolve_model(model: str | None = None) -> ModelChoice:
    """Resolve ``model`` (or ``$BERT_MODEL``, or the bundled default) to a ModelChoice.

    Reads the model's tokenizer_config.json from the local directory, the hub cache or the hub.
    Raises ModelNotAvailableError, naming the model, when none of them has it.
    """
    name = model or os.environ.get(ENV_VAR) or DEFAULT_MODEL
    source = str(bundled_model_dir()) if name == DEFAULT_MODEL else name
    return ModelChoice(name=name, source=source, mecab_dic=mecab_dic_from_config(_tokenizer_config(name, source)))


def _tokenizer_config(name: str, source: str) -> dict:
    from transformers.utils import cached_file

    try:
        cached_file(source, "config.json")  # every model has one, so this raises when the model is not found
        path = cached_file(source, "tokenizer_config.json", _raise_exceptions_for_missing_entries=False)
    except (OSError, ValueError) as error:  # ValueError: a string that is neither a path nor a valid hub id
        raise ModelNotAvailableError(
            f"Model {name!r} is not available here: it is not a local directory, not in the Hugging Face "
            f"cache, and the hub could not be reached ({type(error).__name__}). Download it once on a machine "
            f"with internet access (it is then cached), or pass a local directory; or unset {ENV_VAR} to use "
            f"the bundled offline model {DEFAULT_MODEL!r}."
        ) from None
    if path is None:
        return {}
    return json.loads(Path(path).read_text(encoding="utf-8"))


def load_tokenizer(model: str | ModelChoice | None = None):
    """The model's tokenizer, with the MeCab dictionary its vocabulary was built with."""
    from transformers import AutoTokenizer

    choice = model if isinstance(model, ModelChoice) else resolve_model(model)
    check_dictionary(choice)
    kwargs = {"mecab_kwargs": {"mecab_dic": choice.mecab_dic}} if choice.mecab_dic else {}
    return AutoTokenizer.from_pretrained(choice.source, **kwargs)


def check_dictionary(choice: ModelChoice) -> None:
    """Raise DictionaryNotInstalledError, naming the model and the pip package, if its dictionary is missing."""
    if choice.mecab_dic is None:
        return
    try:
        importlib.import_module(choice.mecab_dic)
    except ModuleNotFoundError:
        package = DICTIONARY_PACKAGES.get(choice.mecab_dic, choice.mecab_dic)
        raise DictionaryNotInstalledError(
            f"Model {choice.name!r} splits words with the MeCab dictionary {choice.mecab_dic!r}, which is not "
            f"installed: `pip install {package}`. Another dictionary "
            f"would split sentences into other words than the model was trained on."
        ) from None


def load_bert(model: str | ModelChoice | None = None, **kwargs):
    """``BertModel.from_pretrained`` for the chosen model; ``kwargs`` go to from_pretrained."""
    from transformers import BertModel

    choice = model if isinstance(model, ModelChoice) else resolve_model(model)
    return BertModel.from_pretrained(choice.source, **kwargs)
