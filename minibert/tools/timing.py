"""The one timing loop: functions called in alternation, side by side in one process (the benchmarks,
``minibert exits``' speed column).

Machines are shared and noisy, so a speed is read as a ratio of two functions timed in the same rounds
(``alternate``, then ``paired_ratio``: the median over rounds of their ratio), after warm-up calls, with
the spread (``spread``) beside it where a page reports it.
"""

from __future__ import annotations

import statistics
import time


def alternate(fns: dict, rounds: int, *, warmup: int = 1, rotate: bool = False,
              settle: int = 0, gap: float = 0.0) -> dict[str, list[float]]:
    """Seconds of each call of each function: ``warmup`` untimed calls each first, then ``rounds`` rounds
    calling every function once (A, B, C, A, B, C, ...; with ``rotate`` each round starts one later, so no
    function always runs right after the same one). ``settle``: untimed calls of a function right before
    each timed one, so that it starts with its own weights in cache and its own threads awake.
    ``gap``: seconds of sleep before a function's turn (its settle calls, then its timed one), so that the
    thread pool of the one before has gone idle: where several runtimes share a process, the one that
    ran before keeps the cores busy for a while after it returns (on the Zen 4, 2 threads: ONNX Runtime's
    pool spins ~40 ms after a run, its default; torch's OpenMP threads ~10 ms), and without a gap the
    next one is timed sharing the cores with it."""
    names = list(fns)
    for _ in range(warmup):
        for name in names:
            fns[name]()
    times = {name: [] for name in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)] if rotate else names
        for name in order:
            if gap:
                time.sleep(gap)
            for _ in range(settle):
                fns[name]()
            start = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - start)
    return times


def medians(times: dict[str, list[float]]) -> dict[str, float]:
    return {name: statistics.median(t) for name, t in times.items()}


def paired_ratio(times: dict, a: str, b: str) -> float:
    """The median over rounds of a's time / b's time in the same round."""
    return statistics.median(x / y for x, y in zip(times[a], times[b]))


def spread(values) -> tuple[float, float]:
    """The lower and upper quartiles of ``values`` (the spread a median is reported with)."""
    values = sorted(values)
    if len(values) < 2:
        return (values[0], values[0]) if values else (float("nan"), float("nan"))
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[0], q[2]
