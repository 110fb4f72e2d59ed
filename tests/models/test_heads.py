"""Task heads (issue 13, part 1): sequence classification, token classification and extractive QA,
compatible with transformers' classes in computation, loss, checkpoint names and config fields.

Reference values come from transformers in the test: random models of each class that transformers
builds and saves (LayerNorms and biases perturbed, see conftest.random_hf_model), loaded by minibert.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from conftest import hf_config, random_hf_model, transformers
from minibert import CheckpointError, InputError
from minibert.models.heads import BertForQuestionAnswering, BertForSequenceClassification, BertForTokenClassification

SMALL = dict(vocab_size=30522, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)
LABELS = {0: "negative", 1: "neutral", 2: "positive"}
QA_LABELS = {0: "start", 1: "end"}
CLASSES = {"sequence": (BertForSequenceClassification, "BertForSequenceClassification"),
           "token": (BertForTokenClassification, "BertForTokenClassification"),
           "qa": (BertForQuestionAnswering, "BertForQuestionAnswering")}


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1000, 30000, (3, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    mask[2, 4:] = 0
    types = (torch.arange(12)[None] >= 5).long().expand(3, 12) * mask
    return {"input_ids": ids * mask, "attention_mask": mask, "token_type_ids": types}


@pytest.fixture(scope="module")
def saved(tmp_path_factory, minilm_dir):
    """One random checkpoint per class, saved by transformers (with the MiniLM vocabulary beside it)."""
    out = {}
    for kind, (_, name) in CLASSES.items():
        labels = QA_LABELS if kind == "qa" else LABELS  # transformers' QA head has num_labels (= 2) outputs
        config = hf_config(**SMALL, id2label=labels, label2id={v: k for k, v in labels.items()},
                           classifier_dropout=0.2)
        model = random_hf_model(config, seed=5, cls=getattr(transformers, name))
        directory = tmp_path_factory.mktemp(kind)
        model.save_pretrained(directory)
        shutil.copy(minilm_dir / "vocab.txt", directory / "vocab.txt")
        out[kind] = directory
    return out


def logits_of(output):
    return torch.stack([output.start_logits, output.end_logits]) if hasattr(output, "start_logits") else output.logits


@pytest.mark.parametrize("kind", list(CLASSES))
def test_transformers_checkpoints_load_and_match(saved, kind):
    ours_cls, name = CLASSES[kind]
    ours = ours_cls.from_pretrained(saved[kind])
    theirs = getattr(transformers, name).from_pretrained(saved[kind]).eval()
    assert ours.config.id2label == (QA_LABELS if kind == "qa" else LABELS) and ours.config.classifier_dropout == 0.2
    b = batch()
    with torch.no_grad():
        a, r = logits_of(ours(**b)), logits_of(theirs(**b))
    valid = b["attention_mask"].bool()
    if kind == "sequence":
        assert (a - r).abs().max() <= 1e-5
    elif kind == "token":
        assert (a - r)[valid].abs().max() <= 1e-5
    else:
        assert (a - r)[:, valid].abs().max() <= 1e-5


@pytest.mark.parametrize("labels", ["single", "multi", "regression", "regression_declared"])
def test_sequence_losses_match_transformers(saved, tmp_path, labels):
    config = hf_config(**SMALL, id2label=LABELS, label2id={v: k for k, v in LABELS.items()})
    if labels == "regression":
        config = hf_config(**SMALL, num_labels=1)
    if labels == "regression_declared":
        config.problem_type = "regression"
    model = random_hf_model(config, seed=6, cls=transformers.BertForSequenceClassification)
    model.save_pretrained(tmp_path)
    ours = BertForSequenceClassification.from_pretrained(tmp_path)
    target = {"single": torch.tensor([0, 2, 1]), "multi": torch.tensor([[1.0, 0, 1], [0, 0, 1], [1, 1, 0]]),
              "regression": torch.tensor([0.5, -1.0, 2.0]),
              "regression_declared": torch.tensor([[0.5, 1, 0], [-1.0, 0, 0], [2.0, 1, 1]])}[labels]
    b = batch(1)
    with torch.no_grad():
        a, r = ours(**b, labels=target).loss, model(**b, labels=target).loss
    assert abs(float(a) - float(r)) <= 1e-6


def test_token_and_span_losses_match_transformers(saved):
    b = batch(2)
    tags = torch.randint(0, 3, (3, 12))
    tags[~b["attention_mask"].bool()] = -100
    ours = BertForTokenClassification.from_pretrained(saved["token"])
    theirs = transformers.BertForTokenClassification.from_pretrained(saved["token"]).eval()
    with torch.no_grad():
        assert abs(float(ours(**b, labels=tags).loss) - float(theirs(**b, labels=tags).loss)) <= 1e-6
    ours = BertForQuestionAnswering.from_pretrained(saved["qa"])
    theirs = transformers.BertForQuestionAnswering.from_pretrained(saved["qa"]).eval()
    starts, ends = torch.tensor([5, 6, 40]), torch.tensor([7, 6, 41])  # 40, 41: outside, ignored
    with torch.no_grad():
        a = ours(**b, start_positions=starts, end_positions=ends).loss
        r = theirs(**b, start_positions=starts, end_positions=ends).loss
    assert abs(float(a) - float(r)) <= 1e-6


@pytest.mark.parametrize("kind", list(CLASSES))
def test_saved_by_us_loads_in_transformers_as_that_class(saved, tmp_path, kind):
    ours_cls, name = CLASSES[kind]
    ours = ours_cls.from_pretrained(saved[kind])
    ours.save_pretrained(tmp_path)
    theirs = getattr(transformers, name).from_pretrained(tmp_path).eval()
    assert theirs.config.id2label == (QA_LABELS if kind == "qa" else LABELS) and theirs.config.architectures == [name]
    b = batch(3)
    with torch.no_grad():
        assert (logits_of(ours(**b)) - logits_of(theirs(**b))).abs().max() <= 1e-5
    again = ours_cls.from_pretrained(tmp_path)
    with torch.no_grad():
        assert torch.equal(logits_of(again(**b)), logits_of(ours(**b)))


def test_fine_tuning_starts_from_an_encoder_with_a_seeded_head(minilm_dir, tmp_path):
    a = BertForSequenceClassification.from_encoder(minilm_dir, labels=["no", "yes"], seed=1)
    b = BertForSequenceClassification.from_encoder(minilm_dir, labels=["no", "yes"], seed=1)
    c = BertForSequenceClassification.from_encoder(minilm_dir, labels=["no", "yes"], seed=2)
    assert a.training and a.config.id2label == {0: "no", 1: "yes"}
    assert torch.equal(a.classifier.weight, b.classifier.weight) and not torch.equal(a.classifier.weight, c.classifier.weight)
    assert abs(float(a.classifier.weight.detach().std()) - 0.02) < 0.005 and not a.classifier.bias.any()
    a.save_pretrained(tmp_path)
    theirs = transformers.BertForSequenceClassification.from_pretrained(tmp_path).eval()
    x = batch(4)
    with torch.no_grad():
        assert (a.eval()(**x).logits - theirs(**x).logits).abs().max() <= 1e-5
    tagger = BertForTokenClassification.from_encoder(minilm_dir, labels=["O", "B-PER", "I-PER"])
    assert tagger.classifier.out_features == 3 and tagger.bert.pooler is not None
    reader = BertForQuestionAnswering.from_encoder(minilm_dir)
    assert reader.qa_outputs.out_features == 2 and reader.config.num_labels == 2
    with pytest.raises(InputError, match="distinct class names"):
        BertForSequenceClassification.from_encoder(minilm_dir, labels=["a", "a"])


def test_wrong_checkpoints_are_clear_errors(minilm_dir, saved, tmp_path):
    with pytest.raises(CheckpointError, match="from_encoder"):
        BertForSequenceClassification.from_pretrained(minilm_dir)  # an encoder: no id2label, no head
    with pytest.raises(CheckpointError, match="has no classifier.weight.*qa_outputs"):
        BertForSequenceClassification.from_pretrained(saved["qa"])
    shutil.copytree(saved["sequence"], tmp_path / "five")
    config = (tmp_path / "five" / "config.json").read_text().replace('"2": "positive"', '"2": "positive", "3": "x", "4": "y"')
    (tmp_path / "five" / "config.json").write_text(config)
    with pytest.raises(CheckpointError, match=r"classifier.weight has shape \(3, 64\), config.json says \(5, 64\)"):
        BertForSequenceClassification.from_pretrained(tmp_path / "five")


def test_predict_gives_label_names(saved):
    model = BertForSequenceClassification.from_pretrained(saved["sequence"])
    out = model.predict(["a good day", "a bad day", "meh"], batch_size=2)
    assert len(out) == 3 and all(o["label"] in LABELS.values() for o in out)
    assert all(abs(sum(o["scores"].values()) - 1) < 1e-5 for o in out)
    pairs = model.predict(["is it good?"], ["it is good."])
    assert pairs[0]["label"] in LABELS.values()
    tags = BertForTokenClassification.from_pretrained(saved["token"]).predict(["Ada Lovelace wrote notes"])
    assert [t for t, _, _ in tags[0]] == ["ada", "love", "##lace", "wrote", "notes"]
    assert all(label in LABELS.values() for _, label, _ in tags[0])
    context = "Ada Lovelace wrote the first published program in 1843."
    answer = BertForQuestionAnswering.from_pretrained(saved["qa"]).predict(["When?"], [context])[0]
    assert answer["answer"] == context[answer["start"]:answer["end"]] and answer["answer"]
