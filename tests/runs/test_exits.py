"""minibert/runs/exits.py: `minibert exits` prints the accuracy / blocks / speed curve, speeds timed warm and
alternating."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

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


def test_exits_take_a_device_checked_before_any_work(tiny_teacher_dir, tmp_path, capsys):
    """``--device`` (issue 61): the exits train and are measured where it says; the CPU run equals one without
    the option, bit for bit; a device this machine lacks is refused before any folder is made."""
    from conftest import cli_error
    from minibert.cli import main

    texts, labels = toy(24, seed=5)
    data = tmp_path / "d.csv"
    data.write_text("text,label\n" + "\n".join(f"{t},{y}" for t, y in zip(texts, labels)) + "\n")
    common = ["exits", "--model", str(tiny_teacher_dir), "--train", str(data), "--eval", str(data), "--epochs", "1",
              "--rounds", "1", "--quiet"]
    assert main([*common, "--out", str(tmp_path / "plain")]) == 0
    assert main([*common, "--out", str(tmp_path / "cpu"), "--device", "cpu"]) == 0
    a, b = (json.loads((tmp_path / name / "exits.json").read_text()) for name in ("plain", "cpu"))
    assert a["exit_accuracy"] == b["exit_accuracy"]
    if not torch.cuda.is_available():
        assert "sees no CUDA device" in cli_error(capsys, *common, "--out", tmp_path / "gpu", "--device", "cuda")
        assert not (tmp_path / "gpu").exists()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (runs on a GPU machine)")
def test_exits_train_and_measure_on_a_gpu(tiny_teacher_dir, tmp_path):
    from minibert.cli import main

    texts, labels = toy(24, seed=5)
    data = tmp_path / "d.csv"
    data.write_text("text,label\n" + "\n".join(f"{t},{y}" for t, y in zip(texts, labels)) + "\n")
    common = ["exits", "--model", str(tiny_teacher_dir), "--train", str(data), "--eval", str(data), "--epochs", "1",
              "--rounds", "1", "--quiet", "--joint"]
    assert main([*common, "--out", str(tmp_path / "cpu")]) == 0
    assert main([*common, "--out", str(tmp_path / "gpu"), "--device", "cuda"]) == 0
    a, b = (json.loads((tmp_path / name / "exits.json").read_text()) for name in ("cpu", "gpu"))
    assert len(b["exit_accuracy"]) == len(a["exit_accuracy"]) and all(0 <= x <= 1 for x in b["exit_accuracy"])
    assert {r["rule"] for r in b["curve"]} == {r["rule"] for r in a["curve"]}
