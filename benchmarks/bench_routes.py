#!/usr/bin/env python3
"""Does the fast path's default ``fp32_kernel="auto"`` ever lose to a fixed route (issue 47)? On BERT-base
geometry (random weights that transformers builds and saves), fp32, this CPU: transformers' BertModel
(sdpa) against the fast path with ``"auto"`` (decided on the whole block, ``tools.plan.block_plan``) and
with each route fixed (``"linear"``, ``"blocked"``, ``"onednn"``), on a dense 8 x 128 batch and a padded
16 x 128 batch at 38 % real tokens, alternating in one process; each a median of paired ratios to
transformers. The issue's goals: dense <= 0.90, padded <= 0.45, auto within 3 % of the best fixed route.

    python benchmarks/bench_routes.py --name routes_epyc-zen4      # ~3 minutes on 2 cores
    python benchmarks/bench_routes.py --quick                       # MiniLM geometry, 3 rounds (smoke)

A fresh ``$MINIBERT_CACHE`` is used, so "auto" measures here as a first use does (its own times are printed).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from minibert import BertModel  # noqa: E402
from minibert.hardware import cpu_description  # noqa: E402
from minibert.tools import fast, kernels, plan  # noqa: E402
from minibert.tools import timing as harness  # noqa: E402

CASES = [("dense 8 x 128", 8, 128, 1.0, 0.90), ("padded 16 x 128", 16, 128, 0.38, 0.45)]
SMALL = dict(vocab_size=30522, hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--name", default="routes", help="results file name (benchmarks/results/NAME.md)")
    p.add_argument("--rounds", type=int, default=None, help="alternating rounds (default 15; --quick 3)")
    p.add_argument("--quick", action="store_true", help="MiniLM geometry, 3 rounds: a smoke run (NAME_quick.*)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = p.parse_args(argv)
    os.environ[kernels.CACHE_ENV] = tempfile.mkdtemp(prefix="minibert-cache-")  # "auto" measures as a first use
    import transformers

    from conftest import hf_config, random_hf_model

    spec = importlib.util.spec_from_file_location("bench_model", ROOT / "benchmarks" / "bench_model.py")
    bench_model = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_model)
    rounds = args.rounds or (3 if args.quick else 15)
    work = Path(tempfile.mkdtemp(prefix="bench_routes_"))
    random_hf_model(hf_config(**(SMALL if args.quick else {})), seed=0).save_pretrained(work)
    theirs = transformers.BertModel.from_pretrained(work, attn_implementation="sdpa").eval()
    ours = BertModel.from_pretrained(work).eval()
    runs = {"auto": fast.prepare(ours)}
    runs.update({route: fast.prepare(ours, fp32_kernel=route) for route in kernels.ROUTES})
    chosen = {name: {k: v for k, v in fast.routes(ours, name).items() if k != "attention"} for name in runs}
    record = plan.plan_record(ours.config) or {}
    rows = []
    for label, B, T, fraction, goal in CASES:
        batch = bench_model.make_batch(B, T, fraction, ours.config.vocab_size)
        fns = {"transformers": lambda: theirs(**batch)}
        fns.update({name: (lambda run=run: run(**batch)) for name, run in runs.items()})
        with torch.inference_mode():
            times = harness.alternate(fns, rounds, warmup=2, rotate=True)
        ratio = {name: harness.paired_ratio(times, name, "transformers") for name in runs}
        best_fixed = min(ratio[r] for r in kernels.ROUTES)
        rows.append({"case": label, "real": fraction, "ratio": {k: round(v, 3) for k, v in ratio.items()},
                     "auto_vs_best_fixed": round(ratio["auto"] / best_fixed, 3), "goal": goal,
                     "transformers_ms": round(1e3 * harness.medians(times)["transformers"], 2)})
        print(f"{label}: " + ", ".join(f"{k} {v:.3f}" for k, v in ratio.items())
              + f"; auto / best fixed {ratio['auto'] / best_fixed:.3f}", flush=True)
    result = {"cpu": cpu_description(), "threads": torch.get_num_threads(), "torch": torch.__version__,
              "transformers": transformers.__version__, "geometry": "MiniLM (quick)" if args.quick else "BERT-base",
              "rounds": rounds, "routes": chosen, "auto_measured": record, "rows": rows}
    name = args.name + ("_quick" if args.quick else "")
    out = Path(args.out)
    (out / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    lines = ["# The fast path's fp32 routes on the whole forward", "",
             f"{result['cpu']}, {result['threads']} threads; torch {result['torch']}, transformers {result['transformers']}; "
             f"{result['geometry']} geometry, random weights, fp32; {rounds} alternating rounds, medians of paired "
             "ratios to transformers' BertModel (sdpa). `auto` measured on first use, as a user's first call does "
             "(a fresh cache).", "",
             "| batch | transformers ms | auto | linear | blocked | onednn | auto / best fixed | goal (auto) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        q = r["ratio"]
        met = "met" if q["auto"] <= r["goal"] and r["auto_vs_best_fixed"] <= 1.03 else "**not met**"
        lines.append(f"| {r['case']} ({r['real']:.0%} real) | {r['transformers_ms']} | {q['auto']:.3f} | {q['linear']:.3f} | "
                     f"{q['blocked']:.3f} | {q['onednn']:.3f} | {r['auto_vs_best_fixed']:.3f} | <= {r['goal']}, within 3 %: {met} |")
    times = record.get("relative_time") or {}
    lines += ["", "What `auto` took (qkv, attention output, ffn in, ffn out): " + ", ".join(chosen["auto"].values())
              + (f" -- the whole-block candidate {record.get('chosen')!r}; its block times relative to F.linear: "
                 + ", ".join(f"{k} {v:.3f}" for k, v in times.items()) if times else "")
              + (f"; each product alone chose: {', '.join(record['per_product'].values())}" if record.get("per_product") else "")
              + ".", ""]
    (out / f"{name}.md").write_text("\n".join(lines), encoding="utf-8")
    print(f"wrote {out / (name + '.md')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
