"""Official checkpoint names and dtype names: one home for each, used by loading, the tokenizer, parity
and the command line.

* ``HUB_ALIASES``: short names of the official Google checkpoints -> hub repo ids.
* ``PRESETS``: the geometry of those checkpoints (their config.json), so counting and estimating need no
  download.
* ``parse_dtype``: "fp32", "bf16", "fp16" (and long names, or a torch.dtype) -> torch.dtype.
"""

from __future__ import annotations

from .errors import InputError

_OFFICIAL = ("bert-base-uncased", "bert-base-cased", "bert-large-uncased", "bert-large-cased",
             "bert-base-multilingual-uncased", "bert-base-multilingual-cased", "bert-base-chinese",
             "bert-large-uncased-whole-word-masking", "bert-large-cased-whole-word-masking")

#: short names accepted for the official checkpoints, resolved to their hub repo ids
HUB_ALIASES = {name: f"google-bert/{name}" for name in _OFFICIAL}

#: geometry of the official Google checkpoints (their config.json files on the hub)
PRESETS = {
    "bert-base-uncased": dict(vocab_size=30522, hidden_size=768, num_hidden_layers=12,
                              num_attention_heads=12, intermediate_size=3072),
    "bert-base-cased": dict(vocab_size=28996, hidden_size=768, num_hidden_layers=12,
                            num_attention_heads=12, intermediate_size=3072),
    "bert-large-uncased": dict(vocab_size=30522, hidden_size=1024, num_hidden_layers=24,
                               num_attention_heads=16, intermediate_size=4096),
    "bert-large-cased": dict(vocab_size=28996, hidden_size=1024, num_hidden_layers=24,
                             num_attention_heads=16, intermediate_size=4096),
}


def hub_repo_id(source: str) -> str:
    """The hub repo id for a short official name (``bert-base-uncased``), or ``source`` unchanged."""
    return HUB_ALIASES.get(source, source)


def preset_name(source: str) -> str | None:
    """The preset for an official name or repo id (``bert-base-uncased``, ``google-bert/bert-base-uncased``),
    or None."""
    key = str(source).split("/")[-1]
    return key if key in PRESETS and hub_repo_id(key) == hub_repo_id(str(source)) else None


DTYPE_NAMES = {"fp32": "float32", "float32": "float32", "float": "float32",
               "bf16": "bfloat16", "bfloat16": "bfloat16",
               "fp16": "float16", "float16": "float16", "half": "float16"}
#: the short names, as options and reports spell them; "int8" (dynamic quantisation) is a loading mode
SHORT_DTYPES = ("fp32", "bf16", "fp16")
QUANTISED_DTYPES = ("int8",)


def short_dtype_name(dtype) -> str:
    """torch.float32 -> "fp32", torch.bfloat16 -> "bf16", torch.float16 -> "fp16" (the names above)."""
    long_name = str(dtype).removeprefix("torch.")
    for short in SHORT_DTYPES:
        if DTYPE_NAMES[short] == long_name:
            return short
    return long_name


def parse_dtype(dtype):
    """None, a torch.dtype, or one of DTYPE_NAMES -> None or a torch.dtype."""
    import torch

    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPE_NAMES:
        raise InputError(f"dtype {dtype!r} is not supported; use one of {sorted(DTYPE_NAMES)}, a torch.dtype, or "
                         "'int8' (from_pretrained: dynamic quantisation of the linear layers)")
    return getattr(torch, DTYPE_NAMES[dtype])
