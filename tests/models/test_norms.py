"""Norm placement (minibert/models/norms.py): pre-LN and DeepNorm beside BERT's post-LN, built, saved and
loaded as themselves, checked against torch's own TransformerEncoderLayer and DeepNorm's formula."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from minibert import BertConfig, BertModel, InputError
from minibert.models.norms import DeepNormBlock, PreLNBlock, deepnorm_constants, norm_config

TINY = dict(vocab_size=50, hidden_size=16, num_hidden_layers=3, num_attention_heads=2, intermediate_size=32,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def _batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 50, (3, 7), generator=g)
    mask = torch.ones(3, 7, dtype=torch.long)
    mask[1, 4:] = 0
    return ids, mask


@pytest.mark.parametrize("placement", ["post", "pre", "deepnorm"])
def test_each_placement_saves_loads_and_matches_itself(tmp_path, placement):
    torch.manual_seed(0)
    model = BertModel(norm_config(BertConfig(**TINY), placement)).eval()
    ids, mask = _batch()
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        model.save_pretrained(tmp_path)
        loaded = BertModel.from_pretrained(tmp_path)
    transformers_note = [w for w in said if "which transformers' Auto classes refuse" in str(w.message)]
    assert len(transformers_note) == (0 if placement == "post" else 2)  # on save and on load, not for BERT's
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["model_type"] == {"post": "bert", "pre": "minibert-pre-ln", "deepnorm": "minibert-deepnorm"}[placement]
    assert written.get("norm_placement", "post") == placement and ("norm_placement" in written) == (placement != "post")
    assert type(loaded.encoder.blocks[0]) is type(model.encoder.blocks[0])
    a, b = model(ids, mask), loaded(ids, mask)
    assert all(torch.equal(x, y) for x, y in zip(a.hidden_states, b.hidden_states))
    assert torch.equal(a.pooler_output, b.pooler_output)
    fast = loaded(ids, mask, fast=True)  # the fused blocks are post-LN's: another placement runs readable
    real = mask.bool()
    assert torch.allclose(fast.last_hidden_state[real], a.last_hidden_state[real], atol=1e-5)
    cut = loaded.keep_blocks([0, 2])  # surgery keeps the placement (and pre-LN's final LayerNorm)
    assert type(cut.encoder.blocks[1]) is type(model.encoder.blocks[2])
    assert cut.config.residual_scale == model.config.residual_scale
    assert all(p.device.type == "cpu" for p in cut.parameters())


def test_the_textbook_model_refuses_a_pre_ln_checkpoint(tmp_path):
    from minibert.model import BertModel as TextbookBertModel

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        BertModel(norm_config(BertConfig(**TINY), "pre")).save_pretrained(tmp_path)
    with pytest.raises(InputError, match=r"norm_placement='pre'.*use minibert.BertModel"):
        TextbookBertModel.from_pretrained(tmp_path)
    with pytest.raises(InputError, match="goes with norm_placement 'deepnorm' only"):
        BertConfig(**TINY, residual_scale=2.0)
    with pytest.raises(InputError, match="norm_placement 'sandwich' is not one of"):
        BertConfig(**TINY, norm_placement="sandwich")


@pytest.mark.parametrize("placement", ["post", "pre"])
def test_blocks_equal_torchs_own_encoder_layer(placement):
    """torch.nn.TransformerEncoderLayer (norm_first=False is post-LN, True is pre-LN) with our block's
    weights computes what our block computes."""
    torch.manual_seed(0)
    config = norm_config(BertConfig(**{**TINY, "layer_norm_eps": 1e-5}), placement)
    block = BertModel(config).eval().encoder.blocks[0]
    H = config.hidden_size
    theirs = torch.nn.TransformerEncoderLayer(H, config.num_attention_heads, config.intermediate_size, dropout=0.0,
                                              activation=torch.nn.functional.gelu, layer_norm_eps=1e-5,
                                              batch_first=True, norm_first=placement == "pre").eval()
    with torch.no_grad():
        a = block.attn
        theirs.self_attn.in_proj_weight.copy_(torch.cat([a.query.weight, a.key.weight, a.value.weight]))
        theirs.self_attn.in_proj_bias.copy_(torch.cat([a.query.bias, a.key.bias, a.value.bias]))
        theirs.self_attn.out_proj.weight.copy_(a.output.weight)
        theirs.self_attn.out_proj.bias.copy_(a.output.bias)
        for mine, their in ((block.ffn.dense_in, theirs.linear1), (block.ffn.dense_out, theirs.linear2),
                            (block.attn_norm, theirs.norm1), (block.ffn_norm, theirs.norm2)):
            their.weight.copy_(torch.randn_like(mine.weight) if isinstance(mine, torch.nn.LayerNorm) else mine.weight)
            their.bias.copy_(torch.randn_like(mine.bias) if isinstance(mine, torch.nn.LayerNorm) else mine.bias)
            mine.weight.copy_(their.weight)
            mine.bias.copy_(their.bias)
    x = torch.randn(2, 5, H)
    with torch.no_grad():
        assert torch.allclose(block(x)[0], theirs(x), atol=1e-5)
    assert isinstance(block, PreLNBlock) == (placement == "pre")


def test_deepnorm_is_post_ln_with_a_scaled_residual_and_a_smaller_init():
    alpha, beta = deepnorm_constants(3)
    assert (alpha, beta) == pytest.approx((6 ** 0.25, 24 ** -0.25))  # Wang et al. 2022, encoder-only
    torch.manual_seed(0)
    post = BertModel(BertConfig(**{**TINY, "num_hidden_layers": 12})).eval()
    torch.manual_seed(0)
    deep = BertModel(norm_config(BertConfig(**{**TINY, "num_hidden_layers": 12}), "deepnorm")).eval()
    _, beta12 = deepnorm_constants(12)
    for name in ("attn.value", "attn.output", "ffn.dense_in", "ffn.dense_out"):  # scaled by beta ...
        w_post, w_deep = (m.encoder.blocks[5].get_submodule(name).weight for m in (post, deep))
        assert torch.allclose(w_deep, w_post * beta12)
    for name in ("attn.query", "attn.key"):  # ... the query and key projections are not
        assert torch.equal(post.encoder.blocks[5].get_submodule(name).weight,
                           deep.encoder.blocks[5].get_submodule(name).weight)
    block = deep.encoder.blocks[0]
    assert isinstance(block, DeepNormBlock) and block.alpha == pytest.approx((24) ** 0.25)
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        attended, _ = block.attn(x)
        h = block.attn_norm(block.alpha * x + attended)
        expected = block.ffn_norm(block.alpha * h + block.ffn(h))
        assert torch.allclose(block(x)[0], expected, atol=1e-6)


@pytest.mark.parametrize("placement", ["pre", "deepnorm"])
def test_transformers_refuses_or_says_why_and_parity_points_to_against(tmp_path, capsys, placement):
    """Issue 61: a pre-LN or DeepNorm checkpoint never loads silently into transformers as BERT's post-LN: its
    Auto classes refuse the model_type, its BertModel / BertForMaskedLM say they instantiate another type;
    ``minibert parity`` says transformers cannot represent it and points to --against."""
    import logging

    transformers = pytest.importorskip("transformers")
    from conftest import cli_error

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        BertModel(norm_config(BertConfig(**TINY), placement), add_mlm_head=True).save_pretrained(tmp_path)
        assert BertModel.from_pretrained(tmp_path).config.norm_placement == placement  # minibert: itself
    for auto in (transformers.AutoModel, transformers.AutoModelForMaskedLM, transformers.AutoConfig):
        with pytest.raises(ValueError, match="minibert-"):
            auto.from_pretrained(tmp_path)
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    try:
        for cls in (transformers.BertModel, transformers.BertForMaskedLM):
            records.clear()
            cls.from_pretrained(tmp_path)
            said = " ".join(r.getMessage() for r in records)
            assert f"model of type `minibert-{'pre-ln' if placement == 'pre' else placement}` to instantiate a " \
                   "model of type `bert`" in said, said
    finally:
        logger.removeHandler(handler)
    capsys.readouterr()
    line = cli_error(capsys, "parity", "--model", tmp_path)
    assert "transformers cannot represent it" in line and "--against" in line
