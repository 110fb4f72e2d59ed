"""What every from-files pipeline does the same way (see the package docstring)."""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from ..checks import check_max_length, model_limit
from ..errors import InputError
from ..training import metrics
from ..training.data import classification_batches, tag_words, tagging_batches
from ..training.datasets import read_table, read_tagged
from ..training.loop import STATE_FILE, History

log = logging.getLogger(__name__)

#: what each task keeps the best epoch by (tags: by their scheme, see ``TaskData.metric``)
TASK_METRIC = {"classify": "accuracy", "regress": "pearson", "tag": "entity_f1"}


def run_folder(out_dir, command: str, *, reads: dict, config, overwrite: bool = False):
    """The output folder of a pipeline that runs ``fit``, checked before any work by the output-folder rule
    (``outputs.RunFolder``: not a model folder it reads, empty or new unless ``config.resume`` or
    ``overwrite``); under torchrun the first process alone takes it. ``claim()`` it around the writing."""
    from ..outputs import RunFolder
    from ..training import ddp

    return RunFolder(out_dir, command=command, reads=reads, resume=config.resume, overwrite=overwrite,
                     writer=ddp.rank() == 0)


def resolved(source) -> str | None:
    """A path or model source as a run records it: a local path absolute (a resume from another folder
    compares alike), a hub id as it is, a model object by its class."""
    if source is None:
        return None
    if not isinstance(source, (str, Path)):
        return f"<{type(source).__name__} object>"
    p = Path(source).expanduser()
    return str(p.resolve()) if p.exists() else str(source)


def begin_fit(run, config) -> None:
    """What a pipeline that runs ``fit`` does once it holds its folder (``run``, an ``outputs.RunFolder``):
    say where Ctrl-C would leave the run, and, resumed, which epoch it goes on after (``fit`` itself warns
    when there is none)."""
    def hint() -> str:
        done = _resumable_epoch(run.path)
        if done:
            return (f"{run.shown} can be resumed after epoch {done} of {config.epochs}: run the same command with "
                    "--resume")
        return f"no epoch of {run.shown} had finished: the same command with --resume starts from the first epoch"

    run.resume_hint = hint
    done = _resumable_epoch(run.path) if config.resume and run.writer else 0
    if done:
        log.info(f"resuming {run.shown} after epoch {done} of {config.epochs}")


def _resumable_epoch(out_dir) -> int:
    """The last finished epoch of a run ``fit`` can resume (metrics.json counts them, training_state.pt holds
    the state); 0 when there is none."""
    from ..textfiles import read_json

    path = Path(out_dir) / "metrics.json"
    if not path.exists() or not (Path(out_dir) / STATE_FILE).exists():
        return 0
    try:
        return len(read_json(path).get("epochs") or [])
    except InputError:
        return 0


def finished_history(out_dir, shown: str) -> History:
    """A finished run's History, read back from its metrics.json, with a warning that there was nothing to
    resume (and nothing is written)."""
    from ..textfiles import read_json

    saved = read_json(Path(out_dir) / "metrics.json")
    history = History(**{k: saved.get(k) for k in ("epochs", "best_epoch", "best_metric", "metric")})
    history.epochs = history.epochs or []
    history.nothing_to_resume = True
    warnings.warn(f"nothing to resume: {shown} holds a finished run (best epoch {history.best_epoch}); nothing is "
                  "written: --overwrite trains it again", stacklevel=3)
    return history


def check_length(model, tokenizer, data: "TaskData", max_length: int) -> int:
    """``max_length`` checked against the model (``checks.check_max_length``), the tokenizer against the
    model's vocabulary (``check_fits``), and a warning saying how many rows it truncates
    (``TaskData.truncation_note``)."""
    tokenizer.check_fits(model.config)
    check_max_length("--max-length", max_length, model_limit(model.config, tokenizer))
    note = data.truncation_note(tokenizer, max_length)
    if note is not None:
        warnings.warn(note, stacklevel=3)
    return max_length


def check_labels(known: Sequence[str], labels, source, what: str) -> None:
    """Every label of the data is one the model predicts (``known``), or an InputError naming the first
    unknown ones, where they come from (``source``) and what the model knows. ``what`` says whose labels
    they are, e.g. "the training data never shows" or "the teacher ... does not predict"."""
    unknown = sorted(set(map(str, labels)) - set(map(str, known)), key=str)
    if unknown:
        shown = sorted(map(str, known), key=str)
        raise InputError(f"{source} has label(s) {unknown[:5]} that {what}; the model can only predict "
                         f"{shown[:10]}{' ...' if len(shown) > 10 else ''}")


@dataclass
class TaskData:
    """The labelled files of a task, read once: ``train`` / ``held`` are tables (classify, regress) or
    (words, tags) lists (tag)."""

    task: str
    train: object
    held: object

    @property
    def rows(self) -> int:
        """Training rows: texts (or pairs), or tagged sentences."""
        return len(self.train[0]) if self.task == "tag" else len(self.train.labels)

    def labels(self, which: str = "train") -> list:
        data = self.train if which == "train" else self.held
        return [t for row in data[1] for t in row if t is not None] if self.task == "tag" else list(data.labels)

    @property
    def scheme(self) -> str | None:
        """The tag scheme of the training tags (``metrics.tag_scheme``: BIO, IOBES or plain); None for texts."""
        return metrics.tag_scheme(self.labels("train")) if self.task == "tag" else None

    @property
    def metric(self) -> str:
        """The metric the best epoch is chosen by: accuracy (classify), Pearson (regress); for tags it follows
        the scheme -- entity F1 for BIO / IOBES, word accuracy for plain tags (parts of speech)."""
        return metrics.SCHEME_METRIC[self.scheme] if self.task == "tag" else TASK_METRIC[self.task]

    def truncation_note(self, tokenizer, max_length: int) -> str | None:
        """How many training and held-out rows are longer than ``max_length`` tokens (and so are truncated
        when they are batched), as one line; None when none are."""
        counts = []
        for which, data in (("training", self.train), ("held-out", self.held)):
            if self.task == "tag":
                texts, pairs = [" ".join(words) for words in data[0]], None
            else:
                texts, pairs = data.texts, data.pairs
            found = tokenizer(list(texts), list(pairs) if pairs is not None else None, truncation=True,
                              max_length=max_length).num_truncated_tokens
            cut = [n for n in found if n]
            if cut:
                counts.append(f"{len(cut)} of {len(found)} {which} rows (up to {max(cut)} tokens cut)")
        if not counts:
            return None
        return (f"{' and '.join(counts)} are longer than {max_length} tokens and are truncated; "
                "--max-length sets the limit")

    def batches(self, tokenizer, label2id: dict, *, batch_size: int, max_length: int, seed: int):
        """``fit``'s batches of the training file, labels mapped by ``label2id`` (regression: the scores)."""
        if self.task == "tag":
            words, tags = self.train
            return tagging_batches(tokenizer, words, tags, label2id, batch_size=batch_size, max_length=max_length,
                                   seed=seed)
        targets = ([float(y) for y in self.train.labels] if self.task == "regress"
                   else [label2id[str(y)] for y in self.train.labels])
        return classification_batches(tokenizer, self.train.texts, targets, pairs=self.train.pairs,
                                      batch_size=batch_size, max_length=max_length, seed=seed)

    def evaluator(self, tokenizer, *, max_length: int) -> Callable:
        """``evaluate(model)`` on the held-out file, as ``minibert finetune`` reports it: accuracy and macro-F1
        (classify), Pearson and Spearman (regress); for tags by their scheme (``metrics.tag_scores``): entity
        F1, precision and recall (BIO / IOBES), word accuracy and macro-F1 (plain tags)."""
        if self.task == "tag":
            words, tags = self.held
            scheme = self.scheme

            def evaluate(model):
                return metrics.tag_scores(tag_words(model, tokenizer, words, max_length=max_length), tags, scheme)
            return evaluate
        held = self.held

        def evaluate(model):
            predictions = model.predict(held.texts, held.pairs, tokenizer=tokenizer, max_length=max_length)
            if self.task == "regress":
                scores = [p["score"] for p in predictions]
                return {"pearson": metrics.pearson(scores, held.labels), "spearman": metrics.spearman(scores, held.labels)}
            labels = [p["label"] for p in predictions]
            return {"accuracy": metrics.accuracy(labels, held.labels), "macro_f1": metrics.macro_f1(labels, held.labels)}
        return evaluate


def read_task_data(task: str, train_path, eval_path, *, text_column: str = "text", pair_column: str | None = None,
                   label_column: str = "label", tag_column: str = "upos") -> TaskData:
    """Read the training and held-out files of ``task`` (``TASK_METRIC``'s keys)."""
    if task not in TASK_METRIC:
        raise InputError(f"task {task!r}: use one of {tuple(TASK_METRIC)}")
    if task == "tag":
        return TaskData(task, read_tagged(train_path, column=tag_column), read_tagged(eval_path, column=tag_column))
    regression = task == "regress"
    read = dict(text_column=text_column, label_column=label_column, pair_column=pair_column, regression=regression)
    data = TaskData(task, read_table(train_path, **read), read_table(eval_path, **read))
    if regression and len({float(y) for y in data.held.labels}) < 2:
        shown = sorted({float(y) for y in data.held.labels})
        raise InputError(f"--eval {eval_path}: {len(data.held.labels)} row(s), label(s) {shown}: regression is "
                         "scored by the Pearson and Spearman correlations of predictions with the labels, which need "
                         "at least two different labels; give a held-out file with varied scores")
    return data
