"""Vectors streamed back from a device (``minibert.tools.encode``, issue 63): a corpus of any size holds at
most a bounded amount of vectors on the GPU. The collector's logic on the CPU, its rows in order."""

from __future__ import annotations

import torch

from minibert.tools import encode


def test_vectors_go_back_every_few_batches_with_a_bound_on_device_memory():
    """On a device the vectors are kept until they reach the flush size, then copied back in one transfer:
    what is held never exceeds the flush size plus one batch, and every row lands where it belongs."""
    g = torch.Generator().manual_seed(0)
    count, width, flush = 1000, 16, 4 * 16 * 100  # bytes of 100 vectors
    out = torch.zeros(count, width)
    collect = encode._Collector(out, on_device=True, flush_bytes=flush)
    order = torch.randperm(count, generator=g).tolist()  # length-sorted batches come in any row order
    want = torch.randn(count, width, generator=g)
    batch = 32
    for start in range(0, count, batch):
        rows = order[start:start + batch]
        collect.add(rows, want[rows])
        assert collect.held < flush + batch * width * 4
    collect.flush()
    assert torch.equal(out, want)
    assert collect.flushes == -(-count // (-(-100 // batch) * batch)) and collect.most_held <= flush + batch * width * 4
    on_cpu = encode._Collector(torch.zeros(count, width), on_device=False, flush_bytes=flush)
    on_cpu.add(order[:5], want[order[:5]])
    assert on_cpu.held == 0 and torch.equal(on_cpu.out[order[:5]], want[order[:5]])  # written at once
