"""``fp32_kernel="auto"``'s decision for a whole block: which of ``tools/kernels.py``'s routes each of a
block's four products takes on this CPU, timed as one block (``block_plan``), kept in the cache file."""

from __future__ import annotations

import math

import torch

from .. import measured
from . import kernels, timing, varlen
from .blocks import FusedBlock, Workspace

PRODUCTS = kernels.PRODUCTS  # a block's four products, as ``routes`` names them
#: the batches a block is timed on (B, T, real-token fraction): a dense batch and a padded one
PLAN_CONTEXTS = ((8, 128, 1.0), (16, 128, 0.38))
_PLANS: dict[tuple, dict[str, str]] = {}


def block_plan(config) -> dict[str, str]:
    """The fp32 routes ``fp32_kernel="auto"`` takes for a block of ``config``'s geometry on this CPU.

    Each product's route measured alone (``kernels.route_for``) need not hold in the forward pass: on an AMD
    EPYC Zen 3 oneDNN's own order won every BERT-base product alone (0.72-0.84 of F.linear's time) yet the
    whole forward ran slower than on F.linear (1.20-1.25x transformers' time against 0.95). So the choice is
    made on the whole block: the per-product choice and each route for every product are timed as one
    block on ``PLAN_CONTEXTS`` (``time_plans``), and the fastest is taken -- one with oneDNN's own order only
    when it beats the fastest exact one by more than ``kernels.BLOCK_MARGIN``. Kept, with the times, in the
    cache file beside the per-shape choices; ``$MINIBERT_FP32_KERNEL`` overrides it."""
    forced = kernels.forced_route()
    if forced is not None:
        return dict.fromkeys(PRODUCTS, forced)
    shapes = kernels.block_shapes(config.hidden_size, config.intermediate_size)
    machine, what = measured.machine_key(), plan_key(config)
    if (machine, what) in _PLANS:
        return _PLANS[(machine, what)]
    entry = measured.saved_entry(kernels.cache_file(), machine, what)
    plan = entry.get("plan") if entry else None
    if not (isinstance(plan, dict) and set(plan) == set(PRODUCTS)
            and all(r in kernels.ROUTES and kernels.runs_here(r, *shapes[p]) for p, r in plan.items())):
        per_product = kernels.routes_for_shapes(config.hidden_size, config.intermediate_size)
        candidates = {route: dict.fromkeys(PRODUCTS, route) for route in kernels.ROUTES
                      if all(kernels.runs_here(route, *shape) for shape in shapes.values())}
        if per_product not in candidates.values():
            candidates["per product"] = per_product
        relative = time_plans(config, candidates)
        chosen = decide_plan(relative, candidates)
        plan = candidates[chosen]
        measured.write_json_entry(kernels.cache_file(), machine, what, {
            "plan": plan, "chosen": chosen, "per_product": per_product,
            "relative_time": {name: round(t, 3) for name, t in relative.items()}})
    _PLANS[(machine, what)] = plan
    return plan


def plan_key(config) -> str:
    """The name a block geometry's plan is kept under in the cache file."""
    return (f"block H={config.hidden_size} F={config.intermediate_size} heads={config.num_attention_heads} "
            f"{config.hidden_act}")


def plan_record(config) -> dict | None:
    """What ``block_plan`` measured for this geometry on this CPU (plan, the candidate chosen, each product's
    choice alone, the relative times), from the cache file; None when nothing was measured."""
    return measured.saved_entry(kernels.cache_file(), measured.machine_key(), plan_key(config))


def decide_plan(relative: dict[str, float], candidates: dict[str, dict[str, str]]) -> str:
    """The candidate to take from ``time_plans``' relative times: the fastest whose products are all exact
    (F.linear's numbers), unless one with oneDNN's own order beats it by more than ``kernels.BLOCK_MARGIN``."""
    def exact(name):
        return all(route in kernels.EXACT_ROUTES for route in candidates[name].values())
    best_exact = min((n for n in relative if exact(n)), key=relative.get, default=None)
    best = min(relative, key=relative.get)
    if best_exact is None or relative[best] < kernels.BLOCK_MARGIN * relative[best_exact]:
        return best
    return best_exact


def time_plans(config, candidates: dict[str, dict[str, str]], rounds: int = 3) -> dict[str, float]:
    """Each candidate plan's time for one block of ``config``'s geometry (random weights), relative to
    F.linear's for every product (or the first candidate's): per context of ``PLAN_CONTEXTS``, the best of
    ``rounds`` alternating calls after a warm-up call each; the geometric mean over the contexts."""
    from ..model import Block

    g = torch.Generator().manual_seed(0)
    block = Block(config).eval()
    with torch.no_grad():
        for name, p in block.named_parameters():  # BERT's init: N(0, 0.02) weights, zero biases, LayerNorm = identity
            p.copy_(torch.randn(p.shape, generator=g) * 0.02 if p.dim() > 1
                    else torch.ones(p.shape) if "norm.weight" in name else torch.zeros(p.shape))
    with torch.inference_mode():
        fast_blocks = {name: FusedBlock(block, config.hidden_act, plan) for name, plan in candidates.items()}
        logs = dict.fromkeys(candidates, 0.0)
        for B, T, real in PLAN_CONTEXTS:
            lengths = [max(1, round(T * real * (0.5 + (i % 4) / 3))) if real < 1 else T for i in range(B)]
            lengths = [min(T, n) for n in lengths]
            mask = torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]
            packing = varlen.pack(None if real == 1 else mask, B, T)
            x = torch.randn(sum(lengths), config.hidden_size, generator=g)
            ws = Workspace()
            fns = {name: (lambda b=b: b(x, packing, "loop", ws)) for name, b in fast_blocks.items()}
            best = {name: min(t) for name, t in timing.alternate(fns, rounds, warmup=1, rotate=True).items()}
            base = best.get("linear", best[next(iter(candidates))])
            for name in candidates:
                logs[name] += math.log(best[name] / base) / len(PLAN_CONTEXTS)
    return {name: math.exp(v) for name, v in logs.items()}

