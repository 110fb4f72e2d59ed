"""Early exits from files, as ``minibert exits`` runs it: exits on a fine-tuned classifier (frozen, or trained
with it), trained on a labelled file; the classifier with its exits, its tokenizer and ``exits.json`` (per-exit
accuracy and the accuracy / blocks / time curve on the held-out file) written out. The exits themselves are
``minibert.training.depth``'s."""

from __future__ import annotations

import json

from ..loading import copy_tokenizer
from ..models.heads import BertForSequenceClassification
from ..textfiles import read_json, write_text_atomic
from ..tokenizer import BertTokenizer
from ..training.depth import EarlyExit, curve_table, exit_accuracies, exit_curve
from ..training.loop import FitConfig, epoch_reporter, fit
from .skeleton import (begin_fit, check_labels, check_length, finished_history, read_task_data, resolved,
                       run_folder)


def train_exits(model_source, train_path, eval_path, out_dir, *, joint: bool = False, config=None,
                batch_size: int = 16, max_length: int = 128, text_column: str = "text", label_column: str = "label",
                rounds: int = 5, overwrite: bool = False, log=None) -> str:
    """``minibert exits``: exits on a fine-tuned classifier (frozen, or ``joint``), trained on ``train_path``;
    the classifier with its exits, the tokenizer and ``exits.json`` (per-exit accuracy and the curve on
    ``eval_path``; its speed column timed over ``rounds`` alternating rounds after a warm-up) written to
    ``out_dir`` (the output-folder rule: ``outputs.RunFolder``; ``config.resume``, ``overwrite``). Returns the
    curve as a markdown table."""
    config = config or FitConfig(epochs=2)
    config.check()
    folder = run_folder(out_dir, "exits", reads={"--model": model_source}, config=config, overwrite=overwrite)
    out_dir = folder.path
    model = BertForSequenceClassification.from_pretrained(model_source)
    tokenizer = BertTokenizer.from_pretrained(model_source)
    ee = EarlyExit(model, frozen=not joint)
    data = read_task_data("classify", train_path, eval_path, text_column=text_column, label_column=label_column)
    check_labels(model.config.label2id, data.labels("train") + data.labels("held"), "the data",
                 f"{model_source} does not predict")
    check_length(model, tokenizer, data, max_length)
    held = data.held
    batches = data.batches(tokenizer, model.config.label2id, batch_size=batch_size, max_length=max_length,
                           seed=config.seed)

    def evaluate(m):
        accuracies = exit_accuracies(m, tokenizer, held.texts, held.labels, max_length=max_length)
        return {"mean_exit_accuracy": sum(accuracies) / len(accuracies),
                **{f"exit_{i}": a for i, a in enumerate(accuracies)}}

    report = epoch_reporter(log, config.epochs, describe=lambda scores: "accuracy per exit " + ", ".join(
        f"{v:.3f}" for k, v in scores.items() if k.startswith("exit_")))

    recorded = {"model": resolved(model_source), "train": resolved(train_path), "eval": resolved(eval_path),
                "joint": joint, "batch_size": batch_size, "max_length": max_length, "text_column": text_column,
                "label_column": label_column}
    with folder.claim(recorded) as run:
        begin_fit(run, config, log)
        if run.finished:
            finished_history(out_dir, folder.shown)  # says there is nothing to resume
            table = ExitsTable(curve_table(read_json(out_dir / "exits.json")["curve"]))
            table.nothing_to_resume = True
            return table
        history = fit(ee, batches, config=config, evaluate=evaluate, metric="mean_exit_accuracy", out_dir=out_dir,
                      on_epoch_end=report)
        best = EarlyExit.from_pretrained(out_dir)
        copy_tokenizer(model_source, out_dir)
        rows = exit_curve(best, tokenizer, held.texts, held.labels, rounds=rounds, max_length=max_length)
        write_text_atomic(out_dir / "exits.json", json.dumps({
            "joint": joint, "best_epoch": history.best_epoch,
            "exit_accuracy": exit_accuracies(best, tokenizer, held.texts, held.labels, max_length=max_length),
            "curve": rows}, indent=2) + "\n")
    return ExitsTable(curve_table(rows))


class ExitsTable(str):
    """The curve as a markdown table; ``nothing_to_resume`` when --resume found the run finished (and wrote
    nothing)."""

    nothing_to_resume = False
