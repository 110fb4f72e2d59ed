"""minibert/compat/hf.py: transformers' calling convention, names and tokenizer methods (bert-score runs on it
with transformers' scores)."""

from __future__ import annotations


import pytest
import torch
from torch import nn

from conftest import ROOT, transformers
from minibert import BertTokenizer, InputError
from minibert.compat import ModelOutput, TransformersBertModel, hf as compat_hf
from minibert.tools.hooks import ablate_heads, has_hooks




@pytest.fixture(scope="module")
def models(minilm_dir):
    ours = TransformersBertModel.from_pretrained(minilm_dir)
    theirs = transformers.BertModel.from_pretrained(minilm_dir).eval()
    return ours, theirs, BertTokenizer.from_pretrained(minilm_dir)


def test_calls_and_outputs_as_transformers(models):
    ours, theirs, tok = models
    batch = tok(["a river bank", "the bank raised its rates again"], padding=True, return_tensors="pt")
    with torch.no_grad():
        a, b = ours(**batch), theirs(**batch)
        assert list(a.keys()) == ["last_hidden_state", "pooler_output"] and a.hidden_states is None
        assert len(a) == 2 and torch.allclose(a[0], b[0], atol=1e-5) and torch.allclose(a[-1], b[-1], atol=1e-5)
        a = ours(batch["input_ids"], attention_mask=batch["attention_mask"], output_hidden_states=True,
                 output_attentions=True)
        b = theirs(batch["input_ids"], attention_mask=batch["attention_mask"], output_hidden_states=True,
                   output_attentions=True)
        # transformers 5 adds cross_attentions=() to an encoder's output when attentions are asked for; an
        # encoder has none, so minibert leaves the field out (None), as transformers 4 did
        assert list(a.keys()) == [k for k in b.keys() if k != "cross_attentions"] and len(a) == 4
        for x, y in zip(a.to_tuple()[2], b.to_tuple()[2]):  # hidden states, 7 of them
            assert torch.allclose(x, y, atol=1e-5)
        assert isinstance(a[1:], tuple) and len(a[1:]) == 3 and a["pooler_output"] is a.pooler_output
        as_tuple = ours(**batch, return_dict=False)
        assert isinstance(as_tuple, tuple) and len(as_tuple) == 2
        embeds = theirs.get_input_embeddings()(batch["input_ids"])
        a = ours(inputs_embeds=embeds, attention_mask=batch["attention_mask"])
        b = theirs(inputs_embeds=embeds, attention_mask=batch["attention_mask"])
        assert torch.allclose(a.last_hidden_state, b.last_hidden_state, atol=1e-5)
        assert not has_hooks(ours)  # the inputs_embeds hook is gone after the call
        # transformers' decoder arguments, as its own callers pass them to an encoder: None / False are taken
        quiet = ours(**batch, encoder_hidden_states=None, encoder_attention_mask=None, past_key_values=None,
                     use_cache=False)
        assert torch.equal(quiet.last_hidden_state, ours(**batch).last_hidden_state)
    assert ours.get_input_embeddings() is ours.embeddings.word and ours.get_output_embeddings() is None
    for bad, message in ((dict(input_ids=batch["input_ids"], inputs_embeds=embeds), "exactly one of"),
                         (dict(input_ids=batch["input_ids"], encoder_hidden_states=embeds), "encoder only"),
                         (dict(input_ids=batch["input_ids"], use_cache=True), "no key/value cache"),
                         (dict(input_ids=batch["input_ids"], labels=1), "unsupported argument"),
                         (dict(inputs_embeds=embeds[..., :10]), r"\(batch, tokens, 384\)")):
        with pytest.raises(InputError, match=message):
            ours(**bad)


def test_head_mask_is_a_scaled_or_ablated_head(models):
    ours, _, tok = models
    batch = tok(["the bank raised its rates"], return_tensors="pt")
    N, h = ours.config.num_hidden_layers, ours.config.num_attention_heads
    with torch.no_grad():
        plain = ours(**batch).last_hidden_state
        assert torch.allclose(ours(**batch, head_mask=torch.ones(h)).last_hidden_state, plain, atol=1e-6)
        mask = torch.ones(N, h)
        mask[1, 3] = mask[4, 0] = 0
        with ablate_heads(ours, {1: [3], 4: [0]}):  # zero ablation of the per-head context = probabilities x 0
            want = ours(**batch).last_hidden_state
        got = ours(**batch, head_mask=mask, output_attentions=True)
        assert torch.allclose(got.last_hidden_state, want, atol=1e-5)
        assert torch.all(got.attentions[1][:, 3] == 0)  # returned attentions carry the mask, as in transformers 4
    with pytest.raises(InputError, match=r"head_mask has shape \(5,\).*\(12,\).*\(6, 12\)"):
        ours(**batch, head_mask=torch.ones(5))


def test_state_dict_and_layers_in_transformers_names(models, minilm_dir):
    ours, theirs, tok = models
    mine, reference = ours.state_dict(), theirs.state_dict()
    assert list(mine) == list(reference)
    assert all(torch.equal(mine[k], reference[k]) for k in reference)
    fresh = TransformersBertModel.from_pretrained(minilm_dir)
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    fresh.load_state_dict(reference)  # transformers' names in
    assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), ours.parameters()))
    bad = dict(reference, **{"encoder.layer.0.attention.self.query.weight": torch.zeros(3, 3)})
    with pytest.raises(InputError, match=r"query.weight: shape \(3, 3\), this model needs \(384, 384\)"):
        fresh.load_state_dict(bad)
    with pytest.raises(InputError, match="unexpected tensors.*cls.foo"):
        fresh.load_state_dict(dict(reference, **{"cls.foo": torch.zeros(1)}))
    # bert-score's cut: encoder.layer = ModuleList(encoder.layer[:k])
    fresh.encoder.layer = nn.ModuleList(list(fresh.encoder.layer[:2]))
    assert fresh.encoder.blocks is fresh.encoder.layer and len(fresh.encoder.blocks) == 2
    batch = tok(["a river bank"], return_tensors="pt")
    with torch.no_grad():
        out = fresh(**batch, output_hidden_states=True)
        full = ours(**batch, output_hidden_states=True)
    assert len(out.hidden_states) == 3 and torch.equal(out.last_hidden_state, full.hidden_states[2])
    assert len(fresh.state_dict()) == 5 + 2 * 16 + 2


def test_tokenizer_surface_matches_transformers(minilm_dir, hf_tokenizer, tmp_path):
    ours = BertTokenizer.from_pretrained(minilm_dir)
    for name in ("cls_token_id", "sep_token_id", "pad_token_id", "unk_token_id", "mask_token_id", "model_max_length",
                 "max_len_single_sentence", "max_len_sentences_pair"):
        assert getattr(ours, name) == getattr(hf_tokenizer, name), name
    assert len(ours) == len(hf_tokenizer) and ours.get_vocab() == hf_tokenizer.get_vocab()
    text, pair = "Hello, world! Ünïcödé text.", "A second one"
    assert ours.encode(text) == hf_tokenizer.encode(text)
    assert ours.encode(["hello", "unaffable"]) == hf_tokenizer.encode(["hello", "unaffable"])
    assert ours.encode(text, pair, max_length=8, truncation=True) == hf_tokenizer.encode(text, pair, max_length=8,
                                                                                       truncation=True)
    # transformers 5's tokenizers dropped build_inputs_with_special_tokens & co.; their __call__ is the reference
    a = hf_tokenizer(text, add_special_tokens=False)["input_ids"]
    b = hf_tokenizer(pair, add_special_tokens=False)["input_ids"]
    full = hf_tokenizer(text, pair, return_special_tokens_mask=True)
    assert ours.build_inputs_with_special_tokens(a, b) == full["input_ids"]
    assert ours.build_inputs_with_special_tokens(a) == hf_tokenizer(text)["input_ids"]
    assert ours.build_inputs_with_special_tokens([]) == [101, 102]
    assert ours.get_special_tokens_mask(a, b) == full["special_tokens_mask"]
    assert ours.get_special_tokens_mask(full["input_ids"], already_has_special_tokens=True) == full["special_tokens_mask"]
    assert ours.create_token_type_ids_from_sequences(a, b) == full["token_type_ids"]
    assert dict(ours.encode_plus(text, pair)) == {k: v for k, v in hf_tokenizer(text, pair).items()}
    batch = ours.batch_encode_plus([(text, pair), ("x", "y")], padding=True)
    assert batch["input_ids"] == hf_tokenizer([text, "x"], [pair, "y"], padding=True)["input_ids"]
    assert ours.convert_tokens_to_string(ours.tokenize("unaffable words")) == \
        hf_tokenizer.convert_tokens_to_string(hf_tokenizer.tokenize("unaffable words"))
    ours.save_pretrained(tmp_path / "tok")
    again = transformers.AutoTokenizer.from_pretrained(tmp_path / "tok")
    mine_again = BertTokenizer.from_pretrained(tmp_path / "tok")
    for t in (text, "Straße CAFÉ 東京"):
        assert again(t)["input_ids"] == hf_tokenizer(t)["input_ids"] == mine_again(t)["input_ids"]


def test_bert_score_runs_on_minibert_with_transformers_scores(minilm_dir, monkeypatch):
    """bert-score builds its model with AutoModel.from_pretrained and cuts it with encoder.layer = ...;
    we hand it minibert's classes there and compare with the same scorer on transformers."""
    pytest.importorskip("bert_score")
    import bert_score.utils

    cands = ["the cat sat on the mat", "a dog ran", "It was the best of times, it was the worst of times."]
    refs = ["a cat was sitting on the mat", "the dog is running fast", "It was the best of times."]
    options = [dict(num_layers=4, idf=True, idf_sents=refs), dict(num_layers=6, all_layers=True)]
    want = [bert_score.BERTScorer(model_type=str(minilm_dir), lang="en", **o).score(cands, refs) for o in options]

    class AutoModel:
        @staticmethod
        def from_pretrained(name, *args, **kwargs):
            return TransformersBertModel.from_pretrained(name)

    class AutoTokenizer:
        @staticmethod
        def from_pretrained(name, *args, **kwargs):
            return BertTokenizer.from_pretrained(name)

    monkeypatch.setattr(bert_score.utils, "AutoModel", AutoModel)
    monkeypatch.setattr(bert_score.utils, "AutoTokenizer", AutoTokenizer)
    for o, (P, R, F) in zip(options, want):
        scorer = bert_score.BERTScorer(model_type=str(minilm_dir), lang="en", **o)
        assert isinstance(scorer._model, TransformersBertModel) and isinstance(scorer._tokenizer, BertTokenizer)
        p, r, f = scorer.score(cands, refs)
        for mine, theirs in ((p, P), (r, R), (f, F)):
            assert torch.allclose(mine, theirs, atol=1e-6), (mine, theirs)


def test_surface_table_is_documented_and_true(models, minilm_dir):
    doc = open(ROOT / "docs" / "reference" / "transformers-compat.md", encoding="utf-8").read()
    assert compat_hf.surface_markdown() in doc
    ours, _, tok = models
    for name in ("get_input_embeddings", "set_input_embeddings", "get_output_embeddings", "num_parameters",
                 "state_dict", "load_state_dict", "from_pretrained", "save_pretrained", "device", "dtype"):
        assert hasattr(ours, name), name
    assert ours.main_input_name == "input_ids" and ours.num_parameters() == sum(p.numel() for p in ours.parameters())
    for name in ("encode", "encode_plus", "batch_encode_plus", "decode", "batch_decode", "get_vocab", "save_pretrained",
                 "build_inputs_with_special_tokens", "num_special_tokens_to_add", "model_input_names", "padding_side"):
        assert hasattr(tok, name), name
    out = ModelOutput(last_hidden_state=torch.zeros(1), attentions=torch.ones(1))
    assert list(out) == ["last_hidden_state", "attentions"] and out[1] is out.attentions and out.pooler_output is None
