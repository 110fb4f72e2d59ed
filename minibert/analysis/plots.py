"""Plots for layer analysis (needs matplotlib: ``pip install -e ".[plots]"``).

Each function writes one figure to ``path``: PNG at 150 dpi, or SVG / PDF when the file name ends so.
``output_path`` checks a path before any work is done; no function creates directories."""

from __future__ import annotations

import math
from pathlib import Path

from ..textfiles import PLOT_SUFFIXES, atomic_file, output_file
from ..errors import InputError, missing_extra, require_extra


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise missing_extra("plots", "matplotlib", "plots") from None
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


#: file types a plot can be written as, chosen by the file name's suffix (no suffix: .png)
FORMATS = PLOT_SUFFIXES
DPI = 150  # raster plots (PNG); SVG and PDF are vector graphics, for print


def output_path(path) -> Path:
    """Where a plot will really be written: ``path`` with ``.png`` added when it has no suffix. An
    unsupported suffix, a missing directory or a directory in place of the file is an InputError, raised
    before any work (call it first) and again when saving; directories are never created."""
    require_extra("matplotlib", "plots", extra="plots")
    return output_file(path, ".png", "plot file", formats=FORMATS)


def _save(fig, path) -> Path:
    path = output_path(path)
    with atomic_file(path) as tmp:  # a killed process leaves the old figure or the new one
        fig.savefig(tmp, dpi=DPI, bbox_inches="tight", format=path.suffix.lower()[1:])
    _pyplot().close(fig)
    return path


def _wrap(title: str, width: int = 48, max_lines: int = 3) -> str:
    """A title in at most ``max_lines`` lines of ``width`` characters, shortened with ... if longer."""
    import textwrap

    lines = []
    for part in str(title).split("\n"):
        lines += textwrap.wrap(part, width) or [""]
    if len(lines) > max_lines:
        lines = lines[:max_lines]
        lines[-1] = lines[-1][: width - 3].rstrip() + "..."
    return "\n".join(lines)


def similarity_heatmap(matrix, path, title="Layer similarity (linear CKA)", label="linear CKA") -> Path:
    """(L + 1) x (L + 1) similarity matrix; layer 0 is the embedding output. The colour scale spans the
    values in the matrix (its label says so), so differences between 0.77 and 1.0 are visible."""
    plt = _pyplot()
    m = [[float(v) for v in row] for row in matrix]
    n = len(m)
    lo, hi = min(map(min, m)), max(map(max, m))
    if hi - lo < 1e-6:  # a constant matrix: a small band around it
        lo, hi = lo - 0.005, hi + 0.005
    side = min(10.0, 2.5 + 0.45 * n)
    fig, ax = plt.subplots(figsize=(side + 1.2, side))
    im = ax.imshow(m, vmin=lo, vmax=hi, cmap="viridis", origin="lower")
    ax.set_xticks(range(n))
    ax.set_yticks(range(n))
    ax.set_xlabel("layer (0 = embeddings)")
    ax.set_ylabel("layer (0 = embeddings)")
    ax.set_title(_wrap(title), fontsize=10)
    if n <= 16:
        size = 8 if n <= 10 else 6
        for i in range(n):
            for j in range(n):
                dark = (m[i][j] - lo) / (hi - lo) < 0.55  # viridis is dark at the low end
                ax.text(j, i, f"{m[i][j]:.2f}", ha="center", va="center", fontsize=size,
                        color="white" if dark else "black")
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04,
                 label=f"{label} (colour scale fitted to the data: {lo:.2f} to {hi:.2f})")
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
    """One head's attention for one sentence: probs (T, T) over the sentence's real tokens only. The
    figure stays at most 7 inches square whatever T is (labels shrink instead), and the colour bar is
    as tall as the map."""
    plt = _pyplot()
    probs = [[float(v) for v in row] for row in probs]
    n = len(tokens)
    if len(probs) != n or any(len(r) != n for r in probs):
        raise InputError(f"attention map is {len(probs)}x{len(probs[0]) if probs else 0}, tokens are {n}")
    side = min(7.0, 2.0 + 0.25 * n)  # inches: 1200 px at 150 dpi at most
    fig, ax = plt.subplots(figsize=(side + 1.0, side))
    im = ax.imshow(probs, vmin=0, vmax=1, cmap="Blues")
    labels = min(8, max(4, int(0.8 * 72 * (side - 1.5) / n)))  # points: a label fits its cell
    ax.set_xticks(range(n))
    ax.set_xticklabels(tokens, rotation=90, fontsize=labels)
    ax.set_yticks(range(n))
    ax.set_yticklabels(tokens, fontsize=labels)
    ax.set_xlabel("key (attended to)")
    ax.set_ylabel("query")
    ax.set_title(_wrap(title or f"Attention, layer {layer}, head {head}"), fontsize=10)
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04, label="probability")
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
    """Per layer: probability of the final prediction (line) and its rank (log scale, right axis, rank 1
    at the top). One legend lists all three lines."""
    plt = _pyplot()
    from matplotlib.ticker import FixedLocator, NullFormatter, NullLocator

    layers = [r.layer for r in result.rows]
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    lines = ax.plot(layers, [r.target_prob for r in result.rows], marker="o", label=f"p({result.target})")
    lines += ax.plot(layers, [r.top_prob for r in result.rows], marker=".", linestyle=":",
                     label="p(layer's top token)")
    ax.set_xlabel("layer (0 = embeddings)")
    ax.set_ylabel("probability")
    ax.set_ylim(0, 1)
    ax.set_xticks(layers)
    rank_ax = ax.twinx()
    ranks = [r.target_rank for r in result.rows]
    lines += rank_ax.plot(layers, ranks, color="tab:red", alpha=0.6, marker="s", markersize=3,
                          label=f"rank of {result.target!r} (right axis)")
    rank_ax.set_yscale("log")
    top = 10 ** max(1, math.ceil(math.log10(max(ranks) + 1)))
    rank_ax.set_ylim(top, 0.8)  # inverted: rank 1 at the top
    rank_ax.yaxis.set_major_locator(FixedLocator([10 ** k for k in range(int(math.log10(top)) + 1)]))
    rank_ax.yaxis.set_minor_locator(NullLocator())
    rank_ax.yaxis.set_minor_formatter(NullFormatter())
    rank_ax.set_yticklabels([f"{10 ** k:,}" for k in range(int(math.log10(top)) + 1)])
    rank_ax.set_ylabel("rank (1 = top)")
    ax.legend(lines, [line.get_label() for line in lines], loc="center left", fontsize=8)
    ax.set_title(_wrap(title or f"Logit lens: when does {result.target!r} win?", 60), fontsize=10)
    return _save(fig, path)


def timeline_heatmaps(timeline, path, title="Probing across time") -> Path:
    """Two panels of hidden state (rows, 0 = embeddings) x snapshot step (columns, log-spaced): the probe
    accuracy, and the linear CKA of each layer with the final snapshot (1 = settled)."""
    plt = _pyplot()
    acc = [list(col) for col in zip(*timeline.accuracy)]  # (layers, snapshots)
    cka = [list(col) for col in zip(*timeline.cka_final)]
    layers, n = len(acc), len(timeline.steps)
    fig, axes = plt.subplots(1, 2, figsize=(min(16.0, 4.0 + 1.1 * n), 1.6 + 0.45 * layers), squeeze=False)
    for ax, values, name in ((axes[0][0], acc, "probe accuracy"), (axes[0][1], cka, "linear CKA with the last step")):
        im = ax.imshow(values, origin="lower", aspect="auto", cmap="viridis")
        ax.set_xticks(range(n))
        ax.set_xticklabels([str(s) for s in timeline.steps], rotation=45, fontsize=7)
        ax.set_yticks(range(layers))
        ax.set_xlabel("step")
        ax.set_ylabel("hidden state (0 = embeddings)")
        ax.set_title(name, fontsize=9)
        fig.colorbar(im, ax=ax, label=name)
        if layers * n <= 160:
            for i in range(layers):
                for j in range(n):
                    ax.text(j, i, f"{values[i][j]:.2f}", ha="center", va="center", fontsize=6, color="white")
    fig.suptitle(_wrap(title, 80), fontsize=10)
    return _save(fig, path)


def depth_study_figures(rows: list[dict], runs: list[dict], folder, name: str = "depth") -> list[Path]:
    """A depth study's figures (``runs.depth_study``): ``{name}_loss.png`` (held-out masked-LM loss vs
    blocks, equal steps and equal training FLOPs, every single run a gray dot), ``{name}_downstream.png``
    when the study probed or fine-tuned (best probe layer, fine-tuned task accuracy and its random-init
    control vs blocks, each run's task accuracy a gray dot) and
    ``{name}_probes.png`` (each depth's probe curve: equal steps, or equal FLOPs when that is the only budget;
    the first seed). ``rows``: one per (depth, budget), seeds averaged; ``runs``: every run."""
    plt = _pyplot()
    folder = Path(folder)
    written = []
    fig, ax = plt.subplots(figsize=(6, 4))
    for budget, marker, label in (("steps", "o", "equal steps (same tokens)"), ("compute", "s", "equal training FLOPs")):
        mine = [r for r in rows if r["budget"] == budget]
        if mine:
            ax.plot([r["depth"] for r in mine], [r["eval_loss"] for r in mine], marker + "-", label=label)
    ax.scatter([r["depth"] for r in runs], [r["eval_loss"] for r in runs], s=12, color="gray", zorder=3)
    ax.set_xlabel("blocks")
    ax.set_ylabel("held-out masked-LM loss")
    ax.set_xticks(sorted({r["depth"] for r in rows}))
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title("Does depth help? (gray dots: single runs)", fontsize=10)
    written.append(_save(fig, folder / f"{name}_loss.png"))
    downstream = (("probe_best", "best probe layer"), ("task_accuracy", "fine-tuned task"),
                  ("task_accuracy_random", "the task from random init"))
    if any(key in r for r in rows for key, _ in downstream):  # a study without probe or task has no such figure
        written.append(_downstream_figure(plt, rows, runs, downstream, folder / f"{name}_downstream.png"))
    first = min((r["seed"] for r in runs), default=0)
    budget = "steps" if any(r["budget"] == "steps" for r in runs) else "compute"
    curves = sorted((r for r in runs if r["budget"] == budget and r["seed"] == first and "probe_accuracy" in r),
                    key=lambda r: r["depth"])
    if curves:
        fig, ax = plt.subplots(figsize=(6, 4))
        for r in curves:
            ax.plot(range(len(r["probe_accuracy"])), r["probe_accuracy"], "o-", label=f"{r['depth']} blocks")
        ax.set_xlabel("hidden state (0 = embeddings)")
        ax.set_ylabel("probe accuracy (held-out words)")
        ax.grid(alpha=0.3)
        ax.legend()
        ax.set_title("Where each depth keeps the probed labels", fontsize=10)
        written.append(_save(fig, folder / f"{name}_probes.png"))
    return written


def _downstream_figure(plt, rows: list[dict], runs: list[dict], keys, path: Path) -> Path:
    """Best probe layer, fine-tuned task accuracy and its random-init control vs blocks (``keys``: (measure,
    label) pairs), each run's task accuracy a gray dot."""
    fig, ax = plt.subplots(figsize=(6, 4))
    for key, label in keys:
        for budget, style, said in (("steps", "o-", "equal steps"), ("compute", "s--", "equal FLOPs")):
            mine = [r for r in rows if r["budget"] == budget and key in r]
            if mine:
                ax.plot([r["depth"] for r in mine], [r[key] for r in mine], style, label=f"{label} ({said})")
    tasks = [r for r in runs if "task_accuracy" in r]  # the seeds behind a mean can disagree (one stuck, one not)
    ax.scatter([r["depth"] for r in tasks], [r["task_accuracy"] for r in tasks], s=12, color="gray", zorder=3)
    ax.set_xlabel("blocks")
    ax.set_ylabel("accuracy")
    ax.set_xticks(sorted({r["depth"] for r in rows}))
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend()
    ax.set_title("What each depth learnt" + (" (gray dots: single runs' task accuracy)" if tasks else ""), fontsize=10)
    return _save(fig, path)


def cut_vs_grown_figure(entry: dict, teacher: dict, path) -> Path:
    """``runs.depth_study.cut_vs_grown``'s comparison: held-out masked-LM loss (left) and the fine-tuned
    task's accuracy, or the best probe layer's without a task (right), of the cut, grown and distilled
    k-block models against k; the deepest model (``teacher``, its study run) as a dashed line."""
    plt = _pyplot()
    depths = sorted(int(k) for k in entry["depths"])
    first = entry["depths"][str(depths[0])]["grown"]
    key, label = (("task_accuracy", "fine-tuned task accuracy") if "task_accuracy" in first else
                  ("probe_best", "best probe layer's accuracy"))

    def value(measures, key):
        return max(measures["probe_accuracy"]) if key == "probe_best" else measures[key]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, (k, said) in zip(axes, (("eval_loss", "held-out masked-LM loss"), (key, label))):
        if k == "probe_best" and "probe_accuracy" not in first:
            ax.set_axis_off()
            continue
        for arm, style in (("cut", "v-"), ("grown", "o-"), ("distilled", "s-")):
            ax.plot(depths, [value(entry["depths"][str(d)][arm], k) for d in depths], style, label=arm)
        ax.axhline(value(teacher, k), color="gray", linestyle="--", label=f"{entry['teacher']} (all blocks)")
        ax.set_xlabel("blocks kept or trained")
        ax.set_ylabel(said)
        ax.set_xticks(depths)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Cut from the deepest model, grown from scratch, or distilled from it", fontsize=10)
    return _save(fig, Path(path))


def block_gradients(records: list[dict], path, title="Per-block gradients") -> Path:
    """A run's per-block diagnostics (``training.diagnostics``: the ``log.jsonl`` lines that hold
    ``grad_norm``): the gradient norm (left) and the update-to-weight ratio (right) of each block against
    the step, one line per block on a log scale, the first block lightest."""
    records = [r for r in records if r.get("grad_norm")]
    if not records:
        raise InputError("no per-block gradient records (log.jsonl lines with grad_norm): train with --grad-every")
    plt = _pyplot()
    blocks = len(records[0]["grad_norm"])
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    colours = plt.get_cmap("viridis")
    for ax, key, label in ((axes[0], "grad_norm", "gradient norm"), (axes[1], "update_ratio", "||update|| / ||weight||")):
        steps = [r["step"] for r in records]
        for b in range(blocks):
            values = [r[key][b] if len(r[key]) > b and r[key][b] > 0 else math.nan  # 0: a step at lr 0 (warmup's
                      for r in records]  # first), which a log scale cannot show
            ax.plot(steps, values, "o-" if len(steps) < 30 else "-", markersize=3,
                    color=colours(b / max(1, blocks - 1) * 0.9), label=f"block {b}")
        ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3, which="both")
    axes[0].legend(fontsize=7, ncol=2 if blocks > 6 else 1)
    fig.suptitle(_wrap(title, 90), fontsize=10)
    return _save(fig, path)


def gradients_at_init(runs: dict[str, list[float]], path, title="Gradient norm per block at initialisation") -> Path:
    """Xiong et al.'s picture: the first step's gradient norm of each block, one line per model (``runs``:
    a label -> its per-block norms, e.g. {"post-LN": [...], "pre-LN": [...]}), log scale."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, norms in runs.items():
        ax.plot(range(len(norms)), norms, "o-", label=label)
    ax.set_yscale("log")
    ax.set_xlabel("block (0 = nearest the input)")
    ax.set_ylabel("gradient norm, step 1")
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    ax.set_title(_wrap(title, 70), fontsize=10)
    return _save(fig, path)


def _by_placement(plt, rows: list[dict], key: str, ylabel: str, title: str, path: Path) -> Path:
    """``key`` vs blocks: one panel per norm placement (BERT's post-LN first), one line per warmup share."""
    from ..config import NORM_PLACEMENTS

    norms = sorted({r["norm"] for r in rows}, key=NORM_PLACEMENTS.index)
    warmups = sorted({r["warmup"] for r in rows})
    colours = plt.get_cmap("viridis")
    fig, axes = plt.subplots(1, len(norms), figsize=(3.2 * len(norms) + 1, 3.6), sharey=True, squeeze=False)
    for ax, norm in zip(axes[0], norms):
        for i, warmup in enumerate(warmups):
            mine = sorted((r for r in rows if (r["norm"], r["warmup"]) == (norm, warmup) and key in r),
                          key=lambda r: r["depth"])
            if mine:
                ax.plot([r["depth"] for r in mine], [r[key] for r in mine], "o-", label=f"warmup {warmup:g}",
                        color=colours(i / max(1, len(warmups) - 1) * 0.85))
        ax.set_title(norm if norm != "post" else "post (BERT)", fontsize=9)
        ax.set_xlabel("blocks")
        ax.set_xticks(sorted({r["depth"] for r in rows}))
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(ylabel, fontsize=8)
    if axes[0][0].get_legend_handles_labels()[0]:
        axes[0][0].legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    return _save(fig, path)


def stability_figures(rows: list[dict], runs: list[dict], folder, name: str = "depth") -> list[Path]:
    """A stability study's figures (``runs.depth_study`` with several norm placements or warmups), equal
    steps: ``{name}_stuck.png`` (the share of runs left on the unigram plateau vs blocks, a panel per
    placement, a line per warmup), ``{name}_loss_by_norm.png`` (held-out masked-LM loss vs blocks, the same)
    and ``{name}_grad_init.png`` (the deepest models' gradient norm per block at the first step, one line per
    placement: Xiong et al. 2020's picture)."""
    plt = _pyplot()
    folder = Path(folder)
    written = []
    steps = [r for r in rows if r["budget"] == "steps"] or rows
    for key, ylabel, suffix, title in (("stuck_share", "share of runs stuck on the unigram plateau", "stuck",
                                        "Which runs stay on the unigram plateau"),
                                       ("eval_loss", "held-out masked-LM loss", "loss_by_norm",
                                        "Held-out loss by norm placement and warmup")):
        written.append(_by_placement(plt, steps, key, ylabel, f"{title} (equal steps)",
                                     folder / f"{name}_{suffix}.png"))
    measured = [r for r in runs if r.get("grad_init")]
    if measured:
        deepest = max(r["depth"] for r in measured)
        chosen = {}
        for r in sorted(measured, key=lambda r: (r["seed"], r.get("warmup", 0.06))):
            if r["depth"] == deepest:
                chosen.setdefault(r.get("norm", "post"), r["grad_init"])
        written.append(gradients_at_init({f"{norm}": norms for norm, norms in chosen.items()},
                                         folder / f"{name}_grad_init.png",
                                         title=f"Gradient norm per block at initialisation, {deepest} blocks"))
    return written
