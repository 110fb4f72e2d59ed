"""Per-block gradient diagnostics and the unigram-plateau detector (minibert/training/diagnostics.py)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch

from minibert import BertConfig
from minibert.models.pretraining import BertForMaskedLM
from minibert.training.diagnostics import BlockGradients, PlateauWatch, block_groups, unigram_rate
from minibert.training.loop import TrainState, train
from minibert.training.settings import PretrainConfig


def test_block_gradients_are_the_norms_and_ratios_by_hand():
    config = BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=3, num_attention_heads=2,
                        intermediate_size=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = BertForMaskedLM.from_config(config, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = TrainState(model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0))
    ids = torch.randint(1, 40, (4, 6), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    block = dict(model.named_parameters())
    names = [n for n in block if ".blocks.1." in n]
    seen = {}

    def loss(m, b):  # the gradient the probe sees: the one this loss gives, taken again by hand
        value = m(**b).loss
        seen["grads"] = torch.autograd.grad(value, [block[n] for n in names], retain_graph=True)
        seen["before"] = [block[n].detach().clone() for n in names]
        return value

    probe = BlockGradients(every=2)
    train(state, [[batch]], loss, PretrainConfig(steps=1, max_grad_norm=None, progress=False), probe=probe)
    record = probe.take()
    assert sorted(block_groups(model)) == ["block 0", "block 1", "block 2", "embeddings", "rest"]
    assert len(record["grad_norm"]) == 3 and probe.take() is None
    by_hand = math.sqrt(sum(float(g.pow(2).sum()) for g in seen["grads"]))
    assert record["grad_norm"][1] == pytest.approx(by_hand, rel=1e-5)
    moved = math.sqrt(sum(float((block[n].detach() - w).pow(2).sum()) for n, w in zip(names, seen["before"])))
    size = math.sqrt(sum(float(w.pow(2).sum()) for w in seen["before"]))
    assert record["update_ratio"][1] == pytest.approx(moved / size, rel=1e-5)
    assert [probe.wants(s) for s in range(6)] == [True, True, False, True, False, True]  # the first, then every 2


def test_the_unigram_rate_and_the_detector():
    stream = np.array([101, 7, 7, 7, 9, 102, 101, 7, 9, 8, 102])
    specials = np.zeros(120, dtype=bool)
    specials[[101, 102]] = True
    assert unigram_rate(stream, specials) == (pytest.approx(4 / 7), 7)  # [CLS] and [SEP] are never masked
    watch = PlateauWatch(0.05, 1012, after=100)
    assert watch.check(50, 0.05) is None  # before the step the user set: not yet
    assert watch.check(100, 0.30) is None  # learning: silent
    said = watch.check(200, 0.052)
    assert "unigram plateau" in said and "--norm pre" in said and "--warmup" in said
    assert watch.check(300, 0.05) is None  # said once
    assert "--norm pre" not in PlateauWatch(0.05, 1, 1, placement="pre").check(1, 0.0)


COLOURS = "red green blue yellow black white orange purple brown pink".split()  # each word has one successor


def _pretrain(folder, minilm_dir, out, *extra):
    return subprocess.run([sys.executable, "-m", "minibert", "pretrain", "--corpus", str(folder / "train.txt"),
                           "--eval-texts", str(folder / "held.txt"), "--vocab", str(minilm_dir), "--blocks", "1",
                           "--hidden", "64", "--heads", "2", "--max-length", "24", "--batch-size", "16",
                           "--dropout", "0", "--steps", "60", "--eval-every", "30", "--plateau-step", "30",
                           "--out", str(out), "--quiet", *extra], capture_output=True, text=True, timeout=300)


def test_the_detector_fires_on_a_run_stuck_on_the_plateau_and_not_on_one_that_learns(minilm_dir, tmp_path, capsys):
    """A corpus of ten colour words in a fixed order (unigram rate 0.1; each masked word is given by its
    neighbours). Stuck: a learning rate too small to leave the start (1e-7): its held-out accuracy stays at
    or under the unigram rate. Learning: lr 1e-2 reaches accuracy 1.0 by step 40 (measured) -- with pre-LN,
    the per-block records and their figure."""
    (tmp_path / "train.txt").write_text("\n\n".join(" ".join(COLOURS) for _ in range(400)) + "\n")
    (tmp_path / "held.txt").write_text("\n".join(" ".join(COLOURS) for _ in range(40)) + "\n")
    stuck = _pretrain(tmp_path, minilm_dir, tmp_path / "stuck", "--lr", "1e-7")
    assert stuck.returncode == 0, stuck.stderr[-2000:]
    assert "stuck on the unigram plateau" in stuck.stderr and "--warmup" in stuck.stderr  # even with --quiet
    assert "unigram rate 0.100" in stuck.stderr
    lines = [json.loads(x) for x in (tmp_path / "stuck" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if "plateau" in r] == [30]  # said once
    learnt = _pretrain(tmp_path, minilm_dir, tmp_path / "learnt", "--lr", "1e-2", "--warmup", "0.05",
                       "--grad-every", "20", "--norm", "pre")
    assert learnt.returncode == 0, learnt.stderr[-2000:]
    assert "unigram plateau" not in learnt.stderr, learnt.stderr[-2000:]
    lines = [json.loads(x) for x in (tmp_path / "learnt" / "log.jsonl").read_text().splitlines()]
    assert [r["masked_accuracy"] for r in lines if "masked_accuracy" in r][-1] > 0.5
    measured = [r for r in lines if "grad_norm" in r]
    assert [r["step"] for r in measured] == [1, 20, 40, 60] and all(len(r["grad_norm"]) == 1 for r in measured)
    assert (tmp_path / "learnt" / "gradients.png").stat().st_size > 10_000 and "gradients.png" in learnt.stdout
    assert json.loads((tmp_path / "learnt" / "config.json").read_text())["norm_placement"] == "pre"
    from minibert.cli import main  # in this process: an argument error needs no interpreter of its own

    with pytest.raises(SystemExit), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        main(["pretrain", "--corpus", str(tmp_path / "train.txt"), "--model", str(tmp_path / "learnt"), "--norm",
              "deepnorm", "--steps", "1", "--out", str(tmp_path / "x")])
    assert "--norm deepnorm builds a new model from scratch" in capsys.readouterr().err
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from minibert.models import BertModel

        assert type(BertModel.from_pretrained(tmp_path / "learnt").encoder.blocks[0]).__name__ == "PreLNBlock"
