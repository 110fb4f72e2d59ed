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
* ``stability``: is depth a stability problem? 2, 4, 6, 8, 12 blocks at width 128 x BERT's post-LN, pre-LN
  and DeepNorm (``models/norms.py``) x warmup 0, 1 %, 6 %, 20 %, seeds 0 and 1: 120 runs of 600 steps of 16 x
  64 at lr 2e-3, equal steps only, no probe or task. Per depth x placement x warmup: the runs stuck on the
  unigram plateau, the runs whose gradients collapsed towards the input, the held-out loss; the 12-block
  runs' per-block gradients over training (``docs/img/NAME_gradients_NORM.png``). 86 minutes on 2 cores of an
  EPYC Zen 5.
* ``control``: with the grid's fixes (pre-LN and DeepNorm, 20 % warmup), does deeper win, and how much of a
  task score is pre-training? The same depths and width, one seed, 1,500 steps at equal steps and equal compute
  (4 blocks' FLOPs), each model fine-tuned on TREC-6 (3 epochs at lr 3e-4), and a randomly initialised model
  of each depth and placement fine-tuned alike. 53 minutes on 2 cores of an EPYC Zen 5.

The full, reduced and quick scales: held-out masked-LM loss / accuracy (one set of held-out examples and masks
for all), a UPOS probe per layer (tests/data/pos_sample.conllu, with its control task), TREC-6 fine-tuning
(``--epochs``), forward time, parameters; then the deepest model cut to each smaller depth, against the same depth grown
from scratch and distilled from the deepest (the same tokens). A stopped run picks up where it stopped
(the same command again: the runs live in benchmarks/results/depth-runs.tmp/SCALE); ``--collect`` writes the
page and figures from that folder as it stands. ``--random-control --name NAME`` adds to a finished study's
NAME.json the random-init control: each depth randomly initialised and fine-tuned on TREC-6 as its models were.

    python benchmarks/bench_depth.py --scale reduced --name depth_epyc-zen4
    python benchmarks/bench_depth.py --random-control --name depth_full_epyc-zen4
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "data"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_pretrain import corpus_files_for_runs  # noqa: E402
from minibert.config import NORM_PLACEMENTS  # noqa: E402
from minibert.logs import lines_to  # noqa: E402
from minibert.hardware import cpu_description, native_half  # noqa: E402
from minibert.runs.depth_study import (ARMS, QUICK, DepthStudyConfig, bert_config, best_probe,  # noqa: E402
                                           cut_vs_grown, plot_study, random_control, run_study, study_config,
                                           summary_rows)

RESULTS = ROOT / "benchmarks" / "results"
MINILM = ROOT / "weights" / "all-MiniLM-L6-v2"
POS = ROOT / "tests" / "data" / "pos_sample.conllu"

SCALES = {
    # fine-tuning at lr 3e-4: the pre-training page's sweep found it better than 1e-4 for 4 x 256 models
    "full": DepthStudyConfig(steps=1200, batch_size=16, task_lr=3e-4),
    "reduced": DepthStudyConfig(hidden=128, heads=2, intermediate=512, steps=1000, batch_size=16, max_length=64,
                                lr=2e-3),
    "quick": QUICK,
    # issue 49: is depth a stability problem? every depth x norm placement x warmup share, two seeds, equal steps
    # only; no probe, task or cut-vs-grown (the held-out loss, the stuck share and the per-block gradients)
    "stability": DepthStudyConfig(depths=(2, 4, 6, 8, 12), hidden=128, heads=2, intermediate=512, steps=600,
                                  batch_size=16, max_length=64, lr=2e-3, budgets=("steps",), seeds=(0, 1),
                                  norms=("post", "pre", "deepnorm"), warmups=(0.0, 0.01, 0.06, 0.2)),
    # with the fixes the stability grid found (pre-LN, DeepNorm; 20 % warmup), does deeper win? one seed of every
    # depth at equal steps (2.5 times the grid's) and at equal compute (4 blocks' FLOPs), each fine-tuned on TREC-6
    # -- and the random-init control: a random model of each depth and placement fine-tuned alike
    "control": DepthStudyConfig(depths=(2, 4, 6, 8, 12), hidden=128, heads=2, intermediate=512, steps=1500,
                                batch_size=16, max_length=64, lr=2e-3, seeds=(0,), norms=("pre", "deepnorm"),
                                warmups=(0.2,), task_lr=3e-4, task_epochs=3),
}
#: what each scale measures besides the held-out loss: the UPOS probe, the task, cut vs grown
MEASURES = {"full": ("probe", "task", "cut"), "reduced": ("probe", "task", "cut"), "quick": ("probe", "task", "cut"),
            "stability": (), "control": ("task",)}


def run(args) -> dict:
    import fetch_data

    config = SCALES[args.scale]
    fixed_epochs = args.scale in ("quick", "control")
    config = dataclasses.replace(config, task_epochs=config.task_epochs if fixed_epochs else args.epochs,
                                 bf16=native_half(torch.bfloat16) and args.scale != "quick")
    out = RESULTS / "depth-runs.tmp" / args.scale
    out.parent.mkdir(exist_ok=True)  # the runs' folder (git-ignored); run_study creates the last level
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
        measures = MEASURES[args.scale]
        conllu = POS if "probe" in measures else None
        task = dict(task_train=trec / "train.csv", task_eval=trec / "test.csv") if "task" in measures else {}
        results = run_study(corpus, out, vocab=MINILM, eval_texts=held, config=config, conllu=conllu, **task)
        results["cut_vs_grown"] = cut_vs_grown(out, corpus, vocab=MINILM, eval_texts=held, conllu=conllu, **task) \
            if "cut" in measures else {}
    # the quick scale is a smoke run: its figures stay beside its runs
    figures = plot_study(results, out if args.scale == "quick" else ROOT / "docs" / "img", name=args.name)
    if args.scale == "stability":
        figures += _training_gradients(results, out, ROOT / "docs" / "img", args.name)
    return {"name": args.name, "scale": args.scale, "config": results["config"], "rows": summary_rows(results),
            "unigram_rate": results.get("unigram_rate"),
            "runs": results["runs"], "speed": results["speed"], "cut_vs_grown": results["cut_vs_grown"],
            "figures": [str(f.relative_to(ROOT)) for f in figures], "seconds_this_call": time.perf_counter() - started,
            "machine": {"cpu": cpu_description(), "threads": torch.get_num_threads(), "torch": torch.__version__}}


def random_controls(r: dict) -> dict:
    """The random-init control of a finished study (``--random-control``): each depth's geometry and first norm
    placement, randomly initialised (seed 0) and fine-tuned on TREC-6 exactly as the study's pre-trained models
    were (its epochs and lr, batch 32, 64 tokens). Returns {depth: accuracy}; no pre-training is run again."""
    import fetch_data
    import tempfile

    from minibert.models.norms import norm_config
    from minibert.tokenizer import BertTokenizer

    config, trec = study_config(r), fetch_data.fetch_trec()
    vocab_size = len(BertTokenizer.from_pretrained(MINILM).vocab)
    out = {}
    with tempfile.TemporaryDirectory() as work:
        for depth in config.depths:
            bert = norm_config(bert_config(config, depth, vocab_size), config.norms[0])
            out[str(depth)] = random_control(bert, MINILM, config, trec / "train.csv", trec / "test.csv",
                                             Path(work) / f"L{depth}")
            print(f"random-init L{depth}: TREC-6 {out[str(depth)]:.3f}", flush=True)
    return out


def _control_table(r: dict) -> list[str]:
    """The pre-trained models' TREC-6 accuracy (equal steps, mean of the seeds) beside the random-init control's."""
    c, control = r["config"], r["random_control"]
    out = ["", f"Random-init control (`--random-control`, {control['machine']}): each depth randomly initialised "
           f"(seed 0) and fine-tuned on TREC-6 exactly as the pre-trained models ({c['task_epochs']} epochs at lr "
           f"{c['task_lr']:g}); gain = pre-trained - random:", "",
           "| blocks | pre-trained (equal steps, mean) | each seed | random init | gain |", "|---|---|---|---|---|"]
    for row in r["rows"]:
        if row["budget"] == "steps" and str(row["depth"]) in control["accuracy"]:
            random_ = control["accuracy"][str(row["depth"])]
            seeds = " / ".join(f"{run_['task_accuracy']:.3f}" for run_ in r["runs"].values()
                               if (run_["depth"], run_["budget"]) == (row["depth"], "steps"))
            out.append(f"| {row['depth']} | {row['task_accuracy']:.3f} | {seeds} | {random_:.3f} | "
                       f"{row['task_accuracy'] - random_:+.3f} |")
    return out


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
    if "random_control" in r:
        out += _control_table(r)
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


def _training_gradients(results: dict, out: Path, folder: Path, name: str) -> list[Path]:
    """The per-block gradient figure of a run over training (its OUT/gradients.png), copied for the deepest
    model of the first seed at BERT's 6 % warmup (or the first warmup), one per norm placement."""
    c = results["config"]
    warmup = 0.06 if 0.06 in c["warmups"] else c["warmups"][0]
    written = []
    for key, run_ in sorted(results["runs"].items()):
        if (run_["depth"], run_["seed"], run_["warmup"]) == (max(c["depths"]), c["seeds"][0], warmup):
            target = folder / f"{name}_gradients_{run_['norm']}.png"
            shutil.copyfile(out / "runs" / key / "gradients.png", target)
            written.append(target)
    return written


def _grid(rows: list[dict], depths, cell) -> list[str]:
    """A table: one line per (norm placement, warmup), one column per depth, ``cell(row)`` in each."""
    out = ["| norm | warmup | " + " | ".join(f"{d} blocks" for d in depths) + " |", "|---|---|" + "---|" * len(depths)]
    lines = sorted({(r["norm"], r["warmup"]) for r in rows}, key=lambda k: (NORM_PLACEMENTS.index(k[0]), k[1]))
    for norm, warmup in lines:
        mine = {r["depth"]: r for r in rows if (r["norm"], r["warmup"]) == (norm, warmup)}
        out.append(f"| {norm} | {warmup:g} | " + " | ".join(cell(mine[d]) if d in mine else "" for d in depths) + " |")
    return out


#: each norm placement in the words of a results page
PLACEMENTS = {"post": "after each sublayer as in BERT (post)",
              "pre": "before each sublayer with a final LayerNorm (pre; Xiong et al. 2020)",
              "deepnorm": "after a scaled residual with a smaller init (DeepNorm; Wang et al. 2022: alpha = "
                          "(2N)^(1/4), beta = (8N)^(-1/4))"}


def _gradient_ratio(run: dict, key: str = "grad_init") -> str:
    """The last block's gradient norm over the first block's, at the first step (or the last record)."""
    norms = run.get(key)
    if not norms or not norms[0]:
        return ""
    ratio = norms[-1] / norms[0]
    return f"{ratio:.2f}" if ratio < 100 else f"{ratio:.1e}".replace("e+0", "e").replace("e+", "e")


def markdown_stability(r: dict) -> str:
    """The stability grid's page (``--scale stability`` and ``control``): the stuck share, the held-out loss and
    the per-block gradients by depth x norm placement x warmup; with a task, the random-init control."""
    c, runs = r["config"], list(r["runs"].values())
    rows = [row for row in r["rows"] if row["budget"] == "steps"]  # the grids: equal steps
    depths = c["depths"]
    rate = r["unigram_rate"]
    out = [f"# Depth and stability ({r['scale']}), {r['machine']['cpu']}", "",
           f"Encoders of {', '.join(map(str, depths))} blocks at width {c['hidden']} ({c['heads']} heads, FFN "
           f"{c['intermediate']}) with the LayerNorm {' or '.join(PLACEMENTS[n] for n in c['norms'])}, pre-trained "
           "from scratch on the reachable English text "
           f"(all-MiniLM-L6-v2's vocabulary), {c['steps']:,} steps of {c['batch_size']} x {c['max_length']} tokens"
           + (f" (and at equal compute: the training FLOPs {c['reference_depth']} blocks spend in those steps)"
              if "compute" in c["budgets"] else "") + ", "
           f"lr {c['lr']:g} with a warmup of {', '.join(f'{w:g}' for w in c['warmups'])} of the steps, then linear "
           f"decay; dropout {c['dropout']:g}, {'bf16' if c['bf16'] else 'fp32'}; seeds "
           f"{', '.join(map(str, c['seeds']))}. Every model's held-out masked-LM loss and masked-token accuracy "
           "on one fixed set of examples and masks (the VADER held-out sentences). A run is **stuck** when its "
           f"held-out masked accuracy is at most 1.1 x the unigram rate + 0.01 (the most frequent token's share of "
           f"the training text: {rate:.3f}; `training.diagnostics.on_plateau`). Threads {r['machine']['threads']}, "
           f"torch {r['machine']['torch']}.", "",
           "Runs stuck on the unigram plateau (of the seeds; equal steps):", "", *_grid(rows, depths, lambda row: (
               f"{round(row['stuck_share'] * row['seeds'])}/{row['seeds']}")), "",
           f"Runs whose gradients collapsed towards the input (at the run's last gradient record the first block's "
           f"gradient norm is under 1/{COLLAPSE} of the last block's):", "",
           *_grid(rows, depths, lambda row: _collapsed(runs, row)), "",
           "Held-out masked-LM loss (mean of the seeds; the range when they differ by more than 0.05):", "",
           *_grid(rows, depths, _loss_cell), "",
           "Masked-token accuracy (mean of the seeds):", "",
           *_grid(rows, depths, lambda row: f"{row['masked_accuracy']:.3f}"),
           "", "Gradient norm of the last block over the first's at the first step (the first seed, warmup "
           f"{c['warmups'][0]:g}; > 1: growing towards the output, Xiong et al.'s post-LN picture), and at the run's "
           "last record:", "",
           "| norm | " + " | ".join(f"{d} blocks: init / last" for d in depths) + " |", "|---|" + "---|" * len(depths)]
    for norm in [n for n in NORM_PLACEMENTS if n in c["norms"]]:
        first = {x["depth"]: x for x in runs if x["norm"] == norm and x["seed"] == c["seeds"][0]
                 and x["warmup"] == c["warmups"][0] and x["budget"] == "steps"}
        out.append(f"| {norm} | " + " | ".join(
            f"{_gradient_ratio(first[d])} / {_gradient_ratio(first[d], 'grad_last')}" if d in first else ""
            for d in depths) + " |")
    if any("task_accuracy" in row for row in r["rows"]):
        out += ["", f"TREC-6 accuracy after {c['task_epochs']} epochs of fine-tuning at lr {c['task_lr']:g} (the best "
                "epoch on the test questions), from the pre-trained model and from a randomly initialised model of the "
                "same geometry and placement fine-tuned alike (the control):", "",
                "| norm | warmup | budget | blocks | steps | held-out loss | masked acc | stuck | pre-trained | "
                "random init | pre-training adds |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        # one control per depth and placement (measured with the first budget's run): every budget's row reads it
        controls = {(x["norm"], x["depth"]): x["task_accuracy_random"] for x in r["rows"]
                    if "task_accuracy_random" in x}
        for row in sorted(r["rows"], key=lambda x: (NORM_PLACEMENTS.index(x["norm"]), x["warmup"],
                                                    x["budget"] != "steps", x["depth"])):
            random_ = controls.get((row["norm"], row["depth"]))
            gain = None if random_ is None else row["task_accuracy"] - random_
            out.append(f"| {row['norm']} | {row['warmup']:g} | {row['budget']} | {row['depth']} | {row['steps']:,} | "
                       f"{row['eval_loss']:.3f} | {row['masked_accuracy']:.3f} | "
                       f"{round(row['stuck_share'] * row['seeds'])}/{row['seeds']} | {row['task_accuracy']:.3f} | "
                       f"{'' if gain is None else f'{random_:.3f}'} | {'' if gain is None else f'{gain:+.3f}'} |")
    out += ["", "Figures: " + ", ".join(f"![]({'../../' + f})" for f in r["figures"]), ""]
    return "\n".join(out)


#: a run's gradients collapsed when its last block's gradient norm is this many times its first block's
COLLAPSE = 100


def _collapsed(runs: list[dict], row: dict) -> str:
    """k/n: of the runs behind an equal-steps row, those whose gradients collapsed towards the input."""
    mine = [x for x in runs if (x["norm"], x["warmup"], x["depth"], x["budget"]) ==
            (row["norm"], row["warmup"], row["depth"], "steps") and x.get("grad_last")]
    return f"{sum(x['grad_last'][-1] > COLLAPSE * x['grad_last'][0] for x in mine)}/{len(mine)}"


def _loss_cell(row: dict) -> str:
    low, high = row["eval_loss_range"]
    return f"{row['eval_loss']:.3f}" + (f" ({low:.2f}-{high:.2f})" if high - low > 0.05 else "")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", choices=sorted(SCALES), default="reduced")
    parser.add_argument("--epochs", type=int, default=2, help="TREC-6 fine-tuning epochs (full, reduced)")
    parser.add_argument("--name", default=None, help="results and figure name (default depth_SCALE)")
    parser.add_argument("--report", action="store_true", help="only write NAME.md again from NAME.json")
    parser.add_argument("--collect", action="store_true",
                        help="write NAME.json, NAME.md and the figures from the study folder as it stands (its runs "
                             "finished; a cut-vs-grown comparison stopped part-way shows the depths it finished)")
    parser.add_argument("--random-control", action="store_true",
                        help="add to NAME.json the random-init control of its study: each depth randomly initialised "
                             "and fine-tuned on TREC-6 as the pre-trained ones were (minutes; nothing pre-trained)")
    args = parser.parse_args()
    args.name = args.name or f"depth_{args.scale}"
    path = RESULTS / f"{args.name}.json"
    results = json.loads(path.read_text()) if args.report or args.random_control else run(args)
    if args.random_control:
        results["random_control"] = {"accuracy": random_controls(results), "machine": f"{cpu_description()}, "
                                     f"threads {torch.get_num_threads()}, torch {torch.__version__}"}
    path.write_text(json.dumps(results, indent=2) + "\n")
    page = (markdown_stability if results["scale"] in ("stability", "control") else markdown)(results)
    path.with_suffix(".md").write_text(page)
    print(page)


if __name__ == "__main__":
    with lines_to(sys.stdout):  # the runs' lines, as they go
        main()
