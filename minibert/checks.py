"""The argument checks every module uses: an int in a range, a positive int, a fraction. Each raises an
``InputError`` (a ValueError) that names the argument, the value it got and the limit it broke; bools are
never taken for numbers. ``minibert.inputs`` (forward arguments) and ``config`` build on these."""

from __future__ import annotations

import sys

from .errors import InputError


def check_index(name: str, value, low: int, high: int, what: str = "") -> int:
    """``value`` must be an int (not a bool) in [low, high]; returns it."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise InputError(f"{name}={value!r} is out of range: it must be an int in [{low}, {high}]"
                         + (f" ({what})" if what else ""))
    return value


def check_positive(name: str, value, what: str = "") -> int:
    """``value`` must be an int (not a bool) >= 1; returns it."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InputError(f"{name} must be a positive integer, got {value!r}" + (f" ({what})" if what else ""))
    return value


def check_fraction(name: str, value, *, closed: bool = False, what: str = "") -> float:
    """``value`` must be a number (not a bool) in [0, 1), or in [0, 1] with ``closed``; returns it as a float.
    (A dropout or a drop probability can never be 1; a mixing weight can.)"""
    bound = "1]" if closed else "1)"
    number = not isinstance(value, bool) and isinstance(value, (int, float))
    if not number or not (0 <= value <= 1 if closed else 0 <= value < 1):
        raise InputError(f"{name} must be in [0, {bound}, got {value!r}" + ("" if number else " (not a number)")
                         + (f" ({what})" if what else ""))
    return float(value)


SEED_LIMIT = 2**32 - 1  # numpy's generators take seeds in [0, 2**32 - 1]


def check_seed(name: str, value) -> int:
    """A random seed: an int in [0, 2**32 - 1] (what torch, numpy and Python all take)."""
    return check_index(name, value, 0, SEED_LIMIT, "a seed is a non-negative integer")


def check_max_length(name: str, value, limit: int, pair: bool = False) -> int:
    """A truncation length: an int in [3, limit] -- room for [CLS], [SEP] and one token, and no more than the
    model's positions (``limit``: min of max_position_embeddings and the tokenizer's model_max_length); for
    a pair of texts in one example ([CLS] A [SEP] B [SEP], e.g. next-sentence pre-training) one token of each,
    so 5. One rule for every command and pipeline that truncates."""
    low = 5 if pair else 3
    return check_index(name, value, low, limit, f"at least one token of text besides [CLS] and [SEP]"
                       f"{' (of each text of a pair)' if pair else ''}; the model's limit is {limit}")


def model_limit(config, tokenizer=None) -> int:
    """The longest input a model takes: its positions, or the tokenizer's model_max_length when smaller."""
    limit = config.max_position_embeddings
    return min(limit, tokenizer.model_max_length) if tokenizer is not None else limit


def encoder_of(model, what: str = "expected"):
    """The BertModel inside a task model (``model.bert``), or the model itself; anything else is refused,
    the message starting with ``what`` (e.g. "task modules go on"). (``minibert.model`` is looked up, not
    imported: it imports the core modules that call this; if it was never imported, nothing is a BertModel.)"""
    textbook = sys.modules.get("minibert.model")
    encoder = getattr(model, "bert", model)
    if textbook is None or not isinstance(encoder, textbook.BertModel):
        raise InputError(f"{what} a minibert BertModel or a task model built on one (its .bert), "
                         f"not {type(model).__name__}")
    return encoder


#: what a part of a model may refuse to take part in: "save" (written as a plain BERT checkpoint, whose
#: tensor names it has none of), "int8" (its linear layers swapped for int8 ones) and "export" (traced into an ONNX graph)
DOINGS = ("save", "int8", "export")


def check_parts(model, doing: str) -> None:
    """Ask every part of ``model`` whether it can take part in ``doing`` (one of ``DOINGS``): a module that
    cannot defines ``refuses(doing) -> str | None`` and says why, and what to do instead, in its own terms.
    The first refusal is raised as an InputError naming the part, before anything is written or swapped.
    So the core names nothing of the layers above it: quantised layers, LoRA layers and task modules
    speak for themselves."""
    if doing not in DOINGS:
        raise ValueError(f"doing={doing!r}: one of {DOINGS}")
    for name, module in model.named_modules():
        ask = getattr(type(module), "refuses", None)
        reason = ask(module, doing) if callable(ask) else None
        if reason:
            raise InputError(f"{name or type(model).__name__}: {reason}")
