"""The fast path's GPU route (issues 47, 63), each test written once against a device: on a GPU where
torch sees one (``benchmarks/bench_gpu.py --from KIT`` runs this module on a lent GPU), and on the CPU with
stand-ins for what only a GPU has -- the varlen kernel by its plain-torch contract
(``varlen.varlen_reference``), CUDA graphs by a graph that recomputes into its captured outputs -- so that
a test whose own arithmetic cannot pass (a count of graphs, a tolerance) fails in CI first, not on the one
lent GPU. What needs a GPU itself (its memory statistics, the CLI with ``--device cuda``) is skipped on the
CPU.

What it holds: on padded batches and sentence pairs the route -- packed real tokens, the attention kernel
chosen for the device and dtype (varlen / nested / padded / loop), scattered once -- equals the readable
path within the fp32 noise floor (TF32 off) and, in half precision, transformers' same-dtype output within
the gap between transformers' own two attention implementations in that dtype; every attention route runs;
hooks and attention maps still go to the readable path; keeping only the last hidden state takes less
GPU memory; CUDA graphs replay the fast path bit for bit, one per shape; the inference commands run with
``--device cuda``.
"""

from __future__ import annotations

import pytest
import torch

from conftest import PAIRS, SENTENCES, cli_in_process, transformers
from minibert import BertModel, BertTokenizer
from minibert.testing import largest_difference as compare
from minibert.tools import fast, graphs, varlen
from minibert.tools.hooks import hooks

HAS_CUDA = torch.cuda.is_available()
DEVICES = [pytest.param("cpu", id="cpu-stand-ins"),
           pytest.param("cuda", id="cuda", marks=pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device "
                                                                       "(runs on a GPU machine)"))]
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device (runs on a GPU machine)")


@pytest.fixture(params=DEVICES)
def device(request, monkeypatch):
    """The device a test runs on; on the CPU the GPU-only kernels are stood in for (varlen: its contract
    in plain torch, runnable in every dtype; CUDA graphs: ``FakeGraph``)."""
    if request.param == "cpu":
        monkeypatch.setattr(varlen, "varlen_kernel", lambda: varlen.varlen_reference)
        real = varlen.runs_here
        monkeypatch.setattr(varlen, "runs_here", lambda route, *a: True if route == "varlen" else real(route, *a))
        monkeypatch.setattr(graphs.GraphCache, "check", staticmethod(lambda model: None))
        monkeypatch.setattr(graphs.GraphCache, "make_graph", staticmethod(FakeGraph))
        monkeypatch.setattr(graphs.GraphCache, "make_pool", staticmethod(object))
        monkeypatch.setattr(graphs.GraphCache, "capture", staticmethod(fake_capture))
    return torch.device(request.param)


class FakeGraph:
    """A CUDA graph's contract: replay recomputes into the very tensors the capture returned."""

    def replay(self):
        fresh = self.fn(*self.inputs)
        for mine, new in zip(_tensors(self.out), _tensors(fresh)):
            mine.copy_(new)


def fake_capture(graph, fn, inputs, pool):
    graph.fn, graph.inputs = fn, inputs
    graph.out = fn(*inputs)
    return graph.out


def _tensors(out):
    return [t for t in (out.last_hidden_state, out.pooler_output, *(out.hidden_states or ())) if t is not None]


def batches(tok, device):
    sentences = dict(tok(SENTENCES, padding=True, return_tensors="pt"))
    pairs = dict(tok([a for a, _ in PAIRS], [b for _, b in PAIRS], padding=True, return_tensors="pt"))
    return [{k: v.to(device) for k, v in b.items()} for b in (sentences, pairs)]


_MODELS: dict = {}


def minilm_on(minilm_dir, device, dtype=torch.float32):
    key = (str(device), dtype)
    if key not in _MODELS:
        _MODELS[key] = BertModel.from_pretrained(minilm_dir, device=device, dtype=dtype).eval()
    return _MODELS[key], BertTokenizer.from_pretrained(minilm_dir)


def noise_floor(model, batch) -> float:
    """The fp32 noise floor on this device: the readable path's fused vs explicit attention, and vs float64."""
    exact = BertModel.from_pretrained(model.source, device=model.device, dtype=torch.float64).eval()
    with torch.inference_mode():
        fused, explicit, truth = model(**batch), model(**batch, output_attentions=True), exact(**batch)
    mask = batch["attention_mask"]
    return max(compare(fused, explicit, mask), compare(fused, truth, mask), 1e-7)


@pytest.mark.parametrize("route", ["auto", "varlen", "nested", "padded", "loop"])
def test_the_gpu_route_matches_the_readable_path_in_fp32(minilm_dir, device, route):
    model, tok = minilm_on(minilm_dir, device)
    if route != "auto" and not varlen.runs_here(route, device, torch.float32, model.config.head_size):
        pytest.skip(f"{route} does not run in fp32 on this GPU")
    for batch in batches(tok, device):
        floor = noise_floor(model, batch)
        with torch.inference_mode():
            slow, quick = model(**batch), fast.prepare(model, attention=route)(**batch)
        assert compare(slow, quick, batch["attention_mask"], pooler=False) <= 4 * floor
        assert torch.all(quick.last_hidden_state[batch["attention_mask"] == 0] == 0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_on_the_gpu_route_matches_transformers(minilm_dir, device, dtype):
    """Against transformers' BertModel in the same dtype: within twice the gap between transformers' own
    eager and SDPA attention on these inputs (the rounding one correct half-precision forward differs by).
    On the CPU in bf16 only (its fp16 is emulated: slow, and not what a GPU computes)."""
    if device.type == "cpu" and dtype == torch.float16:
        pytest.skip("fp16 on a CPU is emulated")
    ours, tok = minilm_on(minilm_dir, device, dtype)
    theirs = {impl: transformers.BertModel.from_pretrained(minilm_dir, attn_implementation=impl, dtype=dtype)
              .to(device).eval() for impl in ("eager", "sdpa")}
    for route in ("auto", "varlen", "nested", "padded"):
        if route != "auto" and not varlen.runs_here(route, device, dtype, ours.config.head_size):
            continue
        for batch in batches(tok, device):
            with torch.inference_mode():
                quick = fast.prepare(ours, attention=route)(**batch)
                ref = {k: m(**batch, output_hidden_states=True) for k, m in theirs.items()}
            gap = max(compare(ref["eager"], ref["sdpa"], batch["attention_mask"], pooler=False), 1e-3)
            assert compare(quick, ref["sdpa"], batch["attention_mask"], pooler=False) <= 2 * gap, route


def test_hooks_and_maps_still_go_to_the_readable_path(minilm_dir, device):
    model, tok = minilm_on(minilm_dir, device)
    batch = batches(tok, device)[0]
    seen = []
    with hooks(model, {"blocks.0.attn.probs": lambda x, name: seen.append(x.shape)}), torch.inference_mode():
        fast.prepare(model)(**batch)
    assert seen  # the hook fired: the readable path ran
    with torch.inference_mode():
        out = fast.prepare(model)(**batch, output_attentions=True)
    assert out.attentions is not None and out.attentions[0].shape[-1] == batch["input_ids"].shape[1]


def earlier_states_bytes(config, B: int, T: int) -> int:
    """What keeping every hidden state holds beyond the last one at the end of a forward: the embeddings'
    and every block but the last's (B, T, H) fp32 states."""
    return config.num_hidden_layers * B * T * config.hidden_size * 4


def test_the_memory_bound_is_arithmetic_the_gpu_can_meet(minilm_dir):
    """The memory test's own arithmetic, on the CPU: the bytes it asks the two peaks to differ by are the
    bytes of the states the fast path returns when asked for all of them (the tensors counted here)."""
    model, _ = minilm_on(minilm_dir, torch.device("cpu"))
    B, T = 4, 32
    ids = torch.randint(1000, 5000, (B, T))
    with torch.inference_mode():
        out = fast.prepare(model)(ids)
    held = sum(t.numel() * t.element_size() for t in out.hidden_states[:-1])
    assert held == earlier_states_bytes(model.config, B, T)


@needs_cuda
def test_keeping_only_the_last_hidden_state_takes_less_memory(minilm_dir):
    """Keeping every hidden state holds the earlier (B, T, H) fp32 states at the end; keeping only the
    last does not: the peaks differ by at least most of their bytes, whatever the attention route's own
    temporaries (a ratio of the peaks depended on the route calibration picked)."""
    device = torch.device("cuda")
    model, _ = minilm_on(minilm_dir, device)
    B, T = 64, 256
    ids = torch.randint(1000, 5000, (B, T), device=device)
    mask = (torch.arange(T, device=device)[None] < torch.randint(20, T, (B, 1), device=device)).long()
    run = fast.prepare(model)
    peaks = {}
    for keep in (True, False):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        with torch.inference_mode():
            run(ids, mask, output_hidden_states=keep)
        torch.cuda.synchronize()
        peaks[keep] = torch.cuda.max_memory_allocated() - before
    assert peaks[True] - peaks[False] >= 0.8 * earlier_states_bytes(model.config, B, T), peaks


@needs_cuda
def test_the_inference_commands_run_on_the_gpu(minilm_dir, tmp_path, capsys):
    texts = tmp_path / "t.txt"
    texts.write_text("a river bank\nthe bank raised its rates\n", encoding="utf-8")
    for args in (["encode", "hello", "--model", minilm_dir, "--device", "cuda", "--dtype", "fp16"],
                 ["embed", texts, "--out", tmp_path / "v.npy", "--model", minilm_dir, "--device", "cuda", "--quiet"],
                 ["search", texts, "bank", "--model", minilm_dir, "--device", "cuda", "--quiet"],
                 ["layers", "hello", "--model", minilm_dir, "--device", "cuda"]):
        r = cli_in_process(capsys, *args)
        assert r.returncode == 0, (args, r.stderr[-2000:])


@needs_cuda
def test_encode_on_the_device_equals_the_cpu(minilm_dir, sentences_dir):
    """The overlapped pipeline (token budget, vectors home every FLUSH_BYTES) on the GPU against the plain
    CPU loop (on a CPU it would be the same call twice; its collector is tested in test_encode.py)."""
    device = torch.device("cuda")
    from minibert.tools import encode

    model = BertModel.from_pretrained(minilm_dir).eval()
    tok = BertTokenizer.from_pretrained(minilm_dir)
    texts = [t for t in (sentences_dir / "held.txt").read_text(encoding="utf-8").split("\n")[:300] if t.strip()]
    cpu = encode.encode_texts(model, tok, texts, normalize=True)
    there = encode.encode_texts(model, tok, texts, normalize=True, device=str(device))
    assert model.device.type == "cpu" and (there - cpu).abs().max() <= 1e-6  # the bound


def test_cuda_graphs_replay_what_the_fast_path_computes(minilm_dir, device):
    """One graph per distinct shape (texts of four token counts: counted, not assumed -- "a river bank"
    and "hello there friend" are both 5 tokens), each replay equal to the fast path bit for bit."""
    model, tok = minilm_on(minilm_dir, device)
    run, plain = fast.prepare(model, cuda_graphs=True), fast.prepare(model)
    texts = ("a river bank", "the bank raised its rates", "a river bank in the early morning light", "hello there",
             "a river bank")
    shapes = set()
    with torch.inference_mode():
        for text in texts:
            ids = tok([text], return_tensors="pt")["input_ids"].to(device)
            shapes.add(tuple(ids.shape))
            graphed, want = run(ids), plain(ids)
            assert torch.equal(graphed.last_hidden_state, want.last_hidden_state)
            assert all(torch.equal(a, b) for a, b in zip(graphed.hidden_states, want.hidden_states))
    assert len(shapes) == 4 and len(run.graphs.entries) == len(shapes) == run.graphs.captures


def test_a_model_on_cuda_zero_takes_device_cuda(minilm_dir, device):
    """``encode(..., device="cuda")`` on a model on cuda:0 (torch.device("cuda") != torch.device("cuda", 0));
    on the CPU, "cpu:0" on a model on "cpu"."""
    from minibert.compat import SentenceEncoder

    encoder = SentenceEncoder.from_pretrained(minilm_dir, device=device)
    spelt = "cuda" if device.type == "cuda" else "cpu:0"
    assert encoder.encode(["a river bank"], device=spelt).shape == (1, 384)
