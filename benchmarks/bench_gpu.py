#!/usr/bin/env python3
"""The fast path on a GPU against transformers (issue 47): one prepared, time-boxed command.

    python benchmarks/bench_gpu.py --name gpu_h200       # on a GPU machine: at most --budget s (default 330)
    python benchmarks/bench_gpu.py --dry                  # on a CPU, a tiny model, a few rounds: checks the
                                                          # script end to end (the test suite runs it)

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
from minibert.tools import fast  # noqa: E402
from minibert.tools import timing as harness  # noqa: E402

MINILM = ROOT / "weights" / "all-MiniLM-L6-v2"
RESULTS = ROOT / "benchmarks" / "results"
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


def model_dir(work: Path, dry: bool) -> Path:
    """BERT-base geometry (``--dry``: a tiny one) with random weights, built and saved by transformers."""
    from conftest import hf_config, random_hf_model

    directory = work / ("tiny-random" if dry else "bert-base-random")
    if not (directory / "model.safetensors").exists():
        random_hf_model(hf_config(**(TINY if dry else {})), seed=0).save_pretrained(directory)
    return directory


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


def measure_embed(device, texts: list[str], rounds: int) -> list[dict]:
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
        theirs = SentenceTransformer(str(MINILM), device=str(device))
        if dtype == torch.float16:
            theirs = theirs.half()
        ours = SentenceEncoder.from_pretrained(MINILM, dtype=dtype, device=device)
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
             + (f"; stopped by the time box before: {', '.join(result['skipped'])}" if result["skipped"] else "") + ").", ""]
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
    p.add_argument("--steps", default=",".join(STEPS), help=f"comma-separated, of {', '.join(STEPS)} (default all)")
    p.add_argument("--dry", action="store_true", help="a CPU, a tiny model, 2 rounds: the script checked end to end")
    p.add_argument("--name", default="gpu", help="results file name (benchmarks/results/NAME.md)")
    p.add_argument("--out", help="folder for the page and JSON (default: benchmarks/results; --dry: a temporary one)")
    p.add_argument("--budget", type=float, default=330, help="seconds the measurements may take (default 330)")
    p.add_argument("--rounds", type=int, help="alternating rounds per batch (default 20; --dry 2)")
    p.add_argument("--texts", nargs="*", default=[], help="more text files for the embed step (one text a line)")
    args = p.parse_args(argv)
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
              "routes": {}, "test": None, "skipped": []}
    if "test" in steps and not args.dry:
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/tools/test_fast_cuda.py"],
                           cwd=ROOT, capture_output=True, text=True)
        result["test"] = (r.stdout.strip().splitlines() or ["no output"])[-1]
        print("test:", result["test"], flush=True)
    directory = model_dir(work, args.dry)
    if "batches" in steps:
        result["batches"] = measure_batches(directory, device, rounds, args.dry, clock)
    for step, run in (("memory", lambda: measure_memory(directory, device, args.dry)),
                      ("embed", lambda: measure_embed(device, read_texts(
                          sorted((ROOT / "data" / "sentences").glob("*.txt")) + [Path(t) for t in args.texts],
                          64 if args.dry else None), 1 if args.dry else 2))):
        if step not in steps:
            continue
        if clock.spent():
            result["skipped"].append(step)
            continue
        result[step] = run()
    if "report" in steps:
        for short, dtype in DTYPES.items():
            if device.type == "cpu" and dtype != torch.float32:
                continue
            result["routes"][short] = fast.routes(BertModel.from_pretrained(directory, dtype=dtype, device=device).eval())
    result["seconds"] = clock.elapsed()
    name = args.name + ("_dry" if args.dry else "")
    (out / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    (out / f"{name}.md").write_text(page(result), encoding="utf-8")
    print(f"wrote {out / (name + '.md')} and .json ({result['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
