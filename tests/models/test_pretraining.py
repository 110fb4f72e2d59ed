"""minibert/models/pretraining.py: the masked-LM and NSP heads against transformers (tied and untied decoders,
checkpoints both ways), sparse prediction."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from conftest import TINY_PRETRAIN as TINY, hf_config, pretraining_batch as _batch, random_hf_model, transformers
from minibert import BertForMaskedLM, BertForPreTraining, BertModel


def test_heads_equal_transformers_and_checkpoints_go_both_ways(pretraining_dir, tmp_path):
    batch, labels, nsl = _batch()
    hf_pre = transformers.BertForPreTraining.from_pretrained(pretraining_dir).eval()
    ours = BertForPreTraining.from_pretrained(pretraining_dir).eval()
    with torch.no_grad():
        a = ours(**batch, labels=labels, next_sentence_label=nsl, return_logits=True)
        b = hf_pre(**batch, labels=labels, next_sentence_label=nsl)
    assert (a.prediction_logits - b.prediction_logits).abs().max() <= 1e-5
    assert (a.seq_relationship_logits - b.seq_relationship_logits).abs().max() <= 1e-5
    assert abs(float(a.loss) - float(b.loss)) <= 1e-5
    hf_mlm = transformers.BertForMaskedLM.from_pretrained(pretraining_dir).eval()
    mlm = BertForMaskedLM.from_pretrained(pretraining_dir).eval()
    with torch.no_grad():
        c, d = mlm(**batch, labels=labels, return_logits=True), hf_mlm(**batch, labels=labels)
    assert (c.logits - d.logits).abs().max() <= 1e-5 and abs(float(c.loss) - float(d.loss)) <= 1e-5
    # ours -> transformers, both classes; and an encoder / a classifier start from it
    ours.save_pretrained(tmp_path / "pre")
    assert json.loads((tmp_path / "pre" / "config.json").read_text())["architectures"] == ["BertForPreTraining"]
    back = transformers.BertForPreTraining.from_pretrained(tmp_path / "pre").eval()
    with torch.no_grad():
        e = back(**batch, labels=labels, next_sentence_label=nsl)
    assert (e.prediction_logits - b.prediction_logits).abs().max() == 0 and float(e.loss) == float(b.loss)
    mlm.save_pretrained(tmp_path / "mlm")
    assert transformers.BertForMaskedLM.from_pretrained(tmp_path / "mlm").eval()(**batch).logits.shape == (3, 12, 30522)
    assert BertModel.from_pretrained(tmp_path / "pre").mlm_head is not None
    from minibert import BertForSequenceClassification

    classifier = BertForSequenceClassification.from_encoder(tmp_path / "pre", labels=["a", "b"])
    assert classifier(**batch).logits.shape == (3, 2)
    from minibert import BertConfig

    BertForMaskedLM.from_config(BertConfig(**TINY)).save_pretrained(tmp_path / "scratch")  # no pooler, as transformers'
    with pytest.warns(UserWarning, match="has no pooler, which BertForSequenceClassification classifies"):
        classifier = BertForSequenceClassification.from_encoder(tmp_path / "scratch", labels=["a", "b"], seed=1)
    assert classifier(**batch).logits.shape == (3, 2) and 0.015 < float(classifier.bert.pooler.dense.weight.detach().std()) < 0.025


def test_an_untied_decoder_equals_transformers_and_goes_both_ways(tmp_path):
    """tie_word_embeddings=false (the --untied ablation): transformers' checkpoint (its own
    cls.predictions.decoder.weight) loads to the same logits, loss and gradients, ours saves back to the same
    tensors, a run's scores come from the decoder, not the embeddings, and a tied config refuses a decoder
    that differs from the embeddings."""
    from safetensors.torch import load_file, save_file

    from minibert import BertConfig

    batch, labels, _ = _batch(vocab=120, seed=3)
    small = TINY | dict(vocab_size=120)
    theirs = random_hf_model(hf_config(**small, tie_word_embeddings=False), seed=5, cls=transformers.BertForMaskedLM)
    theirs.save_pretrained(tmp_path / "hf")
    decoder = theirs.cls.predictions.decoder.weight
    assert not torch.equal(decoder, theirs.bert.embeddings.word_embeddings.weight)
    ours = BertForMaskedLM.from_pretrained(tmp_path / "hf").eval()
    assert ours.config.tie_word_embeddings is False and torch.equal(ours.bert.mlm_head.decoder, decoder)
    a, b = ours(**batch, labels=labels, return_logits=True), theirs(**batch, labels=labels)
    assert (a.logits - b.logits).abs().max() <= 1e-5 and abs(a.loss.item() - b.loss.item()) <= 1e-5
    a.loss.backward()
    b.loss.backward()
    assert torch.allclose(ours.bert.mlm_head.decoder.grad, decoder.grad, atol=1e-7, rtol=1e-5)
    assert torch.allclose(ours.bert.embeddings.word.weight.grad, theirs.bert.embeddings.word_embeddings.weight.grad,
                          atol=1e-7, rtol=1e-5)
    ours.save_pretrained(tmp_path / "ours")
    saved, original = load_file(str(tmp_path / "ours" / "model.safetensors")), load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert json.loads((tmp_path / "ours" / "config.json").read_text())["tie_word_embeddings"] is False
    assert sorted(saved) == sorted(k for k in original if "position_ids" not in k)
    # transformers 5 scores an untied head with the decoder's own bias (cls.predictions.bias is then unused):
    # that one is read, and written under both names
    assert all(torch.equal(saved[k], original[k]) for k in saved if k != "cls.predictions.bias")
    assert torch.equal(saved["cls.predictions.bias"], original["cls.predictions.decoder.bias"])
    back = transformers.BertForMaskedLM.from_pretrained(tmp_path / "ours").eval()
    assert (back(**batch).logits - b.logits).abs().max() == 0
    assert (BertModel.from_pretrained(tmp_path / "ours").mlm_logits(a.hidden_states[-1]) - a.logits).abs().max() == 0
    fresh = BertForMaskedLM.from_config(BertConfig(**small, tie_word_embeddings=False), seed=0)
    tied = BertForMaskedLM.from_config(BertConfig(**small), seed=0)
    assert 0.015 < float(fresh.bert.mlm_head.decoder.detach().std()) < 0.025
    assert all(torch.equal(p, tied.bert.state_dict()[k]) for k, p in fresh.bert.state_dict().items()
               if not k.startswith("mlm_head.decoder"))  # the encoder and head start as the tied model's
    config = json.loads((tmp_path / "ours" / "config.json").read_text())
    del config["tie_word_embeddings"]  # now it says tied, but the decoder is not the embeddings
    (tmp_path / "ours" / "config.json").write_text(json.dumps(config))
    with pytest.raises(Exception, match="differs from"):
        BertForMaskedLM.from_pretrained(tmp_path / "ours")
    saved.pop("cls.predictions.decoder.weight")
    save_file(saved, str(tmp_path / "ours" / "model.safetensors"))
    config["tie_word_embeddings"] = False
    (tmp_path / "ours" / "config.json").write_text(json.dumps(config))
    with pytest.raises(Exception, match="missing tensor.*cls.predictions.decoder.weight"):
        BertForMaskedLM.from_pretrained(tmp_path / "ours")


def test_a_checkpoint_without_heads_gets_fresh_ones_and_says_so(minilm_dir):
    with pytest.warns(UserWarning, match=r"no masked-LM head .* fresh one, seed 3"):
        mlm = BertForMaskedLM.from_pretrained(minilm_dir, seed=3)
    assert torch.equal(mlm.bert.mlm_head.norm.weight, torch.ones(384))
    assert 0.015 < float(mlm.bert.mlm_head.transform.weight.detach().std()) < 0.025
    with pytest.warns(UserWarning, match="next-sentence head"):
        pre = BertForPreTraining.from_pretrained(minilm_dir)
    assert pre.nsp.weight.shape == (2, 384)


def test_sparse_prediction_gives_the_dense_loss_and_gradients(pretraining_dir):
    """The vocabulary projection at the masked positions only: the same loss and gradients as projecting
    every position and ignoring the unlabelled ones (transformers' way)."""
    batch, labels, _ = _batch(seed=2)
    sparse, dense = BertForMaskedLM.from_pretrained(pretraining_dir), BertForMaskedLM.from_pretrained(pretraining_dir)
    loss = sparse(**batch, labels=labels).loss
    loss.backward()
    logits = dense(**batch).prediction_logits  # (B, T, V): every position
    reference = F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1), ignore_index=-100)
    reference.backward()
    assert abs(loss.item() - reference.item()) <= 1e-6 * reference.item()
    for (name, p), q in zip(sparse.named_parameters(), dense.parameters()):
        if p.grad is None:  # the pooler: the masked LM does not read it
            assert q.grad is None, name
            continue
        assert torch.allclose(p.grad, q.grad, atol=1e-7, rtol=1e-5), name
