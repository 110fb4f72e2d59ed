"""minibert/tools/hooks.py: hook points (reading, replacing, caching), interventions (head ablation, patching,
skipped blocks) and the README's worked example."""

from __future__ import annotations

import pytest
import torch

from conftest import assert_same_output, run_model as run
from minibert import BertTokenizer
from minibert.hookpoints import HookPoint
from minibert.tools import hooks as H
from minibert.tools.hooks import point_table


def test_identity_and_reading_hooks_change_nothing_bitwise(model, batch):
    # hooks away from the attention scores and probabilities: the fused path runs, bit for bit the same
    plain = run(model, batch)
    away = [n for n in H.hook_point_names(model) if not n.endswith(("attn.scores", "attn.probs"))]
    with H.hooks(model, {name: lambda x, name: x for name in away}):
        assert_same_output(plain, run(model, batch))
    # a hook at every point: the scores and probabilities exist only on the explicit path, which then
    # runs, as for output_attentions=True -- bit for bit that run
    explicit = run(model, batch, output_attentions=True)
    seen = []
    with H.hooks(model, {"*": [lambda x, name: x, lambda x, name: seen.append(name)]}):
        hooked = run(model, batch)
    assert_same_output(explicit, hooked)
    assert seen == H.hook_point_names(model)  # every point, once, in forward order
    # the two paths differ by rounding only (README states the size)
    valid = batch["attention_mask"].bool()
    assert max((x - y)[valid].abs().max() for x, y in zip(plain.hidden_states, explicit.hidden_states)) < 1e-5
    # same with the attention maps asked for (the explicit path both times)
    plain = run(model, batch, output_attentions=True)
    with H.hooks(model, {"*": lambda x, name: x}):
        hooked = run(model, batch, output_attentions=True)
    assert_same_output(plain, hooked)
    for x, y in zip(plain.attentions, hooked.attentions, strict=True):
        assert torch.equal(x, y)


def test_every_cached_point_has_the_documented_shape(model, batch):
    _, cache = H.run_with_cache(model, **batch)
    c = model.config
    B, T = batch["input_ids"].shape
    sizes = dict(B=B, T=T, H=c.hidden_size, h=c.num_attention_heads, d=c.head_size, F=c.intermediate_size)
    table = point_table(c.num_hidden_layers)
    assert sorted(cache) == sorted(name for name, *_ in table)
    for name, shape, *_ in table:
        expected = tuple(sizes[s.strip()] for s in shape.strip("()").split(","))
        assert tuple(cache[name].shape) == expected, name


def test_cache_lines_up_with_hidden_states_and_attentions(model, batch):
    out, cache = H.run_with_cache(model, **batch, output_attentions=True)
    assert torch.equal(cache["embeddings.output"], out.hidden_states[0])
    for i in range(model.config.num_hidden_layers):
        assert torch.equal(cache[f"blocks.{i}.input"], out.hidden_states[i])
        assert torch.equal(cache[f"blocks.{i}.output"], out.hidden_states[i + 1])
        assert torch.equal(cache[f"blocks.{i}.attn.probs"], out.attentions[i])
    assert torch.equal(cache["pooler.output"], out.pooler_output)
    assert torch.equal(cache.stack("output")[-1], out.last_hidden_state)
    e = [cache[f"embeddings.{n}"] for n in ("word", "token_type", "position", "sum")]
    assert torch.equal((e[0] + e[1]) + e[2], e[3])


def test_attention_recomputed_by_hand_from_the_cache(model, batch):
    _, cache = H.run_with_cache(model, **batch, names="blocks.*.attn.*")  # fused path, probs for hooks
    valid = batch["attention_mask"].bool()
    for i, block in enumerate(model.encoder.blocks):
        q, k, v = (cache[f"blocks.{i}.attn.{n}"] for n in "qkv")
        scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
        scores = scores.masked_fill(~valid[:, None, None, :], torch.finfo(scores.dtype).min)
        torch.testing.assert_close(scores, cache[f"blocks.{i}.attn.scores"], atol=1e-5, rtol=0)
        probs = scores.softmax(-1)
        torch.testing.assert_close(probs, cache[f"blocks.{i}.attn.probs"], atol=1e-6, rtol=0)
        context = probs @ v
        torch.testing.assert_close(context, cache[f"blocks.{i}.attn.context"], atol=1e-5, rtol=0)
        B, h, T, d = context.shape
        merged = context.transpose(1, 2).reshape(B, T, h * d)
        with torch.no_grad():
            output = block.attn.output(merged)
        torch.testing.assert_close(output[valid], cache[f"blocks.{i}.attn.output"][valid], atol=1e-5, rtol=0)


def test_replacing_an_activation_changes_what_follows(model, batch):
    plain = run(model, batch)
    with H.hooks(model, {"blocks.2.ffn.post": lambda x, name: torch.zeros_like(x)}):
        edited = run(model, batch)
    for i in range(3):
        assert torch.equal(plain.hidden_states[i], edited.hidden_states[i])
    assert not torch.allclose(plain.hidden_states[3], edited.hidden_states[3])


def test_in_place_edit_of_probabilities_is_honoured(model, batch):
    def zero_head(x, name):
        x[:, 5] = 0

    _, cache = H.run_with_cache(model, **batch, names="blocks.1.attn.context")
    for mode in (torch.no_grad, torch.inference_mode):
        with mode(), H.hooks(model, {"blocks.1.attn.probs": zero_head}):
            _, edited = H.run_with_cache(model, **batch, names="blocks.1.attn.context")
        assert edited["blocks.1.attn.context"][:, 5].abs().max() == 0
        torch.testing.assert_close(edited["blocks.1.attn.context"][:, :5], cache["blocks.1.attn.context"][:, :5],
                                   atol=1e-5, rtol=0)


def test_hooks_are_removed_after_an_exception(model, batch):
    calls = []

    def fail(x, name):
        calls.append(name)
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        with H.hooks(model, {"blocks.0.attn.probs": fail, "blocks.*.output": lambda x, n: None}):
            run(model, batch)
    assert calls == ["blocks.0.attn.probs"]
    assert all(not m.fns for m in model.modules() if isinstance(m, HookPoint)) and HookPoint.registered == 0
    run(model, batch)  # would raise again if the hook were still there
    assert calls == ["blocks.0.attn.probs"]


def test_bad_hook_names_and_replacements_are_refused(model, batch):
    with pytest.raises(ValueError, match="unknown hook point 'blocks.9.output'"):
        with H.hooks(model, {"blocks.9.output": print}):
            pass
    with pytest.raises(ValueError, match=r"returned \(2, 2\).*shape"):
        with H.hooks(model, {"blocks.0.output": lambda x, n: torch.zeros(2, 2)}):
            run(model, batch)
    assert all(not m.fns for m in model.modules() if isinstance(m, HookPoint)) and HookPoint.registered == 0


def test_head_ablation_equals_zeroing_the_head_context(model, batch):
    heads = {1: [0, 7], 4: [3]}
    with H.ablate_heads(model, heads):
        ablated = run(model, batch)

    def zero(*hs):
        def hook(x, name):
            x = x.clone()
            x[:, list(hs)] = 0
            return x
        return hook

    with H.hooks(model, {"blocks.1.attn.context": zero(0, 7), "blocks.4.attn.context": zero(3)}):
        by_hand = run(model, batch)
    assert_same_output(ablated, by_hand)
    mask = torch.zeros(6, 12, dtype=torch.bool)
    mask[1, 0] = mask[1, 7] = mask[4, 3] = True
    with H.ablate_heads(model, mask):
        assert_same_output(run(model, batch), by_hand)
    assert not torch.allclose(ablated.last_hidden_state, run(model, batch).last_hidden_state)


def test_mean_ablation_uses_the_reference_mean(model, batch):
    with H.ablate_heads(model, [(2, 4)], mode="mean", reference=batch):
        _, cache = H.run_with_cache(model, **batch, names="blocks.2.attn.context")
    _, plain = H.run_with_cache(model, **batch, names="blocks.2.attn.context")
    valid = batch["attention_mask"].bool()
    expected = plain["blocks.2.attn.context"][:, 4][valid].mean(0)  # (d,)
    got = cache["blocks.2.attn.context"][:, 4]  # (B, T, d)
    torch.testing.assert_close(got, expected.expand_as(got), atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="reference="):
        H.ablate_heads(model, [(0, 0)], mode="mean").__enter__()
    with pytest.raises(ValueError, match="head 12 is out of range"):
        H.ablate_heads(model, [(0, 12)]).__enter__()


def test_patching_a_run_with_its_own_cache_changes_nothing(model, batch):
    plain, cache = H.run_with_cache(model, **batch)
    with H.patch(model, cache):
        assert_same_output(run(model, batch), plain)


def test_patching_from_another_input(model, batch):
    other = dict(batch, input_ids=batch["input_ids"].clone())
    other["input_ids"][:, 2] = 2023  # a different token, same length and padding
    out_other, cache = H.run_with_cache(model, **other, names="blocks.2.output")
    plain = run(model, batch)
    with H.patch(model, cache, "blocks.2.output"):
        patched = run(model, batch)
    for i in range(3):
        assert torch.equal(patched.hidden_states[i], plain.hidden_states[i])
    for i in range(3, 7):  # everything after block 2 is the other input's
        assert torch.equal(patched.hidden_states[i], out_other.hidden_states[i])
    with H.patch(model, cache, "blocks.2.output", positions=[2]):
        one = run(model, batch)
    assert not torch.equal(one.last_hidden_state, plain.last_hidden_state)
    assert not torch.equal(one.last_hidden_state, out_other.last_hidden_state)


def test_skip_blocks_and_early_exit(model, batch):
    full = run(model, batch)
    early = run(model, batch, num_blocks=3)
    assert len(early.hidden_states) == 4
    for i in range(4):
        assert torch.equal(early.hidden_states[i], full.hidden_states[i])
    with torch.no_grad():
        assert torch.equal(early.pooler_output, model.pooler(full.hidden_states[3]))
    skipped = run(model, batch, skip_blocks=[2])
    assert torch.equal(skipped.hidden_states[3], skipped.hidden_states[2])
    assert not torch.allclose(skipped.last_hidden_state, full.last_hidden_state)
    with pytest.raises(ValueError, match=r"num_blocks=7 .*\[0, 6\]"):
        run(model, batch, num_blocks=7)
    with pytest.raises(ValueError, match=r"skip_blocks entry=6 is out of range"):
        run(model, batch, skip_blocks=[6])


def test_readme_worked_example_previous_token_head(model, minilm_dir):
    tok = BertTokenizer.from_pretrained(minilm_dir)
    batch = tok(["The quick brown fox jumps over the lazy dog near the river bank today."], return_tensors="pt")
    with torch.inference_mode():
        out, cache = H.run_with_cache(model, **batch, names="blocks.*.attn.probs")
    probs = cache.stack("attn.probs")[:, 0]
    score = probs.diagonal(offset=-1, dim1=-2, dim2=-1)[..., 1:-1].mean(-1)  # (layers, heads)
    assert score[0, 2] > 0.99  # the README's numbers
    assert sorted(map(tuple, (score > 0.3).nonzero().tolist())) == [(0, 2), (2, 11)]
    with H.ablate_heads(model, score > 0.3), torch.inference_mode():
        ablated = model(**batch)
    assert (ablated.last_hidden_state - out.last_hidden_state).norm() > 1
