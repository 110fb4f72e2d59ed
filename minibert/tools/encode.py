"""Texts to vectors: the one loop that tokenises, batches by length, runs the fast path and pools.

    from minibert.tools.encode import encode_texts
    vectors = encode_texts(model, tokenizer, texts, pooling="mean", normalize=True)   # (N, H) float32

``minibert embed``, ``SentenceEncoder.encode``, distillation's teacher vectors and ``search`` all call it
(or ``encode_ids`` on ids they already have), so batching, pooling and the output order are decided in one
place: batches follow ``tools.batching.plan_batches`` (longest first, by count or by a token budget), each
row's vector is written back to its own index, and a model of any kind the library makes runs on the fast
path (``tools.fast``: a task model's encoder, int8, LoRA, bf16; vectors come back as float32).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from ..checks import check_index
from ..errors import InputError
from .batching import collate, plan_batches
from .fast import prepare
from .pooling import pool
from .progress import progress_bar


def encoder_of(model):
    """The BertModel inside a task model (``model.bert``), or the model itself."""
    from ..model import BertModel

    encoder = getattr(model, "bert", model)
    if not isinstance(encoder, BertModel):
        raise InputError(f"expected a minibert BertModel or task model, got {type(model).__name__}")
    return encoder


def encode_ids(model, ids: Sequence[Sequence[int]], pad_token_id: int, *, pooling: str | Sequence[str] = "mean",
               normalize: bool = False, batch_size: int | None = 32, max_tokens: int | None = None,
               progress: bool = False, layer: int | Sequence[int] = -1, combine: str = "concat") -> torch.Tensor:
    """Vectors (N, D) float32 of already tokenised texts, in their order. ``pooling``: a mode of
    ``tools.pooling`` or several (their vectors concatenated, as sentence-transformers does); ``layer``:
    which hidden state to pool (-1 = the last block's output), or several, joined by ``combine``
    (``"concat"``, or ``"mean"`` of the layers' vectors); ``normalize``: unit vectors."""
    encoder = encoder_of(model)
    modes = [pooling] if isinstance(pooling, str) else list(pooling)
    if not modes:
        raise InputError("pooling: name at least one mode")
    L = encoder.config.num_hidden_layers
    layers = [layer] if isinstance(layer, int) else list(layer)
    for i in layers:
        check_index("layer", i, -(L + 1), L, f"the model has hidden states 0..{L}; -1 is the last")
    if not layers:
        raise InputError("layer: name at least one hidden state")
    if combine not in ("concat", "mean"):
        raise InputError(f"combine={combine!r}: use 'concat' or 'mean'")
    width = encoder.config.hidden_size * len(modes) * (len(layers) if combine == "concat" else 1)
    out = torch.empty(len(ids), width, dtype=torch.float32)
    if not len(ids):
        return out
    run = prepare(encoder)
    bar = progress_bar(len(ids), "encode", progress)
    training = encoder.training
    encoder.eval()  # vectors are an inference result (no dropout); the mode comes back below
    try:
        with torch.inference_mode():
            for rows in plan_batches([len(x) for x in ids], batch_size=batch_size, max_tokens=max_tokens):
                batch = collate(ids, rows, pad_token_id, device=encoder.device)
                result = run(**batch)
                per_layer = [torch.cat([pool(result.hidden_states[i], batch["attention_mask"], m) for m in modes], -1)
                             for i in layers]  # each (B, H x modes)
                vectors = (torch.cat(per_layer, -1) if combine == "concat" else torch.stack(per_layer).mean(0)).float()
                if normalize:
                    vectors = F.normalize(vectors, p=2, dim=-1)
                out[torch.as_tensor(rows)] = vectors.cpu()
                bar.update(len(rows))
    finally:
        encoder.train(training)
        bar.close()
    return out


def encode_texts(model, tokenizer, texts: Sequence[str], *, pooling: str | Sequence[str] = "mean",
                 normalize: bool = False, batch_size: int | None = 32, max_tokens: int | None = None,
                 max_length: int | None = None, progress: bool = False, layer: int | Sequence[int] = -1,
                 combine: str = "concat") -> torch.Tensor:
    """Vectors (len(texts), D) float32 of ``texts``, in their order: tokenised with truncation to
    ``max_length`` (default: the tokenizer's limit), then ``encode_ids``."""
    if isinstance(texts, str):
        raise InputError("texts must be a list of strings; wrap a single text in a list")
    texts = list(texts)
    for i, t in enumerate(texts):
        if not isinstance(t, str):
            raise InputError(f"texts[{i}] is a {type(t).__name__}, not a string")
    ids = tokenizer(texts, truncation=True, max_length=max_length, return_token_type_ids=False,
                    return_attention_mask=False)["input_ids"] if texts else []
    return encode_ids(model, ids, tokenizer.pad_token_id, pooling=pooling, normalize=normalize, batch_size=batch_size,
                      max_tokens=max_tokens, progress=progress, layer=layer, combine=combine)
