"""Checking what callers pass to the model's forward (the argument checks themselves: ``checks.py``).

Every error is an ``InputError`` (a ValueError) that names the argument, the offending value and the
limit, instead of an index error deep inside an embedding. Checks that look at tensor *values* are
skipped while torch.compile traces (they would break the graph); shapes are always checked.
"""

from __future__ import annotations

import torch

from .checks import check_index  # noqa: F401  (its home is checks.py; imported from here by older code)
from .config import BertConfig
from .errors import InputError


def check_blocks(config: BertConfig, num_blocks, skip_blocks) -> tuple[int | None, set[int]]:
    """Early exit after ``num_blocks`` blocks and the set of blocks to skip (negative indices allowed)."""
    N = config.num_hidden_layers
    if num_blocks is not None:
        check_index("num_blocks", num_blocks, 0, N, "the number of blocks to run")
    skip = set()
    for i in skip_blocks or ():
        check_index("skip_blocks entry", i, -N, N - 1, f"block indices 0..{N - 1} or -{N}..-1")
        skip.add(i % N)
    return num_blocks, skip


def _as_long_tensor(name: str, value, device) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        try:
            value = torch.as_tensor(value)
        except (TypeError, ValueError, RuntimeError) as e:
            raise InputError(f"{name} must be a tensor of integer ids, could not convert it: {e}") from None
    if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
        raise InputError(f"{name} must hold integers, got a tensor of dtype {value.dtype}")
    return value.to(device=device, dtype=torch.long)


def _check_range(name: str, ids: torch.Tensor, limit: int, what: str, hint: str = "") -> None:
    if torch.compiler.is_compiling():  # a value check would break the compiled graph; shapes are checked
        return
    low, high = torch.aminmax(ids)  # one pass (a short input pays for each small operator), one read back
    low, high = (low.item(), high.item()) if ids.device.type == "cpu" else torch.stack((low, high)).tolist()
    if low < 0 or high >= limit:
        where = tuple(int(i) for i in ((ids < 0) | (ids >= limit)).nonzero()[0])
        raise InputError(f"{name} has value {int(ids[where])} at position {where}; it must be in "
                         f"[0, {limit}) ({what}={limit}){hint}")


def check_inputs(config: BertConfig, device, input_ids, attention_mask, token_type_ids, position_ids,
                 check_values: bool = True):
    """Validate and normalise the forward arguments: (B, T) long tensors on ``device``, default token
    types (0) and positions (0..T-1), and ``attention_mask=None`` when it masks nothing (as transformers,
    which then drops the mask; under torch.compile the mask is kept, since that test reads values).
    ``check_values=False``: shapes and dtypes only, no value read back from the device (the caller checked
    the same inputs on the host: ``tools.fast.host_packing``); the mask is then kept as given."""
    input_ids = _as_long_tensor("input_ids", input_ids, device)
    unsqueeze = input_ids.dim() == 1
    if unsqueeze:
        input_ids = input_ids[None]
    if input_ids.dim() != 2:
        raise InputError(f"input_ids must have shape (batch, tokens), got {tuple(input_ids.shape)}")
    B, T = input_ids.shape
    if B == 0 or T == 0:
        raise InputError(f"input_ids is empty: shape {tuple(input_ids.shape)}")
    if T > config.max_position_embeddings:
        raise InputError(
            f"input_ids has {T} tokens per sequence, more than max_position_embeddings="
            f"{config.max_position_embeddings}; truncate the input (e.g. tokenizer(..., truncation=True))")
    if check_values:
        _check_range("input_ids", input_ids, config.vocab_size, "vocab_size")

    def same_shape(name, value, integer=True, broadcast=False):
        """``broadcast``: one row, (1, T) or (T,), stands for every row of the batch (as in transformers)."""
        if value is None:
            return None
        if integer:
            value = _as_long_tensor(name, value, device)
        elif not isinstance(value, torch.Tensor):
            value = torch.as_tensor(value, device=device)
        else:
            value = value.to(device)
        if (unsqueeze or broadcast) and value.dim() == 1:
            value = value[None]
        if broadcast and tuple(value.shape) == (1, T):
            value = value.expand(B, T)
        if tuple(value.shape) != (B, T):
            also = f" or {(1, T)}" if broadcast else ""
            raise InputError(f"{name} has shape {tuple(value.shape)} but input_ids has shape {(B, T)}; "
                             f"it must be {(B, T)}{also}")
        return value

    attention_mask = same_shape("attention_mask", attention_mask, integer=False)
    token_type_ids = same_shape("token_type_ids", token_type_ids, broadcast=True)
    position_ids = same_shape("position_ids", position_ids, broadcast=True)
    if token_type_ids is None:
        token_type_ids = torch.zeros_like(input_ids)
    elif check_values:
        _check_range("token_type_ids", token_type_ids, config.type_vocab_size, "type_vocab_size")
    if position_ids is None:
        position_ids = torch.arange(T, device=input_ids.device).expand(B, T)
    elif check_values:
        _check_range("position_ids", position_ids, config.max_position_embeddings, "max_position_embeddings")
    if (check_values and attention_mask is not None and not torch.compiler.is_compiling()
            and bool(attention_mask.all())):
        attention_mask = None  # no padding at all: no mask
    return input_ids, attention_mask, token_type_ids, position_ids
