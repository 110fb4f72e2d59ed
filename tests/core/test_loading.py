"""Loading and saving: sources (directory, file, hub id through an offline cache), strictness, pickles,
save_pretrained round trip through transformers, dtypes and load memory; damaged files are a CheckpointError
(one line from the CLI) naming the file; half precision on a CPU without it warns once."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import ROOT, cli_error, hf_config, load_script, random_batch_for, random_hf_model, transformers
from minibert import BertConfig, BertModel, CheckpointError, InputError

TINY = dict(vocab_size=300, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=64)


@pytest.fixture
def tiny_dir(tmp_path):
    directory = tmp_path / "tiny"
    random_hf_model(hf_config(**TINY), seed=7).save_pretrained(directory)
    return directory


def outputs_equal(a: BertModel, b: BertModel, batch) -> bool:
    with torch.no_grad():
        x, y = a(**batch), b(**batch)
    return all(torch.equal(p, q) for p, q in zip(x.hidden_states, y.hidden_states, strict=True))


# ---------------------------------------------------------------------------------------- sources
def test_directory_and_file_sources_load_the_same(tiny_dir):
    batch = random_batch_for(TINY)
    assert outputs_equal(BertModel.from_pretrained(tiny_dir), BertModel.from_pretrained(tiny_dir / "model.safetensors"), batch)
    assert outputs_equal(BertModel.from_pretrained(str(tiny_dir)), BertModel.from_pretrained(tiny_dir), batch)


def make_hub_cache(cache: Path, repo_id: str, files: dict[str, Path], commit: str = "a" * 40) -> str:
    """Lay out files as huggingface_hub's cache does: blobs/, refs/main, snapshots/<commit>/ (links)."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    (repo / "blobs").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for i, (name, source) in enumerate(files.items()):
        blob = repo / "blobs" / f"{i:040x}"
        shutil.copy(source, blob)
        os.symlink(os.path.relpath(blob, snapshot), snapshot / name)
    return commit


def run_offline(cache: Path, code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True,
                          text=True, timeout=300)


def test_hub_id_alias_revision_and_shards_from_offline_cache(tmp_path, tiny_dir, large_legacy_dirs):
    cache = tmp_path / "hub"
    commit = make_hub_cache(cache, "google-bert/bert-base-uncased",
                            {n: tiny_dir / n for n in ("config.json", "model.safetensors")})
    sharded = large_legacy_dirs["sharded"]
    make_hub_cache(cache, "someone/sharded-bert", {p.name: p for p in sharded.iterdir()}, commit="b" * 40)
    result = run_offline(cache, f"""
        import torch
        from minibert import BertModel
        a = BertModel.from_pretrained("bert-base-uncased")             # alias
        b = BertModel.from_pretrained("google-bert/bert-base-uncased", revision="{commit}")
        c = BertModel.from_pretrained("someone/sharded-bert")           # sharded, legacy names
        ids = torch.tensor([[1, 5, 9, 2]])
        assert torch.equal(a(ids).last_hidden_state, b(ids).last_hidden_state)
        print(a.config.hidden_size, c.config.hidden_size, len(c.skipped_tensors))
        try:
            BertModel.from_pretrained("google-bert/bert-large-cased")   # not in the cache
        except FileNotFoundError as e:
            print("MISSING:", e)
    """)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("32 1024 ")
    assert lines[1].startswith("MISSING:") and "HF_HUB_OFFLINE=1" in lines[1] and "bert-large-cased" in lines[1]


def test_revision_with_local_path_is_refused(tiny_dir):
    with pytest.raises(ValueError, match="revision"):
        BertModel.from_pretrained(tiny_dir, revision="main")


def test_nonexistent_path_is_reported(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found: no file or folder .*cannot be a hub repo id"):
        BertModel.from_pretrained(str(tmp_path / "no" / "such" / "dir"))


# ------------------------------------------------------------------------------------ strictness
def edit_checkpoint(src: Path, dst: Path, *, drop=(), reshape=(), add=None, config=None) -> Path:
    dst.mkdir()
    state = load_file(src / "model.safetensors")
    for name in drop:
        del state[name]
    for name in reshape:
        state[name] = state[name][:-1].clone()
    state.update(add or {})
    save_file(state, dst / "model.safetensors")
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(config or {})
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_missing_tensor_is_named(tiny_dir, tmp_path):
    bad = edit_checkpoint(tiny_dir, tmp_path / "bad", drop=["encoder.layer.1.attention.self.key.bias"])
    with pytest.raises(CheckpointError, match=r"1 missing tensor.*encoder\.layer\.1\.attention\.self\.key\.bias"):
        BertModel.from_pretrained(bad)


def test_wrong_shape_is_named_with_both_shapes(tiny_dir, tmp_path):
    bad = edit_checkpoint(tiny_dir, tmp_path / "bad", reshape=["encoder.layer.2.intermediate.dense.weight"])
    with pytest.raises(CheckpointError, match=r"intermediate\.dense\.weight: checkpoint \(63, 32\), config \(64, 32\)"):
        BertModel.from_pretrained(bad)


def test_config_deeper_than_checkpoint(tiny_dir, tmp_path):
    bad = edit_checkpoint(tiny_dir, tmp_path / "bad", config={"num_hidden_layers": 5})
    with pytest.raises(CheckpointError, match=r"num_hidden_layers=5, the checkpoint has 3 blocks.*encoder\.layer\.3\."):
        BertModel.from_pretrained(bad)


def test_checkpoint_deeper_than_config_is_refused(tiny_dir, tmp_path):
    bad = edit_checkpoint(tiny_dir, tmp_path / "bad", config={"num_hidden_layers": 2})
    with pytest.raises(CheckpointError, match=r"unexpected tensor.*encoder\.layer\.2\."):
        BertModel.from_pretrained(bad)


def test_vocab_mismatch_is_refused(tiny_dir, tmp_path):
    bad = edit_checkpoint(tiny_dir, tmp_path / "bad", config={"vocab_size": 301})
    with pytest.raises(CheckpointError, match=r"word_embeddings\.weight: checkpoint \(300, 32\), config \(301, 32\)"):
        BertModel.from_pretrained(bad)


def test_task_heads_are_skipped_and_reported(tiny_dir, tmp_path):
    extra = {"classifier.weight": torch.zeros(2, 32), "classifier.bias": torch.zeros(2)}
    model = BertModel.from_pretrained(edit_checkpoint(tiny_dir, tmp_path / "clf", add=extra))
    assert model.skipped_tensors == ["classifier.bias", "classifier.weight"]


def test_checkpoint_without_pooler_gives_none(tiny_dir, tmp_path):
    directory = edit_checkpoint(tiny_dir, tmp_path / "nopool", drop=["pooler.dense.weight", "pooler.dense.bias"])
    model = BertModel.from_pretrained(directory)
    assert model.pooler is None
    out = model(torch.tensor([[1, 2, 3]]))
    assert out.pooler_output is None and len(out.hidden_states) == TINY["num_hidden_layers"] + 1


def test_pickle_is_refused_and_converter_works(tiny_dir, tmp_path):
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    shutil.copy(tiny_dir / "config.json", pickled)
    state = load_file(tiny_dir / "model.safetensors")
    torch.save(state, pickled / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=r"pytorch_model\.bin.*weights/convert_to_safetensors\.py"):
        BertModel.from_pretrained(pickled)
    with pytest.raises(CheckpointError, match="does not unpickle"):
        BertModel.from_pretrained(pickled / "pytorch_model.bin")
    load_script("convert_to_safetensors").convert(pickled, tmp_path / "converted")
    assert outputs_equal(BertModel.from_pretrained(tmp_path / "converted"), BertModel.from_pretrained(tiny_dir),
                         random_batch_for(TINY))


def test_missing_config_is_reported(tiny_dir, tmp_path):
    (tmp_path / "w").mkdir()
    shutil.copy(tiny_dir / "model.safetensors", tmp_path / "w")
    with pytest.raises(CheckpointError, match="no config.json"):
        BertModel.from_pretrained(tmp_path / "w")


def test_weights_are_copy_on_write_not_shared_with_the_file(tiny_dir):
    """Loading maps the file without copying; editing a parameter must never write through to it."""
    before = (tiny_dir / "model.safetensors").read_bytes()
    model = BertModel.from_pretrained(tiny_dir)
    with torch.no_grad():
        model.embeddings.word.weight.add_(1.0)
    assert (tiny_dir / "model.safetensors").read_bytes() == before


# ------------------------------------------------------------------------------------------ saving
def test_save_pretrained_round_trip_through_transformers(minilm_dir, tmp_path):
    ours = BertModel.from_pretrained(minilm_dir)
    ours.save_pretrained(tmp_path / "saved")
    reference, info = transformers.BertModel.from_pretrained(str(tmp_path / "saved"), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info.get("mismatched_keys")
    batch = {"input_ids": torch.tensor([[101, 7592, 1010, 2088, 999, 102]])}
    with torch.no_grad():
        a = ours(**batch)
        b = reference.eval()(**batch, output_hidden_states=True)
    assert (a.last_hidden_state - b.last_hidden_state).abs().max() <= 1e-5
    assert (a.pooler_output - b.pooler_output).abs().max() <= 1e-5
    again = BertModel.from_pretrained(tmp_path / "saved")
    assert outputs_equal(ours, again, batch)
    assert BertConfig.from_json_file(tmp_path / "saved" / "config.json") == ours.config


def test_trained_then_saved_model_reloads(tiny_dir, tmp_path):
    model = BertModel.from_pretrained(tiny_dir)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = model(torch.tensor([[1, 2, 3, 4]]))
    out.last_hidden_state.pow(2).mean().backward()
    opt.step()
    model.eval()
    model.save_pretrained(tmp_path / "trained")
    assert outputs_equal(model, BertModel.from_pretrained(tmp_path / "trained"), random_batch_for(TINY))
    assert not outputs_equal(model, BertModel.from_pretrained(tiny_dir), random_batch_for(TINY))


# ------------------------------------------------------------------------------------------- dtypes
def test_half_precision_error_is_bounded_by_transformers_own(minilm_dir, hf_tokenizer):
    """bf16 and fp16 weights: our error vs transformers fp32 must be no worse than 2x transformers'
    own half-precision error vs its fp32 (measured here, on the same inputs)."""
    from conftest import PAIRS

    batch = dict(hf_tokenizer([p[0] for p in PAIRS], [p[1] for p in PAIRS], padding=True, return_tensors="pt"))
    valid = batch["attention_mask"].bool()
    with torch.no_grad():
        ref32 = transformers.BertModel.from_pretrained(str(minilm_dir)).eval()(**batch).last_hidden_state
        for dtype in (torch.bfloat16, torch.float16):
            ours = BertModel.from_pretrained(minilm_dir, dtype=dtype)
            assert ours.dtype == dtype
            ref = transformers.BertModel.from_pretrained(str(minilm_dir), dtype=dtype).eval()
            our_err = (ours(**batch).last_hidden_state.float() - ref32)[valid].abs().max().item()
            ref_err = (ref(**batch).last_hidden_state.float() - ref32)[valid].abs().max().item()
            print(f"{dtype}: ours {our_err:.3e}, transformers {ref_err:.3e}")
            assert our_err <= 2 * ref_err, (dtype, our_err, ref_err)


def test_dtype_by_name_and_unknown_dtype(tiny_dir):
    assert BertModel.from_pretrained(tiny_dir, dtype="bf16").dtype == torch.bfloat16
    with pytest.raises(ValueError, match="dtype 'int4' is not supported.*'int8'"):
        BertModel.from_pretrained(tiny_dir, dtype="int4")  # int8 is a dtype since issue 16 (tests/core/test_quantize.py)


def test_load_peak_memory_bert_base(base_random_dir, tiny_dir):
    """Loading must not hold two copies of the weights: the process's peak memory (VmHWM) may grow by
    at most 1.2x the file size, and anonymous memory (where a copy would live) by at most 0.2x.
    A first load of a tiny checkpoint warms torch's one-time lazy set-up (about 75 MiB on first use
    of the meta device, whatever the model size). The peak is compared with the peak before loading,
    not the current RSS, because library pages evicted under memory pressure come back on use."""
    code = f"""
        import torch, minibert
        def status():
            return {{l.split(':')[0]: int(l.split()[1]) / 1024 for l in open('/proc/self/status')
                    if l.startswith(('VmHWM', 'VmRSS', 'RssAnon'))}}
        minibert.BertModel.from_pretrained({str(tiny_dir)!r})  # warm-up, then dropped
        before = status()
        model = minibert.BertModel.from_pretrained({str(base_random_dir)!r})
        with torch.no_grad():
            for p in model.parameters():
                p.sum()  # touch every weight page
        after = status()
        print(after['VmHWM'] - before['VmHWM'], after['RssAnon'] - before['RssAnon'])
    """
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=300)
    assert result.returncode == 0, result.stderr
    peak_growth, anon_growth = map(float, result.stdout.split())
    size = (base_random_dir / "model.safetensors").stat().st_size / 2**20
    print(f"file {size:.0f} MiB: peak growth {peak_growth:.0f} MiB = {peak_growth / size:.3f}x, "
          f"anonymous growth {anon_growth:.0f} MiB = {anon_growth / size:.3f}x")
    assert peak_growth <= 1.2 * size
    assert anon_growth <= 0.2 * size


# ------------------------------------------------------------------------ damaged files, precision warnings
def copy_checkpoint(src: Path, dst: Path, weights: bytes | None = None) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".whl":
            shutil.copy(f, dst / f.name)
    if weights is not None:
        (dst / "model.safetensors").write_bytes(weights)
    return dst


@pytest.mark.parametrize("damage", ["empty", "7 bytes", "header cut", "half", "last byte", "garbled header",
                                    "huge header length", "plain text"])
def test_truncated_or_corrupt_safetensors_is_a_checkpoint_error_naming_the_file(minilm_dir, tmp_path, capsys,
                                                                                   damage):
    data = (minilm_dir / "model.safetensors").read_bytes()
    broken = {
        "empty": b"",
        "7 bytes": data[:7],
        "header cut": data[:500],
        "half": data[: len(data) // 2],
        "last byte": data[:-1],
        "garbled header": data[:8] + b"{not json" + data[17:],
        "huge header length": (10**12).to_bytes(8, "little") + data[8:],
        "plain text": b"this is not a checkpoint\n" * 20,
    }[damage]
    directory = copy_checkpoint(minilm_dir, tmp_path / "broken", broken)
    with pytest.raises(CheckpointError, match="truncated or corrupt") as info:
        BertModel.from_pretrained(directory)
    assert str(directory / "model.safetensors") in str(info.value)
    line = cli_error(capsys, "encode", "hello", "--model", str(directory))
    assert "model.safetensors is truncated or corrupt" in line


@pytest.mark.parametrize("name,content", [("config.json", b"{\"hidden_size\": 3"), ("config.json", b"\xff\xfe\x00"),
                                          ("config.json", b"[1, 2]")])
def test_corrupt_config_is_one_line_naming_the_file(minilm_dir, tmp_path, capsys, name, content):
    directory = copy_checkpoint(minilm_dir, tmp_path / "broken")
    (directory / name).write_bytes(content)
    with pytest.raises(InputError, match="config.json"):
        BertModel.from_pretrained(directory)
    assert "config.json" in cli_error(capsys, "encode", "hello", "--model", str(directory))


def test_corrupt_shard_index_is_a_checkpoint_error(minilm_dir, tmp_path):
    directory = copy_checkpoint(minilm_dir, tmp_path / "sharded")
    (directory / "model.safetensors").unlink()
    (directory / "model.safetensors.index.json").write_text('{"weight_map": [1, 2]}')
    with pytest.raises(CheckpointError, match="weight_map"):
        BertModel.from_pretrained(directory)


def test_half_precision_on_a_cpu_without_it_warns_once(minilm_dir, monkeypatch):
    from minibert import hardware

    monkeypatch.setattr(hardware, "_warned", set())
    monkeypatch.setattr(hardware, "cpu_info", lambda: ("Some CPU", frozenset({"avx2", "avx512f"})))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        BertModel.from_pretrained(minilm_dir, dtype="bf16")
        BertModel.from_pretrained(minilm_dir, dtype="bf16")
        BertModel.from_pretrained(minilm_dir, dtype="fp16")
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 2, messages
    assert "bf16 on this CPU (Some CPU)" in messages[0] and "avx512_bf16 or amx_bf16" in messages[0]
    assert "fp16" in messages[1]
    monkeypatch.setattr(hardware, "_warned", set())
    monkeypatch.setattr(hardware, "cpu_info", lambda: ("Xeon", frozenset({"avx512f", "avx512_bf16", "amx_bf16"})))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        BertModel.from_pretrained(minilm_dir, dtype="bf16")
    assert not [w for w in caught if issubclass(w.category, RuntimeWarning)]
