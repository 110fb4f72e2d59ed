"""Reading and editing what the model computes inside: named hook points, the activation cache, head
ablation and activation patching.

The model passes every activation worth studying through a ``HookPoint`` (``minibert/hookpoints.py``).
A point's name is its place in the module tree, read off ``named_modules()``: ``encoder.`` and the
``hook_`` prefix are dropped, so ``encoder.blocks.3.attn.hook_probs`` is ``blocks.3.attn.probs``. Names
and module attributes use the same words (``attn``, ``attn_norm``, ``ffn``, ``ffn_norm``).

A hook function is called as ``fn(activation, name)``. It may return ``None`` (it only reads) or a tensor
of the same shape (which replaces the activation from then on). A hook at ``attn.scores`` or
``attn.probs`` makes that block compute attention with the explicit formula (the one that has scores
and probabilities), exactly as ``output_attentions=True`` does; that path differs from the fused one by
rounding only (~2e-6 on all-MiniLM-L6-v2's hidden states).

``EMBEDDING_POINTS``, ``BLOCK_POINTS`` and ``POOLER_POINTS`` below list the points, their shapes and how
they relate to transformers' outputs and TransformerLens' names (HookedEncoder's and TransformerBridge's) (B = batch, T = tokens, H = hidden,
h = heads, d = H / h, F = intermediate size, i = block index); README's table is made from them.
"""

from __future__ import annotations

import fnmatch
from contextlib import contextmanager
from typing import Iterable

import torch

from ..errors import InputError
from ..hookpoints import HookFn, HookPoint, registered, visible

# (name, shape, token axis, description, TransformerLens HookedEncoder name, TransformerBridge name). Block
# points are relative to blocks.i. Documentation and the token axis for patching; the names themselves come
# from the module tree (a test holds the two to each other).
#
# Two TransformerLens vocabularies: HookedEncoder (its own BERT, up to TransformerLens 3) and TransformerBridge,
# which wraps transformers' BertModel and replaced it. Their words differ on BERT's post-LayerNorm blocks: the
# bridge's ``hook_attn_out`` is BertAttention's output, after the first LayerNorm (HookedEncoder's is W_O's
# output); its ``hook_resid_mid`` is the input of the second LayerNorm (HookedEncoder's: of the first); its
# ``hook_resid_post`` is the block's output, after the second LayerNorm (HookedEncoder's: before it). Bridge
# names are those of its BERT adapter (blocks.i.ln1 = attention.output.LayerNorm, ln2 = output.LayerNorm,
# attn.q/k/v/o and mlp.in/out = the linear layers); its q/k/v are (B, T, H), before the head split.
EMBEDDING_POINTS = [
    ("embeddings.word", "(B, T, H)", 1, "word (WordPiece) embedding of each token", "embed.hook_embed", "embed.hook_out"),
    ("embeddings.token_type", "(B, T, H)", 1, "segment (token type) embedding", "embed.hook_token_type_embed", "-"),
    ("embeddings.position", "(B, T, H)", 1, "position embedding", "embed.hook_pos_embed", "pos_embed.hook_out"),
    ("embeddings.sum", "(B, T, H)", 1, "(word + token_type) + position, before LayerNorm", "-", "-"),
    ("embeddings.output", "(B, T, H)", 1, "after LayerNorm (and dropout) == hidden_states[0]",
     "blocks.0.hook_resid_pre", "blocks.0.hook_in"),
]
BLOCK_POINTS = [
    ("input", "(B, T, H)", 1, "block input == hidden_states[i]", "hook_resid_pre", "hook_in (= hook_resid_pre)"),
    ("attn.q", "(B, h, T, d)", 2, "queries, split into heads", "attn.hook_q", "- (attn.q.hook_out: before the split)"),
    ("attn.k", "(B, h, T, d)", 2, "keys, split into heads", "attn.hook_k", "- (attn.k.hook_out: before the split)"),
    ("attn.v", "(B, h, T, d)", 2, "values, split into heads", "attn.hook_v", "- (attn.v.hook_out: before the split)"),
    ("attn.scores", "(B, h, T, T)", 2, "q k^T / sqrt(d) after the padding mask (masked keys = dtype min), "
                                       "before softmax", "attn.hook_attn_scores", "-"),
    ("attn.probs", "(B, h, T, T)", 2, "softmax(scores) == attentions[i] (before attention dropout)",
     "attn.hook_pattern", "-"),
    ("attn.context", "(B, h, T, d)", 2, "per-head output probs @ v, before heads are merged", "attn.hook_z",
     "- (attn.o.hook_in: heads merged)"),
    ("attn.output", "(B, T, H)", 1, "after the output dense W_O (before dropout and the residual)",
     "hook_attn_out", "attn.o.hook_out"),
    ("resid_mid", "(B, T, H)", 1, "input + attn.output, before the first LayerNorm", "hook_resid_mid", "ln1.hook_in"),
    ("attn_norm", "(B, T, H)", 1, "LayerNorm(resid_mid): what the feed-forward reads", "- (ln1's output)",
     "attn.hook_out (= hook_attn_out), ln1.hook_out"),
    ("ffn.pre", "(B, T, F)", 1, "W_1 x + b_1, before the activation", "mlp.hook_pre", "mlp.in.hook_out"),
    ("ffn.post", "(B, T, F)", 1, "act(W_1 x + b_1)", "mlp.hook_post", "mlp.out.hook_in"),
    ("ffn.output", "(B, T, H)", 1, "W_2 act(...) + b_2 (before dropout and the residual)", "hook_mlp_out",
     "mlp.out.hook_out (= hook_mlp_out)"),
    ("resid_post", "(B, T, H)", 1, "attn_norm + ffn.output, before the second LayerNorm", "hook_resid_post",
     "ln2.hook_in (= hook_resid_mid)"),
    ("output", "(B, T, H)", 1, "LayerNorm(resid_post) == hidden_states[i + 1]", "hook_normalized_resid_post",
     "hook_out (= hook_resid_post), ln2.hook_out"),
]
POOLER_POINTS = [("pooler.output", "(B, H)", None, "tanh(W h_[CLS] + b) == pooler_output", "-", "-")]


def point_table(num_blocks: int, with_pooler: bool = True) -> list[tuple[str, str, int | None, str, str, str]]:
    """Every hook point of a model with ``num_blocks`` blocks, in the order the forward pass meets them."""
    rows = list(EMBEDDING_POINTS)
    for i in range(num_blocks):
        rows += [(f"blocks.{i}.{name}", *rest) for name, *rest in BLOCK_POINTS]
    return rows + (POOLER_POINTS if with_pooler else [])


def markdown_table() -> str:
    """The table of points on docs/reference/hooks.md (tools/gen_docs.py writes it; a test keeps the two equal)."""
    rows = ["| point | shape | what it is | TransformerLens HookedEncoder | TransformerLens TransformerBridge |",
            "|---|---|---|---|---|"]

    def tl(name, prefix=""):
        if name == "-":
            return "-"
        if name.startswith("- "):
            return "- " + name[2:]
        main, _, note = name.partition(" (")
        return f"`{prefix}{main}`" + (f" ({note}" if note else "")

    rows += [f"| `{n}` | {shape} | {text} | {tl(t)} | {tl(b)} |" for n, shape, _, text, t, b in EMBEDDING_POINTS]
    rows += [f"| `blocks.i.{n}` | {shape} | {text} | {tl(t, 'blocks.i.')} | {tl(b, 'blocks.i.')} |"
             for n, shape, _, text, t, b in BLOCK_POINTS]
    rows += [f"| `{n}` | {shape} | {text} | {tl(t)} | {tl(b)} |" for n, shape, _, text, t, b in POOLER_POINTS]
    return "\n".join(rows)


def point_name(module_path: str) -> str:
    """``encoder.blocks.3.attn.hook_probs`` -> ``blocks.3.attn.probs``."""
    path = module_path[len("encoder."):] if module_path.startswith("encoder.") else module_path
    head, _, last = path.rpartition(".")
    last = last[len("hook_"):]
    return f"{head}.{last}" if head else last


def hook_points(model) -> dict[str, HookPoint]:
    """{point name: HookPoint} for every point of ``model``, in forward order."""
    return {point_name(path): module for path, module in model.named_modules() if isinstance(module, HookPoint)}


def hook_point_names(model) -> list[str]:
    """Every named activation point of ``model``, in the order the forward pass meets them."""
    return list(hook_points(model))


def has_hooks(model) -> bool:
    """Whether any function is registered at any point of ``model`` (a ``hooks`` block is open). Free
    when nothing anywhere is hooked. (torch's own module hooks: ``HookPoint.torch_hooked``.)"""
    return HookPoint.registered > 0 and any(visible(fn) for point in hook_points(model).values()
                                            for _, fn in tuple(point.fns))


def expand_names(model, patterns: str | Iterable[str]) -> list[str]:
    """Resolve exact names and shell-style patterns (``blocks.*.attn.probs``), one or several, to point
    names."""
    if isinstance(patterns, str):
        patterns = [patterns]
    names = hook_point_names(model)
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
                f".output' (see hook_point_names(model))")
        out += [m for m in matched if m not in out]
    return out


@contextmanager
def hooks(model, fns: dict[str, "HookFn | list[HookFn]"]):
    """``with hooks(model, {"blocks.3.attn.probs": fn}): model(**batch)`` -- register ``fn(x, name)`` at
    named points or patterns for the ``with`` block; removed on exit, also when the block raises. Hooks
    apply to the forward calls made in this thread (this ``contextvars`` context) while the block is open;
    other threads running the same model meanwhile see none of them (``hookpoints.registered``)."""
    if not isinstance(fns, dict):
        raise TypeError(f"hooks takes a dict {{point name or pattern: function}}, got {type(fns).__name__}")
    points = hook_points(model)
    entries = []
    for pattern, value in fns.items():
        value = list(value) if isinstance(value, (list, tuple)) else [value]
        for fn in value:
            if not callable(fn):
                raise TypeError(f"the hook for {pattern!r} is not callable: {fn!r}")
        entries += [(points[name], name, fn) for name in expand_names(model, pattern) for fn in value]
    with registered(entries):
        yield model


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
    wanted = hook_point_names(model) if names is None else expand_names(model, names)
    cache = ActivationCache()

    def record(x, name):
        cache[name] = x.detach() if detach else x

    with hooks(model, {name: record for name in wanted}):
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

    with hooks(model, {name: make(layer) for layer, name in names.items()}):
        yield model


@contextmanager
def patch(model, cache: dict, names=None, positions=None):
    """Activation patching: inside the ``with`` block, the points in ``names`` (default: every point in
    ``cache``) take their values from ``cache`` (from ``run_with_cache`` on another input of the same
    shape). ``positions``: patch only these token positions (an int, a list or a bool (T,) mask)."""
    table = {name: axis for name, _, axis, *_ in point_table(model.config.num_hidden_layers)}
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

    with hooks(model, {name: hook for name in wanted}):
        yield model
