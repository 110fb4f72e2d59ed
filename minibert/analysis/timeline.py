"""Probing across time: what each layer knows at each moment of a pre-training run, and when it settles.

A run of ``minibert pretrain --snapshots N`` keeps the model at step 0 and at N steps spaced evenly in
log(step) (``OUT/snapshots/step-000123``: each a checkpoint with its tokenizer). For every snapshot this
module extracts the word vectors of every hidden state on labelled sentences (CoNLL-U), then

* trains a linear probe per layer, with its control task (Hewitt & Liang 2019), as ``minibert probe``
  does: a layer x step grid of probe accuracy answers "when does each layer learn parts of speech?"
  (Liu et al. 2021, "Probing Across Time"; Chiang et al. 2020);
* measures the linear CKA (Kornblith et al. 2019) of each layer's vectors between consecutive snapshots
  and against the final one: the layers whose CKA reaches 1 early are the ones that settle first
  (Raghu et al. 2017 saw lower layers converge first in SVCCA).

The words are the same in every snapshot, so both measures compare like with like. ``probe_over_time``
takes any run folder with snapshots, or a list of (step, folder).
"""

from __future__ import annotations

import json
import logging
from ..errors import InputError
from .layers import linear_cka
from .probing import labelled_word_features, probe_layers
from dataclasses import asdict, dataclass
from pathlib import Path

log = logging.getLogger(__name__)


def snapshot_folder(run_dir, step: int) -> Path:
    """Where a run keeps its snapshot of ``step`` (the one place that names the layout)."""
    return Path(run_dir) / "snapshots" / f"step-{step:06d}"


def snapshots(run_dir) -> list[tuple[int, Path]]:
    """A run's complete snapshots (a config.json written), as (step, folder), by step."""
    folder = Path(run_dir) / "snapshots"
    found = [p for p in folder.glob("step-*") if (p / "config.json").exists()] if folder.is_dir() else []
    return sorted((int(p.name.split("-")[1]), p) for p in found)


@dataclass
class Timeline:
    """Per snapshot (rows, in step order) and per hidden state (columns, 0 = embeddings)."""

    steps: list[int]
    accuracy: list[list[float]]  # probe accuracy on held-out sentences
    control_accuracy: list[list[float]]
    cka_next: list[list[float]]  # linear CKA with the next snapshot (one row fewer)
    cka_final: list[list[float]]  # linear CKA with the last snapshot
    words: int  # labelled words the vectors are taken at
    majority_baseline: float

    @property
    def selectivity(self) -> list[list[float]]:
        return [[a - c for a, c in zip(acc, ctrl)] for acc, ctrl in zip(self.accuracy, self.control_accuracy)]

    def first_step_reaching(self, share: float = 0.9) -> list[int | None]:
        """Per layer: the first snapshot step whose probe accuracy reaches ``share`` of that layer's best
        gain over the majority baseline (None if it never does) -- "when did this layer learn it?"."""
        result = []
        for layer in range(len(self.accuracy[0])):
            column = [row[layer] for row in self.accuracy]
            best = max(column)
            target = self.majority_baseline + share * (best - self.majority_baseline)
            result.append(next((s for s, a in zip(self.steps, column) if a >= target), None))
        return result

    def table(self) -> str:
        layers = len(self.accuracy[0])
        head = f"{'step':>8}  " + "  ".join(f"{'L' + str(l):>6}" for l in range(layers))
        lines = ["probe accuracy per hidden state (0 = embeddings)", head]
        lines += [f"{s:>8}  " + "  ".join(f"{a:>6.3f}" for a in row) for s, row in zip(self.steps, self.accuracy)]
        lines += ["", "linear CKA with the next snapshot", head]
        lines += [f"{s:>8}  " + "  ".join(f"{c:>6.3f}" for c in row) for s, row in zip(self.steps, self.cka_next)]
        reached = self.first_step_reaching()
        lines += ["", "first step at 90 % of the layer's best gain: "
                  + ", ".join(f"L{l} {s}" for l, s in enumerate(reached)),
                  f"{self.words} labelled words; majority baseline {self.majority_baseline:.3f}"]
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {**asdict(self), "selectivity": self.selectivity, "first_step_at_90_percent": self.first_step_reaching()}


def probe_over_time(run, data: list[tuple[list[str], list[str]]], *, pool: str = "first", batch_size: int = 16,
                    seed: int = 0, test_fraction: float = 0.2, progress: bool = True, device=None) -> Timeline:
    """``run``: a run folder with ``snapshots/`` or a list of (step, folder); ``data``: (words, labels)
    sentences (``textfiles.read_conllu``). Every snapshot is probed with the same split and seed; its
    features are computed on ``device`` (None: the CPU)."""
    from ..models import BertModel
    from ..tokenizer import BertTokenizer

    found = snapshots(run) if isinstance(run, (str, Path)) else sorted((int(s), Path(f)) for s, f in run)
    if len(found) < 2:
        where = f"{Path(run) / 'snapshots'}" if isinstance(run, (str, Path)) else "the list given"
        raise InputError(f"probing across time needs at least 2 snapshots, {where} has {len(found)} (pre-train "
                         "with --snapshots N)")
    tokenizer = BertTokenizer.from_pretrained(found[0][1])
    vectors, rows = [], []
    for step, folder in found:
        model = BertModel.from_pretrained(folder, device=device)
        tokenizer.check_fits(model.config, str(folder))
        features, words, labels, sentence_ids = labelled_word_features(model, tokenizer, data, pool=pool,
                                                                       batch_size=batch_size, progress=False)
        result = probe_layers(features, words, labels, sentence_ids, seed=seed, test_fraction=test_fraction)
        vectors.append(features)
        rows.append(result)
        log.info(f"step {step}: probe accuracy " + " ".join(f"{a:.3f}" for a in result.accuracy))
    if len({v.shape[0] for v in vectors}) != 1:
        raise InputError("the snapshots have different depths: they are not one run")
    layers = vectors[0].shape[0]
    cka_next = [[linear_cka(a[l], b[l]) for l in range(layers)] for a, b in zip(vectors, vectors[1:])]
    cka_final = [[linear_cka(a[l], vectors[-1][l]) for l in range(layers)] for a in vectors]
    return Timeline(steps=[s for s, _ in found], accuracy=[r.accuracy for r in rows],
                    control_accuracy=[r.control_accuracy for r in rows], cka_next=cka_next, cka_final=cka_final,
                    words=int(vectors[0].shape[1]), majority_baseline=rows[0].majority_baseline)


def save_timeline(timeline: Timeline, path) -> Path:
    """The timeline as JSON (written atomically)."""
    from ..textfiles import write_text_atomic

    path = Path(path)
    write_text_atomic(path, json.dumps(timeline.to_json(), indent=2) + "\n")
    return path

