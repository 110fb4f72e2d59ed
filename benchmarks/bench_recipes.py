#!/usr/bin/env python3
"""Every fine-tuning recipe with its own defaults (``runs.settings.RECIPES``), against full fine-tuning, at
several training-set sizes (issue 65: a default must hold on a small dataset too).

``minibert finetune --recipe R`` with no --lr and no --epochs, as a user runs it, on all-MiniLM-L6-v2 and
TREC-6: the first N training questions for each size N (default 600, 1,200 and all 5,452; the file is in
no class order), the 500 test questions held out, batch 16, max length 64, for each seed. Each recipe's
best-epoch accuracy, mean and spread over seeds, its gap to full fine-tuning's at the same size, and the
schedule it took (``recipe_epochs``: the recipe's epochs, more on small data to reach its ``min_steps``).
``--epochs N`` fixes the epochs instead (what the defaults were before the rule: 3), for comparison.
Results in benchmarks/results/NAME.json and NAME.md; runs already in NAME.json are kept, not re-run.

    python data/fetch_data.py && python benchmarks/bench_recipes.py --seeds 0,1,2 --name recipes_sizes_epyc-zen4
    python benchmarks/bench_recipes.py --sizes 600,1200 --epochs 3 --name recipes_sizes_epyc-zen4   # the old rule
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
from minibert.runs.settings import RECIPES, FinetuneRun, recipe_epochs  # noqa: E402

MODEL = ROOT / "weights" / "all-MiniLM-L6-v2"
RESULTS = ROOT / "benchmarks" / "results"
BATCH, MAX_LENGTH = 16, 64


def run_one(recipe: str, seed: int, size: int, epochs: int | None, train: Path, test: Path, work: Path) -> dict:
    """One run with the recipe's own defaults (``epochs``: fixed instead): its best epoch's accuracy."""
    run = FinetuneRun(train=train, eval=test, model=str(MODEL), out=work / f"{recipe}-{size}-{seed}", recipe=recipe,
                      seed=seed, batch_size=BATCH, max_length=MAX_LENGTH, progress=False, overwrite=True, epochs=epochs)
    started = time.perf_counter()
    with lines_to(sys.stderr, prefix=f"  {recipe} {size} rows seed {seed}: "):
        history = finetune(run)
    taken = len(history.epochs)
    return {"recipe": recipe, "seed": seed, "size": size, "schedule": "rule" if epochs is None else f"fixed {epochs}",
            "accuracy": history.best_metric, "best_epoch": history.best_epoch, "epochs_taken": taken,
            "steps": taken * -(-size // BATCH), "epochs": [e["eval"]["accuracy"] for e in history.epochs],
            "seconds": round(time.perf_counter() - started, 1), "lr": RECIPES[recipe].lr}


def summary(runs: list[dict]) -> dict:
    """{(schedule, size): {recipe: (mean, low, high, epochs, n)}}."""
    table: dict = {}
    for r in runs:
        table.setdefault((r["schedule"], r["size"]), {}).setdefault(r["recipe"], []).append(r)
    return {key: {recipe: (statistics.mean(x["accuracy"] for x in rows), min(x["accuracy"] for x in rows),
                           max(x["accuracy"] for x in rows), rows[0]["epochs_taken"], len(rows))
                  for recipe, rows in by.items()} for key, by in table.items()}


def markdown(results: dict) -> str:
    m = results["machine"]
    table = summary(results["runs"])
    sizes = sorted({size for _, size in table})
    lines = ["# Fine-tuning recipes with their own defaults, at three training-set sizes", "",
             "all-MiniLM-L6-v2; TREC-6 (6 classes): the first N training questions, the 500 test questions held "
             f"out; batch {BATCH}, max length {MAX_LENGTH}, AdamW, warm-up 10 % of the steps then linear decay; "
             "`minibert finetune --recipe R` with no --lr or --epochs (the recipe's own, `runs.settings.RECIPES`; "
             "its epochs grow on small data until it has taken its `min_steps` optimiser steps); accuracy of the "
             "best epoch, mean over seeds (lowest-highest in brackets). Machine: "
             f"{m['cpu']}, {m['threads']} threads, torch {m['torch']}.", ""]
    for schedule in ("rule", *sorted({s for s, _ in table} - {"rule"})):
        present = [size for size in sizes if (schedule, size) in table]
        if not present:
            continue
        title = "With the schedule rule (the defaults)" if schedule == "rule" else f"Epochs {schedule} (before the rule)"
        lines += [f"## {title}", "", "| recipe | lr | min steps | " + " | ".join(f"{n:,} rows: epochs, accuracy, vs full"
                                                                              for n in present) + " |",
                  "|---|---|---|" + "---|" * len(present)]
        for recipe, defaults in RECIPES.items():
            cells = []
            for size in present:
                row = table[(schedule, size)].get(recipe)
                full = table[(schedule, size)].get("full")
                if row is None:
                    cells.append("")
                    continue
                mean, low, high, epochs, n = row
                gap = f", {100 * (mean - full[0]):+.1f}" if full and recipe != "full" else ""
                cells.append(f"{epochs}, **{mean:.3f}** ({low:.3f}-{high:.3f}, {n} seeds){gap}")
            if any(cells):
                steps = defaults.min_steps if schedule == "rule" and defaults.min_steps else "-"
                lines.append(f"| {recipe} | {defaults.lr:g} | {steps} | " + " | ".join(cells) + " |")
        lines.append("")
    lines.append("Times are not compared: the runs shared the machine's two cores with other work at times.")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--recipes", default=",".join(RECIPES))
    parser.add_argument("--sizes", default="600,1200,5452", help="training rows (the first N of TREC-6's 5,452)")
    parser.add_argument("--epochs", type=int, default=None, help="fixed epochs instead of the recipes' schedule")
    parser.add_argument("--name", default="recipes_sizes")
    parser.add_argument("--report", action="store_true", help="only write NAME.md from NAME.json")
    args = parser.parse_args()
    path = RESULTS / f"{args.name}.json"
    if args.report:
        path.with_suffix(".md").write_text(markdown(json.loads(path.read_text())))
        return
    from minibert.hardware import cpu_description

    trec = fetch_trec()
    lines = (trec / "train.csv").read_text(encoding="utf-8").splitlines()
    sizes = [min(int(s), len(lines) - 1) for s in args.sizes.split(",")]
    results = json.loads(path.read_text()) if path.exists() else {"runs": []}
    results["machine"] = {"cpu": cpu_description(), "threads": torch.get_num_threads(), "torch": torch.__version__}
    schedule = "rule" if args.epochs is None else f"fixed {args.epochs}"
    done = {(r["recipe"], r["seed"], r["size"], r["schedule"]) for r in results["runs"]}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for size in sizes:
            train = work / f"train-{size}.csv"
            train.write_text("\n".join(lines[: size + 1]) + "\n", encoding="utf-8")
            for recipe in args.recipes.split(","):
                print(f"{recipe} at {size} rows: {recipe_epochs(RECIPES[recipe], size, BATCH)[1]}", file=sys.stderr)
                for seed in (int(s) for s in args.seeds.split(",")):
                    if (recipe, seed, size, schedule) in done:
                        continue
                    results["runs"].append(run_one(recipe, seed, size, args.epochs, train, trec / "test.csv", work))
                    path.write_text(json.dumps(results, indent=2) + "\n")  # each run kept as it finishes
    path.with_suffix(".md").write_text(markdown(results))
    print(path.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
