"""minibert/tools/accounting.py: parameter counts, FLOPs and activation memory against transformers and torch's
own counters."""

from __future__ import annotations

import pytest
import torch

from conftest import BASE, hf_config, transformers
from minibert import BertConfig, BertModel
from minibert.tools.accounting import BLOCK_PARTS, activation_memory, flops_per_token, forward_flops, parameter_counts


def test_parameter_counts_match_transformers_for_bert_base():
    reference = transformers.BertModel(hf_config(**BASE))
    ours = parameter_counts(BertConfig.from_preset("bert-base-uncased"))

    def n(module):
        return sum(p.numel() for p in module.parameters())

    assert ours["total"] == reference.num_parameters() == 109_482_240
    assert ours["embeddings"] == n(reference.embeddings) == 23_837_184
    assert ours["blocks.0"] == n(reference.encoder.layer[0]) == 7_087_872
    assert ours["pooler"] == n(reference.pooler) == 590_592
    assert ours["blocks"] == n(reference.encoder)
    assert ours["embeddings.word"] == n(reference.embeddings.word_embeddings)


def test_parameter_counts_of_a_loaded_checkpoint(model):
    counts = parameter_counts(model)
    assert counts["total"] == sum(p.numel() for p in model.parameters())
    assert sum(counts[f"block.{p}"] for p in BLOCK_PARTS) == counts["blocks.0"]
    for part in BLOCK_PARTS:  # one vocabulary: accounting rows are module names
        assert counts[f"block.{part}"] == sum(p.numel() for p in model.encoder.blocks[0].get_submodule(part).parameters())


def test_flops_match_torch_flop_counter():
    from torch.utils.flop_counter import FlopCounterMode

    config = BertConfig(vocab_size=500, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                        intermediate_size=256)
    model = BertModel(config).eval()
    for B, T in ((2, 16), (1, 128)):
        counter = FlopCounterMode(display=False)
        with counter, torch.no_grad():
            model(torch.randint(0, 500, (B, T)), output_attentions=True)
        measured = counter.get_total_flops()  # matrix products only
        # our count is 2 x every block parameter (the usual convention); the counter skips biases and
        # LayerNorm, so take those out to compare exactly
        vectors = sum(p.numel() for p in model.encoder.parameters() if p.dim() == 1)
        ours = forward_flops(config, B, T) - 2 * B * T * vectors - 2 * B * model.pooler.dense.bias.numel()
        assert ours == measured
    base = flops_per_token(BertConfig.from_preset("bert-base-uncased"), 128)
    assert base["dense"] == 2 * 85_054_464 and base["attention"] == 4 * 12 * 768 * 128


@pytest.mark.parametrize("train", [False, True])
@pytest.mark.parametrize("output_attentions", [False, True])
def test_training_activation_memory_matches_saved_tensors(train, output_attentions):
    config = BertConfig(vocab_size=500, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                        intermediate_size=256)
    model = BertModel(config).train(train)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(torch.randint(0, 500, (4, 48)), output_attentions=output_attentions)
    measured = sum(saved.values())
    estimate = activation_memory(model, 4, 48, output_attentions=output_attentions)["training"]
    assert abs(estimate - measured) / measured < 0.05, (estimate, measured)


def test_inspect_cli_prints_bert_base_accounting(capsys):
    from minibert.cli import main

    assert main(["inspect", "--model", "bert-base-uncased"]) == 0
    text = capsys.readouterr().out
    for number in ("109,482,240", "23,837,184", "7,087,872", "590,592", "170.1M", "174.8M"):
        assert number in text
    with pytest.raises(SystemExit) as e:
        main(["inspect", "--model", "bert-base-uncased", "--lengths", "513"])
    assert e.value.code == 2
