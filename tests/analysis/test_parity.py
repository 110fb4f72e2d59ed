"""Parity as a product (issue 7): `minibert parity`, `minibert.testing.assert_bert_close`, the masked-LM
head (today's and the legacy layouts), fill-mask and the logit lens."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import hf_config, random_hf_model, save_legacy, transformers
from minibert import BertModel, BertTokenizer
from minibert.cli import main
from minibert.analysis.lens import fill_mask, logit_lens
from minibert.testing import assert_bert_close, bert_parity

SMALL = dict(vocab_size=30522, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, intermediate_size=128)


@pytest.fixture(scope="module")
def perturbed_dir(minilm_dir, tmp_path_factory):
    """A copy of MiniLM with one tensor of block 3 (its FFN output weight) perturbed by 1e-3."""
    directory = tmp_path_factory.mktemp("minilm_perturbed")
    for f in minilm_dir.iterdir():
        if f.is_file() and f.name != "model.safetensors":
            shutil.copy(f, directory / f.name)
    state = load_file(minilm_dir / "model.safetensors")
    name = next(n for n in state if n.endswith("encoder.layer.3.output.dense.weight"))
    g = torch.Generator().manual_seed(0)
    state[name] = state[name] + 1e-3 * torch.randn(state[name].shape, generator=g)
    save_file(state, directory / "model.safetensors", metadata={"format": "pt"})
    return directory


@pytest.fixture(scope="module")
def mlm_dirs(tmp_path_factory, minilm_dir):
    """Random masked-LM checkpoints saved by transformers: today's layout (BertForMaskedLM.save_pretrained,
    decoder tied and not stored) and the legacy pre-training layout (bert. prefix, gamma/beta, NSP head,
    stored decoder weight). The MiniLM vocabulary is copied in so text can be tokenised."""
    root = tmp_path_factory.mktemp("mlm")
    today = random_hf_model(hf_config(**SMALL), seed=3, cls=transformers.BertForMaskedLM)
    with torch.no_grad():
        today.cls.predictions.bias.normal_(0, 0.5)  # non-zero so a missing bias shows
    today.save_pretrained(root / "today")
    legacy = random_hf_model(hf_config(**SMALL), seed=4, cls=transformers.BertForPreTraining)
    with torch.no_grad():
        legacy.cls.predictions.bias.normal_(0, 0.5)
    save_legacy(legacy, root / "legacy")
    for d in ("today", "legacy"):
        shutil.copy(minilm_dir / "vocab.txt", root / d / "vocab.txt")
    return {"today": root / "today", "legacy": root / "legacy"}


# ------------------------------------------------------------------------------------------ parity CLI
def test_parity_cli_on_minilm_passes(minilm_dir, capsys, tmp_path):
    out_json = tmp_path / "parity.json"
    code = main(["parity", "--model", str(minilm_dir), "--json", str(out_json)])
    text = capsys.readouterr().out
    assert code == 0, text
    for row in ["embeddings", "block 0", "block 5", "pooler", "result: PASS"]:
        assert row in text
    data = json.loads(out_json.read_text())
    assert data["ok"] and data["first_divergent"] is None
    assert [r["layer"] for r in data["rows"]] == ["embeddings"] + [f"block {i}" for i in range(6)] + ["pooler"]
    assert max(r["hidden_max"] for r in data["rows"]) <= 1e-5
    assert all(r["attention_max"] is not None for r in data["rows"][1:-1])


def test_parity_cli_names_the_perturbed_block(minilm_dir, perturbed_dir, capsys, tmp_path):
    code = main(["parity", "--model", str(minilm_dir), "--against", str(perturbed_dir),
                 "--json", str(tmp_path / "p.json"), "--device", "cpu"])  # --device: as every inference command
    text = capsys.readouterr().out
    assert code == 1, text
    assert "first layer over 1e-05: block 3" in text
    assert "block 3" in text.split("<- first divergent")[0].splitlines()[-1]
    data = json.loads((tmp_path / "p.json").read_text())
    assert data["first_divergent"] == "block 3"
    rows = {r["layer"]: r for r in data["rows"]}
    assert rows["block 2"]["hidden_max"] == 0.0 and rows["block 3"]["hidden_max"] > 1e-5


def test_parity_cli_user_texts_dtype_and_errors(minilm_dir, capsys, tmp_path):
    texts = tmp_path / "texts.txt"
    texts.write_text("One line.\n\nA second, longer line of text here.\n")
    assert main(["parity", "--model", str(minilm_dir), "--texts", str(texts), "--dtype", "bf16"]) == 0
    text = capsys.readouterr().out
    assert "bf16, 2 inputs" in text
    with pytest.raises(SystemExit) as e:
        main(["parity", "--model", str(tmp_path / "nowhere")])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        main(["parity", "--model", str(minilm_dir), "--against", str(tmp_path / "nowhere")])
    assert e.value.code == 2


# ------------------------------------------------------------------------------------------ the helper
def test_assert_bert_close_passes_and_fails_with_the_table(minilm_dir, perturbed_dir):
    report = assert_bert_close(minilm_dir, minilm_dir)
    assert report.ok and report.rows[-1].hidden_max == 0.0
    reference = transformers.BertModel.from_pretrained(minilm_dir, attn_implementation="eager").eval()
    assert_bert_close(BertModel.from_pretrained(minilm_dir), reference,
                      tokenizer=BertTokenizer.from_pretrained(minilm_dir), texts=["Any text at all."])
    with pytest.raises(AssertionError) as e:
        assert_bert_close(minilm_dir, perturbed_dir, texts=["The bank approved the loan."])
    message = str(e.value)
    assert "block 3" in message and "<- first divergent" in message and "hidden max" in message
    assert "FAIL" in message


def test_parity_counts_nan_as_divergent(minilm_dir):
    model = BertModel.from_pretrained(minilm_dir)
    broken = BertModel.from_pretrained(minilm_dir)
    with torch.no_grad():
        broken.encoder.blocks[1].attn.output.bias.fill_(float("nan"))
    report = bert_parity(model, broken, tokenizer=BertTokenizer.from_pretrained(minilm_dir), texts=["Hello."])
    assert report.first_divergent == "block 1"


# ---------------------------------------------------------------------------------------- masked-LM head
@pytest.mark.parametrize("layout", ["today", "legacy"])
def test_mlm_logits_match_transformers(mlm_dirs, layout):
    directory = mlm_dirs[layout]
    ours = BertModel.from_pretrained(directory)
    assert ours.mlm_head is not None
    assert not any(n.startswith("cls.predictions.") for n in ours.skipped_tensors)
    if layout == "legacy":
        assert ours.skipped_tensors == ["cls.seq_relationship.bias", "cls.seq_relationship.weight"]
        reference = transformers.BertForPreTraining.from_pretrained(directory).eval()
    else:
        reference = transformers.BertForMaskedLM.from_pretrained(directory).eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 30522, (3, 11), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    mask[2, 3:] = 0
    with torch.no_grad():
        logits = ours.mlm_logits(ours(ids, mask).last_hidden_state)
        out = reference(input_ids=ids, attention_mask=mask)
        ref = out.logits if layout == "today" else out.prediction_logits
    valid = mask.bool()
    assert logits.shape == ref.shape
    assert (logits - ref)[valid].abs().max() <= 1e-5


def test_mlm_head_round_trips_through_save(mlm_dirs, tmp_path):
    ours = BertModel.from_pretrained(mlm_dirs["legacy"])
    ours.save_pretrained(tmp_path)
    again = BertModel.from_pretrained(tmp_path)
    reference = transformers.BertForMaskedLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(1, 30522, (2, 9))
    with torch.no_grad():
        a = ours.mlm_logits(ours(ids).last_hidden_state)
        b = again.mlm_logits(again(ids).last_hidden_state)
        c = reference(input_ids=ids).logits
    assert torch.equal(a, b)
    assert (a - c).abs().max() <= 1e-5
    # the encoder stays usable without the head
    plain = BertModel.from_pretrained(tmp_path, mlm_head=False)
    assert plain.mlm_head is None and any(n.startswith("cls.predictions.") for n in plain.skipped_tensors)


def test_untied_decoder_is_refused(mlm_dirs, tmp_path):
    state = load_file(mlm_dirs["legacy"] / "model.safetensors")
    state["cls.predictions.decoder.weight"] = state["cls.predictions.decoder.weight"] + 1.0
    for f in mlm_dirs["legacy"].iterdir():
        shutil.copy(f, tmp_path / f.name)
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="cls.predictions.decoder.weight differs"):
        BertModel.from_pretrained(tmp_path)
    assert BertModel.from_pretrained(tmp_path, mlm_head=False).mlm_head is None


def test_no_mlm_head_is_told_plainly(minilm_dir, capsys):
    model = BertModel.from_pretrained(minilm_dir)
    assert model.mlm_head is None
    with pytest.raises(ValueError, match="no masked-LM head"):
        model.mlm_logits(torch.zeros(384))
    with pytest.raises(ValueError, match="no masked-LM head"):
        BertModel.from_pretrained(minilm_dir, mlm_head=True)
    with pytest.raises(SystemExit) as e:
        main(["fill", "The capital of France is [MASK].", "--model", str(minilm_dir)])
    assert e.value.code == 2
    assert "no masked-LM head" in capsys.readouterr().err


# ------------------------------------------------------------------------------------ fill and the lens
def test_fill_mask_matches_transformers_top_k(mlm_dirs):
    directory = mlm_dirs["today"]
    model, tok = BertModel.from_pretrained(directory), BertTokenizer.from_pretrained(directory)
    reference = transformers.BertForMaskedLM.from_pretrained(directory).eval()
    texts = ["The capital of France is [MASK].", "[MASK] went to the [MASK] yesterday."]
    results = fill_mask(model, tok, texts, top_k=3)
    assert [len(r) for r in results] == [1, 2]
    batch = tok(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        logits = reference(**batch).logits
    mask_id = tok.vocab["[MASK]"]
    for b, per_text in enumerate(results):
        positions = (batch["input_ids"][b] == mask_id).nonzero().flatten().tolist()
        for t, predictions in zip(positions, per_text):
            probs = logits[b, t].softmax(-1)
            p, ids = probs.topk(3)
            assert [tok for tok, _ in predictions] == tok.convert_ids_to_tokens(ids.tolist())
            assert max(abs(a - float(b_)) for (_, a), b_ in zip(predictions, p)) <= 1e-5


def test_logit_lens_last_row_is_the_prediction(mlm_dirs, capsys, tmp_path):
    directory = mlm_dirs["legacy"]
    model, tok = BertModel.from_pretrained(directory), BertTokenizer.from_pretrained(directory)
    text = "Paris is the [MASK] of France."
    result = logit_lens(model, tok, text)
    assert len(result.rows) == model.config.num_hidden_layers + 1
    top = fill_mask(model, tok, text, top_k=1)[0][0][0][0]  # text 0, mask 0, best (token, p) -> token
    assert result.target == top
    last = result.rows[-1]
    assert last.top_token == result.target and last.target_rank == 1
    assert all(r.target_rank >= 1 for r in result.rows)
    code = main(["fill", text, "--model", str(directory), "--lens", "--plot", str(tmp_path / "lens.png")])
    out = capsys.readouterr().out
    assert code == 0 and "logit lens" in out and (tmp_path / "lens.png").stat().st_size > 1000


def test_parity_without_transformers_says_so(minilm_dir, monkeypatch, capsys):
    import sys

    monkeypatch.setitem(sys.modules, "transformers", None)  # makes `import transformers` fail
    with pytest.raises(SystemExit) as e:
        main(["parity", "--model", str(minilm_dir)])
    assert e.value.code == 2
    assert "needs it installed" in capsys.readouterr().err


def test_parity_checks_its_device_before_any_work(minilm_dir, capsys, tmp_path):
    import torch

    from conftest import cli_error

    if not torch.cuda.is_available():
        assert "sees no CUDA device" in cli_error(capsys, "parity", "--model", minilm_dir, "--device", "cuda",
                                                  "--json", tmp_path / "p.json")
    line = cli_error(capsys, "parity", "--model", minilm_dir, "--device", "cuda:0", "--dtype", "int8")
    assert "int8" in line and "CPU only" in line
    assert not (tmp_path / "p.json").exists()
