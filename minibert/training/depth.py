"""Adaptive depth: spend fewer blocks, chosen once for a model or per input.

* **LayerDrop** (Fan et al. 2019, "Reducing Transformer Depth on Demand with Structured Dropout"): while
  fine-tuning, each block is skipped (the identity) with probability ``p`` on every forward pass, so the
  model learns not to rely on any one block; afterwards it can be pruned to any subset of blocks
  (``keep_blocks``; "every other" from the top: ``spread_blocks``) with little loss.

      drop = LayerDrop(model, p=0.2, seed=0)   # a forward pre-hook: nothing in model.py changes
      fit(model, batches, ...)
      drop.remove()
      small = keep_blocks(model, spread_blocks(6, 3))   # blocks 1, 3, 5

* **Early exit** (DeeBERT, Xin et al. 2020; PABEE, Zhou et al. 2020): a classifier after every block
  ("off-ramp": a tanh layer and a linear layer, the shape of the pooler and classifier, drawn from
  N(0, 0.02) with a seed, reading the mean of the block's real tokens -- or [CLS], as DeeBERT, with
  ``pooling="cls"``); the model's own pooler and classifier are the last exit. Trained on a frozen,
  fine-tuned model (``EarlyExit(model)``: only the ramps learn) or jointly (``frozen=False``: everything
  learns, exit i's loss weighted by i + 1, as PABEE). At inference a row leaves the batch at the first
  exit whose prediction is confident (softmax entropy below ``entropy``) or, with ``patience=k``, once
  k consecutive exits agree; the rows still running go on through the packed fast path
  (``tools.fast.Stepper``), so a finished row costs nothing more.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ..errors import InputError
from ..models.heads import BertForSequenceClassification, init_head, problem_type, sequence_loss
from ..tools.batching import text_batches
from ..tools.pooling import pool
from ..checks import check_fraction, check_index, check_positive, encoder_of
from ..tools.fast import Stepper


# ---------------------------------------------------------------------------------------------- LayerDrop
def spread_blocks(num_blocks: int, keep: int) -> list[int]:
    """``keep`` blocks of ``num_blocks``, evenly spread and always including the top one (which the head
    was trained on): 6 -> 3 gives 1, 3, 5 (LayerDrop's "every other"); 6 -> 2 gives 2, 5; 6 -> 1 gives 5."""
    check_index("keep", keep, 1, num_blocks, f"blocks to keep of {num_blocks}")
    return [(i + 1) * num_blocks // keep - 1 for i in range(keep)]


class LayerDrop:
    """Skips each block with probability ``p`` on every training forward pass of ``model`` (a BertModel
    or a task model with ``.bert``); in eval mode it does nothing. At least one block always runs. Draws
    come from its own generator (``seed``), so a run is repeatable. ``remove()`` takes it off."""

    def __init__(self, model: nn.Module, p: float, *, seed: int = 0):
        check_fraction("LayerDrop p", p)
        self.encoder = encoder_of(model)
        self.p = float(p)
        self.generator = torch.Generator().manual_seed(seed)
        self.dropped: list[list[int]] = []  # the blocks skipped on each training pass (the last 1000)
        self.handle = self.encoder.register_forward_pre_hook(self._pre_forward, with_kwargs=True)

    def _pre_forward(self, module, args, kwargs):
        if not module.training or not self.p:
            return None
        N = module.config.num_hidden_layers
        drop = (torch.rand(N, generator=self.generator) < self.p).tolist()
        if all(drop):  # keep one block, chosen at random
            drop[int(torch.randint(N, (1,), generator=self.generator))] = False
        skipped = [i for i, d in enumerate(drop) if d]
        self.dropped = (self.dropped + [skipped])[-1000:]
        kwargs = dict(kwargs)
        kwargs["skip_blocks"] = tuple(sorted(set(kwargs.get("skip_blocks") or ()) | set(skipped)))
        return args, kwargs

    def remove(self) -> None:
        self.handle.remove()


# ---------------------------------------------------------------------------------------------- early exit
@dataclass
class ExitOutput:
    logits: torch.Tensor  # (N exits, B, C): exit i reads block i's output
    loss: torch.Tensor | None = None


@dataclass
class ExitPrediction:
    logits: torch.Tensor  # (B, C): each row's logits at the exit it took
    exits: torch.Tensor  # (B,): the block after which each row exited (0..N-1); it ran exits + 1 blocks

    @property
    def blocks_run(self) -> float:
        """The average number of blocks a row ran."""
        return float(self.exits.float().mean()) + 1


class EarlyExit(nn.Module):
    """A BertForSequenceClassification with an exit after every block (see the module docstring)."""

    PART = "early_exits"  # early_exits.json (the settings) and early_exits.safetensors (the ramps): ``parts``
    config_keys = ("pooling",)  # what the saved part records to build the exits again

    def __init__(self, model: BertForSequenceClassification, *, frozen: bool = True, seed: int = 0,
                 pooling: str = "mean"):
        super().__init__()
        if not isinstance(model, BertForSequenceClassification) or model.bert.pooler is None:
            raise InputError("EarlyExit takes a BertForSequenceClassification (with its pooler)")
        kind = problem_type(model.config)
        if kind != "single_label_classification":
            raise InputError(f"early exit needs a single-label classifier; this model's problem is {kind}")
        if pooling not in ("mean", "cls"):
            raise InputError(f"pooling {pooling!r}: the exits read 'mean' (of the real tokens) or 'cls'")
        self.model, self.frozen, self.config, self.pooling = model, bool(frozen), model.config, pooling
        N = model.config.num_hidden_layers
        generator = torch.Generator().manual_seed(seed)
        self.ramps = nn.ModuleList(self._new_ramp(model, generator) for _ in range(N - 1))  # after blocks 0..N-2
        if frozen:
            for p in model.parameters():
                p.requires_grad_(False)

    @staticmethod
    def _new_ramp(model, generator) -> nn.Sequential:
        """tanh(W h_[CLS] + b), dropout, a linear layer: the shape of the model's pooler and classifier,
        drawn from N(0, 0.02) with zero biases (as BERT initialises)."""
        H, C = model.config.hidden_size, model.config.num_labels
        ramp = nn.Sequential(nn.Linear(H, H), nn.Tanh(), nn.Dropout(model.dropout.p), nn.Linear(H, C))
        for linear in (ramp[0], ramp[3]):
            init_head(linear, generator)
        return ramp

    def train(self, mode: bool = True):
        super().train(mode)
        if self.frozen:
            self.model.eval()  # a frozen model has no dropout either
        return self

    def exit_logits(self, i: int, first_tokens: torch.Tensor, mean_tokens: torch.Tensor) -> torch.Tensor:
        """Logits (B, C) of exit ``i`` from block i's [CLS] vectors and mean token vectors (B, H) each. The
        ramps read the mean (or [CLS], with ``pooling="cls"``, as DeeBERT); the last exit is the model's
        own pooler and classifier, on [CLS]."""
        if i == len(self.ramps):
            pooled = self.model.bert.pooler.hook_output(torch.tanh(self.model.bert.pooler.dense(first_tokens)))
            return self.model.classifier(self.model.dropout(pooled))
        return self.ramps[i](mean_tokens if self.pooling == "mean" else first_tokens)

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, position_ids=None, labels=None) -> ExitOutput:
        """Every exit's logits; with labels, the training loss: the mean of the ramps' losses (frozen), or
        PABEE's weighted mean over all exits, weight i + 1 for exit i (joint)."""
        with torch.set_grad_enabled(torch.is_grad_enabled() and not self.frozen):
            out = self.model.bert(input_ids, attention_mask, token_type_ids, position_ids)
        states = out.hidden_states[1:]  # block outputs, (B, T, H) each
        logits = torch.stack([self.exit_logits(i, h[:, 0], pool(h, attention_mask, "mean"))
                              for i, h in enumerate(states)])  # (N, B, C)
        loss = None
        if labels is not None:
            losses = torch.stack([sequence_loss(z, labels, self.config) for z in logits])  # (N,)
            if self.frozen:
                loss = losses[:-1].mean()
            else:
                weights = torch.arange(1, len(losses) + 1, dtype=losses.dtype, device=losses.device)
                loss = (weights * losses).sum() / weights.sum()
        return ExitOutput(logits, loss)

    @torch.no_grad()
    def predict_batch(self, input_ids, attention_mask=None, token_type_ids=None, *, entropy: float | None = None,
                      patience: int | None = None) -> ExitPrediction:
        """Each row exits at the first exit whose softmax entropy (nats) is below ``entropy``, or, with
        ``patience=k``, at the first exit whose prediction equals the previous k - 1 exits' (the k-th in a
        row); else at the last. Exited rows leave the packed batch."""
        if (entropy is None) == (patience is None):
            raise InputError("give exactly one of entropy= (a threshold in nats, >= 0) or patience= (exits that agree)")
        if entropy is not None and not entropy >= 0:
            raise InputError(f"entropy={entropy!r} must be >= 0 (0 = never exit early)")
        N = len(self.ramps) + 1
        if patience is not None:
            check_index("patience", patience, 1, N, f"consecutive exits of {N}")
        was_training = self.training
        self.eval()
        try:
            steps = Stepper(self.model.bert, input_ids, attention_mask, token_type_ids)
            B = len(steps.rows)
            final_logits = torch.zeros(B, self.config.num_labels)
            exits = torch.full((B,), N - 1)
            streak = torch.zeros(B, dtype=torch.long)
            previous = torch.full((B,), -1)
            for i in range(N):
                steps.run_block(i)
                # (rows left, C), on the CPU: the bookkeeping below (rows, streaks) is the CPU's, a few numbers a block
                z = self.exit_logits(i, steps.first_tokens(), steps.mean_tokens()).float().cpu()
                rows = steps.rows
                if entropy is not None:
                    p = z.softmax(-1)
                    done = -(torch.xlogy(p, p)).sum(-1) < entropy
                else:
                    guess = z.argmax(-1)
                    streak[rows] = torch.where(guess == previous[rows], streak[rows] + 1, torch.ones_like(guess))
                    previous[rows] = guess
                    done = streak[rows] >= patience
                if i == N - 1:
                    done = torch.ones_like(done)
                final_logits[rows[done]] = z[done]
                exits[rows[done]] = i
                if i < N - 1:
                    steps.keep(~done)
                    if not len(steps.rows):
                        break
            return ExitPrediction(final_logits, exits)
        finally:
            self.train(was_training)

    def predict(self, texts, *, tokenizer, entropy: float | None = None, patience: int | None = None,
                batch_size: int = 32, max_length: int | None = 128) -> tuple[list[str], list[int]]:
        """Labels and exit blocks for ``texts`` (batched in length order, results in input order)."""
        names = [self.config.id2label[i] for i in range(self.config.num_labels)]
        labels, exits = [None] * len(texts), [None] * len(texts)
        for rows, batch in text_batches(tokenizer, texts, batch_size=batch_size, max_length=max_length,
                                        device=self.model.bert.device):
            out = self.predict_batch(batch["input_ids"], batch["attention_mask"], batch.get("token_type_ids"),
                                     entropy=entropy, patience=patience)
            for i, z, e in zip(rows, out.logits, out.exits.tolist()):
                labels[i], exits[i] = names[int(z.argmax())], e
        return labels, exits

    def save_pretrained(self, directory) -> None:
        """The classifier's checkpoint (transformers loads it as a plain classifier) and, beside it, the exits
        as a part (``parts``: early_exits.json and early_exits.safetensors), written together
        (``textfiles.atomic_dir``: a kill leaves the old pair)."""
        from ..loading import CHECKPOINT_FILES
        from ..parts import files, write_part
        from ..textfiles import atomic_dir

        with atomic_dir(directory, replaced=CHECKPOINT_FILES + files(self.PART)) as tmp:
            self.model.save_pretrained(tmp)
            write_part(tmp, self.PART, {k: getattr(self, k) for k in self.config_keys}, self.ramps.state_dict())

    @classmethod
    def from_pretrained(cls, directory) -> "EarlyExit":
        from ..parts import check_fits, has_part, read_part

        if not has_part(directory, cls.PART):
            raise InputError(f"{directory} has no early exits ({cls.PART}.json and .safetensors): it is a plain "
                             "classifier, not an early-exit one")
        record, state = read_part(directory, cls.PART, what="an early-exit classifier")
        model = BertForSequenceClassification.from_pretrained(directory)
        ee = cls(model, **{k: record[k] for k in cls.config_keys if k in record})
        check_fits(directory, ee.ramps, state, f"its {len(ee.ramps)} exits")
        ee.ramps.load_state_dict(state)
        return ee.eval()


def entropy_thresholds(num_labels: int, steps: int = 8) -> list[float]:
    """Thresholds from 0 (never exit early) to log(C) (always exit at the first block), evenly spread."""
    top = math.log(num_labels)
    return [top * i / steps for i in range(steps + 1)]


# ------------------------------------------------------------------------------------ training and report
def exit_accuracies(ee: EarlyExit, tokenizer, texts, labels, *, batch_size: int = 64, max_length: int | None = 128) -> list[float]:
    """The accuracy of every exit on its own (all rows through all blocks)."""
    names = [ee.config.id2label[i] for i in range(ee.config.num_labels)]
    correct = torch.zeros(len(ee.ramps) + 1)
    was_training = ee.training
    ee.eval()
    with torch.no_grad():
        for rows, batch in text_batches(tokenizer, texts, batch_size=batch_size, max_length=max_length,
                                        device=ee.model.bert.device):
            guesses = ee(**batch).logits.argmax(-1).cpu()  # (N, B)
            gold = torch.tensor([names.index(str(labels[i])) for i in rows])
            correct += (guesses == gold).sum(1)
    ee.train(was_training)
    return (correct / len(texts)).tolist()


def exit_curve(ee: EarlyExit, tokenizer, texts, labels, *, entropies=None, patiences=None, rounds: int = 5,
               batch_size: int = 32, max_length: int | None = 128) -> list[dict]:
    """Accuracy, average blocks run and wall time for each exit rule on ``texts``, and for the plain model
    on the fast path (``rule: "full model"``); every rule is called once to warm up, then in ``rounds``
    rounds that alternate the rules (``tools.timing``); ``seconds`` is the median, ``speedup`` the median
    over rounds of the full model's time over the rule's, ``speedup_spread`` its quartiles."""
    import statistics

    from ..tools import fast, timing

    entropies = entropy_thresholds(ee.config.num_labels) if entropies is None else list(entropies)
    patiences = list(range(1, len(ee.ramps) + 2)) if patiences is None else list(patiences)
    rules = [("full model", None)] + [("entropy", e) for e in entropies] + [("patience", k) for k in patiences]
    names = [ee.config.id2label[i] for i in range(ee.config.num_labels)]
    gold = [str(y) for y in labels]
    model = ee.model
    run = fast.prepare(model.bert)

    def full():
        out = [None] * len(texts)
        with torch.inference_mode():
            for rows, batch in text_batches(tokenizer, texts, batch_size=batch_size, max_length=max_length,
                                            device=model.bert.device):
                logits = model.classifier(run(**batch).pooler_output)
                for i, z in zip(rows, logits):
                    out[i] = names[int(z.argmax())]
        return out, [len(ee.ramps)] * len(texts)

    ee.eval()
    results = {}

    def call(rule):
        def run():
            if rule[0] == "full model":
                results[rule] = full()
            else:
                kind, value = rule
                results[rule] = ee.predict(texts, tokenizer=tokenizer, batch_size=batch_size, max_length=max_length,
                                           **{kind: value})
        return run
    # warmed up, alternated with a rotating start, read as medians of paired ratios (tools.timing)
    check_positive("rounds", rounds)
    times = timing.alternate({rule: call(rule) for rule in rules}, rounds, warmup=1, rotate=True)
    rows = []
    for rule in rules:
        predicted, exits = results[rule]
        low, high = timing.spread([f / r for f, r in zip(times[rules[0]], times[rule])])
        rows.append({"rule": rule[0], "value": rule[1],
                     "accuracy": sum(p == g for p, g in zip(predicted, gold)) / len(gold),
                     "blocks": sum(exits) / len(exits) + 1, "seconds": statistics.median(times[rule]),
                     "speedup": timing.paired_ratio(times, rules[0], rule), "speedup_spread": [low, high]})
    return rows


def curve_table(rows: list[dict]) -> str:
    """The exit curve as a markdown table: seconds are medians over the rounds, the speed-up the median of
    the paired ratios with its quartiles (a rule that runs every block reads 1.00x within that spread)."""
    lines = ["| exit rule | accuracy | average blocks run | seconds (median) | speed-up vs full model (quartiles) |",
             "|---|---|---|---|---|"]
    for r in rows:
        rule = r["rule"] if r["value"] is None else (f"entropy < {r['value']:.3f}" if r["rule"] == "entropy"
                                                     else f"patience {r['value']}")
        low, high = r["speedup_spread"]
        lines.append(f"| {rule} | {r['accuracy']:.4f} | {r['blocks']:.2f} | {r['seconds']:.3f} | "
                     f"{r['speedup']:.2f}x ({low:.2f}-{high:.2f}) |")
    return "\n".join(lines)

