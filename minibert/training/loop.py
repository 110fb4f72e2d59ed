"""The training loop every run goes through, as a reader can follow it: ``train``, and ``fit`` around it.

    train(state, steps, loss):                  (fine-tuning, pre-training, distillation, early exits)
        for each step's micro-batches:          (gradient accumulation: ``accumulate`` of them a step)
            for each micro-batch:
                value = loss(model, batch)      (under bf16/fp16 autocast when asked; stop if not finite)
                (value / accumulate).backward() (torchrun: DDP averages the gradients on the last one)
            clip the gradient norm, AdamW step, learning-rate step (warmup, then decay)
            state.step += 1; after_step(...)    (the run's own: a progress bar, a log line, a checkpoint)

    fit(model, batches):                        (the epoch driver of fine-tuning, distillation, exits)
        for each epoch:
            train(state, that epoch's batches in groups, model's own loss)
            evaluate; keep the best checkpoint; write metrics.json and the state to resume from

What differs between runs is only what they hand ``train``: a batch source and a ``loss(model, batch)``
(``model_loss``: the model's own ``.loss`` -- a head's, a distiller's, the exits'; pre-training's share
of the masked tokens, ``pretrain._share_loss``) and what they do after a step (``pretrain`` logs,
evaluates and saves every k steps).

* ``parameter_groups``: AdamW with weight decay on weights only -- biases and LayerNorm parameters are
  not decayed (as BERT was trained) -- and, optionally, layer-wise learning-rate decay (each block's rate
  times ``decay ** depth from the top``; embeddings deepest).
* ``warmup_then_linear_decay``: the learning-rate schedule of the BERT paper.
* ``TrainState``: the model, AdamW's moments, the schedule, the fp16 loss scaler, the steps taken and
  where the data stands -- one checkpoint dict, written atomically (a kill mid-write leaves the previous
  one), with every process's random generators. ``fit`` writes it after each epoch
  (``training_state.pt``), the pre-training loop into each checkpoint; a run started again with
  ``resume`` ends bit for bit where the uninterrupted run would have (CPU; tested with SIGKILL for
  fine-tuning, pre-training, distillation and early exits).
* Mixed precision: bf16 autocast (CPU or GPU), or fp16 autocast with loss scaling on CUDA; the weights
  (master copy) stay fp32 either way. Seeded: deterministic on CPU. A tqdm bar when tqdm is installed.
* Under torchrun (``ddp``) every process builds the same global batches and trains on its slice of each;
  process 0 alone evaluates, saves and reports.
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator

import torch
from torch import nn

from ..errors import InputError
from ..outputs import account_for
from . import ddp
from .diagnostics import BlockGradients, watched_step
from .settings import FitConfig  # noqa: F401  (the loop's settings; declared with the others, no torch there)

log = logging.getLogger(__name__)


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
def model_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    """The loss most runs train on: the model's own (``model(**batch).loss``: a head, a distiller, early exits)."""
    return model(**batch).loss


def train(state: TrainState, steps: Iterable[list[dict]], loss: Callable[[nn.Module, dict], torch.Tensor], config,
          *, half: torch.dtype | None = None, trained: nn.Module | None = None, kept="nothing is kept",
          after_step: Callable[[list[float], list[dict]], None] | None = None,
          probe: BlockGradients | None = None) -> None:
    """The one training loop every run goes through (fine-tuning, pre-training, distillation, early exits)::

        for each step's micro-batches (``steps``: lists of up to ``config.accumulate`` batches):
            for each micro-batch:
                loss(trained, batch) under autocast (``half``); stop if it is not finite; backward(loss / accumulate)
            clip the gradient norm (stop if it is not finite); AdamW step; learning-rate step
            state.step += 1; after_step(the micro-batches' losses, the micro-batches)

    ``probe`` (``diagnostics.BlockGradients``) measures each block's gradient norm and update-to-weight ratio
    around the optimiser step on the steps it wants.

    ``trained`` is the module the loss runs through: ``state.model`` itself, or, under torchrun, its
    ``ddp.wrap`` -- then the gradients are averaged over the processes once a step (``no_sync`` before the
    last micro-batch). ``kept`` says, in words or through a function, what a stopped run keeps."""
    model = state.model
    trained = model if trained is None else trained
    device = next(model.parameters()).device
    model.train()
    state.optimizer.zero_grad(set_to_none=True)
    for batches in steps:
        values = []
        for i, batch in enumerate(batches):
            batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
            synced = trained is model or i == len(batches) - 1  # DDP averages the gradients on the last one
            with nullcontext() if synced else trained.no_sync():
                with torch.autocast(device.type, dtype=half or torch.bfloat16, enabled=half is not None):
                    value = loss(trained, batch)
                values.append(float(value.detach()))
                check_finite(model, state.step + 1, values[-1], lr=config.lr, scaler=state.scaler, kept=kept)
                scaled = value.float() / config.accumulate
                (state.scaler.scale(scaled) if state.scaler else scaled).backward()
        watched_step(probe, state.step, model, state.scaler, lambda: optimizer_step(
            model, state.optimizer, state.scheduler, config, state.scaler,
            check=lambda norm: check_finite(model, state.step + 1, sum(values) / len(values), norm, lr=config.lr,
                                            scaler=state.scaler, kept=kept)))
        state.step += 1
        if after_step is not None:
            after_step(values, batches)


def groups(batches: Iterable[dict], size: int) -> Iterator[list[dict]]:
    """``batches`` in lists of ``size`` (one optimiser step each); the last list may be shorter."""
    group = []
    for batch in batches:
        group.append(batch)
        if len(group) == size:
            yield group
            group = []
    if group:
        yield group


@dataclass
class History:
    epochs: list[dict] = field(default_factory=list)  # per epoch: train_loss, metrics, seconds, examples/s
    best_epoch: int | None = None
    best_metric: float | None = None
    metric: str | None = None  # the name of the metric the best epoch is chosen by

    def to_json(self, path) -> None:
        from ..textfiles import write_text_atomic

        write_text_atomic(path, json.dumps(_finite(asdict(self)), indent=2, allow_nan=False) + "\n")


def _finite(value):
    """``value`` with every NaN or infinity as None (JSON's null): metrics.json stays valid JSON, which has no
    NaN (a correlation over constant predictions is undefined)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def fit(model: nn.Module, train_batches: Callable[[int], Iterable[dict]], *, config: FitConfig = FitConfig(),
        evaluate: Callable[[nn.Module], dict] | None = None, metric: str | None = None,
        out_dir=None, on_epoch_start: Callable[[nn.Module, int], None] | None = None,
        on_epoch_end: Callable[[dict], None] | None = None, save: Callable[[nn.Module, Path], None] | None = None,
        steps_per_epoch: int | None = None) -> History:
    """Fine-tune ``model`` (a module whose forward takes a batch dict and returns ``.loss``): ``train`` over
    each epoch's batches, then evaluate and keep the best.

    ``train_batches(epoch)`` yields the batches of one epoch (shuffled by the caller, e.g. seeded by the
    epoch). ``evaluate(model)`` returns metrics after each epoch; ``metric`` names the one to maximise for
    the best checkpoint, which is saved to ``out_dir`` (``model.save_pretrained``) with ``metrics.json``.
    ``on_epoch_start(model, epoch)`` lets a recipe change what is trainable (gradual unfreezing);
    ``on_epoch_end(record)`` sees each epoch's record (to print it); ``save(model, directory)`` replaces
    ``model.save_pretrained(directory)`` (LoRA saves a merged copy). Under torchrun (``ddp``) every process
    builds the same global batches and trains on its own slice of each; process 0 alone evaluates, saves
    and reports.
    """
    save = save or (lambda m, directory: m.save_pretrained(directory))
    config.check()
    if config.resume and out_dir is None:
        raise InputError("resume=True needs out_dir: the training state is kept there")
    seed_everything(config.seed)
    rank, world = ddp.init() if ddp.is_distributed() else (0, 1)
    device = next(model.parameters()).device
    half, scaler = mixed_precision(config, device)
    if steps_per_epoch is None:
        steps_per_epoch = math.ceil(sum(1 for _ in train_batches(0)) / config.accumulate)
    total_steps = steps_per_epoch * config.epochs
    out_dir = Path(out_dir) if out_dir is not None else None
    state = TrainState(model, None, None, scaler)
    history, trainable_before = History(), None
    saved = _resumable(out_dir, config, device, world) if config.resume else None
    if saved is not None:  # rebuild what the last finished epoch left, exactly
        restore_model(model, saved)
        trainable_before = tuple(p.requires_grad for p in model.parameters())
        state.optimizer, state.scheduler = _optimiser(model, config, total_steps)
        state.restore(saved, rank)
        history = History(**saved["history"])
    trained = ddp.wrap(model, find_unused_parameters=True) if world > 1 else model  # LayerDrop skips blocks
    loss = ddp.sliced(model_loss, rank, world) if world > 1 else model_loss

    def kept() -> str:
        return (f"the best epoch so far, {history.best_epoch}, is in {out_dir}" if history.best_epoch and out_dir
                else "no epoch had finished: nothing was saved")

    for epoch in range(state.position, config.epochs):
        if on_epoch_start is not None:
            on_epoch_start(model, epoch)
        trainable = tuple(p.requires_grad for p in model.parameters())
        if trainable != trainable_before:  # the first epoch, or a recipe unfroze something: new groups
            _regroup(state, config, total_steps)
            trainable_before = trainable
        epoch_record = _EpochRecord(_bar(steps_per_epoch, f"epoch {epoch + 1}/{config.epochs}",
                                         config.progress and rank == 0))
        train(state, groups(train_batches(epoch), config.accumulate), loss, config, half=half, trained=trained,
              kept=kept, after_step=epoch_record.add)
        record = {"epoch": epoch + 1, **epoch_record.close()}
        if rank == 0:
            _evaluate_and_keep(model, record, history, evaluate, metric, out_dir, save)
        else:
            history.epochs.append(record)
        if on_epoch_end is not None and rank == 0:
            on_epoch_end(record)
        if out_dir is not None and epoch + 1 < config.epochs:  # what a resumed run needs to continue from here
            state.position = epoch + 1
            rng = rng_states(world)  # every process's, gathered
            if rank == 0:
                state.save(out_dir / STATE_FILE, config.recorded(), rng, history=asdict(history))
                account_for(out_dir / STATE_FILE)  # the run's record lists what it wrote (outputs.RunFolder)
    if out_dir is not None and rank == 0:
        (out_dir / STATE_FILE).unlink(missing_ok=True)  # finished: nothing to resume
    model.eval()
    return history


def _evaluate_and_keep(model, record: dict, history: History, evaluate, metric, out_dir: Path | None, save) -> None:
    """After an epoch: its evaluation into ``record``; the model saved when the epoch is the best so far
    (or, with no metric to choose by, always: the last is kept); the record added to ``history``, and
    metrics.json written."""
    if evaluate is not None:
        model.eval()
        with torch.no_grad():
            record["eval"] = evaluate(model)
        if metric is not None:
            history.metric = metric
            value = record["eval"][metric]
            if history.best_metric is None or value > history.best_metric:
                history.best_metric, history.best_epoch = value, record["epoch"]
                if out_dir is not None:
                    save(model, out_dir)
    history.epochs.append(record)
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        if evaluate is None or metric is None:
            save(model, out_dir)
        history.to_json(out_dir / "metrics.json")


class _EpochRecord:
    """An epoch's training loss and throughput, step by step (``train``'s ``after_step``), on its bar."""

    def __init__(self, bar):
        self.bar, self.started, self.seen, self.total, self.count = bar, time.perf_counter(), 0, 0.0, 0

    def add(self, losses: list[float], batches: list[dict]) -> None:
        self.total, self.count = self.total + sum(losses), self.count + len(losses)
        self.seen += sum(len(b["input_ids"]) for b in batches)
        self.bar.update(1)
        if hasattr(self.bar, "set_postfix"):
            self.bar.set_postfix(loss=f"{self.total / self.count:.4f}",
                                 ex_s=f"{self.seen / (time.perf_counter() - self.started):.1f}")

    def close(self) -> dict:
        self.bar.close()
        seconds = time.perf_counter() - self.started
        return {"train_loss": self.total / max(1, self.count), "seconds": seconds,
                "examples_per_second": self.seen / seconds if seconds else 0.0}


def _resumable(out_dir: Path, config: FitConfig, device, world: int = 1) -> dict | None:
    """The state the last finished epoch left in ``out_dir`` (None, with a warning, when there is none)."""
    import warnings

    path = out_dir / STATE_FILE
    if not path.exists():
        warnings.warn(f"resume: no {path.name} in {path.parent} (no unfinished run there): starting from the "
                      "first epoch", stacklevel=3)
        return None
    return read_state(path, config.recorded(), device, world=world)


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
            first = non_finite_gradient(model)
            what = f"the gradient norm is {float(grad_norm)}" + (f" (first non-finite gradient: {first})" if first else
                                                                  " (every gradient finite: their norm overflowed)")
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


def rng_states(world: int = 1) -> list[dict]:
    """``rng_state()`` of every process of the run (gathered under torchrun: every process must call it),
    as a checkpoint keeps them."""
    if world == 1:
        return [rng_state()]
    states = [None] * world
    torch.distributed.all_gather_object(states, rng_state())
    return states


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


def read_state(path: Path, settings: dict, device, *, changeable: tuple[str, ...] = (), world: int = 1) -> dict:
    """The state a run left in ``path``, checked against this run's ``settings`` (those in ``changeable``
    may differ: how often it logs, say) and its number of processes (``world``: the random generators it
    keeps are one a process); a file that is not one, other settings or another job size is an InputError
    that names them."""
    try:
        saved = torch.load(path, map_location=device, weights_only=True)  # tensors and plain data only
    except Exception as e:  # truncated or not ours: say which file
        raise InputError(f"{path} cannot be read as a training state ({type(e).__name__}: {e}); delete it to "
                         "start again") from None
    differs = [f"{k}={saved['config'].get(k)!r} then, {v!r} now" for k, v in settings.items()
               if k not in changeable and saved["config"].get(k) != v]
    where = path.parent if path.parent.name.startswith("step-") else path
    if differs:
        raise InputError(f"resume: {where} was written by a run with other settings ({'; '.join(differs)}); give "
                         "the same settings, or another --out")
    if len(saved["rng"]) != world:
        raise InputError(f"resume: {where} was written by {len(saved['rng'])} process(es), this job has {world}")
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
        bar.unit = "step"
    return bar


def epoch_reporter(epochs: int, loss_digits: int = 4,
                   describe: Callable[[dict], str] | None = None) -> Callable[[dict], None]:
    """``on_epoch_end`` for ``fit``: one line per epoch to the log (``minibert.logs``) -- the train loss, the
    evaluation (``describe(eval)``, default every number with 4 decimals) and the seconds."""
    def report(record):
        scores = record.get("eval") or {}
        shown = describe(scores) if describe is not None else ", ".join(f"{k} {v:.4f}" for k, v in scores.items())
        log.info(f"epoch {record['epoch']}/{epochs}: train loss {record['train_loss']:.{loss_digits}f}"
                 + (f", {shown}" if shown else "") + f", {record['seconds']:.1f} s")
    return report
