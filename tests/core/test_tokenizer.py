"""Our pure-Python WordPiece tokenizer against transformers' BertTokenizerFast (the Rust tokenizers
library), built from the same vocabulary: input_ids, token_type_ids, attention_mask and offsets must be
identical, and decode must give the same text."""

from __future__ import annotations

import shutil

import pytest
import torch

from conftest import transformers
from minibert import BertTokenizer

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

CORPUS = [
    "Hello, World! It's a café, naïve résumé; Ångström Øresund façade.",
    "ﬁne ﬂour ligatures Æsir œuvre ß straße",
    "ＦＵＬＬＷＩＤＴＨ ｌｅｔｔｅｒｓ １２３ ＡＢＣ！",
    "中文字符测试，日本語のテキスト、漢字とかな。",
    "한국어 텍스트입니다. 서울특별시",
    "ภาษาไทยไม่มีช่องว่างระหว่างคำ",
    "مرحبا بالعالم، هذا اختبار.",
    "Привет, мир! Ёжик в тумане.",
    "Ελληνικά: ΟΔΟΣ, Σίσυφος.",
    "emoji 😀🥰👍🏽 family 👨‍👩‍👧 flags 🇫🇷",
    "combining e\u0301 a\u0308 n\u0303 and stacked a\u0316\u0301",
    "zero\u200bwidth\u200djoiner\ufeffbom soft\u00adhyphen",
    "control\x01\x07chars\x00 nul \ufffd replacement \x1c\x1d\x85 next-line",
    "tab\there\nnew line\r\nwindows\x0bvt\x0cff\u2028ls\u3000ideographic space",
    "a" * 99, "b" * 100, "c" * 101, "supercalifragilisticexpialidocious" * 4,
    "[CLS] literal [MASK] tokens [SEP] [PAD] [UNK] and [unused1] and [cls] x[MASK]y [[SEP]]",
    "https://example.com/a/b?q=1&x=y#frag user@example.org",
    "3.14159 1,000,000 $5.99 -42 +7 100% 2nd 1e-10 0xFF",
    "!!!???...---***///\\\\|||~~~^^^```",
    "İstanbul DŽ ǅ ǆ Σσς ẞ ﬃ",
    "   leading and trailing spaces   ",
    "",
    " ",
    "\x00",
    "Mixed 日本 text with 한글 and ascii, done.",
    "We're can't won't it's y'all o'clock rock'n'roll",
    "Don't do not DO NOT. Hello ,world !",
]


@pytest.fixture(scope="module", params=["uncased", "cased"])
def tokenizers(request, minilm_dir, tmp_path_factory):
    """(ours, reference) from the same vocab.txt, for the uncased and the cased rules."""
    if request.param == "uncased":
        return BertTokenizer.from_pretrained(minilm_dir), transformers.BertTokenizerFast.from_pretrained(str(minilm_dir))
    vocab = minilm_dir / "vocab.txt"
    return BertTokenizer(vocab, do_lower_case=False), reference_from_vocab(vocab, do_lower_case=False, model_max_length=512)


def reference_from_vocab(vocab_path, **options):
    """BertTokenizerFast built from a vocab.txt (transformers 5 names the argument `vocab`, 4 `vocab_file`)."""
    if int(transformers.__version__.split(".")[0]) >= 5:
        from transformers.models.bert.tokenization_bert import load_vocab

        return transformers.BertTokenizerFast(vocab=load_vocab(str(vocab_path)), **options)
    return transformers.BertTokenizerFast(vocab_file=str(vocab_path), **options)


def as_lists(encoding):
    return {k: [list(map(tuple, row)) if k == "offset_mapping" else list(row) for row in v]
            if v and isinstance(v[0], list) else ([tuple(x) for x in v] if k == "offset_mapping" else list(v))
            for k, v in encoding.items()}


def assert_same(ours, ref, *args, **kwargs):
    a = as_lists(ours(*args, return_offsets_mapping=True, **kwargs))
    b = as_lists(ref(*args, return_offsets_mapping=True, **kwargs))
    for key in ("input_ids", "token_type_ids", "attention_mask", "offset_mapping"):
        assert a[key] == b[key], (key, args, kwargs)


@pytest.mark.parametrize("text", CORPUS)
def test_single_texts(tokenizers, text):
    ours, ref = tokenizers
    assert_same(ours, ref, text)
    assert ours.tokenize(text) == ref.tokenize(text)


def test_pairs_batches_and_padding(tokenizers):
    ours, ref = tokenizers
    firsts, seconds = CORPUS[:14], CORPUS[14:28]
    for padding in (False, True, "longest"):
        assert_same(ours, ref, firsts, padding=padding)
        assert_same(ours, ref, firsts, seconds, padding=padding)
    assert_same(ours, ref, CORPUS[0], CORPUS[1])
    assert_same(ours, ref, firsts, padding="max_length", max_length=200)


@pytest.mark.parametrize("strategy", [True, "longest_first", "only_first", "only_second"])
@pytest.mark.parametrize("max_length", [5, 8, 13, 20, 64])
def test_truncation_strategies_on_pairs(tokenizers, strategy, max_length):
    ours, ref = tokenizers
    pairs = [("a b c d e f g h i j k l", "m n o"), ("one two", "three four five six seven eight nine ten eleven"),
             ("x " * 30, "y " * 30), ("short", "short too"), ("p q r s", "t u v w")]
    for a, b in pairs:
        try:
            expected = ref(a, b, truncation=strategy, max_length=max_length, return_offsets_mapping=True)
        except Exception:  # the reference refuses (e.g. only_first cannot fit): so must we
            with pytest.raises(ValueError):
                ours(a, b, truncation=strategy, max_length=max_length)
            continue
        got = ours(a, b, truncation=strategy, max_length=max_length, return_offsets_mapping=True)
        assert as_lists(got) == as_lists(expected), (a, b)


def test_truncation_of_single_texts_and_default_length(tokenizers):
    ours, ref = tokenizers
    long_text = " ".join(CORPUS * 10)
    for kwargs in ({"truncation": True}, {"truncation": True, "max_length": 17}, {"truncation": "only_first", "max_length": 9}):
        assert_same(ours, ref, [long_text, CORPUS[0]], padding=True, **kwargs)
    assert len(ours(long_text, truncation=True)["input_ids"]) == 512


def test_long_input_is_not_truncated_silently(minilm_dir):
    ours = BertTokenizer.from_pretrained(minilm_dir)
    with pytest.warns(UserWarning, match="truncation=True"):
        ids = ours(" ".join(CORPUS * 20), return_tensors="pt")["input_ids"]
    assert ids.shape[1] > 512


def test_tensors_feed_the_model(minilm_dir):
    from minibert import BertModel

    ours = BertTokenizer.from_pretrained(minilm_dir)
    batch = ours(CORPUS[:3], CORPUS[3:6], padding=True, return_tensors="pt")
    assert batch["input_ids"].dtype == torch.long and batch.input_ids.shape == batch["attention_mask"].shape
    out = BertModel.from_pretrained(minilm_dir)(**batch)
    assert out.last_hidden_state.shape[:2] == batch["input_ids"].shape
    assert ours(CORPUS[:2], padding=True, return_tensors="np")["input_ids"].dtype.name == "int64"
    with pytest.raises(ValueError, match="padding=True"):
        ours(CORPUS[:3], return_tensors="pt")


@pytest.mark.parametrize("skip", [False, True])
def test_decode_matches(tokenizers, skip):
    ours, ref = tokenizers
    for text in CORPUS:
        ids = ref(text)["input_ids"]
        assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip), text
    ids = ref(CORPUS[:4], padding=True, return_tensors="pt")["input_ids"]
    assert ours.batch_decode(ids, skip_special_tokens=skip) == ref.batch_decode(ids, skip_special_tokens=skip)


def test_token_id_conversions(minilm_dir):
    ours = BertTokenizer.from_pretrained(minilm_dir)
    ref = transformers.BertTokenizerFast.from_pretrained(str(minilm_dir))
    tokens = ["[CLS]", "hello", "##ing", "not-a-token", "[SEP]"]
    assert ours.convert_tokens_to_ids(tokens) == ref.convert_tokens_to_ids(tokens)
    assert ours.convert_ids_to_tokens([101, 7592, 102]) == ref.convert_ids_to_tokens([101, 7592, 102])
    assert len(ours) == len(ref.get_vocab())
    with pytest.raises(ValueError, match="token id 99999"):
        ours.convert_ids_to_tokens([99999])


def test_vocab_from_tokenizer_json_only(minilm_dir, tmp_path):
    """With no vocab.txt, the vocabulary and normaliser settings come from tokenizer.json."""
    shutil.copy(minilm_dir / "tokenizer.json", tmp_path)
    ours = BertTokenizer.from_pretrained(tmp_path)
    ref = transformers.BertTokenizerFast.from_pretrained(str(minilm_dir))
    assert_same(ours, ref, CORPUS[:10], padding=True)


def test_every_code_point(minilm_dir):
    """All 1,112,064 Unicode scalar values, each between two letters: same ids and offsets (uncased:
    the path that uses every normalisation step; cased is sampled every 7th code point). The "a{c}b"
    words go 100 to a text, space-separated (a space is a word boundary for both tokenizers, and each
    call's fixed cost is paid 100x less often); a text that differs is compared word by word to name the
    code points."""
    ours = BertTokenizer.from_pretrained(minilm_dir)
    ref = transformers.BertTokenizerFast.from_pretrained(str(minilm_dir))
    cased_ours = BertTokenizer(minilm_dir / "vocab.txt", do_lower_case=False)
    cased_ref = reference_from_vocab(minilm_dir / "vocab.txt", do_lower_case=False)
    points = [c for c in range(0x110000) if not 0xD800 <= c <= 0xDFFF]
    for (o, r), step in (((ours, ref), 1), ((cased_ours, cased_ref), 7)):
        words = [f"a{chr(c)}b" for c in points[::step]]
        groups = [words[i:i + 100] for i in range(0, len(words), 100)]
        texts = [" ".join(group) for group in groups]
        for lo in range(0, len(texts), 1000):
            a = o(texts[lo:lo + 1000], return_offsets_mapping=True)
            b = r(texts[lo:lo + 1000], return_offsets_mapping=True)
            for i, (x, y, ox, oy) in enumerate(zip(a["input_ids"], b["input_ids"], a["offset_mapping"],
                                                   b["offset_mapping"])):
                if x != y or list(map(tuple, ox)) != list(map(tuple, oy)):
                    group = groups[lo + i]
                    wa, wb = o(group, return_offsets_mapping=True), r(group, return_offsets_mapping=True)
                    bad = [hex(ord(w[1:-1])) for w, p, q, op, oq in zip(group, wa["input_ids"], wb["input_ids"],
                                                                       wa["offset_mapping"], wb["offset_mapping"])
                           if p != q or list(map(tuple, op)) != list(map(tuple, oq))]
                    raise AssertionError(f"code points tokenised differently: {bad[:20] or group}")


@settings(max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(max_size=60), pair=st.one_of(st.none(), st.text(max_size=30)))
def test_property_any_unicode_agrees(minilm_dir, text, pair):
    ours, ref = _property_tokenizers(minilm_dir)
    a = ours(text, pair, return_offsets_mapping=True)
    b = ref(text, pair, return_offsets_mapping=True)
    assert a["input_ids"] == b["input_ids"]
    assert a["token_type_ids"] == b["token_type_ids"]
    assert [tuple(x) for x in a["offset_mapping"]] == [tuple(x) for x in b["offset_mapping"]]
    assert ours.decode(a["input_ids"]) == ref.decode(b["input_ids"])


_CACHE = {}


def _property_tokenizers(minilm_dir):
    if "pair" not in _CACHE:
        _CACHE["pair"] = (BertTokenizer.from_pretrained(minilm_dir),
                          transformers.BertTokenizerFast.from_pretrained(str(minilm_dir)))
    return _CACHE["pair"]


def test_bad_arguments_are_clear(minilm_dir):
    ours = BertTokenizer.from_pretrained(minilm_dir)
    with pytest.raises(ValueError, match="padding='maximum'"):
        ours("x", padding="maximum")
    with pytest.raises(ValueError, match="truncation='middle'"):
        ours("x", truncation="middle")
    with pytest.raises(ValueError, match="text has 2 entries but text_pair has 1"):
        ours(["a", "b"], ["c"])
    with pytest.raises(ValueError, match="must be a string"):
        ours([1, 2])
    with pytest.raises(ValueError, match="needs a text_pair"):
        ours("a b c", truncation="only_second", max_length=3)
