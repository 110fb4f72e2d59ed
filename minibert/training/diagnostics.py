"""Per-block gradient norms and update-to-weight ratios: what a training run's stability looks like inside.

Every ``every`` steps (and always at the first step, the gradient at initialisation) the training loop asks
``BlockGradients`` to measure, for the embeddings, each encoder block and the rest (heads, pooler, a final
LayerNorm):

* the gradient norm ``||g||`` over the group's parameters, before clipping -- Xiong et al. 2020 (figure 3)
  show that at initialisation it grows towards the output for post-LN BERT and is flat for pre-LN;
* the update-to-weight ratio ``||W_after - W_before|| / ||W_before||`` of that step -- how far the
  optimiser moved the group relative to its size (Karpathy's rule of thumb: around 1e-3 is healthy).

The record goes into the run's ``log.jsonl`` line of that step (``grad_norm`` and ``update_ratio``: one
value per block, ``*_embeddings`` and ``*_rest`` beside them); ``analysis.plots.block_gradients`` draws it.
"""

from __future__ import annotations

import math
import re

from torch import nn

_BLOCK = re.compile(r"(?:^|\.)encoder\.blocks\.(\d+)\.")


def block_groups(model: nn.Module) -> dict[str, list[tuple[str, nn.Parameter]]]:
    """The trainable parameters of ``model`` by group: "embeddings", "block 0" .. "block N-1", "rest"."""
    groups: dict[str, list] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        found = _BLOCK.search(name)
        key = f"block {found.group(1)}" if found else ("embeddings" if ".embeddings." in f".{name}" else "rest")
        groups.setdefault(key, []).append((name, p))
    return groups


def _norm(tensors) -> float:
    return math.sqrt(sum(float(t.detach().float().pow(2).sum()) for t in tensors))


class BlockGradients:
    """The training loop's probe: ``wants(step)``, then ``before(model, scale)`` between the backward pass
    and the optimiser step, ``after(model)`` once the step is taken; ``take()`` hands the record over."""

    def __init__(self, every: int):
        self.every, self.record, self._before = every, None, None

    def wants(self, step: int) -> bool:
        """``step``: steps taken so far (0 = the first step, at initialisation)."""
        return step == 0 or (step + 1) % self.every == 0

    def before(self, model: nn.Module, scale: float = 1.0) -> None:
        """Gradient norms (divided by an fp16 loss scale) and a copy of the weights about to change."""
        groups = block_groups(model)
        self._before = {key: [p.detach().clone() for _, p in params] for key, params in groups.items()}
        self.record = {key: _norm(p.grad for _, p in params if p.grad is not None) / scale
                       for key, params in groups.items()}

    def after(self, model: nn.Module) -> None:
        groups, ratios = block_groups(model), {}
        for key, params in groups.items():
            old = self._before.get(key, [])
            if len(old) == len(params):
                moved = _norm(p.detach() - w for (_, p), w in zip(params, old))
                ratios[key] = moved / max(_norm(old), 1e-30)
        self.record = _as_lists(self.record, ratios)
        self._before = None

    def take(self) -> dict | None:
        record, self.record = self.record, None
        return record


def _as_lists(norms: dict[str, float], ratios: dict[str, float]) -> dict:
    """The log line's fields: per-block lists in block order, the embeddings and the rest beside them."""
    blocks = sorted((k for k in norms if k.startswith("block ")), key=lambda k: int(k.split()[1]))
    out = {"grad_norm": [norms[k] for k in blocks], "update_ratio": [ratios.get(k, math.nan) for k in blocks]}
    for key in ("embeddings", "rest"):
        if key in norms:
            out[f"grad_norm_{key}"], out[f"update_ratio_{key}"] = norms[key], ratios.get(key, math.nan)
    return out


def watched_step(probe: BlockGradients | None, step: int, model: nn.Module, scaler, take_step) -> None:
    """``take_step()`` (the optimiser step), measured by ``probe`` when it wants this step."""
    if probe is None or not probe.wants(step):
        return take_step()
    probe.before(model, float(scaler.get_scale()) if scaler is not None else 1.0)
    take_step()
    probe.after(model)


def grad_growth(norms: list[float]) -> float:
    """The last block's gradient norm over the first block's: > 1 when gradients grow towards the output."""
    return norms[-1] / norms[0] if norms and norms[0] > 0 else math.nan


# ------------------------------------------------------------------------------- the unigram plateau
#: "on the plateau": a held-out masked accuracy within 10 % (relative) + 1 point of the most frequent token's
#: share -- what a model that predicts that one token at every mask scores, give or take the sample
PLATEAU_FACTOR, PLATEAU_POINTS = 1.1, 0.01


def unigram_rate(stream, specials) -> tuple[float, int]:
    """(the most frequent token's share of the corpus' tokens, its id): special tokens ([CLS], [SEP], ...)
    left out, since they are never masked. ``stream``: the token store's ids; ``specials``: a bool per id."""
    import numpy as np

    counts = np.bincount(np.asarray(stream), minlength=len(specials))[:len(specials)].astype(np.int64)
    counts[np.asarray(specials, dtype=bool)] = 0
    top = int(counts.argmax())
    return float(counts[top]) / max(1, int(counts.sum())), top


def on_plateau(accuracy: float, rate: float) -> bool:
    """Whether a held-out masked accuracy is the unigram rate's (or below it): the plateau."""
    return accuracy <= rate * PLATEAU_FACTOR + PLATEAU_POINTS


def special_ids(tokenizer):
    """A bool per id of ``tokenizer``'s vocabulary: True for its special tokens ([CLS], [SEP], [PAD], ...)."""
    import numpy as np

    specials = np.zeros(len(tokenizer.vocab), dtype=bool)
    specials[[tokenizer.vocab[t] for t in tokenizer.all_special_tokens if t in tokenizer.vocab]] = True
    return specials


class PlateauWatch:
    """Says once when a run's held-out masked accuracy is still at the unigram rate at or after ``after``
    steps: the run has learnt only which token is most frequent (a warning, the run goes on)."""

    def __init__(self, rate: float, token: int, after: int, placement: str = "post"):
        self.rate, self.token, self.after, self.said = rate, token, after, False
        self.placement = placement  # pre-LN is not suggested to a run that has it

    def check(self, step: int, accuracy: float) -> str | None:
        if self.said or step < self.after or not on_plateau(accuracy, self.rate):
            return None
        self.said = True
        near = abs(accuracy - self.rate) <= self.rate * (PLATEAU_FACTOR - 1) + PLATEAU_POINTS
        where = "still the unigram rate" if near else "below even the unigram rate"  # 0.000: not "still" 0.055
        return (f"step {step}: held-out masked accuracy {accuracy:.3f} is {where} {self.rate:.3f} "
                f"(always predicting the corpus' most frequent token, id {self.token}): the run is stuck on the "
                "unigram plateau. What usually gets a run off it: a longer warmup (--warmup 0.2), "
                f"{'' if self.placement == 'pre' else 'pre-LN (--norm pre), '}a lower learning rate (--lr); fewer "
                "blocks also train more easily")
