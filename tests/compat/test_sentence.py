"""minibert/compat/sentence.py: SentenceEncoder against sentence-transformers, folder settings, batching plans,
`embed` and `search`."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from conftest import cli_in_process
from minibert import BertTokenizer, InputError
from minibert.compat import SentenceEncoder, sentence
from minibert.tools.batching import plan_batches


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
    r = run("search", str(path), "money and interest", "--top-k", "2", "--model", str(minilm_dir), "--format", "json", "--quiet",
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
        assert main(["search", str(corpus), "dogs", "--model", str(minilm_dir), "--index", str(index), "--format", "json",
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
