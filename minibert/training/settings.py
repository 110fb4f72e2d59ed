"""The training loop's settings, declared once (``minibert.settings``): what every run that trains with
``loop.fit`` shares. Standard library only, so that the command line builds its options from them without
importing torch; ``runs.settings`` extends them with each command's own."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..checks import SEED_LIMIT
from ..errors import InputError
from ..settings import check, setting

RESUME_HELP = ("continue the unfinished run in --out (same settings; it ends as the uninterrupted run would have); "
               "a finished run has nothing to resume")


@dataclass(kw_only=True)
class FitConfig:
    """How ``loop.fit`` trains: AdamW (weight decay on weights only), warmup then linear decay, clipping,
    gradient accumulation, mixed precision, seeding, resuming."""

    epochs: int = setting(3, "passes over the training data", low=1)
    lr: float = setting(5e-5, "peak learning rate (warmup, then linear decay to 0)", low=0.0, strict=True)
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

    def fit_config(self) -> FitConfig:
        """The loop's settings alone (a run's dataclass extends this one with its own)."""
        names = FitConfig.__dataclass_fields__
        return FitConfig(**{k: v for k, v in asdict(self).items() if k in names})
