"""minibert/tools/surgery.py: truncated models, frozen blocks, the dropout context."""

from __future__ import annotations

import pytest
import torch

from conftest import assert_same_output, run_model as run, transformers
from minibert import BertModel
from minibert.tools import surgery as S


def test_truncated_model_equals_the_first_hidden_states(model, batch, tmp_path):
    full = run(model, batch)
    small = S.truncate(model, 2)
    assert small.config.num_hidden_layers == 2 and model.config.num_hidden_layers == 6
    out = run(small, batch)
    assert len(out.hidden_states) == 3
    for i in range(3):
        assert torch.equal(out.hidden_states[i], full.hidden_states[i])
    # every other block == the full model with the others skipped
    student = S.keep_blocks(model, range(1, 6, 2))
    skipped = run(model, batch, skip_blocks=[0, 2, 4])
    assert torch.equal(run(student, batch).last_hidden_state, skipped.last_hidden_state)
    # save and reload, in minibert and in transformers
    student.save_pretrained(tmp_path)
    again = BertModel.from_pretrained(tmp_path)
    assert_same_output(run(again, batch), run(student, batch))
    reference = transformers.BertModel.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert reference.config.num_hidden_layers == 3
    with torch.no_grad():
        ref = reference(**batch)
    valid = batch["attention_mask"].bool()
    diff = (ref.last_hidden_state - run(student, batch).last_hidden_state)[valid].abs().max()
    assert diff <= 1e-5
    # copies are independent
    with torch.no_grad():
        student.encoder.blocks[0].attn.query.weight.zero_()
    assert model.encoder.blocks[1].attn.query.weight.abs().sum() > 0
    with pytest.raises(ValueError, match=r"block=6 is out of range.*blocks 0\.\.5"):
        S.keep_blocks(model, [0, 6])


def test_freeze_bottom_blocks(minilm_dir, batch):
    model = BertModel.from_pretrained(minilm_dir)
    S.freeze(model, embeddings=True, blocks=2)
    out = model(**batch)
    (out.last_hidden_state.sum() + out.pooler_output.sum()).backward()
    for name, p in model.named_parameters():
        frozen = name.startswith("embeddings.") or name.startswith(("encoder.blocks.0.", "encoder.blocks.1."))
        assert p.requires_grad is not frozen, name
        assert (p.grad is None) is frozen, name
    S.unfreeze(model)
    assert all(p.requires_grad for p in model.parameters())
    with pytest.raises(ValueError, match=r"freeze\(blocks\)=7 is out of range"):
        S.freeze(model, blocks=7)


def test_dropout_context_sets_every_dropout_and_gives_them_back(minilm_dir, batch):
    model = BertModel.from_pretrained(minilm_dir).train()
    rates = [m.p for m in model.modules() if isinstance(m, torch.nn.Dropout)]
    assert rates and all(r == 0.1 for r in rates)  # all-MiniLM-L6-v2's config: 0.1 everywhere
    with torch.no_grad():
        with S.dropout(model, 0.0):
            assert all(m.p == 0.0 for m in model.modules() if isinstance(m, torch.nn.Dropout))
            assert all(block.attn.dropout_p == 0.0 for block in model.encoder.blocks)
            once, twice = model(**batch), model(**batch)  # training mode, yet deterministic
            assert torch.equal(once.last_hidden_state, twice.last_hidden_state)
        assert [m.p for m in model.modules() if isinstance(m, torch.nn.Dropout)] == rates
        assert all(block.attn.dropout_p == 0.1 for block in model.encoder.blocks)
        assert not torch.equal(model(**batch).last_hidden_state, model(**batch).last_hidden_state)
    assert model.config.hidden_dropout_prob == 0.1  # the config is never touched
    with pytest.raises(ValueError, match=r"dropout p must be in \[0, 1\), got 1\.5"):
        with S.dropout(model, 1.5):
            pass
