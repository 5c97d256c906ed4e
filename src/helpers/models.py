"""Choose a BERT model by name or path, and load it with the tokenizer dictionary it was trained with.

One setting picks the model: the ``model`` argument, else the ``BERT_MODEL`` environment variable,
else the tiny Japanese BERT bundled with this package (offline, built by ``helpers.build.tiny_bert``).
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

    if not Path(source).is_dir() and _in_hub_cache(source) is None:
        problem = _hub_problem(source)
        if problem:
            raise ModelNotAvailableError(
                f"Model {name!r} is not available here: {problem}. Download it once on a machine with internet "
                f"access (it is then cached), or pass a local directory; or unset {ENV_VAR} to use the bundled "
                f"offline model {DEFAULT_MODEL!r}.")
    path = cached_file(source, "tokenizer_config.json", _raise_exceptions_for_missing_entries=False)
    if path is None:
        return {}
    return json.loads(Path(path).read_text(encoding="utf-8"))


def _in_hub_cache(source: str) -> str | None:
    """The cached config.json of hub model ``source``, or None; never touches the network."""
    from transformers.utils import cached_file

    try:  # every model has a config.json
        return cached_file(source, "config.json", local_files_only=True, _raise_exceptions_for_missing_entries=False)
    except (OSError, ValueError):  # ValueError: a string that is neither a path nor a valid hub id
        return None


def _hub_problem(source: str) -> str | None:
    """Why hub model ``source``, not in the cache, cannot be downloaded (None: it can), from one request at most.

    Downloading through huggingface_hub would retry a hub it cannot reach five times with back-off (about 25 s,
    eleven warning lines per process); one request says the same at once, after which downloading it caches it.
    """
    from huggingface_hub import constants, get_session, hf_hub_url
    from huggingface_hub.utils import HFValidationError, build_hf_headers, validate_repo_id

    try:
        validate_repo_id(source)
    except HFValidationError:
        return "it is not a local directory, and not a valid model id for the Hugging Face hub"
    if constants.HF_HUB_OFFLINE:
        return (f"it is not a local directory and not in the Hugging Face cache ({constants.HF_HUB_CACHE}), and "
                f"the hub is switched off here (HF_HUB_OFFLINE=1)")
    try:
        response = get_session().head(hf_hub_url(source, "config.json"), headers=build_hf_headers(),
                                      timeout=constants.HF_HUB_ETAG_TIMEOUT)
    except Exception as error:  # connection refused, DNS failure, timeout, proxy, TLS: whatever the client raises
        return (f"it is not a local directory, not in the Hugging Face cache, and the hub "
                f"({constants.ENDPOINT}) could not be reached ({type(error).__name__})")
    if response.status_code in (401, 403, 404):
        return (f"the hub ({constants.ENDPOINT}) has no public model of that name (HTTP {response.status_code}; a "
                f"private or gated model needs `hf auth login`)")
    if response.status_code >= 400:
        return f"the hub ({constants.ENDPOINT}) answered HTTP {response.status_code}"
    return None


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
    except ModuleNotFoundError as error:
        package = DICTIONARY_PACKAGES.get(choice.mecab_dic, choice.mecab_dic)
        raise DictionaryNotInstalledError(
            f"Model {choice.name!r} splits words with the MeCab dictionary {choice.mecab_dic!r}, which is not "
            f"installed: `pip install {package}`. Another dictionary "
            f"would split sentences into other words than the model was trained on."
        ) from error


def load_bert(model: str | ModelChoice | None = None, **kwargs):
    """``BertModel.from_pretrained`` for the chosen model; ``kwargs`` go to from_pretrained."""
    from transformers import BertModel

    choice = model if isinstance(model, ModelChoice) else resolve_model(model)
    return BertModel.from_pretrained(choice.source, **kwargs)
