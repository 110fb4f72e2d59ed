"""minibert/runs/distill.py: `minibert distill` in both modes (sentence embeddings, a task), the held-out split,
augmentation after it, a sentence-transformers teacher's settings kept."""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys

import pytest
import torch

from conftest import cli_error, toy, usage_error
from minibert import BertForSequenceClassification, BertModel, InputError
from minibert.runs import distill as distill_pipeline
from minibert.cli import main
from minibert.runs.settings import DistillRun
from minibert.training import distill


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


def test_distill_takes_a_device_checked_before_any_work(tiny_encoder_dir, tiny_teacher_dir, tmp_path, capsys):
    """``--device`` (issue 61), both modes: on the CPU the same student as without the option, bit for bit; a
    device this machine lacks is refused before any folder is made."""
    from safetensors.torch import load_file

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(f"sentence number {i} is about the bank" for i in range(50)) + "\n")
    texts, labels = toy(24, seed=2)
    data = tmp_path / "d.csv"
    data.write_text("text,label\n" + "\n".join(f"{t},{y}" for t, y in zip(texts, labels)) + "\n")
    modes = {"emb": ["--teacher", str(tiny_encoder_dir), "--texts", str(corpus), "--student-blocks", "1,3"],
             "task": ["--teacher", str(tiny_teacher_dir), "--train", str(data), "--eval", str(data)]}
    for name, argv in modes.items():
        common = ["distill", *argv, "--epochs", "1", "--quiet"]
        assert main([*common, "--out", str(tmp_path / f"{name}-plain")]) == 0
        assert main([*common, "--out", str(tmp_path / f"{name}-cpu"), "--device", "cpu"]) == 0
        a, b = (load_file(tmp_path / f"{name}-{kind}" / "model.safetensors") for kind in ("plain", "cpu"))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        if not torch.cuda.is_available():
            line = cli_error(capsys, *common, "--out", tmp_path / f"{name}-gpu", "--device", "cuda")
            assert "sees no CUDA device" in line and not (tmp_path / f"{name}-gpu").exists()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (runs on a GPU machine)")
def test_distill_runs_on_a_gpu_in_both_modes(tiny_encoder_dir, tiny_teacher_dir, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(f"sentence number {i} is about the bank" for i in range(50)) + "\n")
    texts, labels = toy(24, seed=2)
    data = tmp_path / "d.csv"
    data.write_text("text,label\n" + "\n".join(f"{t},{y}" for t, y in zip(texts, labels)) + "\n")
    for name, argv in {"emb": ["--teacher", str(tiny_encoder_dir), "--texts", str(corpus), "--cache-teacher"],
                       "task": ["--teacher", str(tiny_teacher_dir), "--train", str(data), "--eval", str(data)]}.items():
        assert main(["distill", *argv, "--epochs", "1", "--quiet", "--device", "cuda",
                     "--out", str(tmp_path / name)]) == 0
        assert BertModel.from_pretrained(tmp_path / name).config.num_hidden_layers == 2
