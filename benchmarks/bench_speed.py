#!/usr/bin/env python3
"""Speed where users feel it: one short input's latency, and int8 dynamic quantisation, against what a
user would pick instead (transformers' BertModel, fp32, SDPA), in one process, alternating.

Parts (``--parts``, all by default); numbers go to benchmarks/results/NAME.json and a table to NAME.md
(``--name``, default ``speed``: one name per CPU measured, so one machine's figures never overwrite
another's):

* ``latency``: 1 x 8, 16, 32 tokens on BERT-base geometry (random weights saved by transformers) and
  all-MiniLM-L6-v2: transformers fp32; minibert's fast path (default ``fp32_kernel="auto"``: each product on
  the route measured fastest on this CPU, ``tools/kernels.py``; the routes taken are printed and saved);
  the fast path on plain F.linear (``fp32_kernel="linear"``); oneDNN in F.linear's summation order
  (``"blocked"``); in oneDNN's own order (``"onednn"``); minibert int8. Median of
  ``--rounds`` alternating calls, as ratios to transformers. Then a profile of one 1 x 16 BERT-base call of
  the default fast path (torch.profiler, self CPU time grouped: embeddings, matrix products, attention,
  LayerNorm, GELU/other ops, and the rest of the wall time: Python overhead).
* ``int8``: dense 8 x 128 and 1 x 16 on BERT-base geometry and MiniLM: transformers fp32 vs minibert fp32
  (fast) vs minibert int8 (fast); ONNX Runtime's int8 dynamic quantisation of transformers' model when
  ``onnxruntime`` and ``onnx`` are installed (otherwise the row says so). Accuracy: ``minibert parity
  --dtype int8`` numbers (per-layer error, sentence cosine) for both models.
* ``trec``: TREC-6 test accuracy of the fine-tuned MiniLM classifier of benchmarks/bench_distill.py (its
  ``trec-teacher``, made by ``--parts task``) in fp32 and int8; untimed, so it may run beside other work.

    python benchmarks/bench_speed.py                # ~10 minutes on 2 cores
    python benchmarks/bench_speed.py --quick        # fewer rounds
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
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "data"))

from minibert import BertForSequenceClassification, BertModel  # noqa: E402
from minibert.analysis.parity import run_parity  # noqa: E402
from minibert.hardware import cpu_description, cpu_info  # noqa: E402
from minibert.tools import fast  # noqa: E402

from minibert.tools import timing as harness  # noqa: E402  (the one timing loop)

MINILM = ROOT / "weights" / "all-MiniLM-L6-v2"
RESULTS = ROOT / "benchmarks" / "results"
TEACHER = RESULTS / "distill-runs.tmp" / "trec-teacher"


def base_dir(work: Path) -> Path:
    """BERT-base geometry with random weights, built and saved by transformers (and MiniLM's vocabulary)."""
    import shutil

    from conftest import hf_config, random_hf_model

    directory = work / "bert-base-random"
    if not (directory / "model.safetensors").exists():
        random_hf_model(hf_config(), seed=0).save_pretrained(directory)
        shutil.copy(MINILM / "vocab.txt", directory / "vocab.txt")
    return directory


def batch_of(B: int, T: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1000, 20000, (B, T), generator=g)
    ids[:, 0], ids[:, -1] = 101, 102
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "token_type_ids": torch.zeros_like(ids)}


def alternate(fns: dict, rounds: int) -> dict[str, float]:
    """Median seconds per function over ``rounds`` alternating calls (after two warm-up calls each)."""
    with torch.inference_mode():
        return harness.medians(harness.alternate(fns, rounds, warmup=2))


def implementations(directory: Path, with_prepacked: bool = True) -> dict:
    import transformers

    hf = transformers.BertModel.from_pretrained(directory).eval()  # SDPA attention, transformers' default
    fp32 = BertModel.from_pretrained(directory)
    int8 = BertModel.from_pretrained(directory, dtype="int8")
    impls = {"transformers fp32": lambda b: hf(**b), "minibert fp32": lambda b, f=fast.prepare(fp32): f(**b)}
    if with_prepacked:
        impls["fp32 F.linear"] = lambda b, f=fast.prepare(fp32, fp32_kernel="linear"): f(**b)
        impls["fp32 blocked"] = lambda b, f=fast.prepare(fp32, fp32_kernel="blocked"): f(**b)
        impls["fp32 oneDNN order"] = lambda b, f=fast.prepare(fp32, fp32_kernel="onednn"): f(**b)
    impls["minibert int8"] = lambda b, f=fast.prepare(int8): f(**b)
    return impls, fp32


def part_latency(args, work, results):
    out = []
    results["routes"] = {}
    for name, directory in (("BERT-base", base_dir(work)), ("MiniLM", MINILM)):
        impls, fp32 = implementations(directory)
        results["routes"][name] = fast.routes(fp32)  # what the default ("auto") chose on this CPU
        print(f"  {name}: the default fast path's fp32 routes: {results['routes'][name]}", flush=True)
        for T in (8, 16, 32):
            batch = batch_of(1, T)
            times = alternate({k: (lambda f=f: f(batch)) for k, f in impls.items()}, args.rounds)
            base = times["transformers fp32"]
            out.append({"model": name, "shape": f"1 x {T}", "transformers_ms": base * 1000,
                        **{k: v / base for k, v in times.items() if k != "transformers fp32"}})
            print(f"  {name} 1x{T}: " + ", ".join(f"{k} {v * 1000:.2f} ms" for k, v in times.items()), flush=True)
    results["latency"] = out
    results["summation_blocks"] = {f"{o} x {i}": fast.summation_block(o, i) for o, i in
                                   ((2304, 768), (768, 768), (3072, 768), (768, 3072),
                                    (1152, 384), (384, 384), (1536, 384), (384, 1536))}
    results["profile"] = profile(base_dir(work))


def profile(directory: Path) -> dict:
    """Where one 1 x 16 BERT-base call of the default fast path spends its time."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    model = BertModel.from_pretrained(directory)
    run = fast.prepare(model)
    batch = batch_of(1, 16)
    with torch.inference_mode():
        for _ in range(3):
            run(**batch)
        walls = []
        for _ in range(20):
            start = time.perf_counter()
            run(**batch)
            walls.append(time.perf_counter() - start)
        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(10):
                run(**batch)
    groups = {"matrix products (Q K V fused, output, FFN in, FFN out)": ("addmm", "mm", "linear", "matmul",
                                                                          "_linear_pointwise", "linear_dynamic"),
              "attention (SDPA kernel)": ("scaled_dot_product", "_flash_attention", "_efficient_attention"),
              "LayerNorm": ("layer_norm",),
              "embeddings (lookups)": ("embedding", "index_select"),
              "GELU": ("gelu",)}
    spent = {g: 0.0 for g in groups}
    spent["other tensor ops (views, copies, masks, cat)"] = 0.0
    total_self = 0.0
    for e in prof.key_averages():
        us = e.self_cpu_time_total
        total_self += us
        for g, keys in groups.items():
            if any(k in e.key for k in keys):
                spent[g] += us
                break
        else:
            spent["other tensor ops (views, copies, masks, cat)"] += us
    wall_ms = statistics.median(walls) * 1000
    per_call = {g: us / 10 / 1000 for g, us in spent.items()}  # ms per call under the profiler
    profiled_ms = sum(per_call.values())
    scale = min(1.0, wall_ms / profiled_ms) if profiled_ms else 1.0  # the profiler adds its own cost
    rows = {g: ms * scale for g, ms in per_call.items()}
    rows["Python and dispatch overhead (wall time not inside an op)"] = max(0.0, wall_ms - sum(rows.values()))
    return {"wall_ms": wall_ms, "rows": rows}


def trec_accuracy(directory: Path, dtype) -> float | None:
    from minibert.training.datasets import read_table

    test = ROOT / "data" / "trec" / "test.csv"
    if not (directory / "model.safetensors").exists() or not test.exists():
        return None
    model = BertForSequenceClassification.from_pretrained(directory, dtype=dtype)
    table = read_table(test)
    predicted = [p["label"] for p in model.predict(table.texts, batch_size=32, max_length=64)]
    return sum(p == y for p, y in zip(predicted, table.labels)) / len(table.labels)


def part_int8(args, work, results):
    results.pop("onnx_errors", None)
    rows = []
    for name, directory in (("BERT-base", base_dir(work)), ("MiniLM", MINILM)):
        impls, _ = implementations(directory, with_prepacked=False)
        try:
            onnx = onnx_int8(directory, work)
        except Exception as e:  # the export or the quantiser failed: say so in the results, go on
            results.setdefault("onnx_errors", []).append(f"{name}: {type(e).__name__}: {str(e)[:300]}")
            onnx = None
        if onnx is not None:
            impls["onnxruntime int8"] = onnx
        for B, T in ((8, 128), (1, 16)):
            batch = batch_of(B, T)
            times = alternate({k: (lambda f=f: f(batch)) for k, f in impls.items()}, args.rounds)
            base = times["transformers fp32"]
            rows.append({"model": name, "shape": f"{B} x {T}", "transformers_ms": base * 1000,
                         **{k: v / base for k, v in times.items() if k != "transformers fp32"}})
            print(f"  {name} {B}x{T}: " + ", ".join(f"{k} {v * 1000:.1f} ms" for k, v in times.items()), flush=True)
    accuracy = []
    for name, directory in (("BERT-base geometry (random weights)", base_dir(work)), ("all-MiniLM-L6-v2", MINILM)):
        report = run_parity(str(directory), dtype="int8")
        accuracy.append({"model": name, "worst_layer_max": max(r.hidden_max for r in report.rows),
                         "last_layer_mean": report.rows[-2].hidden_mean, "cosine_min": report.cosine_min,
                         "cosine_mean": report.cosine_mean, "ok": report.ok})
    results["int8"] = {"speed": rows, "parity": accuracy,
                       "onnxruntime": "measured (transformers' model exported with torch.onnx, quantised by "
                       "onnxruntime.quantization.quantize_dynamic, QInt8 weights)" if any("onnxruntime int8" in r for r in rows)
                       else "; ".join(results.get("onnx_errors", [])) or "not installed (pip install onnxruntime onnx): no row"}


def part_trec(args, work, results):
    """TREC-6 test accuracy of bench_distill's fine-tuned teacher in fp32 and int8 (untimed)."""
    results["trec"] = {"fp32": trec_accuracy(TEACHER, None), "int8": trec_accuracy(TEACHER, "int8")}
    if results["trec"]["fp32"] is None:
        print(f"  no fine-tuned classifier at {TEACHER}: run benchmarks/bench_distill.py --parts task first", flush=True)


def _peers():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_cpu_peers", ROOT / "benchmarks" / "bench_cpu_peers.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def onnx_int8(directory: Path, work: Path):
    """transformers' model exported to ONNX and quantised by ONNX Runtime (dynamic, int8), or None."""
    try:
        import onnxruntime as ort
        from onnxruntime.quantization import QuantType, quantize_dynamic
        import transformers  # noqa: F401  (the export needs it)
    except ImportError:
        return None
    int8_path = work / f"{directory.name}.int8.onnx"
    if not int8_path.exists():  # the export bench_cpu_peers.py makes (transformers' eager BertModel, opset 17)
        fp32_path = _peers().export_onnx(directory, work / directory.name)
        quantize_dynamic(str(fp32_path), str(int8_path), weight_type=QuantType.QInt8)
    options = ort.SessionOptions()
    options.intra_op_num_threads = torch.get_num_threads()
    options.inter_op_num_threads = 1
    # ORT's threads spin after a run by default, taking the cores from the next (torch) call in the alternation
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    session = ort.InferenceSession(str(int8_path), options, providers=["CPUExecutionProvider"])
    return lambda b: session.run(None, {k: v.numpy() for k, v in b.items()})


def markdown(results: dict) -> str:
    _, flags = cpu_info()
    out = ["# Speed: one short input, and int8", "",
           f"CPU: {cpu_description()}; {torch.get_num_threads()} threads; torch {torch.__version__}; flags: "
           + ", ".join(sorted(f for f in flags if f.startswith(("avx", "amx", "fma", "vnni")))) + "", "",
           "Ratios are times relative to transformers' BertModel (fp32, SDPA) on the same input, median of "
           "alternating calls in one process (lower is faster).", ""]
    if "latency" in results:
        keys = [k for k in results["latency"][0] if k not in ("model", "shape", "transformers_ms")]
        out += ["## Latency of one input", "", "| model | input | transformers ms | " + " | ".join(keys) + " |",
                "|---" * (3 + len(keys)) + "|"]
        out += [f"| {r['model']} | {r['shape']} | {r['transformers_ms']:.2f} | "
                + " | ".join(f"{r[k]:.2f}" for k in keys) + " |" for r in results["latency"]]
        chosen = results.get("routes", {})
        out += ["", "Routes the default fast path (`fp32_kernel=\"auto\"`) measured fastest and took on this CPU "
                "(`fast.routes`; qkv, attention output, ffn in, ffn out): "
                + "; ".join(f"{m}: " + ", ".join(r.values()) for m, r in chosen.items()) + "."]
        blocks = results.get("summation_blocks", {})
        out += ["", "Inner blocks in which oneDNN reproduces F.linear's sums on this CPU (`fast.summation_block`, "
                "weight (out x in): block; none = the default stays on F.linear): "
                + ", ".join(f"{shape}: {k or 'none'}" for shape, k in blocks.items()) + "."]
        p = results["profile"]
        out += ["", f"Where a 1 x 16 BERT-base call of the default fast path spends its {p['wall_ms']:.2f} ms "
                "(torch.profiler self CPU time, scaled to the unprofiled wall time):", "",
                "| part | ms | share |", "|---|---|---|"]
        out += [f"| {g} | {ms:.2f} | {ms / p['wall_ms']:.0%} |" for g, ms in p["rows"].items()]
        out.append("")
    if "int8" in results:
        r8 = results["int8"]
        keys = [k for k in r8["speed"][0] if k not in ("model", "shape", "transformers_ms")]
        out += ["## int8 dynamic quantisation", "", "| model | input | transformers fp32 ms | " + " | ".join(keys) + " |",
                "|---" * (3 + len(keys)) + "|"]
        out += [f"| {r['model']} | {r['shape']} | {r['transformers_ms']:.1f} | "
                + " | ".join(f"{r[k]:.2f}" if k in r else "-" for k in keys) + " |" for r in r8["speed"]]
        out += ["", f"ONNX Runtime: {r8['onnxruntime']}.", "",
                "Error against fp32 (`minibert parity --dtype int8`, the built-in parity texts):", "",
                "| model | worst layer max abs | last layer mean abs | sentence cosine min | mean | >= 0.99 |",
                "|---|---|---|---|---|---|"]
        out += [f"| {a['model']} | {a['worst_layer_max']:.3f} | {a['last_layer_mean']:.4f} | {a['cosine_min']:.4f} | "
                f"{a['cosine_mean']:.4f} | {'yes' if a['ok'] else 'no'} |" for a in r8["parity"]]
        out.append("")
    t = results.get("trec", {})
    if t.get("fp32") is not None:
        out += [f"TREC-6 test accuracy of the fine-tuned MiniLM classifier: fp32 {t['fp32']:.4f}, int8 "
                f"{t['int8']:.4f} ({(t['int8'] - t['fp32']) * 100:+.1f} points).", ""]
    return "\n".join(out)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", default="latency,int8,trec")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--name", default="speed", help="results file name (one per CPU measured)")
    args = parser.parse_args()
    if args.quick:
        args.rounds = 3
    torch.manual_seed(0)
    path = RESULTS / (f"{args.name}_quick.json" if args.quick else f"{args.name}.json")
    results = json.loads(path.read_text()) if path.exists() else {}
    work = Path(tempfile.gettempdir()) / "minibert-bench-speed"
    work.mkdir(exist_ok=True)
    for part in args.parts.split(","):
        print(f"part {part}", flush=True)
        {"latency": part_latency, "int8": part_int8, "trec": part_trec}[part](args, work, results)
        path.write_text(json.dumps(results, indent=2) + "\n")
        (path.with_suffix(".md")).write_text(markdown(results))
    print(markdown(results))


if __name__ == "__main__":
    main()
