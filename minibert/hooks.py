"""Named activation points: read, cache or replace what the model computes inside.

Every interesting intermediate tensor in ``model.py`` passes through ``self.tap("name", x)``. With
nothing registered, ``tap`` is one truth test of an empty dict and returns ``x`` unchanged -- no hook
objects, no copies, no autograd nodes. ``BertModel.hooks({...})`` registers functions at points for the
duration of a ``with`` block; ``run_with_cache`` uses the same mechanism to record the points.

A hook function is called as ``fn(activation, name)``. It may return ``None`` (it only reads) or a tensor
of the same shape (which replaces the activation from then on).

The points, their shapes and how they relate to transformers' outputs (B = batch, T = tokens, H = hidden,
h = heads, d = H / h, F = intermediate size, i = block index from 0):
"""

from __future__ import annotations

import fnmatch
from contextlib import contextmanager
from typing import Callable, Iterable

import torch

from .errors import InputError

HookFn = Callable[[torch.Tensor, str], "torch.Tensor | None"]

# (name, shape, token axis, description). The single source for validation, documentation and tests.
EMBEDDING_POINTS = [
    ("embeddings.word", "(B, T, H)", 1, "word (WordPiece) embedding of each token"),
    ("embeddings.token_type", "(B, T, H)", 1, "segment (token type) embedding"),
    ("embeddings.position", "(B, T, H)", 1, "position embedding"),
    ("embeddings.sum", "(B, T, H)", 1, "(word + token_type) + position, before LayerNorm"),
    ("embeddings.output", "(B, T, H)", 1, "after LayerNorm (and dropout) == hidden_states[0]"),
]
BLOCK_POINTS = [
    ("input", "(B, T, H)", 1, "block input == hidden_states[i]"),
    ("attn.q", "(B, h, T, d)", 2, "queries, split into heads"),
    ("attn.k", "(B, h, T, d)", 2, "keys, split into heads"),
    ("attn.v", "(B, h, T, d)", 2, "values, split into heads"),
    ("attn.scores", "(B, h, T, T)", 2, "q k^T / sqrt(d) after the padding mask (masked keys = dtype min), "
                                       "before softmax"),
    ("attn.probs", "(B, h, T, T)", 2, "softmax(scores) == attentions[i] (before attention dropout)"),
    ("attn.context", "(B, h, T, d)", 2, "per-head output probs @ v, before heads are merged"),
    ("attn.output", "(B, T, H)", 1, "after the output dense W_O (before dropout and the residual)"),
    ("resid_mid", "(B, T, H)", 1, "LayerNorm(input + attn.output): the residual after the first norm"),
    ("ffn.pre", "(B, T, F)", 1, "W_1 x + b_1, before the activation"),
    ("ffn.post", "(B, T, F)", 1, "act(W_1 x + b_1)"),
    ("ffn.output", "(B, T, H)", 1, "W_2 act(...) + b_2 (before dropout and the residual)"),
    ("output", "(B, T, H)", 1, "LayerNorm(resid_mid + ffn.output) == hidden_states[i + 1]"),
]
POOLER_POINTS = [("pooler.output", "(B, H)", None, "tanh(W h_[CLS] + b) == pooler_output")]


def point_table(num_blocks: int, with_pooler: bool = True) -> list[tuple[str, str, int | None, str]]:
    """Every hook point of a model with ``num_blocks`` blocks, in the order the forward pass meets them."""
    rows = list(EMBEDDING_POINTS)
    for i in range(num_blocks):
        rows += [(f"blocks.{i}.{name}", shape, axis, text) for name, shape, axis, text in BLOCK_POINTS]
    return rows + (POOLER_POINTS if with_pooler else [])


class HookPoints:
    """Mixin for modules with named points. ``taps`` maps a local point name ("q", "probs", ...) to the
    (full name, function) pairs registered there; it is empty unless a ``hooks`` block is active."""

    def _init_taps(self) -> None:
        self.taps: dict[str, list[tuple[str, HookFn]]] = {}
        self.edited = False

    def tap(self, name: str, x: torch.Tensor, watch: bool = False) -> torch.Tensor:
        """Point ``name``: returns ``x``, or what the registered functions make of it. ``watch=True`` also
        notices in-place edits (``self.edited``), for points whose consumer must know (attention)."""
        if not self.taps:  # the hot path when nothing is registered
            return x
        for full_name, fn in self.taps.get(name, ()):
            before = _snapshot(x) if watch else None
            result = fn(x, full_name)
            if result is None or result is x:  # read, or edited in place and returned
                if watch and _changed(x, before):
                    self.edited = True
                continue
            if not isinstance(result, torch.Tensor) or result.shape != x.shape:
                got = tuple(result.shape) if isinstance(result, torch.Tensor) else type(result).__name__
                raise InputError(f"hook at {full_name!r} returned {got}; a replacement must be a tensor "
                                 f"of the activation's shape {tuple(x.shape)}")
            x = result
            self.edited = True
        return x


def _snapshot(x: torch.Tensor):
    # the version counter says whether a tensor was written in place; inference tensors have none
    return x.clone() if x.is_inference() else x._version


def _changed(x: torch.Tensor, before) -> bool:
    return not torch.equal(x, before) if isinstance(before, torch.Tensor) else x._version != before


def _owner(model, name: str):
    """The module that holds point ``name`` and the point's local name there."""
    parts = name.split(".")
    if parts[0] == "embeddings":
        return model.embeddings, parts[1]
    if parts[0] == "pooler":
        return model.pooler, parts[1]
    block = model.encoder.blocks[int(parts[1])]
    if parts[2] == "attn":
        return block.attention, parts[3]
    if parts[2] == "ffn":
        return block.feed_forward, parts[3]
    return block, parts[2]


def expand_names(model, patterns: str | Iterable[str]) -> list[str]:
    """Resolve exact names and shell-style patterns (``blocks.*.attn.probs``), one or several, to point
    names."""
    if isinstance(patterns, str):
        patterns = [patterns]
    names = model.hook_point_names()
    known = set(names)
    out: list[str] = []
    for pattern in patterns:
        if not isinstance(pattern, str):
            raise TypeError(f"hook point names must be strings, got {pattern!r}")
        if pattern in known:
            matched = [pattern]
        else:
            matched = fnmatch.filter(names, pattern) if any(c in pattern for c in "*?[") else []
        if not matched:
            raise InputError(
                f"unknown hook point {pattern!r}; this model has {len(names)} points named like "
                f"'embeddings.output', 'blocks.0.attn.probs' ... 'blocks.{model.config.num_hidden_layers - 1}"
                f".output' (see model.hook_point_names())")
        out += [m for m in matched if m not in out]
    return out


@contextmanager
def registered(model, fns: dict[str, "HookFn | list[HookFn]"]):
    """Register ``{point name or pattern: function or list of functions}`` for the ``with`` block; the
    functions are removed on exit, also when the block raises."""
    if not isinstance(fns, dict):
        raise TypeError(f"hooks takes a dict {{point name or pattern: function}}, got {type(fns).__name__}")
    added: list[tuple[dict, str, tuple[str, HookFn]]] = []
    try:
        for pattern, value in fns.items():
            value = list(value) if isinstance(value, (list, tuple)) else [value]
            for fn in value:
                if not callable(fn):
                    raise TypeError(f"the hook for {pattern!r} is not callable: {fn!r}")
            for name in expand_names(model, pattern):
                module, local = _owner(model, name)
                for fn in value:
                    entry = (name, fn)
                    module.taps.setdefault(local, []).append(entry)
                    added.append((module.taps, local, entry))
        yield model
    finally:
        for taps, local, entry in reversed(added):
            entries = taps.get(local, [])
            if entry in entries:
                entries.remove(entry)
            if not entries:
                taps.pop(local, None)


class ActivationCache(dict):
    """``{point name: tensor}`` from ``run_with_cache``; ``cache.stack("attn.probs")`` stacks a block point
    over blocks into one (N, ...) tensor."""

    def stack(self, point: str) -> torch.Tensor:
        keys = sorted((k for k in self if k.startswith("blocks.") and k.split(".", 2)[2] == point),
                      key=lambda k: int(k.split(".")[1]))
        if not keys:
            raise KeyError(f"no cached 'blocks.<i>.{point}' entries; cached: {sorted(self)[:6]} ...")
        return torch.stack([self[k] for k in keys])


def run_with_cache(model, *args, names=None, detach: bool = True, **kwargs):
    """Run ``model(*args, **kwargs)`` and record the requested points (all of them when ``names`` is None).
    Returns (output, ActivationCache). ``detach=False`` keeps the autograd graph in the cached tensors."""
    wanted = model.hook_point_names() if names is None else expand_names(model, names)
    cache = ActivationCache()

    def record(x, name):
        cache[name] = x.detach() if detach else x

    with registered(model, {name: record for name in wanted}):
        output = model(*args, **kwargs)
    return output, cache


# ------------------------------------------------------------------------------------------ interventions
def _head_mask(model, heads) -> torch.Tensor:
    """Normalise ``heads`` to a bool (N, h) mask: a tensor/array of that shape, a {layer: [heads]} dict,
    or an iterable of (layer, head) pairs."""
    N, h = model.config.num_hidden_layers, model.config.num_attention_heads
    if isinstance(heads, dict):
        pairs = [(layer, head) for layer, hs in heads.items()
                 for head in ([hs] if isinstance(hs, int) else hs)]
    elif isinstance(heads, torch.Tensor) or hasattr(heads, "shape"):
        mask = torch.as_tensor(heads).bool()
        if tuple(mask.shape) != (N, h):
            raise InputError(f"head mask has shape {tuple(mask.shape)}; it must be (num_layers, num_heads) "
                             f"= {(N, h)}")
        return mask
    else:
        pairs = [tuple(p) for p in heads]
    mask = torch.zeros(N, h, dtype=torch.bool)
    for pair in pairs:
        if len(pair) != 2:
            raise InputError(f"heads must be (layer, head) pairs, got {pair!r}")
        layer, head = int(pair[0]), int(pair[1])
        if not 0 <= layer < N:
            raise InputError(f"layer {layer} is out of range: the model has layers 0..{N - 1}")
        if not 0 <= head < h:
            raise InputError(f"head {head} is out of range: each layer has heads 0..{h - 1}")
        mask[layer, head] = True
    return mask


@contextmanager
def ablate_heads(model, heads, mode: str = "zero", reference: dict | None = None):
    """Knock out attention heads inside the ``with`` block by replacing their per-head context
    (``blocks.i.attn.context``, before W_O) with zeros ("zero") or with its mean over the valid tokens of a
    ``reference`` batch ("mean"). ``heads``: bool mask (num_layers, num_heads), {layer: [heads]} or
    [(layer, head), ...]."""
    mask = _head_mask(model, heads)
    if mode not in ("zero", "mean"):
        raise InputError(f"mode must be 'zero' or 'mean', got {mode!r}")
    names = {layer: f"blocks.{layer}.attn.context" for layer in range(mask.shape[0]) if mask[layer].any()}
    means = {}
    if mode == "mean":
        if reference is None:
            raise InputError("mean ablation needs reference=<a batch dict>: the head's mean output over that "
                             "batch's real tokens replaces it")
        with torch.no_grad():
            _, cache = run_with_cache(model, **reference, names=list(names.values()))
        valid = reference.get("attention_mask")
        for name in names.values():
            ctx = cache[name]  # (B, h, T, d)
            w = (torch.ones(ctx.shape[0], ctx.shape[2]) if valid is None else torch.as_tensor(valid).float())
            w = w.to(ctx.device, ctx.dtype)[:, None, :, None]  # (B, 1, T, 1)
            means[name] = (ctx * w).sum((0, 2)) / w.sum((0, 2))  # (h, d)

    def make(layer):
        heads_here = mask[layer].nonzero().flatten().tolist()

        def hook(ctx, name):  # ctx (B, h, T, d)
            ctx = ctx.clone()
            if mode == "zero":
                ctx[:, heads_here] = 0
            else:
                ctx[:, heads_here] = means[name][heads_here][None, :, None, :].to(ctx.dtype)
            return ctx
        return hook

    with registered(model, {name: make(layer) for layer, name in names.items()}):
        yield model


@contextmanager
def patch(model, cache: dict, names=None, positions=None):
    """Activation patching: inside the ``with`` block, the points in ``names`` (default: every point in
    ``cache``) take their values from ``cache`` (from ``run_with_cache`` on another input of the same
    shape). ``positions``: patch only these token positions (an int, a list or a bool (T,) mask)."""
    table = {name: axis for name, _, axis, _ in point_table(model.config.num_hidden_layers)}
    wanted = list(cache) if names is None else expand_names(model, names)
    missing = [n for n in wanted if n not in cache]
    if missing:
        raise KeyError(f"the cache has no {missing[:4]}; run_with_cache(..., names=...) must record them")

    def hook(x, name):
        source = cache[name].to(x.device, x.dtype)
        if source.shape != x.shape:
            raise InputError(f"cannot patch {name!r}: cached shape {tuple(source.shape)} differs from this "
                             f"run's {tuple(x.shape)} (pad both inputs to the same length)")
        if positions is None:
            return source
        axis = table[name]
        if axis is None:
            raise InputError(f"{name!r} has no token axis; patch it without positions=")
        index = [slice(None)] * x.dim()
        index[axis] = torch.as_tensor(positions) if not isinstance(positions, int) else positions
        out = x.clone()
        out[tuple(index)] = source[tuple(index)]
        return out

    with registered(model, {name: hook for name in wanted}):
        yield model
