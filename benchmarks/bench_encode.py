#!/usr/bin/env python3
"""Sentence embedding throughput on this CPU: minibert's SentenceEncoder against sentence-transformers, fixed
batches against token-budget batches, and the Ray Data engine with 1 and 2 local workers.

Texts: 10,000 "sentences of mixed length" made from data/sentences/train.txt (VADER's short texts): text i
joins 1 to 8 consecutive sentences (seeded), so lengths run from a few tokens to the 256-token limit of
all-MiniLM-L6-v2's folder.

Parts (``--parts``, all by default); numbers go to benchmarks/results/encode.json and a table to encode.md:

* ``batching``: ``SentenceTransformer.encode(batch_size=32)`` vs ``SentenceEncoder.encode(batch_size=32)``
  vs ``SentenceEncoder.encode(max_tokens=8192)``, in one process, alternating, median of ``--rounds``;
  also the largest difference between the vectors (the three must agree to 1e-6).
* ``ray``: ``minibert.compat.ray.embed_dataset`` on a local Ray (``num_cpus=2``) over 4 text shards with
  1 worker x 2 torch threads and 2 workers x 1 thread; wall time includes Ray's start of the actors, the
  model loads, reading and writing Parquet. The single-process ``encode`` of the same texts is the baseline.

    python data/fetch_data.py && python benchmarks/bench_encode.py           # ~15 minutes on 2 cores
    python benchmarks/bench_encode.py --quick                                 # 1,000 texts, 1 round
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "data"))

from fetch_data import fetch_sentences  # noqa: E402

from minibert.compat import SentenceEncoder  # noqa: E402
from minibert.hardware import cpu_info  # noqa: E402

MODEL = ROOT / "weights" / "all-MiniLM-L6-v2"
RESULTS = ROOT / "benchmarks" / "results"


def mixed_texts(n: int, seed: int = 0) -> list[str]:
    sentences = [t for t in (fetch_sentences() / "train.txt").read_text(encoding="utf-8").split("\n") if t.strip()]
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        start, k = rng.randrange(len(sentences) - 8), rng.randint(1, 8)
        out.append(" ".join(sentences[start:start + k]))
    return out


def timed(fn):
    start = time.perf_counter()
    value = fn()
    return time.perf_counter() - start, value


def part_batching(args, texts, results):
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(MODEL), device="cpu")
    ours = SentenceEncoder.from_pretrained(MODEL)
    fns = {"sentence-transformers, batch 32": lambda: st.encode(texts, batch_size=32),
           "minibert, batch 32": lambda: ours.encode(texts, batch_size=32),
           "minibert, 8,192-token budget": lambda: ours.encode(texts, max_tokens=8192)}
    times = {name: [] for name in fns}
    vectors = {}
    for _ in range(args.rounds):
        for name, fn in fns.items():
            seconds, vectors[name] = timed(fn)
            times[name].append(seconds)
            print(f"  {name}: {seconds:.1f} s", flush=True)
    reference = vectors["sentence-transformers, batch 32"]
    lengths = [len(x) for x in ours.tokenize(texts)["input_ids"]]
    results["batching"] = {
        "texts": len(texts), "tokens": sum(lengths), "min_tokens": min(lengths), "max_tokens": max(lengths),
        "rows": [{"name": name, "seconds": statistics.median(t), "texts_per_second": len(texts) / statistics.median(t),
                  "max_abs_diff_vs_sentence_transformers": float(np.abs(vectors[name] - reference).max())}
                 for name, t in times.items()]}


def part_ray(args, texts, results):
    import ray

    from minibert.compat.ray import RayEmbed, embed_dataset

    work = Path(tempfile.mkdtemp(prefix="bench_encode_"))
    try:
        shards = work / "shards"
        shards.mkdir()
        for s in range(4):
            (shards / f"part-{s}.txt").write_text("\n".join(texts[s::4]) + "\n", encoding="utf-8")
        ours = SentenceEncoder.from_pretrained(MODEL)
        single, _ = timed(lambda: ours.encode(texts, max_tokens=8192))
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        rows = [{"name": "one process (SentenceEncoder.encode, 2 threads)", "seconds": single,
                 "texts_per_second": len(texts) / single}]
        for workers, threads in ((1, 2), (2, 1)):
            report = embed_dataset([str(shards)], work / f"out-{workers}",
                                   RayEmbed(model=str(MODEL), workers=workers, threads=threads, max_tokens=8192))
            assert report.rows_out == len(texts) and not report.failed, report
            rows.append({"name": f"Ray Data, {workers} worker(s) x {threads} thread(s)", "seconds": report.seconds,
                         "texts_per_second": report.texts_per_second})
            print(f"  {rows[-1]['name']}: {report.seconds:.1f} s", flush=True)
        ray.shutdown()
        results["ray"] = {"texts": len(texts), "rows": rows}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def markdown(results: dict) -> str:
    name, flags = cpu_info()
    out = [f"# Sentence embedding throughput ({results['texts']} texts of mixed length, all-MiniLM-L6-v2)", "",
           f"CPU: {name}; {torch.get_num_threads()} threads; flags: "
           + ", ".join(sorted(f for f in flags if f.startswith(("avx", "amx")))), ""]
    if "batching" in results:
        b = results["batching"]
        out += [f"## Batching ({b['tokens']:,} tokens, {b['min_tokens']}..{b['max_tokens']} per text)", "",
                "| encoder | seconds | texts/s | max abs diff vs sentence-transformers |", "|---|---|---|---|"]
        out += [f"| {r['name']} | {r['seconds']:.1f} | {r['texts_per_second']:.0f} | "
                f"{r['max_abs_diff_vs_sentence_transformers']:.1e} |" for r in b["rows"]]
        out.append("")
    if "ray" in results:
        out += ["## Ray Data engine (local Ray, num_cpus=2; wall time incl. actor start, model load, Parquet)", "",
                "| run | seconds | texts/s |", "|---|---|---|"]
        out += [f"| {r['name']} | {r['seconds']:.1f} | {r['texts_per_second']:.0f} |" for r in results["ray"]["rows"]]
        out.append("")
    return "\n".join(out)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", default="batching,ray")
    parser.add_argument("--quick", action="store_true", help="1,000 texts, one round")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    n = 1000 if args.quick else 10_000
    args.rounds = 1 if args.quick else args.rounds
    texts = mixed_texts(n)
    suffix = "_quick" if args.quick else ""
    path = RESULTS / f"encode{suffix}.json"
    results = json.loads(path.read_text()) if path.exists() else {}
    results["texts"] = n
    for part in args.parts.split(","):
        print(f"part {part}", flush=True)
        {"batching": part_batching, "ray": part_ray}[part](args, texts, results)
        path.write_text(json.dumps(results, indent=2) + "\n")
        (RESULTS / f"encode{suffix}.md").write_text(markdown(results))
    print(markdown(results))


if __name__ == "__main__":
    main()
