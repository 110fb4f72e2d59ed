"""PNG plots for layer analysis (needs matplotlib: ``pip install 'minibert[plots]'``)."""

from __future__ import annotations

from pathlib import Path


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ImportError("plots need matplotlib: pip install 'minibert[plots]'") from None
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    _pyplot().close(fig)
    return path


def similarity_heatmap(matrix, path, title="Layer similarity (linear CKA)", label="CKA") -> Path:
    """(L + 1) x (L + 1) similarity matrix; layer 0 is the embedding output."""
    plt = _pyplot()
    m = [[float(v) for v in row] for row in matrix]
    n = len(m)
    fig, ax = plt.subplots(figsize=(1.2 + 0.45 * n, 1.0 + 0.45 * n))
    im = ax.imshow(m, vmin=min(0.0, min(map(min, m))), vmax=1.0, cmap="viridis", origin="lower")
    ax.set_xticks(range(n))
    ax.set_yticks(range(n))
    ax.set_xlabel("layer (0 = embeddings)")
    ax.set_ylabel("layer (0 = embeddings)")
    ax.set_title(title)
    if n <= 16:
        for i in range(n):
            for j in range(n):
                ax.text(j, i, f"{m[i][j]:.2f}", ha="center", va="center", fontsize=7,
                        color="white" if m[i][j] < 0.6 else "black")
    fig.colorbar(im, ax=ax, label=label)
    return _save(fig, path)


def probe_curve(result, path, title="Linear probe accuracy per layer") -> Path:
    """Held-out accuracy per layer, with the control task and the majority baseline."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(result.layers, result.accuracy, "o-", label="task")
    if any(c == c for c in result.control_accuracy):  # not all NaN
        ax.plot(result.layers, result.control_accuracy, "s--", label="control task (Hewitt & Liang)")
    ax.axhline(result.majority_baseline, color="gray", linestyle=":", label="majority baseline")
    ax.set_xticks(result.layers)
    ax.set_xlabel("layer (0 = embeddings)")
    ax.set_ylabel("held-out accuracy")
    ax.set_ylim(0, 1.02)
    ax.set_title(title)
    ax.legend(loc="lower right")
    ax.grid(alpha=0.3)
    return _save(fig, path)


def attention_map(probs, tokens, path, layer: int, head: int, title=None) -> Path:
    """One head's attention for one sentence: probs (T, T) over the sentence's real tokens only."""
    plt = _pyplot()
    probs = [[float(v) for v in row] for row in probs]
    n = len(tokens)
    if len(probs) != n or any(len(r) != n for r in probs):
        raise ValueError(f"attention map is {len(probs)}x{len(probs[0]) if probs else 0}, tokens are {n}")
    fig, ax = plt.subplots(figsize=(1.5 + 0.35 * n, 1.2 + 0.35 * n))
    im = ax.imshow(probs, vmin=0, vmax=1, cmap="Blues")
    ax.set_xticks(range(n))
    ax.set_xticklabels(tokens, rotation=90)
    ax.set_yticks(range(n))
    ax.set_yticklabels(tokens)
    ax.set_xlabel("key (attended to)")
    ax.set_ylabel("query")
    ax.set_title(title or f"Attention, layer {layer}, head {head}")
    fig.colorbar(im, ax=ax, label="probability")
    return _save(fig, path)


def mix_weights(weights, norms, path, first_layer: int = 0, gamma=None, title="Scalar mix weights") -> Path:
    """Softmax mix weights per layer, with the layers' mean token norms beside them: raw weights alone
    mislead because the layers' scales differ."""
    plt = _pyplot()
    w = [float(x) for x in weights]
    layers = list(range(first_layer, first_layer + len(w)))
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.6))
    a1.bar(layers, w, color="tab:blue")
    a1.set_xlabel("layer (0 = embeddings)")
    a1.set_ylabel("softmax weight")
    a1.set_title(title + (f" (gamma = {float(gamma):.3f})" if gamma is not None else ""))
    a1.set_xticks(layers)
    a2.bar(layers, [float(x) for x in norms], color="tab:orange")
    a2.set_xlabel("layer (0 = embeddings)")
    a2.set_ylabel("mean token L2 norm")
    a2.set_title("Per-layer norm")
    a2.set_xticks(layers)
    return _save(fig, path)


def logit_lens(result, path, title=None) -> Path:
    """Per layer: probability of the final prediction (line) and its rank (log scale, right axis)."""
    plt = _pyplot()
    layers = [r.layer for r in result.rows]
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    ax.plot(layers, [r.target_prob for r in result.rows], marker="o", label=f"p({result.target})")
    ax.plot(layers, [r.top_prob for r in result.rows], marker=".", linestyle=":", label="p(layer's top token)")
    ax.set_xlabel("layer (0 = embeddings)")
    ax.set_ylabel("probability")
    ax.set_ylim(0, 1)
    ax.set_xticks(layers)
    rank_ax = ax.twinx()
    rank_ax.plot(layers, [r.target_rank for r in result.rows], color="tab:red", alpha=0.6, label="rank")
    rank_ax.set_yscale("log")
    rank_ax.set_ylim(max(2 * max(r.target_rank for r in result.rows), 10), 0.8)  # rank 1 at the top
    rank_ax.set_ylabel(f"rank of {result.target!r} (1 = top)")
    ax.legend(loc="upper left", fontsize=8)
    ax.set_title(title or f"Logit lens: when does {result.target!r} win?")
    return _save(fig, path)
