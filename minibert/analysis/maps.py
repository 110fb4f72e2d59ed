"""Maps of the stack: the same points projected to 2-D at several layers, one panel per layer.

What is a point, and what colours it:

    words of a CoNLL-U file        coloured by a column (UPOS, XPOS, DEPREL, ...)      ``word_points``
    sentences of a labelled table  coloured by their label (a dataset's classes)       ``sentence_points``
    occurrences of a word          coloured by their sentence's label (``bank``: river  ``occurrence_points``
                                   vs money), or by which word when several are given

Each returns ``Points``: vectors (L + 1, n, H) of every hidden state and n labels. ``project`` maps one
layer's vectors to 2-D: PCA (always: centred SVD, signs fixed so the result is deterministic), t-SNE
(scikit-learn: ``pip install -e ".[maps]"``) or UMAP (when ``umap-learn`` is installed), each with
an explicit seed. ``stack_map`` projects every chosen layer of the same points and scores how well the
labels separate at each layer in the full space (leave-one-out 5-nearest-neighbour accuracy, cosine) --
the number a reader compares across panels; ``plot_stack_map`` draws it with one legend for all panels.

    points = occurrence_points(model, tok, texts, labels, words=["bank"])
    result = stack_map(points, layers=[0, 2, 4, 6], method="pca", seed=0)
    plot_stack_map(result, "bank.png")
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import InputError, missing_extra
from ..tools.pooling import pool
from .layers import parse_layers
from ..tools.batching import text_batches
from ..tools.progress import progress_bar
from ..words import word_spans
from .probing import extract_span_features

METHODS = ("pca", "tsne", "umap")


@dataclass
class Points:
    vectors: torch.Tensor  # (L + 1, n, H): every hidden state of every point
    labels: list[str]  # n: what colours each point
    what: str  # "words", "sentences" or "occurrences of 'bank'": for titles
    texts: list[str] = field(default_factory=list)  # n: where each point comes from (for tooltips, JSON)


@dataclass
class StackMap:
    layers: list[int]  # the hidden states shown (0 = embeddings)
    coords: np.ndarray  # (len(layers), n, 2)
    labels: list[str]
    method: str
    seed: int
    knn_accuracy: list[float]  # per layer: leave-one-out 5-NN accuracy of the labels (cosine, full space)
    explained: list[tuple[float, float]] | None  # PCA only: share of variance on each axis, per layer
    what: str = "points"
    model: str = "model"


# ------------------------------------------------------------------------------------------------ points
def word_points(model, tokenizer, data, *, pool_pieces: str = "first", progress: bool = False) -> Points:
    """Words of ``data`` (``probing.read_conllu``'s (words, labels) pairs); words labelled None (``_``)
    are left out."""
    sentences = [words for words, _ in data]
    features, index = _span_features(model, tokenizer, [word_spans(w) for w in sentences], pool_pieces, progress)
    keep = [k for k, (s, w) in enumerate(index) if data[s][1][w] is not None]
    if not keep:
        raise InputError("no word has a label (every value in the column is '_')")
    labels = [data[index[k][0]][1][index[k][1]] for k in keep]
    texts = [sentences[index[k][0]][index[k][1]] for k in keep]
    return Points(features[:, keep], labels, "words", texts)


def sentence_points(model, tokenizer, texts, labels, *, method: str = "mean", batch_size: int = 32,
                    max_length: int | None = None, progress: bool = False) -> Points:
    """One pooled vector per text (``mean`` over real tokens, ``cls`` or ``max``) at every layer."""
    from ..tools import fast

    if len(texts) != len(labels):
        raise InputError(f"texts ({len(texts)}) and labels ({len(labels)}) must have the same length")
    run = fast.prepare(model)
    out = [None] * len(texts)
    bar = progress_bar(len(texts), "sentences", progress)
    with torch.inference_mode():
        for rows, batch in text_batches(tokenizer, texts, batch_size=batch_size, max_length=max_length,
                                        device=model.device):
            hidden = torch.stack(run(**batch).hidden_states).float()  # (L + 1, B, T, H)
            pooled = pool(hidden, batch["attention_mask"], method)  # (L + 1, B, H)
            for k, i in enumerate(rows):
                out[i] = pooled[:, k]
            bar.update(len(rows))
    bar.close()
    return Points(torch.stack(out, 1), [str(y) for y in labels], "sentences", list(texts))


def occurrence_points(model, tokenizer, texts, labels=None, *, words, pool_pieces: str = "mean",
                      progress: bool = False) -> Points:
    """Every occurrence of each word in ``words`` (whole word, any case) in ``texts``; coloured by its
    text's label, or without labels by which word it is."""
    if isinstance(words, str):
        words = [words]
    words = [w.strip() for w in words if w.strip()]
    if not words:
        raise InputError("words: give at least one word to look for")
    if labels is not None and len(labels) != len(texts):
        raise InputError(f"texts ({len(texts)}) and labels ({len(labels)}) must have the same length")
    pattern = re.compile(r"(?<!\w)(" + "|".join(re.escape(w) for w in words) + r")(?!\w)", re.IGNORECASE)
    found = [[(m.start(), m.end()) for m in pattern.finditer(t)] for t in texts]
    if not any(found):
        raise InputError(f"no text contains {' or '.join(repr(w) for w in words)} as a whole word")
    features, index = _span_features(model, tokenizer, list(zip(texts, found)), pool_pieces, progress)
    if labels is None:
        point_labels = [texts[t][slice(*found[t][s])].lower() for t, s in index]
    else:
        point_labels = [str(labels[t]) for t, _ in index]
    what = "occurrences of " + ", ".join(repr(w) for w in words)
    return Points(features, point_labels, what, [texts[t] for t, _ in index])


def _span_features(model, tokenizer, text_spans, pool_pieces, progress):
    texts = [t for t, _ in text_spans]
    spans = [s for _, s in text_spans]
    return extract_span_features(model, tokenizer, texts, spans, pool=pool_pieces, progress=progress)


# -------------------------------------------------------------------------------------------- projection
def project(vectors, method: str = "pca", *, seed: int = 0, perplexity: float | None = None) -> np.ndarray:
    """(n, H) -> (n, 2). ``pca``: centred SVD, each axis signed so its largest loading is positive (the
    same input always gives the same picture). ``tsne``: scikit-learn's t-SNE, PCA-initialised, perplexity
    min(30, (n - 1) / 3) unless given. ``umap``: umap-learn, cosine metric. All seeded."""
    x = torch.as_tensor(vectors).double()
    n = x.shape[0]
    if method not in METHODS:
        raise InputError(f"method {method!r}: use one of {METHODS}")
    if n < 3:
        raise InputError(f"a map needs at least 3 points, got {n}")
    if method == "pca":
        return _pca(x)[0]
    if method == "tsne":
        try:
            from sklearn.manifold import TSNE
        except ImportError:
            raise missing_extra("t-SNE maps", "scikit-learn", "maps") from None
        perplexity = perplexity or min(30.0, (n - 1) / 3)
        if not 0 < perplexity < n:
            raise InputError(f"perplexity {perplexity} must be in (0, {n}) for {n} points")
        return TSNE(n_components=2, perplexity=perplexity, init="pca", random_state=seed).fit_transform(x.numpy())
    try:
        import umap
    except ImportError:
        raise missing_extra("UMAP maps", "umap-learn", None) from None
    neighbours = max(2, min(15, n - 1))
    return np.asarray(umap.UMAP(n_components=2, n_neighbors=neighbours, metric="cosine",
                                random_state=seed).fit_transform(x.numpy()))


def _pca(x: torch.Tensor) -> tuple[np.ndarray, tuple[float, float]]:
    centred = x - x.mean(0)
    u, s, vt = torch.linalg.svd(centred, full_matrices=False)
    vt = vt[:2]
    signs = torch.sign(vt.gather(1, vt.abs().argmax(1, keepdim=True)))  # the largest loading positive
    signs[signs == 0] = 1
    coords = centred @ (vt * signs).T  # (n, 2)
    total = float((s**2).sum()) or 1.0
    share = tuple(float(v) / total for v in (s[:2] ** 2))
    return coords.numpy(), (share + (0.0, 0.0))[:2]


def knn_accuracy(vectors, labels, k: int = 5) -> float:
    """Leave-one-out accuracy of a k-nearest-neighbour vote (cosine) in the full space: how well the
    labels separate at this layer, independent of the 2-D projection."""
    x = F.normalize(torch.as_tensor(vectors).double(), dim=-1)
    n = x.shape[0]
    k = min(k, n - 1)
    names = sorted(set(labels))
    y = torch.tensor([names.index(v) for v in labels])
    sim = (x @ x.T).fill_diagonal_(-2)
    neighbours = sim.topk(k, -1).indices  # (n, k)
    votes = F.one_hot(y[neighbours], len(names)).sum(1).double()  # (n, C)
    votes += 1e-3 * F.one_hot(y[neighbours[:, 0]], len(names))  # ties go to the nearest neighbour
    return float((votes.argmax(-1) == y).double().mean())


def stack_map(points: Points, layers, *, method: str = "pca", seed: int = 0, max_points: int | None = 3000,
              model: str = "model") -> StackMap:
    """Project the same points at each of ``layers`` (hidden-state indices, negative from the top, or
    what ``layers.parse_layers`` takes: ``"all"``, ``"0,3,6"``, ``"-3:"``). With
    more than ``max_points`` points a seeded sample is drawn once and used in every panel."""
    chosen = parse_layers(layers, points.vectors.shape[0])
    n = points.vectors.shape[1]
    keep = torch.arange(n)
    if max_points is not None and n > max_points:
        keep = torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:max_points].sort().values
    labels = [points.labels[i] for i in keep.tolist()]
    if len(set(labels)) < 2:
        raise InputError(f"the points have {len(set(labels))} label(s) {sorted(set(labels))}: a map coloured by "
                         "label needs at least 2")
    coords, scores, explained = [], [], []
    for layer in chosen:
        x = points.vectors[layer, keep]
        if method == "pca":
            xy, share = _pca(x.double())
            explained.append(share)
        else:
            xy = project(x, method, seed=seed)
        coords.append(xy)
        scores.append(knn_accuracy(x, labels))
    return StackMap(chosen, np.stack(coords), labels, method, seed, scores, explained if method == "pca" else None,
                    points.what, model)


# ------------------------------------------------------------------------------------------------- plot
AXIS = {"pca": "PC", "tsne": "t-SNE ", "umap": "UMAP "}
MAX_CLASSES = 20  # more classes than this: the rarest are drawn in grey as "other"


def plot_stack_map(result: StackMap, path, title: str | None = None, columns: int | None = None):
    """One panel per layer, the same points and colours in each, one legend (class and count, most
    frequent first) for the figure; each panel's title gives the layer and its 5-NN accuracy."""
    from .plots import _pyplot, _save, _wrap, output_path

    path = output_path(path)
    plt = _pyplot()
    counts = Counter(result.labels)
    classes = [c for c, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]
    shown = classes[:MAX_CLASSES] if len(classes) > MAX_CLASSES else classes
    palette = plt.get_cmap("tab10" if len(shown) <= 10 else "tab20")
    colour = {c: palette(i % palette.N) for i, c in enumerate(shown)}
    other = (0.6, 0.6, 0.6, 1.0)
    L = len(result.layers)
    columns = columns or min(L, 4)
    rows = -(-L // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(3.3 * columns, 3.3 * rows + 0.6), squeeze=False)
    size = max(4.0, min(30.0, 3000 / max(1, len(result.labels))))
    labels = np.array(result.labels, dtype=object)
    for k, ax in enumerate(axes.flat):
        if k >= L:
            ax.axis("off")
            continue
        xy = result.coords[k]
        rest = ~np.isin(labels, shown)
        if rest.any():
            ax.scatter(xy[rest, 0], xy[rest, 1], s=size, color=other, linewidths=0, alpha=0.6)
        for c in reversed(shown):  # the most frequent first in the legend, drawn last (on top)... of the rest
            sel = labels == c
            ax.scatter(xy[sel, 0], xy[sel, 1], s=size, color=colour[c], linewidths=0, alpha=0.8)
        layer = result.layers[k]
        ax.set_title(f"{'embeddings' if layer == 0 else f'layer {layer}'} · 5-NN acc {result.knn_accuracy[k]:.2f}",
                     fontsize=9)
        axis = AXIS[result.method]
        if result.explained is not None:
            a, b = result.explained[k]
            ax.set_xlabel(f"{axis}1 ({a:.0%})", fontsize=8)
            ax.set_ylabel(f"{axis}2 ({b:.0%})", fontsize=8)
        else:
            ax.set_xlabel(f"{axis}1", fontsize=8)
            ax.set_ylabel(f"{axis}2", fontsize=8)
        ax.tick_params(labelsize=6)
        ax.set_xticks([])
        ax.set_yticks([])
    handles = [plt.Line2D([], [], marker="o", linestyle="", color=colour[c], label=f"{c} ({counts[c]})")
               for c in shown]
    if len(shown) < len(classes):
        handles.append(plt.Line2D([], [], marker="o", linestyle="", color=other,
                                  label=f"other ({sum(counts[c] for c in classes[len(shown):])})"))
    fig.legend(handles=handles, loc="lower center", ncol=min(len(handles), 6), fontsize=8, frameon=False,
               bbox_to_anchor=(0.5, 0.0))
    method = {"pca": "PCA", "tsne": "t-SNE", "umap": "UMAP"}[result.method]
    heading = title or (f"{result.model}: {len(result.labels)} {result.what} by layer ({method}, seed {result.seed})")
    fig.suptitle(_wrap(heading, width=30 * columns // 2 + 20), fontsize=10)
    legend_rows = -(-len(handles) // 6)
    fig.tight_layout(rect=(0, 0.04 + 0.035 * legend_rows, 1, 0.95))
    return _save(fig, path)
