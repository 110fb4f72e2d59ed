#!/usr/bin/env python3
"""Model speed and memory: minibert vs transformers' BertModel (SDPA, its default) vs PyTorch's own
``nn.TransformerEncoder`` fast path, on BERT-base geometry (random weights that transformers builds and
saves: the compute is the same as for the real checkpoint).

Machines are shared and noisy, so every number that matters is a ratio measured side by side: each
round runs every implementation once, in a rotating order, and a ratio is the median over rounds of
(minibert time / reference time) in the same round. Absolute times are reported for orientation only.

Measured:
- forward time over a grid of (batch x length), dense and padded mixes, fp32 and bf16;
- useful FLOP/s (real tokens only, ``minibert.tools.accounting``) against the measured peak of one large
  matrix product on this machine;
- checkpoint load time and peak memory growth (fresh processes), import time (fresh processes).

    python benchmarks/bench_model.py                 # full run, ~10 minutes on 2 cores
    python benchmarks/bench_model.py --quick         # small grid, MiniLM-sized model, 2 rounds, ~3 minutes;
                                                     # writes model_quick.md/.json (git-ignored)
Writes benchmarks/results/model.md and model.json (or --out DIR).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import warnings

import torch

warnings.filterwarnings("ignore", message=".*nested tensors is in prototype.*")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from minibert.tools import fast, kernels  # noqa: E402
from minibert import BertModel  # noqa: E402
from minibert.tools.accounting import flops_per_token  # noqa: E402

from minibert.tools import timing as harness  # noqa: E402  (the one timing loop)

BASE = dict(vocab_size=30522, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
            intermediate_size=3072)
SMALL = dict(vocab_size=30522, hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
             intermediate_size=1536)
DENSE = [(1, 16), (1, 128), (8, 128), (32, 128), (8, 512)]
PADDED = [(16, 128, 0.38), (32, 128, 0.5), (8, 512, 0.4)]  # (batch, length, fraction of real tokens)


# ----------------------------------------------------------------------------------------------- inputs
def lengths_for(B: int, T: int, fraction: float, seed: int = 0) -> list[int]:
    """B sequence lengths between ~T/10 and T: one text of exactly T tokens and shorter ones, summing to
    fraction * B * T (as close as the bounds allow). A realistic mix: short texts plus a long one."""
    if fraction >= 1 or B == 1:
        return [T] * B
    low = max(2, round(0.1 * T))
    target = round(fraction * B * T)
    g = torch.Generator().manual_seed(seed)
    raw = 0.2 + 1.6 * torch.rand(B - 1, generator=g)
    rest = (raw / raw.sum() * (target - T)).round().clamp(low, T).long().tolist()
    lengths = [T] + rest
    for _ in range(B * T):  # nudge to the target total within [low, T]
        diff = target - sum(lengths)
        movable = [i for i in range(1, B) if (lengths[i] < T if diff > 0 else lengths[i] > low)]
        if diff == 0 or not movable:
            break
        i = movable[int(torch.randint(len(movable), (1,), generator=g))]
        lengths[i] += 1 if diff > 0 else -1
    return lengths


def make_batch(B: int, T: int, fraction: float, vocab: int) -> dict:
    lengths = lengths_for(B, T, fraction)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1000, vocab, (B, T), generator=g)
    mask = (torch.arange(T)[None] < torch.tensor(lengths)[:, None]).long()
    ids[:, 0] = 101
    return {"input_ids": ids * mask, "attention_mask": mask}


# -------------------------------------------------------------------------------------- implementations
def torch_encoder_from(model: BertModel) -> torch.nn.Module:
    """nn.TransformerEncoder holding minibert's weights (post-LN, GELU, batch first), so PyTorch's native
    fast path (nested tensors for padding) can be timed on the same computation."""
    c = model.config
    layer = torch.nn.TransformerEncoderLayer(c.hidden_size, c.num_attention_heads, c.intermediate_size,
                                             dropout=0.0, activation="gelu", layer_norm_eps=c.layer_norm_eps,
                                             batch_first=True, norm_first=False)
    encoder = torch.nn.TransformerEncoder(layer, c.num_hidden_layers, enable_nested_tensor=True)
    with torch.no_grad():
        for mine, theirs in zip(model.encoder.blocks, encoder.layers):
            a = mine.attn
            theirs.self_attn.in_proj_weight.copy_(torch.cat([a.query.weight, a.key.weight, a.value.weight]))
            theirs.self_attn.in_proj_bias.copy_(torch.cat([a.query.bias, a.key.bias, a.value.bias]))
            theirs.self_attn.out_proj.weight.copy_(a.output.weight)
            theirs.self_attn.out_proj.bias.copy_(a.output.bias)
            theirs.linear1.load_state_dict(mine.ffn.dense_in.state_dict())
            theirs.linear2.load_state_dict(mine.ffn.dense_out.state_dict())
            theirs.norm1.load_state_dict(mine.attn_norm.state_dict())
            theirs.norm2.load_state_dict(mine.ffn_norm.state_dict())
    return encoder.eval()


def implementations(directory: Path, dtype: torch.dtype, with_torch: bool = True) -> dict:
    import transformers

    ours = BertModel.from_pretrained(directory, dtype=dtype).eval()
    reference = transformers.BertModel.from_pretrained(directory, dtype=dtype, attn_implementation="sdpa").eval()
    fast_ours = fast.prepare(ours)
    impls = {
        "transformers": lambda b: reference(**b).last_hidden_state,
        "minibert": lambda b: fast_ours(**b).last_hidden_state,
        "minibert readable": lambda b: ours(**b).last_hidden_state,
    }
    if dtype == torch.float32:
        packed = fast.prepare(BertModel.from_pretrained(directory, dtype=dtype).eval(), fp32_kernel="onednn")
        impls["minibert prepacked fp32"] = lambda b: packed(**b).last_hidden_state
    if with_torch:
        encoder = torch_encoder_from(ours).to(dtype)

        def torch_fast(b):
            x = ours.embeddings(b["input_ids"], torch.zeros_like(b["input_ids"]),
                                torch.arange(b["input_ids"].shape[1]).expand_as(b["input_ids"]))
            padding = ~b["attention_mask"].bool()
            return encoder(x, src_key_padding_mask=padding if padding.any() else None)
        impls["torch TransformerEncoder"] = torch_fast
    return impls


# ------------------------------------------------------------------------------------------------ timing
def time_round_robin(impls: dict, batch: dict, rounds: int) -> dict[str, list[float]]:
    """Times per implementation, and each one's max abs difference from transformers on real tokens
    (from the warm-up call) -- they must all compute the same thing."""
    valid = batch["attention_mask"].bool()
    with torch.inference_mode():
        outputs = {n: impls[n](batch).float() for n in impls}  # warm-up (weight packing, allocator)
        agreement = {n: (outputs[n] - outputs["transformers"])[valid].abs().max().item() for n in impls}
        times = harness.alternate({n: (lambda f=f: f(batch)) for n, f in impls.items()}, rounds, warmup=0, rotate=True)
    return times, agreement


paired_ratio = harness.paired_ratio


def useful_flops(config, lengths: list[int]) -> float:
    """FLOPs on real tokens only: what any implementation must at least compute."""
    return sum(L * flops_per_token(config, L)["total"] for L in lengths) + len(lengths) * flops_per_token(
        config, 1)["pooler_per_sequence"]


def gemm_peak(dtype: torch.dtype, reps: int = 10) -> dict:
    """Peak GFLOP/s of one (1024 x 768) @ (768 x 3072) product: plain F.linear and oneDNN prepacked."""
    x = torch.randn(1024, 768, dtype=dtype)
    w = torch.randn(3072, 768, dtype=dtype)
    flops = 2 * 1024 * 768 * 3072
    out = {}
    candidates = {"F.linear": lambda: torch.nn.functional.linear(x, w)}
    if kernels.MKLDNN:
        packed = torch.ops.mkldnn._reorder_linear_weight(w)
        candidates["oneDNN prepacked"] = lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    for name, f in candidates.items():
        f()
        best = min(_timed(f) for _ in range(reps))
        out[name] = flops / best / 1e9
    return out


def _timed(f) -> float:
    t0 = time.perf_counter()
    f()
    return time.perf_counter() - t0


# ------------------------------------------------------------------------------------- fresh processes
LOAD_SNIPPET = r"""
import sys, time, json
def hwm():
    for line in open('/proc/self/status'):
        if line.startswith('VmHWM'):
            return int(line.split()[1]) * 1024
which, path = sys.argv[1], sys.argv[2]
import torch
if which == 'minibert':
    from minibert import BertModel as M
    kw = {}
else:
    from transformers import BertModel as M
    kw = {}
before = hwm()
t0 = time.perf_counter()
model = M.from_pretrained(path, **kw)
elapsed = time.perf_counter() - t0
print(json.dumps({'seconds': elapsed, 'peak_growth': hwm() - before}))
"""

IMPORT_SNIPPET = r"""
import sys, time, json
t0 = time.perf_counter()
if sys.argv[1] == 'minibert':
    import minibert
    from minibert import BertModel, BertTokenizer
else:
    from transformers import BertModel, BertTokenizerFast
    BertModel, BertTokenizerFast
print(json.dumps({'seconds': time.perf_counter() - t0}))
"""


def fresh(snippet: str, *args: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), TRANSFORMERS_VERBOSITY="error", HF_HUB_OFFLINE="1")
    out = subprocess.run([sys.executable, "-c", snippet, *args], capture_output=True, text=True, env=env,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def load_and_import(directory: Path, rounds: int) -> dict:
    result = {"load": {"minibert": [], "transformers": []}, "import": {"minibert": [], "transformers": []}}
    for r in range(rounds):
        for which in (("minibert", "transformers") if r % 2 == 0 else ("transformers", "minibert")):
            result["load"][which].append(fresh(LOAD_SNIPPET, which, str(directory)))
            result["import"][which].append(fresh(IMPORT_SNIPPET, which)["seconds"])
    size = sum(p.stat().st_size for p in directory.glob("*.safetensors"))
    summary = {
        "checkpoint_bytes": size,
        "load_seconds": {k: statistics.median(x["seconds"] for x in v) for k, v in result["load"].items()},
        "load_peak_growth_x_file": {k: statistics.median(x["peak_growth"] for x in v) / size
                                    for k, v in result["load"].items()},
        "load_ratio": statistics.median(a["seconds"] / b["seconds"] for a, b in
                                        zip(result["load"]["minibert"], result["load"]["transformers"])),
        "import_seconds": {k: statistics.median(v) for k, v in result["import"].items()},
        "import_ratio": statistics.median(a / b for a, b in
                                          zip(result["import"]["minibert"], result["import"]["transformers"])),
    }
    return summary


def compile_check(directory: Path, geometry: dict, rounds: int) -> list[dict]:
    """Does torch.compile pay on CPU? Compile the readable minibert model (fullgraph: it has no graph
    breaks) per dtype and case, and time it against transformers and the fast path."""
    import transformers

    rows = []
    for dname, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        ours = BertModel.from_pretrained(directory, dtype=dtype).eval()
        reference = transformers.BertModel.from_pretrained(directory, dtype=dtype).eval()
        for B, T, fraction in ((8, 128, 1.0), (16, 128, 0.38)):
            batch = make_batch(B, T, fraction, geometry["vocab_size"])
            torch._dynamo.reset()
            compiled = torch.compile(ours, fullgraph=True, dynamic=False)
            t0 = time.perf_counter()
            with torch.inference_mode():
                compiled(**batch)
            compile_seconds = time.perf_counter() - t0
            impls = {"transformers": lambda b: reference(**b).last_hidden_state,
                     "minibert fast": lambda b: fast.prepare(ours)(**b).last_hidden_state,
                     "minibert compiled": lambda b: compiled(**b).last_hidden_state}
            times, agreement = time_round_robin(impls, batch, rounds)
            rows.append({"dtype": dname, "batch": B, "length": T, "real_fraction": fraction,
                         "compile_seconds": compile_seconds,
                         "ratio_vs_transformers": {n: paired_ratio(times, n, "transformers") for n in times},
                         "max_abs_diff_vs_transformers": agreement})
            print(f"compile {dname} {B}x{T}: {compile_seconds:.0f} s to compile; " + ", ".join(
                f"{n} {r:.2f}" for n, r in rows[-1]["ratio_vs_transformers"].items()), flush=True)
    return rows


# ------------------------------------------------------------------------------------------------- main
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="MiniLM geometry, small grid, 2 rounds: a ~3-minute smoke run (results in model_quick.*, git-ignored)")
    parser.add_argument("--rounds", type=int, default=None, help="timing rounds per case (default 5, quick 2)")
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--no-torch", action="store_true", help="leave out nn.TransformerEncoder")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--compile", action="store_true", help="also time torch.compile of the readable model")
    args = parser.parse_args(argv)
    import transformers

    geometry = SMALL if args.quick else BASE
    rounds = args.rounds or (2 if args.quick else 5)
    dense = [(1, 16), (8, 128)] if args.quick else DENSE
    padded = [(16, 128, 0.38)] if args.quick else PADDED
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    torch.manual_seed(0)
    config = transformers.BertConfig(**geometry)
    workdir = Path(tempfile.mkdtemp(prefix="minibert-bench-"))
    transformers.BertModel(config).eval().save_pretrained(workdir)
    ours_config = BertModel.from_pretrained(workdir).config

    from minibert.hardware import cpu_info

    cpu_name, cpu_flags = cpu_info()
    shown = [f for f in ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_fp16")
             if f in cpu_flags]
    report = {"machine": {"cpu": cpu_name or platform.processor() or platform.machine(), "cpu_flags": shown,
                          "threads": torch.get_num_threads(),
                          "torch": torch.__version__, "transformers": transformers.__version__,
                          "python": platform.python_version()},
              "geometry": geometry, "rounds": rounds, "cases": [], "gemm_peak_gflops": {}}
    fp32_times = {}
    for dname in args.dtypes.split(","):
        dtype = dtypes[dname]
        report["gemm_peak_gflops"][dname] = gemm_peak(dtype)
        impls = implementations(workdir, dtype, with_torch=not args.no_torch)
        for B, T, fraction in [(b, t, 1.0) for b, t in dense] + padded:
            batch = make_batch(B, T, fraction, geometry["vocab_size"])
            lengths = batch["attention_mask"].sum(1).tolist()
            times, agreement = time_round_robin(impls, batch, rounds)
            flops = useful_flops(ours_config, lengths)
            case = {"dtype": dname, "batch": B, "length": T, "real_fraction": sum(lengths) / (B * T),
                    "median_seconds": {n: statistics.median(t) for n, t in times.items()},
                    "ratio_vs_transformers": {n: paired_ratio(times, n, "transformers") for n in times},
                    "useful_gflops": {n: flops / statistics.median(t) / 1e9 for n, t in times.items()},
                    "max_abs_diff_vs_transformers": agreement}
            if dname == "fp32":
                fp32_times[(B, T, fraction)] = times["transformers"]
            elif (B, T, fraction) in fp32_times:
                case["minibert_bf16_vs_transformers_fp32"] = statistics.median(times["minibert"]) / statistics.median(
                    fp32_times[(B, T, fraction)])
            report["cases"].append(case)
            print(f"{dname} {B}x{T} real {case['real_fraction']:.2f}: " + ", ".join(
                f"{n} {r:.2f}" for n, r in case["ratio_vs_transformers"].items()), flush=True)
        del impls
    if args.compile:
        report["compile"] = compile_check(workdir, geometry, rounds)
    report["load_import"] = load_and_import(workdir, 3 if not args.quick else 1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "model_quick" if args.quick else "model"
    (out / f"{name}.json").write_text(json.dumps(report, indent=2))
    (out / f"{name}.md").write_text(markdown(report))
    print(markdown(report))
    return 0


def markdown(report: dict) -> str:
    m = report["machine"]
    g = report["geometry"]
    lines = [f"# Model benchmark ({g['num_hidden_layers']} x {g['hidden_size']}, {g['num_attention_heads']} heads)",
             "", f"torch {m['torch']}, transformers {m['transformers']}, {m['threads']} threads, {m['cpu']} "
             f"(CPU flags: {', '.join(m.get('cpu_flags') or ['unknown'])}); "
             f"{report['rounds']} alternating rounds per case. Ratios are medians of same-round time ratios "
             "(lower = faster than transformers' BertModel with SDPA at the same dtype).", ""]
    impls = list(report["cases"][0]["ratio_vs_transformers"])
    others = [n for n in impls if n != "transformers"]
    lines.append("| dtype | batch x length | real tokens | transformers ms | " + " | ".join(others) + " |")
    lines.append("|---|---|---|---|" + "---|" * len(others))
    for c in report["cases"]:
        lines.append(f"| {c['dtype']} | {c['batch']} x {c['length']} | {100 * c['real_fraction']:.0f}% | "
                     f"{1000 * c['median_seconds']['transformers']:.1f} | "
                     + " | ".join(f"{c['ratio_vs_transformers'][n]:.2f}" if n in c["ratio_vs_transformers"]
                                  else "-" for n in others) + " |")
    worst = {}
    for c in report["cases"]:
        for n, d in c["max_abs_diff_vs_transformers"].items():
            worst[(c["dtype"], n)] = max(worst.get((c["dtype"], n), 0.0), d)
    lines += ["", "Largest difference from transformers' last hidden state on real tokens, any case: " + "; ".join(
        f"{n} {dt} {d:.1e}" for (dt, n), d in worst.items() if n != "transformers") + "."]
    lines += ["", "bf16 minibert vs fp32 transformers (time ratio):", ""]
    lines.append("| batch x length | real tokens | ratio |")
    lines.append("|---|---|---|")
    for c in report["cases"]:
        if "minibert_bf16_vs_transformers_fp32" in c:
            lines.append(f"| {c['batch']} x {c['length']} | {100 * c['real_fraction']:.0f}% | "
                         f"{c['minibert_bf16_vs_transformers_fp32']:.2f} |")
    lines += ["", "Useful GFLOP/s (real tokens only) and share of the measured matrix-product peak:", ""]
    for dname, peaks in report["gemm_peak_gflops"].items():
        best = max(peaks.values())
        lines.append(f"- {dname} peak: " + ", ".join(f"{k} {v:.0f}" for k, v in peaks.items()) + " GFLOP/s")
        for c in report["cases"]:
            if c["dtype"] == dname and c["real_fraction"] == 1.0 and c["batch"] * c["length"] >= 4096:
                lines.append(f"  - {c['batch']} x {c['length']}: " + ", ".join(
                    f"{n} {v:.0f} ({100 * v / best:.0f}%)" for n, v in c["useful_gflops"].items()))
    if report.get("compile"):
        lines += ["", "torch.compile of the readable model (fullgraph, static shapes) vs transformers:", "",
                  "| dtype | batch x length | real tokens | compile s | minibert fast | minibert compiled |",
                  "|---|---|---|---|---|---|"]
        for c in report["compile"]:
            r = c["ratio_vs_transformers"]
            lines.append(f"| {c['dtype']} | {c['batch']} x {c['length']} | {100 * c['real_fraction']:.0f}% | "
                         f"{c['compile_seconds']:.0f} | {r['minibert fast']:.2f} | {r['minibert compiled']:.2f} |")
    li = report["load_import"]
    lines += ["", f"Load ({li['checkpoint_bytes'] / 2**20:.0f} MiB safetensors, fresh process, median): "
              f"minibert {li['load_seconds']['minibert']:.3f} s, transformers "
              f"{li['load_seconds']['transformers']:.3f} s, ratio {li['load_ratio']:.2f}; peak memory growth "
              f"minibert {li['load_peak_growth_x_file']['minibert']:.2f}x the file, transformers "
              f"{li['load_peak_growth_x_file']['transformers']:.2f}x.",
              f"Import (fresh process, model + tokenizer classes): minibert {li['import_seconds']['minibert']:.2f} s, "
              f"transformers {li['import_seconds']['transformers']:.2f} s, ratio {li['import_ratio']:.2f}.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
