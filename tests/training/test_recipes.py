"""minibert/training/recipes.py: gradual unfreezing, the ScalarMix classifier."""

from __future__ import annotations

import torch

from conftest import a_batch, toy_task
from minibert import BertForSequenceClassification, BertTokenizer
from minibert.training.data import classification_batches
from minibert.training.loop import FitConfig, fit


def test_gradual_unfreezing_opens_one_block_per_stage(tiny_dir):
    from minibert.training.recipes import gradual_unfreezing

    model = BertForSequenceClassification.from_pretrained(tiny_dir)
    step = gradual_unfreezing(every=2)

    def trains(part):
        return all(p.requires_grad for p in part.parameters())

    blocks = model.bert.encoder.blocks
    step(model, 0)
    assert trains(model.classifier) and trains(model.bert.pooler)
    assert not any(trains(b) for b in blocks) and not trains(model.bert.embeddings)
    step(model, 2)
    assert trains(blocks[1]) and not trains(blocks[0]) and not trains(model.bert.embeddings)
    step(model, 4)
    assert trains(blocks[0]) and not trains(model.bert.embeddings)
    step(model, 6)
    assert trains(model.bert.embeddings)


def test_gradual_unfreezing_inside_fit_keeps_frozen_parts_fixed(tiny_dir):
    from minibert.training.recipes import gradual_unfreezing

    tok = BertTokenizer.from_pretrained(tiny_dir)
    texts, labels = toy_task(16)
    model = BertForSequenceClassification.from_encoder(tiny_dir, labels=["bad", "good"], seed=0)
    block0 = model.bert.encoder.blocks[0].attn.query.weight.detach().clone()
    block1 = model.bert.encoder.blocks[1].attn.query.weight.detach().clone()
    batches = classification_batches(tok, texts, labels, batch_size=8, max_length=16)
    fit(model, batches, config=FitConfig(epochs=2, lr=1e-2, progress=False), on_epoch_start=gradual_unfreezing())
    assert torch.equal(model.bert.encoder.blocks[0].attn.query.weight, block0)  # never opened in 2 epochs
    assert not torch.equal(model.bert.encoder.blocks[1].attn.query.weight, block1)  # opened in epoch 2


def test_scalarmix_classifier_trains_only_the_mix_and_head(tiny_dir, tmp_path):
    from minibert.model import BertModel
    from minibert.training.recipes import ScalarMixClassifier

    encoder = BertModel.from_pretrained(tiny_dir)
    frozen = {n: p.detach().clone() for n, p in encoder.named_parameters()}
    model = ScalarMixClassifier(encoder, ["bad", "good"], seed=0)
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {
        "mix.scalar_parameters", "mix.gamma", "classifier.weight", "classifier.bias"}
    tok = BertTokenizer.from_pretrained(tiny_dir)
    texts, labels = toy_task(32)
    fit(model, classification_batches(tok, texts, labels, batch_size=8, max_length=16),
        config=FitConfig(epochs=3, lr=1e-2, progress=False))
    assert all(torch.equal(p, frozen[n]) for n, p in model.bert.named_parameters())
    assert not torch.allclose(model.mix.weights, torch.full((3,), 1 / 3))
    model.save_pretrained(tmp_path)
    again = ScalarMixClassifier.from_pretrained(tmp_path)
    batch = a_batch(tiny_dir)
    batch.pop("labels")
    with torch.no_grad():
        assert torch.equal(again(**batch).logits, model.eval()(**batch).logits)
    assert again.predict(["a fine day"], tokenizer=tok)[0]["label"] in ("bad", "good")
