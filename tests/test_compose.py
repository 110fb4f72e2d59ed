"""Parts that compose: every tool on every kind of model the library makes, as a matrix.

Each kind of model (plain, int8, LoRA un-merged and merged, a task head's encoder, a distilled student,
an early-exit classifier's encoder, TransformersBertModel, bf16) meets each tool. A pair either works --
and gives what the tool promises on that model -- or is refused with our own error naming why. And no
tool changes the model it is given: its weights, module classes, config, mode and trainable flags are the
same afterwards.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from conftest import SENTENCES, transformers

from minibert import BertConfig, BertModel, BertTokenizer, InputError
from minibert.compat import SentenceEncoder, TransformersBertModel
from minibert.models import BertForSequenceClassification
from minibert.model import BertModel as TextbookBertModel
from minibert.quantize import quantize_linears
from minibert.tools import fast, hooks, surgery
from minibert.tools.encode import encode_texts
from minibert.training.depth import EarlyExit
from minibert.training.distill import init_student
from minibert.training.lora import apply_lora, merge_lora

KINDS = ["plain", "int8", "lora", "lora_merged", "task_head", "student", "early_exit", "transformers", "bf16",
         "adapters", "prefix", "untied_mlm"]


def tiny_config(**labels) -> BertConfig:
    return BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                      intermediate_size=64, max_position_embeddings=64, **labels)


def perturbed(model):
    """Random weights with LayerNorms away from the identity, so that a mix-up shows."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
    return model.eval()


def make(kind: str):
    """A model of that kind, as the library makes it (the encoder, where the kind wraps one)."""
    torch.manual_seed(0)
    plain = perturbed(BertModel(tiny_config()))
    if kind == "plain":
        return plain
    if kind == "int8":
        return quantize_linears(plain)
    if kind in ("lora", "lora_merged"):
        model = apply_lora(plain, r=2, targets=("query", "value", "dense_in"))
        with torch.no_grad():
            for module in model.modules():
                if hasattr(module, "lora_B"):
                    module.lora_B.normal_(0, 0.1)  # a real update, not the zero start
        return merge_lora(model).eval() if kind == "lora_merged" else model.eval()
    if kind in ("task_head", "early_exit"):
        head = BertForSequenceClassification(tiny_config(id2label={0: "a", 1: "b"}))
        head.bert = plain
        if kind == "early_exit":
            return EarlyExit(head, frozen=False).model.bert
        return head.bert
    if kind == "student":
        return init_student(plain, [0, 2]).eval()
    if kind == "transformers":
        return TransformersBertModel.from_model(plain)
    if kind == "bf16":
        return plain.to(torch.bfloat16)
    if kind == "untied_mlm":  # the encoder of a masked LM with an untied decoder (untied.py), its head on
        from minibert.models.pretraining import BertForMaskedLM

        return perturbed(BertForMaskedLM.from_config(dataclasses.replace(tiny_config(), tie_word_embeddings=False)).bert)
    if kind in ("adapters", "prefix"):  # task modules (training.adapters): three on the base, one active
        from minibert.training.adapters import add_adapter, set_active

        add_adapter(plain, "lora", "lora", r=2, targets=("query", "dense_out"))
        add_adapter(plain, "prefix", "prefix", prefix_length=3, prefix_bottleneck=8)
        add_adapter(plain, "houlsby", "houlsby", bottleneck=4, init="bert")
        with torch.no_grad():
            for name, p in plain.task_modules.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.1)
        return set_active(plain, "houlsby" if kind == "adapters" else "prefix").eval()
    raise KeyError(kind)


@pytest.fixture(scope="module")
def tokenizer(minilm_dir):
    return BertTokenizer.from_pretrained(minilm_dir)


@pytest.fixture(scope="module")
def batch(tokenizer):
    return dict(tokenizer(SENTENCES[:3], padding=True, return_tensors="pt"))


def fingerprint(model) -> dict:
    """What a tool must leave as it found it."""
    return {"state": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "classes": [(n, type(m).__name__) for n, m in model.named_modules()],
            "config": dataclasses.asdict(model.config), "training": model.training,
            "grad": [(n, p.requires_grad) for n, p in model.named_parameters()]}


def assert_unchanged(before: dict, model) -> None:
    after = fingerprint(model)
    assert after["classes"] == before["classes"]
    assert after["config"] == before["config"]
    assert after["training"] == before["training"] and after["grad"] == before["grad"]
    assert after["state"].keys() == before["state"].keys()
    for k, v in before["state"].items():
        assert torch.equal(after["state"][k], v), k


def readable(model, batch):
    """The model's own numbers on the readable path (model.py's forward), whatever calling convention."""
    with torch.no_grad():
        return TextbookBertModel.forward(model, **batch)


def tolerance(kind):
    return {"bf16": 5e-2, "int8": 1e-4}.get(kind, 1e-5)


def real(batch):
    return batch["attention_mask"].bool()


# ------------------------------------------------------------------------------------------- the tools
def tool_fast(model, kind, batch, tokenizer):
    want = readable(model, batch).last_hidden_state
    got = fast.prepare(model)(**batch).last_hidden_state
    assert got.dtype == want.dtype
    scale = want.float().abs().max()
    assert (got.float() - want.float())[real(batch)].abs().max() <= tolerance(kind) * max(1.0, float(scale))


def tool_cache(model, kind, batch, tokenizer):
    names = [f"blocks.{i}.output" for i in range(model.config.num_hidden_layers)]
    out, cache = hooks.run_with_cache(model, **batch, names=names)
    states = readable(model, batch).hidden_states
    assert len(cache) == model.config.num_hidden_layers
    for i in range(model.config.num_hidden_layers):
        assert torch.equal(cache[f"blocks.{i}.output"], states[i + 1])


def tool_ablate(model, kind, batch, tokenizer):
    plain = readable(model, batch).last_hidden_state
    with hooks.ablate_heads(model, {0: [1]}):
        ablated = readable(model, batch).last_hidden_state
    assert not torch.equal(ablated, plain)
    assert torch.equal(readable(model, batch).last_hidden_state, plain)  # undone after the block


def tool_patch(model, kind, batch, tokenizer):
    _, cache = hooks.run_with_cache(model, **batch, names="blocks.1.output")
    other = dict(batch, input_ids=batch["input_ids"].flip(0), attention_mask=batch["attention_mask"].flip(0))
    with hooks.patch(model, cache):
        patched = readable(model, other)
    assert torch.equal(patched.hidden_states[2], cache["blocks.1.output"])


def tool_torch_hook(model, kind, batch, tokenizer):
    """torch's own module hooks (what captum uses) fire at hook points and blocks, on every path."""
    seen = []
    handles = [model.encoder.blocks[1].attn.hook_probs.register_forward_hook(lambda m, i, o: seen.append("probs")),
               model.encoder.blocks[-1].register_forward_hook(lambda m, i, o: seen.append("block"))]
    try:
        readable(model, batch)
        assert seen == ["probs", "block"]
        fast.prepare(model)(**batch)  # the fast path steps aside for them
        assert seen == ["probs", "block"] * 2
    finally:
        for h in handles:
            h.remove()


def tool_keep_blocks(model, kind, batch, tokenizer):
    cut = surgery.keep_blocks(model, [0, 1])
    assert type(cut) is type(model) and cut.config.num_hidden_layers == 2
    want, got = readable(model, batch).hidden_states, readable(cut, batch).hidden_states
    assert len(got) == 3 and all(torch.equal(a, b) for a, b in zip(got, want[:3]))


def tool_parameter_counts(model, kind, batch, tokenizer):
    from minibert.tools import accounting

    counts = accounting.parameter_counts(model)
    assert counts["total"] == sum(p.numel() for p in model.parameters())


def tool_encode_texts(model, kind, batch, tokenizer):
    vectors = encode_texts(model, tokenizer, SENTENCES[:3], pooling="mean")
    states = readable(model, batch).last_hidden_state.float()
    mask = batch["attention_mask"][..., None].float()
    want = (states * mask).sum(1) / mask.sum(1)
    assert vectors.shape == (3, model.config.hidden_size) and vectors.dtype == torch.float32
    assert (vectors - want).abs().max() <= tolerance(kind) * max(1.0, float(want.abs().max()))


def tool_sentence_encoder(model, kind, batch, tokenizer):
    vectors = SentenceEncoder(model, tokenizer).encode(SENTENCES[:3], convert_to_tensor=True)
    assert torch.allclose(vectors, encode_texts(model, tokenizer, SENTENCES[:3], pooling="mean"), atol=1e-6)


def tool_probing_features(model, kind, batch, tokenizer):
    from minibert.analysis.probing import extract_word_features

    features, index = extract_word_features(model, tokenizer, [["The", "cat", "sat"]], progress=False)
    assert features.shape[:2] == (model.config.num_hidden_layers + 1, 3) and len(index) == 3


def tool_save_load(model, kind, batch, tokenizer, tmp_path):
    if kind == "int8":
        with pytest.raises(InputError, match="int8"):
            model.save_pretrained(tmp_path)
        return
    if kind == "lora":
        with pytest.raises(InputError, match="merge_lora"):
            model.save_pretrained(tmp_path)
        return
    if kind in ("adapters", "prefix"):
        with pytest.raises(InputError, match="save_adapter"):
            model.save_pretrained(tmp_path)
        return
    model.save_pretrained(tmp_path)
    again = BertModel.from_pretrained(tmp_path, dtype=model.dtype)
    assert torch.equal(readable(again, batch).last_hidden_state, readable(model, batch).last_hidden_state)
    if model.mlm_head is not None:  # a masked LM's head comes back as it was (an untied one with its decoder)
        h = readable(model, batch).last_hidden_state
        assert type(again.mlm_head) is type(model.mlm_head)
        assert torch.equal(again.mlm_logits(h), model.mlm_logits(h))


def tool_transformers_view(model, kind, batch, tokenizer):
    view = TransformersBertModel.from_model(model)
    out = view(**batch, output_hidden_states=True)
    assert torch.equal(out.last_hidden_state, readable(model, batch).last_hidden_state)
    assert view.encoder.layer[0].attention.self.query.weight.shape[0] == model.config.hidden_size


def tool_lora(model, kind, batch, tokenizer):
    if kind == "int8":
        with pytest.raises(InputError, match="int8"):
            apply_lora(copy.deepcopy(model))
        return
    if kind == "lora":
        with pytest.raises(InputError, match="already has LoRA"):
            apply_lora(copy.deepcopy(model))
        return
    adapted = apply_lora(copy.deepcopy(model), targets=("key", "dense_out"))
    assert torch.equal(readable(adapted, batch).last_hidden_state, readable(model, batch).last_hidden_state)


def tool_int8(model, kind, batch, tokenizer):
    if kind == "lora":
        with pytest.raises(InputError, match="merge_lora"):
            quantize_linears(copy.deepcopy(model))
        return
    if kind == "bf16":
        with pytest.raises(InputError, match="fp32"):
            quantize_linears(copy.deepcopy(model))
        return
    if kind in ("adapters", "prefix"):  # they carry a LoRA task module: its hooks would be dropped
        with pytest.raises(InputError, match="LoRA task module"):
            quantize_linears(copy.deepcopy(model))
        return
    quantised = quantize_linears(copy.deepcopy(model))
    want = readable(model, batch).last_hidden_state
    got = readable(quantised, batch).last_hidden_state
    assert (got - want)[real(batch)].abs().max() < 0.5  # int8 noise; the int8 tests hold it finely


def tool_export_onnx(model, kind, batch, tokenizer, tmp_path):
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnx")
    from minibert.compat.export import to_onnx

    if kind in ("int8", "bf16"):  # torch's quantised operators have no ONNX form; the export is fp32
        with pytest.raises(InputError, match="int8-quantised|bfloat16"):
            to_onnx(model, tmp_path / "g", tokenizer=tokenizer, say=None)
        assert not (tmp_path / "g").exists()
        return
    result = to_onnx(model, tmp_path / "g", tokenizer=tokenizer, hidden_states=True, say=None)
    assert result.checks["model.onnx"]["largest_difference"] < 1e-5  # adapters, prefixes, LoRA traced in
    assert f"hidden_state_{model.config.num_hidden_layers}" in result.outputs


TOOLS = {name[len("tool_"):]: fn for name, fn in dict(globals()).items() if name.startswith("tool_")}


@pytest.mark.parametrize("tool", sorted(TOOLS))
@pytest.mark.parametrize("kind", KINDS)
def test_every_tool_on_every_model(kind, tool, batch, tokenizer, tmp_path):
    model = make(kind)
    assert isinstance(model, BertModel), "every model the library makes is the public minibert.BertModel"
    before = fingerprint(model)
    fn = TOOLS[tool]
    if tool in ("save_load", "export_onnx"):
        fn(model, kind, batch, tokenizer, tmp_path)
    else:
        fn(model, kind, batch, tokenizer)
    assert_unchanged(before, model)


# ---------------------------------------------------------------- one public model, whatever made it
def test_the_library_hands_out_the_public_model(minilm_dir, tmp_path):
    from minibert.training.recipes import ScalarMixClassifier

    task = BertForSequenceClassification.from_encoder(minilm_dir, labels=["a", "b"])
    sentence = SentenceEncoder.from_pretrained(minilm_dir)
    student = init_student(BertModel.from_pretrained(minilm_dir), [0, 5])
    for model in (task.bert, sentence.model, student, surgery.truncate(task.bert, 2), surgery.keep_blocks(task, [0]).bert):
        assert isinstance(model, BertModel) and hasattr(model, "run_with_cache"), type(model)
    encoder = BertModel.from_pretrained(minilm_dir)
    before = fingerprint(encoder)
    mix = ScalarMixClassifier(encoder, ["x", "y", "z"])
    assert_unchanged(before, encoder)  # its config (no labels written in) and its trainable flags
    assert encoder.config.id2label is None and not any(p.requires_grad for p in mix.bert.parameters())
    assert mix.config.num_labels == 3
    mix.save_pretrained(tmp_path)
    assert ScalarMixClassifier.from_pretrained(tmp_path).config.id2label == {0: "x", 1: "y", 2: "z"}


def test_transformers_view_leaves_the_callers_model_alone(minilm_dir):
    model = BertModel.from_pretrained(minilm_dir)
    classes = [type(m) for m in model.modules()]
    view = TransformersBertModel.from_model(model)
    assert [type(m) for m in model.modules()] == classes and type(model) is BertModel
    assert view.embeddings.word_embeddings.weight is model.embeddings.word.weight  # shared weights
    view.encoder.layer = torch.nn.ModuleList(view.encoder.layer[:2])
    assert len(model.encoder.blocks) == 6  # its own module list


# ------------------------------------------------------------------------------------ LoRA, in detail
def test_lora_targets_by_name_and_pattern():
    model = perturbed(BertModel(tiny_config()))
    apply_lora(model, targets=("*.ffn.*", "blocks.0.attn.query"))
    adapted = sorted(n for n, m in model.named_modules() if type(m).__name__ == "LoRALinear")
    assert adapted == sorted([f"encoder.blocks.{i}.ffn.dense_{w}" for i in range(3) for w in ("in", "out")]
                             + ["encoder.blocks.0.attn.query"])
    with pytest.raises(InputError, match="targets: 'nothing' matches no linear layer"):
        apply_lora(perturbed(BertModel(tiny_config())), targets=("nothing",))


def test_lora_on_a_linear_without_bias():
    from minibert.training.lora import LoRALinear

    base = torch.nn.Linear(6, 4, bias=False)
    layer = LoRALinear(base, r=2, alpha=4)
    with torch.no_grad():
        layer.lora_B.normal_()
    x = torch.randn(3, 6)
    merged = layer.merged()
    assert merged.bias is None and layer.bias is None
    torch.testing.assert_close(merged(x), layer(x))
    torch.testing.assert_close(torch.nn.functional.linear(x, layer.weight), layer(x))


def test_lora_fast_path_equals_readable_on_real_weights(minilm_dir, tokenizer):
    model = apply_lora(BertModel.from_pretrained(minilm_dir), targets=("query", "value", "dense_in"))
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "lora_B"):
                module.lora_B.normal_(0, 0.02)
    batch = dict(tokenizer(SENTENCES, padding=True, return_tensors="pt"))
    want = readable(model, batch).last_hidden_state
    got = fast.prepare(model)(**batch).last_hidden_state
    assert (got - want)[real(batch)].abs().max() < 1e-4
    ref = readable(merge_lora(copy.deepcopy(model)), batch).last_hidden_state
    assert (ref - want)[real(batch)].abs().max() < 1e-4


# ------------------------------------------------------------------------------ torch hooks, in detail
def test_torch_hooks_on_hook_points_replace_and_go_away(minilm_dir, tokenizer):
    model = BertModel.from_pretrained(minilm_dir)
    batch = dict(tokenizer(SENTENCES[:2], padding=True, return_tensors="pt"))
    plain = readable(model, batch)
    point = model.encoder.blocks[0].hook_output
    handle = point.register_forward_hook(lambda m, i, o: torch.zeros_like(o))
    assert torch.equal(readable(model, batch).hidden_states[1], torch.zeros_like(plain.hidden_states[1]))
    handle.remove()
    assert not point.torch_hooked
    assert torch.equal(readable(model, batch).last_hidden_state, plain.last_hidden_state)


def test_captum_style_layer_hooks_match_transformers(minilm_dir, tokenizer):
    """What captum's layer methods do: a forward hook on transformers' module names, on both models."""
    ours = TransformersBertModel.from_pretrained(minilm_dir)
    theirs = transformers.BertModel.from_pretrained(str(minilm_dir)).eval()
    batch = dict(tokenizer(SENTENCES[:2], padding=True, return_tensors="pt"))
    got = {}

    def catch(key):
        return lambda m, i, o: got.__setitem__(key, o)
    for tag, model in (("ours", ours), ("theirs", theirs)):
        handles = [model.embeddings.word_embeddings.register_forward_hook(catch((tag, "word"))),
                   model.encoder.layer[2].register_forward_hook(catch((tag, "layer"))),
                   model.encoder.layer[2].attention.self.query.register_forward_hook(catch((tag, "query"))),
                   model.encoder.layer[3].output.LayerNorm.register_forward_hook(catch((tag, "norm")))]
        with torch.no_grad():
            model(**batch)
        for h in handles:
            h.remove()
    for key in ("word", "layer", "query", "norm"):
        assert isinstance(got["ours", key], torch.Tensor), key  # a block returns a tensor, as transformers 5
        torch.testing.assert_close(got["ours", key], got["theirs", key], atol=1e-5, rtol=0)
    torch.testing.assert_close(ours.embeddings(batch["input_ids"]), theirs.embeddings(batch["input_ids"]),
                               atol=1e-6, rtol=0)


def test_bertviz_style_loading(minilm_dir, tokenizer):
    model = TransformersBertModel.from_pretrained(minilm_dir, output_attentions=True)
    theirs = transformers.BertModel.from_pretrained(str(minilm_dir), output_attentions=True,
                                                    attn_implementation="eager").eval()
    ids = tokenizer("The cat sat on the mat.", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        attention, reference = model(ids)[-1], theirs(ids)[-1]
    assert len(attention) == 6
    for a, b in zip(attention, reference):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    with pytest.raises(InputError, match="unsupported argument.*trust_remote_code"):
        TransformersBertModel.from_pretrained(minilm_dir, trust_remote_code=True)


# ------------------------------------------------------------------------ tools people point at BERT
def test_keybert_takes_a_sentence_encoder_as_its_backend(minilm_dir):
    keybert = pytest.importorskip("keybert")
    st = pytest.importorskip("sentence_transformers")
    doc = ("Supervised learning is the machine learning task of learning a function that maps an input to an "
           "output based on example input-output pairs. It infers a function from labeled training data.")
    ours = keybert.KeyBERT(model=SentenceEncoder.from_pretrained(minilm_dir).as_backend("keybert"))
    theirs = keybert.KeyBERT(model=st.SentenceTransformer(str(minilm_dir), device="cpu"))
    got, want = ours.extract_keywords(doc, top_n=5), theirs.extract_keywords(doc, top_n=5)
    assert [w for w, _ in got] == [w for w, _ in want]
    assert all(abs(a - b) < 1e-4 for (_, a), (_, b) in zip(got, want))
    with pytest.raises(InputError, match="keybert, bertopic"):
        SentenceEncoder.from_pretrained(minilm_dir).as_backend("flair")


def test_bertopic_takes_a_sentence_encoder_as_its_backend(minilm_dir):
    bertopic = pytest.importorskip("bertopic")
    st = pytest.importorskip("sentence_transformers")
    from sklearn.cluster import KMeans
    from sklearn.decomposition import PCA

    docs = ([f"the river bank was muddy after the rain {i}" for i in range(10)]
            + [f"the bank approved the loan for the house {i}" for i in range(10)])
    encoder = SentenceEncoder.from_pretrained(minilm_dir)
    calls = []
    real_encode = encoder.encode
    encoder.encode = lambda *a, **k: calls.append(len(a[0])) or real_encode(*a, **k)

    def topic_model(embedding_model):  # small, seeded stand-ins for UMAP and HDBSCAN: 20 documents
        return bertopic.BERTopic(embedding_model=embedding_model, umap_model=PCA(n_components=2, random_state=0),
                                 hdbscan_model=KMeans(n_clusters=2, random_state=0, n_init=10))
    ours = topic_model(encoder.as_backend("bertopic"))
    theirs = topic_model(st.SentenceTransformer(str(minilm_dir), device="cpu"))
    topics, _ = ours.fit_transform(docs)
    assert calls and calls[0] == len(docs)  # our encoder embedded the documents (no model from the hub)
    assert topics == theirs.fit_transform(docs)[0]
    assert [w for w, _ in ours.get_topic(0)] == [w for w, _ in theirs.get_topic(0)]
