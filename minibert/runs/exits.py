"""Early exits from files, as ``minibert exits`` runs it: exits on a fine-tuned classifier (frozen, or trained
with it), trained on a labelled file; the classifier with its exits, its tokenizer and ``exits.json`` (per-exit
accuracy and the accuracy / blocks / time curve on the held-out file) written out. The exits themselves are
``minibert.training.depth``'s."""

from __future__ import annotations

import dataclasses
import json

from ..hardware import training_device
from ..outputs import reads_of
from ..loading import copy_tokenizer
from ..models.heads import BertForSequenceClassification
from ..textfiles import read_json, write_text_atomic
from ..tokenizer import BertTokenizer
from ..training.depth import EarlyExit, curve_table, exit_accuracies, exit_curve
from ..settings import base_of
from ..training.loop import FitConfig, epoch_reporter, fit
from .settings import ExitsRun
from .skeleton import (begin_fit, check_labels, check_length, finished_history, read_task_data, resolved,
                       run_folder)


def train_exits(run: ExitsRun) -> str:
    """``minibert exits``: exits on a fine-tuned classifier (frozen, or ``run.joint``), trained on
    ``run.train``; the classifier with its exits, the tokenizer and ``exits.json`` (per-exit accuracy and the
    curve on ``run.eval``; its speed column timed over ``run.rounds`` alternating rounds after a warm-up)
    written to ``run.out`` (the output-folder rule: ``outputs.RunFolder``; ``resume``, ``overwrite``).
    Returns the curve as a markdown table."""
    run.check()
    where = training_device(run.device)  # before any work
    config = dataclasses.replace(base_of(run, FitConfig), lr=run.learning_rate())
    max_length = run.max_length
    folder = run_folder(run.out, "exits", reads=reads_of(run), config=config, overwrite=run.overwrite)
    out_dir = folder.path
    model = BertForSequenceClassification.from_pretrained(run.model)
    tokenizer = BertTokenizer.from_pretrained(run.model)
    ee = EarlyExit(model, frozen=not run.joint).to(where)  # the exits are made beside the model, then moved
    data = read_task_data("classify", run.train, run.eval, text_column=run.text_column, label_column=run.label_column)
    check_labels(model.config.label2id, data.labels("train") + data.labels("held"), "the data",
                 f"{run.model} does not predict")
    check_length(model, tokenizer, data, max_length)
    held = data.held
    batches = data.batches(tokenizer, model.config.label2id, batch_size=run.batch_size, max_length=max_length,
                           seed=config.seed)

    def evaluate(m):
        accuracies = exit_accuracies(m, tokenizer, held.texts, held.labels, max_length=max_length)
        return {"mean_exit_accuracy": sum(accuracies) / len(accuracies),
                **{f"exit_{i}": a for i, a in enumerate(accuracies)}}

    report = epoch_reporter(config.epochs, describe=lambda scores: "accuracy per exit " + ", ".join(
        f"{v:.3f}" for k, v in scores.items() if k.startswith("exit_")))

    recorded = {"model": resolved(run.model), "train": resolved(run.train), "eval": resolved(run.eval),
                "joint": run.joint, "batch_size": run.batch_size, "max_length": max_length,
                "text_column": run.text_column, "label_column": run.label_column}
    with folder.claim(recorded) as claimed:
        begin_fit(claimed, config)
        if claimed.finished:
            finished_history(out_dir, folder.shown)  # says there is nothing to resume
            table = ExitsTable(curve_table(read_json(out_dir / "exits.json")["curve"]))
            table.nothing_to_resume = True
            return table
        history = fit(ee, batches, config=config, evaluate=evaluate, metric="mean_exit_accuracy", out_dir=out_dir,
                      on_epoch_end=report)
        best = EarlyExit.from_pretrained(out_dir).to(where)
        copy_tokenizer(run.model, out_dir)
        rows = exit_curve(best, tokenizer, held.texts, held.labels, rounds=run.rounds, max_length=max_length)
        write_text_atomic(out_dir / "exits.json", json.dumps({
            "joint": run.joint, "best_epoch": history.best_epoch,
            "exit_accuracy": exit_accuracies(best, tokenizer, held.texts, held.labels, max_length=max_length),
            "curve": rows}, indent=2) + "\n")
    return ExitsTable(curve_table(rows))


class ExitsTable(str):
    """The curve as a markdown table; ``nothing_to_resume`` when --resume found the run finished (and wrote
    nothing)."""

    nothing_to_resume = False
