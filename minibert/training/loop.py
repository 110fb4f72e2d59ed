"""Fine-tuning, as a reader can follow it: one function, ``fit``, and the three pieces it is made of.

    for each epoch:
        for each batch:                         (gradient accumulation: every ``accumulate`` batches)
            loss = model(**batch).loss / accumulate
            loss.backward()
            clip the gradient norm, optimizer step (AdamW), learning-rate step (warmup, then linear decay)
        evaluate; keep the best checkpoint; write metrics.json

* ``parameter_groups``: AdamW with weight decay on weights only -- biases and LayerNorm parameters are
  not decayed (as BERT was trained) -- and, optionally, layer-wise learning-rate decay (each block's rate
  times ``decay ** depth from the top``; embeddings deepest).
* ``warmup_then_linear_decay``: the learning-rate schedule of the BERT paper.
* ``fit``: the loop above, seeded (deterministic on CPU), with a tqdm bar showing loss and throughput
  when tqdm is installed, and mixed precision as an option: bf16 autocast (CPU or GPU), or fp16 autocast
  with loss scaling on CUDA; the weights (master copy) stay fp32 either way.
* **Resuming** (``FitConfig(resume=True)``, ``--resume``): after each epoch ``fit`` writes
  ``training_state.pt`` into ``out_dir`` -- a ``TrainState``: the model's weights, AdamW's moments, the
  schedule, which parameters train, every random generator's state, the step, the epoch and the history --
  atomically (a kill mid-write leaves the previous epoch's state); the pre-training loop writes the same
  state into its checkpoints. A run started again with ``resume`` continues after the
  last finished epoch and ends bit for bit where the uninterrupted run would have (CPU; tested with a
  run killed by SIGKILL). The file is removed when the run finishes.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterable

import torch
from torch import nn

from ..errors import InputError
from .settings import FitConfig  # noqa: F401  (the loop's settings; declared with the others, no torch there)


# -------------------------------------------------------------------------------- optimiser pieces
def _no_decay(name: str, param: nn.Parameter) -> bool:
    """Biases and LayerNorm weights are not decayed: 1-D parameters are exactly those in BERT."""
    return param.dim() == 1


def _depth_from_top(name: str, num_blocks: int) -> int:
    """0 for the head and the pooler, 1 for the top block, ..., num_blocks for block 0, num_blocks + 1
    for the embeddings."""
    parts = name.split(".")
    if "embeddings" in parts:
        return num_blocks + 1
    if "blocks" in parts:
        return num_blocks - int(parts[parts.index("blocks") + 1])
    return 0


def parameter_groups(model: nn.Module, *, lr: float, weight_decay: float = 0.01,
                     layer_decay: float | None = None) -> list[dict]:
    """AdamW parameter groups over the trainable parameters: ``weight_decay`` for weights, none for
    biases and LayerNorms; with ``layer_decay``, learning rate ``lr * layer_decay ** depth`` (depth from the
    top, see ``_depth_from_top``)."""
    num_blocks = _num_blocks(model)
    groups: dict[tuple, dict] = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        decay = 0.0 if _no_decay(name, param) else weight_decay
        scale = 1.0 if layer_decay is None else layer_decay ** _depth_from_top(name, num_blocks)
        group = groups.setdefault((decay, scale), {"params": [], "weight_decay": decay, "lr": lr * scale,
                                                   "names": []})
        group["params"].append(param)
        group["names"].append(name)
    if not groups:
        raise InputError("the model has no trainable parameter (everything is frozen)")
    return list(groups.values())


def _num_blocks(model: nn.Module) -> int:
    config = getattr(model, "config", None)
    return getattr(config, "num_hidden_layers", 0)


def warmup_then_linear_decay(optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int,
                             done_steps: int = 0):
    """Learning rate from 0 up to its value over ``warmup_steps``, then linearly down to 0 at
    ``total_steps`` (transformers' ``get_linear_schedule_with_warmup``); ``done_steps`` continues a
    schedule (the optimizer's groups need ``initial_lr``)."""
    def factor(step: int) -> float:
        if step < warmup_steps:
            return step / max(1, warmup_steps)
        return max(0.0, (total_steps - step) / max(1, total_steps - warmup_steps))

    if done_steps:
        for group in optimizer.param_groups:
            group.setdefault("initial_lr", group["lr"])
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor, last_epoch=done_steps - 1)


# ------------------------------------------------------------------------------------------- the loop
@dataclass
class History:
    epochs: list[dict] = field(default_factory=list)  # per epoch: train_loss, metrics, seconds, examples/s
    best_epoch: int | None = None
    best_metric: float | None = None
    metric: str | None = None  # the name of the metric the best epoch is chosen by

    def to_json(self, path) -> None:
        from ..textfiles import write_text_atomic

        write_text_atomic(path, json.dumps(asdict(self), indent=2) + "\n")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def fit(model: nn.Module, train_batches: Callable[[int], Iterable[dict]], *, config: FitConfig = FitConfig(),
        evaluate: Callable[[nn.Module], dict] | None = None, metric: str | None = None,
        out_dir=None, on_epoch_start: Callable[[nn.Module, int], None] | None = None,
        on_epoch_end: Callable[[dict], None] | None = None, save: Callable[[nn.Module, Path], None] | None = None,
        steps_per_epoch: int | None = None) -> History:
    """Fine-tune ``model`` (a module whose forward takes a batch dict and returns ``.loss``).

    ``train_batches(epoch)`` yields the batches of one epoch (shuffled by the caller, e.g. seeded by the
    epoch). ``evaluate(model)`` returns metrics after each epoch; ``metric`` names the one to maximise for
    the best checkpoint, which is saved to ``out_dir`` (``model.save_pretrained``) with ``metrics.json``.
    ``on_epoch_start(model, epoch)`` lets a recipe change what is trainable (gradual unfreezing);
    ``on_epoch_end(record)`` sees each epoch's record (to print it); ``save(model, directory)`` replaces
    ``model.save_pretrained(directory)`` (LoRA saves a merged copy).
    """
    save = save or (lambda m, directory: m.save_pretrained(directory))
    config.check()
    if config.resume and out_dir is None:
        raise InputError("resume=True needs out_dir: the training state is kept there")
    seed_everything(config.seed)
    device = next(model.parameters()).device
    half, scaler = mixed_precision(config, device)
    if steps_per_epoch is None:
        steps_per_epoch = math.ceil(sum(1 for _ in train_batches(0)) / config.accumulate)
    total_steps = steps_per_epoch * config.epochs
    out_dir = Path(out_dir) if out_dir is not None else None
    state = TrainState(model, None, None, scaler)
    history, trainable_before = History(), None
    saved = _resumable(out_dir, config, device) if config.resume else None
    if saved is not None:  # rebuild what the last finished epoch left, exactly
        restore_model(model, saved)
        trainable_before = tuple(p.requires_grad for p in model.parameters())
        state.optimizer, state.scheduler = _optimiser(model, config, total_steps)
        state.restore(saved)
        history = History(**saved["history"])

    def finite(loss_value, norm=None):  # stop before a non-finite step is taken (or saved)
        check_finite(model, state.step + 1, loss_value, norm, lr=config.lr, scaler=scaler,
                     kept=lambda: (f"the best epoch so far, {history.best_epoch}, is in {out_dir}"
                                   if history.best_epoch and out_dir else "no epoch had finished: nothing was saved"))

    for epoch in range(state.position, config.epochs):
        if on_epoch_start is not None:
            on_epoch_start(model, epoch)
        trainable = tuple(p.requires_grad for p in model.parameters())
        if trainable != trainable_before:  # the first epoch, or a recipe unfroze something: new groups
            _regroup(state, config, total_steps)
            trainable_before = trainable
        bar = _bar(steps_per_epoch * config.accumulate, f"epoch {epoch + 1}/{config.epochs}", config.progress)
        record = {"epoch": epoch + 1, **_epoch(state, train_batches(epoch), config, half, finite, bar)}
        if evaluate is not None:
            model.eval()
            with torch.no_grad():
                record["eval"] = evaluate(model)
            if metric is not None:
                history.metric = metric
                value = record["eval"][metric]
                if history.best_metric is None or value > history.best_metric:
                    history.best_metric, history.best_epoch = value, epoch + 1
                    if out_dir is not None:
                        save(model, out_dir)
        history.epochs.append(record)
        if on_epoch_end is not None:
            on_epoch_end(record)
        if out_dir is not None:
            out_dir.mkdir(parents=True, exist_ok=True)
            if evaluate is None or metric is None:  # no metric to choose by: keep the last
                save(model, out_dir)
            history.to_json(out_dir / "metrics.json")
            if epoch + 1 < config.epochs:  # what a resumed run needs to continue from here
                state.position = epoch + 1
                state.save(out_dir / STATE_FILE, config.recorded(), [rng_state()], history=asdict(history))
    if out_dir is not None:
        (out_dir / STATE_FILE).unlink(missing_ok=True)  # finished: nothing to resume
    model.eval()
    return history


def _resumable(out_dir: Path, config: FitConfig, device) -> dict | None:
    """The state the last finished epoch left in ``out_dir`` (None, with a warning, when there is none)."""
    import warnings

    path = out_dir / STATE_FILE
    if not path.exists():
        warnings.warn(f"resume: no {path.name} in {path.parent} (no unfinished run there): starting from the "
                      "first epoch", stacklevel=3)
        return None
    return read_state(path, config.recorded(), device)


def _optimiser(model: nn.Module, config: FitConfig, total_steps: int, done_steps: int = 0):
    """AdamW over what trains now (``parameter_groups``) and the warmup-then-linear schedule, continued
    after ``done_steps``."""
    optimizer = torch.optim.AdamW(parameter_groups(model, lr=config.lr, weight_decay=config.weight_decay,
                                                   layer_decay=config.layer_decay), lr=config.lr)
    return optimizer, warmup_then_linear_decay(optimizer, int(config.warmup_ratio * total_steps), total_steps,
                                               done_steps=done_steps)


def _regroup(state: TrainState, config: FitConfig, total_steps: int) -> None:
    """New AdamW groups for what trains now; parameters trained before keep their moments, and the
    schedule goes on where it was."""
    previous = state.optimizer.state if state.optimizer is not None else {}
    state.optimizer, state.scheduler = _optimiser(state.model, config, total_steps, done_steps=state.step)
    for group in state.optimizer.param_groups:
        for p in group["params"]:
            if p in previous:
                state.optimizer.state[p] = previous[p]


def _epoch(state: TrainState, batches: Iterable[dict], config: FitConfig, half, finite, bar) -> dict:
    """One pass over ``batches``: forward (autocast to ``half`` when set), backward (scaled by the fp16
    scaler), an optimiser step every ``config.accumulate`` batches and after a last, partial group;
    ``finite`` checks each loss and each step's gradient norm. Returns the epoch's record."""
    model, device = state.model, next(state.model.parameters()).device
    model.train()
    started, seen, total_loss, count, value = time.perf_counter(), 0, 0.0, 0, 0.0
    state.optimizer.zero_grad(set_to_none=True)

    def step():
        optimizer_step(model, state.optimizer, state.scheduler, config, state.scaler,
                       check=lambda norm: finite(value, norm))
        state.step += 1

    for i, batch in enumerate(batches):
        batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        with torch.autocast(device.type, dtype=half or torch.bfloat16, enabled=half is not None):
            loss = model(**batch).loss
        value = float(loss.detach())
        finite(value)
        scaled = loss.float() / config.accumulate
        (state.scaler.scale(scaled) if state.scaler else scaled).backward()
        total_loss, count, seen = total_loss + value, count + 1, seen + len(batch["input_ids"])
        if (i + 1) % config.accumulate == 0:
            step()
        bar.update(1)
        if hasattr(bar, "set_postfix"):
            bar.set_postfix(loss=f"{total_loss / count:.4f}", ex_s=f"{seen / (time.perf_counter() - started):.1f}")
    if count % config.accumulate:  # a last, partial accumulation
        step()
    bar.close()
    seconds = time.perf_counter() - started
    return {"train_loss": total_loss / max(1, count), "seconds": seconds,
            "examples_per_second": seen / seconds if seconds else 0.0}


STATE_FILE = "training_state.pt"


def non_finite_gradient(model: nn.Module) -> str | None:
    """The name of the first parameter whose gradient holds a NaN or an infinity (None: all finite)."""
    for name, p in model.named_parameters():
        if p.grad is not None and not bool(torch.isfinite(p.grad).all()):
            return name
    return None


def check_finite(model: nn.Module, step: int, loss: float, grad_norm=None, *, lr: float, kept, scaler=None) -> None:
    """Stop a run whose loss or gradients stopped being numbers: a ``TrainingStopped`` naming the step,
    what was not finite, the likely causes and what is kept (``kept``: the last good checkpoint in words,
    or a function that says it, called only when the run stops). Called before the optimiser step, so the
    weights are still the last finite ones. Under fp16 loss scaling a non-finite gradient is a step the
    scaler skips on purpose; only a non-finite loss, or gradients that overflow even at a scale below 1,
    stop the run."""
    from ..errors import TrainingStopped

    what = None
    if not math.isfinite(loss):
        what = f"the training loss is {loss}"
    elif grad_norm is not None and not math.isfinite(float(grad_norm)):
        if scaler is None:
            what = f"the gradient norm is {float(grad_norm)} (first non-finite gradient: {non_finite_gradient(model)})"
        elif scaler.get_scale() < 1.0:
            what = f"the gradients overflow fp16 even at loss scale {scaler.get_scale():g}"
    if what is None:
        return
    kept = kept() if callable(kept) else kept
    raise TrainingStopped(f"step {step}: {what}. The run is stopped before this step is taken, so nothing non-finite "
                          f"is saved; {kept}. "
                          f"Usual causes: a learning rate too high for this model (now {lr:g}), too short a warmup, "
                          "fp16 overflow (bf16 keeps fp32's range), or inputs the model cannot take")


def rng_state() -> dict:
    """Every random generator's state (python, torch, numpy, CUDA), as plain data torch.save keeps."""
    import numpy as np

    name, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {"python": random.getstate(), "torch": torch.get_rng_state(),
             "numpy": [name, torch.from_numpy(keys.astype("int64")), pos, has_gauss, gauss]}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    """Put back what ``rng_state`` recorded."""
    import numpy as np

    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch"])
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype("uint32"), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ------------------------------------------------------------------------------------ a run's state
@dataclass
class TrainState:
    """Everything a run needs to go on exactly where it stopped, for ``fit`` and the pre-training loop alike:
    the model, AdamW (with its moments), the schedule, the fp16 loss scaler, the optimiser steps taken and
    where the data stands (``position``: fit's finished epochs, the pre-training loop's examples consumed).
    ``save`` writes it as one dict, atomically (a kill mid-write leaves the previous state whole);
    ``read_state`` reads one back, checked against the run's settings; ``restore_model`` (before the
    optimiser is built: its groups follow what trains) and ``restore`` put it back."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler | None = None
    step: int = 0
    position: int = 0

    def save(self, path: Path, settings: dict, rng: list, **extra) -> None:
        """The state into ``path`` with the run's ``settings`` (what a resumed run must share), every
        process's random generators (``rng``: one ``rng_state()`` a process) and what the caller keeps
        beside (``extra``: fit's history)."""
        from ..textfiles import atomic_file

        state = {"model": self.model.state_dict(), "trainable": [p.requires_grad for p in self.model.parameters()],
                 "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                 "scaler": self.scaler.state_dict() if self.scaler is not None else None, "config": settings,
                 "rng": rng, "step": self.step, "position": self.position, **extra}
        with atomic_file(path) as tmp:
            torch.save(state, tmp)

    def restore(self, saved: dict, rank: int = 0) -> None:
        """AdamW, the schedule, the scaler, the step, the position and this process's random generators from
        a saved state (the model first: ``restore_model``)."""
        self.optimizer.load_state_dict(saved["optimizer"])
        self.scheduler.load_state_dict(saved["scheduler"])
        if self.scaler is not None and saved.get("scaler"):
            self.scaler.load_state_dict(saved["scaler"])
        self.step, self.position = saved["step"], saved["position"]
        set_rng_state(saved["rng"][rank])


def restore_model(model: nn.Module, saved: dict) -> None:
    """A saved state's weights and which of them train (before an optimiser is built on them)."""
    model.load_state_dict(saved["model"])
    for p, flag in zip(model.parameters(), saved["trainable"]):
        p.requires_grad_(bool(flag))


def read_state(path: Path, settings: dict, device, *, changeable: tuple[str, ...] = ()) -> dict:
    """The state a run left in ``path``, checked against this run's ``settings`` (those in ``changeable``
    may differ: how often it logs, say); a file that is not one, or other settings, is an InputError that
    names them."""
    try:
        saved = torch.load(path, map_location=device, weights_only=True)  # tensors and plain data only
    except Exception as e:  # truncated or not ours: say which file
        raise InputError(f"{path} cannot be read as a training state ({type(e).__name__}: {e}); delete it to "
                         "start again") from None
    differs = [f"{k}={saved['config'].get(k)!r} then, {v!r} now" for k, v in settings.items()
               if k not in changeable and saved["config"].get(k) != v]
    if differs:
        where = path.parent if path.parent.name.startswith("step-") else path
        raise InputError(f"resume: {where} was written by a run with other settings ({'; '.join(differs)}); give "
                         "the same settings, or another --out")
    return saved


def mixed_precision(config, device: torch.device):
    """(the autocast dtype or None, the fp16 loss scaler or None) for ``config.bf16`` / ``config.fp16`` on
    ``device``: fp16 needs CUDA; bf16 on a CPU without bf16 units is warned about (``hardware``)."""
    if config.fp16 and device.type != "cuda":
        raise InputError("fp16 training needs a CUDA device (on a CPU use bf16)")
    if config.bf16 and device.type == "cpu":
        from ..hardware import warn_if_slow

        warn_if_slow(torch.bfloat16, device, stacklevel=4)
    half = torch.bfloat16 if config.bf16 else torch.float16 if config.fp16 else None
    return half, torch.amp.GradScaler("cuda") if config.fp16 else None


def optimizer_step(model, optimizer, scheduler, config, scaler=None, check=None) -> None:
    """One optimiser step, as ``fit`` and the pre-training loop take it: unscale (fp16), clip at
    ``config.max_grad_norm``, ``check(gradient norm)`` (which may stop the run), step, schedule, zero."""
    if scaler is not None:
        scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
    trainable = [p for p in model.parameters() if p.requires_grad]
    norm = torch.nn.utils.clip_grad_norm_(trainable, config.max_grad_norm if config.max_grad_norm is not None
                                          else math.inf)  # with no limit: the norm alone, nothing clipped
    if check is not None:
        check(norm)
    if scaler is not None:
        scaler.step(optimizer)  # skipped when the gradients overflowed
        scaler.update()
    else:
        optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)


def _bar(total: int, desc: str, enabled: bool):
    from ..tools.progress import progress_bar

    bar = progress_bar(total, desc, enabled)
    if hasattr(bar, "unit"):
        bar.unit = "batch"
    return bar


def epoch_reporter(log: Callable[[str], None] | None, epochs: int, loss_digits: int = 4,
                   describe: Callable[[dict], str] | None = None) -> Callable[[dict], None]:
    """``on_epoch_end`` for ``fit``: one line per epoch to ``log`` (nothing when it is None) -- the train loss,
    the evaluation (``describe(eval)``, default every number with 4 decimals) and the seconds."""
    def report(record):
        if log is None:
            return
        scores = record.get("eval") or {}
        shown = describe(scores) if describe is not None else ", ".join(f"{k} {v:.4f}" for k, v in scores.items())
        log(f"epoch {record['epoch']}/{epochs}: train loss {record['train_loss']:.{loss_digits}f}"
            + (f", {shown}" if shown else "") + f", {record['seconds']:.1f} s")
    return report
