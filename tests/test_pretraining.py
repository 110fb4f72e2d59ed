"""Pre-training (issue 31): the heads against transformers', sparse prediction, the token store, masking by
its definition and against transformers' collators, one step equal to transformers', a run killed and
resumed bit for bit, torchrun, the CLI. Tiny geometries and small corpora: seconds each."""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from conftest import cli_error, hf_config, random_hf_model, transformers, usage_error
from minibert import BertForMaskedLM, BertForPreTraining, BertModel, BertTokenizer, InputError
from minibert.training.pretrain_data import (Examples, MaskingRule, TokenStore, continuation_table, mask_tokens,
                                             read_documents)

TINY = dict(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


@pytest.fixture(scope="module")
def tokenizer(minilm_dir):
    return BertTokenizer.from_pretrained(minilm_dir)


@pytest.fixture(scope="module")
def pretraining_dir(tmp_path_factory, minilm_dir):
    """A random BertForPreTraining saved by transformers (MLM and NSP heads), with MiniLM's vocabulary."""
    directory = tmp_path_factory.mktemp("bert_pretraining")
    random_hf_model(hf_config(**TINY), seed=4, cls=transformers.BertForPreTraining).save_pretrained(directory)
    for name in ("vocab.txt", "tokenizer_config.json"):
        shutil.copy(minilm_dir / name, directory / name)
    return directory


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, sentences_dir):
    """Real English sentences (VADER), as documents of 1-4 sentences separated by blank lines."""
    lines = [s for s in (sentences_dir / "train.txt").read_text(encoding="utf-8").split("\n") if s.strip()][:2400]
    folder = tmp_path_factory.mktemp("corpus")
    (folder / "train.txt").write_text(as_documents(lines), encoding="utf-8")
    held = [s for s in (sentences_dir / "held.txt").read_text(encoding="utf-8").split("\n") if s.strip()][:200]
    (folder / "held.txt").write_text("\n".join(held) + "\n", encoding="utf-8")
    return folder


def as_documents(lines: list[str]) -> str:
    """Sentences (one a line) as a corpus file's text: documents of 1-4 sentences separated by blank lines."""
    blocks = ["\n".join(lines[i:i + 1 + j % 4]) for j, i in enumerate(range(0, len(lines), 4))]
    return "\n\n".join(blocks) + "\n"


def _batch(vocab=30522, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, vocab, (3, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[2, 9:] = 0
    labels = torch.full_like(ids, -100)
    chosen = torch.rand(ids.shape, generator=g) < 0.3
    chosen &= mask.bool()
    labels[chosen] = ids[chosen]
    types = (torch.arange(12) >= 6).long().expand(3, 12) * mask
    return dict(input_ids=ids, attention_mask=mask, token_type_ids=types), labels, torch.tensor([0, 1, 1])


# ------------------------------------------------------------------------------------------- the heads
def test_heads_equal_transformers_and_checkpoints_go_both_ways(pretraining_dir, tmp_path):
    batch, labels, nsl = _batch()
    hf_pre = transformers.BertForPreTraining.from_pretrained(pretraining_dir).eval()
    ours = BertForPreTraining.from_pretrained(pretraining_dir).eval()
    with torch.no_grad():
        a = ours(**batch, labels=labels, next_sentence_label=nsl, return_logits=True)
        b = hf_pre(**batch, labels=labels, next_sentence_label=nsl)
    assert (a.prediction_logits - b.prediction_logits).abs().max() <= 1e-5
    assert (a.seq_relationship_logits - b.seq_relationship_logits).abs().max() <= 1e-5
    assert abs(float(a.loss) - float(b.loss)) <= 1e-5
    hf_mlm = transformers.BertForMaskedLM.from_pretrained(pretraining_dir).eval()
    mlm = BertForMaskedLM.from_pretrained(pretraining_dir).eval()
    with torch.no_grad():
        c, d = mlm(**batch, labels=labels, return_logits=True), hf_mlm(**batch, labels=labels)
    assert (c.logits - d.logits).abs().max() <= 1e-5 and abs(float(c.loss) - float(d.loss)) <= 1e-5
    # ours -> transformers, both classes; and an encoder / a classifier start from it
    ours.save_pretrained(tmp_path / "pre")
    assert json.loads((tmp_path / "pre" / "config.json").read_text())["architectures"] == ["BertForPreTraining"]
    back = transformers.BertForPreTraining.from_pretrained(tmp_path / "pre").eval()
    with torch.no_grad():
        e = back(**batch, labels=labels, next_sentence_label=nsl)
    assert (e.prediction_logits - b.prediction_logits).abs().max() == 0 and float(e.loss) == float(b.loss)
    mlm.save_pretrained(tmp_path / "mlm")
    assert transformers.BertForMaskedLM.from_pretrained(tmp_path / "mlm").eval()(**batch).logits.shape == (3, 12, 30522)
    assert BertModel.from_pretrained(tmp_path / "pre").mlm_head is not None
    from minibert import BertForSequenceClassification

    classifier = BertForSequenceClassification.from_encoder(tmp_path / "pre", labels=["a", "b"])
    assert classifier(**batch).logits.shape == (3, 2)
    from minibert import BertConfig

    BertForMaskedLM.from_config(BertConfig(**TINY)).save_pretrained(tmp_path / "scratch")  # no pooler, as transformers'
    with pytest.warns(UserWarning, match="has no pooler, which BertForSequenceClassification classifies"):
        classifier = BertForSequenceClassification.from_encoder(tmp_path / "scratch", labels=["a", "b"], seed=1)
    assert classifier(**batch).logits.shape == (3, 2) and 0.015 < float(classifier.bert.pooler.dense.weight.detach().std()) < 0.025


def test_an_untied_decoder_equals_transformers_and_goes_both_ways(tmp_path):
    """tie_word_embeddings=false (the --untied ablation): transformers' checkpoint (its own
    cls.predictions.decoder.weight) loads to the same logits, loss and gradients, ours saves back to the same
    tensors, a run's scores come from the decoder, not the embeddings, and a tied config refuses a decoder
    that differs from the embeddings."""
    from safetensors.torch import load_file, save_file

    from minibert import BertConfig

    batch, labels, _ = _batch(vocab=120, seed=3)
    small = TINY | dict(vocab_size=120)
    theirs = random_hf_model(hf_config(**small, tie_word_embeddings=False), seed=5, cls=transformers.BertForMaskedLM)
    theirs.save_pretrained(tmp_path / "hf")
    decoder = theirs.cls.predictions.decoder.weight
    assert not torch.equal(decoder, theirs.bert.embeddings.word_embeddings.weight)
    ours = BertForMaskedLM.from_pretrained(tmp_path / "hf").eval()
    assert ours.config.tie_word_embeddings is False and torch.equal(ours.bert.mlm_head.decoder, decoder)
    a, b = ours(**batch, labels=labels, return_logits=True), theirs(**batch, labels=labels)
    assert (a.logits - b.logits).abs().max() <= 1e-5 and abs(a.loss.item() - b.loss.item()) <= 1e-5
    a.loss.backward()
    b.loss.backward()
    assert torch.allclose(ours.bert.mlm_head.decoder.grad, decoder.grad, atol=1e-7, rtol=1e-5)
    assert torch.allclose(ours.bert.embeddings.word.weight.grad, theirs.bert.embeddings.word_embeddings.weight.grad,
                          atol=1e-7, rtol=1e-5)
    ours.save_pretrained(tmp_path / "ours")
    saved, original = load_file(str(tmp_path / "ours" / "model.safetensors")), load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert json.loads((tmp_path / "ours" / "config.json").read_text())["tie_word_embeddings"] is False
    assert sorted(saved) == sorted(k for k in original if "position_ids" not in k)
    # transformers 5 scores an untied head with the decoder's own bias (cls.predictions.bias is then unused):
    # that one is read, and written under both names
    assert all(torch.equal(saved[k], original[k]) for k in saved if k != "cls.predictions.bias")
    assert torch.equal(saved["cls.predictions.bias"], original["cls.predictions.decoder.bias"])
    back = transformers.BertForMaskedLM.from_pretrained(tmp_path / "ours").eval()
    assert (back(**batch).logits - b.logits).abs().max() == 0
    assert (BertModel.from_pretrained(tmp_path / "ours").mlm_logits(a.hidden_states[-1]) - a.logits).abs().max() == 0
    fresh = BertForMaskedLM.from_config(BertConfig(**small, tie_word_embeddings=False), seed=0)
    tied = BertForMaskedLM.from_config(BertConfig(**small), seed=0)
    assert 0.015 < float(fresh.bert.mlm_head.decoder.detach().std()) < 0.025
    assert all(torch.equal(p, tied.bert.state_dict()[k]) for k, p in fresh.bert.state_dict().items()
               if not k.startswith("mlm_head.decoder"))  # the encoder and head start as the tied model's
    config = json.loads((tmp_path / "ours" / "config.json").read_text())
    del config["tie_word_embeddings"]  # now it says tied, but the decoder is not the embeddings
    (tmp_path / "ours" / "config.json").write_text(json.dumps(config))
    with pytest.raises(Exception, match="differs from"):
        BertForMaskedLM.from_pretrained(tmp_path / "ours")
    saved.pop("cls.predictions.decoder.weight")
    save_file(saved, str(tmp_path / "ours" / "model.safetensors"))
    config["tie_word_embeddings"] = False
    (tmp_path / "ours" / "config.json").write_text(json.dumps(config))
    with pytest.raises(Exception, match="missing tensor.*cls.predictions.decoder.weight"):
        BertForMaskedLM.from_pretrained(tmp_path / "ours")


def test_a_checkpoint_without_heads_gets_fresh_ones_and_says_so(minilm_dir):
    with pytest.warns(UserWarning, match=r"no masked-LM head .* fresh one, seed 3"):
        mlm = BertForMaskedLM.from_pretrained(minilm_dir, seed=3)
    assert torch.equal(mlm.bert.mlm_head.norm.weight, torch.ones(384))
    assert 0.015 < float(mlm.bert.mlm_head.transform.weight.std()) < 0.025
    with pytest.warns(UserWarning, match="next-sentence head"):
        pre = BertForPreTraining.from_pretrained(minilm_dir)
    assert pre.nsp.weight.shape == (2, 384)


def test_sparse_prediction_gives_the_dense_loss_and_gradients(pretraining_dir):
    """The vocabulary projection at the masked positions only: the same loss and gradients as projecting
    every position and ignoring the unlabelled ones (transformers' way)."""
    batch, labels, _ = _batch(seed=2)
    sparse, dense = BertForMaskedLM.from_pretrained(pretraining_dir), BertForMaskedLM.from_pretrained(pretraining_dir)
    loss = sparse(**batch, labels=labels).loss
    loss.backward()
    logits = dense(**batch).prediction_logits  # (B, T, V): every position
    reference = F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1), ignore_index=-100)
    reference.backward()
    assert abs(float(loss) - float(reference)) <= 1e-6 * float(reference)
    for (name, p), q in zip(sparse.named_parameters(), dense.parameters()):
        if p.grad is None:  # the pooler: the masked LM does not read it
            assert q.grad is None, name
            continue
        assert torch.allclose(p.grad, q.grad, atol=1e-7, rtol=1e-5), name


# ---------------------------------------------------------------------------------------- the store
def test_the_store_is_built_once_reused_and_refuses_another_vocabulary(corpus, tokenizer, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="minibert")
    store = TokenStore.build([corpus / "train.txt"], tokenizer, tmp_path / "store", progress=False)
    docs = read_documents(corpus / "train.txt")
    assert store.meta["documents"] == len(docs) and store.meta["sentences"] == sum(len(d) for d in docs)
    first = tokenizer(docs[0][0], add_special_tokens=False)["input_ids"]
    assert store.stream[:len(first)].tolist() == first
    TokenStore.build([corpus / "train.txt"], tokenizer, tmp_path / "store", progress=False)
    assert caplog.records[-1].name == "minibert.training.pretrain_data"
    assert caplog.records[-1].getMessage().startswith("reusing the token store")
    other = BertTokenizer(list(tokenizer.vocab)[:-1] + ["[extra]"])
    with pytest.raises(InputError, match="made with another vocabulary"):
        TokenStore.build([corpus / "train.txt"], other, tmp_path / "store", progress=False)
    examples = Examples(store, tokenizer, max_length=32)
    batch = examples.batch(range(8))
    ids, labels = batch["input_ids"], batch["labels"]
    assert ids.shape == (8, 32) and (ids[:, 0] == tokenizer.vocab["[CLS]"]).all() and (ids[:, -1] == 102).all()
    assert torch.equal(examples.batch(range(8))["labels"], labels)  # the same numbers, the same masks
    assert torch.equal(examples.batch(range(4, 8))["input_ids"], ids[4:])  # however batches are cut


def test_bad_corpora_are_one_clear_error(tmp_path, tokenizer):
    cases = {"empty.txt": (b"\n\n  \n", "has no text"), "binary.txt": (b"abc\x00\x01\x02", "NUL bytes"),
             "latin1.txt": ("caf\xe9 au lait\n".encode("latin-1"), "not UTF-8"),
             "bad.jsonl": (b'{"text": 3}\n', "needs an object with a string field 'text'")}
    for name, (data, message) in cases.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(InputError, match=message):
            TokenStore.build([tmp_path / name], tokenizer, tmp_path / f"s-{name}", progress=False)
    (tmp_path / "ok.jsonl").write_text('{"text": "One sentence here. Another one follows."}\n', encoding="utf-8")
    assert read_documents(tmp_path / "ok.jsonl") == [["One sentence here.", "Another one follows."]]


def test_nsp_examples_have_two_segments_and_half_are_random(corpus, tokenizer, tmp_path):
    store = TokenStore.build([corpus / "train.txt"], tokenizer, tmp_path / "store", progress=False)
    examples = Examples(store, tokenizer, max_length=64, nsp=True)
    batch = examples.batch(range(400))
    labels = batch["next_sentence_label"]
    assert 0.4 < float(labels.float().mean()) < 0.6
    for row, types in zip(batch["input_ids"], batch["token_type_ids"]):
        seps = (row == tokenizer.vocab["[SEP]"]).nonzero().flatten().tolist()
        assert len(seps) == 2 and types[seps[0]] == 0 and types[seps[0] + 1] == 1 and types[seps[1]] == 1


# ------------------------------------------------------------------------------------------ masking
def test_masking_rates_are_the_definitions_on_a_million_tokens(tokenizer):
    """15 % of the non-special tokens chosen, of those 80 % [MASK], 10 % random, 10 % unchanged: each rate
    within 5 standard deviations of its binomial expectation; specials never chosen; labels -100 elsewhere."""
    g = torch.Generator().manual_seed(0)
    specials = torch.zeros(30522, dtype=torch.bool)
    specials[[0, 100, 101, 102]] = True
    chosen = replaced = randomised = kept = total = 0
    for i in range(8000):  # 8,000 x 128 = 1,024,000 tokens
        ids = torch.randint(999, 30522, (128,), generator=g)
        ids[0], ids[-1] = 101, 102
        masked, labels = mask_tokens(ids, specials[ids], MaskingRule(), 103, 30522, torch.Generator().manual_seed(i))
        picked = labels != -100
        assert not picked[specials[ids]].any() and torch.equal(labels[picked], ids[picked])
        assert torch.equal(masked[~picked], ids[~picked])
        chosen += int(picked.sum())
        replaced += int((masked[picked] == 103).sum())
        kept += int((masked[picked] == ids[picked]).sum())
        total += int((~specials[ids]).sum())
    randomised = chosen - replaced - kept

    def within(k, n, p):
        return abs(k / n - p) <= 5 * math.sqrt(p * (1 - p) / n)
    assert total >= 1_000_000 and within(chosen, total, 0.15)
    assert within(replaced, chosen, 0.8) and within(kept, chosen, 0.1 + 0.1 / 30522) and within(randomised, chosen, 0.1 - 0.1 / 30522)


def test_masking_matches_transformers_collators(tokenizer, minilm_dir):
    """The same rates and label convention as transformers' DataCollatorForLanguageModeling (plain and
    whole_word_mask=True) on the same input, and whole words always complete."""
    hf_tok = transformers.BertTokenizerFast.from_pretrained(str(minilm_dir))
    texts = ["unbelievable tokenization of extraordinary multisyllabic words happens everywhere"] * 600
    encoded = [hf_tok(t)["input_ids"] for t in texts]
    rates = {}
    for whole in (False, True):
        collator = transformers.DataCollatorForLanguageModeling(hf_tok, mlm_probability=0.15, whole_word_mask=whole)
        torch.manual_seed(0)
        # whole words: transformers groups the pieces by their offsets (no gap between them), which for text
        # without punctuation is the ## rule minibert uses
        features = [dict(hf_tok(t, return_offsets_mapping=True)) if whole else {"input_ids": e}
                    for t, e in zip(texts, encoded)]
        for f in features:
            f.pop("token_type_ids", None), f.pop("attention_mask", None)
        theirs = collator(features)
        table = continuation_table(tokenizer)
        specials = torch.zeros(len(tokenizer.vocab), dtype=torch.bool)
        specials[[0, 100, 101, 102]] = True
        ours_labels = []
        for i, e in enumerate(encoded):
            ids = torch.tensor(e)
            _, labels = mask_tokens(ids, specials[ids], MaskingRule(whole_word=whole), 103, len(tokenizer.vocab),
                                    torch.Generator().manual_seed(i), table)
            ours_labels.append(labels)
            if whole:  # a word is chosen whole or not at all
                word_start = ~table[ids]
                word = torch.cumsum(word_start.long(), 0)
                for w in word.unique():
                    chosen = (labels[word == w] != -100)
                    assert chosen.all() or not chosen.any()
        ours = torch.stack(ours_labels)
        for name, labels in (("ours", ours), ("theirs", theirs["labels"])):
            inputs = torch.tensor(encoded)
            picked = labels != -100
            assert torch.equal(labels[picked], inputs[picked])  # the original id where chosen, -100 elsewhere
            rates[(whole, name)] = float(picked.float().sum() / (~specials[inputs]).sum())
        assert abs(rates[(whole, "ours")] - rates[(whole, "theirs")]) < 0.02, rates
        assert abs(rates[(whole, "ours")] - 0.15) < 0.02


# --------------------------------------------------------------------------------------------- steps
def test_one_pretraining_step_equals_transformers(pretraining_dir):
    """MLM + NSP, the same weights, batch and masks, dropout off: loss, gradients and the weights after one
    AdamW step within 1e-5 of transformers' BertForPreTraining."""
    batch, labels, nsl = _batch(seed=5)
    ours = BertForPreTraining.from_pretrained(pretraining_dir).train()
    theirs = transformers.BertForPreTraining.from_pretrained(pretraining_dir).train()
    from minibert.training.loop import parameter_groups

    opt_a = torch.optim.AdamW(parameter_groups(ours, lr=1e-3), lr=1e-3, betas=(0.9, 0.98), eps=1e-6)
    decay = [p for n, p in theirs.named_parameters() if not n.endswith("bias") and "LayerNorm" not in n]
    rest = [p for n, p in theirs.named_parameters() if n.endswith("bias") or "LayerNorm" in n]
    opt_b = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}],
                              lr=1e-3, betas=(0.9, 0.98), eps=1e-6)
    a = ours(**batch, labels=labels, next_sentence_label=nsl)
    b = theirs(**batch, labels=labels, next_sentence_label=nsl)
    assert abs(float(a.loss) - float(b.loss)) <= 1e-5
    a.loss.backward()
    b.loss.backward()
    grad_a = ours.bert.encoder.blocks[1].ffn.dense_in.weight.grad
    grad_b = theirs.bert.encoder.layer[1].intermediate.dense.weight.grad
    assert (grad_a - grad_b).abs().max() <= 1e-5
    assert (ours.bert.embeddings.word.weight.grad - theirs.bert.embeddings.word_embeddings.weight.grad).abs().max() <= 1e-5
    opt_a.step()
    opt_b.step()
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        ours.save_pretrained(folder)
        after = transformers.BertForPreTraining.from_pretrained(folder).state_dict()
    expected = theirs.state_dict()
    assert max(float((after[k] - expected[k]).abs().max()) for k in expected if k in after) <= 1e-5


RUN = """
import os, signal, sys, torch
from minibert import BertTokenizer
from minibert.runs.pretrain import run_pretraining
from minibert.runs.settings import PretrainRun
corpus, out, mode = sys.argv[1], sys.argv[2], sys.argv[3]
if mode == "kill":
    import minibert.training.pretrain as P
    real = P._save_checkpoint
    def save_then_die(out_dir, state, *rest):
        folder = real(out_dir, state, *rest)
        if state.step == 6:
            os.kill(os.getpid(), signal.SIGKILL)  # after the second checkpoint, mid-run
        return folder
    P._save_checkpoint = save_then_die
run_pretraining(PretrainRun(corpus=[corpus], out=out, layers=2, hidden=32, heads=4, intermediate=64, vocab=sys.argv[4],
                            max_length=24, nsp=True, resume=mode == "resume", steps=10, batch_size=4, accumulate=2,
                            log_every=2, save_every=3, keep=2, lr=2e-3, progress=False))
"""


def test_a_killed_run_resumes_to_the_same_weights_bit_for_bit(corpus, minilm_dir, tmp_path):
    """From scratch with dropout on, NSP, accumulation and a schedule: killed by SIGKILL after step 6 and
    resumed from its newest checkpoint, the run ends with the uninterrupted run's weights, bit for bit."""
    from safetensors.torch import load_file

    env = dict(os.environ, OMP_NUM_THREADS="1")  # the same threads in every run: the same sums

    def start(mode, out):
        with open(tmp_path / f"{mode}.err", "w") as err:  # a file, not a pipe: nothing blocks on a full buffer
            return subprocess.Popen([sys.executable, "-c", RUN, str(corpus / "train.txt"), str(out), mode,
                                     str(minilm_dir)], stdout=subprocess.DEVNULL, stderr=err, env=env)

    def said(mode):
        return (tmp_path / f"{mode}.err").read_text()[-2000:]
    full, killed = start("full", tmp_path / "full"), start("kill", tmp_path / "cut")  # side by side: one core each
    assert full.wait(timeout=300) == 0, said("full")
    assert killed.wait(timeout=300) == -signal.SIGKILL, said("kill")
    assert sorted(p.name for p in (tmp_path / "cut" / "checkpoints").iterdir()) == ["step-000003", "step-000006"]
    assert start("resume", tmp_path / "cut").wait(timeout=300) == 0, said("resume")
    a, b = load_file(tmp_path / "full" / "model.safetensors"), load_file(tmp_path / "cut" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    losses = [[json.loads(x)["loss"] for x in (tmp_path / d / "log.jsonl").read_text().splitlines()]
              for d in ("full", "cut")]
    assert losses[0] == losses[1] and len(losses[0]) == 5  # the log holds each step once, resumed or not
    assert sorted(p.name for p in (tmp_path / "cut" / "checkpoints").iterdir()) == ["step-000009", "step-000010"]


def test_torchrun_two_processes_equal_one(corpus, minilm_dir, tmp_path):
    """gloo on CPU: 2 processes at the same global batch (each reading and masking its half) train the
    weights one process trains, within 1e-5 after 4 steps (dropout off)."""
    from safetensors.torch import load_file

    common = ["pretrain", "--corpus", str(corpus / "train.txt"), "--layers", "2", "--hidden", "32", "--heads", "4",
              "--vocab", str(minilm_dir), "--max-length", "24", "--steps", "4", "--batch-size", "8", "--lr", "2e-3",
              "--dropout", "0", "--quiet"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    one = subprocess.run([sys.executable, "-m", "minibert", *common, "--out", str(tmp_path / "one")],
                         capture_output=True, text=True, env=env, timeout=300)
    assert one.returncode == 0, one.stderr[-2000:]
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                          "-m", "minibert", *common, "--out", str(tmp_path / "two")],
                         capture_output=True, text=True, env=env, timeout=300)
    assert two.returncode == 0, two.stderr[-3000:]
    a, b = load_file(tmp_path / "one" / "model.safetensors"), load_file(tmp_path / "two" / "model.safetensors")
    assert a.keys() == b.keys()
    BertForMaskedLM.from_config(BertModel.from_pretrained(tmp_path / "one").config, seed=0).save_pretrained(tmp_path / "init")
    start = load_file(tmp_path / "init" / "model.safetensors")  # the run's initialisation (seed 0)
    assert max(float((a[k] - start[k]).abs().max()) for k in a) > 1e-3  # the steps did train
    assert max(float((a[k] - b[k]).abs().max()) for k in a) <= 1e-5


# ------------------------------------------------------------------------------------------------ CLI
def test_cli_pretrains_from_scratch_and_fill_reads_the_result(corpus, minilm_dir, tmp_path, capsys):
    from minibert.cli import main

    assert main(["pretrain", "--corpus", str(corpus / "train.txt"), "--out", str(tmp_path / "run"), "--geometry",
                 "tiny", "--vocab", str(minilm_dir), "--max-length", "32", "--steps", "6", "--batch-size", "8",
                 "--eval-texts", str(corpus / "held.txt"), "--eval-every", "3", "--log-every", "3", "--save-every", "3",
                 "--device", "cpu", "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "pre-trained 6 steps" in printed and "perplexity" in printed
    log = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [3, 6] and all("masked_accuracy" in r for r in log)
    assert main(["fill", "The bank raised its [MASK] rates.", "--model", str(tmp_path / "run"), "--top-k", "3"]) == 0
    filled = capsys.readouterr().out
    assert "[MASK] #1:" in filled and filled.count(",") >= 2  # the top 3 candidates from the new head
    student = ["pretrain", "--corpus", str(corpus / "train.txt"), "--out", str(tmp_path / "student"), "--layers", "1",
               "--hidden", "128", "--heads", "2", "--vocab", str(minilm_dir), "--max-length", "32", "--steps", "3",
               "--batch-size", "8", "--teacher", str(tmp_path / "run"), "--alpha", "0.7", "--quiet"]
    assert main(student) == 0 and "pre-trained 3 steps" in capsys.readouterr().out  # distilled from the tiny run
    saved = BertForMaskedLM.from_pretrained(tmp_path / "student")
    assert saved.config.num_hidden_layers == 1 and not any(k.startswith("teacher") for k in saved.state_dict())
    assert "leave out --nsp" in cli_error(capsys, *student[:4], str(tmp_path / "s2"), *student[5:], "--nsp")
    assert "--alpha: must be in [0, 1], got 1.5" in usage_error(capsys, *student[:4], str(tmp_path / "s2"),
                                                                *student[5:-3], "--alpha", "1.5", "--quiet")
    assert not (tmp_path / "s2").exists()  # refused before any work
    base = ["pretrain", "--corpus", str(corpus / "train.txt"), "--out", str(tmp_path / "bad"), "--steps", "2", "--quiet"]
    for extra, message in ((["--layers", "2", "--hidden", "100", "--heads", "3", "--vocab", str(minilm_dir)],
                            "--hidden 100 is not divisible by --heads 3"),
                           (["--geometry", "tiny"], "give --vocab FOLDER"),
                           (["--model", str(minilm_dir), "--geometry", "tiny"], "leave out --geometry"),
                           (["--model", str(minilm_dir), "--untied"], "--untied makes a new decoder from scratch"),
                           (["--geometry", "tiny", "--vocab", str(minilm_dir), "--eval-every", "2"], "--eval-every needs --eval-texts"),
                           (["--geometry", "tiny", "--vocab", str(minilm_dir), "--fp16"], "--fp16 needs a CUDA device"),
                           (["--geometry", "tiny", "--vocab", str(minilm_dir), "--device", "gpu0"],
                            "--device 'gpu0' is not a device: use cpu, cuda or cuda:N"),
                           (["--geometry", "tiny", "--vocab", str(minilm_dir), "--device", "meta"],
                            "--device 'meta': minibert trains on cpu or cuda")):
        assert message in cli_error(capsys, *base, *extra)
    if not torch.cuda.is_available():
        assert "PyTorch sees no CUDA device" in cli_error(capsys, *base, "--geometry", "tiny", "--vocab", minilm_dir,
                                                          "--device", "cuda")
    assert not (tmp_path / "bad").exists()  # each refused before any work
    line = cli_error(capsys, "pretrain", "--corpus", str(corpus / "train.txt"), "--out", str(tmp_path / "run"),
                     "--layers", "2", "--hidden", "64", "--vocab", str(minilm_dir), "--max-length", "32", "--steps", "6",
                     "--batch-size", "8", "--save-every", "3", "--resume", "--quiet")
    assert "--resume:" in line and "hidden=128 then, 64 now" in line  # the setting named; nothing trained or mixed


def test_continuing_an_untied_run_keeps_and_trains_its_own_decoder(corpus, minilm_dir, tmp_path):
    """--model on an --untied run's folder (bench_pretrain's ``longer`` part): the continued model is still
    untied, and the steps train its decoder apart from the word embeddings."""
    from safetensors.torch import load_file

    from minibert.cli import main

    common = ["--corpus", str(corpus / "train.txt"), "--max-length", "24", "--steps", "3", "--batch-size", "4",
              "--lr", "2e-3", "--quiet"]
    assert main(["pretrain", *common, "--out", str(tmp_path / "first"), "--layers", "1", "--hidden", "32", "--heads",
                 "2", "--intermediate", "64", "--vocab", str(minilm_dir), "--untied"]) == 0
    assert main(["pretrain", *common, "--out", str(tmp_path / "more"), "--model", str(tmp_path / "first"),
                 "--seed", "1"]) == 0
    assert json.loads((tmp_path / "more" / "config.json").read_text())["tie_word_embeddings"] is False
    first, more = (load_file(tmp_path / name / "model.safetensors") for name in ("first", "more"))
    decoder, embeddings = "cls.predictions.decoder.weight", "bert.embeddings.word_embeddings.weight"
    assert (more[decoder] - first[decoder]).abs().max() > 1e-4  # the continued steps trained it
    assert not torch.equal(more[decoder], more[embeddings])
    assert type(BertForMaskedLM.from_pretrained(tmp_path / "more").bert.mlm_head).__name__ == "UntiedMaskedLMHead"


def test_snapshots_at_log_spaced_steps_and_probing_across_time(corpus, minilm_dir, tmp_path, capsys):
    """--snapshots keeps step 0 (the initialisation, bit for bit) and log-spaced steps up to the last (the
    final model, bit for bit), each loadable alone; probe-over-time probes every layer of each and measures
    each layer's CKA against the next and the last snapshot."""
    from safetensors.torch import load_file

    from conftest import POS_SAMPLE
    from minibert.analysis.timeline import probe_over_time, snapshots
    from minibert.cli import main
    from minibert.textfiles import read_conllu
    from minibert.training.pretrain import snapshot_steps

    assert snapshot_steps(1000, 4) == [0, 1, 10, 100, 1000] and snapshot_steps(3, 8) == [0, 1, 2, 3]
    assert snapshot_steps(16, 4) == [0, 1, 3, 6, 16] and snapshot_steps(16, 0) == [] and snapshot_steps(7, 1) == [0, 7]
    run = tmp_path / "run"
    assert main(["pretrain", "--corpus", str(corpus / "train.txt"), "--out", str(run), "--layers", "2", "--hidden", "64",
                 "--heads", "4", "--vocab", str(minilm_dir), "--max-length", "32", "--steps", "16", "--batch-size", "8",
                 "--lr", "2e-3", "--snapshots", "4", "--quiet"]) == 0
    found = snapshots(run)
    assert [step for step, _ in found] == [0, 1, 3, 6, 16]
    BertForMaskedLM.from_config(BertModel.from_pretrained(run).config, seed=0).save_pretrained(tmp_path / "init")
    for one, other in ((found[0][1], tmp_path / "init"), (found[-1][1], run)):
        a, b = load_file(one / "model.safetensors"), load_file(other / "model.safetensors")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert BertTokenizer.from_pretrained(found[2][1]).vocab == BertTokenizer.from_pretrained(minilm_dir).vocab

    sample = tmp_path / "pos.conllu"  # 40 sentences of the UPOS sample
    sample.write_text("\n\n".join(POS_SAMPLE.read_text(encoding="utf-8").strip().split("\n\n")[:40]) + "\n\n")
    assert main(["probe-over-time", str(run), str(sample), "--json", str(tmp_path / "t.json"), "--quiet"]) == 0
    assert "linear CKA with the next snapshot" in capsys.readouterr().out
    timeline = json.loads((tmp_path / "t.json").read_text())
    assert timeline["steps"] == [0, 1, 3, 6, 16] and len(timeline["accuracy"]) == 5 and len(timeline["accuracy"][0]) == 3
    assert len(timeline["cka_next"]) == 4 and all(abs(c - 1) < 1e-9 for c in timeline["cka_final"][-1])
    assert all(0 <= a <= 1 for row in timeline["accuracy"] for a in row) and 0 < timeline["majority_baseline"] < 1
    assert max(abs(c - 1) for c in timeline["cka_final"][0]) > 1e-3  # training moved the representations
    assert len(timeline["first_step_at_90_percent"]) == 3 and len(timeline["selectivity"]) == 5
    with pytest.raises(InputError, match="at least 2 snapshots"):
        probe_over_time([(0, found[0][1])], read_conllu(sample))
    line = cli_error(capsys, "probe-over-time", str(tmp_path / "init"), str(sample))
    assert "at least 2 snapshots" in line and "--snapshots" in line


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (runs on a GPU machine)")
def test_pretraining_and_finetuning_on_cuda(corpus, minilm_dir, tmp_path):
    """--device cuda: the same run as on the CPU (same init, data and masks) reaches the same losses within
    fp32 reduction-order noise; fp16 with loss scaling and bf16 train; the checkpoints load on the CPU; a
    classifier fine-tunes there too."""
    from minibert.cli import main
    from minibert.models.heads import BertForSequenceClassification

    common = ["pretrain", "--corpus", str(corpus / "train.txt"), "--vocab", str(minilm_dir), "--layers", "2",
              "--hidden", "64", "--heads", "2", "--max-length", "32", "--steps", "8", "--batch-size", "8",
              "--log-every", "2", "--dropout", "0", "--quiet"]
    for name, extra in (("cpu", ["--device", "cpu"]), ("cuda", ["--device", "cuda"]),
                        ("fp16", ["--device", "cuda", "--fp16"]), ("bf16", ["--device", "cuda:0", "--bf16"])):
        assert main([*common, "--out", str(tmp_path / name), *extra]) == 0
    losses = {name: [r["loss"] for r in map(json.loads, (tmp_path / name / "log.jsonl").read_text().splitlines())]
              for name in ("cpu", "cuda", "fp16", "bf16")}
    assert losses["cuda"] == pytest.approx(losses["cpu"], rel=1e-3)
    for half in ("fp16", "bf16"):
        assert all(math.isfinite(x) for x in losses[half])
        assert losses[half] == pytest.approx(losses["cpu"], rel=0.05)
    model = BertForMaskedLM.from_pretrained(tmp_path / "fp16")
    assert next(model.parameters()).device.type == "cpu"
    labelled = tmp_path / "labelled.csv"
    rows = [f"{t},{'yes' if i % 2 else 'no'}" for i, t in enumerate(["a good day", "a bad day", "fine work", "poor work"] * 4)]
    labelled.write_text("text,label\n" + "\n".join(rows) + "\n", encoding="utf-8")
    assert main(["finetune", "--model", str(tmp_path / "cuda"), "--train", str(labelled), "--eval", str(labelled),
                 "--out", str(tmp_path / "classifier"), "--epochs", "1", "--device", "cuda", "--quiet"]) == 0
    classifier = BertForSequenceClassification.from_pretrained(tmp_path / "classifier")
    assert next(classifier.parameters()).device.type == "cpu" and classifier.config.num_labels == 2
