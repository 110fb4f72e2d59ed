"""--device and --dtype on every inference command (issue 47): the same checks and one-line errors as
training's --device, before any work, nothing written; ``device=`` on ``encode_texts``. CI has no GPU:
the GPU runs themselves are in tests/tools/test_fast_cuda.py (skipped without CUDA)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import POS_SAMPLE, cli_error, cli_in_process, usage_error
from minibert import BertModel, BertTokenizer
from minibert.errors import InputError
from minibert.tools.encode import encode_texts

NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="the errors of a machine without CUDA")


def commands(tmp_path, minilm_dir):
    """Each inference command with arguments that would run, and the files it would write."""
    texts = tmp_path / "texts.txt"
    texts.write_text("the bank raised its rates\na river bank\n", encoding="utf-8")
    table = tmp_path / "t.csv"
    table.write_text("text,label\na b,x\nc d,y\ne f,x\n", encoding="utf-8")
    m = ["--model", minilm_dir]
    return {
        "encode": (["encode", "hello", *m], []),
        "embed": (["embed", texts, "--out", tmp_path / "v.npy", *m], [tmp_path / "v.npy"]),
        "search": (["search", texts, "bank", "--index", tmp_path / "i.npy", *m], [tmp_path / "i.npy"]),
        "predict": (["predict", minilm_dir, texts], []),
        "layers": (["layers", "hello", "--plot", tmp_path / "l.png", *m], [tmp_path / "l.png"]),
        "probe": (["probe", POS_SAMPLE, "--plot", tmp_path / "p.png", *m], [tmp_path / "p.png"]),
        "fill": (["fill", "a [MASK]", *m], []),
        "map": (["map", table, "--out", tmp_path / "m.png", *m], [tmp_path / "m.png"]),
    }


COMMANDS = ["encode", "embed", "search", "predict", "layers", "probe", "fill", "map"]


@NO_CUDA
@pytest.mark.parametrize("command", COMMANDS)
def test_every_inference_command_checks_its_device_before_any_work(command, tmp_path, minilm_dir, capsys):
    args, writes = commands(tmp_path, minilm_dir)[command]
    line = cli_error(capsys, *args, "--device", "cuda")
    assert line == ("minibert: error: --device 'cuda': PyTorch sees no CUDA device on this machine (torch "
                    f"{torch.__version__}, torch.cuda.is_available() is False): use --device cpu")
    line = cli_error(capsys, *args, "--device", "gpu0")
    assert line == "minibert: error: --device 'gpu0' is not a device: use cpu, cuda or cuda:N"
    line = cli_error(capsys, *args, "--device", "meta")
    assert line == "minibert: error: --device 'meta': minibert runs on cpu or cuda"
    line = cli_error(capsys, *args, "--device", "cuda:1", "--dtype", "int8")
    assert "int8 dynamic quantisation runs on the CPU only" in line and "--device 'cuda:1'" in line
    assert "invalid choice: 'fp64'" in usage_error(capsys, *args, "--dtype", "fp64")
    assert not any(p.exists() for p in writes)  # nothing written on an error


def test_an_index_past_the_gpus_is_refused(monkeypatch, tmp_path, minilm_dir, capsys):
    """As training's --device: a machine with 2 GPUs (stood in for) has cuda:0 and cuda:1."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    args, writes = commands(tmp_path, minilm_dir)["embed"]
    line = cli_error(capsys, *args, "--device", "cuda:2")
    assert line == "minibert: error: --device 'cuda:2': this machine has 2 CUDA device(s), cuda:0..cuda:1"
    assert not any(p.exists() for p in writes)


def test_device_cpu_and_a_dtype_run(tmp_path, minilm_dir, capsys):
    args, _ = commands(tmp_path, minilm_dir)["embed"]
    r = cli_in_process(capsys, *args, "--device", "cpu", "--quiet")
    assert r.returncode == 0, r.stderr
    fp32 = np.load(tmp_path / "v.npy")
    r = cli_in_process(capsys, *args, "--device", "cpu", "--dtype", "int8", "--quiet")
    assert r.returncode == 0, r.stderr
    int8 = np.load(tmp_path / "v.npy")
    cosine = (fp32 * int8).sum(1) / np.linalg.norm(fp32, axis=1) / np.linalg.norm(int8, axis=1)
    assert fp32.shape == int8.shape and cosine.min() > 0.98 and not np.array_equal(fp32, int8)
    r = cli_in_process(capsys, "encode", "hello", "--model", minilm_dir, "--device", "cpu", "--dtype", "bf16", "--format", "json")
    assert r.returncode == 0, r.stderr


def test_encode_texts_takes_a_device_and_never_moves_the_model(minilm_dir):
    model = BertModel.from_pretrained(minilm_dir).eval()
    tok = BertTokenizer.from_pretrained(minilm_dir)
    texts = ["a river bank", "the bank raised its rates", "money"]
    here = encode_texts(model, tok, texts)
    assert torch.equal(encode_texts(model, tok, texts, device="cpu"), here)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"device 'cuda': PyTorch sees no CUDA device"):
            encode_texts(model, tok, texts, device="cuda")
    assert model.device.type == "cpu"


def test_the_overlapped_pipeline_gives_the_same_vectors_in_the_same_order(minilm_dir, sentences_dir):
    """What runs on a GPU by default -- a background thread tokenising slabs of texts ordered by characters
    while the model runs, token-budget batches -- forced here on the CPU: same order, same vectors (within
    fp32 rounding: the batches differ), and a tokeniser error surfaces at once."""
    from minibert.tools import encode as encode_module

    model = BertModel.from_pretrained(minilm_dir).eval()
    tok = BertTokenizer.from_pretrained(minilm_dir)
    texts = (sentences_dir / "held.txt").read_text(encoding="utf-8").split("\n")[:150]
    texts = [t for t in texts if t.strip()] + ["", "x " * 400]  # an empty text, one past the limit
    plain = encode_texts(model, tok, texts, pooling="mean", normalize=True)
    several_plain = encode_texts(model, tok, texts, layer=[0, -1], batch_size=7)

    class Broken:
        pad_token_id = tok.pad_token_id

        def __call__(self, chunk, **options):
            raise RuntimeError("tokeniser broke")

    old = encode_module.SLAB, encode_module.OVERLAP_DEVICES
    encode_module.SLAB = 16  # many slabs, so batches come from the thread while others run
    encode_module.OVERLAP_DEVICES = ("cpu", "cuda")
    try:
        streamed = encode_texts(model, tok, texts, pooling="mean", normalize=True, max_tokens=600)
        several = encode_texts(model, tok, texts, layer=[0, -1], batch_size=7)
        with pytest.raises(RuntimeError, match="tokeniser broke"):
            encode_texts(model, Broken(), texts)
    finally:
        encode_module.SLAB, encode_module.OVERLAP_DEVICES = old
    assert streamed.shape == plain.shape and (streamed - plain).abs().max() <= 1e-5
    assert (several - several_plain).abs().max() <= 1e-5


def test_prefetch_keeps_order_raises_and_stops():
    import threading

    from minibert.tools.batching import prefetch

    assert list(prefetch(iter(range(50)), depth=2)) == list(range(50))

    def failing():
        yield 1
        raise ValueError("at item 2")
    got = []
    with pytest.raises(ValueError, match="at item 2"):
        for x in prefetch(failing()):
            got.append(x)
    assert got == [1]
    made = []

    def endless():
        i = 0
        while True:
            made.append(i)
            yield i
            i += 1
    for x in prefetch(endless(), depth=3):
        if x == 5:
            break  # the thread stops: it does not run on
    n = len(made)
    assert n <= 5 + 1 + 3 + 1 and not any(t.name == "minibert-prefetch" for t in threading.enumerate())


def test_same_device_reads_devices_as_torch_runs_them(monkeypatch):
    """torch.device("cuda") != torch.device("cuda", 0), though a model on cuda:0 runs on "cuda" (the current
    GPU); "cpu:0" is the CPU. An encoder asked for device="cuda" on a model on cuda:0 was refused."""
    from minibert.hardware import same_device

    assert same_device("cpu", torch.device("cpu")) and same_device("cpu:0", "cpu")
    assert not same_device("cpu", "cuda:0") and not same_device("cuda:0", "cuda:1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert same_device("cuda", "cuda:1") and not same_device("cuda", torch.device("cuda", 0))


def test_the_sentence_encoder_takes_the_models_own_device_however_spelt(minilm_dir):
    from minibert.compat import SentenceEncoder

    encoder = SentenceEncoder.from_pretrained(minilm_dir)
    want = encoder.encode(["a river bank"])
    for spelt in ("cpu", "cpu:0", torch.device("cpu", 0)):
        assert np.array_equal(encoder.encode(["a river bank"], device=spelt), want)
    with pytest.raises(InputError, match=r"device='cuda:0': the model is on cpu"):
        encoder.encode(["a river bank"], device="cuda:0")
    with pytest.raises(InputError, match=r"device='gpu' is not a device"):
        encoder.encode(["a river bank"], device="gpu")


def test_measured_choices_written_at_once_all_kept(tmp_path):
    """Several writers adding entries to one cache file at the same time (calibrations in threads, or
    processes): the file holds every entry after (read-modify-write under a lock)."""
    import threading

    from minibert import measured

    path = tmp_path / "choices.json"
    threads = [threading.Thread(target=lambda i=i: [measured.write_json_entry(path, "m", f"k{i}-{j}", {"v": j})
                                                    for j in range(10)]) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert set(measured.read_json(path)["m"]) == {f"k{i}-{j}" for i in range(4) for j in range(10)}
    assert not list(tmp_path.glob(".*.tmp"))


def _measure_in_a_process(path, log):
    import os
    import time

    from minibert import measured

    def measure():
        with open(log, "a") as f:
            f.write(f"start {os.getpid()}\n")
        time.sleep(0.3)  # a calibration: the others must wait, not measure beside it
        return {"route": f"chosen by {os.getpid()}"}
    entry = measured.measure_once(path, "gpu", "bf16 d=32", usable=lambda e: "route" in e, measure=measure)
    with open(log, "a") as f:
        f.write(f"got {entry['route']}\n")


def test_processes_starting_together_measure_once_and_share_the_choice(tmp_path):
    """Ray actors sharing one GPU each asked for the attention route at once and each calibrated under the
    others' load, the contended choice kept for good. measure_once: one process measures, under a lock; the
    others wait, read its entry and do not measure."""
    import multiprocessing

    path, log = tmp_path / "attention.json", tmp_path / "log.txt"
    context = multiprocessing.get_context("fork")
    workers = [context.Process(target=_measure_in_a_process, args=(path, log)) for _ in range(3)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(60)
    lines = log.read_text().splitlines()
    starts = [line for line in lines if line.startswith("start")]
    got = {line for line in lines if line.startswith("got")}
    assert len(starts) == 1 and len(got) == 1 and all(w.exitcode == 0 for w in workers), lines
    assert next(iter(got)).endswith(starts[0].split()[1])  # every process took the one measurement
