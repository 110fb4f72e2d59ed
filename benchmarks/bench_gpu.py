#!/usr/bin/env python3
"""The fast path on a GPU against transformers (issue 47): one prepared, time-boxed command.

    python benchmarks/bench_gpu.py --prepare gpu_kit      # here, on the CPU: one folder (< 60 MB) holding
                                                          # everything the GPU run reads
    python benchmarks/bench_gpu.py --from gpu_kit --name gpu_h200   # on a lent GPU machine (no internet):
                                                          # at most --budget s (default 330)
    python benchmarks/bench_gpu.py --from gpu_kit --dry   # on a CPU, a tiny model, a few rounds: checks the
                                                          # script end to end (the test suite runs it)

A lent GPU machine has no internet and receives at most 64 MiB beside the repository, so ``--prepare``
writes the one folder it needs: all-MiniLM-L6-v2 in fp16 with its tokenizer and sentence-transformers
files (both sides of the embed step read these same weights), the texts, and BERT-base's config (its
random weights are made there, from a seed); ``manifest.json`` lists every file with its size and sha256.
The run reads only that folder and the installed packages: it says in one line what it lacks (that step
skipped, never the hub), writes its JSON and page after every step (a time-out keeps what was done),
gives the pytest step its own timeout inside ``--budget``, and ends with a one-screen summary.

Steps (``--steps``, all by default), each skipped once the time box is spent (the page says which):

* ``test``: ``tests/tools/test_fast_cuda.py`` (the GPU route against the readable path and transformers).
* ``batches``: five batches -- 1 x 16; 32 x 128 dense; 128 x 128 about half real tokens; 16 x 512 dense;
  256 x 256 at 35 % real tokens -- in bf16, fp16 and fp32, BERT-base geometry (random weights that
  transformers builds and saves): transformers' ``BertModel`` (sdpa); minibert's readable model; the fast
  path keeping only the last hidden state (what transformers returns by default); the fast path keeping
  all of them (minibert's default); on batches without padding the fast path as CUDA graphs
  (``cuda_graphs=True``); fp32 also with ``tf32=True``. Median over ``--rounds`` alternating
  calls (the GPU synchronised after each) of each call's time / transformers' time in the same round.
* ``memory``: peak GPU memory of one call on the 256 x 256 batch in bf16, each implementation.
* ``embed``: sentence embeddings with all-MiniLM-L6-v2 of every line of ``data/sentences`` and whatever
  else ``--texts`` names (batch 128): sentence-transformers' ``encode`` against ``SentenceEncoder.encode``
  (tokenisation overlapped with the GPU), fp32 and fp16; texts per second and the largest difference.
* ``report``: the kernel routes chosen (``fast.routes``), and a results page ``benchmarks/results/NAME.md``
  (+ .json) naming the GPU, its driver, torch, CUDA, transformers and sentence-transformers versions, each
  figure beside the issue's goal. ``--dry`` writes to ``--out`` (default: a temporary folder) instead.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from minibert import BertModel  # noqa: E402
from minibert.textfiles import file_sha256  # noqa: E402
from minibert.tools import fast  # noqa: E402
from minibert.tools import timing as harness  # noqa: E402

MINILM = ROOT / "weights" / "all-MiniLM-L6-v2"  # --prepare's source; the run reads the kit's copy
RESULTS = ROOT / "benchmarks" / "results"
KIT_LIMIT = 60 * 2**20  # what a lent machine receives is 64 MiB: the kit stays under 60 MB
KIT_TEXTS = 20_000  # lines of data/sentences carried (the embed step's corpus)
ST_FILES = ("modules.json", "sentence_bert_config.json", "config_sentence_transformers.json", "1_Pooling/config.json")
TOKENIZER_FILES = ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
BASE = dict(vocab_size=30522, hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072)
STEPS = ("test", "batches", "memory", "embed", "report")
#: (B, T, real-token fraction), and the issue's goal for bf16 fast / transformers (None: none set)
BATCHES = [((1, 16, 1.0), 0.5), ((32, 128, 1.0), 0.7), ((128, 128, 0.5), 0.5), ((16, 512, 1.0), 0.75),
           ((256, 256, 0.35), 0.35)]
DRY_BATCHES = [((1, 16, 1.0), 0.5), ((4, 32, 1.0), 0.7), ((8, 32, 0.5), 0.5), ((2, 64, 1.0), 0.75),
               ((8, 64, 0.35), 0.35)]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
TINY = dict(vocab_size=2000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)


def _bench_model():
    spec = importlib.util.spec_from_file_location("bench_model", ROOT / "benchmarks" / "bench_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Clock:
    """The time box: ``spent()`` once ``budget`` seconds have passed since the start."""

    def __init__(self, budget: float):
        self.start, self.budget = time.perf_counter(), budget

    def spent(self) -> bool:
        return time.perf_counter() - self.start > self.budget

    def elapsed(self) -> float:
        return time.perf_counter() - self.start


def model_dir(work: Path, dry: bool, kit: Path | None = None) -> Path:
    """BERT-base geometry (``--dry``: a tiny one) with random weights, built and saved by transformers (its
    config from the kit where there is one: nothing else of it needs carrying)."""
    from conftest import hf_config, random_hf_model

    directory = work / ("tiny-random" if dry else "bert-base-random")
    if not (directory / "model.safetensors").exists():
        geometry = TINY if dry else BASE
        if kit is not None and not dry and (kit / "bert-base" / "config.json").is_file():
            saved = json.loads((kit / "bert-base" / "config.json").read_text(encoding="utf-8"))
            geometry = {k: saved[k] for k in BASE}
        random_hf_model(hf_config(**geometry), seed=0).save_pretrained(directory)
    return directory


def prepare_kit(folder: Path) -> dict:
    """Everything the GPU run reads, into ``folder`` (refused if it holds anything else): MiniLM in fp16 with
    its tokenizer and sentence-transformers files, ``texts.txt``, BERT-base's config, ``manifest.json``."""
    from safetensors.torch import load_file, save_file

    from conftest import hf_config

    if folder.exists() and any(folder.iterdir()) and not (folder / "manifest.json").is_file():
        raise SystemExit(f"--prepare {folder}: the folder holds files this script did not write; name an empty one")
    if not (MINILM / "model.safetensors").is_file():
        raise SystemExit(f"--prepare: {MINILM} is missing: python weights/fetch_minilm.py")
    minilm = folder / "minilm"
    (minilm / "1_Pooling").mkdir(parents=True, exist_ok=True)
    weights = {k: v.to(torch.float16) if v.is_floating_point() else v
               for k, v in load_file(str(MINILM / "model.safetensors")).items()}
    save_file(weights, str(minilm / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((MINILM / "config.json").read_text(encoding="utf-8"))
    (minilm / "config.json").write_text(json.dumps(config, indent=1) + "\n")  # loaded in the dtype each step asks
    for name in (*TOKENIZER_FILES, *ST_FILES):
        if (MINILM / name).is_file():
            shutil.copyfile(MINILM / name, minilm / name)
    texts = read_texts(sorted((ROOT / "data" / "sentences").glob("*.txt")), KIT_TEXTS)
    (folder / "texts.txt").write_text("\n".join(texts) + "\n", encoding="utf-8")
    (folder / "bert-base").mkdir(exist_ok=True)
    hf_config(**BASE).to_json_file(str(folder / "bert-base" / "config.json"))
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != "manifest.json")
    manifest = {"files": {str(p.relative_to(folder)): {"bytes": p.stat().st_size, "sha256": file_sha256(p)} for p in files},
                "texts": len(texts)}
    manifest["bytes"] = sum(f["bytes"] for f in manifest["files"].values())
    if manifest["bytes"] > KIT_LIMIT:
        raise SystemExit(f"--prepare: the kit is {manifest['bytes'] / 2**20:.1f} MiB, over {KIT_LIMIT / 2**20:.0f} MiB")
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
    return manifest


def check_kit(kit: Path | None, steps: list[str]) -> dict[str, str]:
    """What the run lacks, step by step (step -> one line), before it starts: the kit's files against its
    manifest (missing or changed), and the packages each step imports."""
    import importlib.util as util

    lacking = {}
    if kit is None:
        lacking["embed"] = "no --from kit: the embed step reads all-MiniLM-L6-v2 and the texts from one"
    else:
        manifest = json.loads((kit / "manifest.json").read_text()) if (kit / "manifest.json").is_file() else None
        if manifest is None:
            return {step: f"{kit}/manifest.json is missing (make the kit with --prepare)" for step in steps}
        for name, entry in manifest["files"].items():
            path = kit / name
            if not path.is_file() or path.stat().st_size != entry["bytes"]:
                step = "batches" if name.startswith("bert-base") else "embed"
                lacking.setdefault(step, f"{kit / name} is missing or changed")
    if util.find_spec("sentence_transformers") is None:
        lacking.setdefault("embed", "sentence-transformers is not installed")
    if util.find_spec("pytest") is None:
        lacking.setdefault("test", "pytest is not installed")
    return {step: why for step, why in lacking.items() if step in steps}


def synced(fn, device):
    if device.type != "cuda":
        return fn

    def run():
        fn()
        torch.cuda.synchronize()
    return run


def measure_batches(directory: Path, device, rounds: int, dry: bool, clock: Clock) -> list[dict]:
    """One row per batch and dtype: each implementation's median time ratio to transformers'."""
    import transformers

    make_batch = _bench_model().make_batch
    rows = []
    for short, dtype in DTYPES.items():
        if dry and dtype != torch.float32 and device.type == "cpu":
            continue  # half precision on a CPU says nothing about a GPU; the dry run checks the fp32 path
        if clock.spent():
            break
        theirs = transformers.BertModel.from_pretrained(directory, attn_implementation="sdpa", dtype=dtype).to(device).eval()
        ours = BertModel.from_pretrained(directory, dtype=dtype, device=device).eval()
        quick = fast.prepare(ours)
        tf32 = fast.prepare(ours, tf32=True)
        graphs = fast.prepare(ours, cuda_graphs=True) if device.type == "cuda" else None
        routes = fast.routes(ours)
        for (B, T, fraction), goal in (DRY_BATCHES if dry else BATCHES):
            if clock.spent():
                break
            batch = {k: v.to(device) for k, v in make_batch(B, T, fraction, theirs.config.vocab_size).items()}
            fns = {"transformers": lambda: theirs(**batch),
                   "readable": lambda: ours(**batch),
                   "fast": lambda: quick(**batch, output_hidden_states=False),
                   "fast, all states": lambda: quick(**batch)}
            if dtype == torch.float32 and device.type == "cuda":
                fns["fast, tf32"] = lambda: tf32(**batch, output_hidden_states=False)
            if graphs is not None and fraction == 1.0:  # no padding: a CUDA graph per shape
                fns["fast, cuda graphs"] = lambda: graphs(**batch, output_hidden_states=False)
            with torch.inference_mode():
                times = harness.alternate({k: synced(f, device) for k, f in fns.items()}, rounds, warmup=3, rotate=True)
            row = {"dtype": short, "B": B, "T": T, "real": round(float(batch["attention_mask"].float().mean()), 3),
                   "transformers_ms": round(1e3 * statistics.median(times["transformers"]), 3),
                   "ratio": {k: round(harness.paired_ratio(times, k, "transformers"), 3) for k in fns if k != "transformers"},
                   "goal": goal if short == "bf16" else None, "attention": routes["attention"]}
            rows.append(row)
            print(f"{short} {B} x {T} ({row['real']:.0%} real): " + ", ".join(f"{k} {v:.2f}" for k, v in row["ratio"].items())
                  + f"  (transformers {row['transformers_ms']} ms)", flush=True)
        theirs = ours = quick = tf32 = graphs = None  # freed before the next dtype's copies
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def measure_memory(directory: Path, device, dry: bool) -> dict | None:
    """Peak GPU memory (MiB above what the model holds) of one call on the last batch, bf16."""
    if device.type != "cuda":
        return None
    import transformers

    (B, T, fraction), _ = (DRY_BATCHES if dry else BATCHES)[-1]
    make_batch = _bench_model().make_batch
    theirs = transformers.BertModel.from_pretrained(directory, attn_implementation="sdpa", dtype=torch.bfloat16).to(device).eval()
    ours = BertModel.from_pretrained(directory, dtype=torch.bfloat16, device=device).eval()
    quick = fast.prepare(ours)
    batch = {k: v.to(device) for k, v in make_batch(B, T, fraction, theirs.config.vocab_size).items()}
    fns = {"transformers": lambda: theirs(**batch), "readable": lambda: ours(**batch),
           "fast": lambda: quick(**batch, output_hidden_states=False), "fast, all states": lambda: quick(**batch)}
    peaks = {}
    for name, fn in fns.items():
        with torch.inference_mode():
            fn()  # warm: workspaces and packed copies exist before measuring
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            fn()
            torch.cuda.synchronize()
        peaks[name] = round((torch.cuda.max_memory_allocated() - before) / 2**20, 1)
    print("peak memory (MiB): " + ", ".join(f"{k} {v}" for k, v in peaks.items()), flush=True)
    return {"batch": f"{B} x {T} at {fraction:.0%}", "peak_mib": peaks}


def read_texts(files: list[Path], limit: int | None) -> list[str]:
    texts = []
    for f in files:
        if f.is_file():
            texts += [t for t in f.read_text(encoding="utf-8").split("\n") if t.strip()]
    return texts[:limit] if limit else texts


def measure_embed(device, texts: list[str], rounds: int, minilm: Path = MINILM) -> list[dict]:
    """sentence-transformers' encode against ours, texts per second, fp32 and fp16 (fp32 only on a CPU)."""
    try:
        from sentence_transformers import SentenceTransformer
    except ImportError:
        print("embed: sentence-transformers is not installed; skipped", flush=True)
        return []
    from minibert.compat.sentence import SentenceEncoder

    if not texts:
        print("embed: no texts (fetch data/sentences: python data/fetch_data.py sentences, or pass --texts); skipped",
              flush=True)
        return []
    rows = []
    for short in ("fp32", "fp16") if device.type == "cuda" else ("fp32",):
        dtype = DTYPES[short]
        theirs = SentenceTransformer(str(minilm), device=str(device), local_files_only=True,
                                     model_kwargs={"dtype": torch.float32})
        if dtype == torch.float16:
            theirs = theirs.half()
        ours = SentenceEncoder.from_pretrained(minilm, dtype=dtype, device=device)
        fns = {"sentence-transformers": lambda: theirs.encode(texts, batch_size=128, convert_to_numpy=True),
               "minibert": lambda: ours.encode(texts, batch_size=128)}
        for fn in fns.values():
            fn()  # warm-up: kernels chosen, caches built
        times = harness.alternate({k: synced(f, device) for k, f in fns.items()}, rounds, warmup=0, rotate=True)
        a, b = theirs.encode(texts[:512], batch_size=128), ours.encode(texts[:512], batch_size=128)
        best = {k: min(v) for k, v in times.items()}
        row = {"dtype": short, "texts": len(texts), "seconds": {k: round(v, 3) for k, v in best.items()},
               "speedup": round(best["sentence-transformers"] / best["minibert"], 3),
               "max_difference": float(abs(a - b).max())}
        rows.append(row)
        print(f"embed {short}: {len(texts)} texts, sentence-transformers {best['sentence-transformers']:.2f} s, "
              f"minibert {best['minibert']:.2f} s ({row['speedup']:.2f}x), max difference {row['max_difference']:.2e}",
              flush=True)
    return rows


def machine(device) -> dict:
    import transformers

    about = {"torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version()}
    try:
        import sentence_transformers

        about["sentence-transformers"] = sentence_transformers.__version__
    except ImportError:
        pass
    if device.type == "cuda":
        about["gpu"] = torch.cuda.get_device_name(device)
        about["cuda"] = torch.version.cuda
        try:
            about["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                             capture_output=True, text=True, timeout=30).stdout.strip().split("\n")[0]
        except (OSError, subprocess.SubprocessError):
            about["driver"] = "unknown"
    else:
        from minibert.hardware import cpu_description

        about["cpu"] = cpu_description()
        about["threads"] = torch.get_num_threads()
    return about


def page(result: dict) -> str:
    """The results page (markdown)."""
    about = result["machine"]
    where = (f"{about['gpu']} (driver {about.get('driver')}, CUDA {about.get('cuda')})" if "gpu" in about
             else f"{about['cpu']}, {about['threads']} threads -- a dry run: a tiny model on a CPU, no GPU figure")
    lines = ["# The fast path on a GPU against transformers", "",
             f"Measured on {where}; torch {about['torch']}, transformers {about['transformers']}"
             + (f", sentence-transformers {about['sentence-transformers']}" if "sentence-transformers" in about else "")
             + f", Python {about['python']}. Command: `{result['command']}` ({result['seconds']:.0f} s"
             + (f"; stopped by the time box before: {', '.join(result['skipped'])}" if result["skipped"] else "") + ")."
             + "".join(f" Skipped {step}: {why}." for step, why in result.get("lacking", {}).items()), ""]
    if result.get("test") is not None:
        lines += [f"`tests/tools/test_fast_cuda.py`: {result['test']}", ""]
    if result["batches"]:
        names = list(result["batches"][0]["ratio"])
        names = sorted({k for r in result["batches"] for k in r["ratio"]}, key=lambda k: (k not in names, names.index(k) if k in names else 0))
        lines += ["Time / transformers' `BertModel` (sdpa) in the same rounds (median of paired ratios); goal: the "
                  "issue's for bf16 fast; attention: the route the fast path chose.", "",
                  "| dtype | batch | real tokens | transformers ms | " + " | ".join(names) + " | goal | attention |",
                  "|---|---|---|---|" + "---|" * len(names) + "---|---|"]
        for r in result["batches"]:
            goal = "" if r["goal"] is None else (f"<= {r['goal']} " + ("met" if r["ratio"]["fast"] <= r["goal"] else "**not met**"))
            lines.append(f"| {r['dtype']} | {r['B']} x {r['T']} | {r['real']:.0%} | {r['transformers_ms']} | "
                         + " | ".join(f"{r['ratio'][k]:.2f}" if k in r["ratio"] else "" for k in names)
                         + f" | {goal} | {r['attention']} |")
        lines.append("")
    if result.get("memory"):
        m = result["memory"]
        theirs = m["peak_mib"]["transformers"]
        lines += [f"Peak GPU memory of one call, {m['batch']}, bf16 (MiB above the weights; goal: fast <= transformers "
                  f"-- {'met' if m['peak_mib']['fast'] <= theirs else '**not met**'}): "
                  + ", ".join(f"{k} {v}" for k, v in m["peak_mib"].items()), ""]
    if result["embed"]:
        lines += ["Sentence embeddings, all-MiniLM-L6-v2, batch 128 (best of the rounds; goal: >= 2x):", "",
                  "| dtype | texts | sentence-transformers s | minibert s | speed-up | largest difference |", "|---|---|---|---|---|---|"]
        for r in result["embed"]:
            s = r["seconds"]
            lines.append(f"| {r['dtype']} | {r['texts']} | {s['sentence-transformers']} | {s['minibert']} | "
                         f"{r['speedup']:.2f}x{'' if r['speedup'] >= 2 else ' (goal not met)'} | {r['max_difference']:.1e} |")
        lines.append("")
    if result.get("routes"):
        lines += ["Kernel routes the fast path took (`fast.routes`): " + "; ".join(
            f"{k}: " + ", ".join(f"{n} {v}" for n, v in r.items()) for k, r in result["routes"].items()), ""]
    return "\n".join(lines).rstrip() + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prepare", type=Path, help="write the folder the GPU run reads (here, on the CPU), then stop")
    p.add_argument("--from", dest="kit", type=Path, help="the folder --prepare wrote: all the run reads")
    p.add_argument("--steps", default=",".join(STEPS), help=f"comma-separated, of {', '.join(STEPS)} (default all)")
    p.add_argument("--dry", action="store_true", help="a CPU, a tiny model, 2 rounds: the script checked end to end")
    p.add_argument("--name", default="gpu", help="results file name (benchmarks/results/NAME.md)")
    p.add_argument("--out", help="folder for the page and JSON (default: benchmarks/results; --dry: a temporary one)")
    p.add_argument("--budget", type=float, default=330, help="seconds the measurements may take (default 330)")
    p.add_argument("--rounds", type=int, help="alternating rounds per batch (default 20; --dry 2)")
    p.add_argument("--texts", nargs="*", default=[], help="more text files for the embed step (one text a line)")
    args = p.parse_args(argv)
    if args.prepare is not None:
        manifest = prepare_kit(args.prepare)
        print(f"wrote {args.prepare}: {len(manifest['files'])} files, {manifest['bytes'] / 2**20:.1f} MiB "
              f"({manifest['texts']} texts); carry it to the GPU machine and run --from {args.prepare}")
        return 0
    steps = [s for s in args.steps.split(",") if s]
    unknown = sorted(set(steps) - set(STEPS))
    if unknown:
        p.error(f"--steps: unknown {unknown}; use {', '.join(STEPS)}")
    if not args.dry and not torch.cuda.is_available():
        p.error("no CUDA device here: this bench measures a GPU (--dry checks the script on a CPU)")
    device = torch.device("cpu" if args.dry else "cuda")
    rounds = args.rounds or (2 if args.dry else 20)
    clock = Clock(args.budget)
    out = Path(args.out) if args.out else (Path(tempfile.mkdtemp(prefix="bench_gpu_")) if args.dry else RESULTS)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench_gpu_work_"))
    command = "python benchmarks/bench_gpu.py " + " ".join(argv if argv is not None else sys.argv[1:])
    result = {"command": command.strip(), "machine": machine(device), "batches": [], "memory": None, "embed": [],
              "routes": {}, "test": None, "skipped": [], "lacking": check_kit(args.kit, steps)}
    for step, why in result["lacking"].items():
        print(f"{step}: skipped -- {why}", flush=True)
    name = args.name + ("_dry" if args.dry else "")
    steps = [s for s in steps if s not in result["lacking"]]
    kit_texts = [args.kit / "texts.txt"] if args.kit is not None else []
    directory = model_dir(work, args.dry, args.kit)
    runs = {"test": lambda: run_tests(clock),
            "batches": lambda: measure_batches(directory, device, rounds, args.dry, clock),
            "memory": lambda: measure_memory(directory, device, args.dry),
            "embed": lambda: measure_embed(device, read_texts(kit_texts + [Path(t) for t in args.texts],
                                                              64 if args.dry else None),
                                           1 if args.dry else 2, args.kit / "minilm"),
            "report": lambda: {short: fast.routes(BertModel.from_pretrained(directory, dtype=dtype, device=device).eval())
                               for short, dtype in DTYPES.items() if device.type == "cuda" or dtype == torch.float32}}
    keys = {"report": "routes"}
    for step in STEPS:
        if step not in steps or (step == "test" and args.dry):
            continue
        if clock.spent():
            result["skipped"].append(step)
            continue
        result[keys.get(step, step)] = runs[step]()
        write_results(out, name, result, clock)  # after every step: a time-out keeps what was done
    write_results(out, name, result, clock)
    print(summary(result))
    print(f"wrote {out / (name + '.md')} and .json ({result['seconds']:.0f} s)")
    return 0


def run_tests(clock: Clock) -> str:
    """tests/tools/test_fast_cuda.py in its own process, with at most a quarter of the budget left."""
    limit = max(30.0, (clock.budget - clock.elapsed()) / 4)
    try:
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/tools/test_fast_cuda.py"],
                           cwd=ROOT, capture_output=True, text=True, timeout=limit)
        line = (r.stdout.strip().splitlines() or ["no output"])[-1]
    except subprocess.TimeoutExpired:
        line = f"stopped after {limit:.0f} s (its share of --budget)"
    print("test:", line, flush=True)
    return line


def write_results(out: Path, name: str, result: dict, clock: Clock) -> None:
    result["seconds"] = clock.elapsed()
    (out / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    (out / f"{name}.md").write_text(page(result), encoding="utf-8")


def summary(result: dict) -> str:
    """One screen: each step's outcome, each batch's fast / transformers ratio per dtype."""
    lines = ["", "step      outcome"]
    lines.append(f"test      {result['test'] or 'not run'}")
    for row in result["batches"]:
        ratios = ", ".join(f"{k} {v:.2f}" for k, v in row["ratio"].items())
        lines.append(f"batch     {row['dtype']} {row['B']} x {row['T']} ({row['real']:.0%} real): {ratios}")
    if result["memory"]:
        lines.append(f"memory    {result['memory']['peak_mib']}")
    for row in result["embed"]:
        lines.append(f"embed     {row['dtype']}: {row['speedup']:.2f}x sentence-transformers, max diff {row['max_difference']:.1e}")
    for step, why in {**result["lacking"], **dict.fromkeys(result["skipped"], "time box spent")}.items():
        lines.append(f"{step:<9} skipped: {why}")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
