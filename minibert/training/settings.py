"""The training loop's settings, declared once (``minibert.settings``): what every run that trains with
``loop.fit`` shares. Standard library only, so that the command line builds its options from them without
importing torch; ``runs.settings`` extends them with each command's own."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from ..checks import SEED_LIMIT
from ..errors import InputError
from ..settings import check, setting

#: the largest learning rate a setting takes: AdamW moves every weight by about the rate each step, so a run
#: diverges well below it, but up to it the loop's finiteness check says so (step N, the loss, the rate);
#: above it the optimiser's float32 arithmetic itself overflows (1e38 did) before any check can speak
LR_LIMIT = 1e6
#: a learning rate's bounds, the same in every setting that has one: finite, > 0, at most LR_LIMIT
LR_BOUNDS = dict(low=0.0, strict=True, high=LR_LIMIT)

RESUME_HELP = ("continue the unfinished run in --out (same settings; it ends as the uninterrupted run would have); "
               "a finished run has nothing to resume")


@dataclass(kw_only=True)
class FitConfig:
    """How ``loop.fit`` trains: AdamW (weight decay on weights only), warmup then linear decay, clipping,
    gradient accumulation, mixed precision, seeding, resuming."""

    epochs: int = setting(3, "passes over the training data", low=1)
    lr: float = setting(5e-5, "peak learning rate (warmup, then linear decay to 0)", **LR_BOUNDS)
    weight_decay: float = setting(0.01, "AdamW's weight decay, on weights only (not biases or LayerNorms)",
                                  low=0.0, cli=False)
    layer_decay: float | None = setting(None, "layer-wise learning-rate decay: each block's rate times this per "
                                        "block from the top (e.g. 0.9); None: off", low=0.0, high=1.0, strict=True,
                                        cli=False)
    warmup_ratio: float = setting(0.1, "share of the optimisation steps spent warming up", low=0.0, below=1.0,
                                  cli=False)
    accumulate: int = setting(1, "batches per optimisation step (gradient accumulation)", low=1, cli=False)
    max_grad_norm: float | None = setting(1.0, "clip the gradient norm at this; None: off", low=0.0, strict=True,
                                          cli=False)
    seed: int = setting(0, "random seed, an integer >= 0", low=0, high=SEED_LIMIT)
    bf16: bool = setting(False, "bf16 autocast (fp32 master weights)")
    fp16: bool = setting(False, "CUDA only: fp16 autocast with loss scaling (fp32 master weights)", cli=False)
    progress: bool = setting(True, "no progress bar", flag="--quiet", negate=True)
    resume: bool = setting(False, RESUME_HELP)

    def recorded(self) -> dict:
        """The settings a resumed run must share with the run it continues (not progress, not resume)."""
        return {k: v for k, v in asdict(self).items() if k not in ("progress", "resume")}

    def check(self) -> None:
        check(self)
        if self.bf16 and self.fp16:
            raise InputError("bf16 and fp16 exclude each other")


POOLINGS = ("mean", "cls", "max")


@dataclass(kw_only=True)
class EmbeddingDistillConfig(FitConfig):
    """How ``distill.distill_embeddings`` trains a student to give its teacher's sentence vectors: the loop's
    settings, the loss (the vectors compared, and the weights of the optional terms) and the batches."""

    lr: float = setting(5e-4, "peak learning rate (warmup, then linear decay to 0)", **LR_BOUNDS)
    pooling: str = setting("mean", "embedding mode: sentence vector", choices=POOLINGS, flag="--pool")
    normalize: bool = setting(False, "embedding mode: match unit vectors")
    similarity_weight: float = setting(0.0, "embedding mode: weight of the MSE between in-batch cosine similarities",
                                       low=0.0)
    hidden_weight: float = setting(0.0, "weight of the hidden-state MSE", low=0.0)
    attention_weight: float = setting(0.0, "weight of the attention KL", low=0.0)
    batch_size: int = setting(32, "texts per batch", low=1)
    max_length: int | None = setting(128, "truncate texts to this many tokens, [CLS] and [SEP] included", low=3)
    group_by_length: bool = setting(False, "embedding mode: batches of texts of similar length (less padding, "
                                    "faster epochs)")
    cache_teacher: bool = setting(False, "embedding mode: compute the teacher's vectors once, before the first "
                                  "epoch (faster epochs; not with --hidden-weight / --attention-weight)")
    student_dropout: float | None = setting(0.0, "the student's dropout while it trains (0: off -- a regression "
                                            "onto a deterministic teacher fits better without that noise); the "
                                            "saved student keeps its own; None: its own throughout",
                                            low=0.0, below=1.0)
    k: int = setting(10, "the k of the top-k overlap the agreement reports", low=1, high=1000, cli=False)

    def check(self) -> None:
        super().check()
        if self.cache_teacher and (self.hidden_weight or self.attention_weight):
            raise InputError("cache_teacher keeps only the teacher's pooled vectors: hidden_weight and "
                             "attention_weight need its states on every batch (leave cache_teacher off)")


SCHEDULES = ("linear", "cosine")


@dataclass(kw_only=True)
class PretrainConfig:
    """How ``pretrain.pretrain`` trains: a step budget (``steps``, or ``tokens``), AdamW as RoBERTa set it,
    warmup then linear or cosine decay, clipping, mixed precision, evaluation, checkpoints, snapshots."""

    steps: int | None = setting(None, "optimiser steps", low=1)
    tokens: int | None = setting(None, "a budget of tokens instead of steps (steps = tokens / (batch size x "
                                 "accumulate x max length))", low=1)
    batch_size: int = setting(32, "examples a micro-batch (the whole job's, under torchrun)", low=1)
    accumulate: int = setting(1, "micro-batches a step", low=1)
    lr: float = setting(5e-4, "peak learning rate", **LR_BOUNDS)
    warmup: float = setting(0.06, "share of the steps spent warming up", low=0.0, below=1.0)
    schedule: str = setting("linear", "decay after warmup, to 0", choices=SCHEDULES)
    weight_decay: float = setting(0.01, "AdamW's weight decay, on weights only", low=0.0, cli=False)
    betas: tuple[float, float] = setting((0.9, 0.98), "AdamW's betas (RoBERTa's)", cli=False)
    eps: float = setting(1e-6, "AdamW's epsilon (RoBERTa's)", low=0.0, strict=True, cli=False)
    max_grad_norm: float | None = setting(1.0, "clip the gradient norm at this; None: off", low=0.0, strict=True,
                                          cli=False)
    bf16: bool = setting(False, "bf16 autocast (fp32 master weights)")
    fp16: bool = setting(False, "fp16 autocast with loss scaling (CUDA only)")
    eval_every: int | None = setting(None, "steps between evaluations (needs --eval-texts)", low=1)
    eval_examples: int = setting(256, "held-out examples an evaluation (always the same ones, the same masks)",
                                 low=1, cli=False)
    save_every: int | None = setting(None, "steps between checkpoints, the last step included (default: none -- "
                                     "the model is written at the end either way, but a run without checkpoints "
                                     "cannot be resumed)", low=1)
    keep: int = setting(3, "checkpoints kept", low=1)
    snapshots: int = setting(0, "also keep the model at step 0 and at this many log-spaced steps, in OUT/snapshots/ "
                             "(for minibert probe-over-time); 0: none", low=0)
    log_every: int = setting(10, "steps between log lines", low=1)
    grad_every: int | None = setting(None, "steps between per-block gradient norms and update/weight ratios in "
                                     "log.jsonl (the first step's too) and OUT/gradients.png; default: off", low=1)
    plateau_step: int = setting(300, "from this step on, a held-out masked accuracy still at the most frequent "
                                "token's rate is reported as the unigram plateau (a warning; needs --eval-texts)",
                                low=1)
    seed: int = setting(0, "random seed, an integer >= 0", low=0, high=SEED_LIMIT)
    progress: bool = setting(True, "no progress bar or log lines", flag="--quiet", negate=True)

    def check(self) -> None:
        check(self)
        if (self.steps is None) == (self.tokens is None):
            raise InputError("give either steps or tokens (a budget), not both and not neither: --steps N or "
                             "--tokens N (how long to train)")
        if self.bf16 and self.fp16:
            raise InputError("bf16 and fp16 exclude each other")

    def total_steps(self, max_length: int) -> int:
        if self.steps is not None:
            return self.steps
        return max(1, math.ceil(self.tokens / (self.batch_size * self.accumulate * max_length)))

    def recorded(self) -> dict:
        """What a resumed run must share with the run it continues."""
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(self).items() if k != "progress"}
