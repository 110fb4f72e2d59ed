"""The one timing loop (``tools.timing.alternate``): its order, settle calls and the gap between turns."""

from __future__ import annotations

import time

from minibert.tools import timing


def test_a_gap_comes_before_each_turn_and_not_between_its_calls():
    calls = []
    fns = {name: (lambda name=name: calls.append((name, time.perf_counter()))) for name in "AB"}
    times = timing.alternate(fns, 3, warmup=0, rotate=True, settle=1, gap=0.03)
    assert {k: len(v) for k, v in times.items()} == {"A": 3, "B": 3}
    assert [name for name, _ in calls] == ["A", "A", "B", "B", "B", "B", "A", "A", "A", "A", "B", "B"]
    stamps = [t for _, t in calls]
    for i in range(0, len(stamps), 2):  # each turn: a settle call, then the timed one, no sleep between
        assert stamps[i + 1] - stamps[i] < 0.03
    for i in range(1, len(stamps) - 1, 2):  # the next turn (whoever's) starts after the gap
        assert stamps[i + 1] - stamps[i] >= 0.03


def test_without_a_gap_nothing_sleeps():
    start = time.perf_counter()
    timing.alternate({"A": lambda: None, "B": lambda: None}, 50, warmup=0, settle=1)
    assert time.perf_counter() - start < 0.03
