"""minibert/parts.py: the one save/load protocol for what a task adds to a model (a JSON record and its
tensors, the record sealed into the tensors' metadata), and the task-level objects that use it."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from minibert import InputError
from minibert.parts import check_fits, read_part, save_part


def test_a_part_round_trips_and_refuses_what_does_not_fit(tmp_path):
    module = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    save_part(tmp_path / "p", "ramps", {"pooling": "mean", "layers": 2}, module.state_dict())
    assert sorted(p.name for p in (tmp_path / "p").iterdir()) == ["ramps.json", "ramps.safetensors"]
    record, tensors = read_part(tmp_path / "p", "ramps")
    assert record == {"pooling": "mean", "layers": 2}
    check_fits(tmp_path / "p", module, tensors, "the ramps")
    assert all(torch.equal(tensors[k], v) for k, v in module.state_dict().items())
    other = nn.Sequential(nn.Linear(4, 5), nn.Linear(5, 2), nn.Linear(2, 2))
    with pytest.raises(InputError, match=r"the ramps does not fit \(0\.bias: saved \(3,\), this model needs \(5,\); "
                                         r"0\.weight: saved \(3, 4\), this model needs "
                                         r"\(5, 4\);.*2\.bias: missing from the file"):
        check_fits(tmp_path / "p", other, tensors, "the ramps")
    (tmp_path / "p" / "ramps.json").write_text(json.dumps({"pooling": "cls", "layers": 2}))
    with pytest.raises(InputError, match=r"pooling is 'cls' there, 'mean' in ramps\.safetensors\): it was edited "
                                         r"after saving"):
        read_part(tmp_path / "p", "ramps")
    with pytest.raises(InputError, match=r"not an early-exit classifier \(needs exits\.json and exits\.safetensors\)"):
        read_part(tmp_path / "p", "exits", what="an early-exit classifier")


def test_early_exits_save_as_a_part_beside_the_classifier(tmp_path):
    from conftest import hf_config, random_hf_model
    from minibert import BertForSequenceClassification
    from minibert.training.depth import EarlyExit

    random_hf_model(hf_config(vocab_size=99, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                              intermediate_size=32), seed=1).save_pretrained(tmp_path / "encoder")
    classifier = BertForSequenceClassification.from_encoder(tmp_path / "encoder", labels=["a", "b", "c"], seed=0)
    ee = EarlyExit(classifier, pooling="cls", seed=3)
    ee.save_pretrained(tmp_path / "ee")
    assert json.loads((tmp_path / "ee" / "early_exits.json").read_text()) == {"pooling": "cls"}
    back = EarlyExit.from_pretrained(tmp_path / "ee")
    assert back.pooling == "cls"
    assert all(torch.equal(a, b) for a, b in zip(ee.ramps.state_dict().values(), back.ramps.state_dict().values()))
    (tmp_path / "ee" / "early_exits.json").write_text(json.dumps({"pooling": "mean"}))
    with pytest.raises(InputError, match="edited after saving"):
        EarlyExit.from_pretrained(tmp_path / "ee")
