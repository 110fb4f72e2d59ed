"""Pre-training with BERT's own objective, as a reader can follow it: one function, ``pretrain``.

    for each step (until --steps, or the --tokens budget):
        for each of ``accumulate`` micro-batches:
            the next examples of the run, masked (pretrain_data.Examples.batch)
            loss = MLM (+ NSP) on them, scaled to its share of the step's masked tokens; backward
        clip the gradient norm; AdamW step; learning-rate step (warmup, then linear or cosine decay)
        every log_every steps: a line of log.jsonl (loss, learning rate, tokens/s)
        every eval_every steps: held-out masked-LM loss, perplexity, masked-token accuracy (a fixed mask)
        every save_every steps: a checkpoint folder, written atomically; the last ``keep`` kept
        at the snapshot steps (step 0 and ``snapshots`` log-spaced ones): the model alone, kept for good

**AdamW as RoBERTa set it**: betas (0.9, 0.98), eps 1e-6, weight decay 0.01 on weights only, warmup over
the first 6 % of the steps. **Mixed precision**: bf16 autocast on a CPU with bf16 units (a warning where
there are none), fp16 with loss scaling on CUDA; the weights stay fp32.

**Checkpoints lose nothing**: ``checkpoints/step-000100/`` holds the model (config.json and
model.safetensors: ``minibert fill`` and transformers load it) and ``training_state.pt`` -- AdamW's
moments, the schedule, every process's random generators, the step and how many examples were consumed.
``resume=True`` continues from the newest one and ends bit for bit where the uninterrupted run would have
(CPU; tested by killing a run with SIGKILL). Example n of the run is always the same example with the
same mask, so nothing else needs saving.

**Under torchrun** every process builds the same global batch numbers, reads and masks only its own slice
of them, and DistributedDataParallel averages the gradients; each process's loss is scaled by its share
of the step's masked tokens (and examples, for NSP), so N processes take the step one process takes on
the whole batch. Process 0 alone evaluates, logs and writes checkpoints.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import time
import warnings
from pathlib import Path

import torch
from torch import nn

from ..analysis.timeline import snapshot_folder
from ..errors import InputError
from ..loading import copy_tokenizer
from ..outputs import account_for
from ..textfiles import atomic_dir, write_text_atomic
from . import ddp
from .diagnostics import BlockGradients, PlateauWatch, unigram_rate
from .loop import (STATE_FILE, TrainState, mixed_precision, parameter_groups, read_state, restore_model, rng_states,
                   train)
from .pretrain_data import Examples
from .settings import PretrainConfig  # the loop's settings, declared with the others (no torch there)

log = logging.getLogger(__name__)



def snapshot_steps(steps: int, count: int) -> list[int]:
    """Step 0 (the initialisation) and ``count`` steps spaced evenly in log(step) from 1 to ``steps``
    (rounded; a step named twice is kept once, so short runs get fewer). Early steps are dense because
    that is where a model changes fastest (Liu et al. 2021 and Chiang et al. 2020 probe along such a grid)."""
    if count <= 0:
        return []
    if count == 1:
        return [0, steps]
    return sorted({0, *(round(steps ** (i / (count - 1))) for i in range(count))})


def schedule(optimizer, warmup_steps: int, total_steps: int, kind: str = "linear"):
    """Learning rate from 0 up to its value over ``warmup_steps``, then down to 0 at ``total_steps``,
    linearly or along a half cosine."""
    def factor(step: int) -> float:
        if step < warmup_steps:
            return step / max(1, warmup_steps)
        done = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return 1.0 - done if kind == "linear" else 0.5 * (1.0 + math.cos(math.pi * done))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def evaluate(model: nn.Module, examples: Examples, count: int, batch_size: int = 32, mask_seed: int = 1234) -> dict:
    """Held-out masked-LM loss (mean over masked tokens), perplexity and masked-token accuracy on examples
    0..count-1 of ``examples``, always masked the same way (``mask_seed``); NSP accuracy with NSP."""
    was_training = model.training
    model.eval()
    total_loss = correct = masked = nsp_right = seen = 0.0
    with torch.no_grad():
        for start in range(0, count, batch_size):
            numbers = range(start, min(count, start + batch_size))
            batch = {k: v.to(_device(model)) for k, v in examples.batch(numbers, mask_seed=mask_seed).items()}
            nsl = batch.pop("next_sentence_label", None)
            out = model(**batch)
            labels = batch["labels"]
            n = int((labels != -100).sum())
            total_loss += float(out.mlm_loss) * n
            correct += int((out.masked_logits.argmax(-1) == labels[labels != -100]).sum())
            masked += n
            if nsl is not None and getattr(out, "seq_relationship_logits", None) is not None:
                nsp_right += int((out.seq_relationship_logits.argmax(-1) == nsl).sum())
                seen += len(nsl)
    model.train(was_training)
    loss = total_loss / max(1, masked)
    result = {"eval_loss": loss, "perplexity": math.exp(min(loss, 50.0)), "masked_accuracy": correct / max(1, masked),
              "masked_tokens": int(masked)}
    if seen:
        result["nsp_accuracy"] = nsp_right / seen
    return result


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


# ------------------------------------------------------------------------------------- checkpoints
def _save_snapshot(out_dir: Path, model, step: int, tokenizer_source) -> None:
    with atomic_dir(snapshot_folder(out_dir, step)) as tmp:
        model.save_pretrained(tmp)
        if tokenizer_source is not None:
            copy_tokenizer(tokenizer_source, tmp)


def checkpoints(out_dir: Path) -> list[Path]:
    """The complete checkpoint folders of a run, oldest first."""
    folder = out_dir / "checkpoints"
    found = [p for p in folder.glob("step-*") if (p / STATE_FILE).exists()] if folder.is_dir() else []
    return sorted(found, key=lambda p: int(p.name.split("-")[1]))


def _save_checkpoint(out_dir: Path, state: TrainState, config: PretrainConfig, rng_states: list,
                     tokenizer_source=None) -> Path:
    """``checkpoints/step-N/``: the model (loadable on its own, with the tokenizer) and the run's
    ``TrainState`` (position: the examples consumed), written together; the oldest beyond ``config.keep``
    are removed."""
    folder = out_dir / "checkpoints" / f"step-{state.step:06d}"
    with atomic_dir(folder) as tmp:
        state.model.save_pretrained(tmp)
        if tokenizer_source is not None:
            copy_tokenizer(tokenizer_source, tmp)
        state.save(tmp / STATE_FILE, config.recorded(), rng_states)
    for old in checkpoints(out_dir)[:-config.keep]:
        shutil.rmtree(old, ignore_errors=True)
    account_for(folder)  # the run's record lists what it wrote: a kill from here on leaves it replaceable
    return folder


def _resume(state: TrainState, out_dir: Path, config: PretrainConfig, rank: int, world: int, steps: int) -> None:
    """``state`` as the newest checkpoint in ``out_dir`` left it (a warning when there is none): the same
    settings (but how often it logs, evaluates and saves), the same model, the same number of processes."""
    found = checkpoints(out_dir)
    if not found:
        if rank == 0:
            import warnings

            warnings.warn(f"resume: no checkpoint in {out_dir / 'checkpoints'} (nothing to resume): starting from "
                          "step 0", stacklevel=3)
        return
    saved = read_state(found[-1] / STATE_FILE, config.recorded(), _device(state.model), changeable=CHANGEABLE, world=world)
    mine = {k: tuple(v.shape) for k, v in state.model.state_dict().items()}
    theirs = {k: tuple(v.shape) for k, v in saved["model"].items()}
    if mine != theirs:
        differ = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
        raise InputError(f"resume: {found[-1]} holds another model (differs at {', '.join(differ[:4])}"
                         f"{' ...' if len(differ) > 4 else ''}); give the same geometry, or another --out")
    restore_model(state.model, saved)
    state.restore(saved, rank)
    if rank == 0:
        log.info(f"resuming from {found[-1]} (step {state.step} of {steps})")


#: settings a resumed run may change (how often it logs, evaluates, saves; what it keeps)
CHANGEABLE = ("eval_every", "eval_examples", "save_every", "keep", "log_every", "snapshots", "grad_every",
              "plateau_step")


# --------------------------------------------------------------------------------------------- the loop
def pretrain(model: nn.Module, examples: Examples, config: PretrainConfig, out_dir, *,
             eval_examples: Examples | None = None, resume: bool = False, tokenizer_source=None) -> dict:
    """Train ``model`` (a ``BertForMaskedLM`` or ``BertForPreTraining``) on ``examples``; write checkpoints,
    ``log.jsonl`` and, at the end, the model itself into ``out_dir``. Returns the last evaluation (or the
    last training loss) with the steps, tokens and seconds. ``tokenizer_source``: a folder whose tokenizer
    files every checkpoint and snapshot gets a copy of, so each one loads on its own."""
    config.check()
    if config.eval_every is not None and eval_examples is None:
        raise InputError("eval_every needs held-out examples (eval texts)")
    if examples.nsp and not hasattr(model, "nsp"):
        raise InputError("NSP examples need a BertForPreTraining (masked LM + next sentence)")
    out_dir = Path(out_dir)
    rank, world = ddp.init() if ddp.is_distributed() else (0, 1)
    half, scaler = mixed_precision(config, _device(model))
    steps = config.total_steps(examples.max_length)
    torch.manual_seed(config.seed + rank)
    optimizer = torch.optim.AdamW(parameter_groups(model, lr=config.lr, weight_decay=config.weight_decay),
                                  lr=config.lr, betas=config.betas, eps=config.eps)
    state = TrainState(model, optimizer, schedule(optimizer, int(config.warmup * steps), steps, config.schedule),
                       scaler)
    if resume:
        _resume(state, out_dir, config, rank, world, steps)
    start = state.step
    trained = ddp.wrap(model, find_unused_parameters=not examples.nsp) if world > 1 else model
    log_path = out_dir / "log.jsonl"
    if rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        _trim_log(log_path, start)
    keep_at = set(snapshot_steps(steps, config.snapshots))
    if rank == 0 and start == 0 and 0 in keep_at:
        _save_snapshot(out_dir, model, 0, tokenizer_source)
    every = _EveryStep(state, config, steps, out_dir, rank, world, keep_at, eval_examples, tokenizer_source)
    every.last = _last_record(log_path) if start else {}  # a resumed run that has no step left keeps what it logged
    every.bar.update(start)
    if eval_examples is not None and rank == 0:
        every.plateau = PlateauWatch(*unigram_rate(examples.store.stream, examples.specials), config.plateau_step,
                                     getattr(model.config, "norm_placement", "post"))
    every.probe = BlockGradients(config.grad_every) if config.grad_every and rank == 0 else None
    train(state, _micro_batches(state, examples, config, steps, rank, world), _share_loss(rank, world), config,
          half=half, trained=trained, kept=lambda: _last_good(out_dir), after_step=every, probe=every.probe)
    every.bar.close()
    model.eval()
    if rank == 0 and config.grad_every:
        _plot_gradients(log_path, out_dir / "gradients.png")
    if rank == 0:
        model.save_pretrained(out_dir)
        write_text_atomic(out_dir / "pretrain.json", json.dumps({"config": config.recorded(), "steps": steps,
                                                                  "examples": state.position, "last": every.last},
                                                                 indent=2) + "\n")
    return {**every.last, "steps": steps, "examples": state.position, **({"resumed_from": start} if start else {})}


def _micro_batches(state: TrainState, examples: Examples, config: PretrainConfig, steps: int, rank: int, world: int):
    """Each step's ``config.accumulate`` micro-batches, from the examples the run has not consumed yet
    (``state.position``, moved on after each step): this process's slice of each global batch of
    ``config.batch_size`` examples, masked (``Examples.batch``: example n is always the same example with
    the same mask)."""
    while state.step < steps:
        micro = []
        for m in range(config.accumulate):
            first = state.position + m * config.batch_size
            lo, hi = (first + config.batch_size * r // world for r in (rank, rank + 1))
            micro.append(examples.batch(range(lo, hi)))
        yield micro


def _share_loss(rank: int, world: int):
    """The masked-LM loss (+ NSP) of this process's slice, scaled to its share of the global micro-batch's
    masked tokens (and examples, for NSP) times ``world``, so that DDP's average over N processes is the
    loss one process takes on the whole micro-batch."""
    def loss(trained: nn.Module, batch: dict) -> torch.Tensor:
        batch = dict(batch)
        nsl = batch.pop("next_sentence_label", None)
        masked = (batch["labels"] != -100).sum()
        counts = torch.stack([masked, torch.tensor(len(batch["input_ids"]), device=masked.device)]).float()
        if world > 1:
            torch.distributed.all_reduce(counts)  # the global micro-batch's masked tokens and examples
        out = trained(**batch, next_sentence_label=nsl) if nsl is not None else trained(**batch)
        value = out.mlm_loss.float() * (float(masked) / max(1.0, float(counts[0])) * world)
        if nsl is not None:
            value = value + out.nsp_loss.float() * len(nsl) / float(counts[1]) * world
        return value
    return loss


def _plot_gradients(log_path: Path, figure: Path) -> None:
    """OUT/gradients.png from the run's per-block records (said, not raised, without matplotlib)."""
    from ..analysis import plots
    from ..errors import MissingExtra

    records = [json.loads(line) for line in log_path.read_text(encoding="utf-8").splitlines() if line.strip()]
    try:
        log.info(f"per-block gradients: {plots.block_gradients(records, figure, title=f'{log_path.parent.name}: per-block gradients')}")
    except MissingExtra as e:
        log.warning(f"no gradient figure: {e}")


class _EveryStep:
    """``train``'s ``after_step`` for pre-training: the examples consumed, and every k steps a log line
    (``log.jsonl``, and the log), a held-out evaluation, a snapshot, a checkpoint (process 0 writes)."""

    def __init__(self, state, config, steps, out_dir, rank, world, keep_at, eval_examples, tokenizer_source):
        self.state, self.config, self.steps, self.out_dir = state, config, steps, out_dir
        self.rank, self.world, self.keep_at = rank, world, keep_at
        self.eval_examples, self.tokenizer_source = eval_examples, tokenizer_source
        self.window, self.last = _Window(), {}
        self.bar = _bar(steps, config.progress and rank == 0)
        self.plateau = self.probe = None  # diagnostics.PlateauWatch and BlockGradients, when asked for

    def __call__(self, losses: list[float], batches: list[dict]) -> None:
        state, config, done = self.state, self.config, self.state.step
        state.position += config.batch_size * config.accumulate
        step_loss = sum(losses) / config.accumulate
        if self.world > 1:  # the mean over processes of the step's loss
            total = torch.tensor(step_loss, device=_device(state.model))
            torch.distributed.all_reduce(total)
            step_loss = float(total) / self.world
        self.window.add(step_loss, sum(int(b["attention_mask"].sum()) for b in batches) * self.world)
        self.bar.update(1)
        end = done == self.steps
        record = self.window.record(done, state) if done % config.log_every == 0 or end else None
        if record is not None and hasattr(self.bar, "set_postfix"):
            self.bar.set_postfix(loss=f"{record['loss']:.3f}")
        if self.eval_examples is not None and config.eval_every and (done % config.eval_every == 0 or end):
            if self.rank == 0:
                record = {**(record or {"step": done}),
                          **evaluate(state.model, self.eval_examples, config.eval_examples)}
                self._check_plateau(record)
        measured = self.probe.take() if self.probe is not None else None
        if measured is not None:  # this step's per-block gradient norms and update ratios
            record = {**(record or {"step": done}), **measured}
        if record is not None and self.rank == 0:
            self.last = record
            with open(self.out_dir / "log.jsonl", "a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")
            log.info(" ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in record.items()
                              if not isinstance(v, (list, dict))))  # per-block lists: log.jsonl only
        if done in self.keep_at and self.rank == 0:
            _save_snapshot(self.out_dir, state.model, done, self.tokenizer_source)
        if config.save_every and (done % config.save_every == 0 or end):
            _checkpoint(self.out_dir, state, config, self.rank, self.world, self.tokenizer_source)


    def _check_plateau(self, record: dict) -> None:
        said = self.plateau.check(record["step"], record["masked_accuracy"]) if self.plateau is not None else None
        if said:
            record["plateau"] = {"unigram_rate": self.plateau.rate, "token": self.plateau.token}
            warnings.warn(said, stacklevel=2)  # on stderr, even with --quiet


class _Window:
    """The training loss and throughput since the last log line."""

    def __init__(self):
        self.started, self.tokens, self.loss, self.steps = time.perf_counter(), 0, 0.0, 0

    def add(self, loss: float, tokens: int) -> None:
        self.loss, self.steps, self.tokens = self.loss + loss, self.steps + 1, self.tokens + tokens

    def record(self, step: int, state: TrainState) -> dict:
        """The log line of ``step``; the window starts again."""
        seconds = time.perf_counter() - self.started
        record = {"step": step, "loss": self.loss / self.steps, "lr": state.scheduler.get_last_lr()[0],
                  "tokens_per_second": self.tokens / seconds if seconds else 0.0, "examples": state.position}
        self.__init__()
        return record


def _checkpoint(out_dir: Path, state: TrainState, config: PretrainConfig, rank: int, world: int,
                tokenizer_source) -> None:
    """Every process's random generators gathered, and process 0 writes the checkpoint."""
    states = rng_states(world)
    if rank == 0:
        _save_checkpoint(out_dir, state, config, states, tokenizer_source)
    if world > 1:
        torch.distributed.barrier()


def _bar(steps: int, enabled: bool):
    from ..tools.progress import progress_bar

    bar = progress_bar(steps, "pretraining", enabled)
    if hasattr(bar, "unit"):
        bar.unit = "step"
    return bar


def _last_good(out_dir: Path) -> str:
    """Where a stopped run's last good weights are, in words."""
    found = checkpoints(out_dir)
    return (f"the last good checkpoint is {found[-1]}" if found
            else "no checkpoint had been written, so none is kept (--save-every sets how often)")


def _records(path: Path) -> list[tuple[str, dict]]:
    """(line, record) for each record of a run's log.jsonl; a line a kill cut short is left out."""
    if not path.exists():
        return []
    found = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict):
            found.append((line, record))
    return found


def _last_record(path: Path) -> dict:
    """The last record of a run's log.jsonl ({} when none): what the run's summary ends with."""
    records = _records(path)
    return records[-1][1] if records else {}


def _trim_log(path: Path, step: int) -> None:
    """Keep the records of steps up to ``step`` (a resumed run writes the later ones again); a line a kill
    cut short is dropped."""
    if not path.exists():
        return
    kept = [line for line, record in _records(path) if record.get("step", 0) <= step]
    write_text_atomic(path, "".join(line + "\n" for line in kept))
