"""minibert/training/lora.py: LoRA exact at the start, merged, and equal to peft."""

from __future__ import annotations

import pytest
import torch

from conftest import a_batch, toy_task, transformers
from minibert import BertForSequenceClassification, BertTokenizer, InputError
from minibert.training.data import classification_batches
from minibert.training.loop import FitConfig, fit


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
