"""Batches of texts that waste little work on padding: length-sorted, by count or by a token budget.

    from minibert.tools.batching import plan_batches
    for rows in plan_batches(lengths, batch_size=32):          # at most 32 rows a batch
    for rows in plan_batches(lengths, max_tokens=8192):        # rows x longest row <= 8192 tokens
        ...                                                     # rows: indices into the input, in batch order

Rows are sorted longest first (as sentence-transformers' ``encode``: the biggest batch comes first, so
memory peaks at once and never later), ties kept in input order; the caller writes each result back to
its index, so the output order is the input's. A token budget counts padded tokens (rows x the longest
row), which is what a forward pass costs; sorted, that is within a few tokens of the real ones. One row
longer than the budget still gets a batch of its own.
"""

from __future__ import annotations

from typing import Sequence

from ..errors import InputError


def plan_batches(lengths: Sequence[int], *, batch_size: int | None = None,
                 max_tokens: int | None = None) -> list[list[int]]:
    """Indices of ``lengths`` grouped into batches, longest rows first. ``batch_size`` caps the rows of a
    batch, ``max_tokens`` its padded tokens (rows x longest); at least one of them must be given."""
    if batch_size is None and max_tokens is None:
        raise InputError("plan_batches needs batch_size or max_tokens (or both)")
    for name, value in (("batch_size", batch_size), ("max_tokens", max_tokens)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise InputError(f"{name} must be a positive integer, got {value!r}")
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])  # stable: ties keep input order
    batches, current, longest = [], [], 0
    for i in order:
        new_longest = max(longest, lengths[i])
        full = (batch_size is not None and len(current) >= batch_size) or (
            max_tokens is not None and current and new_longest * (len(current) + 1) > max_tokens)
        if full:
            batches.append(current)
            current, new_longest = [], lengths[i]
        current.append(i)
        longest = new_longest
    if current:
        batches.append(current)
    return batches


def collate(input_ids: Sequence[Sequence[int]], rows: Sequence[int], pad_id: int, *, device=None) -> dict:
    """One padded batch (input_ids, attention_mask, token_type_ids as (B, T) long tensors) of the
    already tokenised ``input_ids[i]`` for i in ``rows`` (single texts: token type 0 everywhere)."""
    import torch

    longest = max(len(input_ids[i]) for i in rows)
    ids = torch.full((len(rows), longest), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), longest), dtype=torch.long)
    for r, i in enumerate(rows):
        n = len(input_ids[i])
        ids[r, :n] = torch.as_tensor(input_ids[i], dtype=torch.long)
        mask[r, :n] = 1
    batch = {"input_ids": ids, "attention_mask": mask, "token_type_ids": torch.zeros_like(ids)}
    return {k: v.to(device) for k, v in batch.items()} if device is not None else batch
