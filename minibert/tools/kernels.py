"""The fp32 matrix-product routes of the fast path, and which one this CPU runs fastest.

``y = x W^T + b`` (x: (N, in), W: (out, in)) can be computed three ways, all correct fp32 sums:

* ``"linear"``: ``F.linear`` (MKL's GEMM on CPU). What the readable model computes.
* ``"blocked"``: oneDNN's kernels cut along the inner dimension into the blocks MKL sums in on this CPU,
  added up in MKL's order (``blocked_linear``): F.linear's numbers bit for bit wherever MKL runs its
  blocked kernel (the block is found by trying, ``summation_block``), at oneDNN's speed on few rows.
* ``"onednn"``: one oneDNN call on a prepacked weight, summing in oneDNN's own order. Usually the
  fastest; its results differ from F.linear's by fp32 rounding (the fast path is held to 4x the fp32 noise
  floor on this route, 2x on the other two).

Which is fastest depends on the CPU: on one AMD EPYC (Zen 5) the blocked route ran BERT-base at 0.58 of
transformers' time, on a Zen 4 at 0.94 while the oneDNN route ran 0.70. So the fast path's default
(``fp32_kernel="auto"``) measures: ``route_for(out, in)`` times the three routes side by side on random
(16, in) and (256, in) inputs (``calibrate``: warmed up, alternating, best of 3 rounds; ~0.1 s a shape
for BERT-base) and takes the fastest -- oneDNN's own order only when it beats the faster exact route by
more than 5 %. A choice is kept per weight shape, CPU model, thread count and torch version, in the
process and in ``fp32_kernels.json`` under ``$MINIBERT_CACHE`` (default ``~/.cache/minibert``; a folder
that cannot be written is skipped), so later processes do not measure again. ``MINIBERT_FP32_KERNEL=
linear|blocked|onednn`` (or ``fast.prepare(model, fp32_kernel=...)``) overrides the choice.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F

from .. import measured
from ..measured import machine_key, saved_entry, write_json_entry
from . import timing

MKLDNN = (hasattr(torch.ops, "mkldnn") and hasattr(torch.ops.mkldnn, "_linear_pointwise")
          and hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and torch.backends.mkldnn.is_available())

if MKLDNN:  # the overloads themselves: one attribute walk less per call (hundreds of calls per forward)
    ONEDNN_LINEAR = torch.ops.mkldnn._linear_pointwise.default
    ONEDNN_LINEAR_ADD = torch.ops.mkldnn._linear_pointwise.binary

ROUTES = ("linear", "blocked", "onednn")
EXACT_ROUTES = ("linear", "blocked")  # F.linear's numbers
MARGIN = 0.95  # oneDNN's own order is taken only when it is more than 5 % faster than the best exact route
#: the same for a whole block (``tools.plan.block_plan``): more than 3 %, so "auto" is never more than 3 %
#: slower than the fastest fixed route it measured
BLOCK_MARGIN = 0.97
OVERRIDE_ENV = "MINIBERT_FP32_KERNEL"
CACHE_ENV = measured.CACHE_ENV
_BLOCK_SIZES = (512, 384, 256, 192, 128, 96, 64)  # the inner blocks tried after the whole width
_TILE = 256  # rows: more than twice this many are summed in tiles of at least this many


def pack(weight: torch.Tensor):
    """``weight`` (out, in) reordered into oneDNN's blocked layout (a copy), or None where it cannot be."""
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())
    except RuntimeError:  # this CPU or build cannot
        return None


def pack_blocks(weight: torch.Tensor, k: int) -> list | None:
    """The (out, k) column blocks of ``weight`` (the last one narrower when k does not divide ``in``),
    each prepacked for oneDNN."""
    blocks = [pack(weight[:, i:i + k]) for i in range(0, weight.shape[1], k)]
    return None if any(b is None for b in blocks) else blocks


def blocked_linear(x: torch.Tensor, blocks: list, bias: torch.Tensor, k: int,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T + b summed block by block, in order: ((b + x_0 W_0^T) + x_1 W_1^T) + ... -- the order in
    which a blocked GEMM such as MKL's accumulates C over the inner dimension. x: (N, in). Many rows go
    in tiles of at least ``_TILE`` rows (each tile's partial sums stay in cache), written into ``out``."""
    n = x.shape[0] // _TILE
    if n >= 2:
        out = x.new_empty(x.shape[0], bias.shape[0]) if out is None else out
        for rows, dst in zip(x.tensor_split(n), out.tensor_split(n)):
            dst.copy_(blocked_linear(rows, blocks, bias, k))
        return out
    if len(blocks) == 1:
        return ONEDNN_LINEAR(x, blocks[0], bias, "none", [], "")
    if len(blocks) * k == x.shape[1]:  # (C, N, k): one copy, not one per block
        parts = x.view(x.shape[0], len(blocks), k).transpose(0, 1).contiguous().unbind(0)
    else:  # a narrower last block
        parts = [part.contiguous() for part in x.split(k, 1)]
    y = ONEDNN_LINEAR(parts[0], blocks[0], bias, "none", [], "")  # (N, out)
    for i in range(1, len(blocks)):
        y = ONEDNN_LINEAR_ADD(parts[i], y, blocks[i], None, "add")  # y + x_i W_i^T
    return y


_BLOCKS: dict[tuple, int | None] = {}


def summation_block(out_features: int, in_features: int) -> int | None:
    """The inner block k for which oneDNN's fp32 products, summed block by block (``blocked_linear``),
    equal ``F.linear``'s bit for bit on this CPU and thread count, or None. Found by trying the whole
    width, then each narrower ``_BLOCK_SIZES`` (the last block takes the rest), on random (16, 64 and
    300, in) inputs -- few rows, and one tile's worth, as ``blocked_linear`` cuts many -- and an (out, in)
    weight; remembered per process."""
    key = (out_features, in_features, torch.get_num_threads())
    if key not in _BLOCKS:
        _BLOCKS[key] = None
        if MKLDNN:
            g = torch.Generator().manual_seed(0)
            w = torch.randn(out_features, in_features, generator=g)
            b = torch.randn(out_features, generator=g)
            xs = [torch.randn(m, in_features, generator=g) for m in (16, 64, 300)]  # 300: a tile
            with torch.inference_mode():
                wanted = [F.linear(x, w, b) for x in xs]
                for k in (in_features,) + tuple(c for c in _BLOCK_SIZES if c < in_features):
                    blocks = pack_blocks(w, k)
                    if blocks is not None and all(torch.equal(blocked_linear(x, blocks, b, k), y)
                                                  for x, y in zip(xs, wanted)):
                        _BLOCKS[key] = k
                        break
    return _BLOCKS[key]


# ------------------------------------------------------------------------------------- choosing a route
_PACKABLE: dict[tuple, bool] = {}


def runs_here(route: str, out_features: int, in_features: int) -> bool:
    """Whether this CPU and build can take ``route`` for an (out, in) weight: F.linear always; the blocked
    route where a summation block exists; oneDNN's where weights can be prepacked."""
    if route == "linear":
        return True
    if not MKLDNN:
        return False
    if route == "blocked":
        return summation_block(out_features, in_features) is not None
    key = (out_features, in_features)
    if key not in _PACKABLE:
        _PACKABLE[key] = pack(torch.zeros(out_features, in_features)) is not None
    return _PACKABLE[key]


def calibrate(out_features: int, in_features: int, rows=(16, 256), rounds: int = 3) -> dict[str, float]:
    """Each route's time for an (out, in) weight on this CPU, relative to F.linear's (1.0): the geometric
    mean over ``rows`` of the best of ``rounds`` alternating calls, after a warm-up call of each."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(out_features, in_features, generator=g)
    b = torch.randn(out_features, generator=g)
    available = [route for route in ROUTES if runs_here(route, out_features, in_features)]
    fns = {}
    for n in rows:
        x = torch.randn(n, in_features, generator=g)
        fns[("linear", n)] = lambda x=x: F.linear(x, w, b)
        if "blocked" in available:
            k = summation_block(out_features, in_features)
            blocks = pack_blocks(w, k)
            fns[("blocked", n)] = lambda x=x, blocks=blocks, k=k: blocked_linear(x, blocks, b, k)
        if "onednn" in available:
            packed = pack(w)
            fns[("onednn", n)] = lambda x=x, packed=packed: ONEDNN_LINEAR(x, packed, b, "none", [], "")
    with torch.inference_mode():
        times = timing.alternate(fns, rounds, warmup=1, rotate=True)
    best = {key: min(t) for key, t in times.items()}
    return {route: math.exp(sum(math.log(best[(route, n)] / best[("linear", n)]) for n in rows) / len(rows))
            for route in available}


def decide(relative: dict[str, float]) -> str:
    """The route to take from ``calibrate``'s relative times: the faster exact route, unless oneDNN's own
    order beats it by more than 5 % (``MARGIN``)."""
    exact = min((r for r in EXACT_ROUTES if r in relative), key=lambda r: (relative[r], EXACT_ROUTES.index(r)))
    if "onednn" in relative and relative["onednn"] < MARGIN * relative[exact]:
        return "onednn"
    return exact


def cache_file() -> Path:
    """Where measured choices are kept: ``fp32_kernels.json`` under ``$MINIBERT_CACHE`` (``minibert.measured``)."""
    return measured.cache_dir() / "fp32_kernels.json"


_CHOICES: dict[tuple, str] = {}


def forced_route() -> str | None:
    """``$MINIBERT_FP32_KERNEL`` when set (checked), else None."""
    return measured.forced_choice(OVERRIDE_ENV, ROUTES)


def route_for(out_features: int, in_features: int) -> str:
    """The fp32 route ``fp32_kernel="auto"`` takes for an (out, in) weight here: ``$MINIBERT_FP32_KERNEL``
    when set, else the choice measured on this CPU model, thread count and torch version (in this process,
    or earlier ones through the cache file), else measured now (``calibrate``, ``decide``) and kept."""
    forced = forced_route()
    if forced is not None:
        return forced if runs_here(forced, out_features, in_features) else "linear"
    machine, shape = machine_key(), f"{out_features}x{in_features}"
    key = (machine, shape)
    if key not in _CHOICES:
        entry = saved_entry(cache_file(), machine, shape)
        route = entry.get("route") if entry else None
        if route not in ROUTES or not runs_here(route, out_features, in_features):  # none saved, or not here
            relative = calibrate(out_features, in_features)
            route = decide(relative)
            write_json_entry(cache_file(), machine, shape, {"route": route, "relative_time": {r: round(t, 3) for r, t in relative.items()}})
        _CHOICES[key] = route
    return _CHOICES[key]


#: a BERT block's four products (QKV fused, attention output, FFN in, FFN out), named as ``minibert inspect``
#: prints them
PRODUCTS = ("qkv", "attention output", "ffn in", "ffn out")


def block_shapes(hidden: int, intermediate: int) -> dict[str, tuple[int, int]]:
    """The (out, in) weight shape of each of a block's ``PRODUCTS``."""
    return dict(zip(PRODUCTS, ((3 * hidden, hidden), (hidden, hidden), (intermediate, hidden), (hidden, intermediate))))


def routes_for_shapes(hidden: int, intermediate: int) -> dict[str, str]:
    """``route_for`` of each of a block's ``PRODUCTS``, each measured alone."""
    return {name: route_for(*shape) for name, shape in block_shapes(hidden, intermediate).items()}
