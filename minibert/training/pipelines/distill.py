"""Distillation from files, as ``minibert distill`` runs it: sentence embeddings on unlabelled texts
(``distill_corpus``), or a fine-tuned classifier / tagger on labelled files (``distill_task``). Students,
losses and distillers are ``minibert.training.distill``'s; this reads, wires them to ``fit`` and writes the
best student with its tokenizer."""

from __future__ import annotations

import contextlib
import random
from dataclasses import dataclass
from typing import Callable, Sequence

from ...errors import InputError
from ...inputs import check_index
from ...loading import copy_tokenizer
from ...models import BertModel
from ...models.heads import BertForSequenceClassification, BertForTokenClassification
from ...tokenizer import BertTokenizer
from ...tools.surgery import check_dropout, dropout, freeze
from ..distill import (TaskDistiller, augment_texts, default_blocks, distill_embeddings, embed, embedding_agreement,
                       init_student, parse_layer_map)
from ..loop import FitConfig, History, epoch_reporter, fit
from .skeleton import TASK_METRIC, check_labels, read_task_data


@dataclass
class CorpusRun:
    history: History
    before: dict  # agreement of the untrained student (the teacher's blocks, copied)
    blocks: list[int]  # the teacher blocks the student started from
    held_out: int  # texts the agreement is measured on
    split: bool  # True: they were held out of ``texts`` (no eval_texts given)


def distill_corpus(teacher_source, texts: Sequence[str], out_dir, *, eval_texts: Sequence[str] | None = None,
                   student_blocks=None, pooling: str = "mean", normalize: bool = False,
                   similarity_weight: float = 0.0, hidden_weight: float = 0.0,
                   attention_weight: float = 0.0, layer_map: dict[int, int] | str | None = None,
                   config: FitConfig = FitConfig(epochs=3, lr=5e-4), batch_size: int = 32,
                   max_length: int | None = 128, group_by_length: bool = False,
                   student_dropout: float | None = 0.0, augment: int = 0, cache_teacher: bool = False,
                   freeze_embeddings: bool = False, log: Callable[[str], None] | None = None) -> CorpusRun:
    """``minibert distill --texts``: load the teacher, start the student from ``student_blocks`` (default
    every other), hold 5 % of ``texts`` out when no ``eval_texts`` are given, add ``augment`` new texts made
    from the training texts (``augment_texts``, after the held-out split), measure the agreement before,
    distil, and write the best student with the tokenizer to ``out_dir``. ``freeze_embeddings``: the
    student keeps the teacher's embeddings (``surgery.freeze``): no gradient for the word-embedding
    matrix, a faster step."""
    if student_dropout is not None:
        check_dropout(student_dropout)
    check_index("augment (texts to make)", augment, 0, 10**9)
    texts = [t for t in texts if t.strip()]
    if not texts:
        raise InputError("no non-empty text to distil on")
    split = not eval_texts
    if split:
        texts, eval_texts = split_held_out(texts, seed=config.seed)
    else:
        eval_texts = [t for t in eval_texts if t.strip()]
        if len(eval_texts) < 3:
            raise InputError(f"{len(eval_texts)} non-empty held-out text(s); the agreement needs at least 3")
    if augment:
        texts = texts + augment_texts(texts, augment, seed=config.seed)
    teacher = BertModel.from_pretrained(teacher_source, mlm_head=False).eval()
    tokenizer = BertTokenizer.from_pretrained(teacher_source)
    blocks = list(student_blocks) if student_blocks is not None else default_blocks(teacher.config.num_hidden_layers)
    student = init_student(teacher, blocks).train()
    if freeze_embeddings:
        freeze(student, embeddings=True)
    if isinstance(layer_map, str):
        layer_map = parse_layer_map(layer_map, student.config.num_hidden_layers, teacher.config.num_hidden_layers)
    k = min(10, len(eval_texts) - 1)
    before = embedding_agreement(embed(teacher, tokenizer, eval_texts, pooling=pooling, max_length=max_length),
                                 embed(student, tokenizer, eval_texts, pooling=pooling, max_length=max_length), k=k)
    history = distill_embeddings(teacher, student, tokenizer, texts, eval_texts=eval_texts, pooling=pooling,
                                 normalize=normalize, similarity_weight=similarity_weight,
                                 hidden_weight=hidden_weight, attention_weight=attention_weight,
                                 layer_map=layer_map, config=config, batch_size=batch_size, max_length=max_length,
                                 group_by_length=group_by_length, student_dropout=student_dropout,
                                 cache_teacher=cache_teacher, out_dir=out_dir, log=log)
    copy_tokenizer(teacher_source, out_dir)
    return CorpusRun(history, before, blocks, len(eval_texts), split)


def split_held_out(texts: Sequence[str], share: float = 0.05, limit: int = 1000, seed: int = 0):
    """(train, held): a seeded share of the texts (at most ``limit``, at least 3) held out for agreement."""
    order = list(range(len(texts)))
    random.Random(seed).shuffle(order)
    n = min(limit, max(3, round(share * len(texts))))
    if len(texts) - n < 1:
        raise InputError(f"{len(texts)} texts are too few to hold {n} out for evaluation; give --eval-texts")
    held = set(order[:n])
    return [t for i, t in enumerate(texts) if i not in held], [texts[i] for i in sorted(held)]


# ------------------------------------------------------------------------------------------------ task
def distill_task(train_path, eval_path, teacher_source, out_dir, *, task: str = "classify", student_blocks=None,
                 temperature: float = 2.0, alpha: float = 0.5, hidden_weight: float = 0.0,
                 attention_weight: float = 0.0, layer_map: dict[int, int] | str | None = None, text_column: str = "text",
                 pair_column: str | None = None, label_column: str = "label", tag_column: str = "upos",
                 config: FitConfig = FitConfig(), batch_size: int = 16, max_length: int = 128,
                 student_dropout: float | None = None,
                 log: Callable[[str], None] | None = print) -> tuple[History, dict]:
    """Distil a fine-tuned classifier (``task="classify"``) or tagger (``"tag"``) into a student made of
    ``student_blocks`` of its blocks; the student is evaluated after each epoch as ``minibert finetune``
    evaluates (accuracy / entity F1), the best epoch saved in ``out_dir`` with the tokenizer. Returns the
    history and the teacher's score on the same evaluation data. ``student_dropout``: as in
    ``distill_embeddings``; None (here the default) keeps the student's own dropout, which regularises a
    classifier trained on few labels."""
    if task not in ("classify", "tag"):
        raise InputError(f"task {task!r}: distillation with soft targets takes 'classify' or 'tag'")
    if student_dropout is not None:
        check_dropout(student_dropout)
    cls = BertForSequenceClassification if task == "classify" else BertForTokenClassification
    teacher = cls.from_pretrained(teacher_source).eval()
    tokenizer = BertTokenizer.from_pretrained(teacher_source)
    student = init_student(teacher, student_blocks).train()
    if isinstance(layer_map, str):
        layer_map = parse_layer_map(layer_map, student.config.num_hidden_layers, teacher.config.num_hidden_layers)
    label2id = teacher.config.label2id
    data = read_task_data(task, train_path, eval_path, text_column=text_column, pair_column=pair_column,
                          label_column=label_column, tag_column=tag_column)
    check_labels(label2id, data.labels("train") + data.labels("held"), "the data",
                 f"the teacher {teacher_source} does not predict")
    batches = data.batches(tokenizer, label2id, batch_size=batch_size, max_length=max_length, seed=config.seed)
    score = data.evaluator(tokenizer, max_length=max_length)
    metric = TASK_METRIC[task]
    teacher_score = score(teacher)
    if log is not None:
        log(f"teacher ({teacher.config.num_hidden_layers} blocks): "
            + ", ".join(f"{k} {v:.4f}" for k, v in teacher_score.items()))
    distiller = TaskDistiller(teacher, student, temperature=temperature, alpha=alpha, hidden_weight=hidden_weight,
                              attention_weight=attention_weight, layer_map=layer_map)
    with contextlib.nullcontext() if student_dropout is None else dropout(student, student_dropout):
        history = fit(distiller, batches, config=config, evaluate=lambda m: score(m.student), metric=metric,
                      out_dir=out_dir, on_epoch_end=epoch_reporter(log, config.epochs, loss_digits=5))
    copy_tokenizer(teacher_source, out_dir)
    return history, teacher_score
