"""Plots (minibert/analysis/plots.py) fit to print: titles, scales, numbers, 150 dpi or vector, nothing
written to a missing directory, the real path printed."""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import SENTENCES, cli_error, run_cli
from minibert import BertModel, BertTokenizer, InputError


def _captured_figure(monkeypatch, draw):
    """Run a plot function, keeping its matplotlib figure for inspection."""
    from minibert.analysis import plots

    kept = {}
    real_save = plots._save

    def keep(fig, path):
        fig.canvas.draw()
        kept["fig"] = copy.copy(fig)
        kept["renderer"] = fig.canvas.get_renderer()
        return real_save(fig, path)

    monkeypatch.setattr(plots, "_save", keep)
    path = draw()
    return kept["fig"], path


def test_cka_heatmap_title_scale_and_numbers(minilm_dir, tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from minibert.analysis import layers as L
    from minibert.analysis import plots

    model, tok = BertModel.from_pretrained(minilm_dir), BertTokenizer.from_pretrained(minilm_dir)
    batch = tok([SENTENCES[1]], return_tensors="pt")
    with torch.inference_mode():
        cka = L.cka_matrix(model(**batch).hidden_states, batch["attention_mask"])
    title = "Linear CKA between layers: " + SENTENCES[1] * 3
    fig, path = _captured_figure(monkeypatch, lambda: plots.similarity_heatmap(cka, tmp_path / "cka.png", title=title))
    ax = fig.axes[0]
    assert all(len(line) <= 48 for line in ax.get_title().splitlines()) and len(ax.get_title().splitlines()) <= 3
    low, high = ax.images[0].get_clim()
    assert low == pytest.approx(float(cka.min())) and high == pytest.approx(float(cka.max()))
    assert "fitted to the data" in fig.axes[1].get_ylabel()
    title_box = ax.title.get_window_extent()
    bar_box = fig.axes[1].get_window_extent()
    assert title_box.x1 <= bar_box.x0 or title_box.y0 >= bar_box.y1  # the colour bar does not cover the title
    assert len(ax.texts) == cka.numel()


def test_cka_needs_enough_tokens(minilm_dir, capsys):
    from minibert.analysis import layers as L

    h = [torch.randn(1, 4, 8) for _ in range(3)]
    mask = torch.ones(1, 4)
    with pytest.raises(InputError, match="at least 3 tokens, got 2"):
        L.cka_matrix(h, mask, torch.tensor([[101, 5, 6, 102]]), exclude_ids=[101, 102])
    with pytest.warns(UserWarning, match="CKA over only 4 tokens"):
        L.cka_matrix(h, mask)
    line = cli_error(capsys, "layers", "Hi there", "--model", str(minilm_dir), "--exclude-special")
    assert "CKA needs at least 3 tokens, got 2" in line


def test_logit_lens_plot_legend_and_rank_axis(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from minibert.analysis import plots
    from minibert.analysis.lens import LensResult, LensRow

    rows = [LensRow(i, "x", 0.1, rank, 0.1) for i, rank in enumerate([2500, 300, 40, 7, 2, 1])]
    fig, _ = _captured_figure(monkeypatch, lambda: plots.logit_lens(LensResult("t", 3, "capital", rows),
                                                                    tmp_path / "lens.png"))
    ax, rank_ax = fig.axes
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert len(legend) == 3 and any("rank" in t for t in legend)
    labels = [t.get_text() for t in rank_ax.get_yticklabels() if t.get_text()]
    assert labels == ["1", "10", "100", "1,000", "10,000"]
    assert not [t.get_text() for t in rank_ax.get_yticklabels(minor=True) if t.get_text()]
    low, high = rank_ax.get_ylim()
    assert low > high  # rank 1 at the top


def test_attention_map_size_is_bounded_and_colour_bar_fits(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from minibert.analysis import plots

    n = 41
    probs = torch.softmax(torch.randn(n, n), -1)
    fig, path = _captured_figure(monkeypatch, lambda: plots.attention_map(probs, [f"tok{i}" for i in range(n)],
                                                                          tmp_path / "a.png", 0, 0))
    width, height = fig.get_size_inches() * plots.DPI
    assert width <= 1300 and height <= 1300
    map_box, bar_box = fig.axes[0].get_window_extent(), fig.axes[1].get_window_extent()
    assert bar_box.height <= map_box.height * 1.02


@pytest.mark.parametrize("name,magic", [("p.png", b"\x89PNG"), ("p.svg", b"<?xml"), ("p.pdf", b"%PDF"),
                                        ("p", b"\x89PNG")])
def test_plots_are_150_dpi_or_vector_as_the_name_asks(tmp_path, name, magic):
    pytest.importorskip("matplotlib")
    from PIL import Image

    from minibert.analysis import plots
    from minibert.analysis.probing import ProbeResult

    path = plots.probe_curve(ProbeResult([0, 1], [0.5, 0.9], [0.4, 0.5], 0.3, 10, 5, ["a", "b"]), tmp_path / name)
    assert path.suffix in (".png", ".svg", ".pdf") and path.read_bytes()[: len(magic)] == magic
    if path.suffix == ".png":
        assert Image.open(path).info["dpi"][0] >= 149.9


def test_plot_to_a_missing_directory_is_an_error_and_creates_nothing(tmp_path):
    pytest.importorskip("matplotlib")
    from minibert.analysis import plots
    from minibert.analysis.probing import ProbeResult

    with pytest.raises(InputError, match="does not exist"):
        plots.probe_curve(ProbeResult([0, 1], [0.5, 0.9], [0.4, 0.5], 0.3, 10, 5, ["a", "b"]),
                          tmp_path / "missing" / "p.png")
    assert not (tmp_path / "missing").exists()


def test_cli_prints_the_real_plot_path(minilm_dir, tmp_path):
    pytest.importorskip("matplotlib")
    r = run_cli("layers", "The bank approved the loan application after a long review.", "--model",
                str(minilm_dir), "--plot", str(tmp_path / "heat"))
    assert r.returncode == 0, r.stderr
    assert f"wrote {tmp_path / 'heat.png'}" in r.stdout and (tmp_path / "heat.png").exists()
