"""The BERT shapes the predictions are made for, as ``BertConfig`` objects (no weights, no download)."""

from __future__ import annotations


def bert_base_config(num_hidden_layers: int = 12, **overrides):
    """The memo's model, ``bert-base-japanese-whole-word-masking`` (v1): hidden 768, 12 layers, vocab 32000."""
    from transformers import BertConfig

    settings = dict(vocab_size=32000, hidden_size=768, num_hidden_layers=num_hidden_layers, num_attention_heads=12,
                    intermediate_size=3072, max_position_embeddings=512, use_cache=False)
    return BertConfig(**(settings | overrides))


def bert_large_config(num_hidden_layers: int = 24):
    """BERT-large's shape with the v1 vocabulary: hidden 1024, 24 layers, 16 heads (about 336 M parameters)."""
    return bert_base_config(num_hidden_layers, hidden_size=1024, num_attention_heads=16, intermediate_size=4096)


def encoder_1b_config(num_hidden_layers: int = 18):
    """A BERT-shaped encoder of about a billion parameters: hidden 2048, 18 layers, 16 heads."""
    return bert_base_config(num_hidden_layers, hidden_size=2048, num_attention_heads=16, intermediate_size=8192)


MODELS = {"BERT-base": bert_base_config, "BERT-large": bert_large_config, "1B encoder": encoder_1b_config}
"""The models notebook 08 compares under DDP and FSDP2."""


def bundled_config():
    """The bundled tiny model's config (4 layers, hidden 128): small enough to trace on real tensors too."""
    from transformers import BertConfig

    from helpers.models import bundled_model_dir

    return BertConfig.from_pretrained(bundled_model_dir())


HUB = "https://huggingface.co/"
PRESETS = {
    # The config.json fields that decide a model's memory, as published on the Hugging Face hub (no hub here, so
    # written out; transformers' defaults for the rest). Each with where it was read.
    "tohoku-nlp/bert-base-japanese-whole-word-masking": (
        dict(model_type="bert", vocab_size=32000, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
             intermediate_size=3072, max_position_embeddings=512),
        "the memo's model (cl-tohoku/ is the same model), v1's shape: tohoku-nlp/bert-base-japanese's config.json"),
    "tohoku-nlp/bert-base-japanese-v3": (
        dict(model_type="bert", vocab_size=32768, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
             intermediate_size=3072, max_position_embeddings=512),
        f"{HUB}tohoku-nlp/bert-base-japanese-v2/blob/main/config.json (v3 keeps its shape and 32,768-token vocabulary)"),
    "tohoku-nlp/bert-large-japanese-v2": (
        dict(model_type="bert", vocab_size=32768, hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
             intermediate_size=4096, max_position_embeddings=512),
        "BERT-large's shape with the v2/v3 vocabulary, as its model card describes it"),
    "rinna/japanese-roberta-base": (
        dict(model_type="roberta", vocab_size=32000, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
             intermediate_size=3072, max_position_embeddings=514, type_vocab_size=2, pad_token_id=3,
             bos_token_id=1, eos_token_id=2, layer_norm_eps=1e-05),
        f"the config.json of a fine-tuned copy that names it as its base ({HUB}xiongjie/face-expression-ja/blame/"
        f"main/config.json, '_name_or_path': 'rinna/japanese-roberta-base')"),
    "ku-nlp/deberta-v2-base-japanese": (
        dict(model_type="deberta-v2", vocab_size=32000, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
             intermediate_size=3072, max_position_embeddings=512, type_vocab_size=0, pad_token_id=0,
             relative_attention=True, position_buckets=256, max_relative_positions=-1, pos_att_type=["p2c", "c2p"],
             position_biased_input=False, norm_rel_ebd="layer_norm", share_att_key=True, pooler_hidden_size=768,
             pooler_dropout=0, pooler_hidden_act="gelu", layer_norm_eps=1e-07),
        f"the config.json of fine-tuned copies that name it as their base ({HUB}MuneK/deberta-v2-base-japanese-"
        f"finetuned-wrime/blob/main/config.json, {HUB}Mizuiro-sakura/deberta-v2-base-japanese-finetuned-QAe)"),
    "line-corporation/line-distilbert-base-japanese": (
        dict(model_type="distilbert", vocab_size=32768, dim=768, n_layers=6, n_heads=12, hidden_dim=3072,
             max_position_embeddings=512, sinusoidal_pos_embds=True, pad_token_id=0, seq_classif_dropout=0.2),
        f"the config.json of a model trained from it ({HUB}cl-nagoya/ruri-pt-small/blob/main/config.json, "
        f"'_name_or_path': 'line-corporation/line-distilbert-base-japanese'); its model card: 6 layers, 768 "
        f"dimensions, 12 heads, 66M parameters"),
    "sbintuitions/modernbert-ja-130m": (
        dict(model_type="modernbert", vocab_size=102400, hidden_size=512, intermediate_size=2048, num_hidden_layers=19,
             num_attention_heads=8, max_position_embeddings=8192, global_attn_every_n_layers=3, local_attention=128,
             pad_token_id=3, bos_token_id=1, eos_token_id=2, cls_token_id=6, sep_token_id=4, attention_bias=False,
             mlp_bias=False, norm_bias=False, classifier_bias=False, classifier_pooling="cls"),
        f"its model card's table (dimension 512, intermediate 2048, 19 layers, vocabulary 102,400; "
        f"{HUB}sbintuitions/modernbert-ja-130m) and the published config.json of its siblings for the rest "
        f"({HUB}sbintuitions/modernbert-ja-30m/blob/main/config.json); 8 heads is not published: the siblings' "
        f"heads are 64 wide (30m: 256/4, 310m: 768/12)"),
}
"""Model presets: name -> (config.json fields, where they were read). ``preset_config`` builds them."""
ALIASES = {"cl-tohoku/": "tohoku-nlp/"}  # the Tohoku models' former organisation name on the hub


def preset_name(model: str) -> str | None:
    """The preset ``model`` names (under either organisation name), or None."""
    for old, new in ALIASES.items():
        model = model.replace(old, new)
    return model if model in PRESETS else None


def preset_config(name: str):
    """The transformers config of preset ``name`` (``PRESETS``), built offline."""
    from transformers import AutoConfig

    fields, _ = PRESETS[name]
    return AutoConfig.for_model(**(fields | {"use_cache": False}))
