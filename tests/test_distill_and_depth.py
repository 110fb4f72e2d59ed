"""Issue 14: distillation into a shallower student, LayerDrop, early exit (tiny geometries, few steps;
the full MiniLM runs are in benchmarks/bench_distill.py)."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import re
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from conftest import usage_error, cli_error, hf_config, random_hf_model
from minibert import BertForSequenceClassification, BertModel, BertTokenizer, InputError
from minibert.training import depth, distill
from minibert.runs import distill as distill_pipeline
from minibert.training.data import classification_batches
from minibert.training.loop import FitConfig, fit
from minibert.training.settings import EmbeddingDistillConfig
from minibert.tools.encode import encode_texts
from minibert.runs.settings import DistillRun

TINY = dict(vocab_size=30522, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, intermediate_size=64,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
GOOD = ["good", "great", "fine", "nice", "happy"]
BAD = ["bad", "awful", "poor", "sad", "terrible"]


def toy(n=64, seed=0):
    import random

    rng = random.Random(seed)
    texts, labels = [], []
    for i in range(n):
        word = rng.choice(GOOD if i % 2 == 0 else BAD)
        texts.append(f"the {rng.choice(['day', 'meal', 'trip'])} was {word} and {rng.choice(['long', 'short'])}")
        labels.append("pos" if i % 2 == 0 else "neg")
    return texts, labels


@pytest.fixture(scope="module")
def tiny_encoder_dir(tmp_path_factory, minilm_dir):
    directory = tmp_path_factory.mktemp("tiny_encoder")
    random_hf_model(hf_config(**TINY), seed=5).save_pretrained(directory)
    shutil.copy(minilm_dir / "vocab.txt", directory / "vocab.txt")
    return directory


@pytest.fixture(scope="module")
def tiny_teacher_dir(tmp_path_factory, tiny_encoder_dir):
    """A 4-block classifier fine-tuned on the toy task (it learns it), saved with its tokenizer."""
    directory = tmp_path_factory.mktemp("tiny_teacher")
    tok = BertTokenizer.from_pretrained(tiny_encoder_dir)
    texts, labels = toy(64)
    model = BertForSequenceClassification.from_encoder(tiny_encoder_dir, labels=["neg", "pos"], seed=0)
    batches = classification_batches(tok, texts, [["neg", "pos"].index(y) for y in labels], batch_size=8,
                                     max_length=16)
    fit(model, batches, config=FitConfig(epochs=8, lr=3e-3, progress=False))
    model.save_pretrained(directory)
    shutil.copy(tiny_encoder_dir / "vocab.txt", directory / "vocab.txt")
    predicted = [p["label"] for p in model.predict(texts, tokenizer=tok)]
    assert sum(p == y for p, y in zip(predicted, labels)) / len(labels) >= 0.9  # the teacher knows the task
    return directory


# ------------------------------------------------------------------------------------------ students
def test_student_is_the_teacher_with_blocks_skipped(tiny_encoder_dir):
    teacher = BertModel.from_pretrained(tiny_encoder_dir).eval()
    assert distill.default_blocks(4) == [0, 2] and distill.default_blocks(12) == [0, 2, 4, 6, 8, 10]
    student = distill.init_student(teacher).eval()
    assert student.config.num_hidden_layers == 2 and teacher.config.num_hidden_layers == 4
    batch = BertTokenizer.from_pretrained(tiny_encoder_dir)(["a river bank", "no"], padding=True, return_tensors="pt")
    with torch.no_grad():
        want = teacher(**batch, skip_blocks=[1, 3]).last_hidden_state  # blocks 0 and 2 in a row
        got = student(**batch).last_hidden_state
    assert torch.equal(got, want)
    with torch.no_grad():  # real copies: training the student never changes the teacher
        student.encoder.blocks[0].attn.query.weight.add_(1.0)
    assert not torch.equal(teacher.encoder.blocks[0].attn.query.weight, student.encoder.blocks[0].attn.query.weight)
    with pytest.raises(InputError, match="student blocks"):
        distill.init_student(teacher, [0, 4])


def test_task_student_copies_head_and_pooler(tiny_teacher_dir):
    teacher = BertForSequenceClassification.from_pretrained(tiny_teacher_dir)
    student = distill.init_student(teacher, [1, 3])
    assert type(student) is BertForSequenceClassification and student.config.num_hidden_layers == 2
    assert student.config.id2label == teacher.config.id2label
    assert torch.equal(student.classifier.weight, teacher.classifier.weight)
    assert student.classifier.weight.data_ptr() != teacher.classifier.weight.data_ptr()
    assert torch.equal(student.bert.encoder.blocks[0].ffn.dense_in.weight, teacher.bert.encoder.blocks[1].ffn.dense_in.weight)


def test_layer_maps():
    assert distill.uniform_layer_map(3, 6) == {1: 2, 2: 4, 3: 6}
    assert distill.uniform_layer_map(6, 12) == {i: 2 * i for i in range(1, 7)}
    assert distill.uniform_layer_map(4, 6) == {1: 2, 2: 3, 3: 4, 4: 6}  # rounded; the last on the last
    assert distill.parse_layer_map("0:0,1:2, 3:6", 3, 6) == {0: 0, 1: 2, 3: 6}
    assert distill.parse_layer_map("uniform", 3, 6) == {1: 2, 2: 4, 3: 6}
    for bad, message in (("1:7", "teacher hidden state"), ("4:2", "student hidden state"), ("1-2", "student:teacher"),
                         ("1:2,1:3", "twice")):
        with pytest.raises(InputError, match=message):
            distill.parse_layer_map(bad, 3, 6)


# -------------------------------------------------------------------------------------------- losses
def test_soft_target_loss_is_the_tempered_kl_times_t_squared():
    torch.manual_seed(0)
    s, t = torch.randn(5, 4), torch.randn(5, 4)
    for T in (1.0, 2.0, 4.0):
        p_t = (t / T).softmax(-1)
        want = (p_t * (p_t.log() - (s / T).log_softmax(-1))).sum(-1).mean() * T * T
        assert torch.allclose(distill.soft_target_loss(s, t, T), want, atol=1e-6)
        assert float(distill.soft_target_loss(t, t, T)) == pytest.approx(0.0, abs=1e-6)


def test_similarity_loss_compares_every_pair_of_cosines():
    torch.manual_seed(3)
    a, b = torch.randn(6, 8), torch.randn(6, 8)
    want = torch.stack([(F.cosine_similarity(a[i], a[j], dim=0) - F.cosine_similarity(b[i], b[j], dim=0)) ** 2
                        for i in range(6) for j in range(i + 1, 6)]).mean()
    assert torch.allclose(distill.similarity_loss(a, b), want, atol=1e-6)
    assert float(distill.similarity_loss(a, 2 * a)) == pytest.approx(0.0, abs=1e-10)  # cosines ignore scale
    assert float(distill.similarity_loss(a[:1], b[:1])) == 0.0  # one text: no pair


def test_inside_losses_ignore_padding_and_vanish_on_equal_inputs(tiny_encoder_dir):
    model = BertModel.from_pretrained(tiny_encoder_dir).eval()
    tok = BertTokenizer.from_pretrained(tiny_encoder_dir)
    batch = tok(["a river bank in spring", "no"], padding=True, return_tensors="pt")
    other = {k: v.clone() for k, v in batch.items()}
    other["input_ids"][1, 3:] = 1000  # different token ids at padded positions: masked, must not count
    with torch.no_grad():
        a = model(**batch, output_attentions=True)
        b = model(**other, output_attentions=True)
        c = distill.init_student(model, [1, 2, 3, 0]).eval()(**batch, output_attentions=True)
    mapping = {1: 1, 2: 2, 4: 4}
    mask = batch["attention_mask"]
    assert float(distill.hidden_state_loss(a.hidden_states, b.hidden_states, mapping, mask)) == pytest.approx(0, abs=1e-12)
    assert float(distill.attention_loss(a.attentions, b.attentions, mapping, mask)) == pytest.approx(0, abs=1e-6)
    assert float(distill.hidden_state_loss(c.hidden_states, a.hidden_states, mapping, mask)) > 1e-3
    assert float(distill.attention_loss(c.attentions, a.attentions, mapping, mask)) > 1e-4
    with pytest.raises(InputError, match="block output"):
        distill.attention_loss(a.attentions, b.attentions, {0: 0}, mask)


def test_embedding_agreement_against_scipy():
    scipy_stats = pytest.importorskip("scipy.stats")
    torch.manual_seed(1)
    a = torch.randn(40, 16)
    b = a + 0.5 * torch.randn(40, 16)
    got = distill.embedding_agreement(a, b, k=5)
    an, bn = F.normalize(a, dim=-1), F.normalize(b, dim=-1)
    iu = torch.triu_indices(40, 40, 1)
    x, y = (an @ an.T)[iu[0], iu[1]], (bn @ bn.T)[iu[0], iu[1]]
    assert got["spearman"] == pytest.approx(scipy_stats.spearmanr(x.numpy(), y.numpy()).statistic, abs=1e-6)
    same = distill.embedding_agreement(a, 3 * a, k=5)  # scale does not matter to cosines
    assert same["spearman"] == pytest.approx(1.0) and same["top_k_overlap"] == 1.0
    assert 0 < got["top_k_overlap"] < 1
    with pytest.raises(InputError, match="k"):
        distill.embedding_agreement(a, b, k=40)


# ------------------------------------------------------------------------------------- distillation
def test_embedding_distillation_moves_the_student_towards_the_teacher(minilm_dir, sentences_dir, tmp_path):
    """MiniLM 6 -> 3 blocks on 256 real sentences (the full run: benchmarks/bench_distill.py)."""
    teacher = BertModel.from_pretrained(minilm_dir, mlm_head=False).eval()
    tok = BertTokenizer.from_pretrained(minilm_dir)
    texts = (sentences_dir / "train.txt").read_text(encoding="utf-8").split("\n")[:256]
    held = (sentences_dir / "held.txt").read_text(encoding="utf-8").split("\n")[:60]
    student = distill.init_student(teacher, [0, 2, 4]).train()
    teacher_weights = {k: v.clone() for k, v in teacher.state_dict().items()}
    before = distill.embedding_agreement(encode_texts(teacher, tok, held), encode_texts(student, tok, held))
    rates = []  # the dropout rate the student trains with (off by default), seen from inside its forward pass
    hook = student.encoder.blocks[0].dropout.register_forward_pre_hook(
        lambda module, args: rates.append((module.p, module.training)))
    history = distill.distill_embeddings(teacher, student, tok, texts, eval_texts=held, out_dir=tmp_path / "s",
                                         config=EmbeddingDistillConfig(epochs=2, lr=3e-4, progress=False,
                                                                       normalize=True, batch_size=16, max_length=48))
    hook.remove()
    assert {p for p, training in rates if training} == {0.0}
    assert student.encoder.blocks[0].dropout.p == 0.1 and student.config.hidden_dropout_prob == 0.1  # its own again
    assert history.epochs[-1]["train_loss"] < history.epochs[0]["train_loss"]
    best = history.epochs[history.best_epoch - 1]["eval"]
    assert best["spearman"] > before["spearman"] + 0.05
    saved = BertModel.from_pretrained(tmp_path / "s")
    assert saved.config.num_hidden_layers == 3
    assert all(p.requires_grad for p in student.parameters())
    # the teacher is run under no_grad: its weights and its requires_grad flags are left as they were, so a
    # second student cut from it trains too (a frozen teacher once gave frozen students)
    assert all(torch.equal(v, teacher_weights[k]) for k, v in teacher.state_dict().items())
    assert all(p.requires_grad for p in teacher.parameters())
    teacher.requires_grad_(False)
    assert all(p.requires_grad for p in distill.init_student(teacher, [1, 3]).parameters())


def test_cached_teacher_vectors_train_the_same_student_without_running_the_teacher(tiny_encoder_dir,
                                                                                   monkeypatch):
    teacher = BertModel.from_pretrained(tiny_encoder_dir).eval()
    tok = BertTokenizer.from_pretrained(tiny_encoder_dir)
    texts, _ = toy(40, seed=3)
    texts = [t + " " + "again " * (i % 7) for i, t in enumerate(texts)]  # lengths differ: padded batches
    calls = []
    real = distill.full_precision
    monkeypatch.setattr(distill, "full_precision", lambda *a, **k: calls.append(1) or real(*a, **k))
    students = {}
    for cache in (False, True):
        calls.clear()
        student = distill.init_student(teacher, [0, 3]).train()
        distill.distill_embeddings(teacher, student, tok, texts,
                                   config=EmbeddingDistillConfig(epochs=2, lr=1e-3, progress=False, normalize=True,
                                                                 cache_teacher=cache, group_by_length=True,
                                                                 batch_size=8, max_length=24))
        students[cache] = student
        assert len(calls) == (0 if cache else 2 * 5)  # 5 batches an epoch, each ran the teacher
    plain, cached = ({k: v.detach() for k, v in students[c].named_parameters()} for c in (False, True))
    start = {k: v.detach() for k, v in distill.init_student(teacher, [0, 3]).named_parameters()}
    moved = torch.cat([(plain[k] - start[k]).flatten() for k in plain]).norm()
    apart = torch.cat([(plain[k] - cached[k]).flatten() for k in plain]).norm()
    assert moved > 0.1 and apart < 1e-3 * moved  # the same targets (up to rounding): the same training
    # each row of a batch carries its own text's vector (here: vector i is all i)
    targets = torch.arange(len(texts), dtype=torch.float32)[:, None].repeat(1, 32)
    for batch in distill.text_batches(tok, texts, batch_size=8, group_by_length=True, targets=targets)(1):
        assert batch["teacher_vectors"].shape == (len(batch["input_ids"]), 32)
        for ids, mask, vector in zip(batch["input_ids"], batch["attention_mask"], batch["teacher_vectors"]):
            assert torch.equal(vector, targets[int(vector[0])])
            assert ids[mask.bool()].tolist() == tok(texts[int(vector[0])])["input_ids"]
    with pytest.raises(InputError, match="targets: 3 vectors for 40 texts"):
        distill.text_batches(tok, texts, targets=targets[:3])
    with pytest.raises(InputError, match="cache_teacher keeps only the teacher's pooled vectors"):
        distill.distill_embeddings(teacher, distill.init_student(teacher, [0, 3]), tok, texts,
                                   config=EmbeddingDistillConfig(cache_teacher=True, hidden_weight=0.1))


def test_the_teacher_stays_fp32_when_the_student_trains_in_bf16(tiny_encoder_dir):
    teacher = BertModel.from_pretrained(tiny_encoder_dir).eval()
    student = distill.init_student(teacher, [0, 3])
    tok = BertTokenizer.from_pretrained(tiny_encoder_dir)
    batch = dict(tok(["the river bank was muddy", "rates rose"], padding=True, return_tensors="pt"))
    dtypes = {"teacher": [], "student": []}
    hooks = [model.encoder.blocks[0].attn.query.register_forward_hook(
        lambda module, args, out, who=who: dtypes[who].append(out.dtype))
        for who, model in (("teacher", teacher), ("student", student))]
    distiller = distill.EmbeddingDistiller(teacher, student, attention_weight=0.1)  # the readable teacher (maps)
    fast_teacher = distiller._fast_teacher  # the one that runs without attention terms
    with torch.no_grad():
        expected = fast_teacher(batch["input_ids"], batch["attention_mask"]).last_hidden_state
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = distill.full_precision(fast_teacher, batch["input_ids"], batch["attention_mask"]).last_hidden_state
        loss = distiller(**batch).loss
    for hook in hooks:
        hook.remove()
    assert got.dtype == torch.float32 and torch.equal(got, expected)
    # autocast reached the student only (torch hooks fire on the teacher's fast path too: it steps aside for them)
    assert dtypes["teacher"] and set(dtypes["teacher"]) == {torch.float32} and dtypes["student"] == [torch.bfloat16]
    assert loss.dtype == torch.float32 and torch.isfinite(loss)


def test_length_grouped_batches_cover_every_text_once_with_less_padding(minilm_dir, sentences_dir):
    from minibert.training.data import LENGTH_POOL, _epoch_rows

    tok = BertTokenizer.from_pretrained(minilm_dir)
    texts = (sentences_dir / "train.txt").read_text(encoding="utf-8").split("\n")[:1500]
    lengths = [len(x) for x in tok(texts, truncation=True, max_length=64)["input_ids"]]

    def padded(batches):  # tokens computed = rows x longest, over the epoch
        return sum(len(rows) * max(lengths[i] for i in rows) for rows in batches)

    plain = list(_epoch_rows(len(texts), 16, True, 0))
    grouped = list(_epoch_rows(len(texts), 16, True, 0, lengths))
    assert sorted(i for rows in grouped for i in rows) == list(range(len(texts)))  # each text once
    assert sum(len(rows) != 16 for rows in grouped) <= math.ceil(len(texts) / (16 * LENGTH_POOL))  # one per pool
    assert padded(grouped) < 0.8 * padded(plain) and sum(lengths) <= padded(grouped)
    assert grouped == list(_epoch_rows(len(texts), 16, True, 0, lengths))  # seeded
    assert grouped != list(_epoch_rows(len(texts), 16, True, 1, lengths))  # another epoch, another order
    # the batches themselves: what the tokeniser pads for those rows (the texts are tokenised once, up front)
    few = texts[:40]
    few_lengths = [len(x) for x in tok(few, truncation=True, max_length=64)["input_ids"]]
    made = list(distill.text_batches(tok, few, batch_size=8, max_length=64, seed=3, group_by_length=True)(0))
    for rows, batch in zip(_epoch_rows(len(few), 8, True, 3, few_lengths), made, strict=True):
        want = tok([few[i] for i in rows], padding=True, truncation=True, max_length=64, return_tensors="pt")
        assert all(torch.equal(want[k], batch[k]) for k in ("input_ids", "attention_mask", "token_type_ids"))


def _made_from(text: str, sources: list[list[str]]) -> str:
    """Which kind of augment_texts' new text this is: a crop, a dropout, a pair (or '' if none)."""
    words = text.split()
    for src in sources:
        if any(src[i:i + len(words)] == words for i in range(len(src) - len(words) + 1)):
            return "crop" if len(words) < len(src) else "whole"  # a dropout that happened to drop nothing
    for a in sources:
        if words[:len(a)] == a and words[len(a):] in sources:
            return "pair"
    for src in sources:  # an ordered subsequence of one text
        rest = iter(src)
        if len(words) < len(src) and all(w in rest for w in words):
            return "dropout"
    return ""


def test_augmented_texts_are_crops_pairs_and_dropouts_of_the_given_ones():
    texts = [f"w{i}a w{i}b w{i}c w{i}d w{i}e w{i}f w{i}g w{i}h" for i in range(30)] + ["solo"]
    sources = [t.split() for t in texts]
    made = distill.augment_texts(texts + ["", "  "], 300, seed=4)
    assert len(made) == 300 and made == distill.augment_texts(texts + ["", "  "], 300, seed=4)
    assert made != distill.augment_texts(texts, 300, seed=5)
    kinds = [_made_from(t, sources) for t in made]
    assert "" not in kinds, [t for t, k in zip(made, kinds) if not k][:3]
    counts = {k: kinds.count(k) for k in set(kinds)}
    assert counts["crop"] > 60 and counts["pair"] > 60 and counts["dropout"] + counts["whole"] > 60, counts
    assert counts["whole"] < counts["dropout"]  # 8 words each kept with 0.85: nothing dropped in 27 %
    assert all(len(t.split()) >= 3 for t, k in zip(made, kinds) if k == "crop")
    # texts too short to crop or thin become pairs
    assert {_made_from(t, [["solo"]]) for t in distill.augment_texts(["solo"], 9)} == {"pair"}
    assert distill.augment_texts(texts, 0) == []
    with pytest.raises(InputError, match="no non-empty text"):
        distill.augment_texts(["", " "], 5)
    with pytest.raises(InputError, match=re.escape("n (texts to make)")):
        distill.augment_texts(texts, -1)
    with pytest.raises(InputError, match=re.escape("drop must be in [0, 1), got 1.0")):
        distill.augment_texts(texts, 5, drop=1.0)


def test_distill_corpus_augments_after_holding_out(tiny_encoder_dir, tmp_path, monkeypatch):
    seen = {}

    def record(teacher, student, tokenizer, texts, *, eval_texts, **kwargs):
        seen["train"], seen["held"] = list(texts), list(eval_texts)
    monkeypatch.setattr(distill_pipeline, "distill_embeddings", record)
    texts = [f"sentence {i} tells of the river bank and the boat" for i in range(60)]
    distill_pipeline.distill_corpus(DistillRun(teacher=tiny_encoder_dir, texts=texts, out=tmp_path / "s",
                                               student_blocks=[0, 2], augment=50))
    held = set(seen["held"])  # 5 % of 60, raised to 21: the top-10 overlap needs 20 others per text
    assert len(held) == 21 and len(seen["train"]) == 39 + 50
    plain = seen["train"][:39]
    assert set(plain) == set(texts) - held
    made_words = {w for t in seen["train"][39:] for w in t.split()}
    assert not made_words & {t.split()[1] for t in held}  # nothing made from a held-out sentence
    with pytest.raises(InputError, match="augment"):
        distill_pipeline.distill_corpus(DistillRun(teacher=tiny_encoder_dir, texts=texts, out=tmp_path / "s", augment=-3))


def test_task_distillation_learns_the_teachers_answers(tiny_teacher_dir, tmp_path):
    texts, labels = toy(64, seed=1)
    path = tmp_path / "train.csv"
    path.write_text("text,label\n" + "\n".join(f"{t},{y}" for t, y in zip(texts, labels)) + "\n")
    history, teacher_score = distill_pipeline.distill_task(DistillRun(
        train=path, eval=path, teacher=tiny_teacher_dir, out=tmp_path / "student", student_blocks=[3], temperature=2.0,
        alpha=0.7, hidden_weight=0.5, attention_weight=0.5, layer_map="1:4", epochs=4, lr=3e-3, progress=False,
        batch_size=8, max_length=16))
    assert teacher_score["accuracy"] >= 0.9
    assert history.best_metric >= 0.9 * teacher_score["accuracy"]
    student = BertForSequenceClassification.from_pretrained(tmp_path / "student")
    assert student.config.num_hidden_layers == 1 and (tmp_path / "student" / "vocab.txt").exists()
    with pytest.raises(InputError, match="label"):
        bad = tmp_path / "bad.csv"
        bad.write_text("text,label\nhello,other\nbye,pos\n")
        distill_pipeline.distill_task(DistillRun(train=bad, eval=bad, teacher=tiny_teacher_dir, out=tmp_path / "x"))


def test_distillers_refuse_what_cannot_be_matched(tiny_encoder_dir, tiny_teacher_dir):
    teacher = BertModel.from_pretrained(tiny_encoder_dir)
    wide = BertModel(hf_like(hidden_size=64, num_attention_heads=4))
    with pytest.raises(InputError, match="same width"):
        distill.EmbeddingDistiller(teacher, wide, hidden_weight=1.0)
    distill.EmbeddingDistiller(teacher, wide)  # pooled vectors of another width cannot be compared either...
    with pytest.raises(InputError, match="pooling"):
        distill.EmbeddingDistiller(teacher, distill.init_student(teacher), pooling="sum")
    clf = BertForSequenceClassification.from_pretrained(tiny_teacher_dir)
    for kwargs, message in (({"temperature": 0}, "temperature"), ({"alpha": 1.5}, "alpha")):
        with pytest.raises(InputError, match=message):
            distill.TaskDistiller(clf, distill.init_student(clf), **kwargs)


def hf_like(**overrides):
    from minibert import BertConfig

    values = {k: v for k, v in TINY.items()}
    values.update(overrides)
    return BertConfig(**values)


def test_distill_cli_both_modes(tiny_encoder_dir, tiny_teacher_dir, tmp_path, capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(f"sentence number {i} is about the {w}" for i in range(60)
                                for w in ("bank",)) + "\n")
    run = [sys.executable, "-m", "minibert"]
    out = subprocess.run(run + ["distill", "--teacher", str(tiny_encoder_dir), "--texts", str(corpus), "--out",
                                str(tmp_path / "emb"), "--student-blocks", "1,3", "--epochs", "1", "--quiet",
                                "--augment", "20", "--cache-teacher", "--bf16", "--freeze-embeddings"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "agreement with the teacher on 21 held-out texts" in out.stdout and "blocks [1, 3] of" in out.stdout
    assert "trained on 59 texts" in out.stdout  # the 39 not held out + 20 made from them
    student, teacher = BertModel.from_pretrained(tmp_path / "emb"), BertModel.from_pretrained(tiny_encoder_dir)
    assert student.config.num_hidden_layers == 2
    assert torch.equal(student.embeddings.word.weight, teacher.embeddings.word.weight)  # frozen: the teacher's
    assert not torch.equal(student.encoder.blocks[0].attn.query.weight, teacher.encoder.blocks[1].attn.query.weight)
    texts, labels = toy(32, seed=2)
    data = tmp_path / "d.csv"
    data.write_text("text,label\n" + "\n".join(f"{t},{y}" for t, y in zip(texts, labels)) + "\n")
    out = subprocess.run(run + ["distill", "--teacher", str(tiny_teacher_dir), "--train", str(data), "--eval",
                                str(data), "--out", str(tmp_path / "task"), "--epochs", "1", "--quiet"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "of it); wrote" in out.stdout and "(teacher " in out.stdout
    for argv, message in ((["--texts", str(corpus), "--train", str(data)], "exclude each other"),
                          ([], "give --texts"), (["--train", str(data)], "needs --eval"),
                          (["--texts", str(corpus), "--student-blocks", "0,x"], "--student-blocks"),
                          (["--texts", str(corpus), "--student-blocks", "0,9"], "student blocks"),
                          (["--train", str(data), "--eval", str(data), "--group-by-length"], "embedding mode"),
                          (["--train", str(data), "--eval", str(data), "--augment", "5"], "--augment is for"),
                          (["--texts", str(corpus), "--augment", "-1"], "augment (texts to make)"),
                          (["--train", str(data), "--eval", str(data), "--cache-teacher"], "--cache-teacher is for"),
                          (["--train", str(data), "--eval", str(data), "--freeze-embeddings"],
                           "--freeze-embeddings is for"),
                          (["--texts", str(corpus), "--cache-teacher", "--hidden-weight", "1"],
                           "cache_teacher keeps only")):
        line = cli_error(capsys, "distill", "--teacher", tiny_encoder_dir, "--out", tmp_path / "e", "--quiet", *argv)
        assert message in line, (argv, line)
    for argv, message in ((["--texts", str(corpus), "--student-dropout", "1"], "--student-dropout: must be in [0, 1)"),
                          (["--texts", str(corpus), "--seed", "-1"], "--seed: must be in [0, 2**32 - 1], got -1"),
                          (["--texts", str(corpus), "--max-length", "2"], "--max-length: must be >= 3")):
        assert message in usage_error(capsys, "distill", "--teacher", tiny_encoder_dir, "--out", tmp_path / "e", *argv)
    for argv, flag in ((["--temperature", "3"], "--temperature"), (["--alpha", "0.2"], "--alpha"),
                       (["--task", "tag"], "--task")):  # task mode's options, refused in embedding mode
        line = cli_error(capsys, "distill", "--teacher", tiny_encoder_dir, "--out", tmp_path / "e", "--texts", corpus, *argv)
        assert f"{flag} is for task mode" in line
    assert not (tmp_path / "e").exists()  # each refused before any work


# ------------------------------------------------------------------------------------------ LayerDrop
def test_layerdrop_skips_blocks_while_training_only(tiny_teacher_dir):
    model = BertForSequenceClassification.from_pretrained(tiny_teacher_dir)
    batch = dict(BertTokenizer.from_pretrained(tiny_teacher_dir)(["the day was good", "bad"], padding=True,
                                                                  return_tensors="pt"))
    with torch.no_grad():
        plain = model(**batch).logits
    drop = depth.LayerDrop(model, 0.5, seed=3)
    with torch.no_grad():
        assert torch.equal(model(**batch).logits, plain)  # eval mode: no effect
        model.train()
        seen = []
        for _ in range(200):
            logits = model(**batch).logits
            skipped = drop.dropped[-1]
            seen.append(skipped)
        model.eval()
        want = model.classifier(model.bert(**batch, skip_blocks=skipped).pooler_output)
    assert torch.equal(logits, want)  # the last pass really skipped what it recorded
    assert all(len(s) < 4 for s in seen)  # at least one block always runs
    share = sum(len(s) for s in seen) / (4 * len(seen))
    assert 0.4 < share < 0.6
    drop.remove()
    model.train()
    with torch.no_grad():
        model(**batch)
    assert len(drop.dropped) == 200  # removed: no more draws
    again = depth.LayerDrop(model, 0.5, seed=3)
    with torch.no_grad():
        for _ in range(200):
            model(**batch)
    assert again.dropped == seen  # the same seed, the same draws
    again.remove()
    with pytest.raises(InputError, match=r"\[0, 1\)"):
        depth.LayerDrop(model, 1.0)


def test_spread_blocks_keeps_the_top_block():
    assert depth.spread_blocks(6, 3) == [1, 3, 5]
    assert depth.spread_blocks(6, 6) == list(range(6))
    assert depth.spread_blocks(6, 1) == [5]
    assert depth.spread_blocks(12, 4) == [2, 5, 8, 11]
    with pytest.raises(InputError, match="keep"):
        depth.spread_blocks(6, 7)


def test_finetune_with_layerdrop_writes_a_prunable_model(tiny_encoder_dir, tmp_path):
    from minibert.runs.finetune import finetune
    from minibert.runs.settings import FinetuneRun

    texts, labels = toy(32, seed=4)
    data = tmp_path / "d.csv"
    data.write_text("text,label\n" + "\n".join(f"{t},{y}" for t, y in zip(texts, labels)) + "\n")
    history = finetune(FinetuneRun(train=data, eval=data, model=tiny_encoder_dir, out=tmp_path / "ld", layerdrop=0.3,
                                   epochs=1, lr=1e-3, progress=False, max_length=16))
    model = BertForSequenceClassification.from_pretrained(tmp_path / "ld")
    assert not model.bert._forward_pre_hooks  # the LayerDrop hook is gone from the saved model's source
    assert history.best_metric is not None
    with pytest.raises(InputError, match="scalarmix"):
        finetune(FinetuneRun(train=data, eval=data, model=tiny_encoder_dir, out=tmp_path / "x", layerdrop=0.3,
                             recipe="scalarmix"))


# ------------------------------------------------------------------------------------------ early exit
def early_exit_model(tiny_teacher_dir, frozen=True):
    model = BertForSequenceClassification.from_pretrained(tiny_teacher_dir)
    ee = depth.EarlyExit(model, frozen=frozen).eval()
    torch.manual_seed(0)
    with torch.no_grad():  # make the exits disagree and differ in confidence, as trained ones do
        for ramp in ee.ramps:
            ramp[0].weight.normal_(0, 0.5)
            ramp[3].weight.normal_(0, 2.0)
    return ee


def test_each_row_gets_the_logits_of_the_exit_it_took(tiny_teacher_dir):
    ee = early_exit_model(tiny_teacher_dir)
    tok = BertTokenizer.from_pretrained(tiny_teacher_dir)
    texts, _ = toy(12, seed=5)
    texts[3] = "bad"  # rows of different lengths: padding in the batch
    batch = tok(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        every = ee(**batch).logits  # (4 exits, B, C), readable path, nobody leaves
        plain = ee.model(**batch).logits
    assert torch.equal(every[-1], plain)  # the last exit is the model itself
    B = len(texts)
    seen_exits = set()
    rules = [{"entropy": e} for e in depth.entropy_thresholds(2, 12)] + [{"patience": k} for k in (1, 2, 3, 4)]
    for rule in rules:
        out = ee.predict_batch(batch["input_ids"], batch["attention_mask"], **rule)
        want = every[out.exits, torch.arange(B)]
        assert (out.logits - want).abs().max() <= 1e-5, rule  # fast path vs readable path, per row
        seen_exits |= set(out.exits.tolist())
        if rule.get("entropy") is not None:  # a row exits at the first exit below the threshold
            p = every.softmax(-1)
            entropy = -(torch.xlogy(p, p)).sum(-1)  # (exits, B)
            for row, e in enumerate(out.exits.tolist()):
                below = (entropy[:, row] < rule["entropy"]).nonzero().flatten().tolist()
                assert e == (below[0] if below else 3)
    assert seen_exits == {0, 1, 2, 3}  # the rules really spread rows over the depths
    never = ee.predict_batch(batch["input_ids"], batch["attention_mask"], entropy=0.0)
    assert never.exits.tolist() == [3] * B and never.blocks_run == 4
    always = ee.predict_batch(batch["input_ids"], batch["attention_mask"], entropy=math.log(2) + 1e-6)
    assert always.exits.tolist() == [0] * B and always.blocks_run == 1
    one = ee.predict_batch(batch["input_ids"], batch["attention_mask"], patience=1)
    assert one.exits.tolist() == [0] * B
    with pytest.raises(InputError, match="exactly one"):
        ee.predict_batch(batch["input_ids"], entropy=0.1, patience=2)
    with pytest.raises(InputError, match="patience"):
        ee.predict_batch(batch["input_ids"], patience=5)


def test_exits_train_frozen_or_joint_and_round_trip(tiny_teacher_dir, tmp_path):
    tok = BertTokenizer.from_pretrained(tiny_teacher_dir)
    texts, labels = toy(48, seed=6)
    ids = [["neg", "pos"].index(y) for y in labels]
    batches = classification_batches(tok, texts, ids, batch_size=8, max_length=16)
    frozen = depth.EarlyExit(BertForSequenceClassification.from_pretrained(tiny_teacher_dir))
    encoder_before = {k: v.clone() for k, v in frozen.model.state_dict().items()}
    before = depth.exit_accuracies(frozen, tok, texts, labels)
    fit(frozen, batches, config=FitConfig(epochs=4, lr=3e-3, progress=False))
    after = depth.exit_accuracies(frozen, tok, texts, labels)
    assert all(torch.equal(v, frozen.model.state_dict()[k]) for k, v in encoder_before.items())  # frozen: unchanged
    assert after[-1] == before[-1] and min(after[:-1]) >= 0.9
    frozen.save_pretrained(tmp_path / "ee")
    loaded = depth.EarlyExit.from_pretrained(tmp_path / "ee")
    batch = tok(texts[:5], padding=True, return_tensors="pt")
    with torch.no_grad():
        assert torch.equal(loaded(**batch).logits, frozen.eval()(**batch).logits)
    labels_out, exits = loaded.predict(texts, tokenizer=tok, entropy=0.3)
    assert len(labels_out) == len(texts) and all(0 <= e <= 3 for e in exits)
    joint = depth.EarlyExit(BertForSequenceClassification.from_pretrained(tiny_teacher_dir), frozen=False).train()
    out = joint(**batch, labels=torch.tensor(ids[:5]))
    losses = torch.stack([F.cross_entropy(z, torch.tensor(ids[:5])) for z in out.logits])
    assert torch.allclose(out.loss, (torch.arange(1.0, 5.0) * losses).sum() / 10)  # PABEE's weights 1..N
    assert any(p.requires_grad for p in joint.model.parameters())
    with pytest.raises(InputError, match="plain classifier"):
        depth.EarlyExit.from_pretrained(tiny_teacher_dir)


def test_exits_cli_prints_the_curve(tiny_teacher_dir, tmp_path):
    texts, labels = toy(32, seed=7)
    data = tmp_path / "d.csv"
    data.write_text("text,label\n" + "\n".join(f"{t},{y}" for t, y in zip(texts, labels)) + "\n")
    out = subprocess.run([sys.executable, "-m", "minibert", "exits", "--model", str(tiny_teacher_dir), "--train",
                          str(data), "--eval", str(data), "--out", str(tmp_path / "ee"), "--epochs", "1", "--quiet"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "| full model |" in out.stdout and "| patience 4 |" in out.stdout and "entropy < 0.693" in out.stdout
    saved = json.loads((tmp_path / "ee" / "exits.json").read_text())
    assert len(saved["exit_accuracy"]) == 4
    full = next(r for r in saved["curve"] if r["rule"] == "full model")
    last = next(r for r in saved["curve"] if r["rule"] == "entropy" and r["value"] == 0)
    assert last["accuracy"] == full["accuracy"] and last["blocks"] == 4.0


# ------------------------------------------------------------------------- what a new user found
def test_distill_says_the_true_counts_and_refuses_too_few_texts_for_its_metric(tiny_encoder_dir, tmp_path, caplog):
    """5 texts used to give "holding out 5 %" while 3 were held out, and a top-10 overlap on 3 texts. The
    held-out share is at least 2k + 1 texts (each text's k nearest among 2k others), at least as many are
    left to train on, and the log says the true counts."""
    texts = [f"sentence {i} tells of the river bank and the boat" for i in range(5)]
    with pytest.raises(InputError, match=r"5 texts are too few to hold 21 out .* give --eval-texts"):
        distill_pipeline.distill_corpus(DistillRun(teacher=tiny_encoder_dir, texts=texts, out=tmp_path / "s"))
    with pytest.raises(InputError, match=r"3 non-empty held-out text\(s\); the top-10 overlap needs at least 21"):
        distill_pipeline.distill_corpus(DistillRun(teacher=tiny_encoder_dir, texts=texts, out=tmp_path / "s",
                                                   eval_texts=texts[:3]))
    with pytest.raises(InputError, match=r"eval_texts: 3 text\(s\); the agreement's top-10 overlap needs at least 21"):
        distill.distill_embeddings(None, None, None, texts, eval_texts=texts[:3])
    assert not (tmp_path / "s").exists()
    texts = [f"sentence {i} tells of the river bank and the boat" for i in range(100)]
    caplog.set_level(logging.INFO, logger="minibert")  # the run's lines go through logging
    run = distill_pipeline.distill_corpus(DistillRun(teacher=tiny_encoder_dir, texts=texts, out=tmp_path / "s",
                                                     student_blocks=[0, 3], k=3, epochs=1, lr=1e-3, progress=False))
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("minibert.")]
    assert run.held_out == 7 and run.trained_on == 93  # 5 % of 100 is 5, raised to 2k + 1 = 7
    assert "agreement measured on 7 held-out texts, held out of the 100 given (7.0%" in lines[0]
    assert run.history.epochs[0]["eval"]["k"] == 3


def test_a_student_keeps_its_sentence_transformers_teachers_settings(tiny_encoder_dir, tmp_path, caplog):
    """A student distilled from a sentence-transformers folder was written without modules.json, so `embed`
    pooled it differently from its teacher. It now keeps the teacher's pooling, normalisation and length,
    matches vectors pooled that way, and says so."""
    from minibert.compat import SentenceEncoder

    teacher = tmp_path / "teacher"
    shutil.copytree(tiny_encoder_dir, teacher)
    (teacher / "1_Pooling").mkdir()
    (teacher / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    (teacher / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": 32, "pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False}))
    (teacher / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 24, "do_lower_case": False}))
    texts = [f"sentence {i} tells of the river bank and the boat" for i in range(60)]
    caplog.set_level(logging.INFO, logger="minibert")
    run = distill_pipeline.distill_corpus(DistillRun(teacher=teacher, texts=texts, out=tmp_path / "student",
                                                     student_blocks=[0, 3], k=3, epochs=1, lr=1e-3, progress=False))
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("minibert.")]
    assert (run.pooling, run.normalize, run.sentence_folder) == ("cls", True, True)
    assert any("keeps" in line and "pooling cls, normalized, max_seq_length 24" in line for line in lines)
    student, original = SentenceEncoder.from_pretrained(tmp_path / "student"), SentenceEncoder.from_pretrained(teacher)
    assert student.settings()["pooling"] == ["cls"] and student.normalize and student.max_seq_length == 24
    assert student.model.config.num_hidden_layers == 2 and original.model.config.num_hidden_layers == 4
    vectors = student.encode(texts[:4])
    assert abs(float((vectors ** 2).sum(1).max()) - 1.0) < 1e-5  # unit vectors, as the teacher's
    # a plain checkpoint as the teacher: mean pooling, not normalised, and no folder settings written
    run = distill_pipeline.distill_corpus(DistillRun(teacher=tiny_encoder_dir, texts=texts, out=tmp_path / "plain",
                                                     student_blocks=[0, 3], k=3, epochs=1, lr=1e-3, progress=False))
    assert (run.pooling, run.normalize, run.sentence_folder) == ("mean", False, False)
    assert not (tmp_path / "plain" / "modules.json").exists()


def test_exit_speeds_are_warmed_up_alternating_medians_with_their_spread(tiny_teacher_dir, monkeypatch):
    """`minibert exits` timed each rule once, the full model first and cold (one run read 10x, the next
    0.12x, for rules that run every block). Every rule is now called once to warm up, then once per round
    with the order rotated each round, and the speed-up is the median of paired ratios with quartiles."""
    from minibert.tools import timing

    tok = BertTokenizer.from_pretrained(tiny_teacher_dir)
    model = BertForSequenceClassification.from_pretrained(tiny_teacher_dir)
    ee = depth.EarlyExit(model)
    texts, labels = toy(16, seed=3)
    calls = []
    real = timing.alternate

    def recorded(fns, rounds, **kw):  # the exit rules' timing (not the fast path's kernel calibration)
        if ("full model", None) in fns:
            fns = {name: (lambda name=name, f=f: (calls.append(name), f())) for name, f in fns.items()}
        return real(fns, rounds, **kw)
    monkeypatch.setattr(timing, "alternate", recorded)
    rows = depth.exit_curve(ee, tok, texts, labels, entropies=[0.0], patiences=[4], rounds=3)
    rules = [("full model", None), ("entropy", 0.0), ("patience", 4)]
    assert [r["rule"] for r in rows] == [r for r, _ in rules]
    assert all(calls.count(rule) == 1 + 3 for rule in rules)  # a warm-up call, then one per round
    firsts = [calls[i] for i in range(3, len(calls), 3)]
    assert firsts == [rules[0], rules[1], rules[2]]  # each round starts with another rule
    for row in rows:
        low, high = row["speedup_spread"]
        assert low <= row["speedup"] <= high
    assert "speed-up vs full model (quartiles)" in depth.curve_table(rows)
    with pytest.raises(InputError, match="rounds must be a positive integer"):
        depth.exit_curve(ee, tok, texts, labels, rounds=0)


def test_masked_lm_distillation_mixes_the_soft_and_hard_losses_at_the_masked_tokens():
    from minibert.config import BertConfig
    from minibert.models.pretraining import BertForMaskedLM

    config = BertConfig(vocab_size=120, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    teacher = BertForMaskedLM.from_config(config, seed=1)
    student = BertForMaskedLM.from_config(dataclasses.replace(config, num_hidden_layers=1), seed=2)
    distiller = distill.MaskedLMDistiller(teacher, student, temperature=3.0, alpha=0.25).train()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 120, (3, 10), generator=g)
    labels = torch.full_like(ids, -100)
    labels[:, [2, 5]] = ids[:, [2, 5]]
    out = distiller(ids, torch.ones_like(ids), labels=labels)
    t, s = teacher(ids, labels=labels), student(ids, labels=labels)
    assert out.masked_logits.shape == (6, 120)  # the masked tokens only
    soft = distill.soft_target_loss(s.masked_logits, t.masked_logits, 3.0)
    assert float(out.mlm_loss.detach()) == pytest.approx(float((0.25 * soft + 0.75 * s.mlm_loss).detach()), rel=1e-6)
    out.mlm_loss.backward()
    assert teacher.bert.embeddings.word.weight.grad is None  # the teacher only answers
    assert {n for n, _ in distiller.named_parameters()} == {n for n, _ in student.named_parameters()}
    distiller.eval()
    assert float(distiller(ids, labels=labels).mlm_loss.detach()) == pytest.approx(float(s.mlm_loss.detach()), rel=1e-6)  # the student
    assert not teacher.training
    with pytest.raises(InputError, match="the teacher must be a BertForMaskedLM"):
        distill.MaskedLMDistiller(teacher.bert, student)
    other = BertForMaskedLM.from_config(dataclasses.replace(config, vocab_size=99))
    with pytest.raises(InputError, match="teacher vocabulary 120 words, student 99"):
        distill.MaskedLMDistiller(teacher, other)
    with pytest.raises(InputError, match="alpha"):
        distill.MaskedLMDistiller(teacher, student, alpha=1.5)
