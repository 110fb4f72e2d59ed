#!/usr/bin/env python3
"""Every fine-tuning recipe with its own defaults (``runs.settings.RECIPES``), against full fine-tuning.

``minibert finetune --recipe R`` with no --lr and no --epochs, as a user runs it, on all-MiniLM-L6-v2 and a
held-out TREC-6 slice: the first N training questions (default 1,500), the 500 test questions held out,
batch 16, max length 64, for each seed. Each recipe's best-epoch accuracy, its gap to full fine-tuning's,
and what the recipe trained at which rate. Results in benchmarks/results/NAME.json and NAME.md.

    python data/fetch_data.py && python benchmarks/bench_recipes.py --seeds 0,1,2 --name recipes_epyc-zen4
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "data"))

from fetch_data import fetch_trec  # noqa: E402

from minibert.logs import lines_to  # noqa: E402
from minibert.runs.finetune import finetune  # noqa: E402
from minibert.runs.settings import RECIPES, FinetuneRun  # noqa: E402

MODEL = ROOT / "weights" / "all-MiniLM-L6-v2"
RESULTS = ROOT / "benchmarks" / "results"


def run_one(recipe: str, seed: int, train: Path, test: Path, work: Path) -> dict:
    """One run with the recipe's own defaults: its best epoch's accuracy and what it took."""
    run = FinetuneRun(train=train, eval=test, model=str(MODEL), out=work / f"{recipe}-{seed}", recipe=recipe,
                      seed=seed, batch_size=16, max_length=64, progress=False, overwrite=True)
    started = time.perf_counter()
    with lines_to(sys.stderr, prefix=f"  {recipe} seed {seed}: "):
        history = finetune(run)
    return {"recipe": recipe, "seed": seed, "accuracy": history.best_metric, "best_epoch": history.best_epoch,
            "epochs": [e["eval"]["accuracy"] for e in history.epochs], "seconds": time.perf_counter() - started,
            "lr": RECIPES[recipe].lr, "default_epochs": RECIPES[recipe].epochs}


def markdown(results: dict) -> str:
    runs = results["runs"]
    by = {r: [x for x in runs if x["recipe"] == r] for r in dict.fromkeys(x["recipe"] for x in runs)}
    full = statistics.mean(x["accuracy"] for x in by["full"]) if "full" in by else None  # a subset may leave it out
    lines = ["# Fine-tuning recipes with their own defaults", "",
             f"all-MiniLM-L6-v2; TREC-6: the first {results['train_slice']:,} training questions, the 500 test questions "
             "held out; batch 16, max length 64, AdamW with 10 % warmup; `minibert finetune --recipe R` with no "
             "--lr or --epochs (the recipe's own, `runs.settings.RECIPES`); accuracy of the best epoch, mean over "
             f"seeds {', '.join(map(str, results['seeds']))} (each seed's in brackets). Machine: "
             f"{results['machine']['cpu']}, {results['machine']['threads']} threads, torch {results['machine']['torch']}.",
             "", "| recipe | what trains | lr | epochs | accuracy | vs full (points) |", "|---|---|---|---|---|---|"]
    for recipe, rows in by.items():
        accs = [x["accuracy"] for x in rows]
        mean = statistics.mean(accs)
        lines.append(f"| {recipe} | {RECIPES[recipe].trains} | {rows[0]['lr']:g} | {rows[0]['default_epochs']} | "
                     f"{mean:.3f} ({', '.join(f'{a:.3f}' for a in accs)}) | "
                     f"{f'{100 * (mean - full):+.1f}' if full is not None else '-'} |")
    if full is not None:
        worst = min(statistics.mean(x["accuracy"] for x in rows) for rows in by.values())
        lines += ["", f"Every recipe comes within {100 * (full - worst):.1f} points of full fine-tuning "
                  f"({full:.3f}) with its own defaults. (The runs' times are not reported: other work shared the "
                  "machine's two cores while they ran.)"]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--recipes", default=",".join(RECIPES))
    parser.add_argument("--train-slice", type=int, default=1500)
    parser.add_argument("--name", default="recipes")
    parser.add_argument("--report", action="store_true", help="only write NAME.md from NAME.json")
    args = parser.parse_args()
    if args.report:
        path = RESULTS / f"{args.name}.json"
        path.with_suffix(".md").write_text(markdown(json.loads(path.read_text())))
        return
    from minibert.hardware import cpu_info

    trec = fetch_trec()
    seeds = [int(s) for s in args.seeds.split(",")]
    path = RESULTS / f"{args.name}.json"
    results = json.loads(path.read_text()) if path.exists() else {"runs": []}
    done = {(r["recipe"], r["seed"]) for r in results["runs"]}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        lines = (trec / "train.csv").read_text(encoding="utf-8").splitlines()
        train = work / "train.csv"
        train.write_text("\n".join(lines[: args.train_slice + 1]) + "\n", encoding="utf-8")
        for recipe in args.recipes.split(","):
            for seed in seeds:
                if (recipe, seed) in done:
                    continue
                results["runs"].append(run_one(recipe, seed, train, trec / "test.csv", work))
                results |= {"train_slice": args.train_slice, "seeds": sorted({r["seed"] for r in results["runs"]}),
                            "machine": {"cpu": cpu_info()[0], "threads": torch.get_num_threads(),
                                        "torch": torch.__version__}}
                path.write_text(json.dumps(results, indent=2) + "\n")  # each run kept as it finishes
    path.with_suffix(".md").write_text(markdown(results))
    print(path.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
