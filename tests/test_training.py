"""The fine-tuning loop (issue 13, part 2): one optimisation step equals transformers' (loss, gradients,
updated weights), accumulation equals a bigger batch, runs are seed-deterministic, parameter groups
follow BERT's recipe, the best checkpoint and metrics.json are written, and a tiny task is learnt.

Dropout is off in the step-parity test: dropout draws random numbers in a different order in any two
implementations, so with it on no two libraries give the same step.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from conftest import hf_config, random_hf_model, transformers
from minibert import BertForSequenceClassification, BertTokenizer, InputError
from minibert.loading import tensor_map
from minibert.training.data import classification_batches
from minibert.training.loop import FitConfig, fit, parameter_groups, warmup_then_linear_decay

TINY = dict(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
WORDS_GOOD = ["good", "great", "fine", "nice", "happy"]
WORDS_BAD = ["bad", "awful", "poor", "sad", "terrible"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, minilm_dir):
    """A tiny 3-class classifier saved by transformers, dropout off, MiniLM's vocabulary beside it."""
    directory = tmp_path_factory.mktemp("tiny_classifier")
    config = hf_config(**TINY, id2label={0: "a", 1: "b", 2: "c"}, label2id={"a": 0, "b": 1, "c": 2},
                       hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    random_hf_model(config, seed=7, cls=transformers.BertForSequenceClassification).save_pretrained(directory)
    shutil.copy(minilm_dir / "vocab.txt", directory / "vocab.txt")
    return directory


def their_name(ours: str, config) -> str:
    names = {f"bert.{o}": f"bert.{t}" for t, o, _ in tensor_map(config)}
    names.update({"classifier.weight": "classifier.weight", "classifier.bias": "classifier.bias"})
    return names[ours]


def a_batch(tiny_dir):
    tok = BertTokenizer.from_pretrained(tiny_dir)
    batch = dict(tok(["the bank approved it", "no", "a river bank in spring time"], ["yes", "maybe so", "ok"],
                     padding=True, return_tensors="pt"))
    batch["labels"] = torch.tensor([2, 0, 1])
    return batch


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


def toy_task(n=48, seed=0):
    """Sentences with a "good" or a "bad" word in them: label 1 or 0."""
    import random

    rng = random.Random(seed)
    texts, labels = [], []
    for i in range(n):
        good = i % 2 == 0
        word = rng.choice(WORDS_GOOD if good else WORDS_BAD)
        texts.append(f"the day was {word} and the food was {rng.choice(['hot', 'cold', 'warm'])}")
        labels.append(int(good))
    return texts, labels


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


# ------------------------------------------------------------------------------------------- recipes
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


def test_lora_starts_exact_trains_little_and_merges(tiny_dir, tmp_path):
    from minibert.training.lora import (adapter_state, apply_lora, load_adapters, merge_lora, save_adapters,
                                       trainable_share)

    model = BertForSequenceClassification.from_pretrained(tiny_dir)
    batch = a_batch(tiny_dir)
    with torch.no_grad():
        before = model(**batch).logits
    apply_lora(model, r=4, alpha=8)
    with torch.no_grad():
        assert torch.equal(model(**batch).logits, before)  # B = 0: the same function at the start
    assert 0 < trainable_share(model) < 0.1
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {n for n in trainable if "lora_" in n or n.startswith("classifier.")}
    texts, labels = toy_task(16)
    tok = BertTokenizer.from_pretrained(tiny_dir)
    fit(model, classification_batches(tok, texts, labels, batch_size=8, max_length=16),
        config=FitConfig(epochs=2, lr=1e-2, progress=False))
    model.eval()
    with torch.no_grad():
        adapted = model(**batch).logits
    assert not torch.allclose(adapted, before)
    assert all("lora_" in n or n.startswith("classifier.") for n in adapter_state(model))
    save_adapters(model, tmp_path / "adapters.safetensors")
    fresh = apply_lora(BertForSequenceClassification.from_pretrained(tiny_dir), r=4, alpha=8).eval()
    load_adapters(fresh, tmp_path / "adapters.safetensors")
    with torch.no_grad():
        assert torch.equal(fresh(**batch).logits, adapted)  # the adapters alone restore the trained model
    with pytest.raises(InputError, match="do not fit"):
        load_adapters(apply_lora(BertForSequenceClassification.from_pretrained(tiny_dir), r=2),
                      tmp_path / "adapters.safetensors")
    merge_lora(model)
    with torch.no_grad():
        assert (model(**batch).logits - adapted).abs().max() <= 1e-5  # merging changes nothing
    model.save_pretrained(tmp_path)  # plain Linear layers again: a transformers checkpoint
    theirs = transformers.BertForSequenceClassification.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        assert (theirs(**batch).logits - adapted).abs().max() <= 1e-5
    with pytest.raises(InputError, match="targets"):
        apply_lora(BertForSequenceClassification.from_pretrained(tiny_dir), targets=("nonsense",))


def test_lora_forward_equals_peft(tiny_dir):
    """peft (if installed) computes the same adapted function from the same A and B."""
    peft = pytest.importorskip("peft")
    from minibert.training.lora import apply_lora

    ours = BertForSequenceClassification.from_pretrained(tiny_dir)
    theirs = transformers.BertForSequenceClassification.from_pretrained(tiny_dir).eval()
    apply_lora(ours, r=4, alpha=8)
    theirs = peft.get_peft_model(theirs, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["query", "value"],
                                                         lora_dropout=0.0)).eval()
    torch.manual_seed(0)
    for i, block in enumerate(ours.bert.encoder.blocks):
        for target in ("query", "value"):
            mine = getattr(block.attn, target)
            with torch.no_grad():
                mine.lora_B.normal_()
            layer = theirs.base_model.model.bert.encoder.layer[i].attention.self
            peft_layer = getattr(layer, target)
            with torch.no_grad():
                peft_layer.lora_A["default"].weight.copy_(mine.lora_A)
                peft_layer.lora_B["default"].weight.copy_(mine.lora_B)
    ours.eval()
    batch = a_batch(tiny_dir)
    batch.pop("labels")
    with torch.no_grad():
        assert (ours(**batch).logits - theirs(**batch).logits).abs().max() <= 1e-5


def test_lora_on_the_feed_forward_with_pefts_target_names_equals_peft(tiny_dir):
    """The same target list as peft's (transformers' module names, the feed-forward included) adapts the same
    layers; with the same A and B the logits agree, on the readable path and the fast path."""
    peft = pytest.importorskip("peft")
    from minibert.tools import fast
    from minibert.training.lora import apply_lora, transformers_path

    names = ["query", "intermediate.dense", "output.dense"]  # output.dense: W_O and the FFN output, as in peft
    ours = apply_lora(BertForSequenceClassification.from_pretrained(tiny_dir), r=4, alpha=8, targets=names)
    theirs = transformers.BertForSequenceClassification.from_pretrained(tiny_dir).eval()
    theirs = peft.get_peft_model(theirs, peft.LoraConfig(r=4, lora_alpha=8, target_modules=names,
                                                         lora_dropout=0.0)).eval()
    adapted_theirs = {n.removeprefix("base_model.model.") for n, m in theirs.named_modules() if hasattr(m, "lora_A")}
    mine = {n: m for n, m in ours.named_modules() if type(m).__name__ == "LoRALinear"}
    assert {transformers_path(n) for n in mine} == adapted_theirs
    torch.manual_seed(0)
    for name, layer in mine.items():
        with torch.no_grad():
            layer.lora_B.normal_(0, 0.1)
        peft_layer = theirs.base_model.model.get_submodule(transformers_path(name))
        with torch.no_grad():
            peft_layer.lora_A["default"].weight.copy_(layer.lora_A)
            peft_layer.lora_B["default"].weight.copy_(layer.lora_B)
    ours.eval()
    batch = a_batch(tiny_dir)
    batch.pop("labels")
    with torch.no_grad():
        want = theirs(**batch).logits
        assert (ours(**batch).logits - want).abs().max() <= 1e-5
        pooled = fast.prepare(ours.bert)(**batch).pooler_output
        assert (ours.classifier(pooled) - want).abs().max() <= 1e-4


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
