"""minibert/training/depth.py: LayerDrop (blocks skipped while training only, a prunable model) and early exits
(each row's exit, frozen or joint training, round trips)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from conftest import toy
from minibert import BertForSequenceClassification, BertTokenizer, InputError
from minibert.training import depth
from minibert.training.data import classification_batches
from minibert.training.loop import FitConfig, fit


def test_layerdrop_skips_blocks_while_training_only(tiny_teacher_dir):
    model = BertForSequenceClassification.from_pretrained(tiny_teacher_dir)
    batch = dict(BertTokenizer.from_pretrained(tiny_teacher_dir)(["the day was good", "bad"], padding=True,
                                                                  return_tensors="pt"))
    with torch.no_grad():
        plain = model(**batch).logits
    drop = depth.LayerDrop(model, 0.5, seed=3)
    with torch.no_grad():
        assert torch.equal(model(**batch).logits, plain)  # eval mode: no effect
        model.train()
        seen = []
        for _ in range(200):
            logits = model(**batch).logits
            skipped = drop.dropped[-1]
            seen.append(skipped)
        model.eval()
        want = model.classifier(model.bert(**batch, skip_blocks=skipped).pooler_output)
    assert torch.equal(logits, want)  # the last pass really skipped what it recorded
    assert all(len(s) < 4 for s in seen)  # at least one block always runs
    share = sum(len(s) for s in seen) / (4 * len(seen))
    assert 0.4 < share < 0.6
    drop.remove()
    model.train()
    with torch.no_grad():
        model(**batch)
    assert len(drop.dropped) == 200  # removed: no more draws
    again = depth.LayerDrop(model, 0.5, seed=3)
    with torch.no_grad():
        for _ in range(200):
            model(**batch)
    assert again.dropped == seen  # the same seed, the same draws
    again.remove()
    with pytest.raises(InputError, match=r"\[0, 1\)"):
        depth.LayerDrop(model, 1.0)


def test_spread_blocks_keeps_the_top_block():
    assert depth.spread_blocks(6, 3) == [1, 3, 5]
    assert depth.spread_blocks(6, 6) == list(range(6))
    assert depth.spread_blocks(6, 1) == [5]
    assert depth.spread_blocks(12, 4) == [2, 5, 8, 11]
    with pytest.raises(InputError, match="keep"):
        depth.spread_blocks(6, 7)


def test_finetune_with_layerdrop_writes_a_prunable_model(tiny_encoder_dir, tmp_path):
    from minibert.runs.finetune import finetune
    from minibert.runs.settings import FinetuneRun

    texts, labels = toy(32, seed=4)
    data = tmp_path / "d.csv"
    data.write_text("text,label\n" + "\n".join(f"{t},{y}" for t, y in zip(texts, labels)) + "\n")
    history = finetune(FinetuneRun(train=data, eval=data, model=tiny_encoder_dir, out=tmp_path / "ld", layerdrop=0.3,
                                   epochs=1, lr=1e-3, progress=False, max_length=16))
    model = BertForSequenceClassification.from_pretrained(tmp_path / "ld")
    assert not model.bert._forward_pre_hooks  # the LayerDrop hook is gone from the saved model's source
    assert history.best_metric is not None
    with pytest.raises(InputError, match="scalarmix"):
        finetune(FinetuneRun(train=data, eval=data, model=tiny_encoder_dir, out=tmp_path / "x", layerdrop=0.3,
                             recipe="scalarmix"))


def early_exit_model(tiny_teacher_dir, frozen=True):
    model = BertForSequenceClassification.from_pretrained(tiny_teacher_dir)
    ee = depth.EarlyExit(model, frozen=frozen).eval()
    torch.manual_seed(0)
    with torch.no_grad():  # make the exits disagree and differ in confidence, as trained ones do
        for ramp in ee.ramps:
            ramp[0].weight.normal_(0, 0.5)
            ramp[3].weight.normal_(0, 2.0)
    return ee


def test_each_row_gets_the_logits_of_the_exit_it_took(tiny_teacher_dir):
    ee = early_exit_model(tiny_teacher_dir)
    tok = BertTokenizer.from_pretrained(tiny_teacher_dir)
    texts, _ = toy(12, seed=5)
    texts[3] = "bad"  # rows of different lengths: padding in the batch
    batch = tok(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        every = ee(**batch).logits  # (4 exits, B, C), readable path, nobody leaves
        plain = ee.model(**batch).logits
    assert torch.equal(every[-1], plain)  # the last exit is the model itself
    B = len(texts)
    seen_exits = set()
    rules = [{"entropy": e} for e in depth.entropy_thresholds(2, 12)] + [{"patience": k} for k in (1, 2, 3, 4)]
    for rule in rules:
        out = ee.predict_batch(batch["input_ids"], batch["attention_mask"], **rule)
        want = every[out.exits, torch.arange(B)]
        assert (out.logits - want).abs().max() <= 1e-5, rule  # fast path vs readable path, per row
        seen_exits |= set(out.exits.tolist())
        if rule.get("entropy") is not None:  # a row exits at the first exit below the threshold
            p = every.softmax(-1)
            entropy = -(torch.xlogy(p, p)).sum(-1)  # (exits, B)
            for row, e in enumerate(out.exits.tolist()):
                below = (entropy[:, row] < rule["entropy"]).nonzero().flatten().tolist()
                assert e == (below[0] if below else 3)
    assert seen_exits == {0, 1, 2, 3}  # the rules really spread rows over the depths
    never = ee.predict_batch(batch["input_ids"], batch["attention_mask"], entropy=0.0)
    assert never.exits.tolist() == [3] * B and never.blocks_run == 4
    always = ee.predict_batch(batch["input_ids"], batch["attention_mask"], entropy=math.log(2) + 1e-6)
    assert always.exits.tolist() == [0] * B and always.blocks_run == 1
    one = ee.predict_batch(batch["input_ids"], batch["attention_mask"], patience=1)
    assert one.exits.tolist() == [0] * B
    with pytest.raises(InputError, match="exactly one"):
        ee.predict_batch(batch["input_ids"], entropy=0.1, patience=2)
    with pytest.raises(InputError, match="patience"):
        ee.predict_batch(batch["input_ids"], patience=5)


def test_exits_train_frozen_or_joint_and_round_trip(tiny_teacher_dir, tmp_path):
    tok = BertTokenizer.from_pretrained(tiny_teacher_dir)
    texts, labels = toy(48, seed=6)
    ids = [["neg", "pos"].index(y) for y in labels]
    batches = classification_batches(tok, texts, ids, batch_size=8, max_length=16)
    frozen = depth.EarlyExit(BertForSequenceClassification.from_pretrained(tiny_teacher_dir))
    encoder_before = {k: v.clone() for k, v in frozen.model.state_dict().items()}
    before = depth.exit_accuracies(frozen, tok, texts, labels)
    fit(frozen, batches, config=FitConfig(epochs=4, lr=3e-3, progress=False))
    after = depth.exit_accuracies(frozen, tok, texts, labels)
    assert all(torch.equal(v, frozen.model.state_dict()[k]) for k, v in encoder_before.items())  # frozen: unchanged
    assert after[-1] == before[-1] and min(after[:-1]) >= 0.9
    frozen.save_pretrained(tmp_path / "ee")
    loaded = depth.EarlyExit.from_pretrained(tmp_path / "ee")
    batch = tok(texts[:5], padding=True, return_tensors="pt")
    with torch.no_grad():
        assert torch.equal(loaded(**batch).logits, frozen.eval()(**batch).logits)
    labels_out, exits = loaded.predict(texts, tokenizer=tok, entropy=0.3)
    assert len(labels_out) == len(texts) and all(0 <= e <= 3 for e in exits)
    joint = depth.EarlyExit(BertForSequenceClassification.from_pretrained(tiny_teacher_dir), frozen=False).train()
    out = joint(**batch, labels=torch.tensor(ids[:5]))
    losses = torch.stack([F.cross_entropy(z, torch.tensor(ids[:5])) for z in out.logits])
    assert torch.allclose(out.loss, (torch.arange(1.0, 5.0) * losses).sum() / 10)  # PABEE's weights 1..N
    assert any(p.requires_grad for p in joint.model.parameters())
    with pytest.raises(InputError, match="plain classifier"):
        depth.EarlyExit.from_pretrained(tiny_teacher_dir)
