"""The fast path's GPU route (issue 47), on a GPU only: skipped where torch sees no CUDA device (CI has
none; ``benchmarks/bench_gpu.py --steps test`` runs this module on a lent GPU).

What it holds: on padded batches and sentence pairs the GPU route -- packed real tokens, the attention
kernel chosen for this GPU and dtype (varlen / nested / padded), scattered once -- equals the readable
path within the fp32 noise floor (TF32 off) and, in bf16 / fp16, transformers' same-dtype output within
the gap between transformers' own two attention implementations in that dtype; every attention route runs;
hooks and attention maps still go to the readable path; keeping only the last hidden state takes less
GPU memory; the inference commands run with ``--device cuda``.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (runs on a GPU machine)")

from conftest import PAIRS, SENTENCES, cli_in_process, transformers  # noqa: E402
from minibert import BertModel, BertTokenizer  # noqa: E402
from minibert.testing import largest_difference as compare  # noqa: E402
from minibert.tools import fast, varlen  # noqa: E402
from minibert.tools.hooks import hooks  # noqa: E402

CUDA = torch.device("cuda")


def batches(tok):
    sentences = dict(tok(SENTENCES, padding=True, return_tensors="pt"))
    pairs = dict(tok([a for a, _ in PAIRS], [b for _, b in PAIRS], padding=True, return_tensors="pt"))
    return [{k: v.to(CUDA) for k, v in b.items()} for b in (sentences, pairs)]


@pytest.fixture(scope="module")
def minilm(minilm_dir):
    return BertModel.from_pretrained(minilm_dir, device=CUDA).eval(), BertTokenizer.from_pretrained(minilm_dir)


def noise_floor_on_gpu(model, batch) -> float:
    """The fp32 noise floor on this GPU: the readable path's fused vs explicit attention, and vs float64."""
    exact = BertModel.from_pretrained(model.source, device=CUDA, dtype=torch.float64).eval()
    with torch.inference_mode():
        fused, explicit, truth = model(**batch), model(**batch, output_attentions=True), exact(**batch)
    mask = batch["attention_mask"]
    return max(compare(fused, explicit, mask), compare(fused, truth, mask), 1e-7)


@pytest.mark.parametrize("route", ["auto", "varlen", "nested", "padded", "loop"])
def test_the_gpu_route_matches_the_readable_path_in_fp32(minilm, route):
    model, tok = minilm
    if route != "auto" and not varlen.runs_here(route, CUDA, torch.float32, model.config.head_size):
        pytest.skip(f"{route} does not run in fp32 on this GPU")
    for batch in batches(tok):
        floor = noise_floor_on_gpu(model, batch)
        with torch.inference_mode():
            slow, quick = model(**batch), fast.prepare(model, attention=route)(**batch)
        assert compare(slow, quick, batch["attention_mask"], pooler=False) <= 4 * floor
        assert torch.all(quick.last_hidden_state[batch["attention_mask"] == 0] == 0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_on_the_gpu_route_matches_transformers(minilm_dir, dtype):
    """Against transformers' BertModel in the same dtype: within twice the gap between transformers' own
    eager and SDPA attention on these inputs (the rounding one correct half-precision forward differs by)."""
    tok = BertTokenizer.from_pretrained(minilm_dir)
    ours = BertModel.from_pretrained(minilm_dir, device=CUDA, dtype=dtype).eval()
    theirs = {impl: transformers.BertModel.from_pretrained(minilm_dir, attn_implementation=impl, dtype=dtype)
              .to(CUDA).eval() for impl in ("eager", "sdpa")}
    for route in ("auto", "varlen", "nested", "padded"):
        if route != "auto" and not varlen.runs_here(route, CUDA, dtype, ours.config.head_size):
            continue
        for batch in batches(tok):
            with torch.inference_mode():
                quick = fast.prepare(ours, attention=route)(**batch)
                ref = {k: m(**batch, output_hidden_states=True) for k, m in theirs.items()}
            gap = max(compare(ref["eager"], ref["sdpa"], batch["attention_mask"], pooler=False), 1e-3)
            assert compare(quick, ref["sdpa"], batch["attention_mask"], pooler=False) <= 2 * gap, route


def test_hooks_and_maps_still_go_to_the_readable_path(minilm):
    model, tok = minilm
    batch = batches(tok)[0]
    seen = []
    with hooks(model, {"blocks.0.attn.probs": lambda x, name: seen.append(x.shape)}), torch.inference_mode():
        fast.prepare(model)(**batch)
    assert seen  # the hook fired: the readable path ran
    with torch.inference_mode():
        out = fast.prepare(model)(**batch, output_attentions=True)
    assert out.attentions is not None and out.attentions[0].shape[-1] == batch["input_ids"].shape[1]


def test_keeping_only_the_last_hidden_state_takes_less_memory(minilm):
    """Keeping every hidden state holds the 6 earlier (B, T, H) fp32 states at the end; keeping only the
    last does not: the peaks differ by at least most of their bytes, whatever the attention route's own
    temporaries (a ratio of the peaks depended on the route calibration picked)."""
    model, tok = minilm
    B, T = 64, 256
    ids = torch.randint(1000, 5000, (B, T), device=CUDA)
    mask = (torch.arange(T, device=CUDA)[None] < torch.randint(20, T, (B, 1), device=CUDA)).long()
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
    earlier_states = model.config.num_hidden_layers * B * T * model.config.hidden_size * 4
    assert peaks[True] - peaks[False] >= 0.8 * earlier_states, (peaks, earlier_states)


def test_the_inference_commands_run_on_the_gpu(minilm_dir, tmp_path, capsys):
    texts = tmp_path / "t.txt"
    texts.write_text("a river bank\nthe bank raised its rates\n", encoding="utf-8")
    for args in (["encode", "hello", "--model", minilm_dir, "--device", "cuda", "--dtype", "fp16"],
                 ["embed", texts, "--out", tmp_path / "v.npy", "--model", minilm_dir, "--device", "cuda", "--quiet"],
                 ["search", texts, "bank", "--model", minilm_dir, "--device", "cuda", "--quiet"],
                 ["layers", "hello", "--model", minilm_dir, "--device", "cuda"]):
        r = cli_in_process(capsys, *args)
        assert r.returncode == 0, (args, r.stderr[-2000:])


def test_encode_on_the_gpu_equals_the_cpu(minilm_dir, sentences_dir):
    from minibert.tools.encode import encode_texts

    model = BertModel.from_pretrained(minilm_dir).eval()
    tok = BertTokenizer.from_pretrained(minilm_dir)
    texts = [t for t in (sentences_dir / "held.txt").read_text(encoding="utf-8").split("\n")[:300] if t.strip()]
    cpu = encode_texts(model, tok, texts, normalize=True)
    gpu = encode_texts(model, tok, texts, normalize=True, device="cuda")  # overlapped, token budget, one copy back
    assert model.device.type == "cpu" and (gpu - cpu).abs().max() <= 1e-6  # the bound


def test_cuda_graphs_replay_what_the_fast_path_computes(minilm):
    """One graph per distinct shape (texts of three token counts: counted, not assumed -- "a river bank"
    and "hello there friend" are both 5 tokens), each replay equal to the fast path bit for bit."""
    model, tok = minilm
    run, plain = fast.prepare(model, cuda_graphs=True), fast.prepare(model)
    texts = ("a river bank", "the bank raised its rates", "a river bank in the early morning light", "hello there")
    shapes = set()
    with torch.inference_mode():
        for text in texts:
            ids = tok([text], return_tensors="pt")["input_ids"].to(CUDA)
            shapes.add(tuple(ids.shape))
            graphed, want = run(ids), plain(ids)
            assert torch.equal(graphed.last_hidden_state, want.last_hidden_state)
            assert all(torch.equal(a, b) for a, b in zip(graphed.hidden_states, want.hidden_states))
    assert len(shapes) >= 3 and len(run.graphs.entries) == len(shapes) == run.graphs.captures


def test_a_model_on_cuda_zero_takes_device_cuda():
    """``encode(..., device="cuda")`` on a model on cuda:0 (torch.device("cuda") != torch.device("cuda", 0))."""
    from minibert.hardware import same_device

    assert same_device("cuda", torch.device("cuda", torch.cuda.current_device()))
