"""minibert/runs/exits.py: `minibert exits` prints the accuracy / blocks / speed curve, speeds timed warm and
alternating."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import toy
from minibert import BertForSequenceClassification, BertTokenizer, InputError
from minibert.training import depth


def test_exits_cli_prints_the_curve(tiny_teacher_dir, tmp_path):
    texts, labels = toy(32, seed=7)
    data = tmp_path / "d.csv"
    data.write_text("text,label\n" + "\n".join(f"{t},{y}" for t, y in zip(texts, labels)) + "\n")
    out = subprocess.run([sys.executable, "-m", "minibert", "exits", "--model", str(tiny_teacher_dir), "--train",
                          str(data), "--eval", str(data), "--out", str(tmp_path / "ee"), "--epochs", "1", "--quiet"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "| full model |" in out.stdout and "| patience 4 |" in out.stdout and "entropy < 0.693" in out.stdout
    saved = json.loads((tmp_path / "ee" / "exits.json").read_text())
    assert len(saved["exit_accuracy"]) == 4
    full = next(r for r in saved["curve"] if r["rule"] == "full model")
    last = next(r for r in saved["curve"] if r["rule"] == "entropy" and r["value"] == 0)
    assert last["accuracy"] == full["accuracy"] and last["blocks"] == 4.0


def test_exit_speeds_are_warmed_up_alternating_medians_with_their_spread(tiny_teacher_dir, monkeypatch):
    """`minibert exits` timed each rule once, the full model first and cold (one run read 10x, the next
    0.12x, for rules that run every block). Every rule is now called once to warm up, then once per round
    with the order rotated each round, and the speed-up is the median of paired ratios with quartiles."""
    from minibert.tools import timing

    tok = BertTokenizer.from_pretrained(tiny_teacher_dir)
    model = BertForSequenceClassification.from_pretrained(tiny_teacher_dir)
    ee = depth.EarlyExit(model)
    texts, labels = toy(16, seed=3)
    calls = []
    real = timing.alternate

    def recorded(fns, rounds, **kw):  # the exit rules' timing (not the fast path's kernel calibration)
        if ("full model", None) in fns:
            fns = {name: (lambda name=name, f=f: (calls.append(name), f())) for name, f in fns.items()}
        return real(fns, rounds, **kw)
    monkeypatch.setattr(timing, "alternate", recorded)
    rows = depth.exit_curve(ee, tok, texts, labels, entropies=[0.0], patiences=[4], rounds=3)
    rules = [("full model", None), ("entropy", 0.0), ("patience", 4)]
    assert [r["rule"] for r in rows] == [r for r, _ in rules]
    assert all(calls.count(rule) == 1 + 3 for rule in rules)  # a warm-up call, then one per round
    firsts = [calls[i] for i in range(3, len(calls), 3)]
    assert firsts == [rules[0], rules[1], rules[2]]  # each round starts with another rule
    for row in rows:
        low, high = row["speedup_spread"]
        assert low <= row["speedup"] <= high
    assert "speed-up vs full model (quartiles)" in depth.curve_table(rows)
    with pytest.raises(InputError, match="rounds must be a positive integer"):
        depth.exit_curve(ee, tok, texts, labels, rounds=0)
