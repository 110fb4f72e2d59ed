"""Bad inputs give a ValueError naming the argument, the value and the limit; config validation."""

from __future__ import annotations

import json

import pytest
import torch

from minibert import BertConfig, BertModel

TINY = BertConfig(vocab_size=100, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                  intermediate_size=32, max_position_embeddings=20, type_vocab_size=2)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return BertModel(TINY).eval()


IDS = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 0]])


@pytest.mark.parametrize("kwargs, pattern", [
    (dict(input_ids=torch.tensor([[1, 100, 3]])),
     r"input_ids has value 100 at position \(0, 1\); it must be in \[0, 100\) \(vocab_size=100\)"),
    (dict(input_ids=torch.tensor([[1, -1, 3]])), r"input_ids has value -1 at position \(0, 1\)"),
    (dict(input_ids=torch.ones(1, 21, dtype=torch.long)),
     r"input_ids has 21 tokens .* max_position_embeddings=20.*truncation=True"),
    (dict(input_ids=IDS, token_type_ids=torch.tensor([[0, 0, 1, 2], [0, 0, 0, 0]])),
     r"token_type_ids has value 2 at position \(0, 3\); it must be in \[0, 2\) \(type_vocab_size=2\)"),
    (dict(input_ids=IDS, position_ids=torch.tensor([[0, 1, 2, 20], [0, 1, 2, 3]])),
     r"position_ids has value 20 .* \(max_position_embeddings=20\)"),
    (dict(input_ids=IDS, attention_mask=torch.ones(2, 5)),
     r"attention_mask has shape \(2, 5\) but input_ids has shape \(2, 4\)"),
    (dict(input_ids=IDS, token_type_ids=torch.zeros(3, 4, dtype=torch.long)),  # (1, 4) broadcasts
     r"token_type_ids has shape \(3, 4\) but input_ids has shape \(2, 4\); it must be \(2, 4\) or \(1, 4\)"),
    (dict(input_ids=IDS, position_ids=torch.zeros(2, 3, dtype=torch.long)),
     r"position_ids has shape \(2, 3\) but input_ids"),
    (dict(input_ids=IDS.float()), r"input_ids must hold integers, got a tensor of dtype torch.float32"),
    (dict(input_ids=IDS, token_type_ids=torch.zeros(2, 4)), r"token_type_ids must hold integers"),
    (dict(input_ids=torch.zeros(2, 0, dtype=torch.long)), r"input_ids is empty"),
    (dict(input_ids=torch.zeros(2, 3, 4, dtype=torch.long)), r"input_ids must have shape \(batch, tokens\)"),
    (dict(input_ids=[[1.5, 2.0]]), r"input_ids must hold integers"),
])
def test_bad_input_is_a_clear_value_error(model, kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        model(**kwargs)


def test_good_inputs_in_other_forms(model):
    ref = model(IDS).last_hidden_state
    assert torch.equal(model(IDS.tolist()).last_hidden_state, ref)  # nested lists
    assert torch.equal(model(IDS.int()).last_hidden_state, ref)  # int32
    assert torch.equal(model(IDS[0]).last_hidden_state, ref[:1])  # one sequence, 1-D
    assert torch.equal(model(IDS, attention_mask=torch.ones(2, 4, dtype=torch.bool)).last_hidden_state, ref)
    assert model(torch.ones(1, 20, dtype=torch.long)).last_hidden_state.shape == (1, 20, 16)  # the limit


def test_output_structure(model):
    out = model(IDS, attention_mask=(IDS != 0).long(), output_attentions=True)
    assert out.last_hidden_state.shape == (2, 4, 16) and out.pooler_output.shape == (2, 16)
    assert len(out.hidden_states) == 3 and all(h.shape == (2, 4, 16) for h in out.hidden_states)
    assert len(out.attentions) == 2 and all(a.shape == (2, 2, 4, 4) for a in out.attentions)
    assert model(IDS).attentions is None
    assert out["last_hidden_state"] is out.last_hidden_state


def test_dropout_in_training_mode_only(model):
    model.train()
    try:
        a, b = model(IDS).last_hidden_state, model(IDS).last_hidden_state
        assert not torch.equal(a, b)
        a.sum().backward()
        assert model.embeddings.word.weight.grad is not None
    finally:
        model.zero_grad()
        model.eval()
    assert torch.equal(model(IDS).last_hidden_state, model(IDS).last_hidden_state)


# ------------------------------------------------------------------------------------------- config
@pytest.mark.parametrize("kwargs, pattern", [
    (dict(hidden_size=100, num_attention_heads=12), r"hidden_size \(100\) must be divisible by num_attention_heads \(12\)"),
    (dict(hidden_act="swish"), r"hidden_act 'swish' is not supported"),
    (dict(position_embedding_type="relative_key"), r"position_embedding_type 'relative_key' is not supported"),
    (dict(num_hidden_layers=0), r"num_hidden_layers=0 is out of range: it must be an int in \[1, 1024\]"),
    (dict(vocab_size=10, pad_token_id=10), r"pad_token_id=10 is out of range: it must be an int in \[0, 9\]"),
    (dict(hidden_dropout_prob=1.5), r"hidden_dropout_prob must be in \[0, 1\)"),
])
def test_config_validation(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        BertConfig(**kwargs)


def test_relative_positions_refused_when_loading(tmp_path):
    config = dict(BertConfig().to_dict(), position_embedding_type="relative_key_query")
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="relative_key_query"):
        BertConfig.from_json_file(tmp_path / "config.json")


def test_config_json_round_trip_and_presets(tmp_path):
    config = BertConfig.from_preset("bert-large-uncased")
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads) == (1024, 24, 16)
    assert BertConfig.from_preset("google-bert/bert-base-cased").vocab_size == 28996
    config.to_json_file(tmp_path / "config.json")
    assert BertConfig.from_json_file(tmp_path / "config.json") == config
    with pytest.raises(ValueError, match="unknown preset"):
        BertConfig.from_preset("bert-huge")


def test_config_reads_transformers_config(tmp_path):
    transformers = pytest.importorskip("transformers")
    transformers.BertConfig(hidden_size=64, num_attention_heads=4, layer_norm_eps=1e-7).save_pretrained(tmp_path)
    config = BertConfig.from_json_file(tmp_path / "config.json")
    assert config.hidden_size == 64 and config.layer_norm_eps == 1e-7 and config.hidden_act == "gelu"
