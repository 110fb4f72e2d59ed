"""Layer toolkit: selection, pooling, combination (ScalarMix), similarity (CKA), probing, plots, CLI."""

from __future__ import annotations


import numpy as np
import pytest
import torch

from conftest import ROOT, cli_in_process
from minibert import BertModel, BertTokenizer
from minibert.analysis import layers as L
from minibert.testing import fp32_noise_floor

torch.manual_seed(0)


def fake_stack(n_layers=5, B=3, T=6, H=8):
    return tuple(torch.randn(B, T, H) for _ in range(n_layers))


# -------------------------------------------------------------------------------------- selection
def test_parse_layers():
    assert L.parse_layers("-4:", 13) == [9, 10, 11, 12]
    assert L.parse_layers("0,6,-1", 13) == [0, 6, 12]
    assert L.parse_layers(-1, 7) == [6]
    assert L.parse_layers(slice(1, None, 2), 7) == [1, 3, 5]
    assert L.parse_layers("all", 3) == [0, 1, 2]
    with pytest.raises(ValueError, match="layer 13 is out of range: there are 13 hidden states"):
        L.parse_layers(13, 13)
    with pytest.raises(ValueError, match="selects no layer"):
        L.parse_layers("5:2", 13)


def test_concat_last_four_is_4x_hidden():
    hs = fake_stack(13, H=768)
    assert L.concat_layers(hs).shape == (3, 6, 3072)
    assert torch.equal(L.concat_layers(hs, [0, -1])[..., :768], hs[0])


def test_pooling_ignores_padding():
    h = torch.randn(2, 5, 4)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    for method in ("mean", "max", "cls"):
        a = L.pool(h, mask, method)
        h2 = h.clone()
        h2[0, 3:] = 1e6  # garbage at padded positions
        assert torch.equal(L.pool(h2, mask, method), a)
    assert torch.allclose(L.pool(h, mask, "mean")[0], h[0, :3].mean(0))
    assert torch.equal(L.pool(h, mask, "max")[0], h[0, :3].amax(0))


def test_weighted_sum_softmax():
    hs = fake_stack(3)
    w = torch.tensor([0.0, 1.0, 2.0])
    s = w.softmax(0)
    assert torch.allclose(L.weighted_sum(hs, w), s[0] * hs[0] + s[1] * hs[1] + s[2] * hs[2], atol=1e-6)
    with pytest.raises(ValueError, match="one per layer"):
        L.weighted_sum(hs, [1.0, 2.0])


# ------------------------------------------------------------------------------------------ ScalarMix
def test_scalar_mix_parameters_and_uniform_init():
    mix = L.ScalarMix(12)
    assert sum(p.numel() for p in mix.parameters()) == 13
    hs = fake_stack(12)
    with torch.no_grad():
        mix.gamma.fill_(1.7)
    expected = 1.7 * torch.stack(hs).mean(0)
    assert torch.allclose(mix(hs), expected, atol=1e-6)


def test_scalar_mix_layer_norm_ignores_padding_and_matches_formula():
    mix = L.ScalarMix(3, do_layer_norm=True)
    hs = torch.randn(3, 2, 5, 4)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 0]])
    out = mix(hs, mask)
    hs2 = hs.clone()
    hs2[:, 0, 3:] = 1e4
    hs2[:, 1, 4] = -1e4
    valid = mask.bool()
    assert torch.allclose(mix(hs2, mask)[valid], out[valid], atol=1e-5)
    # one mean and one variance per layer over all unmasked elements (not per token)
    ref = []
    for k in range(3):
        v = hs[k][valid]  # (n, H)
        ref.append((hs[k] - v.mean()) / torch.sqrt(v.var(unbiased=False) + 1e-13))
    assert torch.allclose(out[valid], torch.stack(ref).mean(0)[valid], atol=1e-5)


def test_scalar_mix_gradients_and_layer_count_message():
    mix = L.ScalarMix(4)
    hs = fake_stack(4)
    (mix(hs) * torch.randn(3, 6, 8)).sum().backward()
    assert mix.scalar_parameters.grad is not None and mix.scalar_parameters.grad.abs().sum() > 0
    assert mix.gamma.grad is not None
    with pytest.raises(ValueError, match=r"hidden_states\[1:\]"):
        mix(fake_stack(5))


def test_centre_of_gravity_and_expected_layer():
    assert L.centre_of_gravity([0.0, 0.0, 1.0]) == 2.0
    assert L.centre_of_gravity([0.5, 0.5], first_layer=1) == 1.5
    assert L.centre_of_gravity(L.ScalarMix(5)) == pytest.approx(2.0)
    # all the gain at layer 3 -> expected layer 3; equal gains at 1 and 3 -> 2
    assert L.expected_layer([0.5, 0.5, 0.5, 0.9, 0.9]) == pytest.approx(3.0)
    assert L.expected_layer([0.0, 0.1, 0.1, 0.2]) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="undefined"):
        L.expected_layer([0.3, 0.3])


# ----------------------------------------------------------------------------------------- similarity
def numpy_cka(x, y):
    x = x - x.mean(0)
    y = y - y.mean(0)
    return np.linalg.norm(y.T @ x) ** 2 / (np.linalg.norm(x.T @ x) * np.linalg.norm(y.T @ y))


@pytest.mark.parametrize("n, d", [(50, 8), (6, 20)])  # both the feature and the Gram (n < d) forms
def test_cka_matches_numpy_and_invariances(n, d):
    x, y = torch.randn(n, d, dtype=torch.float64), torch.randn(n, d, dtype=torch.float64)
    assert L.linear_cka(x, y) == pytest.approx(numpy_cka(x.numpy(), y.numpy()), rel=1e-10)
    assert L.linear_cka(x, x) == pytest.approx(1.0)
    q, _ = torch.linalg.qr(torch.randn(d, d, dtype=torch.float64))
    assert L.linear_cka(x, 3.5 * x @ q) == pytest.approx(1.0)
    assert L.linear_cka(x, y @ q * 0.2) == pytest.approx(L.linear_cka(x, y))


@pytest.fixture(scope="module")
def minilm(minilm_dir):
    return BertModel.from_pretrained(minilm_dir), BertTokenizer.from_pretrained(minilm_dir)


def test_cka_and_pooling_padding_invariant_on_real_model(minilm):
    model, tok = minilm
    texts = ["The bank approved the loan.", "A much longer sentence about rivers, banks and boats."]
    short = tok(texts, padding=True, return_tensors="pt")
    long_ = tok(texts, padding="max_length", max_length=40, return_tensors="pt")
    with torch.no_grad():
        a, b = model(**short), model(**long_)
    T = short["input_ids"].shape[1]
    ca = L.cka_matrix(a.hidden_states, short["attention_mask"])
    cb = L.cka_matrix(b.hidden_states, long_["attention_mask"])
    assert torch.allclose(ca, cb, atol=1e-5)
    assert torch.allclose(torch.diag(ca), torch.ones(7, dtype=torch.float64))
    for method in ("mean", "max", "cls"):
        pa = L.pool(L.stack(a.hidden_states), short["attention_mask"], method)
        pb = L.pool(L.stack(b.hidden_states)[:, :, :T], long_["attention_mask"][:, :T], method)
        pc = L.pool(L.stack(b.hidden_states), long_["attention_mask"], method)
        assert torch.allclose(pb, pc) and torch.allclose(pa, pc, atol=1e-5)
    special = [tok.vocab["[CLS]"], tok.vocab["[SEP]"]]
    cx = L.cka_matrix(a.hidden_states, short["attention_mask"], short["input_ids"], special)
    assert cx.shape == (7, 7) and not torch.allclose(cx, ca)
    cos = L.cosine_matrix(a.hidden_states, short["attention_mask"], "mean")
    assert cos.shape == (7, 7) and torch.allclose(torch.diag(cos), torch.ones(7, dtype=torch.float64))
    stats = L.layer_statistics(a.hidden_states, short["attention_mask"])
    assert torch.isnan(stats["cos_previous"][0]) and stats["cos_last"][-1] == pytest.approx(1.0)


# -------------------------------------------------------------------------------------------- probing
def test_probing_on_real_weights(minilm):
    from minibert.analysis.probing import probe_model, read_conllu

    pytest.importorskip("conllu")
    model, tok = minilm
    data = read_conllu(ROOT / "tests" / "data" / "pos_sample.conllu")
    result = probe_model(model, tok, data, progress=False)
    again = probe_model(model, tok, data, progress=False)
    assert result.accuracy == again.accuracy and result.control_accuracy == again.control_accuracy
    print(result.table())
    assert len(result.accuracy) == 7
    best = max(result.accuracy)
    assert best >= result.majority_baseline + 0.5  # far above always-the-most-frequent-tag
    contextual = range(1, 7)
    assert all(result.control_accuracy[l] < result.accuracy[l] for l in contextual)
    assert max(result.selectivity) > 0.05


def test_word_alignment_pools_subwords(minilm):
    from minibert.analysis.probing import extract_word_features

    model, tok = minilm
    sentences = [["unaffable", "dogs"], ["Hi", "\x00", "there"]]  # a word with no sub-word is left out
    feats, index = extract_word_features(model, tok, sentences, pool="mean", progress=False)
    assert index == [(0, 0), (0, 1), (1, 0), (1, 2)]
    batch = tok(["unaffable dogs"], return_tensors="pt")
    n_pieces = len(tok.tokenize("unaffable"))
    assert n_pieces > 1
    with torch.no_grad():
        hs = torch.stack(model(**batch).hidden_states)
    assert torch.allclose(feats[:, 0], hs[:, 0, 1:1 + n_pieces].mean(1), atol=1e-5)


# ------------------------------------------------------------------------------------- plots and CLI
PNG = b"\x89PNG\r\n\x1a\n"




def test_cli_layers_probe_embed_end_to_end(minilm_dir, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    m = str(minilm_dir)
    r = cli_in_process(capsys, "layers", "The bank approved the loan application.", "--model", m, "--plot", str(tmp_path / "l.png"))
    assert r.returncode == 0, r.stderr
    assert "CKA last" in r.stdout and len([ln for ln in r.stdout.splitlines() if ln.strip()[:1].isdigit()]) == 7
    r = cli_in_process(capsys, "probe", str(ROOT / "tests" / "data" / "pos_sample.conllu"), "--model", m, "--plot",
                str(tmp_path / "p.png"), "--quiet")
    assert r.returncode == 0, r.stderr
    assert "majority baseline" in r.stdout and "<- best" in r.stdout
    (tmp_path / "texts.txt").write_text("first text\nsecond, a longer one\nthird\nlast\n")  # blank lines: see test_first_hour
    r = cli_in_process(capsys, "embed", str(tmp_path / "texts.txt"), "--model", m, "--layers", "-4:", "--pool", "mean",
                "--out", str(tmp_path / "v.npy"), "--quiet")
    assert r.returncode == 0, r.stderr
    v = np.load(tmp_path / "v.npy")
    assert v.shape == (4, 4 * 384)
    for png in ("l.png", "p.png"):
        assert (tmp_path / png).read_bytes()[:8] == PNG
    # same vectors as the library gives for one text, whatever its batch neighbours
    model, tok = BertModel.from_pretrained(minilm_dir), BertTokenizer.from_pretrained(minilm_dir)
    batch = tok(["second, a longer one"], return_tensors="pt")
    with torch.no_grad():
        ref = L.pool(L.select_layers(model(**batch).hidden_states, "-4:"), batch["attention_mask"], "mean")
    tolerance = 2 * fp32_noise_floor(model, batch)  # embed runs the fast path: CPU-dependent rounding
    assert np.allclose(v[1], torch.cat(tuple(ref), -1)[0].numpy(), atol=tolerance, rtol=0)


def test_cli_errors_are_one_line(minilm_dir, tmp_path, capsys):
    for args in (["probe", str(tmp_path / "missing.conllu"), "--model", str(minilm_dir)],
                 ["embed", str(tmp_path / "missing.txt"), "--model", str(minilm_dir), "--out", str(tmp_path / "x.npy")],
                 ["layers", "x", "--model", str(tmp_path / "nomodel")]):
        r = cli_in_process(capsys, *args)
        assert r.returncode == 2 and r.stderr.startswith("minibert: error:") and len(r.stderr.splitlines()) == 1, r.stderr
        assert "Traceback" not in r.stderr


def test_plots_write_png(tmp_path, minilm):
    pytest.importorskip("matplotlib")
    from minibert.analysis import plots
    from minibert.analysis.probing import ProbeResult

    model, tok = minilm
    batch = tok(["Where is the bank?", "Hi"], padding=True, return_tensors="pt")
    with torch.no_grad():
        out = model(**batch, output_attentions=True)
    n = int(batch["attention_mask"][1].sum())  # the padded row: cut the padding away
    probs = out.attentions[2][1, 3, :n, :n]
    tokens = tok.convert_ids_to_tokens(batch["input_ids"][1, :n].tolist())
    paths = [plots.attention_map(probs, tokens, tmp_path / "a.png", layer=3, head=3),
             plots.similarity_heatmap(L.cka_matrix(out.hidden_states, batch["attention_mask"]), tmp_path / "h.png"),
             plots.probe_curve(ProbeResult([0, 1], [0.5, 0.9], [0.4, 0.5], 0.3, 10, 5, ["a", "b"]), tmp_path / "c.png"),
             plots.mix_weights(L.ScalarMix(6).weights.detach(), L.layer_statistics(out.hidden_states)["norm_mean"][1:],
                               tmp_path / "m.png", first_layer=1, gamma=1.0)]
    for p in paths:
        assert p.read_bytes()[:8] == PNG
    with pytest.raises(ValueError, match="tokens are 2"):
        plots.attention_map(probs, tokens[:2], tmp_path / "bad.png", layer=0, head=0)
