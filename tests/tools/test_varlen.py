"""Packed tokens and the attention kernels of the fast path (``minibert.tools.varlen``, issue 47).

CI has no GPU, so the GPU route's bookkeeping -- where the real tokens are, ``cu_seqlens``, the longest
row, gathering once and scattering once -- runs here on the CPU, the variable-length kernel replaced by
``varlen_reference`` (its contract in plain torch). ``tests/tools/test_fast_cuda.py`` runs the real kernels
where there is a GPU."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import PAIRS, SENTENCES, SyncCounter
from minibert import BertModel, BertTokenizer
from minibert.errors import InputError
from minibert.testing import fp32_noise_floor
from minibert.testing import largest_difference as compare
from minibert.tools import fast, graphs, varlen
from minibert.tools.hooks import hooks

MASKS = {
    "right padding": [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]],
    "left padding": [[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 0, 1]],
    "holes and an empty row": [[1, 0, 1, 0, 1], [0, 0, 0, 0, 0], [0, 1, 1, 1, 0], [1, 0, 0, 0, 0]],
    "one token each": [[1, 0, 0], [0, 1, 0], [0, 0, 1]],
}


@pytest.fixture(scope="module")
def minilm(minilm_dir):
    return BertModel.from_pretrained(minilm_dir).eval(), BertTokenizer.from_pretrained(minilm_dir)


@pytest.fixture
def cpu_varlen(monkeypatch):
    """The varlen route on this CPU: its kernel is the plain-torch reference, with the same arguments."""
    calls = []

    def kernel(*args, **kwargs):
        calls.append(args[3:])  # cu_seq_q, cu_seq_k, max_q, max_k
        return varlen.varlen_reference(*args, **kwargs)
    real = varlen.runs_here
    monkeypatch.setattr(varlen, "varlen_kernel", lambda: kernel)
    monkeypatch.setattr(varlen, "runs_here", lambda route, *a: True if route == "varlen" else real(route, *a))
    return calls


@pytest.mark.parametrize("name", list(MASKS))
def test_packing_says_where_the_real_tokens_are(name):
    mask = torch.tensor(MASKS[name])
    B, T = mask.shape
    p = varlen.pack(mask, B, T)
    lengths = [int(n) for n in mask.sum(1) if n]
    assert not p.dense and p.lengths == lengths and p.max_len == max(lengths)
    assert p.cu_seqlens.dtype == torch.int32 and p.cu_seqlens.tolist() == [0] + torch.tensor(lengths).cumsum(0).tolist()
    assert p.where.tolist() == [i for i, m in enumerate(mask.reshape(-1).tolist()) if m]  # row by row, in order
    x = torch.arange(1, sum(lengths) + 1, dtype=torch.float32)[:, None].repeat(1, 2)  # (N, 2)
    full = p.scatter(x)  # (B, T, 2): each token in its place, zeros at padding
    assert torch.equal(full.reshape(-1, 2)[p.where], x) and torch.equal(full[mask == 0], torch.zeros(int((mask == 0).sum()), 2))
    slots, keys = p.padded_slots()  # the padded route's grid: row r's tokens at r * max_len + 0, 1, ...
    rows = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    assert torch.equal(slots // p.max_len, rows) and keys.shape == (len(lengths), 1, 1, p.max_len)
    assert keys[:, 0, 0].sum(1).tolist() == lengths


def test_a_batch_without_padding_is_dense_and_an_empty_one_packs_nothing():
    p = varlen.pack(None, 3, 4)
    assert p.dense and p.lengths == [4, 4, 4] and p.cu_seqlens.tolist() == [0, 4, 8, 12] and p.max_len == 4
    x = torch.randn(12, 5)
    assert torch.equal(p.scatter(x), x.view(3, 4, 5))
    empty = varlen.pack(torch.zeros(2, 3, dtype=torch.long), 2, 3)
    assert empty.lengths == [] and empty.max_len == 0 and empty.cu_seqlens.tolist() == [0]
    assert torch.equal(empty.scatter(torch.zeros(0, 5)), torch.zeros(2, 3, 5))


@pytest.mark.parametrize("name", list(MASKS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_attention_route_attends_within_each_sequence(name, dtype, cpu_varlen):
    """Every route equals the per-sequence loop (itself checked against the explicit formula of the
    readable model): the packing, not the kernel, decides which tokens see each other."""
    mask = torch.tensor(MASKS[name])
    B, T = mask.shape
    p = varlen.pack(mask, B, T)
    h, d = 4, 8
    qkv = torch.randn(sum(p.lengths), 3 * h * d, generator=torch.Generator().manual_seed(1)).to(dtype)
    loop = varlen.attend("loop", qkv, p, h, d**-0.5)
    # the loop against softmax(QK^T/sqrt(d))V written out, row by row
    for (start, end) in zip(p.cu_seqlens[:-1].tolist(), p.cu_seqlens[1:].tolist()):
        q, k, v = qkv[start:end].float().view(-1, 3, h, d).unbind(1)
        probs = (torch.einsum("qhd,khd->hqk", q, k) * d**-0.5).softmax(-1)
        want = torch.einsum("hqk,khd->qhd", probs, v).reshape(-1, h * d)
        assert (loop[start:end].float() - want).abs().max() <= (1e-5 if dtype == torch.float32 else 2e-2)
    for route in ("nested", "padded", "varlen"):
        got = varlen.attend(route, qkv, p, h, d**-0.5)
        assert got.shape == loop.shape and got.dtype == dtype
        assert (got.float() - loop.float()).abs().max() <= (1e-5 if dtype == torch.float32 else 2e-2), route
    assert cpu_varlen[-1] == (p.cu_seqlens, p.cu_seqlens, p.max_len, p.max_len)


@pytest.mark.parametrize("route", ["loop", "varlen", "nested", "padded"])
def test_the_fast_path_on_every_route_matches_the_readable_path(minilm, route, cpu_varlen):
    """Padded sentences and sentence pairs (token types), a row of one token and a row of none."""
    model, tok = minilm
    pairs = dict(tok([a for a, _ in PAIRS], [b for _, b in PAIRS], padding=True, return_tensors="pt"))
    sentences = dict(tok(SENTENCES, padding=True, return_tensors="pt"))
    sentences["attention_mask"][-1, 1:] = 0  # one real token
    sentences["attention_mask"][-2] = 0  # none
    run = fast.prepare(model, attention=route)
    for batch in (pairs, sentences):
        with torch.inference_mode():
            slow, quick = model(**batch), run(**batch)
        valid = batch["attention_mask"].clone()
        valid[-2] = 0 if batch is sentences else valid[-2]
        assert compare(slow, quick, valid, pooler=False) <= fast.noise_factor(model) * fp32_noise_floor(model, batch)
        assert torch.all(quick.last_hidden_state[batch["attention_mask"] == 0] == 0)
    assert (len(cpu_varlen) > 0) == (route == "varlen")  # the route asked for is the one that ran


def test_attention_routes_are_chosen_checked_and_overridable(minilm, monkeypatch, tmp_path):
    model, _ = minilm
    monkeypatch.delenv(varlen.OVERRIDE_ENV, raising=False)
    assert varlen.attention_route("cpu", torch.float32, 32) == "loop"  # a CPU: the per-sequence loop
    assert fast.routes(model)["attention"] == "loop"
    with pytest.raises(InputError, match=r"attention='varlen' cannot run here: varlen_attn \(FlashAttention\) needs a "
                                         r"CUDA device.*this model: cpu, torch.float32, head size 32"):
        fast.prepare(model, attention="varlen")(torch.tensor([[101, 102]]))
    with pytest.raises(InputError, match=r"attention='flash': use 'auto' or one of \('loop', 'varlen', 'nested', 'padded'\)"):
        fast.prepare(model, attention="flash")
    monkeypatch.setenv(varlen.OVERRIDE_ENV, "padded")
    assert fast.routes(model)["attention"] == "padded"
    monkeypatch.setenv(varlen.OVERRIDE_ENV, "varlen")  # the variable cannot make a CPU run FlashAttention
    assert varlen.attention_route("cpu", torch.float32, 32) == "padded"
    monkeypatch.setenv(varlen.OVERRIDE_ENV, "fastest")
    with pytest.raises(InputError, match=r"MINIBERT_ATTENTION='fastest': use one of"):
        varlen.attention_route("cpu", torch.float32, 32)
    monkeypatch.delenv(varlen.OVERRIDE_ENV)

    # a GPU (stood in for): measured once per device, dtype and head size, kept in attention.json
    monkeypatch.setenv("MINIBERT_CACHE", str(tmp_path))
    monkeypatch.setattr(varlen, "_CHOICES", {})
    monkeypatch.setattr(varlen, "device_key", lambda device: "Some GPU | torch x")
    measured = []

    def fake_calibrate(device, dtype, head_size):
        measured.append((dtype, head_size))
        return {"loop": 40.0, "nested": 9.0, "padded": 1.0} | ({"varlen": 0.6} if dtype == torch.bfloat16 else {})
    monkeypatch.setattr(varlen, "calibrate", fake_calibrate)
    real = varlen.runs_here
    monkeypatch.setattr(varlen, "runs_here", lambda route, device, dtype, d: (
        dtype == torch.bfloat16 if route == "varlen" else real(route, device, dtype, d)))
    cuda = torch.device("cuda", 0)
    assert varlen.attention_route(cuda, torch.bfloat16, 64) == "varlen"
    assert varlen.attention_route(cuda, torch.float32, 64) == "padded"
    assert varlen.attention_route(cuda, torch.bfloat16, 64) == "varlen" and len(measured) == 2
    saved = json.loads((tmp_path / "attention.json").read_text())
    assert saved["Some GPU | torch x"]["bfloat16 d=64"]["route"] == "varlen"
    monkeypatch.setattr(varlen, "_CHOICES", {})  # another process reads the file
    assert varlen.attention_route(cuda, torch.float32, 64) == "padded" and len(measured) == 2


def test_calibration_times_the_routes_that_run_here():
    relative = varlen.calibrate("cpu", torch.float32, 8, rounds=1, rows=6, low=2, high=12)
    assert set(relative) == {"loop", "nested", "padded"} and relative["padded"] == 1.0


# ------------------------------------------------------------------------------ hidden states on demand
def test_hidden_states_on_demand(minilm):
    """output_hidden_states: True (default, all), False (None; the last block's output still returned), or
    indices (fast path): the same numbers as the full run where kept, None elsewhere."""
    model, tok = minilm
    batch = dict(tok(SENTENCES, padding=True, return_tensors="pt"))
    run = fast.prepare(model)
    with torch.inference_mode():
        full, none = model(**batch), model(**batch, output_hidden_states=False)
        fast_full = run(**batch)
        fast_none = run(**batch, output_hidden_states=False)
        fast_some = run(**batch, output_hidden_states=[0, -1, 3])
        fast_early = run(**batch, output_hidden_states=[-1], num_blocks=2)
    assert none.hidden_states is None and torch.equal(none.last_hidden_state, full.last_hidden_state)
    assert torch.equal(none.pooler_output, full.pooler_output)
    assert fast_none.hidden_states is None and torch.equal(fast_none.last_hidden_state, fast_full.last_hidden_state)
    L = model.config.num_hidden_layers
    assert len(fast_some.hidden_states) == L + 1
    assert [i for i, t in enumerate(fast_some.hidden_states) if t is not None] == [0, 3, L]
    for i in (0, 3, L):
        assert torch.equal(fast_some.hidden_states[i], fast_full.hidden_states[i])
    assert len(fast_early.hidden_states) == 3 and torch.equal(fast_early.hidden_states[2], fast_full.hidden_states[2])
    assert torch.equal(fast_early.last_hidden_state, fast_full.hidden_states[2])
    # the readable path (here because a hook is set) gives the same selection
    with hooks(model, {"blocks.0.output": lambda x, name: x}), torch.inference_mode():
        hooked = run(**batch, output_hidden_states=[1])
        hooked_none = run(**batch, output_hidden_states=False)
    assert [i for i, t in enumerate(hooked.hidden_states) if t is not None] == [1]
    assert torch.equal(hooked.hidden_states[1], full.hidden_states[1]) and hooked_none.hidden_states is None
    for bad, message in ((L + 1, r"output_hidden_states entry"), (5, r"pass True, False or a list")):
        with pytest.raises(InputError, match=message):
            run(**batch, output_hidden_states=[bad] if bad == L + 1 else bad)
    # run_with_cache passes it on
    out, cache = model.run_with_cache(**batch, names=["blocks.0.output"], output_hidden_states=False)
    assert out.hidden_states is None and "blocks.0.output" in cache


def test_transformers_calls_keep_only_what_they_ask_for(minilm_dir):
    from minibert.compat.hf import TransformersBertModel

    model = TransformersBertModel.from_pretrained(minilm_dir).eval()
    batch = {"input_ids": torch.tensor([[101, 7592, 102]])}
    with torch.inference_mode():
        assert model(**batch).hidden_states is None
        assert len(model(**batch, output_hidden_states=True).hidden_states) == 7


# ------------------------------------------------------------------------------------ CUDA graphs
class FakeGraph:
    """A CUDA graph's contract on a CPU: ``capture`` records the function and its static inputs; ``replay``
    recomputes into the very output tensors the capture returned (what a graph's replay does)."""

    captures = 0

    def __init__(self):
        self.fn = self.inputs = self.out = None

    def replay(self):
        fresh = self.fn(*self.inputs)
        self.out.last_hidden_state.copy_(fresh.last_hidden_state)
        if self.out.pooler_output is not None:
            self.out.pooler_output.copy_(fresh.pooler_output)


def fake_capture(graph, fn, inputs, pool=None):
    FakeGraph.captures += 1
    graph.fn, graph.inputs = fn, inputs
    graph.out = fn(*inputs)
    return graph.out


@pytest.fixture
def graphs_on_cpu(monkeypatch):
    monkeypatch.setattr(graphs.GraphCache, "check", staticmethod(lambda model: None))
    monkeypatch.setattr(graphs.GraphCache, "make_graph", staticmethod(FakeGraph))
    monkeypatch.setattr(graphs.GraphCache, "capture", staticmethod(fake_capture))
    monkeypatch.setattr(graphs.GraphCache, "make_pool", staticmethod(object))
    FakeGraph.captures = 0


def test_cuda_graphs_capture_once_per_shape_replay_new_inputs_and_follow_the_weights(minilm_dir, graphs_on_cpu):
    """cuda_graphs=True: a batch without padding is captured once for its shape and replayed with each new
    input (the outputs copied out, never the graph's own); padded batches run as usual; at most `limit`
    graphs; new weights drop every graph."""
    model = BertModel.from_pretrained(minilm_dir).eval()
    run, plain = fast.prepare(model, cuda_graphs=True), fast.prepare(model)
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randint(1000, 5000, (2, 9), generator=g) for _ in range(2))
    with torch.inference_mode():
        out_a = run(a, output_hidden_states=False)
        out_b = run(b, output_hidden_states=False)  # same shape: replayed with b's ids
        assert FakeGraph.captures == 1
        for ids, out in ((a, out_a), (b, out_b)):
            want = plain(ids, output_hidden_states=False)
            assert torch.equal(out.last_hidden_state, want.last_hidden_state)
            assert torch.equal(out.pooler_output, want.pooler_output)
        assert not torch.equal(out_a.last_hidden_state, out_b.last_hidden_state)  # a's output was copied out
        run(torch.randint(1000, 5000, (1, 16), generator=g))  # another shape, another graph
        assert FakeGraph.captures == 2
        padded = torch.ones(2, 9, dtype=torch.long)
        padded[1, 5:] = 0
        assert torch.equal(run(a, padded).last_hidden_state, plain(a, padded).last_hidden_state)
        assert FakeGraph.captures == 2  # a padded batch is not a graph
        small = fast.prepare(model, cuda_graphs=True)
        small.graphs.limit = 2
        for T in (4, 5, 6):
            small(torch.randint(1000, 5000, (1, T), generator=g))
        assert len(small.graphs.entries) == 2
        captures = FakeGraph.captures
        with torch.no_grad():
            model.pooler.dense.bias += 1.0  # in place, outside the packed blocks: the graph reads that memory
        edited = run(a, output_hidden_states=False)
        assert FakeGraph.captures == captures
        assert torch.equal(edited.pooler_output, plain(a, output_hidden_states=False).pooler_output)
        with torch.no_grad():
            model.encoder.blocks[0].attn.query.weight.mul_(1.5)  # the fused QKV copy goes stale: captured again
        edited = run(a, output_hidden_states=False)
        assert FakeGraph.captures == captures + 1
        assert torch.equal(edited.last_hidden_state, plain(a, output_hidden_states=False).last_hidden_state)
        model.pooler.dense.weight = torch.nn.Parameter(model.pooler.dense.weight.detach().clone())  # replaced
        run(a, output_hidden_states=False)
        assert FakeGraph.captures == captures + 2


def test_cuda_graphs_need_a_model_on_a_gpu(minilm_dir):
    model = BertModel.from_pretrained(minilm_dir).eval()
    with pytest.raises(InputError, match=r"cuda_graphs: the model is on cpu; CUDA graphs need a model on a GPU"):
        fast.prepare(model, cuda_graphs=True)(torch.tensor([[101, 102]]))
    with pytest.raises(InputError, match=r"cuda_graphs='yes': pass True or False"):
        fast.prepare(model, cuda_graphs="yes")


# ------------------------------------------------------------------------------------ issue 63
def test_the_varlen_route_calls_the_kernel_as_each_torch_takes_it(monkeypatch):
    """torch 2.10 / 2.11's varlen_attn has no ``scale`` keyword (2.12+ has): the route and the capability
    probe call it alike, passing scale only where it is taken (else folded into q when it is not the
    kernel's own 1/sqrt(d)). Both kernels' results equal the reference's with the scale asked for."""
    calls = []

    def old_kernel(q, k, v, cu_q, cu_k, max_q, max_k):  # torch 2.10's signature
        calls.append("old")
        return varlen.varlen_reference(q, k, v, cu_q, cu_k, max_q, max_k)

    def new_kernel(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None):
        calls.append(("new", scale))
        return varlen.varlen_reference(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale)

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(7, 2, 8, generator=g) for _ in range(3))
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    for scale in (8 ** -0.5, 0.3):
        want = varlen.varlen_reference(q, k, v, cu, cu, 4, 4, scale=scale)
        for kernel in (old_kernel, new_kernel):
            monkeypatch.setattr(varlen, "varlen_kernel", lambda kernel=kernel: kernel)
            got = varlen.call_varlen(q, k, v, cu, 4, scale)
            assert (got - want).abs().max() <= 1e-6, (kernel.__name__, scale)
    assert calls == ["old", ("new", 8 ** -0.5), "old", ("new", 0.3)]
    # the probe makes the route's very call: with torch 2.10's kernel it passes, and so does the route
    monkeypatch.setattr(varlen, "varlen_kernel", lambda: old_kernel)
    varlen.probe("cpu", torch.float32, 8)
    assert calls[-1] == "old"


def test_the_nested_route_gives_its_lengths_from_the_host(monkeypatch):
    """SDPA on jagged tensors reads the shortest and longest rows with .item() (a host sync each, ~5 a block
    on a GPU) unless the tensors carry them: the route passes both, from the packing's host lengths."""
    made = []
    real = torch.nested.nested_tensor_from_jagged

    def recorded(values, offsets=None, *args, **kwargs):
        made.append(kwargs)
        return real(values, offsets, *args, **kwargs)
    monkeypatch.setattr(torch.nested, "nested_tensor_from_jagged", recorded)
    mask = torch.arange(12)[None, :] < torch.tensor([12, 5, 9])[:, None]
    packing = varlen.pack(mask, 3, 12)
    qkv = torch.randn(int(mask.sum()), 3 * 2 * 8)
    got = varlen.attend("nested", qkv, packing, 2, 8 ** -0.5)
    assert made and all(k.get("min_seqlen") == 5 and k.get("max_seqlen") == 12 for k in made)
    assert (got - varlen.attend("loop", qkv, packing, 2, 8 ** -0.5)).abs().max() <= 1e-5


def test_the_padded_routes_bookkeeping_reads_nothing_back(monkeypatch):
    """Once a batch is packed (one read of its lengths, by design), the padded route's slots and key mask
    are made without reading the device: sizes from the host's lengths, repeat_interleave told its size."""
    mask = torch.arange(12)[None, :] < torch.tensor([12, 5, 9])[:, None]
    packing = varlen.pack(mask, 3, 12)
    counter = SyncCounter(monkeypatch)
    slots, keys = packing.padded_slots()
    syncs = counter.count
    monkeypatch.undo()
    assert syncs == 0, f"{syncs} host reads"
    assert slots.tolist() == [*range(12), *range(12, 17), *range(24, 33)] and keys.sum().item() == 26


def test_a_route_that_fails_in_calibration_is_named_and_never_chosen(monkeypatch):
    """A kernel that raises on this device is left out of the choice with a warning naming it (before, the
    failure surfaced from inside the first forward pass)."""
    real = varlen._KERNELS["nested"]

    def broken(*args):
        raise RuntimeError("no kernel for this GPU")
    monkeypatch.setitem(varlen._KERNELS, "nested", broken)
    with pytest.warns(RuntimeWarning, match=r"nested \(RuntimeError: no kernel for this GPU\)"):
        relative = varlen.calibrate("cpu", torch.float32, 8, rounds=1, rows=4, low=2, high=8)
    assert "nested" not in relative and relative["padded"] == 1.0 and set(relative) >= {"loop", "padded"}
    monkeypatch.setitem(varlen._KERNELS, "nested", real)
