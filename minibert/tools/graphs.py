"""CUDA graphs of the fast forward pass (``FastBert(cuda_graphs=True)``), and the TF32 switch of
``FastBert(tf32=True)``."""

from __future__ import annotations

import torch

from ..errors import InputError
from ..model import BertOutput


class GraphCache:
    """CUDA graphs of the fast forward pass, one per key (the packed weights, the input shape and the
    options), captured on first sight: inputs are copied into the graph's own tensors, the graph replays
    every kernel in one launch, and the outputs are copied out (the graph's own are overwritten by the next
    replay). At most ``limit`` graphs are kept (the least recently used goes). A graph reads the memory of
    the weights it was captured with, so when they change -- the packed blocks rebuilt after an edit, a
    parameter replaced -- every graph is dropped and captured again. ``check``, ``make_graph`` and
    ``capture`` are seams for tests of this bookkeeping on a CPU."""

    def __init__(self, limit: int = 8):
        self.limit = limit
        self.weights = None  # what the graphs were captured with
        self.entries: dict = {}  # key -> (graph, static inputs, static output), in order of use

    @staticmethod
    def check(model) -> None:
        if model.device.type != "cuda":
            raise InputError(f"cuda_graphs=True: the model is on {model.device}; CUDA graphs need a model on a GPU "
                             "(move it there, or leave cuda_graphs out)")

    @staticmethod
    def make_graph():
        return torch.cuda.CUDAGraph()

    @staticmethod
    def capture(graph, fn, inputs):
        """Warm up on a side stream (torch's rule before a capture), then record ``fn(*inputs)``."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                fn(*inputs)
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(graph):
            return fn(*inputs)

    def run(self, weights, key, fn, inputs: tuple) -> BertOutput:
        """``weights``: the model's ``Copies`` record, rebuilt whenever what a graph reads changed."""
        if self.weights is not weights:
            self.entries.clear()  # captured with other weights: never replayed
            self.weights = weights
        entry = self.entries.pop(key, None)
        if entry is None:
            static = tuple(t.clone() for t in inputs)
            graph = self.make_graph()
            entry = (graph, static, self.capture(graph, fn, static))
            if len(self.entries) >= self.limit:
                self.entries.pop(next(iter(self.entries)))  # the least recently used
        self.entries[key] = entry  # most recent last
        graph, static, out = entry
        for mine, given in zip(static, inputs):
            mine.copy_(given)
        graph.replay()
        copy = (lambda t: None if t is None else t.clone())
        return BertOutput(last_hidden_state=copy(out.last_hidden_state), pooler_output=copy(out.pooler_output),
                          hidden_states=None if out.hidden_states is None else tuple(map(copy, out.hidden_states)))


class TF32:
    """Within this block, fp32 matrix products on CUDA may run in TensorFloat-32 (``FastBert(tf32=True)``);
    torch's setting comes back after."""

    def __init__(self, on: bool):
        self.on = on

    def __enter__(self):
        if self.on:
            self.before = torch.backends.cuda.matmul.allowTF32
            torch.backends.cuda.matmul.allowTF32 = True

    def __exit__(self, *exc):
        if self.on:
            torch.backends.cuda.matmul.allowTF32 = self.before

