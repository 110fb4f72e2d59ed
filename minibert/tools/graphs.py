"""CUDA graphs of the fast forward pass (``FastBert(cuda_graphs=True)``), and the TF32 switch of
``FastBert(tf32=True)``."""

from __future__ import annotations

import contextlib
import threading

import torch

from ..errors import InputError
from ..model import BertOutput


class GraphCache:
    """CUDA graphs of the fast forward pass, one per key (the packed weights, the input shape and the
    options), captured on first sight: inputs are copied into the graph's own tensors, the graph replays
    every kernel in one launch, and the outputs are copied out (the graph's own are overwritten by the next
    replay). A graph reads the memory of the weights it was captured with, so when they change -- the
    packed blocks rebuilt after an edit, a parameter replaced -- every graph is dropped and captured again.

    Which shapes get a graph: ``shapes=None`` (``cuda_graphs=True``) any batch without padding, the ``limit``
    most recently used kept -- traffic of many lengths then captures again and again, so a caller that
    knows its shapes declares them (``cuda_graphs=[(1, 16), (1, 32)]``): only those are captured, every
    other batch runs as usual, and nothing is ever dropped for room. All graphs share one memory pool
    (their intermediate buffers are reused from one capture to the next: replays never overlap, see the
    lock); capture and replay run on the model's device (a model on cuda:1 needs no ``set_device``), the
    capture in thread-local mode (another thread's CUDA work does not break it); one lock makes the cache
    safe to call from several threads (one replay at a time: a graph's inputs and outputs are its own).
    ``check``, ``make_graph``, ``make_pool`` and ``capture`` are seams for tests of this bookkeeping on a
    CPU."""

    def __init__(self, limit: int = 8, shapes=None):
        self.limit = limit
        self.shapes = None if shapes is None else frozenset(tuple(s) for s in shapes)
        self.weights = None  # what the graphs were captured with
        self.entries: dict = {}  # key -> (graph, static inputs, static output), in order of use
        self.pool = None  # one memory pool for every graph of this cache
        self.captures = 0
        self.lock = threading.Lock()

    def wants(self, shape) -> bool:
        """Whether a batch of this (B, T) shape (without padding) runs as a graph."""
        return self.shapes is None or tuple(shape) in self.shapes

    @staticmethod
    def check(model) -> None:
        if model.device.type != "cuda":
            raise InputError(f"cuda_graphs: the model is on {model.device}; CUDA graphs need a model on a GPU "
                             "(move it there, or leave cuda_graphs out)")

    @staticmethod
    def make_graph():
        return torch.cuda.CUDAGraph()

    @staticmethod
    def make_pool():
        return torch.cuda.graph_pool_handle()

    @staticmethod
    def capture(graph, fn, inputs, pool):
        """Warm up on a side stream of the current device (torch's rule before a capture), then record
        ``fn(*inputs)`` into ``pool``, in thread-local capture mode."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                fn(*inputs)
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            return fn(*inputs)

    def run(self, weights, key, fn, inputs: tuple, device=None) -> BertOutput:
        """``weights``: the model's ``Copies`` record, rebuilt whenever what a graph reads changed;
        ``device``: the model's (capture and replay run there)."""
        with self.lock, _on(device):
            if self.weights is not weights:
                self.entries.clear()  # captured with other weights: never replayed
                self.weights = weights
            entry = self.entries.pop(key, None)
            if entry is None:
                if self.pool is None:
                    self.pool = self.make_pool()
                static = tuple(t.clone() for t in inputs)
                graph = self.make_graph()
                entry = (graph, static, self.capture(graph, fn, static, self.pool))
                self.captures += 1
                if self.shapes is None and len(self.entries) >= self.limit:
                    self.entries.pop(next(iter(self.entries)))  # the least recently used
            self.entries[key] = entry  # most recent last
            graph, static, out = entry
            for mine, given in zip(static, inputs):
                mine.copy_(given)
            graph.replay()
            copy = (lambda t: None if t is None else t.clone())
            return BertOutput(last_hidden_state=copy(out.last_hidden_state), pooler_output=copy(out.pooler_output),
                              hidden_states=None if out.hidden_states is None else tuple(map(copy, out.hidden_states)))


def _on(device):
    """The device context of a CUDA device (what the current device is inside), nothing elsewhere."""
    if device is not None and torch.device(device).type == "cuda":
        return torch.cuda.device(device)
    return contextlib.nullcontext()


class TF32:
    """Within this block, fp32 matrix products on CUDA may run in TensorFloat-32 (``FastBert(tf32=True)``);
    torch's setting comes back after, exactly as it was.

    The setting is torch's new per-backend one, ``torch.backends.cuda.matmul.fp32_precision`` ("tf32",
    "ieee", or "none": follow the global one), read and written as it is: since torch 2.9 reading the
    legacy ``allow_tf32`` or ``get_float32_matmul_precision()`` raises once anyone has used the new API, and
    going through ``set_float32_matmul_precision`` would turn a user's "medium" into "high". The setting
    is the process's: while several threads are inside such blocks it stays "tf32", and the first one in
    keeps the value the last one out restores (a count under a lock), so no thread restores it under
    another that still needs it."""

    _lock = threading.Lock()
    _inside = 0
    _before = None

    def __init__(self, on: bool):
        self.on = on

    def __enter__(self):
        if self.on:
            with TF32._lock:
                if TF32._inside == 0:
                    TF32._before = _read(torch.backends.cuda.matmul)
                    _write(torch.backends.cuda.matmul, "tf32")
                TF32._inside += 1
        return self

    def __exit__(self, *exc):
        if self.on:
            with TF32._lock:
                TF32._inside -= 1
                if TF32._inside == 0:
                    _write(torch.backends.cuda.matmul, TF32._before)


def _read(backend):
    """The setting as it is: the new API's string where this torch has it, else the legacy boolean."""
    return backend.fp32_precision if hasattr(backend, "fp32_precision") else backend.allow_tf32


def _write(backend, value) -> None:
    if hasattr(backend, "fp32_precision"):
        backend.fp32_precision = value if isinstance(value, str) else ("tf32" if value else "ieee")
    else:  # torch < 2.9
        backend.allow_tf32 = value == "tf32" if isinstance(value, str) else value
