"""Issue 14, part 3: maps of the stack (``minibert.analysis.maps`` and ``minibert map``)."""

from __future__ import annotations

import json
import subprocess
import sys
import types

import numpy as np
import pytest
import torch

from conftest import ROOT
from minibert import BertModel, BertTokenizer, InputError, MissingExtra
from minibert.analysis import maps
from minibert.analysis.probing import read_conllu
from minibert.training.datasets import read_table

BANK = ROOT / "tests" / "data" / "bank_senses.csv"
POS = ROOT / "tests" / "data" / "pos_sample.conllu"


@pytest.fixture(scope="module")
def minilm(minilm_dir):
    return BertModel.from_pretrained(minilm_dir, mlm_head=False).eval(), BertTokenizer.from_pretrained(minilm_dir)


def test_pca_equals_scikit_learn_up_to_sign_and_is_deterministic():
    decomposition = pytest.importorskip("sklearn.decomposition")
    x = torch.randn(50, 12, generator=torch.Generator().manual_seed(0)) * torch.linspace(3, 0.1, 12)
    ours = maps.project(x, "pca")
    theirs = decomposition.PCA(n_components=2).fit(x.double().numpy())
    reference = theirs.transform(x.double().numpy())
    for axis in range(2):
        sign = np.sign(ours[:, axis] @ reference[:, axis])
        assert np.abs(ours[:, axis] - sign * reference[:, axis]).max() < 1e-9
    _, share = maps._pca(x.double())
    assert np.allclose(share, theirs.explained_variance_ratio_, atol=1e-12)
    assert np.array_equal(maps.project(x, "pca"), ours)
    assert np.array_equal(maps.project(-x, "pca"), maps.project(-x, "pca"))
    with pytest.raises(InputError, match="at least 3"):
        maps.project(x[:2])
    with pytest.raises(InputError, match="method"):
        maps.project(x, "mds")


def test_knn_accuracy_equals_scikit_learn_leave_one_out():
    neighbors = pytest.importorskip("sklearn.neighbors")
    model_selection = pytest.importorskip("sklearn.model_selection")
    g = torch.Generator().manual_seed(1)
    x = torch.cat([torch.randn(30, 8, generator=g) + 1.0, torch.randn(30, 8, generator=g) - 0.3])
    labels = ["a"] * 30 + ["b"] * 30  # two classes, k = 5: no tied vote, so the two rules agree exactly
    theirs = model_selection.cross_val_score(neighbors.KNeighborsClassifier(5, metric="cosine", algorithm="brute"),
                                             x.numpy(), labels, cv=model_selection.LeaveOneOut()).mean()
    assert maps.knn_accuracy(x, labels) == pytest.approx(theirs)


def test_tsne_is_seeded_and_umap_is_optional(monkeypatch):
    pytest.importorskip("sklearn.manifold")
    x = torch.randn(40, 6, generator=torch.Generator().manual_seed(2))
    a, b = maps.project(x, "tsne", seed=3), maps.project(x, "tsne", seed=3)
    assert a.shape == (40, 2) and np.array_equal(a, b)
    with pytest.raises(InputError, match="perplexity"):
        maps.project(x, "tsne", perplexity=50)
    monkeypatch.setitem(sys.modules, "umap", None)  # not installed
    with pytest.raises(MissingExtra, match="umap-learn"):
        maps.project(x, "umap")
    calls = {}

    class FakeUMAP:  # stands for umap-learn: what minibert asks of it
        def __init__(self, **options):
            calls.update(options)

        def fit_transform(self, data):
            return data[:, :2]
    monkeypatch.setitem(sys.modules, "umap", types.SimpleNamespace(UMAP=FakeUMAP))
    assert np.array_equal(maps.project(x, "umap", seed=4), x.double().numpy()[:, :2])
    assert calls == {"n_components": 2, "n_neighbors": 15, "metric": "cosine", "random_state": 4}


def test_occurrences_of_a_word_are_whole_words_in_any_case(minilm):
    model, tok = minilm
    texts = ["The Bank closed.", "banking is hard", "an embankment", "bank, bank and BANK!", "nothing here"]
    points = maps.occurrence_points(model, tok, texts, ["m", "x", "y", "z", "n"], words="bank")
    assert points.labels == ["m", "z", "z", "z"] and points.vectors.shape == (7, 4, 384)
    assert points.texts[0] == "The Bank closed."
    by_word = maps.occurrence_points(model, tok, ["a river bank", "the river"], None, words=["bank", "River"])
    assert by_word.labels == ["river", "bank", "river"]
    with pytest.raises(InputError, match="no text contains"):
        maps.occurrence_points(model, tok, texts, None, words="cat")
    # the vector of an occurrence is the mean of its pieces at that layer, as the full forward computes it
    batch = tok(["The Bank closed."], return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).hidden_states
    assert torch.allclose(points.vectors[3, 0], hidden[3][0, 2], atol=1e-5)  # [CLS] the bank: token 2


def test_word_points_leave_out_unlabelled_words(minilm):
    model, tok = minilm
    data = [(["The", "bank", "closed"], ["DET", None, "VERB"]), (["Rivers", "flow"], ["NOUN", "VERB"])]
    points = maps.word_points(model, tok, data)
    assert points.labels == ["DET", "VERB", "NOUN", "VERB"] and points.texts == ["The", "closed", "Rivers", "flow"]
    with pytest.raises(InputError, match="no word has a label"):
        maps.word_points(model, tok, [(["a", "b"], [None, None])])


def test_stack_map_uses_the_same_points_in_every_panel(minilm, tmp_path):
    model, tok = minilm
    table = read_table(BANK)
    points = maps.occurrence_points(model, tok, table.texts, table.labels, words="bank")
    result = maps.stack_map(points, "all", method="pca", seed=0, model="MiniLM")
    assert result.layers == list(range(7)) and result.coords.shape == (7, 32, 2)
    assert result.knn_accuracy[-1] == 1.0  # river and money senses separate completely in the top layer
    assert result.knn_accuracy[0] < result.knn_accuracy[-1]
    again = maps.stack_map(points, [0, -1], method="pca", seed=0)
    assert np.array_equal(again.coords[1], result.coords[-1])
    sampled = maps.stack_map(points, [1, 2], max_points=10, seed=5)
    assert sampled.coords.shape == (2, 10, 2) and sampled.labels == maps.stack_map(points, [3], max_points=10, seed=5).labels
    with pytest.raises(InputError, match="twice"):
        maps.stack_map(points, [6, -1])
    with pytest.raises(InputError, match="at least 2"):
        maps.stack_map(maps.Points(points.vectors, ["x"] * 32, "p"), [1])
    path = maps.plot_stack_map(result, tmp_path / "bank")
    assert path.name == "bank.png" and path.stat().st_size > 10_000
    from PIL import Image

    assert Image.open(path).info["dpi"][0] == pytest.approx(150, abs=1)


def test_plot_has_one_legend_with_counts_and_a_panel_per_layer(minilm, tmp_path, monkeypatch):
    plt = pytest.importorskip("matplotlib.pyplot")
    model, tok = minilm
    data = read_conllu(POS, "upos")[:40]
    result = maps.stack_map(maps.word_points(model, tok, data), [0, 3, 6], method="pca")
    figures = []
    monkeypatch.setattr("minibert.analysis.plots._save", lambda fig, path: figures.append(fig) or path)
    maps.plot_stack_map(result, tmp_path / "pos.svg")
    fig = figures[0]
    panels = [ax for ax in fig.axes if ax.get_title()]
    assert [ax.get_title().split(" ·")[0] for ax in panels] == ["embeddings", "layer 3", "layer 6"]
    assert all("5-NN acc" in ax.get_title() for ax in panels)
    assert len(fig.legends) == 1 and not any(ax.get_legend() for ax in fig.axes)
    counts = {}
    for label in result.labels:
        counts[label] = counts.get(label, 0) + 1
    texts = [t.get_text() for t in fig.legends[0].get_texts()]
    assert texts[0] == f"{max(counts, key=lambda c: (counts[c], c))} ({max(counts.values())})"  # most frequent first
    assert sum(int(t.rsplit("(", 1)[1].rstrip(")")) for t in texts) == len(result.labels)
    assert panels[0].get_xlabel().startswith("PC1 (")
    plt.close(fig)


def test_map_cli(minilm_dir, tmp_path, capsys):
    """One run as a user types it (a new process); the other calls in-process (no torch import each)."""
    from minibert.cli import main

    run = [sys.executable, "-m", "minibert", "map"]
    out = subprocess.run(run + [str(BANK), "--model", str(minilm_dir), "--word", "bank", "--layers", "0,3,6",
                                "--out", str(tmp_path / "bank.png"), "--json", str(tmp_path / "bank"), "--quiet"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "32 occurrences of 'bank', 2 labels" in out.stdout and "wrote" in out.stdout
    saved = json.loads((tmp_path / "bank.json").read_text())
    assert saved["layers"] == [0, 3, 6] and len(saved["coords"][0]) == 32 and saved["knn_accuracy"][-1] == 1.0
    assert (tmp_path / "bank.png").exists()
    capsys.readouterr()
    assert main(["map", str(BANK), "--model", str(minilm_dir), "--layers", "-2:", "--out", str(tmp_path / "sent.svg"),
                 "--quiet"]) == 0
    assert "32 sentences" in capsys.readouterr().out
    assert (tmp_path / "sent.svg").exists()
    text = tmp_path / "t.txt"
    text.write_text("the river bank\nthe bank loan\n")
    for argv, message in (([str(text)], "--word"), ([str(POS), "--word", "bank"], "--word picks"),
                          ([str(BANK), "--layers", "9"], "out of range"), ([str(BANK), "--method", "mds"], "--method"),
                          ([str(tmp_path / "x.parquet")], "use a .conllu"),
                          ([str(BANK), "--max-points", "2"], "--max-points"),
                          ([str(BANK), "--out", str(tmp_path / "no" / "m.png")], "does not exist")):
        out_given = "--out" in argv
        with pytest.raises(SystemExit) as exit_info:
            main(["map"] + argv + ["--model", str(minilm_dir)] + ([] if out_given else ["--out", str(tmp_path / "m.png")]))
        assert exit_info.value.code == 2 and message in capsys.readouterr().err, argv
    assert not (tmp_path / "m.png").exists() and not (tmp_path / "no").exists()
