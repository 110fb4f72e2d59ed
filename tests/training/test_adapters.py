"""Adapters, prefix-tuning and LoRA as task modules on one frozen base (issue 33): exact against the
libraries that define them, many tasks switched without copies, saved alone, and every tool on them.

The AdapterHub references (tests/data/adapters/) were computed by `adapters` 1.3.0 with transformers
4.57.6 -- pinned apart from the test extra -- by `python tools/adapter_references.py` (PROVENANCE.json
beside them names the versions); peft's prefix-tuning runs here directly."""

from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from conftest import DATA as TEST_DATA, transformers
from minibert import BertForSequenceClassification, BertModel, InputError
from minibert.cli import main
from minibert.training.adapters import (CONFIG_FILE, add_adapter, flatten_prefix, load_adapter, remove_adapter,
                                        save_adapter, set_active, task_head, task_names, trainable_parameters)

DATA = TEST_DATA / "adapters"
TOL = 1e-5


def reference(kind):
    tensors = load_file(str(DATA / f"{kind}.safetensors"))
    part = lambda prefix: {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}  # noqa: E731
    return part("weights."), part("batch."), part("hidden_states."), tensors


def with_adapterhub_weights(kind, **options):
    """Our model with AdapterHub's weights for ``kind`` (their names mapped to ours here)."""
    weights, batch, hidden, tensors = reference(kind)
    model = BertModel.from_pretrained(DATA / "base").eval()
    add_adapter(model, "a", "prefix" if kind == "prefix" else kind, **options)
    task = model.task_modules.tasks["a"]
    with torch.no_grad():
        if kind == "prefix":
            stem = "prefix_tuning.prefix_tunings.prefix.self_prefix."
            task.embedding.weight.copy_(weights[stem + "wte.weight"])
            for j in (0, 2):
                task.mlp[j].weight.copy_(weights[stem + f"control_trans.{j}.weight"])
                task.mlp[j].bias.copy_(weights[stem + f"control_trans.{j}.bias"])
        else:
            assert len(weights) == 4 * model.config.num_hidden_layers * (2 if kind == "houlsby" else 1)
            for name, value in weights.items():  # encoder.layer.{i}.{attention.output|output}.adapters.{k}.adapter_{down.0|up}.{w|b}
                parts = name.split(".")
                adapter = (task.attn if parts[3] == "attention" else task.ffn)[int(parts[2])]
                linear = adapter.down if "adapter_down" in name else adapter.up
                getattr(linear, parts[-1]).copy_(value)
    return model, batch, hidden, tensors


def assert_hidden_close(out, hidden, mask):
    assert len(out.hidden_states) == len(hidden)
    for i, h in enumerate(out.hidden_states):
        assert (h - hidden[str(i)])[mask].abs().max().item() <= TOL, i


@pytest.mark.parametrize("kind", ["houlsby", "pfeiffer"])
def test_bottleneck_adapters_match_adapterhub(kind):
    model, batch, hidden, _ = with_adapterhub_weights(kind, reduction_factor=4)
    mask = batch["attention_mask"].bool()
    assert_hidden_close(model(**batch), hidden, mask)
    assert_hidden_close(model(**batch, fast=True), hidden, mask)  # the fast path runs the readable one here
    set_active(model, None)  # the plain base: not the adapted output (the adapters matter in the reference)
    assert (model(**batch).last_hidden_state - hidden["3"])[mask].abs().max() > 0.05


def test_prefix_tuning_matches_adapterhub_with_and_without_the_mlp():
    model, batch, hidden, tensors = with_adapterhub_weights("prefix", prefix_length=5, prefix_bottleneck=24)
    mask = batch["attention_mask"].bool()
    assert_hidden_close(model(**batch), hidden, mask)
    flatten_prefix(model)
    ejected = {k[len("ejected_hidden_states."):]: v for k, v in tensors.items() if k.startswith("ejected_hidden_states.")}
    assert_hidden_close(model(**batch), ejected, mask)
    flat = tensors["ejected.prefix_tuning.prefix_tunings.prefix.self_prefix.control_trans"]  # (P, L, 2, H) flat
    task = model.task_modules.tasks["a"]
    assert torch.allclose(flat.view(5, 3, 2, 32).permute(1, 2, 0, 3), task.prefix, atol=1e-6)
    assert task.mlp is None and task.embedding is None


def test_prefix_tuning_matches_peft_whose_positions_start_after_the_prefix():
    peft = pytest.importorskip("peft")
    hf = transformers.BertModel.from_pretrained(DATA / "base").eval()
    config = peft.PrefixTuningConfig(task_type=peft.TaskType.FEATURE_EXTRACTION, num_virtual_tokens=4,
                                     prefix_projection=True, encoder_hidden_size=16)
    wrapped = peft.get_peft_model(hf, config)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in wrapped.prompt_encoder.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.3)
    wrapped.eval()
    ids = torch.tensor([[2, 17, 33, 41, 9, 3], [2, 8, 19, 3, 0, 0]])
    am = (ids != 0).long()
    theirs = wrapped(input_ids=ids, attention_mask=am).last_hidden_state
    ours = BertModel.from_pretrained(DATA / "base").eval()
    add_adapter(ours, "p", "prefix", prefix_length=4, prefix_bottleneck=16)
    task, encoder = ours.task_modules.tasks["p"], wrapped.prompt_encoder.default
    with torch.no_grad():
        task.embedding.weight.copy_(encoder.embedding.weight)
        for j in (0, 2):
            task.mlp[j].weight.copy_(encoder.transform[j].weight)
            task.mlp[j].bias.copy_(encoder.transform[j].bias)
    mask = am.bool()
    # transformers' BertModel (5.x) numbers positions after the cached (prefix) length under peft: P, P+1, ...;
    # ours (and AdapterHub's) start at 0. One of the two numberings must match peft to 1e-5.
    gaps = {start: float((ours(ids, am, position_ids=torch.arange(start, start + ids.shape[1])).last_hidden_state
                          - theirs)[mask].abs().max()) for start in (0, 4)}
    assert min(gaps.values()) <= TOL, gaps
    assert max(gaps.values()) > 1e-3  # the numbering matters: the comparison can tell them apart


def test_lora_task_module_equals_apply_lora():
    from minibert.training.lora import apply_lora

    base = BertModel.from_pretrained(DATA / "base").eval()
    one = apply_lora(copy.deepcopy(base), r=4, alpha=8, targets=("query", "value", "dense_in"))
    many = copy.deepcopy(base)
    add_adapter(many, "l", "lora", r=4, alpha=8, targets=("query", "value", "dense_in"))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, module in one.named_modules():
            if hasattr(module, "lora_A"):
                module.lora_B.normal_(generator=generator)
                pair = many.task_modules.tasks["l"].pair(name)
                pair.lora_A.copy_(module.lora_A)
                pair.lora_B.copy_(module.lora_B)
    _, batch, _, _ = reference("houlsby")
    mask = batch["attention_mask"].bool()
    assert (one(**batch).last_hidden_state - many(**batch).last_hidden_state)[mask].abs().max() <= TOL
    assert (base(**batch).last_hidden_state - many(**batch).last_hidden_state)[mask].abs().max() > 1e-3


def tiny_head():
    return BertForSequenceClassification.from_encoder(DATA / "base", labels=["no", "yes"], seed=0).eval()


def test_a_task_module_with_its_own_pooler_saves_loads_and_leaves_the_base_alone(tmp_path):
    """pooler=True (the finetune prefix recipe's): the module carries a trained copy of the base's pooler that
    stands in for it while the module is active; the base's own is neither changed nor trained."""
    _, batch, _, _ = reference("houlsby")
    model = tiny_head()
    with torch.no_grad():
        plain = model.bert(**batch).pooler_output
    for kind, options in (("prefix", {"prefix_length": 3, "prefix_bottleneck": 8}), ("houlsby", {"bottleneck": 4})):
        add_adapter(model, kind, kind, pooler=True, **options)
        own = model.bert.task_modules.tasks[kind].pooler
        assert torch.equal(own.weight, model.bert.pooler.dense.weight) and own.weight is not model.bert.pooler.dense.weight
        assert own.weight.requires_grad and not model.bert.pooler.dense.weight.requires_grad
        with torch.no_grad():
            own.weight.add_(0.05 * torch.randn_like(own.weight))
            logits = model(**batch).logits
            assert not torch.allclose(model.bert(**batch).pooler_output, plain)  # the module's pooler stands in
        save_adapter(model, kind, tmp_path / kind)
        assert json.loads((tmp_path / kind / CONFIG_FILE).read_text())["options"]["pooler"] is True
        again = load_adapter(tiny_head(), tmp_path / kind)
        with torch.no_grad():
            assert torch.equal(again(**batch).logits, logits)
    set_active(model, None)
    with torch.no_grad():
        assert torch.equal(model.bert(**batch).pooler_output, plain)  # the base's pooler, untouched
    bare = BertForSequenceClassification.from_encoder(DATA / "base", labels=["no", "yes"], seed=0)
    bare.bert.pooler = None  # a base without a pooler (a masked LM's): the module brings a new one and fills
    add_adapter(bare, "p", "prefix", pooler=True)  # pooler_output itself (issue 61)
    with torch.no_grad():
        out = bare.bert(**batch)
    own = bare.bert.task_modules.tasks["p"].pooler
    assert torch.equal(out.pooler_output, torch.tanh(own(out.last_hidden_state[:, 0])))
    remove_adapter(bare, "p")
    with pytest.raises(InputError, match="prefix_length: not an option of a houlsby module; it takes bottleneck"):
        add_adapter(bare, "h", "houlsby", prefix_length=3)  # another kind's option, refused rather than ignored


def test_many_tasks_on_one_base_switch_save_and_load(tmp_path):
    model = tiny_head()
    base_state = {k: v.clone() for k, v in model.bert.state_dict().items()}
    add_adapter(model, "h", "houlsby", bottleneck=8, init="bert")
    add_adapter(model, "p", "prefix", prefix_length=3, prefix_bottleneck=8)
    add_adapter(model, "l", "lora", r=2, targets="*.ffn.*")
    add_adapter(model, "f", "pfeiffer", bottleneck=8, init="houlsby")
    assert task_names(model) == ["h", "p", "l", "f"]
    trainable, total = trainable_parameters(model)
    tasks = model.bert.task_modules.tasks
    assert trainable == sum(p.numel() for p in tasks["f"].parameters()) + 2 * 32 + 2  # the newest and the head
    set_active(model, "h")
    assert trainable_parameters(model)[0] == sum(p.numel() for p in tasks["h"].parameters()) + 2 * 32 + 2
    assert all(not p.requires_grad for n, p in model.bert.named_parameters() if not n.startswith("task_modules."))
    _, batch, _, _ = reference("houlsby")
    with torch.no_grad():
        model.bert.task_modules.tasks["l"].pairs["encoder__blocks__0__ffn__dense_in"].lora_B.normal_()
        outputs = {}
        for name in task_names(model) + [None]:
            set_active(model, name)
            outputs[name] = model(**batch).logits.clone()
    assert all(not torch.equal(outputs[a], outputs[None]) for a in ("h", "p", "l", "f"))
    for name in task_names(model):
        save_adapter(model, name, tmp_path / name)
    size = sum(f.stat().st_size for f in (tmp_path / "h").iterdir())
    assert size < 60_000 and json.loads((tmp_path / "h" / CONFIG_FILE).read_text())["head"]["id2label"] == {"0": "no", "1": "yes"}
    # a fresh base takes them back, one by one or several at once: the same outputs
    for name in ("h", "p", "l", "f"):
        again = tiny_head()
        load_adapter(again, tmp_path / name)
        with torch.no_grad():
            assert torch.allclose(again(**batch).logits, outputs[name], atol=TOL), name
    shared = BertModel.from_pretrained(DATA / "base").eval()
    heads = {name: task_head(shared, tmp_path / name) for name in ("h", "p", "l", "f")}
    with torch.no_grad():
        for name, head in heads.items():
            set_active(shared, name)
            assert head.bert is shared and torch.allclose(head(**batch).logits, outputs[name], atol=TOL)
    assert {k: v for k, v in model.bert.state_dict().items() if not k.startswith("task_modules.")}.keys() == base_state.keys()
    assert all(torch.equal(model.bert.state_dict()[k], v) for k, v in base_state.items())  # the base untouched
    # refusals: another base, a wrong name, a double name, save_pretrained of an adapted model
    other = BertModel.from_pretrained(DATA / "base")
    with torch.no_grad():
        other.encoder.blocks[0].ffn.dense_in.weight.add_(1e-3)
    with pytest.raises(InputError, match="another base"):
        load_adapter(other, tmp_path / "h")
    assert task_names(other) == []
    with pytest.raises(InputError, match="no task module named 'x'"):
        set_active(model, "x")
    with pytest.raises(InputError, match="already has a task module named 'h'"):
        add_adapter(model, "h", "houlsby")
    with pytest.raises(InputError, match="task modules"):
        model.save_pretrained(tmp_path / "whole")
    remove_adapter(model, "h")
    assert task_names(model) == ["p", "l", "f"]


def test_training_moves_only_the_task_module_and_the_head():
    model = tiny_head().train()
    add_adapter(model, "p", "prefix", prefix_length=3, prefix_bottleneck=8)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    _, batch, _, _ = reference("houlsby")
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    loss = model(**batch, labels=torch.tensor([0, 1, 1])).loss
    loss.backward()
    optimizer.step()
    changed = {k for k, v in model.state_dict().items() if not torch.equal(v, before[k])}
    assert changed and all(k.startswith(("bert.task_modules.", "classifier.")) for k in changed)
    assert any(k.startswith("bert.task_modules.tasks.p.mlp") for k in changed)


def test_tools_on_an_adapted_model():
    from minibert.quantize import quantize_linears

    model, batch, hidden, _ = with_adapterhub_weights("houlsby", reduction_factor=4)
    mask = batch["attention_mask"].bool()
    # the adapters' own hook points, in run_with_cache: block 2's output is LayerNorm(h + the adapter's output)
    out, cache = model.run_with_cache(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"],
                                      names=["task_modules.tasks.a.ffn.*.output", "blocks.2.attn_norm"])
    assert len(cache) == 4
    block = model.encoder.blocks[2]
    rebuilt = block.ffn_norm(cache["blocks.2.attn_norm"] + cache["task_modules.tasks.a.ffn.2.output"])
    assert torch.allclose(rebuilt, out.hidden_states[3], atol=TOL)
    # a copy is independent: switching it off leaves the original adapted
    twin = copy.deepcopy(model)
    set_active(twin, None)
    assert_hidden_close(model(**batch), hidden, mask)
    assert (twin(**batch).last_hidden_state - hidden["3"])[mask].abs().max() > 0.05
    # bf16: the adapters follow the base's dtype
    half = BertModel.from_pretrained(DATA / "base", dtype=torch.bfloat16).eval()
    add_adapter(half, "b", "houlsby", bottleneck=8)
    assert half(**batch).last_hidden_state.dtype == torch.bfloat16
    # int8 base: adapters and prefixes run, LoRA task modules are refused by name
    q = quantize_linears(copy.deepcopy(model))
    assert (q(**batch).last_hidden_state - hidden["3"])[mask].abs().max() < 0.1
    with pytest.raises(InputError, match="int8"):
        add_adapter(q, "l", "lora")


def test_bad_arguments_are_named():
    model = BertModel.from_pretrained(DATA / "base")
    for kwargs, message in [({"kind": "ia4"}, "kind='ia4'"), ({"bottleneck": 0}, "bottleneck"),
                            ({"init": "zeros"}, "init='zeros'"), ({"nonlinearity": "cube"}, "nonlinearity='cube'"),
                            ({"kind": "prefix", "prefix_length": -1}, "prefix_length"),
                            ({"kind": "lora", "targets": "nothing_here"}, "matches no linear layer")]:
        with pytest.raises(InputError, match=message):
            add_adapter(model, "x", **kwargs)
        assert task_names(model) == []
    with pytest.raises(InputError, match="identifier"):
        add_adapter(model, "two words")


def test_finetune_recipes_write_the_task_module_and_predict_runs_several(tmp_path, capsys):
    from conftest import toy_rows, write_csv

    base = tmp_path / "base"
    shutil.copytree(DATA / "base", base)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(5, 120)]
    words = ["the", "day", "was", "and", "hot", "cold", "good", "great", "fine", "nice", "bad", "awful", "poor", "sad"]
    vocab[5:5 + len(words)] = words
    (base / "vocab.txt").write_text("\n".join(vocab) + "\n", encoding="utf-8")
    train = write_csv(tmp_path / "train.csv", toy_rows(16, 0))
    held = write_csv(tmp_path / "test.csv", toy_rows(8, 1))
    outs = []
    for recipe, extra in [("adapter", ["--adapter-size", "8"]), ("prefix", ["--prefix-length", "4"]),
                          ("lora", ["--lora-targets", "query,value,dense_in"]),
                          ("adapter", ["--adapter-kind", "pfeiffer", "--adapter-size", "4"])]:
        out = tmp_path / f"{recipe}-{len(outs)}"
        assert main(["finetune", "--train", str(train), "--eval", str(held), "--model", str(base), "--out", str(out),
                     "--epochs", "2", "--lr", "1e-2", "--recipe", recipe, *extra, "--max-length", "16", "--quiet"]) == 0
        assert (out / CONFIG_FILE).exists() and not (out / "model.safetensors").exists()
        assert sum(f.stat().st_size for f in out.iterdir()) < 100_000  # the base is named, not copied
        outs.append(out)
    (tmp_path / "new.txt").write_text("the day was great\n\nthe day was awful\n", encoding="utf-8")
    capsys.readouterr()
    assert main(["predict", str(outs[0]), str(tmp_path / "new.txt")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3 and lines[1] == "" and lines[0].split("\t")[0] in ("neg", "pos")
    assert main(["predict", *map(str, outs), str(tmp_path / "new.txt"), "--model", str(base)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 12 and [line.split("\t")[0] for line in lines if line] == \
        [o.name.replace("-", "_") for o in outs for _ in range(2)]
    assert main(["finetune", "--train", str(train), "--eval", str(held), "--model", str(base), "--out",
                 str(tmp_path / "merged"), "--epochs", "1", "--recipe", "lora", "--merge-lora", "--max-length", "16",
                 "--quiet"]) == 0
    assert BertForSequenceClassification.from_pretrained(tmp_path / "merged").config.id2label == {0: "neg", 1: "pos"}


def test_a_trained_prefix_model_copies_and_its_mlp_runs_once_a_pass():
    model = tiny_head().train()
    add_adapter(model, "p", "prefix", prefix_length=3, prefix_bottleneck=8)
    _, batch, _, _ = reference("houlsby")
    calls = []
    model.bert.task_modules.tasks["p"].mlp.register_forward_hook(lambda *a: calls.append(1))
    model(**batch, labels=torch.tensor([0, 1, 1])).loss.backward()
    assert len(calls) == 1  # one MLP pass for the three blocks
    twin = copy.deepcopy(model)  # after a training pass: the cached prefixes are not copied
    model.eval(), twin.eval()
    with torch.no_grad():
        assert torch.equal(twin(**batch).logits, model(**batch).logits)
