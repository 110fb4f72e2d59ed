"""minibert/training/loop.py: one step equal to transformers', parameter groups and the schedule, accumulation, a
toy task learnt deterministically, bf16 autocast."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import TINY_FINETUNE as TINY, a_batch, toy_task, transformers
from minibert import BertForSequenceClassification, BertTokenizer, InputError
from minibert.loading import tensor_map
from minibert.training.data import classification_batches
from minibert.training.loop import FitConfig, fit, parameter_groups, warmup_then_linear_decay


def their_name(ours: str, config) -> str:
    names = {f"bert.{o}": f"bert.{t}" for t, o, _ in tensor_map(config)}
    names.update({"classifier.weight": "classifier.weight", "classifier.bias": "classifier.bias"})
    return names[ours]


def test_one_training_step_equals_transformers(tiny_dir):
    ours = BertForSequenceClassification.from_pretrained(tiny_dir).train()
    theirs = transformers.BertForSequenceClassification.from_pretrained(tiny_dir).train()
    batch = a_batch(tiny_dir)
    loss_ours, loss_theirs = ours(**batch).loss, theirs(**batch).loss
    assert abs(loss_ours.item() - loss_theirs.item()) <= 1e-6
    loss_ours.backward()
    loss_theirs.backward()
    params = dict(theirs.named_parameters())
    for name, p in ours.named_parameters():
        assert (p.grad - params[their_name(name, ours.config)].grad).abs().max() <= 1e-5, name
    groups_ours = parameter_groups(ours, lr=1e-3, weight_decay=0.01)
    by_name = {n: p for n, p in theirs.named_parameters()}
    groups_theirs = [{"params": [by_name[their_name(n, ours.config)] for n in g["names"]],
                      "weight_decay": g["weight_decay"], "lr": g["lr"]} for g in groups_ours]
    for groups, model in ((groups_ours, ours), (groups_theirs, theirs)):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        torch.optim.AdamW(groups, lr=1e-3).step()
    for name, p in ours.named_parameters():
        assert (p - params[their_name(name, ours.config)]).abs().max() <= 1e-5, name


def test_parameter_groups_decay_weights_only_and_layer_rates():
    torch.manual_seed(0)
    from minibert.config import BertConfig

    model = BertForSequenceClassification(BertConfig(**TINY, id2label={0: "x", 1: "y"}))
    groups = parameter_groups(model, lr=1.0, weight_decay=0.1, layer_decay=0.5)
    rate = {n: g["lr"] for g in groups for n in g["names"]}
    decay = {n: g["weight_decay"] for g in groups for n in g["names"]}
    assert decay["bert.encoder.blocks.0.attn.query.weight"] == 0.1
    assert decay["bert.encoder.blocks.0.attn.query.bias"] == 0.0 and decay["bert.encoder.blocks.1.ffn_norm.weight"] == 0.0
    assert rate["classifier.weight"] == 1.0 and rate["bert.pooler.dense.weight"] == 1.0
    assert rate["bert.encoder.blocks.1.attn.key.weight"] == 0.5  # top block: depth 1
    assert rate["bert.encoder.blocks.0.attn.key.weight"] == 0.25
    assert rate["bert.embeddings.word.weight"] == 0.125
    for p in model.parameters():
        p.requires_grad_(False)
    with pytest.raises(InputError, match="no trainable parameter"):
        parameter_groups(model, lr=1.0)


def test_warmup_then_linear_decay():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    schedule = warmup_then_linear_decay(opt, warmup_steps=2, total_steps=6)
    rates = []
    for _ in range(7):
        rates.append(opt.param_groups[0]["lr"])
        opt.step()
        schedule.step()
    assert rates == pytest.approx([0.0, 0.5, 1.0, 0.75, 0.5, 0.25, 0.0])


def test_accumulating_two_half_batches_equals_one_batch(tiny_dir, minilm_dir):
    tok = BertTokenizer.from_pretrained(tiny_dir)
    texts, labels = toy_task(8)
    results = []
    for batch_size, accumulate in ((8, 1), (4, 2)):
        model = BertForSequenceClassification.from_encoder(tiny_dir, labels=["bad", "good"], seed=3)
        model.config.hidden_dropout_prob = 0.0
        batches = classification_batches(tok, texts, labels, batch_size=batch_size, shuffle=False, max_length=16)
        fit(model, batches, config=FitConfig(epochs=1, lr=1e-3, accumulate=accumulate, warmup_ratio=0.0,
                                             max_grad_norm=None, progress=False))
        results.append(model)
    for (name, a), b in zip(results[0].named_parameters(), results[1].parameters()):
        assert (a - b).abs().max() <= 1e-5, name


def test_fit_learns_a_toy_task_deterministically_and_keeps_the_best(tiny_dir, tmp_path):
    tok = BertTokenizer.from_pretrained(tiny_dir)
    texts, labels = toy_task(64)
    held_out, held_labels = toy_task(32, seed=1)

    def accuracy(model):
        predictions = [p["label"] for p in model.predict(held_out, tokenizer=tok)]
        return {"accuracy": sum(p == ("good" if y else "bad") for p, y in zip(predictions, held_labels)) / len(held_labels)}

    runs = []
    for out in ("a", "b"):
        model = BertForSequenceClassification.from_encoder(tiny_dir, labels=["bad", "good"], seed=0)
        batches = classification_batches(tok, texts, labels, batch_size=8, seed=0, max_length=16)
        history = fit(model, batches, config=FitConfig(epochs=8, lr=1e-2, progress=False), evaluate=accuracy,
                      metric="accuracy", out_dir=tmp_path / out)
        runs.append((model, history))
    (a, ha), (b, hb) = runs
    assert [e["train_loss"] for e in ha.epochs] == [e["train_loss"] for e in hb.epochs]  # seeded: identical
    assert ha.best_metric >= 0.9, ha.epochs
    assert ha.epochs[-1]["train_loss"] < ha.epochs[0]["train_loss"]
    saved = json.loads((tmp_path / "a" / "metrics.json").read_text())
    assert saved["best_epoch"] == ha.best_epoch and len(saved["epochs"]) == 8
    best = BertForSequenceClassification.from_pretrained(tmp_path / "a")
    assert accuracy(best)["accuracy"] == ha.best_metric


def test_bf16_autocast_keeps_fp32_weights_and_tracks_fp32(tiny_dir):
    tok = BertTokenizer.from_pretrained(tiny_dir)
    texts, labels = toy_task(16)
    losses = []
    for bf16 in (False, True):
        model = BertForSequenceClassification.from_encoder(tiny_dir, labels=["bad", "good"], seed=0)
        history = fit(model, classification_batches(tok, texts, labels, batch_size=8, max_length=16),
                      config=FitConfig(epochs=2, lr=1e-2, bf16=bf16, progress=False))
        assert all(p.dtype == torch.float32 for p in model.parameters())  # the master weights
        losses.append([e["train_loss"] for e in history.epochs])
    assert losses[0] != losses[1] and max(abs(a - b) for a, b in zip(*losses)) < 0.05
    with pytest.raises(InputError, match="fp16 training needs a CUDA device"):
        fit(model, classification_batches(tok, texts, labels), config=FitConfig(fp16=True, progress=False))
