#!/usr/bin/env python3
"""Parameter-efficient fine-tuning: full fine-tuning, LoRA, Houlsby and Pfeiffer adapters and prefix-tuning
on all-MiniLM-L6-v2, side by side, and against peft's / AdapterHub's implementations of the same methods.

Parts (``--parts``, comma-separated; each adds to benchmarks/results/<name>.json and rewrites the .md):

  runs     TREC-6 (accuracy) and WNUT-16 (entity F1) with each method and seed, through ``minibert
           finetune``'s pipeline (each run in its own process: its peak memory is its own): the best epoch's
           metric, trainable parameters (count and share), seconds per epoch and per step, peak memory, the
           size of what the run writes
  speed    one training step (forward, backward, AdamW; 16 TREC questions) of each method, ours against peft's
           LoRA (this environment) and AdapterHub's Houlsby, Pfeiffer and prefix (its own environment,
           tools/adapter_references.py builds it; ours runs there too, alternating in one process). peft's
           prefix-tuning does not run on BertForSequenceClassification with transformers 5.x ("Model does not
           support past key values"); on BertModel it does, and tests/training/test_adapters.py compares with it there
  refquality  the reference implementations trained as ours are (TREC-6, seed 0): accuracy next to ours
  memory   one base + 5 task modules with their heads in memory, against 5 whole fine-tuned models (RSS of a
           fresh process each, and the parameter bytes)
  report   the .md from the .json

    python data/fetch_data.py && python benchmarks/bench_peft.py --parts runs,speed,refquality,memory

Methods and their settings: full (lr 5e-5), lora (r 8, alpha 16, query + value; lr 1e-3), houlsby and
pfeiffer (bottleneck 64; lr 1e-3), prefix (P = 16, MLP 512; lr 5e-3); batch 16, max length 64, warmup 10 %,
AdamW. Speeds are this CPU's: the report names it.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "data"))

MODEL = ROOT / "weights" / "all-MiniLM-L6-v2"
RESULTS = ROOT / "benchmarks" / "results"
METHODS = {  # name: (finetune's recipe and options, learning rate)
    "full": ({"recipe": "full"}, 5e-5),
    "lora": ({"recipe": "lora", "lora_rank": 8, "lora_targets": ("query", "value")}, 1e-3),
    "houlsby": ({"recipe": "adapter", "adapter_kind": "houlsby", "adapter_size": 64}, 1e-3),
    "pfeiffer": ({"recipe": "adapter", "adapter_kind": "pfeiffer", "adapter_size": 64}, 1e-3),
    "prefix": ({"recipe": "prefix", "prefix_length": 16}, 5e-3),
}
ADD = {  # the same modules through training.adapters.add_adapter (speed, memory, parameter counts)
    "lora": {"kind": "lora", "r": 8, "alpha": 16.0, "targets": ("query", "value")},
    "houlsby": {"kind": "houlsby", "bottleneck": 64},
    "pfeiffer": {"kind": "pfeiffer", "bottleneck": 64},
    "prefix": {"kind": "prefix", "prefix_length": 16, "prefix_bottleneck": 512},
}


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def slice_file(src: Path, dst: Path, n: int | None, tagged: bool) -> Path:
    """The first n examples of a training file (bench_finetune's slicing); all of it for None."""
    from bench_finetune import slice_file as first_examples

    return src if n is None else first_examples(src, dst, n, tagged)


def dataset_files(args, workdir: Path) -> dict:
    from fetch_data import fetch_trec, fetch_wnut16

    trec, wnut = fetch_trec(), fetch_wnut16()
    return {"trec": (slice_file(trec / "train.csv", workdir / "trec-train.csv", args.trec_slice, False), trec / "test.csv"),
            "wnut16": (slice_file(wnut / "train.txt", workdir / "wnut-train.txt", args.wnut_slice, True), wnut / "test.txt")}


# ----------------------------------------------------------------------------------------------- runs
def one_run(dataset: str, method: str, seed: int, train: Path, test: Path, epochs: int, workdir: Path,
            lr: float | None = None) -> dict:
    from minibert.logs import lines_to
    from minibert.runs.finetune import finetune
    from minibert.runs.settings import FinetuneRun

    options, default_lr = METHODS[method]
    lr = lr or default_lr
    before = peak_mib()
    out = workdir / f"{dataset}-{method}-{seed}-lr{lr:g}"
    run = FinetuneRun(train=train, eval=test, model=MODEL, out=out, task="tag" if dataset == "wnut16" else "classify",
                      epochs=epochs, lr=lr, seed=seed, progress=False, batch_size=16, max_length=64, **options,
                      overwrite=True)
    with lines_to(sys.stderr, prefix=f"  {dataset} {method} {seed}: "):
        history = finetune(run)
    metrics = json.loads((out / "metrics.json").read_text())
    steps = sum(1 for _ in open(train, encoding="utf-8")) if dataset == "trec" else None
    written = written_bytes(out)
    return {"dataset": dataset, "method": method, "seed": seed, "lr": lr, "epochs": epochs,
            "best_metric": metrics["best_metric"], "best_epoch": metrics["best_epoch"],
            "seconds_per_epoch": statistics.mean(e["seconds"] for e in history.epochs),
            "train_loss": [e.get("train_loss") for e in history.epochs],
            "examples": steps - 1 if steps else None, "peak_memory_mib": peak_mib(),
            "peak_memory_growth_mib": peak_mib() - before, "written_bytes": written}


MODEL_FILES = ("adapter.safetensors", "adapter.json", "model.safetensors", "config.json")


def written_bytes(folder: Path) -> int:
    """The model a run wrote: the task module and head, or the whole checkpoint (not the tokenizer's files)."""
    return sum((folder / name).stat().st_size for name in MODEL_FILES if (folder / name).exists())


def trainable(dataset: str, method: str) -> tuple[int, int]:
    from minibert import BertForSequenceClassification, BertForTokenClassification
    from minibert.training.adapters import add_adapter, trainable_parameters

    cls = BertForTokenClassification if dataset == "wnut16" else BertForSequenceClassification
    model = cls.from_encoder(MODEL, labels=21 if dataset == "wnut16" else 6)
    if method != "full":
        add_adapter(model, "t", **ADD[method])
    return trainable_parameters(model)


def part_runs(args, results):
    workdir = RESULTS / "peft-runs.tmp"
    workdir.mkdir(parents=True, exist_ok=True)
    files = dataset_files(args, workdir)
    done = {(r["dataset"], r["method"], r["seed"], r["lr"]) for r in results.get("runs", [])}
    lrs = dict(item.split("=") for item in args.lr)
    for dataset in args.datasets.split(","):
        for seed in range(args.seeds):
            for method in args.methods.split(","):
                lr = float(lrs.get(method, METHODS[method][1]))
                if (dataset, method, seed, lr) in done:
                    continue
                print(f"{dataset} {method} seed {seed} lr {lr:g} ...", flush=True)
                out = subprocess.run([sys.executable, __file__, "--one", dataset, method, str(seed), *map(str, files[dataset]),
                                      str(args.epochs), str(workdir), str(lr)], stdout=subprocess.PIPE, text=True, check=True)
                row = json.loads(out.stdout.strip().splitlines()[-1])
                row["trainable"], row["parameters"] = trainable(dataset, method)
                results.setdefault("runs", []).append(row)
                results["settings"] = {"epochs": args.epochs, "trec_slice": args.trec_slice, "wnut_slice": args.wnut_slice,
                                       "batch": 16, "max_length": 64}
                save(args, results)


# ---------------------------------------------------------------------------------------------- speed
def trec_batch(n: int = 16):
    from minibert import BertTokenizer

    tokenizer = BertTokenizer.from_pretrained(MODEL)
    texts = [line.rsplit(",", 1)[0] for line in (ROOT / "data" / "trec" / "train.csv").read_text().splitlines()[1:n + 1]]
    batch = dict(tokenizer(texts, padding=True, truncation=True, max_length=64, return_tensors="pt"))
    batch["labels"] = torch.arange(n) % 6
    return batch


def ours(method: str, head_dir: Path):
    from minibert import BertForSequenceClassification
    from minibert.training.adapters import add_adapter

    model = BertForSequenceClassification.from_encoder(head_dir, labels=6, seed=0)
    if method != "full":
        add_adapter(model, "t", **ADD[method])
    return model.train()


def timed_pairs(models: dict, batch: dict, rounds: int) -> dict:
    """Median ms of a training step for each model, alternating in one process."""
    from minibert.tools import timing

    optimisers = {name: torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-5) for name, m in models.items()}

    def step(name):
        loss = models[name](**batch).loss
        loss.backward()
        optimisers[name].step()
        optimisers[name].zero_grad()
    times = timing.alternate({name: (lambda name=name: step(name)) for name in models}, rounds, warmup=1)
    return {name: 1000 * statistics.median(t) for name, t in times.items()} | {"_times": times}


def ratios(times: dict, pairs: list[tuple[str, str]]) -> dict:
    return {f"{a} / {b}": statistics.median(x / y for x, y in zip(times[a], times[b])) for a, b in pairs}


def part_speed(args, results):
    import peft
    import transformers

    batch = trec_batch()
    with tempfile.TemporaryDirectory() as tmp:
        head = Path(tmp) / "head"
        from minibert import BertForSequenceClassification

        BertForSequenceClassification.from_encoder(MODEL, labels=6, seed=0).save_pretrained(head)
        models = {f"minibert {m}": ours(m, head) for m in METHODS}
        hf = lambda: transformers.BertForSequenceClassification.from_pretrained(head).train()  # noqa: E731
        models["peft lora"] = peft.get_peft_model(hf(), peft.LoraConfig(task_type="SEQ_CLS", r=8, lora_alpha=16,
                                                                      target_modules=["query", "value"]))
        models["transformers full"] = hf()
        times = timed_pairs(models, batch, args.rounds)
        raw = times.pop("_times")
        speed = {"ms": times, "ratios": ratios(raw, [("minibert lora", "peft lora"), ("minibert full", "transformers full")]),
                 "versions": {"peft": peft.__version__, "transformers": transformers.__version__}}
        python = Path(os.environ.get("ADAPTER_REFERENCES_PYTHON", ROOT / ".cache" / "adapter-references-env" / "bin" / "python"))
        if not python.exists():
            sys.path.insert(0, str(ROOT / "tools"))
            import adapter_references

            python = adapter_references.build_environment()
        out = subprocess.run([str(python), __file__, "--adapterhub-speed", str(head), str(args.rounds)],
                             stdout=subprocess.PIPE, text=True, check=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
        speed["adapterhub"] = json.loads(out.stdout.strip().splitlines()[-1])
    results["speed"] = speed


def adapterhub_speed(head: Path, rounds: int) -> dict:
    """(Runs in AdapterHub's environment.) Our Houlsby, Pfeiffer and prefix against theirs, alternating."""
    import adapters
    import transformers
    from adapters import DoubleSeqBnConfig, PrefixTuningConfig, SeqBnConfig

    batch = trec_batch()
    models = {f"minibert {m}": ours(m, head) for m in ("houlsby", "pfeiffer", "prefix")}
    for name, config in (("houlsby", DoubleSeqBnConfig(reduction_factor=384 / 64)),
                         ("pfeiffer", SeqBnConfig(reduction_factor=384 / 64)),
                         ("prefix", PrefixTuningConfig(prefix_length=16, bottleneck_size=512))):
        model = transformers.BertForSequenceClassification.from_pretrained(head)
        adapters.init(model)
        model.add_adapter(name, config=config)
        model.train_adapter(name)
        for p in model.classifier.parameters():
            p.requires_grad_(True)
        models[f"adapters {name}"] = model.train()
    times = timed_pairs(models, batch, rounds)
    raw = times.pop("_times")
    return {"ms": times, "ratios": ratios(raw, [(f"minibert {m}", f"adapters {m}") for m in ("houlsby", "pfeiffer", "prefix")]),
            "versions": {"adapters": adapters.__version__, "transformers": transformers.__version__, "torch": torch.__version__}}


# ----------------------------------------------------------------------------------- reference quality
def part_refquality(args, results):
    """peft's LoRA and prefix here, AdapterHub's Houlsby / Pfeiffer / prefix in their environment: each
    trained on the same TREC-6 batches, schedule and epochs as ours (seed 0), test accuracy."""
    import peft
    import transformers

    workdir = RESULTS / "peft-runs.tmp"
    workdir.mkdir(parents=True, exist_ok=True)
    train, test = dataset_files(args, workdir)["trec"]
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        head = Path(tmp) / "head"
        from minibert import BertForSequenceClassification

        BertForSequenceClassification.from_encoder(MODEL, labels=sorted({l.rsplit(",", 1)[1] for l in train.read_text().splitlines()[1:]}),
                                                   seed=0).save_pretrained(head)
        hf = lambda: transformers.BertForSequenceClassification.from_pretrained(head)  # noqa: E731
        for name, config in (("lora", peft.LoraConfig(task_type="SEQ_CLS", r=8, lora_alpha=16, target_modules=["query", "value"])),):
            print(f"peft {name} ...", flush=True)
            rows[f"peft {name}"] = train_reference(peft.get_peft_model(hf(), config), train, test, METHODS[name][1], args.epochs)
        python = Path(os.environ.get("ADAPTER_REFERENCES_PYTHON", ROOT / ".cache" / "adapter-references-env" / "bin" / "python"))
        for name in ("houlsby", "pfeiffer", "prefix"):
            print(f"adapters {name} ...", flush=True)
            out = subprocess.run([str(python), __file__, "--adapterhub-train", name, str(head), str(train), str(test),
                                  str(args.epochs)], stdout=subprocess.PIPE, text=True, check=True,
                                 env=dict(os.environ, PYTHONPATH=str(ROOT)))
            rows[f"adapters {name}"] = json.loads(out.stdout.strip().splitlines()[-1])
    results["refquality"] = rows


def train_reference(model, train: Path, test: Path, lr: float, epochs: int, task: str = "classify") -> dict:
    """A transformers-convention model trained with our batches, schedule and optimiser: test accuracy
    (classify), and the mean training loss of each epoch (both tasks)."""
    import time

    from minibert import BertTokenizer
    from minibert.training import metrics
    from minibert.runs.skeleton import read_task_data

    torch.manual_seed(0)
    tokenizer = BertTokenizer.from_pretrained(MODEL)
    data = read_task_data(task, train, test)
    names = sorted(set(data.labels("train")), key=str)
    label2id = {n: i for i, n in enumerate(names)}
    batches = data.batches(tokenizer, label2id, batch_size=16, max_length=64, seed=0)  # batches(epoch), as fit's
    per_epoch = len(list(batches(0)))
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr)
    total = epochs * per_epoch
    warmup = int(0.1 * total)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: (s + 1) / max(1, warmup) if s < warmup
                                                 else max(0.0, (total - s) / max(1, total - warmup)))
    best, start, losses = 0.0, time.perf_counter(), []
    for epoch in range(epochs):
        model.train()
        total_loss, steps = 0.0, 0
        for batch in batches(epoch):
            batch = {k: v for k, v in batch.items() if k in ("input_ids", "attention_mask", "token_type_ids", "labels")}
            loss = model(**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad()
            total_loss, steps = total_loss + loss.item(), steps + 1
        losses.append(total_loss / steps)
        if task != "classify":
            continue
        model.eval()
        held = data.held
        predicted = []
        with torch.no_grad():
            for i in range(0, len(held.texts), 64):
                enc = dict(tokenizer(held.texts[i:i + 64], padding=True, truncation=True, max_length=64, return_tensors="pt"))
                predicted += [names[j] for j in model(**enc).logits.argmax(-1).tolist()]
        best = max(best, metrics.accuracy(predicted, [str(y) for y in held.labels]))
    trained = sum(p.numel() for p in params)
    return {"accuracy": best if task == "classify" else None, "train_loss": losses, "trainable": trained,
            "seconds": time.perf_counter() - start, "epochs": epochs, "lr": lr, "task": task}


def adapterhub_train(name: str, head: Path, train: Path, test: Path, epochs: int, task: str = "classify") -> dict:
    import adapters
    import transformers
    from adapters import DoubleSeqBnConfig, PrefixTuningConfig, SeqBnConfig

    cls = transformers.BertForSequenceClassification if task == "classify" else transformers.BertForTokenClassification
    model = cls.from_pretrained(head)
    adapters.init(model)
    config = {"houlsby": DoubleSeqBnConfig(reduction_factor=384 / 64), "pfeiffer": SeqBnConfig(reduction_factor=384 / 64),
              "prefix": PrefixTuningConfig(prefix_length=16, bottleneck_size=512)}[name]
    model.add_adapter(name, config=config)
    model.train_adapter(name)
    for p in model.classifier.parameters():
        p.requires_grad_(True)
    return train_reference(model, train, test, METHODS[name][1], epochs, task)


def part_reftagging(args, results):
    """AdapterHub's Houlsby adapter trained on the WNUT-16 slice as ours was (seed 0, same batches, schedule and
    epochs): its training loss per epoch beside our run's, to tell the method from our implementation when
    the entity F1 stays at 0."""
    from minibert import BertForTokenClassification
    from minibert.runs.skeleton import read_task_data

    workdir = RESULTS / "peft-runs.tmp"
    workdir.mkdir(parents=True, exist_ok=True)
    train, test = dataset_files(args, workdir)["wnut16"]
    names = sorted(set(read_task_data("tag", train, test).labels("train")), key=str)
    with tempfile.TemporaryDirectory() as tmp:
        head = Path(tmp) / "head"
        BertForTokenClassification.from_encoder(MODEL, labels=names, seed=0).save_pretrained(head)
        python = Path(os.environ.get("ADAPTER_REFERENCES_PYTHON", ROOT / ".cache" / "adapter-references-env" / "bin" / "python"))
        out = subprocess.run([str(python), __file__, "--adapterhub-train", "houlsby", str(head), str(train), str(test),
                              str(args.epochs), "tag"], stdout=subprocess.PIPE, text=True, check=True,
                             env=dict(os.environ, PYTHONPATH=str(ROOT)))
    results["reftagging"] = {"adapters houlsby": json.loads(out.stdout.strip().splitlines()[-1])}


# --------------------------------------------------------------------------------------------- memory
def rss_mib() -> float:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def private(model):
    """Weights in the process's own memory, as distinct fine-tuned models have them (not pages shared with
    the checkpoint file they were read from)."""
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.clone()
    return model


def memory_child(mode: str) -> dict:
    import gc

    from minibert import BertForSequenceClassification, BertModel
    from minibert.training.adapters import add_adapter, save_adapter, task_head

    with tempfile.TemporaryDirectory() as tmp:
        folders = []
        if mode == "shared":
            for i, method in enumerate(("houlsby", "pfeiffer", "prefix", "lora", "houlsby")):
                head = BertForSequenceClassification.from_encoder(MODEL, labels=6, seed=i)
                add_adapter(head, f"task{i}", **ADD[method])
                folders.append(save_adapter(head, f"task{i}", Path(tmp) / f"task{i}"))
                del head
        gc.collect()
        before = rss_mib()
        if mode == "whole":
            models = [private(BertForSequenceClassification.from_encoder(MODEL, labels=6, seed=i)) for i in range(5)]
        else:
            base = private(BertModel.from_pretrained(MODEL))
            models = [task_head(base, f) for f in folders]
        gc.collect()
        unique = {id(p): p for m in models for p in m.parameters()}
        params = sum(p.numel() * p.element_size() for p in unique.values())
        return {"mode": mode, "rss_growth_mib": rss_mib() - before, "parameter_mib": params / 2**20}


def part_memory(args, results):
    rows = {}
    for mode in ("whole", "shared"):
        out = subprocess.run([sys.executable, __file__, "--memory-child", mode], stdout=subprocess.PIPE, text=True, check=True)
        rows[mode] = json.loads(out.stdout.strip().splitlines()[-1])
    results["memory"] = rows


# --------------------------------------------------------------------------------------------- report
def markdown(results: dict) -> str:
    from collections import defaultdict

    machine = results.get("machine", {})
    out = ["# Parameter-efficient fine-tuning", "",
           f"CPU: {machine.get('cpu')}; {machine.get('threads')} threads; torch {machine.get('torch')}; flags: "
           f"{', '.join(machine.get('flags', []))}", ""]
    settings = results.get("settings", {})
    if results.get("runs"):
        out += [f"all-MiniLM-L6-v2, {settings.get('epochs')} epochs, batch 16, max length 64, AdamW with 10 % warmup; "
                f"TREC-6 training questions: {settings.get('trec_slice') or 'all 5,452'}, WNUT-16 training tweets: "
                f"{settings.get('wnut_slice') or 'all'}; metric of the best epoch on the test set, mean +- standard "
                "deviation over seeds (each seed's value in brackets).", "",
                "| data | method | lr | metric | seeds | trainable (share) | s / epoch | peak memory | model written |",
                "|---|---|---|---|---|---|---|---|---|"]
        groups = defaultdict(list)
        for row in sorted(results["runs"], key=lambda r: (r["dataset"], list(METHODS).index(r["method"]), r["lr"])):
            groups[(row["dataset"], row["method"], row["lr"])].append(row)
        for (dataset, method, _), rows in groups.items():
            values = [r["best_metric"] for r in rows]
            spread = statistics.stdev(values) if len(values) > 1 else 0.0
            r = rows[0]
            name = "accuracy" if dataset == "trec" else "entity F1"
            out.append(f"| {dataset} | {method} | {r['lr']:g} | {name} {statistics.mean(values):.4f} +- {spread:.4f} "
                       f"({', '.join(f'{v:.3f}' for v in values)}) | {len(values)} | {r['trainable']:,} "
                       f"({100 * r['trainable'] / r['parameters']:.2f} %) | "
                       f"{statistics.mean(x['seconds_per_epoch'] for x in rows):.0f} | "
                       f"{max(x['peak_memory_mib'] for x in rows):.0f} MiB | {r['written_bytes'] / 2**20:.2f} MiB |")
        out.append("")
    if results.get("runs"):
        out += read_runs(results)
    if results.get("speed"):
        s = results["speed"]
        out += ["## One training step against the reference implementations", "",
                "16 TREC-6 questions, forward + backward + AdamW, alternating in one process (median of paired ratios "
                "< 1: ours faster). AdapterHub runs in its own environment "
                f"(adapters {s['adapterhub']['versions']['adapters']}, transformers "
                f"{s['adapterhub']['versions']['transformers']}); peft {s['versions']['peft']} with transformers "
                f"{s['versions']['transformers']}.", "", "| pair | ms (ours, theirs) | ratio ours / theirs |", "|---|---|---|"]
        for table in (s, s["adapterhub"]):
            for pair, ratio in table["ratios"].items():
                a, b = pair.split(" / ")
                out.append(f"| {pair} | {table['ms'][a]:.0f}, {table['ms'][b]:.0f} | **{ratio:.2f}** |")
        out.append("")
    if results.get("refquality"):
        out += ["## The reference implementations trained the same way (TREC-6, seed 0)", "",
                "| implementation | accuracy | trainable | lr |", "|---|---|---|---|"]
        for name, row in results["refquality"].items():
            out.append(f"| {name} | {row['accuracy']:.4f} | {row['trainable']:,} | {row['lr']:g} |")
        out.append("")
    if results.get("reftagging"):
        row = results["reftagging"]["adapters houlsby"]
        ours = [r for r in results.get("runs", []) if r["dataset"] == "wnut16" and r["method"] == "houlsby"
                and r["seed"] == 0 and r["lr"] == METHODS["houlsby"][1]]
        out += ["## AdapterHub's Houlsby adapter on the WNUT-16 slice (seed 0, trained as ours)", "",
                f"Mean training loss per epoch: AdapterHub {', '.join(f'{x:.3f}' for x in row['train_loss'])}"
                + (f"; ours {', '.join(f'{x:.3f}' for x in ours[0]['train_loss'])}" if ours and ours[0].get("train_loss")
                   else "") + " (predicting \"O\" everywhere costs about 0.36 here).", ""]
    if results.get("memory"):
        m = results["memory"]
        out += ["## One base, five tasks", "",
                "Five TREC-6 classifiers in one process: five whole fine-tuned models, against one all-MiniLM-L6-v2 "
                "base with five task modules (2 Houlsby, Pfeiffer, prefix, LoRA) and their heads (`task_head`, the base "
                "shared); resident memory of a fresh process before and after loading them.", "",
                "| | parameters in memory | resident memory growth |", "|---|---|---|",
                f"| 5 whole models | {m['whole']['parameter_mib']:.0f} MiB | {m['whole']['rss_growth_mib']:.0f} MiB |",
                f"| 1 base + 5 task modules | {m['shared']['parameter_mib']:.0f} MiB | {m['shared']['rss_growth_mib']:.0f} MiB |", ""]
    return "\n".join(out)


def read_runs(results: dict) -> list[str]:
    """What the runs table says, in words computed from it: each method's distance from full fine-tuning
    against the seeds' spread, and the published shape beside it."""
    from collections import defaultdict

    groups = defaultdict(list)
    for row in results["runs"]:
        groups[(row["dataset"], row["method"], row["lr"])].append(row)
    out = ["## Read", ""]
    for dataset in sorted({d for d, _, _ in groups}):
        full = groups.get((dataset, "full", METHODS["full"][1]))
        if not full:
            continue
        base = statistics.mean(r["best_metric"] for r in full)
        parts = []
        for (d, method, lr), rows in sorted(groups.items(), key=lambda kv: (list(METHODS).index(kv[0][1]), kv[0][2])):
            if d != dataset or method == "full":
                continue
            values = [r["best_metric"] for r in rows]
            spread = max(statistics.stdev(values) if len(values) > 1 else 0.0,
                         statistics.stdev([r["best_metric"] for r in full]) if len(full) > 1 else 0.0)
            gap = 100 * (statistics.mean(values) - base)
            verdict = "within" if abs(gap) <= 100 * 2 * spread else "beyond"
            parts.append(f"{method} (lr {lr:g}) {gap:+.1f} points, {verdict} twice the seed spread of "
                         f"{100 * spread:.1f} points ({100 * rows[0]['trainable'] / rows[0]['parameters']:.2f} % trained)")
        name = "accuracy" if dataset == "trec" else "entity F1"
        out.append(f"- {dataset}: against full fine-tuning ({name} {base:.3f}): " + "; ".join(parts) + ".")
    out += ["", "Published shape: Houlsby et al. 2019 report adapters within 0.4 points of full fine-tuning on GLUE "
            "with 3.6 % of the parameters per task, trained to convergence on full datasets; Li and Liang 2021 and "
            "P-tuning v2 (Liu et al. 2022) find prefix-tuning slow to train on natural-language understanding with "
            "small models, closing the gap with prefixes in every layer (as here) and long training (far more than "
            "the 3 epochs here); LoRA (Hu et al. 2021) matches full fine-tuning on GLUE with query and value adapted. "
            "He et al. 2022 put the three in one frame (a change added to the hidden states at some place, with some "
            "function). These runs are short (3 epochs on slices), so they measure how fast each method learns on a "
            "small budget more than where it ends.", ""]
    return out


def save(args, results):
    from minibert.hardware import cpu_info

    name, flags = cpu_info()
    results["machine"] = {"cpu": name, "threads": torch.get_num_threads(), "torch": torch.__version__,
                          "flags": sorted(f for f in flags if f.startswith(("avx512", "amx", "avx2")))}
    path = RESULTS / f"{args.name}.json"
    path.write_text(json.dumps(results, indent=2) + "\n")
    path.with_suffix(".md").write_text(markdown(results))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", default="runs,speed,refquality,memory")
    parser.add_argument("--datasets", default="trec,wnut16")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--trec-slice", type=int, default=None, help="the first N TREC-6 training questions")
    parser.add_argument("--wnut-slice", type=int, default=None, help="the first N WNUT-16 training tweets")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--name", default="peft")
    parser.add_argument("--lr", action="append", default=[], metavar="METHOD=LR",
                        help="another learning rate for a method (its runs are kept beside the default's)")
    parser.add_argument("--one", nargs=8, help=argparse.SUPPRESS)
    parser.add_argument("--adapterhub-speed", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--adapterhub-train", nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("--memory-child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        dataset, method, seed, train, test, epochs, workdir, lr = args.one
        print(json.dumps(one_run(dataset, method, int(seed), Path(train), Path(test), int(epochs), Path(workdir),
                                 float(lr))))
        return
    if args.adapterhub_speed:
        print(json.dumps(adapterhub_speed(Path(args.adapterhub_speed[0]), int(args.adapterhub_speed[1]))))
        return
    if args.adapterhub_train:
        name, head, train, test, epochs, *task = args.adapterhub_train
        print(json.dumps(adapterhub_train(name, Path(head), Path(train), Path(test), int(epochs), *task)))
        return
    if args.memory_child:
        print(json.dumps(memory_child(args.memory_child)))
        return
    path = RESULTS / f"{args.name}.json"
    results = json.loads(path.read_text()) if path.exists() else {}
    for part in args.parts.split(","):
        print(f"part {part}", flush=True)
        {"runs": part_runs, "speed": part_speed, "refquality": part_refquality, "reftagging": part_reftagging,
         "memory": part_memory,
         "report": lambda *a: None}[part](args, results)
        save(args, results)
    print(markdown(results))


if __name__ == "__main__":
    main()
