"""Numerical parity with transformers' BertModel.

What is compared: every hidden state (embeddings output + each block), the attention probabilities and
the pooler output, on valid (unpadded) positions only -- padded positions are not defined by BERT.
Tolerance: max abs difference <= 1e-5 in fp32 (transformers' own integration test allows 1e-4). The
reference runs eager attention when probabilities are compared and SDPA (its default) otherwise.
"""

from __future__ import annotations

import pytest
import torch

from conftest import BASE, LARGE_SHALLOW, PAIRS, SENTENCES, transformers
from minibert import BertModel

ATOL = 1e-5


def run_both(ours, reference, batch, output_attentions):
    with torch.no_grad():
        a = ours(**batch, output_attentions=output_attentions)
        b = reference(**batch, output_hidden_states=True, output_attentions=output_attentions)
    return a, b


def max_diffs(a, b, attention_mask):
    """Max abs difference per compared tensor, valid positions only."""
    valid = attention_mask.bool()
    diffs = {f"hidden_states[{i}]": (x - y)[valid].abs().max().item()
             for i, (x, y) in enumerate(zip(a.hidden_states, b.hidden_states, strict=True))}
    if b.pooler_output is not None:
        diffs["pooler"] = (a.pooler_output - b.pooler_output).abs().max().item()
    if a.attentions is not None:
        pair = valid[:, None, :, None] & valid[:, None, None, :]  # valid query and valid key
        for i, (x, y) in enumerate(zip(a.attentions, b.attentions, strict=True)):
            diffs[f"attentions[{i}]"] = (x - y).masked_select(pair).abs().max().item()
    return diffs


def assert_parity(ours, reference_dir, batch, atol=ATOL):
    """Compare on both transformers attention paths; ours explicit (with probabilities) and fused."""
    report = {}
    for impl, output_attentions in (("eager", True), ("sdpa", False)):
        reference = transformers.BertModel.from_pretrained(str(reference_dir), attn_implementation=impl).eval()
        a, b = run_both(ours, reference, batch, output_attentions)
        assert len(a.hidden_states) == ours.config.num_hidden_layers + 1
        assert torch.equal(a.hidden_states[-1], a.last_hidden_state)
        diffs = max_diffs(a, b, batch["attention_mask"])
        report[impl] = max(diffs.values())
        bad = {k: v for k, v in diffs.items() if not v <= atol}
        assert not bad, f"{impl}: differences above {atol}: {bad}"
    return report


def padded_pairs_batch(tokenizer):
    texts = [p[0] for p in PAIRS] + SENTENCES[:2]
    pairs = [p[1] for p in PAIRS] + ["And a second segment.", "Another one, slightly longer than that."]
    batch = tokenizer(texts, pairs, padding=True, return_tensors="pt")
    assert (batch["attention_mask"] == 0).any() and (batch["token_type_ids"] == 1).any()
    return dict(batch)


def test_minilm_real_weights_padded_pairs(minilm_dir, hf_tokenizer):
    ours = BertModel.from_pretrained(minilm_dir)
    report = assert_parity(ours, minilm_dir, padded_pairs_batch(hf_tokenizer))
    print("MiniLM padded pairs, max abs diff:", report)


def test_minilm_real_weights_single_sentences(minilm_dir, hf_tokenizer):
    ours = BertModel.from_pretrained(minilm_dir)
    assert_parity(ours, minilm_dir, dict(hf_tokenizer(SENTENCES, padding=True, return_tensors="pt")))


def test_minilm_512_tokens(minilm_dir, hf_tokenizer):
    text = " ".join(SENTENCES * 40)
    batch = dict(hf_tokenizer([text], truncation=True, max_length=512, return_tensors="pt"))
    assert batch["input_ids"].shape == (1, 512)
    ours = BertModel.from_pretrained(minilm_dir)
    print("MiniLM 512 tokens:", assert_parity(ours, minilm_dir, batch))


def random_batch(vocab_size, lengths, seed=0, pairs=True):
    g = torch.Generator().manual_seed(seed)
    T = max(lengths)
    ids = torch.randint(1, vocab_size, (len(lengths), T), generator=g)
    mask = torch.zeros(len(lengths), T, dtype=torch.long)
    types = torch.zeros(len(lengths), T, dtype=torch.long)
    for row, n in enumerate(lengths):
        mask[row, :n] = 1
        ids[row, n:] = 0
        if pairs:
            types[row, n // 2:n] = 1
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}


def test_bert_base_geometry_random_weights(base_random_dir):
    ours = BertModel.from_pretrained(base_random_dir)
    assert ours.config.num_hidden_layers == 12 and ours.config.hidden_size == 768
    batch = random_batch(BASE["vocab_size"], [37, 64, 5, 20])
    print("BERT-base random:", assert_parity(ours, base_random_dir, batch))


@pytest.mark.parametrize("layout", ["single", "sharded"])
def test_bert_large_width_legacy_layout(large_legacy_dirs, layout):
    directory = large_legacy_dirs[layout]
    ours = BertModel.from_pretrained(directory)
    assert ours.config.hidden_size == 1024 and ours.config.num_attention_heads == 16
    assert ours.skipped_tensors and all(n.startswith("cls.") for n in ours.skipped_tensors)
    batch = random_batch(LARGE_SHALLOW["vocab_size"], [50, 12, 33], seed=3)
    print(f"BERT-large width, legacy {layout}:", assert_parity(ours, directory, batch))


@pytest.mark.parametrize("act", ["gelu", "gelu_new", "gelu_pytorch_tanh", "relu"])
def test_every_activation(tmp_path, act):
    from conftest import hf_config, random_hf_model

    random_hf_model(hf_config(vocab_size=500, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                              intermediate_size=128, hidden_act=act), seed=4).save_pretrained(tmp_path)
    ours = BertModel.from_pretrained(tmp_path)
    assert ours.config.hidden_act == act
    assert_parity(ours, tmp_path, random_batch(500, [9, 16, 3], seed=5))


def test_fused_and_explicit_attention_agree(minilm_dir, hf_tokenizer):
    """The fast path (SDPA) must compute what the readable path computes."""
    ours = BertModel.from_pretrained(minilm_dir)
    batch = padded_pairs_batch(hf_tokenizer)
    with torch.no_grad():
        fused = ours(**batch)
        explicit = ours(**batch, output_attentions=True)
    valid = batch["attention_mask"].bool()
    for x, y in zip(fused.hidden_states, explicit.hidden_states, strict=True):
        assert (x - y)[valid].abs().max() <= ATOL
    assert (fused.pooler_output - explicit.pooler_output).abs().max() <= ATOL


def test_fully_masked_row_attends_uniformly_on_both_paths(minilm_dir):
    """An all-zero attention_mask row: we chose transformers' eager behaviour (uniform attention over
    all keys) on both our paths, so they agree there too."""
    ours = BertModel.from_pretrained(minilm_dir)
    ids = torch.tensor([[101, 7592, 2088, 102], [101, 2054, 102, 0]])
    mask = torch.tensor([[1, 1, 1, 1], [0, 0, 0, 0]])
    with torch.no_grad():
        fused = ours(ids, mask)
        explicit = ours(ids, mask, output_attentions=True)
        reference = transformers.BertModel.from_pretrained(str(minilm_dir), attn_implementation="eager").eval()
        ref = reference(ids, attention_mask=mask, output_hidden_states=True)
    probs = explicit.attentions[0][1]
    assert torch.allclose(probs, torch.full_like(probs, 0.25))
    assert (fused.last_hidden_state - explicit.last_hidden_state).abs().max() <= ATOL
    assert (explicit.last_hidden_state - ref.last_hidden_state).abs().max() <= ATOL


def test_left_padding_and_explicit_position_ids(minilm_dir):
    """Default positions are 0..T-1 regardless of padding (as transformers); explicit ones are honoured."""
    ours = BertModel.from_pretrained(minilm_dir)
    reference = transformers.BertModel.from_pretrained(str(minilm_dir)).eval()
    ids = torch.tensor([[0, 0, 101, 7592, 2088, 102], [101, 2054, 2003, 2023, 1029, 102]])
    mask = (ids != 0).long()
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    for kwargs in ({}, {"position_ids": positions}):
        with torch.no_grad():
            a = ours(ids, attention_mask=mask, **kwargs).last_hidden_state
            b = reference(ids, attention_mask=mask, **kwargs).last_hidden_state
        assert (a - b)[mask.bool()].abs().max() <= ATOL
