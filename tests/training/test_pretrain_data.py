"""minibert/training/pretrain_data.py: the token store (built once, reused, refused for another vocabulary), NSP
examples, masking against its definition and transformers' collators."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from conftest import transformers
from minibert import BertTokenizer, InputError
from minibert.training.pretrain_data import (Examples, MaskingRule, TokenStore, continuation_table, mask_tokens,
                                             read_documents)


@pytest.fixture(scope="module")
def tokenizer(minilm_dir):
    return BertTokenizer.from_pretrained(minilm_dir)


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
