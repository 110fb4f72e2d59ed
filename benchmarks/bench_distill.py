#!/usr/bin/env python3
"""Fewer layers on purpose: distillation, LayerDrop and early exit on all-MiniLM-L6-v2, on this CPU.

Parts (``--parts``, all by default), each writing its numbers into benchmarks/results/distill.json and a
table into distill.md; finished runs are kept in ``--workdir`` (default benchmarks/results/distill-runs.tmp,
git-ignored) and reused, so a part can be rerun alone:

* ``embeddings``: MiniLM (6 blocks) -> 3 blocks by sentence-embedding distillation: blocks 0, 2, 4 (3 epochs)
  on 22,703 unlabelled sentences (data/sentences, from the VADER archive), and on those plus 60,457
  public-domain ones (data/corpus: State of the Union addresses and Moby-Dick, ``fetch_data.py --corpus``)
  in batches grouped by length, both with the student's dropout on; then what the probes below found --
  blocks 0, 2, 5, dropout off -- on those plus 267,171 more (data/more: Tatoeba, WikiText-2, tweets,
  ``fetch_data.py --more``), 2 epochs; and, as text like the held-out sentences beat more text, the 22,703
  plus 150,000 new texts made from them (``distill.augment_texts``: crops, pairs, word dropout), 2 epochs;
  last, the 22,703 plus 200,000 made texts for 3 epochs with the faster step (teacher vectors cached,
  embeddings frozen, the student in bf16 -- fast on CPUs with avx512_bf16 or AMX, slow without).
  Agreement with the teacher on 1,000 held-out sentences (Spearman of the
  pairwise cosines, top-10 neighbour overlap) before and after; speed-up of the student's embeddings
  (fast path, batch 32, median of alternating rounds). ``--runs 'NAME;...'`` (names split at ';', as they hold commas) (re)trains only those runs;
  the others keep their numbers from distill.json.
* ``probes``: one epoch each on the 22,703 sentences, one change at a time (``PROBES``: which blocks,
  dropout, learning rate, batch size, hidden-state / attention / cosine-matrix terms).
* ``steps``: one training step of the embedding distillation four ways, timed side by side: the teacher
  run on each batch (fp32), its vectors cached, + the embeddings frozen, + bf16.
* ``task``: a MiniLM classifier fine-tuned on TREC-6 (the teacher) -> 3 blocks by task distillation (soft
  targets T = 2, alpha = 0.5); against the same 3 blocks fine-tuned without a teacher; speed-up of the
  classifier on the 500 test questions.
* ``layerdrop``: TREC-6 fine-tuning with LayerDrop p = 0.2, then pruned to k = 1..6 blocks ("every
  other", ``spread_blocks``), against the teacher (trained without LayerDrop) pruned the same way.
* ``exits``: early exits on the frozen teacher; accuracy / average blocks / wall time over entropy
  thresholds and patience.

    python data/fetch_data.py --corpus --more && python benchmarks/bench_distill.py    # ~7 hours on 2 cores
    python benchmarks/bench_distill.py --quick                              # slices, ~6 minutes (smoke run)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "data"))

from fetch_data import fetch_corpus, fetch_more, fetch_sentences, fetch_trec  # noqa: E402

from minibert.logs import lines_to  # noqa: E402
from minibert import BertForSequenceClassification, BertModel, BertTokenizer  # noqa: E402
from minibert.hardware import cpu_info  # noqa: E402
from minibert.loading import copy_tokenizer  # noqa: E402
from minibert.tools import fast, surgery  # noqa: E402
from minibert.tools.encode import encode_texts  # noqa: E402
from minibert.training import depth, distill  # noqa: E402
from minibert.runs import distill as distill_pipeline, exits, finetune as tasks  # noqa: E402
from minibert.training.datasets import read_table  # noqa: E402

from minibert.tools import timing as harness  # noqa: E402  (the one timing loop)
from minibert.training.settings import EmbeddingDistillConfig  # noqa: E402
from minibert.runs.settings import DistillRun, ExitsRun, FinetuneRun  # noqa: E402

MODEL = ROOT / "weights" / "all-MiniLM-L6-v2"
PARTS = ("embeddings", "probes", "steps", "task", "layerdrop", "exits")
MAX_LENGTH, BATCH = 64, 16  # TREC fine-tuning, as benchmarks/bench_finetune.py


def lines(path: Path, n: int | None = None) -> list[str]:
    out = [t for t in path.read_text(encoding="utf-8").split("\n") if t.strip()]
    return out[:n] if n else out


def alternate(fns: dict, rounds: int) -> dict:
    """Median seconds of each function, called in alternation ``rounds`` times (after one warm-up each)."""
    return harness.medians(harness.alternate(fns, rounds, warmup=1))


def teacher_dir(args, trec: Path) -> Path:
    """The TREC-6 teacher: MiniLM fine-tuned (full recipe, 3 epochs), made once and reused."""
    out = args.workdir / "trec-teacher"
    if not (out / "model.safetensors").exists():
        tasks.finetune(FinetuneRun(train=args.train, eval=trec / "test.csv", model=MODEL, out=out, epochs=args.epochs,
                                   progress=False, batch_size=BATCH, max_length=MAX_LENGTH, overwrite=True))
    return out


def best_accuracy(directory: Path) -> tuple[float, int]:
    history = json.loads((directory / "metrics.json").read_text())
    return history["best_metric"], history["best_epoch"]


def run_dir(args, kind: str, name: str) -> Path:
    """Where a named run keeps its student and metrics.json: ``<workdir>/<kind>-<name, one dash per sign>``."""
    return args.workdir / (kind + "-" + "".join(c if c.isalnum() else "-" for c in name))


def embedding_setup(args):
    """The VADER training and held-out sentences (slices with --quick), the teacher and its tokenizer."""
    sentences = fetch_sentences()
    texts = lines(sentences / "train.txt", 2000 if args.quick else None)
    held = lines(sentences / "held.txt", 200 if args.quick else None)
    return texts, held, BertModel.from_pretrained(MODEL, mlm_head=False).eval(), BertTokenizer.from_pretrained(MODEL)


# ------------------------------------------------------------------------------------------------ parts
def part_embeddings(args, results):
    texts, held, teacher, tokenizer = embedding_setup(args)
    reference = encode_texts(teacher, tokenizer, held, max_length=128)
    earlier = {run["name"]: run for run in results.get("embeddings", {}).get("runs", [])}
    out = {"train_texts": len(texts), "held_texts": len(held), "runs": []}
    for blocks in ([0, 2, 4], [1, 3, 5], [0, 2, 5]):
        student = distill.init_student(teacher, blocks)
        before = distill.embedding_agreement(reference, encode_texts(student, tokenizer, held, max_length=128))
        out.setdefault("before", {})[str(blocks)] = before
    trained = None
    for name, options in args.embedding_runs:
        options = dict(options)
        directory = run_dir(args, "embeddings", name)
        if not (directory / "metrics.json").exists() and name in earlier and args.runs is not None \
                and name not in args.runs:
            out["runs"].append(earlier[name])  # not asked for: its numbers from the last full run
            continue
        blocks = options.pop("blocks", [0, 2, 4])
        run_texts = texts + (lines(fetch_corpus() / "train.txt", 4000 if args.quick else None)
                             if options.pop("corpus", False) else [])
        run_texts += lines(fetch_more() / "train.txt", 4000 if args.quick else None) if options.pop("more", False) else []
        made = options.pop("augment", 0)  # new texts made from the VADER training sentences (never the held-out)
        run_texts += distill.augment_texts(texts, 4000 if args.quick and made else made, seed=0)
        epochs = options.pop("epochs", args.embedding_epochs)
        if args.quick:
            epochs = 1  # a smoke run
        bf16, frozen = options.pop("bf16", False), options.pop("freeze_embeddings", False)
        layer_map = options.pop("layer_map", None)
        if not (directory / "metrics.json").exists():
            student = distill.init_student(teacher, blocks).train()
            if frozen:  # the student keeps the teacher's embeddings as they are
                surgery.freeze(student, embeddings=True)
            distill.distill_embeddings(teacher, student, tokenizer, run_texts, eval_texts=held, out_dir=directory,
                                       config=EmbeddingDistillConfig(epochs=epochs, lr=options.pop("lr"), bf16=bf16,
                                                                     progress=False, batch_size=32, max_length=128,
                                                                     **options),
                                       layer_map=layer_map)
        history = json.loads((directory / "metrics.json").read_text())
        best = history["epochs"][history["best_epoch"] - 1]
        out["runs"].append({"name": name, "blocks": blocks, "train_texts": len(run_texts), "cpu": cpu_info()[0],
                            "precision": "bf16 autocast" if bf16 else "fp32", "frozen_embeddings": frozen,
                            "best_epoch": history["best_epoch"],
                            **best["eval"], "by_epoch": [e["eval"]["spearman"] for e in history["epochs"]],
                            "seconds_per_epoch": statistics.mean(e["seconds"] for e in history["epochs"])})
        trained = directory
    student = BertModel.from_pretrained(trained).eval()  # (speed only: any trained 3-block student)
    batch = tokenizer(held[:32], padding=True, truncation=True, return_tensors="pt")
    one = tokenizer(held[:1], return_tensors="pt")
    t_fast, s_fast = fast.prepare(teacher), fast.prepare(student)
    times = alternate({"teacher_corpus": lambda: encode_texts(teacher, tokenizer, held, max_length=128),
                       "student_corpus": lambda: encode_texts(student, tokenizer, held, max_length=128),
                       "teacher_32": lambda: t_fast(**batch), "student_32": lambda: s_fast(**batch),
                       "teacher_1": lambda: t_fast(**one), "student_1": lambda: s_fast(**one)}, args.rounds)
    out["speed"] = {**times, "speedup_corpus": times["teacher_corpus"] / times["student_corpus"],
                    "speedup_32": times["teacher_32"] / times["student_32"],
                    "speedup_1": times["teacher_1"] / times["student_1"]}
    results["embeddings"] = out


BIG_RUN = "top block kept, dropout off, + corpus + 267,171 more sentences, grouped by length"
AUGMENTED_RUN = "top block kept, dropout off, + 150,000 texts made from the 22,703, grouped by length"
LONG_RUN = ("top block kept, dropout off, + 200,000 texts made from the 22,703, grouped by length, 3 epochs, "
            "bf16 student, embeddings frozen, teacher vectors cached")
#: one epoch each on the 22,703 sentences, blocks 0, 2, 4 with dropout unless said: what moves the agreement
PROBES = [("blocks 0, 2, 4 (baseline)", {"student_dropout": None}),
          ("+ last hidden states (MSE, weight 0.01, map 3:6)", {"student_dropout": None, "hidden_weight": 0.01,
                                                                 "layer_map": {3: 6}}),
          ("+ last hidden states (MSE, weight 0.05, map 3:6)", {"student_dropout": None, "hidden_weight": 0.05,
                                                                 "layer_map": {3: 6}}),
          ("lr 1e-3", {"student_dropout": None, "lr": 1e-3}),
          ("+ in-batch cosine matrix (weight 0.05)", {"student_dropout": None, "similarity_weight": 0.05}),
          ("blocks 0, 2, 5", {"student_dropout": None, "blocks": [0, 2, 5]}),
          ("blocks 0, 3, 5", {"student_dropout": None, "blocks": [0, 3, 5]}),
          ("blocks 1, 3, 5", {"student_dropout": None, "blocks": [1, 3, 5]}),
          ("blocks 0, 1, 5", {"student_dropout": None, "blocks": [0, 1, 5]}),
          ("blocks 0, 2, 5, + last-block attention (KL, weight 0.1, map 3:6)",
           {"student_dropout": None, "blocks": [0, 2, 5], "attention_weight": 0.1, "layer_map": {3: 6}}),
          ("blocks 0, 2, 5, dropout off", {"blocks": [0, 2, 5]}),
          ("blocks 0, 2, 5, dropout off, lr 1e-3", {"blocks": [0, 2, 5], "lr": 1e-3}),
          ("blocks 0, 2, 5, dropout off, batches of 64, lr 7e-4", {"blocks": [0, 2, 5], "lr": 7e-4, "batch_size": 64}),
          ("blocks 0, 2, 5, dropout off, lr 3e-4", {"blocks": [0, 2, 5], "lr": 3e-4})]


def part_probes(args, results):
    """Each of PROBES: 1 epoch on the 22,703 sentences, agreement on the 1,000 held-out ones."""
    texts, held, teacher, tokenizer = embedding_setup(args)
    rows = []
    for name, options in PROBES:
        options = {"normalize": True, "lr": 5e-4, "student_dropout": 0.0, "batch_size": 32, **options}
        directory = run_dir(args, "probe", name)
        if not (directory / "metrics.json").exists():
            student = distill.init_student(teacher, options.pop("blocks", [0, 2, 4])).train()
            layer_map = options.pop("layer_map", None)
            distill.distill_embeddings(teacher, student, tokenizer, texts, eval_texts=held, out_dir=directory,
                                       config=EmbeddingDistillConfig(epochs=1, lr=options.pop("lr"), progress=False,
                                                                     max_length=128, **options),
                                       layer_map=layer_map)
        epoch = json.loads((directory / "metrics.json").read_text())["epochs"][0]
        rows.append({"name": name, **epoch["eval"], "seconds": epoch["seconds"]})
    results["probes"] = {"train_texts": len(texts), "held_texts": len(held), "rows": rows}


def part_steps(args, results):
    """One training step of the 6 -> 3 distillation (blocks 0, 2, 5, batches of 32 grouped by length, from
    the 22,703 sentences and as many texts made from them), four ways, timed side by side: the teacher run
    on each batch (fp32, as the first four runs), its vectors cached, + the embeddings frozen, + bf16."""
    texts, _, teacher, tokenizer = embedding_setup(args)
    texts = texts[:1600] + distill.augment_texts(texts[:1600], 1600, seed=0)
    targets = encode_texts(teacher, tokenizer, texts, max_length=128)
    batches = list(distill.text_batches(tokenizer, texts, batch_size=32, group_by_length=True, targets=targets)(0))
    batches = batches[:8 if args.quick else 24]
    student = distill.init_student(teacher, [0, 2, 5]).train()
    distiller = distill.EmbeddingDistiller(teacher, student, normalize=True)
    recipes = {"teacher on each batch, fp32": (False, False, False), "teacher vectors cached": (True, False, False),
               "cached + embeddings frozen": (True, True, False), "cached + frozen + bf16": (True, True, True)}

    def steps(cached, frozen, bf16):
        optimizer = torch.optim.AdamW(student.parameters(), lr=1e-6)  # frozen weights get no grad: skipped

        def run():
            surgery.freeze(student, embeddings=True) if frozen else surgery.unfreeze(student)
            for batch in batches:
                batch = batch if cached else {k: v for k, v in batch.items() if k != "teacher_vectors"}
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                    loss = distiller(**batch).loss
                loss.backward()
                torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        return run
    with surgery.dropout(student, 0.0):  # the student trains with dropout off, as in the runs
        times = alternate({name: steps(*flags) for name, flags in recipes.items()}, args.rounds)
    base = times["teacher on each batch, fp32"]
    results["steps"] = {"batches": len(batches), "mean_tokens": statistics.mean(b["input_ids"].shape[1] for b in batches),
                        "rows": [{"name": name, "ms_per_step": 1000 * t / len(batches), "speedup": base / t}
                                 for name, t in times.items()]}


def part_task(args, results):
    trec = fetch_trec()
    teacher = teacher_dir(args, trec)
    student_dir = args.workdir / "trec-distilled"
    if not (student_dir / "metrics.json").exists():
        distill_pipeline.distill_task(DistillRun(train=args.train, eval=trec / "test.csv", teacher=teacher,
                                                 out=student_dir, student_blocks=[0, 2, 4], temperature=2.0, alpha=0.5,
                                                 epochs=args.epochs, progress=False, batch_size=BATCH,
                                                 max_length=MAX_LENGTH, overwrite=True))
    baseline_dir = args.workdir / "trec-3blocks-no-teacher"
    if not (baseline_dir / "metrics.json").exists():
        shallow = args.workdir / "minilm-3blocks"
        distill.init_student(BertModel.from_pretrained(MODEL, mlm_head=False), [0, 2, 4]).save_pretrained(shallow)
        copy_tokenizer(MODEL, shallow)
        tasks.finetune(FinetuneRun(train=args.train, eval=trec / "test.csv", model=shallow, out=baseline_dir,
                                   epochs=args.epochs, progress=False, batch_size=BATCH, max_length=MAX_LENGTH,
                                   overwrite=True))
    t_acc, t_epoch = best_accuracy(teacher)
    s_acc, s_epoch = best_accuracy(student_dir)
    b_acc, b_epoch = best_accuracy(baseline_dir)
    test = read_table(trec / "test.csv")
    tokenizer = BertTokenizer.from_pretrained(teacher)
    t_model = BertForSequenceClassification.from_pretrained(teacher).eval()
    s_model = BertForSequenceClassification.from_pretrained(student_dir).eval()
    t_run, s_run = fast.prepare(t_model.bert), fast.prepare(s_model.bert)
    batches = [tokenizer(test.texts[i:i + 32], padding=True, truncation=True, max_length=MAX_LENGTH,
                         return_tensors="pt") for i in range(0, len(test.texts), 32)]

    def classify(model, run):
        with torch.inference_mode():
            for batch in batches:
                model.classifier(run(**batch).pooler_output)
    times = alternate({"teacher": lambda: classify(t_model, t_run), "student": lambda: classify(s_model, s_run)},
                      args.rounds)
    results["task"] = {"teacher_accuracy": t_acc, "teacher_epoch": t_epoch, "student_accuracy": s_acc,
                       "student_epoch": s_epoch, "share_of_teacher": s_acc / t_acc,
                       "no_teacher_accuracy": b_acc, "no_teacher_epoch": b_epoch,
                       "seconds_teacher": times["teacher"], "seconds_student": times["student"],
                       "speedup": times["teacher"] / times["student"], "test_questions": len(test.texts)}


def part_layerdrop(args, results):
    trec = fetch_trec()
    teacher = teacher_dir(args, trec)
    dropped = args.workdir / "trec-layerdrop"
    if not (dropped / "metrics.json").exists():
        tasks.finetune(FinetuneRun(train=args.train, eval=trec / "test.csv", model=MODEL, out=dropped, layerdrop=args.p,
                                   epochs=args.ld_epochs or args.epochs, progress=False, batch_size=BATCH,
                                   max_length=MAX_LENGTH, overwrite=True))
    test = read_table(trec / "test.csv")
    tokenizer = BertTokenizer.from_pretrained(teacher)
    table = []
    for name, directory in (("without LayerDrop", teacher), (f"LayerDrop p={args.p}", dropped)):
        model = BertForSequenceClassification.from_pretrained(directory)
        N = model.config.num_hidden_layers
        for k in range(N, 0, -1):
            for strategy, blocks in (("every other", depth.spread_blocks(N, k)), ("bottom k", list(range(k)))):
                if strategy == "bottom k" and k == N:
                    continue
                pruned = distill.init_student(model, blocks).eval()
                predicted = [p["label"] for p in pruned.predict(test.texts, tokenizer=tokenizer, max_length=MAX_LENGTH)]
                accuracy = sum(p == g for p, g in zip(predicted, test.labels)) / len(test.labels)
                table.append({"model": name, "blocks_kept": k, "strategy": strategy, "blocks": blocks,
                              "accuracy": accuracy})
    epochs = len(json.loads((dropped / "metrics.json").read_text())["epochs"])
    results["layerdrop"] = {"p": args.p, "epochs": epochs, "table": table, "trained_accuracy": {
        "without LayerDrop": best_accuracy(teacher)[0], f"LayerDrop p={args.p}": best_accuracy(dropped)[0]}}


def part_exits(args, results):
    trec = fetch_trec()
    teacher = teacher_dir(args, trec)
    out = {}
    for mode, joint in (("frozen", False),):
        directory = args.workdir / f"trec-exits-{mode}"
        if not (directory / "exits.json").exists():
            exits.train_exits(ExitsRun(model=teacher, train=args.train, eval=trec / "test.csv", out=directory,
                                       joint=joint, epochs=2, lr=1e-3, progress=False, batch_size=BATCH,
                                       max_length=MAX_LENGTH, overwrite=True))
        best = depth.EarlyExit.from_pretrained(directory)
        test = read_table(trec / "test.csv")
        tokenizer = BertTokenizer.from_pretrained(teacher)
        rows = depth.exit_curve(best, tokenizer, test.texts, test.labels, rounds=args.rounds, max_length=MAX_LENGTH)
        saved = json.loads((directory / "exits.json").read_text())
        out[mode] = {"exit_accuracy": saved["exit_accuracy"], "curve": rows}
    results["exits"] = out


# ---------------------------------------------------------------------------------------------- report
def markdown(results: dict) -> str:
    md = ["# Distillation and adaptive depth (all-MiniLM-L6-v2)", ""]
    machines = results.get("machines", {})
    for header in dict.fromkeys(machines.values()):  # each machine once, with the parts it ran
        md.append(f"* {', '.join(p for p in PARTS if machines.get(p) == header)}: {header}")
    md.append("")
    if "embeddings" in results:
        e = results["embeddings"]
        md += ["## Sentence-embedding distillation: 6 -> 3 blocks", "",
               f"Students: the teacher blocks named; trained on {e['train_texts']:,} unlabelled sentences (and, where "
               "said, the larger corpora too), agreement measured on "
               f"{e['held_texts']:,} held-out ones (Spearman of all pairwise cosine similarities; "
               "share of each sentence's 10 nearest neighbours both models agree on).", "",
               "| student | training texts | Spearman | by epoch | top-10 overlap | best epoch | s / epoch |",
               "|---|---|---|---|---|---|---|"]
        for blocks, before in e["before"].items():
            md.append(f"| blocks {blocks}, before training | - | {before['spearman']:.4f} | - | "
                      f"{before['top_k_overlap']:.3f} | - | - |")
        for run in e["runs"]:
            by_epoch = " / ".join(f"{v:.3f}" for v in run.get("by_epoch", [])) or "-"
            where = f" ({run['cpu']})" if run.get("cpu") else ""  # runs kept from an earlier machine say which
            blocks = ", ".join(map(str, run.get("blocks", [0, 2, 4])))
            md.append(f"| {blocks} distilled: {run['name']} | {run.get('train_texts', e['train_texts']):,} | "
                      f"**{run['spearman']:.4f}** | {by_epoch} | {run['top_k_overlap']:.3f} | "
                      f"{run['best_epoch']} | {run['seconds_per_epoch']:.0f}{where} |")
        s = e["speed"]
        md += ["", f"Speed-up of the 3-block student (fast path, median of alternating rounds): embedding the "
               f"{e['held_texts']} held-out sentences **{s['speedup_corpus']:.2f}x** ({s['teacher_corpus']:.2f} s -> "
               f"{s['student_corpus']:.2f} s), one batch of 32 {s['speedup_32']:.2f}x, one sentence "
               f"{s['speedup_1']:.2f}x.", ""]
    if "steps" in results:
        st = results["steps"]
        md += ["## One training step, four ways (side by side)", "",
               f"{st['batches']} batches of 32 grouped by length ({st['mean_tokens']:.1f} tokens on average), "
               "blocks 0, 2, 5, dropout off; forward, backward, clipping, AdamW.", "",
               "| step | ms | speed-up |", "|---|---|---|"]
        md += [f"| {r['name']} | {r['ms_per_step']:.0f} | {r['speedup']:.2f}x |" for r in st["rows"]]
        md.append("")
    if "probes" in results:
        pr = results["probes"]
        md += ["## What moves the agreement: one-epoch probes", "",
               f"One epoch each on the {pr['train_texts']:,} sentences (MSE of unit vectors, lr 5e-4, batches of 32, "
               f"the student's dropout 0.1, unless the row says otherwise); agreement on the {pr['held_texts']:,} "
               "held-out sentences." + (f" {pr['measured_by']}" if pr.get("measured_by") else ""), "",
               "| probe | Spearman | top-10 overlap | seconds |", "|---|---|---|---|"]
        md += [f"| {r['name']} | {r['spearman']:.4f} | {r['top_k_overlap']:.3f} | {r['seconds']:.0f} |"
               for r in pr["rows"]]
        md.append("")
    if "task" in results:
        t = results["task"]
        md += ["## Task distillation: TREC-6", "",
               "| model | blocks | TREC-6 test accuracy | share of the teacher's |", "|---|---|---|---|",
               f"| teacher (MiniLM fine-tuned, full recipe) | 6 | {t['teacher_accuracy']:.4f} | 100 % |",
               f"| student, distilled (T = 2, alpha = 0.5) | 3 | **{t['student_accuracy']:.4f}** | "
               f"**{t['share_of_teacher']:.1%}** |",
               f"| same 3 blocks fine-tuned without a teacher | 3 | {t['no_teacher_accuracy']:.4f} | "
               f"{t['no_teacher_accuracy'] / t['teacher_accuracy']:.1%} |", "",
               f"Classifying the {t['test_questions']} test questions (fast path, batches of 32): teacher "
               f"{t['seconds_teacher']:.2f} s, student {t['seconds_student']:.2f} s: **{t['speedup']:.2f}x**.", ""]
    if "layerdrop" in results:
        ld = results["layerdrop"]
        names = list(ld["trained_accuracy"])
        md += ["## LayerDrop: accuracy vs blocks kept (TREC-6 test)", "",
               f"Fine-tuned without LayerDrop (3 epochs) and with it (p = {ld['p']}, {ld.get('epochs', 3)} epochs), then "
               "pruned without further training; "
               "\"every other\" keeps evenly spread blocks including the top one (`depth.spread_blocks`); "
               "\"bottom k\" keeps blocks 0..k-1.", "",
               "| blocks kept | which | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
        keys = sorted({(r["blocks_kept"], r["strategy"], tuple(r["blocks"])) for r in ld["table"]},
                      key=lambda k: (-k[0], k[1]))
        for k, strategy, blocks in keys:
            cells = [next(f"{r['accuracy']:.4f}" for r in ld["table"] if r["model"] == n and r["blocks_kept"] == k
                          and r["strategy"] == strategy) for n in names]
            md.append(f"| {k} | {strategy} {list(blocks)} | " + " | ".join(cells) + " |")
        md.append("")
    if "exits" in results:
        for mode, x in results["exits"].items():
            md += [f"## Early exit on the TREC-6 teacher ({mode} model, exits trained 2 epochs at lr 1e-3)", "",
                   "Accuracy of each exit alone: " + ", ".join(f"block {i}: {a:.4f}" for i, a in
                                                                enumerate(x["exit_accuracy"])) + ".", "",
                   depth.curve_table(x["curve"]), ""]
    return "\n".join(md)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default=",".join(PARTS))
    parser.add_argument("--quick", action="store_true", help="slices of the data, one epoch: a smoke run")
    parser.add_argument("--workdir", type=Path)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--runs", help="embeddings part: only these runs (by name, ';' between names) are trained; the others "
                        "keep their numbers from distill.json")
    parser.add_argument("--ld-epochs", type=int, help="epochs of the LayerDrop run (default: as the teacher, 3)")
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    suffix = "_quick" if args.quick else ""
    args.workdir = args.workdir or ROOT / "benchmarks" / "results" / f"distill-runs{suffix}.tmp"
    args.workdir.mkdir(parents=True, exist_ok=True)
    args.epochs = 1 if args.quick else 3
    args.embedding_epochs = 1 if args.quick else 3
    args.p = 0.2
    # lr 5e-4 beat 2e-4 (0.778 vs 0.769 after 1 epoch on 3,000 sentences); an added cosine-matrix term
    # (similarity_weight 1: 0.655) or hidden-state term (hidden_weight 1: 0.538) did worse there
    # the first two ran with the student's own dropout (0.1), as distillation did before student_dropout
    args.embedding_runs = [("MSE on unit vectors, lr 5e-4", {"normalize": True, "lr": 5e-4, "student_dropout": None}),
                           ("same, + 60,457 corpus sentences, batches grouped by length",
                            {"normalize": True, "lr": 5e-4, "corpus": True, "group_by_length": True,
                             "student_dropout": None}),
                           # what the probes found: the top block kept, dropout off; and far more text
                           (BIG_RUN, {"blocks": [0, 2, 5], "normalize": True, "lr": 5e-4, "corpus": True, "more": True,
                                      "group_by_length": True, "student_dropout": 0.0,
                                      "epochs": 2}),  # 2 x 350,331 texts: ~1.5 hours on 2 cores
                           # text like the held-out sentences mattered more than more text: new texts made
                           # from the 22,703 (crops, pairs, word dropout: distill.augment_texts)
                           (AUGMENTED_RUN, {"blocks": [0, 2, 5], "normalize": True, "lr": 5e-4, "augment": 150_000,
                                            "group_by_length": True, "student_dropout": 0.0, "epochs": 2}),
                           # the same kind of text, 1.9x the passes (63 minutes here against the fourth's 81):
                           # the faster step (teacher cached, embeddings frozen, bf16: 3.0x, --parts steps)
                           # bought more made texts and a third epoch
                           (LONG_RUN, {"blocks": [0, 2, 5], "normalize": True, "lr": 5e-4, "augment": 200_000,
                                       "group_by_length": True, "student_dropout": 0.0, "epochs": 3, "bf16": True,
                                       "freeze_embeddings": True, "cache_teacher": True})]
    args.runs = None if args.runs is None else [r.strip() for r in args.runs.split(";") if r.strip()]
    unknown = sorted(set(args.runs or ()) - {name for name, _ in args.embedding_runs})
    if unknown:
        parser.error(f"--runs: {unknown} not among {[name for name, _ in args.embedding_runs]}")
    trec = fetch_trec()
    args.train = trec / "train.csv"
    if args.quick:
        args.train = args.workdir / "trec-train-slice.csv"
        all_rows = (trec / "train.csv").read_text(encoding="utf-8").splitlines()
        args.train.write_text("\n".join(all_rows[:601]) + "\n", encoding="utf-8")
        args.rounds = min(args.rounds, 2)
    json_path = ROOT / "benchmarks" / "results" / f"distill{suffix}.json"
    results = json.loads(json_path.read_text()) if json_path.exists() else {}
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    for part in parts:
        if part not in PARTS:
            parser.error(f"--parts: {part!r} is not one of {PARTS}")
    name, flags = cpu_info()
    shown = sorted(f for f in flags if f.startswith(("avx", "amx")))
    header = (f"torch {torch.__version__}, {torch.get_num_threads()} threads, {name} (CPU flags: "
              f"{', '.join(shown) or 'no AVX'}); fp32 unless a run or step says bf16.")
    for part in parts:
        started = time.perf_counter()
        globals()[f"part_{part}"](args, results)
        # merge into what is on disk now: another run may have written other parts meanwhile
        results = {**(json.loads(json_path.read_text()) if json_path.exists() else {}), part: results[part]}
        results.setdefault("seconds", {})[part] = time.perf_counter() - started
        results.setdefault("machines", {})[part] = header  # parts may run on different machines
        results.pop("header", None)
        json_path.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
        json_path.with_suffix(".md").write_text(markdown(results) + "\n", encoding="utf-8")
        print(f"{part}: done in {time.perf_counter() - started:.0f} s", flush=True)
    print(json_path.with_suffix(".md").read_text())


if __name__ == "__main__":
    with lines_to(sys.stdout):  # the runs' lines, as they go
        main()
