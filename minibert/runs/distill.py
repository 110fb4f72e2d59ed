"""Distillation from files, as ``minibert distill`` runs it: sentence embeddings on unlabelled texts
(``distill_corpus``), or a fine-tuned classifier / tagger on labelled files (``distill_task``). Students,
losses and distillers are ``minibert.training.distill``'s; this reads, wires them to ``fit`` and writes the
best student with its tokenizer."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import random
from dataclasses import dataclass
from typing import Sequence

from ..checks import check_max_length, model_limit
from ..errors import InputError
from ..inputs import check_index
from ..hardware import training_device
from ..outputs import reads_of
from ..loading import copy_tokenizer
from ..models import BertModel
from ..models.heads import BertForSequenceClassification, BertForTokenClassification
from ..tokenizer import BertTokenizer
from ..tools.encode import encode_texts
from ..tools.surgery import dropout, freeze
from ..training.distill import (TaskDistiller, augment_texts, default_blocks, distill_embeddings, embedding_agreement,
                       init_student, parse_layer_map)
from ..settings import base_of
from ..training.loop import FitConfig, History, epoch_reporter, fit
from ..training.settings import EmbeddingDistillConfig
from .settings import DistillRun
from .skeleton import (begin_fit, check_labels, check_length, finished_history, read_task_data, resolved,
                       run_folder)

log = logging.getLogger(__name__)

#: the k of the top-k overlap the agreement reports
AGREEMENT_K = 10


@dataclass
class CorpusRun:
    history: History
    before: dict  # agreement of the untrained student (the teacher's blocks, copied)
    blocks: list[int]  # the teacher blocks the student started from
    held_out: int  # texts the agreement is measured on
    split: bool  # True: they were held out of ``texts`` (no eval_texts given)
    pooling: str = "mean"  # the sentence vector matched
    normalize: bool = False
    sentence_folder: bool = False  # the teacher's sentence-transformers settings were kept
    trained_on: int = 0  # texts trained on (augmented ones included)


def distill_corpus(run: DistillRun) -> CorpusRun:
    """``minibert distill --texts``: load the teacher, start the student from ``run.student_blocks``
    (default every other), hold 5 % of the texts out when no ``eval_texts`` are given (at least ``2k + 1``:
    the top-k overlap needs more neighbours than k to mean anything), add ``augment`` new texts made from
    the training texts (``augment_texts``, after the held-out split), measure the agreement before, distil,
    and write the best student with the tokenizer to ``run.out``. ``texts`` / ``eval_texts``: a file, one
    text per line, or (in Python) a list. ``freeze_embeddings``: the student keeps the teacher's embeddings
    (``surgery.freeze``): no gradient for the word-embedding matrix, a faster step.

    A teacher that is a sentence-transformers folder gives its pooling and normalisation as the defaults
    (``pooling`` / ``normalize`` None; otherwise mean, not normalised), and the student is written with the
    same folder settings (modules.json, pooling config, max_seq_length), so it embeds as its teacher does.

    ``run.out`` follows the output-folder rule (``outputs.RunFolder``; ``resume``, ``overwrite``)."""
    run.check()
    where = training_device(run.device)  # before any work
    student_dropout = 0.0 if run.student_dropout is None else run.student_dropout
    folder = run_folder(run.out, "distill", reads=reads_of(run), config=run, overwrite=run.overwrite)
    out_dir = folder.path
    texts, eval_texts, split = _corpus_texts(run)
    teacher, tokenizer, sentence, pooling, normalize = _embedding_teacher(run)
    config = dataclasses.replace(base_of(run, EmbeddingDistillConfig), lr=run.learning_rate(), pooling=pooling,
                                 normalize=normalize, student_dropout=student_dropout)
    if run.max_length is not None:
        check_max_length("--max-length", run.max_length, model_limit(teacher.config, tokenizer))
    blocks = run.blocks() or default_blocks(teacher.config.num_hidden_layers)
    teacher.to(where)  # loaded here, so moved in place; the student is cut from it there
    student = init_student(teacher, blocks).train()
    if run.freeze_embeddings:
        freeze(student, embeddings=True)
    layer_map = run.layer_map
    if isinstance(layer_map, str):
        layer_map = parse_layer_map(layer_map, student.config.num_hidden_layers, teacher.config.num_hidden_layers)
    recorded = {"mode": "embeddings", "teacher": resolved(run.teacher), "texts": _texts_hash(texts),
                "eval_texts": _texts_hash(eval_texts), "student_blocks": blocks, "pooling": pooling,
                "normalize": normalize, "similarity_weight": run.similarity_weight, "hidden_weight": run.hidden_weight,
                "attention_weight": run.attention_weight, "layer_map": layer_map, "batch_size": run.batch_size,
                "max_length": run.max_length, "group_by_length": run.group_by_length,
                "student_dropout": student_dropout, "augment": run.augment, "cache_teacher": run.cache_teacher,
                "freeze_embeddings": run.freeze_embeddings, "k": run.k}
    with folder.claim(recorded) as claimed:
        begin_fit(claimed, config)
        if claimed.finished:
            history = finished_history(out_dir, folder.shown)
            kept = claimed.finished_summary("run") or {}
            return CorpusRun(history, kept.get("before", {}), blocks, kept.get("held_out", len(eval_texts)), split,
                             pooling, normalize, sentence is not None, kept.get("trained_on", len(texts)))
        vectors = lambda m: encode_texts(m, tokenizer, eval_texts, pooling=pooling, max_length=run.max_length)  # noqa: E731
        before = embedding_agreement(vectors(teacher), vectors(student), k=run.k)
        history = distill_embeddings(teacher, student, tokenizer, texts, eval_texts=eval_texts, config=config,
                                     layer_map=layer_map, out_dir=out_dir)
        copy_tokenizer(run.teacher, out_dir)
        if sentence is not None:  # the student embeds as its teacher does: the same folder settings
            _keep_sentence_settings(sentence, student, tokenizer, pooling, normalize, out_dir, run.teacher)
        claimed.note(run={"before": before, "held_out": len(eval_texts), "trained_on": len(texts)})
    return CorpusRun(history, before, blocks, len(eval_texts), split, pooling, normalize, sentence is not None,
                     len(texts))


def _corpus_texts(run: DistillRun) -> tuple[list[str], list[str], bool]:
    """(training texts, held-out texts, whether they were held out of the training ones): read, split, said,
    and augmented."""
    from ..textfiles import read_lines

    k = run.k
    check_index("augment (texts to make)", run.augment, 0, 10**9)
    texts = read_lines(run.texts) if isinstance(run.texts, (str, os.PathLike)) else list(run.texts)
    texts = [t for t in texts if t.strip()]
    if not texts:
        raise InputError("no non-empty text to distil on")
    eval_texts = run.eval_texts
    if isinstance(eval_texts, (str, os.PathLike)):
        eval_texts = read_lines(eval_texts)
    split = not eval_texts
    total = len(texts)
    if split:
        texts, eval_texts = split_held_out(texts, seed=run.seed, minimum=2 * k + 1)
    else:
        eval_texts = [t for t in eval_texts if t.strip()]
        if len(eval_texts) < 2 * k + 1:
            raise InputError(f"{len(eval_texts)} non-empty held-out text(s); the top-{k} overlap needs at least "
                             f"{2 * k + 1} (each text's {k} nearest among at least {2 * k} others)")
    log.info(f"agreement measured on {len(eval_texts)} held-out texts"
             + (f", held out of the {total} given ({len(eval_texts) / total:.1%}; 5 % with at least {2 * k + 1} and at "
                f"most 1000; --eval-texts to choose), training on the other {len(texts)}" if split
                else f"; training on {len(texts)} texts"))
    if run.augment:
        texts = texts + augment_texts(texts, run.augment, seed=run.seed)
    return texts, eval_texts, split


def _embedding_teacher(run: DistillRun):
    """(teacher, tokenizer, its sentence-transformers settings or None, pooling, normalize): a
    sentence-transformers folder's pooling and normalisation are the defaults."""
    from ..compat.sentence import SentenceEncoder, is_sentence_folder

    pooling, normalize = run.pooling, run.normalize
    sentence = SentenceEncoder.from_pretrained(run.teacher) if is_sentence_folder(run.teacher) else None
    if sentence is not None:
        if pooling is None and len(sentence.pooling) != 1:
            raise InputError(f"{run.teacher} pools {'+'.join(sentence.pooling)}; distillation matches one pooling "
                             "mode: give pooling (--pool)")
        pooling = sentence.pooling[0] if pooling is None else pooling
        normalize = sentence.normalize if normalize is None else normalize
        teacher, tokenizer = sentence.model.eval(), sentence.tokenizer
    else:
        teacher = BertModel.from_pretrained(run.teacher, mlm_head=False).eval()
        tokenizer = BertTokenizer.from_pretrained(run.teacher)
    tokenizer.check_fits(teacher.config, str(run.teacher))
    return teacher, tokenizer, sentence, pooling or "mean", bool(normalize)


def _keep_sentence_settings(sentence, student, tokenizer, pooling, normalize, out_dir, teacher_source) -> None:
    from ..compat.sentence import SentenceEncoder

    kept = SentenceEncoder(student, tokenizer, pooling=[pooling], normalize=normalize,
                           max_seq_length=sentence.max_seq_length, do_lower_case=sentence.do_lower_case)
    kept.save_settings(out_dir)
    log.info(f"the student keeps {teacher_source}'s sentence-transformers settings: pooling {pooling}"
             f"{', normalized' if normalize else ''}, max_seq_length {sentence.max_seq_length} (modules.json, "
             "1_Pooling/config.json, sentence_bert_config.json written)")


def _texts_hash(texts) -> str:
    """What a list of texts a run was given is, in a record: their count and sha256."""
    import hashlib

    h = hashlib.sha256()
    for t in texts:
        h.update(t.encode("utf-8") + b"\n")
    return f"{len(texts)} texts, sha256 {h.hexdigest()[:16]}"


def split_held_out(texts: Sequence[str], share: float = 0.05, limit: int = 1000, seed: int = 0,
                   minimum: int = 2 * AGREEMENT_K + 1):
    """(train, held): a seeded share of the texts (at least ``minimum``, at most ``limit``) held out for
    agreement; at least as many texts must be left to train on."""
    order = list(range(len(texts)))
    random.Random(seed).shuffle(order)
    n = min(max(limit, minimum), max(minimum, round(share * len(texts))))
    if len(texts) - n < minimum:
        raise InputError(f"{len(texts)} texts are too few to hold {n} out for the agreement and train on the rest "
                         f"(at least {2 * n} are needed); give --eval-texts")
    held = set(order[:n])
    return [t for i, t in enumerate(texts) if i not in held], [texts[i] for i in sorted(held)]


# ------------------------------------------------------------------------------------------------ task
def distill_task(run: DistillRun) -> tuple[History, dict]:
    """Distil a fine-tuned classifier (``task="classify"``) or tagger (``"tag"``) into a student made of
    ``student_blocks`` of its blocks; the student is evaluated after each epoch as ``minibert finetune``
    evaluates (accuracy / entity F1), the best epoch saved in ``run.out`` with the tokenizer. Returns the
    history and the teacher's score on the same evaluation data. ``student_dropout``: as in
    ``distill_embeddings``; None (here the default) keeps the student's own dropout, which regularises a
    classifier trained on few labels."""
    run.check()
    where = training_device(run.device)  # before any work
    task = run.task or "classify"
    config = dataclasses.replace(base_of(run, FitConfig), lr=run.learning_rate())
    temperature = 2.0 if run.temperature is None else run.temperature
    alpha = 0.5 if run.alpha is None else run.alpha
    max_length, student_dropout, teacher_source = run.max_length, run.student_dropout, run.teacher
    folder = run_folder(run.out, "distill", reads={**reads_of(run), "--teacher": teacher_source},
                        config=config, overwrite=run.overwrite)
    out_dir = folder.path
    cls = BertForSequenceClassification if task == "classify" else BertForTokenClassification
    teacher = cls.from_pretrained(teacher_source, device=where).eval()
    tokenizer = BertTokenizer.from_pretrained(teacher_source)
    student_blocks = run.blocks()
    student = init_student(teacher, student_blocks).train()
    layer_map = run.layer_map
    if isinstance(layer_map, str):
        layer_map = parse_layer_map(layer_map, student.config.num_hidden_layers, teacher.config.num_hidden_layers)
    label2id = teacher.config.label2id
    data = read_task_data(task, run.train, run.eval, text_column=run.text_column, pair_column=run.text_pair_column,
                          label_column=run.label_column, tag_column=run.tag_column)
    check_labels(label2id, data.labels("train") + data.labels("held"), "the data",
                 f"the teacher {teacher_source} does not predict")
    check_length(teacher, tokenizer, data, max_length)
    recorded = {"mode": "task", "task": task, "teacher": resolved(teacher_source), "train": resolved(run.train),
                "eval": resolved(run.eval), "student_blocks": list(student_blocks) if student_blocks else None,
                "temperature": temperature, "alpha": alpha, "hidden_weight": run.hidden_weight,
                "attention_weight": run.attention_weight, "layer_map": layer_map, "text_column": run.text_column,
                "pair_column": run.text_pair_column, "label_column": run.label_column, "batch_size": run.batch_size,
                "max_length": max_length, "student_dropout": student_dropout}
    with folder.claim(recorded) as claimed:
        begin_fit(claimed, config)
        if claimed.finished:
            return finished_history(out_dir, folder.shown), claimed.finished_summary("teacher_score") or {}
        batches = data.batches(tokenizer, label2id, batch_size=run.batch_size, max_length=max_length, seed=config.seed)
        score = data.evaluator(tokenizer, max_length=max_length)
        metric = data.metric
        teacher_score = score(teacher)
        log.info(f"teacher ({teacher.config.num_hidden_layers} blocks): "
                 + ", ".join(f"{k} {v:.4f}" for k, v in teacher_score.items()))
        distiller = TaskDistiller(teacher, student, temperature=temperature, alpha=alpha,
                                  hidden_weight=run.hidden_weight, attention_weight=run.attention_weight,
                                  layer_map=layer_map)
        with contextlib.nullcontext() if student_dropout is None else dropout(student, student_dropout):
            history = fit(distiller, batches, config=config, evaluate=lambda m: score(m.student), metric=metric,
                          out_dir=out_dir, on_epoch_end=epoch_reporter(config.epochs, loss_digits=5))
        copy_tokenizer(teacher_source, out_dir)
        claimed.note(teacher_score=teacher_score)
    return history, teacher_score
