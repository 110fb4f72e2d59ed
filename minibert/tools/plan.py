"""``fp32_kernel="auto"``'s decision for a whole block: which of ``tools/kernels.py``'s routes each of a
block's four products takes on this CPU, timed as whole blocks on the forwards it serves -- one plan per row
bucket (``BUCKETS``: a short input, the batches), a forward taking the plan of its row count
(``bucket_of``) -- kept in the cache file."""

from __future__ import annotations

import math

import torch

from .. import measured
from . import kernels, timing, varlen
from .blocks import FusedBlock, Workspace

PRODUCTS = kernels.PRODUCTS  # a block's four products, as ``routes`` names them
#: the batches a block is timed on (B, T, real-token fraction): a dense batch and a padded one
PLAN_CONTEXTS = ((8, 128, 1.0), (16, 128, 0.38))
#: a forward of at most this many real tokens (rows of every product) takes the "short" plan, timed on
#: one short input: on an AMD EPYC Zen 3 MKL's GEMM (F.linear) wins the batches and is the slowest route at
#: 16 rows (BERT-base's 48 products at 16 rows: F.linear 33.9 ms, oneDNN on a packed weight 21.0 ms)
SHORT_ROWS = 64
#: each row bucket's plan is timed on the forwards it serves: (B, T, real-token fraction) contexts, and how many
#: distinct blocks run one after another (a short input's products read their weights from memory, not from a
#: cache one repeated block keeps warm)
BUCKETS = {"short": {"contexts": ((1, 16, 1.0), (1, 48, 1.0)), "blocks": 4, "rounds": 15},
           "batch": {"contexts": PLAN_CONTEXTS, "blocks": 1, "rounds": 3}}
_PLANS: dict[tuple, dict[str, str]] = {}


def bucket_of(rows: int) -> str:
    """The row bucket a forward of ``rows`` real tokens takes its plan from."""
    return "short" if rows <= SHORT_ROWS else "batch"


def block_plans(config) -> dict[str, dict[str, str]]:
    """``block_plan`` of every row bucket (``BUCKETS``), by bucket name."""
    return {bucket: block_plan(config, bucket) for bucket in BUCKETS}


def block_plan(config, bucket: str = "batch") -> dict[str, str]:
    """The fp32 routes ``fp32_kernel="auto"`` takes for a block of ``config``'s geometry on this CPU, in a
    forward of ``bucket``'s rows (``BUCKETS``: "short", at most ``SHORT_ROWS`` real tokens, or "batch").

    Each product's route measured alone (``kernels.route_for``) need not hold in the forward pass: on an AMD
    EPYC Zen 3 oneDNN's own order won every BERT-base product alone (0.72-0.84 of F.linear's time) yet the
    whole forward ran slower than on F.linear (1.20-1.25x transformers' time against 0.95). So the choice is
    made on the whole block: the per-product choice and each route for every product are timed as one
    block on the bucket's contexts (``time_plans``), and the fastest is taken -- one with oneDNN's own order
    only when it beats the fastest exact one by more than ``kernels.BLOCK_MARGIN``. Nor need a route that wins
    the batches win one short input: the plan is decided per row bucket, each timed on the forwards it
    serves. Kept, with the times, in the cache file beside the per-shape choices; ``$MINIBERT_FP32_KERNEL``
    overrides it."""
    if bucket not in BUCKETS:
        raise ValueError(f"bucket {bucket!r}: one of {tuple(BUCKETS)}")
    forced = kernels.forced_route()
    if forced is not None:
        return dict.fromkeys(PRODUCTS, forced)
    shapes = kernels.block_shapes(config.hidden_size, config.intermediate_size)
    machine, what = measured.machine_key(), plan_key(config, bucket)
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
        timed_on = BUCKETS[bucket]
        relative = time_plans(config, candidates, rounds=timed_on["rounds"], contexts=timed_on["contexts"],
                              blocks=timed_on["blocks"])
        chosen = decide_plan(relative, candidates)
        plan = candidates[chosen]
        measured.write_json_entry(kernels.cache_file(), machine, what, {
            "plan": plan, "chosen": chosen, "per_product": per_product, "bucket": bucket,
            "timed_on": [list(c) for c in timed_on["contexts"]],
            "relative_time": {name: round(t, 3) for name, t in relative.items()}})
    _PLANS[(machine, what)] = plan
    return plan


def plan_key(config, bucket: str = "batch") -> str:
    """The name a block geometry's plan for a row bucket is kept under in the cache file."""
    return (f"block H={config.hidden_size} F={config.intermediate_size} heads={config.num_attention_heads} "
            f"{config.hidden_act}" + ("" if bucket == "batch" else f" rows<={SHORT_ROWS}"))


def plan_record(config, bucket: str = "batch") -> dict | None:
    """What ``block_plan`` measured for this geometry and row bucket on this CPU (plan, the candidate chosen,
    each product's choice alone, the relative times), from the cache file; None when nothing was measured."""
    return measured.saved_entry(kernels.cache_file(), measured.machine_key(), plan_key(config, bucket))


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


def time_plans(config, candidates: dict[str, dict[str, str]], rounds: int = 3, contexts=PLAN_CONTEXTS,
               blocks: int = 1) -> dict[str, float]:
    """Each candidate plan's time for ``blocks`` distinct blocks of ``config``'s geometry (random weights) run
    one after another, relative to F.linear's for every product (or the first candidate's): per context of
    ``contexts``, the best of ``rounds`` alternating calls after a warm-up call each; the geometric mean over
    the contexts."""
    from ..model import Block

    g = torch.Generator().manual_seed(0)
    stack = [Block(config).eval() for _ in range(blocks)]
    with torch.no_grad():
        for block in stack:
            for name, p in block.named_parameters():  # BERT's init: N(0, 0.02) weights, zero biases, LayerNorm = identity
                p.copy_(torch.randn(p.shape, generator=g) * 0.02 if p.dim() > 1
                        else torch.ones(p.shape) if "norm.weight" in name else torch.zeros(p.shape))
    with torch.inference_mode():
        fast_blocks = {name: [FusedBlock(block, config.hidden_act, plan) for block in stack]
                       for name, plan in candidates.items()}
        logs = dict.fromkeys(candidates, 0.0)

        def run(chain, x, packing, ws):
            for block in chain:
                x = block(x, packing, "loop", ws)
            return x
        for B, T, real in contexts:
            lengths = [max(1, round(T * real * (0.5 + (i % 4) / 3))) if real < 1 else T for i in range(B)]
            lengths = [min(T, n) for n in lengths]
            mask = torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]
            packing = varlen.pack(None if real == 1 else mask, B, T)
            x = torch.randn(sum(lengths), config.hidden_size, generator=g)
            ws = Workspace()
            fns = {name: (lambda chain=chain: run(chain, x, packing, ws)) for name, chain in fast_blocks.items()}
            best = {name: min(t) for name, t in timing.alternate(fns, rounds, warmup=1, rotate=True).items()}
            base = best.get("linear", best[next(iter(candidates))])
            for name in candidates:
                logs[name] += math.log(best[name] / base) / len(contexts)
    return {name: math.exp(v) for name, v in logs.items()}

