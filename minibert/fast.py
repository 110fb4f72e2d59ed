"""The fast inference path: ``model(**batch, fast=True)``.

It computes what ``model.py`` computes -- a test holds the two to 1e-5 -- with four changes that only
matter for speed:

1. **No padding.** The real tokens of the batch are packed into one (N, H) matrix (N = number of real
   tokens), so the dense layers, LayerNorms and GELU never touch padding. Attention runs per sequence on
   its own tokens, which is what the padding mask achieves the slow way. On a batch that is 38 % real
   tokens this does 38 % of the dense work. A row's result cannot depend on its neighbours.
2. **Fused projections.** Q, K and V come from one (3H x H) matrix product instead of three.
3. **Prepacked bf16/fp16 weights.** For half precision on x86 CPUs the weights are reordered once into
   oneDNN's blocked layout (AMX kernels) and the GELU runs inside the first FFN product. fp32 keeps
   ``F.linear`` (MKL) by default: oneDNN's fp32 products are about 15 % faster but sum in another order,
   and after 6-12 blocks that costs up to ~1.1e-5 -- over our 1e-5 promise. ``PREPACK_FP32 = True``
   trades that exactness for the speed. The fused/packed copy is kept in a cache beside the model (not
   inside it: copying, pickling and saving a model never see it), rebuilt when a parameter changes, and
   freed with the model; ``cached_bytes(model)`` says how much memory it holds, ``release(model)`` frees it.
4. **inference_mode**, in-place residual adds and GELU, PyTorch's fused attention kernel, and the two
   big per-block buffers (QKV and FFN inner) reused by every block of a forward pass (``_Workspace``).

Outputs at padded positions are zeros (the readable path leaves arbitrary, unused values there); every
real position matches. The readable path runs instead when attention maps, hooks or training are asked
for, since only it computes those.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

from .hardware import warn_if_slow

_MKLDNN = (hasattr(torch.ops, "mkldnn") and hasattr(torch.ops.mkldnn, "_linear_pointwise")
           and hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and torch.backends.mkldnn.is_available())
_GELU_ALGORITHM = {"gelu": "none", "gelu_pytorch_tanh": "tanh"}  # activations oneDNN can fuse

#: use oneDNN's prepacked products for fp32 too: ~15 % faster, but up to ~1.1e-5 from the readable path
PREPACK_FP32 = False


class _Linear:
    """y = x W^T + b (optionally followed by a fused GELU) with W prepacked when oneDNN is there."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor, gelu: str | None = None):
        self.bias = bias.detach()
        self.gelu = gelu
        self.packed = None
        dtypes = (torch.float32, torch.bfloat16, torch.float16) if PREPACK_FP32 else (torch.bfloat16, torch.float16)
        if _MKLDNN and weight.device.type == "cpu" and weight.dtype in dtypes:
            try:
                self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
            except RuntimeError:  # this CPU or build cannot: plain F.linear below
                self.packed = None
        self.weight = weight.detach()

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """x: (N, in). ``out``: an (N, out) buffer to write into (plain path only), see ``_Workspace``."""
        if self.packed is not None:
            if self.gelu is None:
                return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "gelu", [], self.gelu)
        if out is None:
            y = F.linear(x, self.weight, self.bias)
            return F.gelu(y, approximate=self.gelu) if self.gelu is not None else y
        torch.addmm(self.bias, x, self.weight.t(), out=out)  # what F.linear runs, into our buffer
        return torch.ops.aten.gelu_(out, approximate=self.gelu) if self.gelu is not None else out


class _Workspace(dict):
    """Large buffers reused by every block of one forward pass. A fresh (N, 3H) or (N, F) tensor above
    glibc's 32 MB mmap limit is new memory each time: every page faults on first touch, which cost more
    than the GELU itself at 32 x 128 tokens. Reusing one buffer per kind faults once per forward."""

    def get(self, name: str, shape: tuple, like: torch.Tensor) -> torch.Tensor:
        buf = dict.get(self, name)
        if buf is None or buf.shape != shape:
            buf = self[name] = like.new_empty(shape)
        return buf


class _FastBlock:
    def __init__(self, block, hidden_act: str):
        a, f = block.attention, block.feed_forward
        self.heads, self.d = a.num_heads, a.head_size
        self.qkv = _Linear(torch.cat([a.query.weight, a.key.weight, a.value.weight]),
                           torch.cat([a.query.bias, a.key.bias, a.value.bias]))  # (3H, H)
        self.out = _Linear(a.output.weight, a.output.bias)
        self.norm1 = block.attention_norm
        algorithm = _GELU_ALGORITHM.get(hidden_act)
        self.ffn_in = _Linear(f.dense_in.weight, f.dense_in.bias, gelu=algorithm)
        self.act = None if algorithm is not None else f.act  # applied separately when not fusable
        self.ffn_out = _Linear(f.dense_out.weight, f.dense_out.bias)
        self.norm2 = block.output_norm

    def __call__(self, x: torch.Tensor, lengths: list[int] | None, B: int, T: int, ws: _Workspace) -> torch.Tensor:
        """x: (N, H) packed real tokens. lengths: tokens per sequence (None = dense (B, T))."""
        h, d = self.heads, self.d
        N = x.shape[0]
        qkv = self.qkv(x, out=ws.get("qkv", (N, 3 * h * d), x))  # (N, 3H)
        if lengths is None:  # dense batch: one attention call for all
            q, k, v = qkv.view(B, T, 3, h, d).permute(2, 0, 3, 1, 4)  # each (B, h, T, d)
            ctx = F.scaled_dot_product_attention(q, k, v, scale=d**-0.5)  # (B, h, T, d)
            ctx = ctx.transpose(1, 2).reshape(B * T, h * d)  # (N, H)
        else:  # one attention call per sequence, on its real tokens only
            parts = []
            for chunk in qkv.split(lengths):  # (L, 3H)
                q, k, v = chunk.view(1, -1, 3, h, d).permute(2, 0, 3, 1, 4)  # each (1, h, L, d)
                parts.append(F.scaled_dot_product_attention(q, k, v, scale=d**-0.5)[0].transpose(0, 1))
            ctx = torch.cat(parts).reshape(-1, h * d)  # (N, H)
        y = self.out(ctx).add_(x)  # residual
        x = F.layer_norm(y, y.shape[-1:], self.norm1.weight, self.norm1.bias, self.norm1.eps)
        inner = self.ffn_in(x, out=ws.get("inner", (N, self.ffn_in.weight.shape[0]), x))  # (N, F), GELU fused
        if self.act is not None:
            inner = self.act(inner)
        y = self.ffn_out(inner).add_(x)
        return F.layer_norm(y, y.shape[-1:], self.norm2.weight, self.norm2.bias, self.norm2.eps)


def _key(model):
    key = [model.dtype, model.device, PREPACK_FP32, _MKLDNN]
    for p in model.parameters():
        try:
            key.append((p.data_ptr(), p._version))
        except RuntimeError:  # inference tensors have no version counter
            key.append((p.data_ptr(), None))
    return tuple(key)


#: model -> (key, fused/packed blocks). Beside the model, not in it: an opaque prepacked oneDNN tensor
#: cannot be deep-copied or pickled, so it must never be reachable from the module. Weak keys: an entry
#: goes when its model does.
_CACHE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _blocks(model) -> list[_FastBlock]:
    key = _key(model)
    cached = _CACHE.get(model)
    if cached is None or cached[0] != key:
        warn_if_slow(model.dtype, model.device)  # once per process: bf16/fp16 without CPU support is slow
        _CACHE.pop(model, None)  # free the old copy before building the new one
        with torch.inference_mode():
            cached = (key, [_FastBlock(block, model.config.hidden_act) for block in model.encoder.blocks])
        _CACHE[model] = cached
    return cached[1]


def release(model) -> None:
    """Free the fused/packed weight copy the fast path keeps for ``model`` (it is rebuilt on the next
    ``fast=True`` call)."""
    _CACHE.pop(model, None)


def cached_bytes(model) -> int:
    """Memory held by the fast path's weight copies for ``model`` (0 when none): the fused QKV matrices,
    and in half precision (or with ``PREPACK_FP32``) the prepacked copies of every block weight."""
    cached = _CACHE.get(model)
    if cached is None:
        return 0
    total = 0
    for block in cached[1]:
        for linear in (block.qkv, block.out, block.ffn_in, block.ffn_out):
            size = linear.weight.numel() * linear.weight.element_size()
            total += size * (linear.packed is not None) + size * (linear is block.qkv)
    return total


def fast_forward(model, input_ids, attention_mask, token_type_ids, position_ids, num_blocks=None,
                 skip_blocks=()):
    """The packed forward pass; arguments already checked by ``BertModel.forward``."""
    from .model import BertOutput

    blocks = _blocks(model)
    B, T = input_ids.shape
    H = model.config.hidden_size
    e = model.embeddings
    with torch.inference_mode():
        real = None if attention_mask is None else attention_mask.bool()  # (B, T)
        if real is None or bool(real.all()):
            where, lengths = None, None
            ids, tts, pos = input_ids.reshape(-1), token_type_ids.reshape(-1), position_ids.reshape(-1)
        else:
            where = real.reshape(-1).nonzero().squeeze(1)  # flat indices of the real tokens, row by row
            lengths = real.sum(1).tolist()
            ids, tts, pos = (t.reshape(-1)[where] for t in (input_ids, token_type_ids, position_ids))
        x = (e.word.weight[ids] + e.token_type.weight[tts]) + e.position.weight[pos]  # (N, H)
        x = F.layer_norm(x, (H,), e.norm.weight, e.norm.bias, e.norm.eps)

        nonempty = [n for n in lengths if n] if lengths is not None else None
        packed_states = [x]
        workspace = _Workspace()
        for i, block in enumerate(blocks[:num_blocks]):
            if i not in skip_blocks and x.shape[0]:  # (an all-padding batch has no token to run)
                x = block(x, nonempty, B, T, workspace)
            packed_states.append(x)

        def unpack(t):  # (N, H) -> (B, T, H), zeros at padding
            if where is None:
                return t.view(B, T, H)
            full = t.new_zeros(B * T, H)
            full[where] = t
            return full.view(B, T, H)

        hidden_states = tuple(unpack(t) for t in packed_states)
        last = hidden_states[-1]
        pooled = model.pooler(last) if model.pooler is not None else None
    return BertOutput(last_hidden_state=last, pooler_output=pooled, hidden_states=hidden_states)
