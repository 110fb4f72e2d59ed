#!/usr/bin/env python3
"""Where one short input's time goes (issue 62, point 1): the fast path's 1 x 16 forward on all-MiniLM-L6-v2
and BERT-base geometry, per operator (torch.profiler: self time per forward), the part no operator accounts
for (Python, dispatch), the fixed cost of one oneDNN product call, and ONNX Runtime's own per-operator
profile of its optimised graph on the same input -- set against the physical limits of this CPU: the
forward's FLOPs at the FMA rate a large product reaches here, and the weights' bytes at the memory
bandwidth a large read reaches here.

    python benchmarks/bench_profile.py --name profile_epyc-zen4       # ~1 minute on 2 cores
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))

from minibert import BertConfig, BertModel  # noqa: E402
from minibert.tools import fast, kernels  # noqa: E402

import bench_cpu_peers as peers  # noqa: E402


#: the operators that compute a product, by route: oneDNN (prepacked), F.linear (MKL's GEMM), a plain
#: matrix product, int8's kernels (fbgemm's handed the grid, the dynamic one) -- the profile counts the
#: products whatever route ran them
PRODUCT_OPS = ("mkldnn::_linear_pointwise", "aten::addmm", "aten::mm", "quantized::linear_dynamic",
               "quantized::linear_with_input_q_dq_qweight_dq_output_fp32")


def per_call(fn, calls: int) -> float:
    """Seconds per call: the median of 5 runs of ``calls`` calls, after a warm-up."""
    for _ in range(max(3, calls // 10)):
        fn()
    runs = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        runs.append((time.perf_counter() - start) / calls)
    return statistics.median(runs)


def limits() -> dict:
    """The FMA rate of a large fp32 product (oneDNN, prepacked: the fastest route here) and the read
    bandwidth of a 256 MB tensor, on this CPU and thread count."""
    with torch.inference_mode():
        x, w = torch.randn(1024, 1024), torch.randn(1024, 1024)
        if kernels.MKLDNN:
            packed, bias = kernels.pack(w), torch.zeros(1024)
            flop_s = 2 * 1024**3 / per_call(lambda: kernels.ONEDNN_LINEAR(x, packed, bias, "none", [], ""), 20)
        else:
            flop_s = 2 * 1024**3 / per_call(lambda: x @ w.t(), 20)
        big = torch.randn(64 * 1024 * 1024)
        read = big.numel() * 4 / per_call(big.sum, 5)
        # the fixed cost of one product call: a (1 x 64) @ (64 x 64) product does next to no work
        tiny_x, tiny_w = torch.randn(1, 64), torch.randn(64, 64)
        onednn = None
        if kernels.MKLDNN:
            tiny_packed = kernels.pack(tiny_w)
            onednn = per_call(lambda: kernels.ONEDNN_LINEAR(tiny_x, tiny_packed, None, "none", [], ""), 2000) * 1e6
        linear = per_call(lambda: torch.nn.functional.linear(tiny_x, tiny_w), 2000) * 1e6
    return {"gflop_s": flop_s / 1e9, "read_gb_s": read / 1e9, "onednn_call_us": onednn, "f_linear_call_us": linear}


def forward_costs(config: BertConfig, tokens: int) -> dict:
    """FLOPs of one forward over ``tokens`` tokens (products and attention) and the bytes of the weights
    every forward reads (the block weights; the embedding rows read are negligible; no pooler, as in ORT's
    graph)."""
    H, F, n = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    per_block = 2 * tokens * (4 * H * H + 2 * H * F) + 4 * tokens * tokens * H
    weight_bytes = 4 * n * (4 * H * H + 2 * H * F + 9 * H + F)
    return {"flops": n * per_block, "weight_bytes": weight_bytes}


def profile_ours(model: BertModel, batch: dict, forwards: int = 50) -> tuple[float, dict]:
    """Milliseconds per forward and the self time of each operator per forward (ms), torch.profiler, with the
    wall time of the profiled forwards (``profiled_ms``: what the operators' times are part of)."""
    runner = fast.prepare(model)
    call = (lambda: runner(**batch, output_hidden_states=False, pooler=False))  # what ORT's graph computes
    with torch.inference_mode():
        wall = per_call(call, 200) * 1e3
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            for _ in range(forwards):
                call()
            profiled = (time.perf_counter() - start) / forwards * 1e3
    ops = {e.key: e.self_cpu_time_total / 1e3 / forwards for e in prof.key_averages()}
    ops = {k: round(v, 4) for k, v in sorted(ops.items(), key=lambda kv: -kv[1]) if v >= 0.005}
    counts = {e.key: e.count // forwards for e in prof.key_averages()}
    return wall, {"self_ms": ops, "calls": {k: counts[k] for k in ops}, "profiled_ms": round(profiled, 3)}


def profile_ort(folder: Path, config, batch: dict, work: Path, threads: int) -> dict | None:
    """ORT's own profile of its optimised graph: ms per run by operator type, and the run's ms."""
    try:
        import onnxruntime as ort
    except ImportError:
        return None
    onnx_path = peers.export_onnx(folder, work)
    runners, _ = peers.ort_runners(onnx_path, config, threads)
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    feeds = {k: v.numpy() for k, v in batch.items()}
    plain = ort.InferenceSession(str(onnx_path.with_name("model_opt.onnx")), options, providers=["CPUExecutionProvider"])
    wall = per_call(lambda: plain.run(None, feeds), 200) * 1e3
    options.enable_profiling = True
    options.profile_file_prefix = str(work / "ort_profile")
    session = ort.InferenceSession(str(onnx_path.with_name("model_opt.onnx")), options, providers=["CPUExecutionProvider"])
    for _ in range(200):
        session.run(None, feeds)
    events = json.loads(Path(session.end_profiling()).read_text())
    by_op, runs = collections.Counter(), 0
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            by_op[e["args"]["op_name"]] += e["dur"]
        runs += e.get("name") == "model_run"
    return {"ms": round(wall, 3), "self_ms": {k: round(v / runs / 1e3, 4) for k, v in by_op.most_common()}}


def report(name: str, folder: Path, work: Path, threads: int, bounds: dict) -> dict:
    config = BertConfig.from_json_file(folder / "config.json")
    model = BertModel.from_pretrained(folder).eval()
    batch = peers.batch(1, 16, 1.0, seed=1)
    wall, ops = profile_ours(model, batch)
    costs = forward_costs(config, 16)
    products = sum(v for k, v in ops["self_ms"].items() if k in PRODUCT_OPS)
    accounted = sum(ops["self_ms"].values())
    calls = sum(ops["calls"].get(k, 0) for k in PRODUCT_OPS)  # whatever route ran them
    routes = {k: ops["calls"][k] for k in PRODUCT_OPS if ops["calls"].get(k)}
    row = {"name": name, "ms": round(wall, 3), "operators": ops, "products_ms": round(products, 3),
           "product_routes": routes, "plan": fast.routes(model, rows=16),
           # the same forwards' wall time less their operators' self time (both under the profiler)
           "outside_operators_ms": round(ops["profiled_ms"] - accounted, 3),
           "product_calls": calls,
           "product_fixed_ms": round(routes.get("mkldnn::_linear_pointwise", 0) * (bounds["onednn_call_us"] or 0) / 1e3, 3),
           "flops": costs["flops"], "weight_bytes": costs["weight_bytes"],
           "compute_bound_ms": round(costs["flops"] / (bounds["gflop_s"] * 1e9) * 1e3, 3),
           "memory_bound_ms": round(costs["weight_bytes"] / (bounds["read_gb_s"] * 1e9) * 1e3, 3),
           "ort": profile_ort(folder, config, batch, work, threads)}
    print(json.dumps({k: v for k, v in row.items() if k != "operators"}), flush=True)
    return row


def page(result: dict) -> str:
    about, bounds = result["machine"], result["limits"]
    lines = ["# Where one short query's time goes (1 x 16, the fast path)", "",
             f"Measured on {about['cpu']} (flags: {', '.join(about['flags'])}), {about['threads']} threads; "
             + ", ".join(f"{k} {v}" for k, v in about["versions"].items()) + f". Command: `{result['command']}`.", "",
             f"This CPU's limits, measured here: a large fp32 product (1024^3, oneDNN) runs at "
             f"**{bounds['gflop_s']:.0f} GFLOP/s**; a 256 MB read at **{bounds['read_gb_s']:.0f} GB/s**; one oneDNN "
             f"product call costs **{bounds['onednn_call_us']:.1f} us** even when it does no work (a 1 x 64 x 64 "
             f"product), `F.linear` {bounds['f_linear_call_us']:.1f} us.", "",
             "| | " + " | ".join(r["name"] for r in result["models"]) + " |", "|---" * (len(result["models"]) + 1) + "|"]
    def row(label, fn):
        lines.append(f"| {label} | " + " | ".join(fn(r) for r in result["models"]) + " |")
    row("fast path, ms per forward", lambda r: f"**{r['ms']:.2f}**")
    row("ORT optimised graph, ms per run", lambda r: f"**{r['ort']['ms']:.2f}**" if r["ort"] else "not installed")
    row("issue 72's goal: 1.0 x ORT's run, ms", lambda r: f"{r['ort']['ms']:.2f}" if r["ort"] else "")
    row("the plan at 16 rows (qkv, attention output, ffn in, ffn out)",
        lambda r: ", ".join(v for k, v in r.get("plan", {}).items() if k != "attention") or "-")
    row("products (every route), ms", lambda r: f"{r['products_ms']:.2f} ({r['product_calls']} calls: "
        + ", ".join(f"{k} {n}" for k, n in r.get("product_routes", {}).items()) + ")")
    row("... of which oneDNN calls' fixed cost, ms", lambda r: f"{r['product_fixed_ms']:.2f}")
    for op in ("aten::_scaled_dot_product_flash_attention_for_cpu", "aten::native_layer_norm", "aten::embedding",
               "aten::index_select", "aten::add_", "aten::empty"):
        row(f"`{op}`, ms", lambda r, op=op: f"{r['operators']['self_ms'].get(op, 0):.3f}")
    row("outside any operator (Python, dispatch), ms", lambda r: f"{r['outside_operators_ms']:.2f}")
    row("FLOPs / this CPU's rate (compute bound), ms", lambda r: f"{r['compute_bound_ms']:.2f} ({r['flops'] / 1e6:.0f} MFLOP)")
    row("weights / this CPU's bandwidth (memory bound), ms",
        lambda r: f"{r['memory_bound_ms']:.2f} ({r['weight_bytes'] / 1e6:.0f} MB)")
    row("ORT's products (MatMul + Attention with its QKV product), ms",
        lambda r: f"{r['ort']['self_ms'].get('MatMul', 0) + r['ort']['self_ms'].get('Attention', 0):.2f}" if r["ort"] else "")
    row("ORT's other operators, ms", lambda r: f"{sum(v for k, v in r['ort']['self_ms'].items() if k not in ('MatMul', 'Attention')):.2f}"
        if r["ort"] else "")
    lines += ["", "Every operator's self time per forward (torch.profiler; ORT's own profiler for ORT):", ""]
    for r in result["models"]:
        lines.append(f"- {r['name']}: " + ", ".join(f"`{k}` {v:.3f} ms x{r['operators']['calls'][k]}"
                                                    for k, v in r["operators"]["self_ms"].items()))
        if r["ort"]:
            lines.append(f"- {r['name']}, ORT: " + ", ".join(f"`{k}` {v:.3f} ms" for k, v in r["ort"]["self_ms"].items()))
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--name", default="profile", help="results file name (benchmarks/results/NAME.md and .json)")
    p.add_argument("--threads", type=int, default=2, help="threads (default 2)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"), help="folder of the results files")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    result = {"machine": peers.machine(args.threads), "limits": limits(), "models": [],
              "command": "python benchmarks/bench_profile.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    print(result["limits"], flush=True)
    with tempfile.TemporaryDirectory(prefix="bench_profile_") as tmp:
        for name, folder in peers.models(False, Path(tmp)):
            where = Path(tmp) / name.split()[0]
            where.mkdir()
            result["models"].append(report(name.split(" (")[0], folder, where, args.threads, result["limits"]))
    peers.write_results(Path(args.out), args.name, result, page(result))
    print(f"wrote {Path(args.out) / args.name}.md and .json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
