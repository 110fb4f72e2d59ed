"""The hidden-state stack as a toolkit: pick layers, pool tokens, combine layers, compare layers.

Everything here takes ``out.hidden_states`` (a tuple of L + 1 tensors (B, T, H), [0] = embeddings
output) or its stacked form (L + 1, B, T, H), plus the ``attention_mask`` (B, T) so that padding never
leaks into a pooled vector, a mix or a similarity. The definitions followed: ScalarMix is ELMo's and
AllenNLP's ``gamma * sum_k softmax(w)_k h_k`` (N + 1 parameters, w started at 0, gamma at 1; its optional
layer norm normalises each layer by one mean and variance over all unmasked elements of the batch, not per
token); linear CKA is Kornblith et al. 2019's ``||Y^T X||_F^2 / (||X^T X||_F ||Y^T Y||_F)`` on column-centred
(tokens x features) matrices, padding excluded; centre of gravity and expected layer are Tenney et al.
2019's.

* selection: ``parse_layers("-4:", n)``, ``select_layers``; pooling: ``pool`` (cls, mean, max)
* combination: ``concat_layers`` (default the last four), ``weighted_sum`` (softmax of fixed weights),
  ``ScalarMix`` (ELMo / AllenNLP, learned), ``centre_of_gravity``, ``expected_layer`` (Tenney et al. 2019)
* similarity: ``linear_cka``, ``cka_matrix``, ``cosine_matrix``, ``layer_statistics``
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

import torch
from torch import nn

from ..errors import InputError
from ..tools.pooling import pool  # noqa: F401  (its home is tools.pooling; here for analysis code)


# ------------------------------------------------------------------------------------------ selection
def stack(hidden_states) -> torch.Tensor:
    """(L + 1, B, T, H) from the tuple that the model returns (a stacked tensor passes through)."""
    if isinstance(hidden_states, torch.Tensor):
        if hidden_states.dim() != 4:
            raise InputError(f"hidden_states must be (layers, B, T, H), got shape {tuple(hidden_states.shape)}")
        return hidden_states
    return torch.stack(tuple(hidden_states))


def parse_layers(spec, num_layers: int) -> list[int]:
    """Layer indices, non-negative, from an int, a sequence of ints, a slice, or a string such as
    ``"-4:"``, ``"0,6,-1"``, ``"2:5"`` or ``"all"``. ``num_layers`` counts hidden states (L + 1).
    A layer named twice (``"0,6,-1"`` with 7 hidden states names 6 twice) is an error."""
    original = spec
    if isinstance(spec, str):
        text = spec.strip()
        if text == "all":
            return list(range(num_layers))
        if ":" in text:
            parts = text.split(":")
            if len(parts) not in (2, 3):
                raise InputError(f"layers {spec!r}: a slice is start:stop[:step]")
            try:
                spec = slice(*[int(p) if p.strip() else None for p in parts])
            except ValueError:
                raise InputError(f"layers {spec!r} is not a slice of integers") from None
        else:
            try:
                spec = [int(p) for p in text.split(",")]
            except ValueError:
                raise InputError(f"layers {spec!r}: use integers separated by commas, a slice, or 'all'") from None
    if isinstance(spec, slice):
        indices = list(range(num_layers))[spec]
        if not indices:
            raise InputError(f"layers {spec} selects no layer out of {num_layers}")
        return indices
    if isinstance(spec, int):
        spec = [spec]
    out, given = [], {}
    for i in spec:
        if not -num_layers <= int(i) < num_layers:
            raise InputError(f"layer {i} is out of range: there are {num_layers} hidden states "
                             f"(0..{num_layers - 1}, or -{num_layers}..-1)")
        layer = int(i) % num_layers
        if layer in given:
            same = f"{given[layer]} and {i} are both" if given[layer] != i else f"{i} is"
            raise InputError(f"layers {original!r} selects hidden state {layer} twice ({same} layer {layer} of "
                             f"0..{num_layers - 1}); list each layer once")
        given[layer] = i
        out.append(layer)
    if not out:
        raise InputError("no layer selected")
    return out


def select_layers(hidden_states, layers) -> torch.Tensor:
    """(k, B, T, H) for the chosen layers (see ``parse_layers``)."""
    h = stack(hidden_states)
    return h[parse_layers(layers, h.shape[0])]


# ---------------------------------------------------------------------------------------- combination
def concat_layers(hidden_states, layers=(-4, -3, -2, -1)) -> torch.Tensor:
    """Concatenate the chosen layers along features: (B, T, k * H); 3072 for BERT-base's last four."""
    chosen = select_layers(hidden_states, layers)
    return torch.cat(tuple(chosen), dim=-1)


def weighted_sum(hidden_states, weights, layers=None) -> torch.Tensor:
    """sum_k softmax(weights)_k * h_k over the chosen layers (all by default): (B, T, H)."""
    h = stack(hidden_states) if layers is None else select_layers(hidden_states, layers)
    weights = torch.as_tensor(weights, dtype=torch.float32, device=h.device)
    if weights.shape != (h.shape[0],):
        raise InputError(f"weights has shape {tuple(weights.shape)}, expected ({h.shape[0]},): one per layer")
    s = weights.softmax(0).to(h.dtype)
    return torch.einsum("k,kbth->bth", s, h)


class ScalarMix(nn.Module):
    """ELMo's scalar mix (Peters et al. 2018; AllenNLP ``scalar_mix.py``):

        mix = gamma * sum_k softmax(w)_k * h_k

    with N + 1 parameters: the N scalars ``w`` (started at 0 = a uniform mix) and ``gamma`` (started
    at 1). ``scalar_parameters`` holds the raw, pre-softmax ``w``; ``weights`` is the softmax that
    actually mixes -- the two are often confused.

    ``do_layer_norm=True`` normalises each layer before mixing with ONE mean and ONE variance computed
    over all unmasked elements of the batch (batch x time x dim) -- not a per-token LayerNorm.

    Which layers? AllenNLP mixes ``hidden_states[1:]`` (embedding output left out, N = L); jiant mixed
    the embedding output too (N = L + 1). Build ``ScalarMix(L)`` and pass ``out.hidden_states[1:]``,
    or ``ScalarMix(L + 1)`` and pass ``out.hidden_states``.
    """

    def __init__(self, num_layers: int, do_layer_norm: bool = False, initial_scalar_parameters=None,
                 trainable: bool = True):
        super().__init__()
        if num_layers < 1:
            raise InputError(f"num_layers must be >= 1, got {num_layers}")
        init = torch.zeros(num_layers) if initial_scalar_parameters is None else torch.as_tensor(
            initial_scalar_parameters, dtype=torch.float32)
        if init.shape != (num_layers,):
            raise InputError(f"initial_scalar_parameters has {init.numel()} values, expected {num_layers}")
        self.num_layers = num_layers
        self.do_layer_norm = do_layer_norm
        self.scalar_parameters = nn.Parameter(init.clone(), requires_grad=trainable)
        self.gamma = nn.Parameter(torch.ones(1), requires_grad=trainable)

    @property
    def weights(self) -> torch.Tensor:
        """softmax(w): the mixing weights, summing to 1."""
        return self.scalar_parameters.softmax(0)

    def forward(self, hidden_states, mask: torch.Tensor | None = None) -> torch.Tensor:
        h = stack(hidden_states)  # (N, B, T, H)
        if h.shape[0] != self.num_layers:
            raise InputError(
                f"ScalarMix was built for {self.num_layers} layers but got {h.shape[0]}; pass "
                "out.hidden_states[1:] to leave the embedding output out, or build ScalarMix(L + 1) for all")
        if self.do_layer_norm:
            if mask is None:
                raise InputError("ScalarMix(do_layer_norm=True) needs the mask: its statistics skip padding")
            h = _masked_layer_norm(h, mask.to(h.device))
        s = self.weights.to(h.dtype)
        return self.gamma.to(h.dtype) * torch.einsum("k,kbth->bth", s, h)


def _masked_layer_norm(h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per layer, (h - mean) / sqrt(var + tiny) with mean and var over every unmasked element."""
    m = mask.bool()[None, :, :, None].to(h.dtype)  # (1, B, T, 1)
    count = m.sum() * h.shape[-1]
    mean = (h * m).sum(dim=(1, 2, 3), keepdim=True) / count  # (N, 1, 1, 1)
    var = (((h - mean) * m) ** 2).sum(dim=(1, 2, 3), keepdim=True) / count
    tiny = 1e-4 if h.dtype in (torch.float16, torch.bfloat16) else 1e-13  # AllenNLP's tiny_value_of_dtype
    return (h - mean) / torch.sqrt(var + tiny)


def centre_of_gravity(weights, first_layer: int = 0) -> float:
    """sum_l l * s_l for mixing weights s (a ScalarMix, or weights that sum to 1). ``first_layer`` is
    the index of the first mixed layer: 1 when the embedding output was left out."""
    if isinstance(weights, ScalarMix):
        weights = weights.weights
    s = torch.as_tensor(weights, dtype=torch.float64).detach()
    if not math.isclose(float(s.sum()), 1.0, abs_tol=1e-4):
        raise InputError(f"weights must sum to 1 (softmax weights), they sum to {float(s.sum()):.4f}")
    layers = torch.arange(first_layer, first_layer + s.numel(), dtype=torch.float64)
    return float((layers * s).sum())


def expected_layer(scores: Sequence[float]) -> float:
    """Tenney et al. 2019: with F(l) the score of a probe on a cumulative mix of layers 0..l,
    Delta_l = F(l) - F(l - 1) and E[layer] = sum_{l>=1} l * Delta_l / sum_{l>=1} Delta_l."""
    f = [float(x) for x in scores]
    if len(f) < 2:
        raise InputError("expected_layer needs scores for at least layers 0 and 1")
    deltas = [f[i] - f[i - 1] for i in range(1, len(f))]
    total = sum(deltas)
    if total == 0:
        raise InputError("the scores do not change across layers: the expected layer is undefined")
    return sum(l * d for l, d in zip(range(1, len(f)), deltas)) / total


# ----------------------------------------------------------------------------------------- similarity
def linear_cka(x: torch.Tensor, y: torch.Tensor) -> float:
    """Linear CKA (Kornblith et al. 2019) of two (n, d) representations of the same n items:
    ||Y^T X||_F^2 / (||X^T X||_F ||Y^T Y||_F) after centring each column. 1 = same up to rotation and
    isotropic scaling. Computed in float64."""
    if x.dim() != 2 or y.dim() != 2 or x.shape[0] != y.shape[0]:
        raise InputError(f"linear_cka needs (n, d) matrices with the same n, got {tuple(x.shape)} and {tuple(y.shape)}")
    x = x.double() - x.double().mean(0, keepdim=True)
    y = y.double() - y.double().mean(0, keepdim=True)
    if x.shape[0] < max(x.shape[1], y.shape[1]):  # the same value through n x n Gram matrices
        kx, ky = x @ x.T, y @ y.T
        num = (kx * ky).sum()
        den = kx.norm() * ky.norm()
    else:
        num = (y.T @ x).norm() ** 2
        den = (x.T @ x).norm() * (y.T @ y).norm()
    if den == 0:
        raise InputError("linear_cka is undefined for a constant representation")
    return float(num / den)


def token_mask(attention_mask: torch.Tensor, input_ids: torch.Tensor | None = None,
               exclude_ids: Sequence[int] = ()) -> torch.Tensor:
    """Real tokens (attention_mask != 0), minus any whose id is in ``exclude_ids`` (e.g. [CLS], [SEP])."""
    keep = attention_mask.bool()
    if exclude_ids:
        if input_ids is None:
            raise InputError("exclude_ids needs input_ids")
        keep = keep & ~torch.isin(input_ids, torch.as_tensor(list(exclude_ids), device=input_ids.device))
    return keep


CKA_MIN_TOKENS = 3  # fewer is an error: with 2 tokens linear CKA is identically 1
CKA_FEW_TOKENS = 10  # fewer is a warning


def cka_matrix(hidden_states, attention_mask: torch.Tensor, input_ids=None, exclude_ids=()) -> torch.Tensor:
    """(L + 1, L + 1) linear CKA between every pair of layers over the real tokens of the batch."""
    h = stack(hidden_states)
    keep = token_mask(attention_mask.to(h.device), input_ids, exclude_ids)
    tokens = h[:, keep]  # (L + 1, n, H)
    n_tokens = tokens.shape[1]
    if n_tokens < CKA_MIN_TOKENS:
        raise InputError(f"CKA needs at least {CKA_MIN_TOKENS} tokens, got {n_tokens} after masking"
                         + (" and leaving out the special tokens" if exclude_ids else "")
                         + ": over 2 tokens every pair of layers has CKA exactly 1 (centred, 2 points span "
                         "one direction), which says nothing. Use a longer text or more texts")
    if n_tokens < CKA_FEW_TOKENS:
        warnings.warn(f"CKA over only {n_tokens} tokens is biased towards 1 (it needs many more tokens than "
                      f"the {tokens.shape[-1]} dimensions to be reliable); use a longer text or more texts",
                      stacklevel=2)
    n = h.shape[0]
    out = torch.eye(n, dtype=torch.float64)
    for i in range(n):
        for j in range(i + 1, n):
            out[i, j] = out[j, i] = linear_cka(tokens[i], tokens[j])
    return out


def cosine_matrix(hidden_states, attention_mask=None, method: str = "cls") -> torch.Tensor:
    """(L + 1, L + 1) cosine similarity between layers of the pooled vectors, averaged over the batch."""
    pooled = pool(stack(hidden_states).double(), attention_mask, method)  # (L + 1, B, H)
    unit = torch.nn.functional.normalize(pooled, dim=-1)
    return torch.einsum("ibh,jbh->ijb", unit, unit).mean(-1)


def layer_statistics(hidden_states, attention_mask=None) -> dict[str, torch.Tensor]:
    """Per layer, over real tokens: mean and std of the token vectors' L2 norms, the mean cosine of each
    token with itself one layer down (NaN for layer 0) and with itself at the last layer."""
    h = stack(hidden_states).double()
    keep = (attention_mask.to(h.device).bool() if attention_mask is not None
            else torch.ones(h.shape[1:3], dtype=torch.bool, device=h.device))
    tokens = h[:, keep]  # (L + 1, n, H)
    norms = tokens.norm(dim=-1)
    cos = torch.nn.functional.cosine_similarity
    previous = torch.full((h.shape[0],), float("nan"), dtype=torch.float64)
    previous[1:] = cos(tokens[1:], tokens[:-1], dim=-1).mean(-1)
    return {"norm_mean": norms.mean(-1), "norm_std": norms.std(-1) if norms.shape[1] > 1 else torch.zeros(h.shape[0], dtype=torch.float64),
            "cos_previous": previous, "cos_last": cos(tokens, tokens[-1:], dim=-1).mean(-1)}
