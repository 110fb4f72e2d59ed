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

from ..checks import check_positive
from ..errors import InputError


def plan_batches(lengths: Sequence[int], *, batch_size: int | None = None,
                 max_tokens: int | None = None) -> list[list[int]]:
    """Indices of ``lengths`` grouped into batches, longest rows first. ``batch_size`` caps the rows of a
    batch, ``max_tokens`` its padded tokens (rows x longest); at least one of them must be given."""
    if batch_size is None and max_tokens is None:
        raise InputError("plan_batches needs batch_size or max_tokens (or both)")
    for name, value in (("batch_size", batch_size), ("max_tokens", max_tokens)):
        if value is not None:
            check_positive(name, value)
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


def collate(input_ids: Sequence[Sequence[int]], rows: Sequence[int], pad_id: int, *, device=None,
            token_type_ids: Sequence[Sequence[int]] | None = None,
            offset_mapping: Sequence[Sequence[tuple[int, int]]] | None = None) -> dict:
    """One padded batch (input_ids, attention_mask, token_type_ids as (B, T) long tensors) of the
    already tokenised ``input_ids[i]`` for i in ``rows``. Token types are 0 everywhere unless
    ``token_type_ids`` (a tokenizer's, for pairs) are given; ``offset_mapping`` adds (B, T, 2) character
    offsets, (0, 0) at padding."""
    import torch

    longest = max(len(input_ids[i]) for i in rows)
    ids = torch.full((len(rows), longest), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), longest), dtype=torch.long)
    types = torch.zeros_like(ids)
    offsets = torch.zeros((len(rows), longest, 2), dtype=torch.long) if offset_mapping is not None else None
    for r, i in enumerate(rows):
        n = len(input_ids[i])
        ids[r, :n] = torch.as_tensor(input_ids[i], dtype=torch.long)
        mask[r, :n] = 1
        if token_type_ids is not None:
            types[r, :n] = torch.as_tensor(token_type_ids[i], dtype=torch.long)
        if offsets is not None and n:
            offsets[r, :n] = torch.as_tensor(offset_mapping[i], dtype=torch.long).view(n, 2)
    batch = {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}
    if offsets is not None:
        batch["offset_mapping"] = offsets
    return {k: v.to(device) for k, v in batch.items()} if device is not None else batch


def text_batches(tokenizer, texts: Sequence[str], text_pairs: Sequence[str] | None = None, *,
                 batch_size: int | None = 32, max_tokens: int | None = None, max_length: int | None = None,
                 offsets: bool = False, device=None):
    """``(rows, batch)`` for the texts (and pairs): tokenised once with truncation to ``max_length``,
    grouped by ``plan_batches`` (longest first), each batch padded to its own longest row. ``rows`` are
    indices into ``texts``: a caller writes each result back to its row, so outputs keep the input order.
    ``offsets``: each batch also carries ``offset_mapping`` (B, T, 2)."""
    texts = list(texts)
    pairs = None if text_pairs is None else list(text_pairs)
    encoded = tokenizer(texts, pairs, truncation=True, max_length=max_length, return_attention_mask=False,
                        return_offsets_mapping=offsets) if texts else {"input_ids": []}
    ids = encoded["input_ids"]
    for rows in plan_batches([len(x) for x in ids], batch_size=batch_size, max_tokens=max_tokens):
        yield rows, collate(ids, rows, tokenizer.pad_token_id, device=device,
                            token_type_ids=encoded.get("token_type_ids") if pairs is not None else None,
                            offset_mapping=encoded["offset_mapping"] if offsets else None)


class _Failure:
    def __init__(self, error: BaseException):
        self.error = error


def prefetch(items, depth: int = 3):
    """Iterate ``items`` (an iterable doing CPU work: tokenising, collating) in a background thread, at
    most ``depth`` items ahead of the consumer, so that work overlaps with what the consumer does with each
    item (a GPU's forward pass). Items come in their order; an exception in the thread is raised here, at
    the item where it happened; leaving the loop early stops the thread."""
    import queue
    import threading

    check_positive("depth", depth)
    ahead: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()
    done = object()

    def put(item) -> bool:
        while not stop.is_set():
            try:
                ahead.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def work():
        try:
            for item in items:
                if not put(item):
                    return
            put(done)
        except BaseException as error:  # noqa: BLE001 - handed to the consumer, raised there
            put(_Failure(error))

    thread = threading.Thread(target=work, name="minibert-prefetch", daemon=True)
    thread.start()
    try:
        while True:
            item = ahead.get()
            if item is done:
                return
            if isinstance(item, _Failure):
                raise item.error
            yield item
    finally:
        stop.set()
        thread.join(timeout=5)
