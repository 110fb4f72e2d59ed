"""CUDA graphs and the TF32 switch of the fast path (``minibert.tools.graphs``), their logic on the CPU:
the TF32 setting restored exactly as it was, on every API state torch 2.9+ can be in; the graph cache's
shapes, lock, shared pool and device (issue 63). The same cache on a GPU: ``test_fast_cuda.py``."""

from __future__ import annotations

import threading

import pytest
import torch

from minibert import BertModel
from minibert.errors import InputError
from minibert.tools import fast, graphs

MATMUL = torch.backends.cuda.matmul


@pytest.fixture
def tf32_state():
    """Whatever a test does to torch's matmul precision is undone after it."""
    before = MATMUL.fp32_precision
    yield
    MATMUL.fp32_precision = before
    graphs.TF32._inside = 0


@pytest.mark.parametrize("user", ["untouched", "new api ieee", "new api tf32", "legacy allow_tf32", "medium"])
def test_tf32_comes_back_exactly_as_it_was(tf32_state, user):
    """Inside: TF32 on. After: the very value before, and torch's own getters work as they did (the old
    switch read the legacy flag, which raises once the new API was used, and turned "medium" into "high")."""
    if user == "new api ieee":
        MATMUL.fp32_precision = "ieee"
    elif user == "new api tf32":
        MATMUL.fp32_precision = "tf32"
    elif user == "legacy allow_tf32":
        MATMUL.allow_tf32 = False
    elif user == "medium":
        torch.set_float32_matmul_precision("medium")
    before = MATMUL.fp32_precision
    try:
        global_before = torch.get_float32_matmul_precision()
    except RuntimeError:
        global_before = "raises"
    with graphs.TF32(True):
        assert MATMUL.fp32_precision == "tf32"
    assert MATMUL.fp32_precision == before
    try:
        global_after = torch.get_float32_matmul_precision()
    except RuntimeError:
        global_after = "raises"
    assert global_after == global_before
    with pytest.raises(ValueError), graphs.TF32(True):
        raise ValueError("inside")
    assert MATMUL.fp32_precision == before  # restored on an exception too
    with graphs.TF32(False):
        assert MATMUL.fp32_precision == before  # off: not touched


def test_tf32_is_restored_by_the_last_thread_out(tf32_state):
    """Threads overlapping inside: the setting stays on until the last one leaves, then comes back."""
    MATMUL.fp32_precision = "ieee"
    inside, release, seen = threading.Barrier(3), threading.Event(), []

    def worker(hold):
        with graphs.TF32(True):
            inside.wait()
            if hold:
                release.wait(10)
            seen.append(MATMUL.fp32_precision)

    threads = [threading.Thread(target=worker, args=(hold,)) for hold in (False, True)]
    for t in threads:
        t.start()
    inside.wait()
    threads[0].join(10)
    assert MATMUL.fp32_precision == "tf32"  # one thread left, the other is still inside
    release.set()
    threads[1].join(10)
    assert seen == ["tf32", "tf32"] and MATMUL.fp32_precision == "ieee"


# ------------------------------------------------------------------------------------ the graph cache
class FakeGraph:
    """A CUDA graph's contract on a CPU (see test_varlen.py): replay recomputes into the captured outputs."""

    def __init__(self):
        self.fn = self.inputs = self.out = None

    def replay(self):
        fresh = self.fn(*self.inputs)
        self.out.last_hidden_state.copy_(fresh.last_hidden_state)


def fake_capture(graph, fn, inputs, pool):
    graph.fn, graph.inputs, graph.pool = fn, inputs, pool
    graph.out = fn(*inputs)
    return graph.out


@pytest.fixture
def on_cpu(monkeypatch):
    pools = []
    monkeypatch.setattr(graphs.GraphCache, "check", staticmethod(lambda model: None))
    monkeypatch.setattr(graphs.GraphCache, "make_graph", staticmethod(FakeGraph))
    monkeypatch.setattr(graphs.GraphCache, "make_pool", staticmethod(lambda: pools.append(object()) or pools[-1]))
    monkeypatch.setattr(graphs.GraphCache, "capture", staticmethod(fake_capture))
    return pools


def test_declared_shapes_only_one_pool_and_one_replay_at_a_time(minilm_dir, on_cpu):
    """cuda_graphs=[shapes]: only those shapes are captured (others run as usual, nothing dropped for room);
    every graph of a cache is captured into one memory pool; calls from several threads give each its own
    right answer (the lock: a graph's static inputs are shared)."""
    model = BertModel.from_pretrained(minilm_dir).eval()
    run, plain = fast.prepare(model, cuda_graphs=[(1, 5), (1, 7)]), fast.prepare(model)
    g = torch.Generator().manual_seed(0)
    inputs = [torch.randint(1000, 5000, (1, T), generator=g) for T in (5, 7, 9, 5, 7, 9)]
    with torch.inference_mode():
        for ids in inputs:
            assert torch.equal(run(ids, output_hidden_states=False).last_hidden_state,
                               plain(ids, output_hidden_states=False).last_hidden_state)
    cache = run.graphs
    assert cache.captures == 2 and {k[0] for k in cache.entries} == {(1, 5), (1, 7)}
    assert len(on_cpu) == 1 and all(graph.pool is on_cpu[0] for graph, _, _ in cache.entries.values())
    wanted = {i: plain(ids, output_hidden_states=False).last_hidden_state for i, ids in enumerate(inputs)}
    got, errors = {}, []

    def worker(i):
        try:
            with torch.inference_mode():
                for _ in range(5):
                    got[i] = run(inputs[i], output_hidden_states=False).last_hidden_state
        except Exception as e:  # noqa: BLE001
            errors.append(e)
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(inputs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and all(torch.equal(got[i], wanted[i]) for i in wanted)


@pytest.mark.parametrize("bad", ["yes", [(1,)], [(0, 16)], [(1, 16.0)], [(True, 4)], 3, []])
def test_cuda_graphs_takes_true_false_or_shapes(minilm_dir, bad):
    model = BertModel.from_pretrained(minilm_dir).eval()
    with pytest.raises(InputError, match=r"cuda_graphs=.*: pass True or False, or the \(batch, length\) shapes"):
        fast.prepare(model, cuda_graphs=bad)
    assert fast.prepare(model, cuda_graphs=[(1, 16), [2, 8]]).graphs.wants((2, 8))
    assert fast.prepare(model, cuda_graphs=False).graphs is None


def test_capture_and_replay_run_on_the_models_device(monkeypatch):
    """run() enters the model's CUDA device (a model on cuda:1 without set_device); nothing on a CPU."""
    entered = []

    class Device:
        def __init__(self, device):
            self.device = device

        def __enter__(self):
            entered.append(self.device)

        def __exit__(self, *exc):
            return False
    monkeypatch.setattr(torch.cuda, "device", Device)
    assert isinstance(graphs._on(torch.device("cpu")), type(graphs._on(None)))
    graphs._on(torch.device("cuda", 1)).__enter__()
    assert entered == [torch.device("cuda", 1)]
