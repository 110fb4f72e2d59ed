#!/usr/bin/env python3
"""Fine-tuning benchmark: all-MiniLM-L6-v2 on TREC-6 and WNUT-16, per recipe, on this machine's CPU.

For each (dataset, recipe): the eval metric of the best epoch (TREC-6 test accuracy; WNUT-16 entity F1
on our fixed split), trainable parameters, seconds per epoch and peak memory growth. Then the training
step (forward + backward + AdamW step) of minibert's BertForSequenceClassification against transformers'
on the same batch and weights, alternating in one process (median time ratio, fp32), and the same for
bf16 autocast against fp32 (bf16 is only fast on CPUs with bf16 matrix instructions).

    python data/fetch_data.py && python benchmarks/bench_finetune.py            # ~1 hour on 2 cores
    python benchmarks/bench_finetune.py --quick                                  # slices, ~5 minutes

Writes benchmarks/results/finetune.md and finetune.json (--quick: finetune_quick.*, git-ignored).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "data"))

from fetch_data import fetch_trec, fetch_wnut16  # noqa: E402

from minibert.logs import lines_to  # noqa: E402
from minibert import BertForSequenceClassification, BertTokenizer  # noqa: E402
from minibert.hardware import cpu_info  # noqa: E402
from minibert.runs import finetune as tasks  # noqa: E402
from minibert.runs.settings import FinetuneRun  # noqa: E402

from minibert.tools import timing as harness  # noqa: E402  (the one timing loop)

MODEL = ROOT / "weights" / "all-MiniLM-L6-v2"
ARGS = None  # the parsed command line (the parent passes its options to each one-run child)


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def slice_file(src: Path, dst: Path, n: int, tagged: bool) -> Path:
    if tagged:
        blocks = [b for b in src.read_text(encoding="utf-8").split("\n\n") if b.strip()][:n]
        dst.write_text("\n\n".join(blocks) + "\n", encoding="utf-8")
    else:
        lines = src.read_text(encoding="utf-8").splitlines()
        dst.write_text("\n".join(lines[: n + 1]) + "\n", encoding="utf-8")
    return dst


def run_recipe(dataset: str, recipe: str, train: Path, test: Path, epochs: int, workdir: Path) -> dict:
    """One (dataset, recipe) run in a fresh process, so that its peak memory is its own."""
    import subprocess

    options = ["--lora-lr", str(ARGS.lora_lr), "--lora-rank", str(ARGS.lora_rank), "--lora-targets", ARGS.lora_targets]
    options += ["--bf16"] if ARGS.bf16 else []
    out = subprocess.run([sys.executable, __file__, *options, "--one", dataset, recipe, str(train), str(test),
                          str(epochs), str(workdir)], stdout=subprocess.PIPE, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def one_run(dataset: str, recipe: str, train: Path, test: Path, epochs: int, workdir: Path, args) -> dict:
    before = peak_mib()
    lr = args.lora_lr if recipe == "lora" else 1e-3 if recipe == "scalarmix" else 5e-5
    out = workdir / f"{dataset}-{recipe}"
    lora = {"lora_rank": args.lora_rank, "lora_targets": tuple(args.lora_targets.split(","))} if recipe == "lora" else {}
    run = FinetuneRun(train=train, eval=test, model=MODEL, out=out, task="tag" if dataset == "wnut16" else "classify",
                      recipe=recipe, epochs=epochs, lr=lr, progress=False, seed=0, bf16=args.bf16, batch_size=16,
                      max_length=64, overwrite=True, **lora)
    with lines_to(sys.stderr, prefix=f"  {dataset} {recipe}: "):
        history = tasks.finetune(run)
    metrics = json.loads((out / "metrics.json").read_text())
    trainable = _trainable(dataset, recipe, args)
    if recipe == "lora":
        recipe = f"lora (r {args.lora_rank}, {args.lora_targets.replace(',', '+')}, lr {lr:g})"
    if args.bf16:
        recipe += " bf16"
    return {"dataset": dataset, "recipe": recipe, "lr": lr, "epochs": epochs,
            "best_metric": metrics["best_metric"], "best_epoch": metrics["best_epoch"],
            "seconds_per_epoch": statistics.mean(e["seconds"] for e in history.epochs),
            "trainable_parameters": trainable, "peak_memory_mib": peak_mib(),
            "peak_memory_growth_mib": peak_mib() - before,
            "per_epoch": history.epochs}


def _trainable(dataset: str, recipe: str, args) -> int:
    from minibert import BertForTokenClassification
    from minibert.model import BertModel
    from minibert.training.lora import apply_lora
    from minibert.training.recipes import ScalarMixClassifier, gradual_unfreezing

    if recipe == "scalarmix":
        model = ScalarMixClassifier(BertModel.from_pretrained(MODEL), 6)
        return sum(p.numel() for p in model.parameters() if p.requires_grad)
    cls = BertForTokenClassification if dataset == "wnut16" else BertForSequenceClassification
    model = cls.from_encoder(MODEL, labels=21 if dataset == "wnut16" else 6)
    if recipe == "lora":
        apply_lora(model, r=args.lora_rank, alpha=2 * args.lora_rank, targets=tuple(args.lora_targets.split(",")))
    elif recipe == "gradual":  # what trains in the last epoch of a 3-epoch run: head, pooler, top 2 blocks
        gradual_unfreezing()(model, 2)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def step_ratio(rounds: int) -> dict:
    """Training step time: minibert / transformers (fp32), and minibert bf16 autocast / fp32."""
    import transformers

    tok = BertTokenizer.from_pretrained(MODEL)
    texts = [line.split(",")[0] for line in (ROOT / "data" / "trec" / "train.csv").read_text().splitlines()[1:17]]
    batch = dict(tok(texts, padding=True, truncation=True, max_length=64, return_tensors="pt"))
    batch["labels"] = torch.arange(16) % 6
    ours = BertForSequenceClassification.from_encoder(MODEL, labels=6, seed=0)
    ours.save_pretrained(ROOT / "benchmarks" / "results" / "tmp-step")
    theirs = transformers.BertForSequenceClassification.from_pretrained(ROOT / "benchmarks" / "results" / "tmp-step")
    runs = {"minibert": (ours, False), "transformers": (theirs, False), "minibert bf16": (ours, True)}
    optimisers = {name: torch.optim.AdamW(m.parameters(), lr=1e-5) for name, (m, _) in runs.items()}

    def step(name):
        model, bf16 = runs[name]
        model.train()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = model(**batch).loss
        loss.backward()
        optimisers[name].step()
        optimisers[name].zero_grad()
    times = harness.alternate({name: (lambda name=name: step(name)) for name in runs}, rounds, warmup=1)
    import shutil

    shutil.rmtree(ROOT / "benchmarks" / "results" / "tmp-step")
    ratio = statistics.median(a / b for a, b in zip(times["minibert"], times["transformers"]))
    bf16 = statistics.median(a / b for a, b in zip(times["minibert bf16"], times["minibert"]))
    return {"minibert_vs_transformers_fp32": ratio, "bf16_vs_fp32": bf16,
            "minibert_ms": 1000 * statistics.median(times["minibert"]),
            "transformers_ms": 1000 * statistics.median(times["transformers"])}


def markdown(report: dict) -> str:
    m = report["machine"]
    lines = ["# Fine-tuning benchmark (all-MiniLM-L6-v2)", "",
             f"torch {m['torch']}, {m['threads']} threads, {m['cpu']} (CPU flags: {', '.join(m['cpu_flags']) or 'unknown'}); "
             f"batch 16, max length 64, AdamW, warmup 10 %, seed 0.", "",
             "| data | recipe | epochs | metric (best epoch) | trainable parameters | s / epoch | peak memory (process) |",
             "|---|---|---|---|---|---|---|"]
    for r in report["runs"]:
        name = "TREC-6 test accuracy" if r["dataset"] == "trec" else "WNUT-16 entity F1"
        lines.append(f"| {r['dataset']} | {r['recipe']} | {r['epochs']} | {name} {r['best_metric']:.4f} (epoch "
                     f"{r['best_epoch']}) | {r['trainable_parameters']:,} | {r['seconds_per_epoch']:.0f} | "
                     f"{r['peak_memory_mib']:.0f} MiB |")
    s = report["step"]
    lines += ["", f"Training step (forward + backward + AdamW, 16 x <= 64 tokens, median of alternating rounds): "
              f"minibert {s['minibert_ms']:.0f} ms, transformers {s['transformers_ms']:.0f} ms, ratio "
              f"**{s['minibert_vs_transformers_fp32']:.2f}**; bf16 autocast / fp32: {s['bf16_vs_fp32']:.2f}."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="slices (400 questions, 300 tweets), 1 epoch")
    parser.add_argument("--recipes", default="full,gradual,llrd,lora")
    parser.add_argument("--datasets", default="trec,wnut16")
    parser.add_argument("--name", default=None, help="output name in benchmarks/results (default finetune)")
    parser.add_argument("--lora-lr", type=float, default=1e-3)
    parser.add_argument("--lora-rank", type=int, default=8)
    parser.add_argument("--lora-targets", default="query,value")
    parser.add_argument("--bf16", action="store_true", help="train with bf16 autocast")
    parser.add_argument("--train-slice", type=int, default=None, help="use the first N training examples")
    parser.add_argument("--epochs", type=int, default=None)
    parser.add_argument("--one", nargs=6, help=argparse.SUPPRESS)  # internal: one run, JSON on stdout
    args = parser.parse_args()
    global ARGS
    ARGS = args
    if args.one:
        dataset, recipe, train, test, epochs, workdir = args.one
        print(json.dumps(one_run(dataset, recipe, Path(train), Path(test), int(epochs), Path(workdir), args)))
        return
    trec, wnut = fetch_trec(), fetch_wnut16()
    workdir = ROOT / "benchmarks" / "results" / "finetune-runs.tmp"
    workdir.mkdir(parents=True, exist_ok=True)
    files = {"trec": (trec / "train.csv", trec / "test.csv"), "wnut16": (wnut / "train.txt", wnut / "test.txt")}
    epochs = args.epochs or (1 if args.quick else 3)
    if args.quick:
        files = {"trec": (slice_file(trec / "train.csv", workdir / "trec-train.csv", 400, False), trec / "test.csv"),
                 "wnut16": (slice_file(wnut / "train.txt", workdir / "wnut-train.txt", 300, True),
                            wnut / "test.txt")}
    if args.train_slice:
        files = {"trec": (slice_file(trec / "train.csv", workdir / "trec-slice.csv", args.train_slice, False),
                          trec / "test.csv"),
                 "wnut16": (slice_file(wnut / "train.txt", workdir / "wnut-slice.txt", args.train_slice, True),
                            wnut / "test.txt")}
    name, flags = cpu_info()
    report = {"machine": {"cpu": name, "cpu_flags": sorted(f for f in flags if f.startswith(("avx", "amx"))),
                          "threads": torch.get_num_threads(), "torch": torch.__version__}, "runs": []}
    for dataset in args.datasets.split(","):
        for recipe in args.recipes.split(","):
            print(f"{dataset} {recipe} ...", flush=True)
            report["runs"].append(run_recipe(dataset, recipe, *files[dataset], epochs, workdir))
    report["step"] = step_ratio(rounds=5 if args.quick or args.name else 20)
    out = ROOT / "benchmarks" / "results" / (args.name or ("finetune_quick" if args.quick else "finetune"))
    out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    out.with_suffix(".md").write_text(markdown(report), encoding="utf-8")
    print(markdown(report))


if __name__ == "__main__":
    main()
