"""Code written for transformers runs on minibert (bert-score as the third-party witness), and
sentence-transformers folders give sentence-transformers' vectors (minibert/compat)."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch
from torch import nn

from conftest import cli_in_process, transformers
from minibert import BertTokenizer, InputError
from minibert.compat import ModelOutput, SentenceEncoder, TransformersBertModel
from minibert.compat import hf as compat_hf
from minibert.compat import sentence
from minibert.tools.batching import plan_batches
from minibert.tools.hooks import ablate_heads, has_hooks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def models(minilm_dir):
    ours = TransformersBertModel.from_pretrained(minilm_dir)
    theirs = transformers.BertModel.from_pretrained(minilm_dir).eval()
    return ours, theirs, BertTokenizer.from_pretrained(minilm_dir)


# ------------------------------------------------------------------------------- transformers surface
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
    doc = open(os.path.join(ROOT, "docs", "reference", "transformers-compat.md"), encoding="utf-8").read()
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


# ------------------------------------------------------------------------------- sentence-transformers
def test_pooling_modes_against_sentence_transformers():
    st = pytest.importorskip("sentence_transformers")
    from sentence_transformers.sentence_transformer.modules import Pooling

    torch.manual_seed(0)
    hidden = torch.randn(3, 6, 8)
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0], [1, 0, 0, 0, 0, 0]])
    for mode in sentence.POOLING_MODES:
        want = Pooling(8, pooling_mode=mode)({"token_embeddings": hidden, "attention_mask": mask})["sentence_embedding"]
        assert torch.allclose(sentence.pool(hidden, mask, mode), want, atol=1e-6), mode
    assert st is not None


def test_sentence_encoder_equals_sentence_transformers(minilm_dir, sentences_dir):
    st = pytest.importorskip("sentence_transformers")
    texts = (sentences_dir / "held.txt").read_text(encoding="utf-8").split("\n")[:80]
    texts += ["word " * 400, "  spaces around  ", "x", "Ünïcödé TEXT, with CAPS."]  # one past 256 tokens
    encoder = SentenceEncoder.from_pretrained(minilm_dir)
    assert encoder.settings() == {"source": str(minilm_dir), "from": "modules.json", "max_seq_length": 256,
                                  "do_lower_case": False, "pooling": ["mean"], "normalize": True}
    reference = st.SentenceTransformer(str(minilm_dir), device="cpu")
    want = reference.encode(texts, batch_size=16)
    got = encoder.encode(texts, batch_size=16)
    assert got.shape == want.shape == (len(texts), 384) and got.dtype == np.float32
    assert np.abs(got - want).max() <= 1e-6
    assert np.abs(encoder.encode(texts, max_tokens=1024) - want).max() <= 1e-6  # token-budget batches
    one = encoder.encode("a single text")
    assert one.shape == (384,) and np.abs(one - reference.encode("a single text")).max() <= 1e-6
    t = encoder.encode(texts[:3], convert_to_tensor=True, normalize_embeddings=True)
    assert isinstance(t, torch.Tensor) and torch.allclose(t.norm(dim=1), torch.ones(3))


def test_folder_settings_are_read_as_written(minilm_dir, tmp_path):
    """Other pooling modes, lowercasing, truncation and no Normalize: against sentence-transformers on the
    same weights, saved by sentence-transformers itself."""
    st = pytest.importorskip("sentence_transformers")
    from sentence_transformers.base.modules import Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling

    texts = ["The Bank of England RAISED rates.", "a short one", "word " * 60]
    for modes, lower in ((("cls", "max"), False), ("weightedmean", True), ("mean_sqrt_len_tokens", False),
                         ("lasttoken", False)):
        transformer = Transformer(str(minilm_dir), max_seq_length=32, do_lower_case=lower)
        model = st.SentenceTransformer(modules=[transformer, Pooling(384, pooling_mode=modes)], device="cpu")
        folder = tmp_path / "_".join([modes] if isinstance(modes, str) else modes)
        model.save(str(folder))
        encoder = SentenceEncoder.from_pretrained(folder)
        assert encoder.max_seq_length == 32 and encoder.do_lower_case == lower and not encoder.normalize
        assert encoder.pooling == ([modes] if isinstance(modes, str) else list(modes))
        assert np.abs(encoder.encode(texts) - model.encode(texts)).max() <= 1e-5, modes
    (tmp_path / "dense").mkdir()
    (tmp_path / "dense" / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "2_Dense", "type": "sentence_transformers.models.Dense"}]))
    with pytest.raises(Exception, match="sentence_transformers.models.Dense"):
        SentenceEncoder.from_pretrained(tmp_path / "dense")


def test_plain_checkpoint_gets_mean_pooling(tmp_path, minilm_dir):
    for name in ("config.json", "model.safetensors", "vocab.txt", "tokenizer_config.json"):
        shutil.copy(minilm_dir / name, tmp_path / name)
    encoder = SentenceEncoder.from_pretrained(tmp_path)
    assert encoder.settings()["from"] == "defaults (no modules.json)" and encoder.max_seq_length == 512
    assert not encoder.normalize and encoder.pooling == ["mean"]


def test_batches_keep_order_and_budget():
    lengths = [5, 17, 3, 17, 9, 2, 30, 1]
    for options in (dict(batch_size=3), dict(max_tokens=40), dict(batch_size=2, max_tokens=40), dict(max_tokens=10)):
        plan = plan_batches(lengths, **options)
        flat = [i for rows in plan for i in rows]
        assert sorted(flat) == list(range(len(lengths)))  # every row once
        assert [lengths[i] for i in flat] == sorted(lengths, reverse=True)  # longest first
        for rows in plan:
            if "batch_size" in options:
                assert len(rows) <= options["batch_size"]
            if "max_tokens" in options and len(rows) > 1:
                assert max(lengths[i] for i in rows) * len(rows) <= options["max_tokens"]
    assert plan_batches([30], max_tokens=10) == [[0]]  # a row over the budget still runs, alone
    assert plan_batches([4, 4, 4], batch_size=5) == [[0, 1, 2]]  # ties keep the input order
    with pytest.raises(InputError, match="batch_size or max_tokens"):
        plan_batches([1])
    with pytest.raises(InputError, match="max_tokens must be a positive integer, got 0"):
        plan_batches([1], max_tokens=0)


def test_embed_cli_follows_the_folder_and_says_so(minilm_dir, tmp_path, capsys):
    lines = ["a river bank", "the bank raised its rates", "word " * 300]
    path = tmp_path / "t.txt"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")

    def run(*args):
        return cli_in_process(capsys, *args)
    r = run("embed", str(path), "--out", str(tmp_path / "v.npy"), "--model", str(minilm_dir), "--quiet")
    assert r.returncode == 0, r.stderr
    assert "follows" in r.stderr and "max_seq_length 256, pooling mean, normalized" in r.stderr
    assert "1 of 3 lines had more than 256 tokens" in r.stderr
    want = SentenceEncoder.from_pretrained(minilm_dir).encode(lines)
    assert np.abs(np.load(tmp_path / "v.npy") - want).max() <= 1e-6
    r = run("embed", str(path), "--out", str(tmp_path / "w.npy"), "--model", str(minilm_dir), "--quiet",
            "--ignore-folder-settings", "--max-tokens", "600")
    assert r.returncode == 0, r.stderr and "follows" not in r.stderr
    raw = np.load(tmp_path / "w.npy")
    assert np.linalg.norm(raw, axis=1).min() > 2  # raw mean of the last layer, not unit vectors
    r = run("search", str(path), "money and interest", "-k", "2", "--model", str(minilm_dir), "--json", "--quiet",
            "--index", str(tmp_path / "index.npy"))
    assert r.returncode == 0, r.stderr
    hits = json.loads(r.stdout)["results"][0]["hits"]
    assert [h["line"] for h in hits][0] == 2 and hits[0]["score"] > hits[1]["score"]
    assert np.load(tmp_path / "index.npy").shape == (3, 384)
    r = run("search", str(path), "money", "--model", str(minilm_dir), "--index", str(tmp_path / "index.npy"), "--quiet")
    assert r.returncode == 0 and "using the saved index" in r.stderr


def test_probing_features_with_a_token_budget_equal_fixed_batches(minilm_dir):
    from minibert import BertModel
    from minibert.analysis.probing import extract_word_features

    model, tok = BertModel.from_pretrained(minilm_dir), BertTokenizer.from_pretrained(minilm_dir)
    sentences = [["The", "bank", "approved", "it", "."], ["Hi"], ["A", "much", "longer", "sentence", "about", "rivers",
                                                                     "and", "their", "muddy", "banks", "."]] * 3
    fixed, index = extract_word_features(model, tok, sentences, batch_size=4, progress=False)
    budget, index2 = extract_word_features(model, tok, sentences, batch_size=None, max_tokens=40, progress=False)
    assert index == index2 and torch.allclose(fixed, budget, atol=1e-5)


def test_search_index_is_rebuilt_when_what_it_was_made_from_changes(minilm_dir, tmp_path, capsys):
    """A saved index used to be reused whenever the corpus had as many lines: after line 1 changed, "dogs"
    was ranked against the old line's vector. It now records the corpus' sha256, the model's weights and
    the settings, and is rebuilt (and says why) when one differs."""
    from minibert.cli import main
    from minibert.cli.encoding import _index_differences, index_record

    corpus, index = tmp_path / "corpus.txt", tmp_path / "idx.npy"
    lines = ["the cat sat on the mat", "the bank raised its rates", "ducks swim on the lake"]
    corpus.write_text("\n".join(lines) + "\n", encoding="utf-8")

    def search(*extra):
        assert main(["search", str(corpus), "dogs", "--model", str(minilm_dir), "--index", str(index), "--json",
                     "--quiet", "--batch-size", "2", *extra]) == 0
        out = capsys.readouterr()
        return json.loads(out.out)["results"][0]["hits"], out.err
    _, err = search()
    assert "saved the index" in err and (tmp_path / "idx.json").exists()
    _, err = search()
    assert "using the saved index" in err
    lines[0] = "dogs run in parks"  # same number of lines
    corpus.write_text("\n".join(lines) + "\n", encoding="utf-8")
    hits, err = search()
    assert "rebuilding the index" in err and "the corpus changed" in err
    encoder = SentenceEncoder.from_pretrained(minilm_dir)
    fresh, query = encoder.encode(lines), encoder.encode(["dogs"])
    assert hits[0]["line"] == 1 and abs(hits[0]["score"] - float(fresh[0] @ query[0])) < 1e-5
    _, err = search("--max-length", "8")
    assert "rebuilding" in err and "max_seq_length was 256, now 8" in err
    (tmp_path / "idx.json").unlink()
    _, err = search("--max-length", "8")
    assert "idx.json (what the index was made from) is missing" in err
    # another model's weights (one value changed) are another index
    record = index_record(corpus, 3, encoder)
    with torch.no_grad():
        encoder.model.encoder.blocks[0].ffn.dense_in.weight[0, 0] += 1e-3
    changed = index_record(corpus, 3, encoder)
    (tmp_path / "saved.json").write_text(json.dumps({**record, "dims": 384}), encoding="utf-8")
    assert _index_differences(tmp_path / "saved.json", changed, (3, 384)) == ["the model's weights differ"]
    assert _index_differences(tmp_path / "saved.json", record, (3, 384)) == []
