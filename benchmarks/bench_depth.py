#!/usr/bin/env python3
"""The depth lab, measured: a depth study (``runs.depth_study``) on the reachable English text and the
cut-vs-grown comparison; results in benchmarks/results/NAME.json and NAME.md, figures in docs/img/NAME_*.png.

Scales (``--scale``):

* ``full``: 1, 2, 4, 6, 8 blocks of 256 (4 heads, FFN 1,024; ``DepthStudyConfig()``'s geometry), 1,200
  steps of 16 x 128 (2.5M tokens a run; the mini run left the unigram plateau by then), lr 1e-3, under equal
  steps (seeds 0 and 1) and equal training FLOPs (4 blocks' budget), TREC-6 at lr 3e-4: about 3.5 hours on 2
  cores of an EPYC Zen 4 (measured: 15 runs, then the cut-vs-grown comparison's four distillations, each
  paced by the 8-block teacher; the FLOPs of each run are printed before it starts).
  ``DepthStudyConfig()`` itself (2,000 steps of 32 x 128) is for a machine with more cores or a GPU.
* ``reduced``: the same five depths at width 128 (2 heads, FFN 512), 1,000 steps of 16 x 64, lr 2e-3,
  bf16 where the CPU has bf16 units: about an hour on 2 cores.
* ``quick``: the tutorial's ``--quick`` (1, 2, 4 blocks of width 64, 60 steps): minutes.

Every scale: held-out masked-LM loss / accuracy (one set of held-out examples and masks for all), a UPOS
probe per layer (tests/data/pos_sample.conllu, with its control task), TREC-6 fine-tuning (``--epochs``),
forward time, parameters; then the deepest model cut to each smaller depth, against the same depth grown
from scratch and distilled from the deepest (the same tokens). A stopped run picks up where it stopped
(the same command again: the runs live in benchmarks/results/depth-runs.tmp/SCALE); ``--collect`` writes the
page and figures from that folder as it stands.

    python benchmarks/bench_depth.py --scale reduced --name depth_epyc-zen4
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "data"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_pretrain import corpus_files_for_runs  # noqa: E402
from minibert.logs import lines_to  # noqa: E402
from minibert.hardware import cpu_description, native_half  # noqa: E402
from minibert.runs.depth_study import (ARMS, QUICK, DepthStudyConfig, best_probe, cut_vs_grown,  # noqa: E402
                                           plot_study, run_study, summary_rows)

RESULTS = ROOT / "benchmarks" / "results"
MINILM = ROOT / "weights" / "all-MiniLM-L6-v2"
POS = ROOT / "tests" / "data" / "pos_sample.conllu"

SCALES = {
    # fine-tuning at lr 3e-4: the pre-training page's sweep found it better than 1e-4 for 4 x 256 models
    "full": DepthStudyConfig(steps=1200, batch_size=16, task_lr=3e-4),
    "reduced": DepthStudyConfig(hidden=128, heads=2, intermediate=512, steps=1000, batch_size=16, max_length=64,
                                lr=2e-3),
    "quick": QUICK,
}


def run(args) -> dict:
    import fetch_data

    config = SCALES[args.scale]
    config = dataclasses.replace(config, task_epochs=args.epochs if args.scale != "quick" else config.task_epochs,
                                 bf16=native_half(torch.bfloat16) and args.scale != "quick")
    out = RESULTS / "depth-runs.tmp" / args.scale
    started = time.perf_counter()
    if args.collect:  # report the study folder as it stands: nothing is trained or measured
        study = out / "study.json"
        if not study.exists():
            raise SystemExit(f"--collect: {study} does not exist; run the study first (without --collect)")
        results = json.loads(study.read_text(encoding="utf-8"))
        if "speed" not in results:
            raise SystemExit(f"--collect: {study} has not finished its runs; run the same command without --collect")
        results.setdefault("cut_vs_grown", {})
    else:
        trec = fetch_data.fetch_trec()
        corpus = corpus_files_for_runs()
        held = fetch_data.fetch_sentences() / "held.txt"
        results = run_study(corpus, out, vocab=MINILM, eval_texts=held, config=config, conllu=POS,
                            task_train=trec / "train.csv", task_eval=trec / "test.csv")
        results["cut_vs_grown"] = cut_vs_grown(out, corpus, vocab=MINILM, eval_texts=held, conllu=POS,
                                               task_train=trec / "train.csv", task_eval=trec / "test.csv")
    # the quick scale is a smoke run: its figures stay beside its runs
    figures = plot_study(results, out if args.scale == "quick" else ROOT / "docs" / "img", name=args.name)
    return {"name": args.name, "scale": args.scale, "config": results["config"], "rows": summary_rows(results),
            "runs": results["runs"], "speed": results["speed"], "cut_vs_grown": results["cut_vs_grown"],
            "figures": [str(f.relative_to(ROOT)) for f in figures], "seconds_this_call": time.perf_counter() - started,
            "machine": {"cpu": cpu_description(), "threads": torch.get_num_threads(), "torch": torch.__version__}}


def markdown(r: dict) -> str:
    c = r["config"]
    out = [f"# Depth study ({r['scale']}), {r['machine']['cpu']}", "",
           f"Encoders of {', '.join(map(str, c['depths']))} blocks at width {c['hidden']} ({c['heads']} heads, FFN "
           f"{c['intermediate']}), pre-trained from scratch on the reachable English text (VADER, the npm corpus, "
           f"Tatoeba, WikiText-2, tweets; all-MiniLM-L6-v2's vocabulary), {c['batch_size']} x {c['max_length']} tokens a "
           f"step, lr {c['lr']:g}, warmup {','.join(f'{w:g}' for w in c.get('warmups', [c.get('warmup', 0.06)]))}, dropout {c['dropout']:g}, {'bf16' if c['bf16'] else 'fp32'}. "
           f"Equal steps: {c['steps']:,} steps for every depth (seeds {', '.join(map(str, c['seeds']))}); equal "
           f"compute: the training FLOPs {c['reference_depth']} blocks spend in {c['steps']:,} steps "
           "(`tools.accounting.pretraining_flops`). Held-out loss on the same examples and masks for every model "
           "(the VADER held-out sentences); probe: the best layer of a linear UPOS probe (tests/data/pos_sample.conllu); "
           f"task: TREC-6 accuracy after {c['task_epochs']} epoch(s) of fine-tuning. Forward: one batch of 8 x "
           f"{c['max_length']}, fp32, median of alternating rounds. Threads {r['machine']['threads']}, torch "
           f"{r['machine']['torch']}.", "",
           "| blocks | budget | seeds | steps | tokens | TFLOP | parameters | held-out loss (range) | masked acc | "
           "best probe | TREC-6 | forward ms |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in r["rows"]:
        name = f"L{row['depth']}-steps-seed{c['seeds'][0]}"
        ms = r["speed"].get(name, {}).get("ms") if row["budget"] == "steps" else None
        low, high = row["eval_loss_range"]
        spread = f" ({low:.3f}-{high:.3f})" if row["seeds"] > 1 else ""
        out.append(f"| {row['depth']} | {row['budget']} | {row['seeds']} | {row['steps']:,} | {row['tokens'] / 1e6:.2f} M | "
                   f"{row['flops'] / 1e12:.1f} | {row['parameters'] / 1e6:.2f} M | {row['eval_loss']:.3f}{spread} | "
                   f"{row['masked_accuracy']:.3f} | {row.get('probe_best', float('nan')):.3f} | "
                   f"{row.get('task_accuracy', float('nan')):.3f} | {'' if ms is None else f'{ms:.1f}'} |")
    out += ["", "Probe accuracy per hidden state (0 = embeddings), equal steps, first seed:", "",
            "| blocks | " + " | ".join(f"h{i}" for i in range(max(c["depths"]) + 1)) + " | selectivity at the best |",
            "|---|" + "---|" * (max(c["depths"]) + 2)]
    for depth in c["depths"]:
        run_ = r["runs"][f"L{depth}-steps-seed{c['seeds'][0]}"]
        if "probe_accuracy" in run_:
            acc = run_["probe_accuracy"]
            cells = [f"{a:.3f}" for a in acc] + [""] * (max(c["depths"]) + 1 - len(acc))
            best = max(range(len(acc)), key=acc.__getitem__)
            out.append(f"| {depth} | " + " | ".join(cells) + f" | {run_['probe_selectivity'][best]:.3f} (h{best}) |")
    cvg = r.get("cut_vs_grown")
    if cvg and cvg["depths"]:
        teacher = r["runs"][cvg["teacher"]]
        out += ["", f"Cut vs grown: the deepest model ({cvg['teacher']}: held-out loss {teacher['eval_loss']:.3f}, TREC-6 "
                f"{teacher.get('task_accuracy', float('nan')):.3f}) cut to k blocks under its own head, not trained "
                f"further; k blocks grown from scratch; k blocks distilled from the deepest on the same tokens "
                f"(temperature {cvg['temperature']:g}, alpha {cvg['alpha']:g}).", "",
                "| k | model | held-out loss | masked acc | best probe | TREC-6 |", "|---|---|---|---|---|---|"]
        for k, arms in sorted(cvg["depths"].items(), key=lambda kv: int(kv[0])):
            for arm in ARMS:
                m = arms[arm]
                out.append(f"| {k} | {arm} | {m['eval_loss']:.3f} | {m['masked_accuracy']:.3f} | {best_probe(m):.3f} | "
                           f"{m.get('task_accuracy', float('nan')):.3f} |")
        left = [k for k in c["depths"] if k < max(c["depths"]) and str(k) not in cvg["depths"]]
        if left:
            out += ["", f"Not finished (the comparison was stopped): k = {', '.join(map(str, left))}; the same command "
                    "without --collect picks it up."]
    out += ["", "Figures: " + ", ".join(f"![]({'../../' + f})" for f in r["figures"]), ""]
    return "\n".join(out)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", choices=sorted(SCALES), default="reduced")
    parser.add_argument("--epochs", type=int, default=2, help="TREC-6 fine-tuning epochs (full, reduced)")
    parser.add_argument("--name", default=None, help="results and figure name (default depth_SCALE)")
    parser.add_argument("--report", action="store_true", help="only write NAME.md again from NAME.json")
    parser.add_argument("--collect", action="store_true",
                        help="write NAME.json, NAME.md and the figures from the study folder as it stands (its runs "
                             "finished; a cut-vs-grown comparison stopped part-way shows the depths it finished)")
    args = parser.parse_args()
    args.name = args.name or f"depth_{args.scale}"
    path = RESULTS / f"{args.name}.json"
    results = json.loads(path.read_text()) if args.report else run(args)
    path.write_text(json.dumps(results, indent=2) + "\n")
    path.with_suffix(".md").write_text(markdown(results))
    print(markdown(results))


if __name__ == "__main__":
    with lines_to(sys.stdout):  # the runs' lines, as they go
        main()
