"""Pooling: one vector per sequence from its token vectors, (..., B, T, H) -> (..., B, H).

The one home of every pooling mode the library uses: ``cls`` (the first token), ``mean`` and ``max``
over real tokens (``attention_mask != 0``: padding never changes the result), and the other modes of
sentence-transformers' Pooling module -- ``mean_sqrt_len_tokens``, ``weightedmean`` (weights 1, 2, 3, ...
by position) and ``lasttoken``. Rows are right-padded, as minibert's tokenizer pads them.
"""

from __future__ import annotations

import torch

from ..errors import InputError

#: every mode, in sentence-transformers' order of its pooling_mode_* flags
POOLING_MODES = ("cls", "max", "mean", "mean_sqrt_len_tokens", "weightedmean", "lasttoken")


def pool(hidden: torch.Tensor, attention_mask: torch.Tensor | None = None, method: str = "mean") -> torch.Tensor:
    """Pool tokens into one vector per sequence: (..., B, T, H) -> (..., B, H) (see the module docstring)."""
    if method == "cls":
        return hidden[..., 0, :]
    if method not in POOLING_MODES:
        raise InputError(f"pool method {method!r}; use one of {', '.join(POOLING_MODES)}")
    if attention_mask is None:
        attention_mask = torch.ones(hidden.shape[-3:-1], device=hidden.device)
    mask = attention_mask.to(hidden.device).bool()[..., None]  # (B, T, 1)
    weights = mask.to(hidden.dtype)
    if method == "mean":
        return (hidden * weights).sum(-2) / weights.sum(-2).clamp(min=1)
    if method == "max":
        return hidden.masked_fill(~mask, float("-inf")).amax(-2)
    if method == "mean_sqrt_len_tokens":
        return (hidden * weights).sum(-2) / torch.sqrt(weights.sum(-2).clamp(min=1e-9))
    if method == "weightedmean":
        positions = torch.arange(1, hidden.shape[-2] + 1, dtype=hidden.dtype, device=hidden.device)
        w = weights * positions[:, None]  # (B, T, 1): 1, 2, 3, ... on real tokens
        return (hidden * w).sum(-2) / w.sum(-2).clamp(min=1e-9)
    last = mask[..., 0].long().sum(-1).clamp(min=1) - 1  # "lasttoken": (B,) index of each row's last real token
    return hidden.gather(-2, last[..., None, None].expand(*last.shape, 1, hidden.shape[-1])).squeeze(-2)
