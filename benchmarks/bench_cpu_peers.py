#!/usr/bin/env python3
"""minibert's fast path against what its users run on a CPU instead (issue 62): ONNX Runtime with its BERT
graph optimiser (fp32, and dynamic int8), OpenVINO (fp32), CTranslate2 (fp32, int8), transformers (sdpa,
eager), and minibert's fast path in fp32 and int8 -- on all-MiniLM-L6-v2 (real weights) and BERT-base
geometry (random weights that transformers builds and saves), three batches: one short query (1 x 16),
a dense 8 x 128 batch, a padded 16 x 128 batch at 38 % real tokens.

Every runner is timed in the same alternating rounds in one process, each with the same number of threads
(``--threads``, default 2); a figure is the median over rounds of the paired ratio to transformers' fp32
``BertModel`` (sdpa), and the milliseconds of the median round. Beside the times: each runner's largest
difference from transformers at real tokens (fp32 noise is ~1e-6; int8 is judged by the cosine of
mean-pooled sentence vectors). The goals of issue 72 are time / ORT's optimised fp32 graph: 1 x 16 <= 1.0,
dense <= 1.0, padded <= 0.5 (issue 62 asked 0.9 of the first two); the page says the plan the fast path took
for each row bucket (``tools.plan``), and times the fast path with its compiled forward for one short input
(``fast.prepare(model, compile=True)``, ``tools.compiled``: compiled once per machine and weights, a minute
or two a model, kept under ``$MINIBERT_CACHE``; not in a dry run).

    pip install -c constraints.txt -e ".[test,bench]"
    python benchmarks/bench_cpu_peers.py --name cpu_peers_epyc-zen4     # ~10 minutes on 2 cores
    python benchmarks/bench_cpu_peers.py --dry --out /tmp/peers          # a tiny model, 2 rounds (the test suite)

A runtime that is not installed is left out and named on the page. The ONNX graph is transformers' model
exported by ``torch.onnx.export`` (opset 17, eager attention, so ORT's optimiser fuses every block:
EmbedLayerNormalization, Attention, BiasGelu, SkipLayerNormalization); OpenVINO reads the same graph
before ORT's fusions; CTranslate2 converts the checkpoint (its converter reads ``position_embedding_type``,
which transformers 5's ``BertConfig`` no longer has: set to "absolute" in a copy first).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from minibert import BertModel  # noqa: E402
from minibert.hardware import cpu_description, cpu_info  # noqa: E402
from minibert.tools import fast  # noqa: E402
from minibert.tools import timing as harness  # noqa: E402

#: (name, B, T, real-token fraction, goal for our fast path's time / ORT's optimised fp32)
BATCHES = [("1 x 16", 1, 16, 1.0, 1.0), ("dense 8 x 128", 8, 128, 1.0, 1.0), ("padded 16 x 128", 16, 128, 0.38, 0.5)]
DRY_BATCHES = [("1 x 16", 1, 16, 1.0, 1.0), ("padded 4 x 32", 4, 32, 0.5, 0.5)]
BASE = dict(vocab_size=30522, hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072)
TINY = dict(vocab_size=30522, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)
FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")
PACKAGES = ("torch", "transformers", "onnxruntime", "onnx", "openvino", "ctranslate2")


def batch(B: int, T: int, real: float, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random word ids in [1000, 20000) with [CLS] and [SEP]; right padding to the lengths of ``real``."""
    g = torch.Generator().manual_seed(seed)
    lengths = [T] * B if real >= 1 else [min(T, max(3, round(T * real * (0.5 + (i % 4) / 3)))) for i in range(B)]
    ids = torch.zeros(B, T, dtype=torch.long)
    mask = torch.zeros(B, T, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.randint(1000, 20000, (n,), generator=g)
        ids[i, 0], ids[i, n - 1] = 101, 102
        mask[i, :n] = 1
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": torch.zeros_like(ids)}


# --------------------------------------------------------------------------------------- the runners
def transformers_runner(folder: Path, attn: str):
    import transformers

    model = transformers.BertModel.from_pretrained(str(folder), attn_implementation=attn).eval()

    def run(b):
        with torch.inference_mode():
            return model(**b).last_hidden_state.numpy()
    return run


def minibert_runner(folder: Path, dtype: str, compile: bool = False):
    model = BertModel.from_pretrained(folder, dtype=None if dtype == "fp32" else dtype).eval()
    runner = fast.prepare(model, compile=compile)
    if compile and runner.compiled is None:
        return None

    def run(b):  # the last hidden state only, as the ONNX graph computes (its pooler is pruned)
        return runner(**b, output_hidden_states=False, pooler=False).last_hidden_state.numpy()
    run.prepared = runner
    return run


def export_onnx(folder: Path, work: Path) -> Path:
    """transformers' model (eager attention: the form ORT's optimiser fuses) as ``work/model.onnx``, dynamic
    batch and length; inputs input_ids, attention_mask, token_type_ids; output last_hidden_state."""
    import transformers

    model = transformers.BertModel.from_pretrained(str(folder), attn_implementation="eager").eval()

    class LastState(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, input_ids, attention_mask, token_type_ids):
            return self.inner(input_ids=input_ids, attention_mask=attention_mask,
                              token_type_ids=token_type_ids).last_hidden_state

    b = batch(2, 8, 1.0)
    work.mkdir(parents=True, exist_ok=True)
    path = work / "model.onnx"
    names = ["input_ids", "attention_mask", "token_type_ids"]
    axes = {n: {0: "batch", 1: "length"} for n in [*names, "last_hidden_state"]}
    torch.onnx.export(LastState(model), tuple(b[n] for n in names), str(path), input_names=names,
                      output_names=["last_hidden_state"], dynamic_axes=axes, opset_version=17, dynamo=False)
    return path


def ort_runners(onnx_path: Path, config, threads: int, int8: bool = True, spinning: bool = True) -> dict:
    """ORT on the optimised fp32 graph, and (``int8``) on its dynamic int8 quantisation (ORT's defaults);
    ``spinning``: ORT's idle threads spin a while after each run (its default)."""
    import onnxruntime as ort
    from onnxruntime.quantization import QuantType, quantize_dynamic
    from onnxruntime.transformers import optimizer

    optimised = onnx_path.with_name("model_opt.onnx")
    graph = optimizer.optimize_model(str(onnx_path), model_type="bert", num_heads=config.num_attention_heads,
                                     hidden_size=config.hidden_size)
    graph.save_model_to_file(str(optimised))
    fused = {k: v for k, v in graph.get_fused_operator_statistics().items() if v}
    quantised = onnx_path.with_name("model_int8.onnx")
    if int8:
        import onnx

        # the fused contrib operators carry no type for shape inference: their outputs are fp32
        quantize_dynamic(str(optimised), str(quantised), weight_type=QuantType.QInt8,
                         extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT})
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    # ORT's pool threads spin for a while after each run, its default (one short query: ~3.1 against
    # ~4.1 ms without, MiniLM on the Zen 4); ``--no-ort-spinning`` turns it off
    options.add_session_config_entry("session.intra_op.allow_spinning", "1" if spinning else "0")
    runners = {}
    for name, path in (("ORT fp32", optimised), ("ORT int8", quantised))[:2 if int8 else 1]:
        session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        runners[name] = (lambda b, s=session: s.run(None, {k: v.numpy() for k, v in b.items()})[0])
    return runners, fused


def openvino_runner(onnx_path: Path, threads: int):
    import openvino as ov

    core = ov.Core()
    compiled = core.compile_model(str(onnx_path), "CPU", {"INFERENCE_NUM_THREADS": threads,
                                                          "INFERENCE_PRECISION_HINT": "f32"})  # not bf16
    request = compiled.create_infer_request()

    def run(b):
        request.infer({k: v.numpy() for k, v in b.items()})
        return request.get_output_tensor(0).data.copy()
    return run


def ct2_runners(folder: Path, work: Path, threads: int) -> dict:
    import ctranslate2

    copy = work / "ct2_source"
    shutil.copytree(folder, copy, dirs_exist_ok=True)
    config = json.loads((copy / "config.json").read_text())
    config.setdefault("position_embedding_type", "absolute")  # what CTranslate2's converter reads
    (copy / "config.json").write_text(json.dumps(config))
    converted = work / "ct2"
    ctranslate2.converters.TransformersConverter(str(copy)).convert(str(converted), force=True)
    runners = {}
    for name, compute in (("CT2 fp32", "float32"), ("CT2 int8", "int8")):
        encoder = ctranslate2.Encoder(str(converted), device="cpu", compute_type=compute, intra_threads=threads)

        def run(b, e=encoder):
            lengths = b["attention_mask"].sum(1)
            ids = [row[:n].tolist() for row, n in zip(b["input_ids"], lengths.tolist())]
            out = np.array(e.forward_batch(ids).last_hidden_state)  # (B, longest, H), zeros past each length
            T = b["input_ids"].shape[1]
            return np.pad(out, ((0, 0), (0, T - out.shape[1]), (0, 0)))
        runners[name] = run
    return runners


def build_runners(folder: Path, config, threads: int, work: Path, spinning: bool = True,
                  compile: bool = True) -> tuple[dict, dict]:
    """Every runner that can be built here but CTranslate2's (``measure_ct2``: a process of its own), and
    what was left out (name -> why). ``compile``: the fast path with its compiled forward for one short
    input too (``fast.prepare(model, compile=True)``; it serves the 1 x 16 batch, the batches run the fast path)."""
    runners = {"transformers sdpa": transformers_runner(folder, "sdpa"),
               "transformers eager": transformers_runner(folder, "eager"),
               "minibert fast": minibert_runner(folder, "fp32"), "minibert int8": minibert_runner(folder, "int8")}
    missing, notes = {}, {}
    if compile:
        start = time.perf_counter()
        runner = minibert_runner(folder, "fp32", compile=True)
        if runner is None:
            missing["minibert compiled"] = "not built or nowhere faster here (the log says which)"
        else:
            runners["minibert compiled"] = runner
            notes["compiled"] = {"prepare_s": round(time.perf_counter() - start, 1), **runner.prepared.compiled.entry}
    model = BertModel.from_pretrained(folder).eval()
    notes["plan"] = {label: fast.routes(model, rows=rows)  # the fast path's plan per row bucket (tools.plan)
                     for label, rows in (("one short input (16 rows)", 16), ("batches", None))}
    try:
        onnx_path = export_onnx(folder, work)
    except ImportError as e:
        missing["ONNX export"] = f"not installed ({e.name})"
        return runners, {"missing": missing, **notes}
    for label, build in (("ORT", lambda: ort_runners(onnx_path, config, threads, spinning=spinning)),
                         ("OpenVINO", lambda: {"OpenVINO fp32": openvino_runner(onnx_path, threads)})):
        try:
            made = build()
        except ImportError as e:
            missing[label] = f"not installed ({e.name})"
            continue
        if label == "ORT":
            made, notes["ORT fusions"] = made
        runners.update(made)
    return runners, {"missing": missing, **notes}


# --------------------------------------------------------------------------------------- measuring
def agreement(got: np.ndarray, want: np.ndarray, mask: torch.Tensor) -> dict:
    """Largest difference at real tokens, and the lowest cosine of mean-pooled sentence vectors (the measures
    ``minibert export`` and ``parity --against`` use)."""
    from minibert.compat.export import difference, sentence_cosines

    m = mask.numpy()
    return {"largest_difference": difference("last_hidden_state", got, want, m),
            "cosine_min": float(sentence_cosines(got, want, m).min())}


#: seconds of sleep before each runner's turn (``timing.alternate``'s gap): in one process the runner timed
#: before keeps the cores busy after it returns -- ORT's pool spins ~40 ms after a run (its default), torch's
#: OpenMP threads ~10 ms (measured on the Zen 4: CPU time used while the process sleeps) --, so without a
#: gap the next runner starts sharing the cores with it (our one-query forward timed 10 ms after an ORT run
#: took 9-16 ms, against 5-6 alone; the untimed settle calls absorbed most of it, the gap the rest)
GAP = 0.06


def measure(runners: dict, batches: list, rounds: int, gap: float = GAP) -> list[dict]:
    rows = []
    for name, B, T, real, goal in batches:
        b = batch(B, T, real, seed=1)
        want = runners["transformers sdpa"](b)
        repeat = 20 if B * T <= 16 else 1  # a short query is timed over 20 calls a round
        fns = {k: (lambda run=run: [run(b) for _ in range(repeat)]) for k, run in runners.items()}
        # each runner's turn starts once the runner before has let go of the cores (``gap``), then an untimed
        # call of its own (its threads awake, its weights in cache), then the timed one
        times = harness.alternate(fns, rounds, warmup=1, rotate=True, settle=1, gap=gap)
        row = {"batch": name, "B": B, "T": T, "real_fraction": real, "goal": goal, "runners": {}}
        for k, run in runners.items():
            row["runners"][k] = {"ratio": round(harness.paired_ratio(times, k, "transformers sdpa"), 3),
                                 "ms": round(1e3 * sorted(times[k])[len(times[k]) // 2] / repeat, 3),
                                 **agreement(run(b), want, b["attention_mask"])}
        ort = row["runners"].get("ORT fp32")
        if ort:
            row["fast_over_ort"] = round(harness.paired_ratio(times, "minibert fast", "ORT fp32"), 3)
            if "minibert compiled" in runners:
                row["compiled_over_ort"] = round(harness.paired_ratio(times, "minibert compiled", "ORT fp32"), 3)
        rows.append(row)
        print(f"{name}: " + ", ".join(f"{k} {v['ratio']:.3f}" for k, v in row["runners"].items())
              + (f"; fast / ORT {row['fast_over_ort']:.3f} (goal <= {goal})" if ort else "")
              + (f", compiled / ORT {row['compiled_over_ort']:.3f}" if "compiled_over_ort" in row else ""), flush=True)
    return rows


def measure_ct2(folder: Path, work: Path, args, rounds: int) -> dict | str:
    """CTranslate2's rows, measured in a process of its own beside its own transformers baseline: once
    CTranslate2 has run in a process, every torch operator there is slower for good (its OpenMP runtime,
    a second copy of libgomp, leaves torch's threads waking slowly: on the Zen 4 a LayerNorm call 6.5 ->
    45 us, the fast path's one short query 4.3 -> 6.7 ms), which would charge CTranslate2's cost to every
    runner timed after it. The rows (batch -> runner -> cell), or why there are none."""
    import importlib.util as util
    import subprocess

    if util.find_spec("ctranslate2") is None:
        return "not installed (ctranslate2)"
    out = work / "ct2.json"
    command = [sys.executable, __file__, "--ct2-only", str(folder), "--ct2-json", str(out), "--rounds", str(rounds),
               "--threads", str(args.threads), "--gap", str(args.gap)] + (["--dry"] if args.dry else [])
    done = subprocess.run(command, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        return f"failed: {done.stderr.strip().splitlines()[-1] if done.stderr.strip() else done.returncode}"
    return json.loads(out.read_text())


def merge_ct2(rows: list[dict], ct2, notes: dict) -> None:
    """CTranslate2's cells (ratios to the transformers baseline of its own process) into ``rows``."""
    if isinstance(ct2, str):
        notes.setdefault("missing", {})["CTranslate2"] = ct2
        return
    for row in rows:
        for name, cell in ct2[row["batch"]].items():
            if name != "transformers sdpa":
                row["runners"][name] = {**cell, "own_process": True}


def corpus_row(work: Path, args) -> dict | str:
    """The end-to-end measure with all-MiniLM-L6-v2 on data/sentences (``--corpus`` texts; 64 in a dry run),
    or why it was not made."""
    import importlib.util as util

    from minibert import BertConfig

    if util.find_spec("sentence_transformers") is None or util.find_spec("onnxruntime") is None:
        return "sentence-transformers or onnxruntime is not installed"
    folder = ROOT / "weights" / "all-MiniLM-L6-v2"
    if not (folder / "model.safetensors").is_file():
        return f"{folder} is missing: python weights/fetch_minilm.py"
    files = sorted((ROOT / "data" / "sentences").glob("*.txt"))
    texts = [t for f in files for t in f.read_text(encoding="utf-8").split("\n") if t.strip()]
    if not texts:
        return "no texts: python data/fetch_data.py sentences"
    texts = texts[:64 if args.dry else args.corpus]
    (work / "e2e").mkdir(parents=True, exist_ok=True)
    return end_to_end(folder, work / "e2e", BertConfig.from_json_file(folder / "config.json"), args.threads, texts,
                      1 if args.dry else 3)


def ct2_only(folder: Path, out: Path, dry: bool, rounds: int, threads: int, gap: float) -> int:
    with tempfile.TemporaryDirectory(prefix="bench_ct2_") as tmp:
        runners = {"transformers sdpa": transformers_runner(folder, "sdpa"), **ct2_runners(folder, Path(tmp), threads)}
        rows = measure(runners, DRY_BATCHES if dry else BATCHES, rounds, gap)
    out.write_text(json.dumps({row["batch"]: row["runners"] for row in rows}))
    return 0


def end_to_end(folder: Path, work: Path, config, threads: int, texts: list[str], rounds: int) -> dict:
    """A corpus encoded end to end, texts to unit vectors (mean-pooled, normalised, batch 32): minibert's
    ``SentenceEncoder`` (its tokenizer, length-sorted batches, the fast path), ONNX Runtime's optimised
    graph driven by transformers' Rust tokenizer (batches of 32 in the corpus's order, padded to the
    longest, as an ONNX pipeline does), and sentence-transformers' ``encode`` (torch; it sorts by length
    too). Texts per second (best of ``rounds``) and each one's largest difference from ours."""
    import transformers
    from sentence_transformers import SentenceTransformer

    from minibert.compat import SentenceEncoder

    ours = SentenceEncoder.from_pretrained(folder)
    theirs = SentenceTransformer(str(folder), device="cpu", local_files_only=True)
    runners, _ = ort_runners(export_onnx(folder, work), config, threads, int8=False)
    ort_model = runners["ORT fp32"]
    fast_tok = transformers.AutoTokenizer.from_pretrained(str(folder))

    def ort_pipeline():
        out = []
        for i in range(0, len(texts), 32):
            b = fast_tok(texts[i:i + 32], padding=True, truncation=True, max_length=256, return_tensors="pt")
            states = ort_model({"input_ids": b["input_ids"], "attention_mask": b["attention_mask"],
                                "token_type_ids": b["token_type_ids"]})
            m = b["attention_mask"].numpy()[..., None]
            v = (states * m).sum(1) / m.sum(1)
            out.append(v / np.linalg.norm(v, axis=1, keepdims=True))
        return np.concatenate(out)

    def ort_sorted():
        """The strongest ORT pipeline a user runs: batches of similar lengths (sorted, as sentence-transformers'
        ONNX backend and our encoder do), padded to each batch's longest, vectors put back in order."""
        lengths = [len(ids) for ids in fast_tok(texts, truncation=True, max_length=256)["input_ids"]]
        order = sorted(range(len(texts)), key=lambda i: -lengths[i])
        out = np.empty((len(texts), config.hidden_size), dtype=np.float32)
        for i in range(0, len(order), 32):
            chunk = order[i:i + 32]
            b = fast_tok([texts[j] for j in chunk], padding=True, truncation=True, max_length=256, return_tensors="pt")
            states = ort_model({"input_ids": b["input_ids"], "attention_mask": b["attention_mask"],
                                "token_type_ids": b["token_type_ids"]})
            m = b["attention_mask"].numpy()[..., None]
            v = (states * m).sum(1) / m.sum(1)
            out[chunk] = v / np.linalg.norm(v, axis=1, keepdims=True)
        return out

    int8 = SentenceEncoder.from_pretrained(folder, dtype="int8")
    fns = {"minibert": lambda: ours.encode(texts, batch_size=32, normalize_embeddings=True),
           "minibert int8": lambda: int8.encode(texts, batch_size=32, normalize_embeddings=True),
           "ORT + Rust tokenizer": ort_pipeline,
           "ORT length-sorted + Rust tokenizer": ort_sorted,
           "sentence-transformers": lambda: theirs.encode(texts, batch_size=32, normalize_embeddings=True)}
    notes = {}
    try:  # sentence-transformers' ONNX backend: it sorts by length too; offline it needs a graph in the folder
        st_onnx = SentenceTransformer(str(folder), device="cpu", local_files_only=True, backend="onnx")
        fns["sentence-transformers onnx"] = lambda: st_onnx.encode(texts, batch_size=32, normalize_embeddings=True)
    except Exception as e:  # noqa: BLE001 -- optimum missing, no graph and no hub: said on the page
        notes["sentence-transformers onnx"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    times = harness.alternate(fns, rounds, warmup=1, rotate=True, gap=GAP)
    want = fns["minibert"]()
    row = {"texts": len(texts), "texts_per_second": {}, "largest_difference": {}, "not_run": notes}
    for name, fn in fns.items():
        got = np.asarray(fn())
        row["texts_per_second"][name] = round(len(texts) / min(times[name]), 1)
        row["largest_difference"][name] = float(np.abs(got - want).max())
        if name == "minibert int8":
            row["int8_cosine_min"] = round(float((got * want).sum(1).min()), 4)  # unit vectors
    ort = {k: v for k, v in row["texts_per_second"].items() if k.startswith("ORT") or k.endswith(" onnx")}
    row["strongest_ort"] = max(ort, key=ort.get)
    row["over_ort"] = round(row["texts_per_second"]["minibert"] / ort[row["strongest_ort"]], 3)
    row["int8_over_ort"] = round(row["texts_per_second"]["minibert int8"] / ort[row["strongest_ort"]], 3)
    print("end to end: " + ", ".join(f"{k} {v} texts/s" for k, v in row["texts_per_second"].items())
          + f"; minibert / {row['strongest_ort']} {row['over_ort']:.2f}x (goal >= 1.1), int8 {row['int8_over_ort']:.2f}x "
          f"at cosine {row['int8_cosine_min']:.4f} (goal >= 1.5 at >= 0.99)", flush=True)
    return row


def machine(threads: int) -> dict:
    _, flags = cpu_info()
    versions = {}
    for package in PACKAGES:
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            pass
    return {"cpu": cpu_description(), "flags": [f for f in FLAGS if f in flags], "threads": threads,
            "python": sys.version.split()[0], "versions": versions}


def page(result: dict) -> str:
    about = result["machine"]
    lines = ["# minibert's fast path against ONNX Runtime, OpenVINO and CTranslate2 on a CPU", "",
             f"Measured on {about['cpu']} (flags: {', '.join(about['flags']) or 'none of ' + ', '.join(FLAGS)}), "
             f"{about['threads']} threads for every runner (ORT's idle threads "
             f"{'spinning, its default' if result.get('ort_spinning') else 'not spinning'}), Python {about['python']}; "
             + ", ".join(f"{k} {v}" for k, v in about["versions"].items())
             + f". Command: `{result['command']}` ({result['seconds']:.0f} s, {result['rounds']} alternating rounds"
             + (f"; {result['gap_s'] * 1e3:.0f} ms of sleep before each runner's turn, so the one before has let "
                "go of the cores -- ORT's pool spins ~40 ms after a run, torch's OpenMP threads ~10 ms --, then "
                "an untimed call of its own" if result.get("gap_s") else "; runners timed back to back, each "
                "sharing the cores with the spinning threads of the one before")
             + "; minibert's runners return the last hidden state without the pooler, as the ONNX graph does)."
             + (" **A dry run: a tiny model, no figure to read.**" if result["dry"] else ""), "",
             "Each cell: time / transformers' fp32 `BertModel` (sdpa), the median over rounds of the paired "
             "ratio, with the milliseconds of the median round; the last row: each runner's largest difference "
             "from transformers at real tokens and the lowest cosine of mean-pooled sentence vectors, on the "
             "last batch. CTranslate2 is timed in a process of its own, against transformers there: once it "
             "has run, every torch operator in its process is slower for good (its own copy of libgomp; on the "
             "Zen 4 a LayerNorm call went 6.5 -> 45 us), which would charge its cost to the runners after it. "
             "The last column is issue 72's measure: our fast path's time / ORT's "
             "optimised fp32 graph, beside its goal. Where one is missed, why is on the profile page "
             "(`benchmarks/bench_profile.py`: one query's time by operator beside ORT's, and the goal beside our "
             "products alone) and in the fast-path how-to.", ""]
    for model in result["models"]:
        names = list(model["rows"][0]["runners"])
        lines += [f"## {model['name']}", "", "| batch | " + " | ".join(names) + " | fast / ORT fp32 (goal) |",
                  "|---" * (len(names) + 2) + "|"]
        for row in model["rows"]:
            cells = [f"{row['runners'][n]['ratio']:.3f} ({row['runners'][n]['ms']:.2f} ms)" for n in names]
            over = (f"**{row['fast_over_ort']:.2f}** (<= {row['goal']})" if "fast_over_ort" in row else "no ORT")
            if "compiled_over_ort" in row:
                over += f"; compiled **{row['compiled_over_ort']:.2f}**"
            lines.append(f"| {row['batch']} | " + " | ".join(cells) + f" | {over} |")
        lines.append("| largest difference (last batch) | " + " | ".join(
            f"{model['rows'][-1]['runners'][n]['largest_difference']:.1e}, cos {model['rows'][-1]['runners'][n]['cosine_min']:.4f}"
            for n in names) + " | |")
        notes = model["notes"]
        if notes.get("plan"):
            lines += ["", "The fast path's fp32 plan here (qkv, attention output, ffn in, ffn out; attention), per row "
                      "bucket (`tools.plan`): " + "; ".join(f"{bucket}: " + ", ".join(routes.values())
                                                            for bucket, routes in notes["plan"].items()) + "."]
        if notes.get("compiled"):
            c = notes["compiled"]
            lines += ["", "`minibert compiled`: the fast path prepared with `compile=True` (`tools.compiled`: the readable "
                      "model compiled ahead of time by AOTInductor for one input of 2..64 real tokens, taken only where "
                      f"it measured faster than the fast path) -- prepared in {c['prepare_s']:.0f} s here"
                      + (f" (compiled in {c['compile_s']} s; its time / the fast path's at "
                         + ", ".join(f"{k} tokens {v}" for k, v in c["ratio_to_fast"].items())
                         + f": it serves 2..{c['up_to']} real tokens, every other call runs the fast path)"
                         if "compile_s" in c else "") + "."]
        if notes.get("ORT fusions"):
            lines += ["", "ORT's optimiser fused: " + ", ".join(f"{k} {v}" for k, v in notes["ORT fusions"].items()) + "."]
        if notes.get("missing"):
            lines += ["", "Left out: " + "; ".join(f"{k}: {v}" for k, v in notes["missing"].items()) + "."]
        lines.append("")
    e2e = result.get("end_to_end")
    if isinstance(e2e, dict):
        lines += ["## End to end: a corpus to sentence vectors", "",
                  f"all-MiniLM-L6-v2, {e2e['texts']} sentences of data/sentences to unit vectors (mean-pooled, batch "
                  "32), texts per second (best of 3): " + ", ".join(
                      f"{k} **{v}** (largest difference from ours {e2e['largest_difference'][k]:.1e})"
                      for k, v in e2e["texts_per_second"].items())
                  + f"; ours / the strongest ORT pipeline ({e2e.get('strongest_ort', 'ORT + Rust tokenizer')}) "
                  f"**{e2e['over_ort']:.2f}x** (issue 72's goal >= 1.1)"
                  + (f"; our int8 **{e2e['int8_over_ort']:.2f}x** at sentence-vector cosine {e2e['int8_cosine_min']:.4f} "
                     "to our fp32 (goal >= 1.5 at >= 0.99)" if "int8_over_ort" in e2e else "")
                  + ". fastembed is not in it: it downloads its models from the hub, which these machines cannot reach."
                  + "".join(f" Not run: {k} ({v})." for k, v in e2e.get("not_run", {}).items()), ""]
    elif e2e:
        lines += ["## End to end", "", f"Not measured: {e2e}.", ""]
    return "\n".join(lines)


def models(dry: bool, work: Path) -> list[tuple[str, Path]]:
    from conftest import hf_config, random_hf_model

    if dry:
        folder = work / "tiny"
        random_hf_model(hf_config(**TINY), seed=0).save_pretrained(folder)
        return [("a tiny random BERT (2 x 64)", folder)]
    spec = importlib.util.spec_from_file_location("fetch_minilm", ROOT / "weights" / "fetch_minilm.py")
    fetch = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fetch)
    base = work / "base"
    random_hf_model(hf_config(**BASE), seed=0).save_pretrained(base)
    return [("all-MiniLM-L6-v2 (real weights, 6 x 384)", Path(fetch.fetch())),
            ("BERT-base geometry (random weights, 12 x 768)", base)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--name", default="cpu_peers", help="results file name (benchmarks/results/NAME.md and .json)")
    p.add_argument("--rounds", type=int, default=None, help="alternating rounds (default 15; --dry 2)")
    p.add_argument("--threads", type=int, default=2, help="threads of every runner (default 2)")
    p.add_argument("--dry", action="store_true", help="a tiny random model, 2 rounds: every step, no figure")
    p.add_argument("--gap", type=float, default=None,
                   help=f"seconds of sleep before each runner's turn, so the one before has let go of the cores "
                        f"(default {GAP}; --dry 0.005; 0 times them back to back, sharing the cores)")
    p.add_argument("--no-compile", action="store_true",
                   help="leave out the fast path's compiled forward (a dry run always does: compiling takes a minute)")
    p.add_argument("--no-ort-spinning", action="store_true",
                   help="ORT's idle threads sleep at once (its default is to spin a while)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"), help="folder of the results files")
    p.add_argument("--corpus", type=int, default=2000, help="texts of data/sentences encoded end to end (default 2000)")
    p.add_argument("--end-to-end-only", action="store_true",
                   help="measure only the corpus encode and add it to the results files of --name")
    p.add_argument("--ct2-only", type=Path, default=None, help=argparse.SUPPRESS)  # the child of measure_ct2
    p.add_argument("--ct2-json", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.threads < 1 or (args.rounds is not None and args.rounds < 1):
        p.error(f"--threads={args.threads} and --rounds={args.rounds} must be at least 1")
    if args.gap is not None and not 0 <= args.gap <= 10:
        p.error(f"--gap={args.gap}: seconds in [0, 10]")
    args.gap = args.gap if args.gap is not None else 0.005 if args.dry else GAP
    torch.set_num_threads(args.threads)
    rounds = args.rounds or (2 if args.dry else 15)
    if args.ct2_only is not None:
        return ct2_only(args.ct2_only, args.ct2_json, args.dry, rounds, args.threads, args.gap)
    if args.end_to_end_only:
        result = json.loads((Path(args.out) / f"{args.name}.json").read_text())
        with tempfile.TemporaryDirectory(prefix="bench_cpu_peers_") as tmp:
            result["end_to_end"] = corpus_row(Path(tmp), args)
        write_results(Path(args.out), args.name, result, page(result))
        print(f"added the end-to-end measure to {Path(args.out) / args.name}.md")
        return 0
    start = time.time()
    result = {"machine": machine(args.threads), "rounds": rounds, "dry": args.dry, "models": [],
              "ort_spinning": not args.no_ort_spinning, "gap_s": args.gap,
              "command": "python benchmarks/bench_cpu_peers.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    with tempfile.TemporaryDirectory(prefix="bench_cpu_peers_") as tmp:
        work = Path(tmp)
        for name, folder in models(args.dry, work):
            from minibert import BertConfig

            config = BertConfig.from_json_file(folder / "config.json")
            where = work / name.split()[0]
            where.mkdir()
            runners, notes = build_runners(folder, config, args.threads, where, spinning=not args.no_ort_spinning,
                                           compile=not args.dry and not args.no_compile)
            print(f"{name}: {', '.join(runners)}" + (f" (left out: {notes['missing']})" if notes["missing"] else ""))
            rows = measure(runners, DRY_BATCHES if args.dry else BATCHES, rounds, args.gap)
            del runners
            merge_ct2(rows, measure_ct2(folder, where, args, rounds), notes)
            result["models"].append({"name": name, "rows": rows, "notes": notes})
        if not args.dry:  # the per-batch figures on disk before the corpus (a long run stopped there keeps them)
            result["seconds"] = time.time() - start
            write_results(Path(args.out), args.name, result, page(result))
        result["end_to_end"] = corpus_row(work, args)
    result["seconds"] = time.time() - start
    name = args.name + ("_dry" if args.dry and args.name == "cpu_peers" else "")
    write_results(Path(args.out), name, result, page(result))
    print(f"wrote {Path(args.out) / name}.md and .json ({result['seconds']:.0f} s)")
    return 0


def write_results(out: Path, name: str, result: dict, text: str) -> None:
    """``out/NAME.json`` (the result) and ``out/NAME.md`` (its page); ``out`` made if missing."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / f"{name}.md").write_text(text + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
