"""The benchmark harness must compare like with like: its padded batches have the stated share of real
tokens, and its torch nn.TransformerEncoder peer computes the same function as minibert."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from conftest import ROOT, random_batch_for
from minibert import BertConfig, BertModel


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_model", ROOT / "benchmarks" / "bench_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("B,T,fraction", [(16, 128, 0.38), (32, 128, 0.5), (8, 512, 0.4), (4, 16, 1.0)])
def test_padded_batches_have_the_stated_real_fraction(bench, B, T, fraction):
    lengths = bench.lengths_for(B, T, fraction)
    assert len(lengths) == B and max(lengths) == T and min(lengths) >= min(T, round(0.1 * T))
    assert abs(sum(lengths) / (B * T) - fraction) <= 1 / (B * T)
    batch = bench.make_batch(B, T, fraction, vocab=30522)
    assert batch["attention_mask"].sum(1).tolist() == lengths


def test_torch_encoder_peer_computes_the_same_function(bench):
    config = BertConfig(vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=128)
    torch.manual_seed(0)
    model = BertModel(config).eval()
    encoder = bench.torch_encoder_from(model)
    batch = random_batch_for(dict(vocab_size=300), lengths=(9, 4, 6))
    with torch.inference_mode():
        ours = model(**batch).last_hidden_state
        x = model.embeddings(batch["input_ids"], torch.zeros_like(batch["input_ids"]),
                             torch.arange(9).expand(3, 9))
        theirs = encoder(x, src_key_padding_mask=~batch["attention_mask"].bool())
    valid = batch["attention_mask"].bool()
    assert (ours - theirs)[valid].abs().max() <= 1e-5


def test_the_gpu_bench_runs_end_to_end_in_its_dry_mode(tmp_path, minilm_dir, sentences_dir, capsys):
    """benchmarks/bench_gpu.py --prepare KIT, then --from KIT --dry: what a lent GPU machine runs, every step
    but the CUDA tests, on this CPU with a tiny model. The kit is everything the run reads, under the 64 MiB
    a lent machine receives; a piece missing from it is one line and that step skipped, never the hub."""
    import json
    import subprocess
    import sys

    bench = ROOT / "benchmarks" / "bench_gpu.py"
    kit = tmp_path / "kit"
    r = subprocess.run([sys.executable, str(bench), "--prepare", str(kit)], capture_output=True, text=True,
                       timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    manifest = json.loads((kit / "manifest.json").read_text())
    on_disk = sum(p.stat().st_size for p in kit.rglob("*") if p.is_file())
    assert on_disk < 64 * 2**20 and manifest["bytes"] < 60 * 2**20 and "minilm/model.safetensors" in manifest["files"]
    assert {"minilm/1_Pooling/config.json", "minilm/modules.json", "texts.txt", "bert-base/config.json"} <= set(manifest["files"])
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, str(bench), "--from", str(kit), "--dry", "--out", str(out)],
                       capture_output=True, text=True, timeout=300, cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads((out / "gpu_dry.json").read_text())
    assert len(result["batches"]) == 5 and all(set(b["ratio"]) >= {"readable", "fast", "fast, all states"}
                                               for b in result["batches"])
    assert result["routes"]["fp32"]["attention"] == "loop" and result["skipped"] == [] and result["lacking"] == {}
    assert [row["texts"] for row in result["embed"]] == [64] and result["embed"][0]["max_difference"] < 1e-5
    text = (out / "gpu_dry.md").read_text()
    assert "a dry run: a tiny model on a CPU, no GPU figure" in text and "torch " in text
    assert "step      outcome" in r.stdout and "embed     fp32" in r.stdout
    spec = importlib.util.spec_from_file_location("bench_gpu", bench)  # the checks below: in this process
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    (kit / "minilm" / "model.safetensors").unlink()  # a piece missing: said, that step skipped
    lacking = module.check_kit(kit, ["embed", "batches", "report"])
    assert list(lacking) == ["embed"] and "minilm/model.safetensors is missing" in lacking["embed"]
    assert set(module.check_kit(tmp_path / "nothing", ["test", "embed"])) == {"test", "embed"}
    with pytest.raises(SystemExit) as refused:
        module.main(["--steps", "nope", "--dry"])
    assert refused.value.code == 2 and "unknown ['nope']" in capsys.readouterr().err


def test_the_cpu_peers_bench_runs_end_to_end_in_its_dry_mode(tmp_path, minilm_dir, sentences_dir):
    """benchmarks/bench_cpu_peers.py --dry: every runner installed here (transformers, minibert fp32 and
    int8; ONNX Runtime fp32 and int8, OpenVINO, CTranslate2 where installed) on a tiny random model, timed
    and checked against transformers; a page naming the machine, the threads and the versions."""
    import importlib.util as util
    import json
    import subprocess
    import sys

    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_cpu_peers.py"), "--dry", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads((tmp_path / "cpu_peers_dry.json").read_text())
    (model,) = result["models"]
    expected = {"transformers sdpa", "transformers eager", "minibert fast", "minibert int8"}
    installed = {"onnxruntime": {"ORT fp32", "ORT int8"}, "openvino": {"OpenVINO fp32"},
                 "ctranslate2": {"CT2 fp32", "CT2 int8"}}
    for package, names in installed.items():
        if util.find_spec(package) is not None and util.find_spec("onnx") is not None:
            expected |= names
    for row in model["rows"]:
        assert set(row["runners"]) == expected, (set(row["runners"]), expected)
        for name, cell in row["runners"].items():
            assert cell["ms"] > 0 and cell["ratio"] > 0
            # fp32 runtimes agree with transformers to fp32 noise; int8 ones by their sentence vectors
            assert cell["largest_difference"] < (0.5 if "int8" in name else 1e-4), (name, cell)
            assert cell["cosine_min"] > (0.98 if "int8" in name else 0.99999), (name, cell)
        assert ("fast_over_ort" in row) == ("ORT fp32" in expected)
    e2e = result["end_to_end"]  # 64 sentences through minibert (fp32, int8), ORT's pipelines, sentence-transformers
    ran = set(e2e["texts_per_second"])
    assert e2e["texts"] == 64 and ran - {"sentence-transformers onnx"} == {
        "minibert", "minibert int8", "ORT + Rust tokenizer", "ORT length-sorted + Rust tokenizer", "sentence-transformers"}
    assert ("sentence-transformers onnx" in ran) != ("sentence-transformers onnx" in e2e["not_run"])  # run, or why not
    assert max(v for k, v in e2e["largest_difference"].items() if k != "minibert int8") < 1e-5
    assert 0.95 < e2e["int8_cosine_min"] <= 1.0 and e2e["strongest_ort"] in ran
    text = (tmp_path / "cpu_peers_dry.md").read_text()
    assert "A dry run" in text and "texts per second" in text and "2 threads for every runner" in text and "torch " in text
    assert result["machine"]["cpu"] in text


def test_the_runtime_parity_bench_runs_end_to_end_in_its_dry_mode(tmp_path, minilm_dir):
    """benchmarks/bench_runtime_parity.py --dry: every deployed form made here (ORT as exported, optimised,
    int8; OpenVINO from the graph and from IRs with and without fp16 weights; CTranslate2 fp32 and int8) on a
    tiny random model, each judged; a page naming the machine and the versions."""
    import importlib.util as util
    import json
    import subprocess
    import sys

    pytest.importorskip("onnxruntime")
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_runtime_parity.py"), "--dry", "--out",
                        str(tmp_path)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    (model,) = json.loads((tmp_path / "runtime_parity_dry.json").read_text())["models"]
    reports = model["reports"]
    assert {"ORT, as exported", "ORT, optimised", "ORT int8 (dynamic)"} <= set(reports)
    for label, report in reports.items():
        if "save_model default" in label:  # fp16 weights: found at the embeddings, and said
            assert not report["ok"] and report["first_divergent"] == "embeddings" and "fp16" in report["b"]
        elif report["dtype"] == "fp32":
            assert report["ok"] and max(row["hidden_max"] for row in report["rows"]) < 1e-5, label
    assert ("CTranslate2 fp32" in reports) == (util.find_spec("ctranslate2") is not None)
    assert ("OpenVINO f32 (the ONNX graph)" in reports) == (util.find_spec("openvino") is not None)
    text = (tmp_path / "runtime_parity_dry.md").read_text()
    assert "dry run" in text and "onnxruntime " in text and "| block 1 |" in text
