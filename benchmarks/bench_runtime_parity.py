#!/usr/bin/env python3
"""What each deployed form of a model differs by from the exact reference, layer by layer (issue 64): the
graph ``minibert export onnx --hidden-states --optimize --int8`` writes, run by ONNX Runtime (as exported,
after ORT's transformer optimiser, ORT's dynamic int8) and by OpenVINO (the ONNX graph; an IR saved by
``ov.save_model`` with its default fp16 weights and with ``compress_to_fp16=False``), and the CTranslate2
conversion (``minibert export ct2``) in fp32 and int8 -- on all-MiniLM-L6-v2 (real weights) and BERT-base
geometry (random weights that transformers builds and saves) -- each through ``minibert parity --against``'s
function on its built-in varied inputs (padding, pairs, long and short texts, accents, non-Latin script).

    pip install -c constraints.txt -e ".[test,bench]"
    python benchmarks/bench_runtime_parity.py --name runtime_parity_epyc-zen4     # ~3 minutes on 2 cores
    python benchmarks/bench_runtime_parity.py --dry --out /tmp/parity              # a tiny model (the test suite)

A runtime that is not installed is left out and named on the page.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

from bench_cpu_peers import machine, models, write_results  # noqa: E402
from minibert.errors import MissingExtra  # noqa: E402
from minibert.loading import copy_tokenizer  # noqa: E402

PACKAGES = ("torch", "onnx", "onnxruntime", "openvino", "ctranslate2", "transformers")


def deployed_forms(folder: Path, work: Path) -> tuple[dict, dict]:
    """{label: (path, runtime, dtype)} of every deployed form that can be made here, and {label: why not}."""
    from minibert.compat.export import to_ct2, to_onnx

    forms, missing = {}, {}
    graph = work / "onnx"
    to_onnx(folder, graph, hidden_states=True, optimize=True, int8=True, say=None)
    forms["ORT, as exported"] = (graph / "model.onnx", "onnxruntime", None)
    forms["ORT, optimised"] = (graph / "model_optimized.onnx", "onnxruntime", None)
    forms["ORT int8 (dynamic)"] = (graph / "model_int8.onnx", "onnxruntime", None)
    try:
        import openvino as ov

        forms["OpenVINO f32 (the ONNX graph)"] = (graph / "model.onnx", "openvino", None)
        for label, compress in (("OpenVINO IR, save_model default", True), ("OpenVINO IR, compress_to_fp16=False", False)):
            ir = work / f"ir_{int(compress)}"
            ir.mkdir()
            ov.save_model(ov.convert_model(str(graph / "model.onnx")), str(ir / "model.xml"), compress_to_fp16=compress)
            forms[label] = (ir, "openvino", None)
    except ImportError:
        missing["OpenVINO"] = "not installed (openvino)"
    try:
        ct2 = to_ct2(folder, work / "ct2", say=None)
        forms["CTranslate2 fp32"] = (ct2, "ctranslate2", "fp32")
        forms["CTranslate2 int8"] = (ct2, "ctranslate2", "int8")
    except MissingExtra as e:
        missing["CTranslate2"] = str(e)
    return forms, missing


def measure(folder: Path, work: Path, threads: int) -> dict:
    from minibert.compat.runtimes import runtime_parity

    forms, missing = deployed_forms(folder, work)
    reports = {}
    for label, (path, runtime, dtype) in forms.items():
        report = runtime_parity(folder, path, runtime=runtime, dtype=dtype, threads=threads)
        reports[label] = report.to_json()
        print(f"  {label}: {'PASS' if report.ok else 'FAIL'}, largest {max(r.hidden_max for r in report.rows):.2e}, "
              f"cosine min {report.cosine_min:.4f}", flush=True)
    return {"reports": reports, "missing": missing}


def page(result: dict) -> str:
    m = result["machine"]
    lines = ["# What each deployed form differs by, per layer" + (" (dry run: a tiny model)" if result["dry"] else ""),
             "", f"CPU: {m['cpu']}; flags: {', '.join(m['flags']) or 'none of note'}; {m['threads']} threads; "
             + ", ".join(f"{k} {v}" for k, v in m["versions"].items()) + ".", "",
             f"`{result['command']}`. Each cell: the largest absolute difference from minibert's readable fp32 model "
             "over real tokens of minibert parity's built-in inputs (texts and pairs, padded together, up to the "
             "model's last position). Every form is compared at its final output (\"output (last layer)\"); a "
             "runtime without hidden states at that row alone. fp32 passes within 1e-4 on every row; int8 is judged "
             "by the cosine of the sentence vectors (>= 0.99).", ""]
    for entry in result["models"]:
        reports = entry["reports"]
        labels = list(reports)
        layers = []
        for r in sorted(reports.values(), key=lambda r: -len(r["rows"])):  # the per-layer reports first
            layers += [row["layer"] for row in r["rows"] if row["layer"] not in layers]
        lines += [f"## {entry['name']}", "", "| layer | " + " | ".join(labels) + " |",
                  "|---|" + "---|" * len(labels)]
        for layer in layers:
            cells = []
            for label in labels:
                row = next((x for x in reports[label]["rows"] if x["layer"] == layer), None)
                cells.append(f"{row['hidden_max']:.1e}" if row else "")
            lines.append(f"| {layer} | " + " | ".join(cells) + " |")
        lines.append("| sentence cosine, min | " + " | ".join(
            f"{reports[k]['cosine_min']:.4f}" if reports[k]["cosine_min"] is not None else "-" for k in labels) + " |")
        lines.append("| judged as | " + " | ".join(reports[k]["dtype"] for k in labels) + " |")
        lines.append("| result | " + " | ".join(
            ("**PASS**" if reports[k]["ok"] else "FAIL" + (f" from {reports[k]['first_divergent']}"
                                                          if reports[k]["first_divergent"] else " (cosine)"))
            for k in labels) + " |")
        if entry["missing"]:
            lines += ["", "Left out: " + "; ".join(f"{k}: {v}" for k, v in entry["missing"].items()) + "."]
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--name", default="runtime_parity", help="results file name (benchmarks/results/NAME.md and .json)")
    p.add_argument("--threads", type=int, default=2, help="threads of every runtime and of torch (default 2)")
    p.add_argument("--dry", action="store_true", help="a tiny random model: every step, no figure")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"), help="folder of the results files")
    args = p.parse_args(argv)
    if args.threads < 1:
        p.error(f"--threads={args.threads} must be at least 1")
    torch.set_num_threads(args.threads)
    start = time.time()
    result = {"machine": machine(args.threads), "dry": args.dry, "models": [],
              "command": "python benchmarks/bench_runtime_parity.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    result["machine"]["versions"] = {k: v for k, v in result["machine"]["versions"].items() if k in PACKAGES}
    with tempfile.TemporaryDirectory(prefix="bench_runtime_parity_") as tmp:
        work = Path(tmp)
        made = models(args.dry, work)
        minilm = next((f for n, f in made if "MiniLM" in n), None)
        for name, folder in made:
            if not (folder / "vocab.txt").exists():  # transformers' random models come without a tokenizer
                copy_tokenizer(minilm or ROOT / "weights" / "all-MiniLM-L6-v2", folder)
            print(name, flush=True)
            where = work / name.split()[0]
            where.mkdir()
            result["models"].append({"name": name, **measure(folder, where, args.threads)})
    result["seconds"] = time.time() - start
    name = args.name + ("_dry" if args.dry and args.name == "runtime_parity" else "")
    write_results(Path(args.out), name, result, page(result))
    print(f"wrote {Path(args.out) / name}.md and .json ({result['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
