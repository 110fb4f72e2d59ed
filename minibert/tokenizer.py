"""BERT's WordPiece tokenizer, from scratch, with the ids and offsets of transformers' BertTokenizerFast.

    text ──► split off special tokens ──► normalise ──► pre-tokenise ──► WordPiece ──► [CLS] a [SEP] b [SEP]

1. Special tokens written in the text (``[CLS]``, ``[SEP]``, ``[MASK]``, ...) are found first, in the
   original text, and kept whole.
2. Normalise each remaining piece, one character at a time:
   clean (drop NUL, U+FFFD and control/format/unassigned characters; whitespace becomes a space),
   put spaces around CJK ideographs, strip accents (NFD, drop non-spacing marks), lowercase.
3. Pre-tokenise: split on whitespace (dropped) and on every punctuation character (kept, alone).
4. WordPiece (Wu et al. 2016; Devlin et al. 2019): greedy longest match from the left; pieces after the
   first carry ``##``. A word longer than 100 characters, or one the vocabulary cannot cover, is [UNK].

Every normalised character remembers the span of the original character it came from, so each token's
``offset_mapping`` points into the text the user gave. The WordPiece result of each word is cached.
"""

from __future__ import annotations

import re
import unicodedata
import warnings
from pathlib import Path

from . import _unicode_tables as _tables
from .charclasses import WHITESPACE, is_cjk, is_control, is_mark, is_punctuation
from .errors import InputError
from .textfiles import field

# The character classes (whitespace, control, punctuation, mark, CJK) live in charclasses.py.

_ASCII_SIMPLE = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")  # ASCII characters that need the general path
_ASCII_WORDS = re.compile(r"[A-Za-z0-9]+|[!-/:-@\[-`{-~]")  # an ASCII word, or one ASCII punctuation


class Encoding(dict):
    """What the tokenizer returns: a dict (``model(**encoding)`` works) with attribute access.

    ``encoding.num_truncated_tokens`` (an attribute, not a key, so it never reaches the model) lists, per
    row, how many tokens truncation cut off: 0 for rows that fit."""

    num_truncated_tokens: list[int]

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class BertTokenizer:
    """WordPiece tokenizer with BertTokenizerFast's behaviour, in pure Python.

    ``BertTokenizer("vocab.txt", do_lower_case=True)`` or ``BertTokenizer.from_pretrained(source)``.
    """

    def __init__(self, vocab, *, do_lower_case: bool = True, strip_accents: bool | None = None,
                 tokenize_chinese_chars: bool = True, unk_token="[UNK]", sep_token="[SEP]", pad_token="[PAD]",
                 cls_token="[CLS]", mask_token="[MASK]", model_max_length: int = 512,
                 max_input_chars_per_word: int = 100):
        if isinstance(vocab, (str, Path)):
            vocab = load_vocab(vocab)
        elif isinstance(vocab, (list, tuple)):
            vocab = {token: i for i, token in enumerate(vocab)}
        self.vocab: dict[str, int] = dict(vocab)
        for name, value in (("do_lower_case", do_lower_case), ("tokenize_chinese_chars", tokenize_chinese_chars),
                            ("strip_accents", strip_accents)):
            if not isinstance(value, bool) and not (name == "strip_accents" and value is None):
                raise InputError(f"{name} must be true or false, got {value!r}" + (
                    " (a string is not a boolean: \"false\" would read as true)" if isinstance(value, str) else ""))
        for name, value in (("model_max_length", model_max_length), ("max_input_chars_per_word", max_input_chars_per_word)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InputError(f"{name} must be a positive integer, got {value!r}")
        for name, value in (("unk_token", unk_token), ("sep_token", sep_token), ("pad_token", pad_token),
                            ("cls_token", cls_token), ("mask_token", mask_token)):
            if not isinstance(value, str) and not (name == "mask_token" and value is None):
                raise InputError(f"{name} must be a string, got {value!r}")
        self.ids_to_tokens = {i: t for t, i in self.vocab.items()}
        self.do_lower_case = do_lower_case
        self.strip_accents = do_lower_case if strip_accents is None else strip_accents  # as transformers
        self.tokenize_chinese_chars = tokenize_chinese_chars
        self.unk_token, self.sep_token, self.pad_token = unk_token, sep_token, pad_token
        self.cls_token, self.mask_token = cls_token, mask_token
        for name in ("unk_token", "sep_token", "pad_token", "cls_token"):
            if getattr(self, name) not in self.vocab:
                raise InputError(f"{name} {getattr(self, name)!r} is not in the vocabulary")
        self.model_max_length = model_max_length
        self.max_input_chars_per_word = max_input_chars_per_word
        self.all_special_tokens = [t for t in (unk_token, sep_token, pad_token, cls_token, mask_token)
                                   if t is not None and t in self.vocab]
        self.all_special_ids = [self.vocab[t] for t in self.all_special_tokens]
        # longest first, so that a special token that contains another wins (leftmost-longest match)
        self._special_re = re.compile("|".join(re.escape(t) for t in sorted(self.all_special_tokens,
                                                                             key=len, reverse=True)))
        self._norm_cache: dict[str, str] = {}
        self._word_cache: dict[str, tuple] = {}

    # ------------------------------------------------------------------------------------ loading
    @classmethod
    def from_pretrained(cls, source, *, revision=None) -> "BertTokenizer":
        """A directory (vocab.txt or tokenizer.json, tokenizer_config.json), a file inside one, or a hub id."""
        from .loading import resolve_source

        path = resolve_source(source, revision=revision,
                              files=["vocab.txt", "tokenizer_config.json", "tokenizer.json",
                                     "special_tokens_map.json", "config.json"])
        directory = path if path.is_dir() else path.parent
        options = {}
        fast = _read_json(directory / "tokenizer.json")
        if fast:  # the fast tokenizer's own normaliser settings, overridden by tokenizer_config.json below
            norm = fast.get("normalizer") or {}
            if norm.get("type") == "BertNormalizer":
                options.update(do_lower_case=norm.get("lowercase", True), strip_accents=norm.get("strip_accents"),
                               tokenize_chinese_chars=norm.get("handle_chinese_chars", True))
        config_file = directory / "tokenizer_config.json"
        config = _read_json(config_file)
        specials = dict(_read_json(directory / "special_tokens_map.json"))
        specials.update({k: v for k, v in config.items() if k.endswith("_token")})
        for key in ("do_lower_case", "strip_accents", "tokenize_chinese_chars"):
            if config.get(key) is not None or key == "strip_accents" and key in config:
                options[key] = field(config, key, (bool, None) if key == "strip_accents" else bool, config_file)
        for key in ("unk_token", "sep_token", "pad_token", "cls_token", "mask_token"):
            if key in specials:
                value = specials[key]
                if isinstance(value, dict):  # {"content": "[CLS]", "lstrip": false, ...}
                    value = field(value, "content", str, f"{directory} ({key})")
                options[key] = field({key: value}, key, str, f"{directory} ({key})")
        positions = None
        if (directory / "config.json").exists():
            positions = field(_read_json(directory / "config.json"), "max_position_embeddings", int,
                              directory / "config.json", default=None)
        limit = field(config, "model_max_length", (float, None), config_file, default=None,
                      check=lambda v: None if v is None or v >= 1 else "it must be at least 1")
        if limit is None or limit > 10**9:  # transformers' "no limit" sentinel (1e30): the model's positions
            limit = positions or 512
        elif positions is not None and limit > positions:
            warnings.warn(f"{config_file}: model_max_length {limit:g} is more than the model's "
                          f"{positions} positions; truncating at {positions}", stacklevel=2)
            limit = positions
        options["model_max_length"] = int(limit)
        if (directory / "vocab.txt").exists():
            vocab = load_vocab(directory / "vocab.txt")
        elif fast and isinstance(fast.get("model"), dict) and fast["model"].get("type") == "WordPiece":
            where = directory / "tokenizer.json"
            vocab = field(fast["model"], "vocab", dict, where)
            ids = sorted(vocab.values()) if all(isinstance(i, int) and not isinstance(i, bool)
                                                for i in vocab.values()) else None
            if ids != list(range(len(vocab))):
                raise InputError(f"{where}: model.vocab must map each token to its own id 0..{len(vocab) - 1}")
            options.setdefault("max_input_chars_per_word", fast["model"].get("max_input_chars_per_word", 100))
        else:
            raise FileNotFoundError(f"no vocab.txt, and no WordPiece tokenizer.json, in {directory}")
        return cls(vocab, **options)

    def check_fits(self, config, where: str = "the model") -> None:
        """Every id this tokenizer can produce -- special or regular -- must be a row of the model's
        word-embedding table (``config.vocab_size``); said at load, not as an index error at the first
        forward pass."""
        largest = max(self.vocab.values())
        if largest >= config.vocab_size:
            token = self.ids_to_tokens[largest]
            raise InputError(f"the tokenizer's vocabulary has ids up to {largest} ({token!r}), past {where}'s "
                             f"vocab_size of {config.vocab_size} (ids 0..{config.vocab_size - 1}): the tokenizer "
                             "and the checkpoint do not belong together")

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def __len__(self) -> int:
        return len(self.vocab)

    # ------------------------------------------------------------------------------ normalisation
    def _normalise_char(self, ch: str) -> str:
        """What one original character becomes: '' (dropped), ' ' or one or more characters."""
        out = self._norm_cache.get(ch)
        if out is not None:
            return out
        if is_control(ch):
            out = ""
        elif ch in WHITESPACE:
            out = " "
        else:
            out = ch
            if self.strip_accents:
                out = _tables.NFD_EXCEPTIONS.get(ord(ch)) or "".join(
                    c for c in unicodedata.normalize("NFD", ch) if not is_mark(c))
            if self.do_lower_case:  # char by char (no final-sigma rule), as the reference does
                out = "".join(_tables.LOWER_EXCEPTIONS.get(ord(c)) or c.lower() for c in out)
            if self.tokenize_chinese_chars and is_cjk(ch):
                out = f" {out} "
        self._norm_cache[ch] = out
        return out

    def _words(self, text: str, base: int = 0):
        """Normalise and pre-tokenise one piece of text (no special tokens in it), which starts at
        ``base`` in the original text. Yields (normalised word, origins): origins[k] is the index in the
        original text of the character that normalised character k came from; on the ASCII fast path
        origins is instead the int start of the word, as character k is original character start + k."""
        if text.isascii() and not _ASCII_SIMPLE.search(text):  # fast path: offsets map one to one
            lowered = text.lower() if self.do_lower_case else text
            for m in _ASCII_WORDS.finditer(text):
                yield lowered[m.start():m.end()], base + m.start()
            return
        chars, origins = [], []
        for i, ch in enumerate(text, start=base):
            for c in self._normalise_char(ch):
                if c in WHITESPACE or is_punctuation(c):
                    if chars:
                        yield "".join(chars), origins
                        chars, origins = [], []
                    if c not in WHITESPACE:
                        yield c, [i]  # punctuation is a word of its own
                else:
                    chars.append(c)
                    origins.append(i)
        if chars:
            yield "".join(chars), origins

    # ----------------------------------------------------------------------------------- WordPiece
    def _wordpiece(self, word: str) -> tuple:
        """Greedy longest-match-first split of one normalised word: ((piece, start, end), ...), where
        start/end index the word's characters. [UNK] covers the whole word when it cannot be split."""
        cached = self._word_cache.get(word)
        if cached is not None:
            return cached
        n = len(word)
        pieces = []
        if n > self.max_input_chars_per_word:
            pieces = None
        else:
            start = 0
            while start < n:
                end = n
                while end > start:
                    piece = word[start:end] if start == 0 else "##" + word[start:end]
                    if piece in self.vocab:
                        pieces.append((piece, start, end))
                        break
                    end -= 1
                else:
                    pieces = None
                    break
                start = end
        result = tuple(pieces) if pieces is not None else ((self.unk_token, 0, n),)
        if len(self._word_cache) < 500_000:
            self._word_cache[word] = result
        return result

    def _encode_text(self, text: str) -> tuple[list[str], list[tuple[int, int]]]:
        """Tokens and original character offsets of one text, without [CLS]/[SEP]."""
        tokens, offsets = [], []
        pos = 0
        segments = []
        for m in self._special_re.finditer(text) if self.all_special_tokens else ():
            segments.append((text[pos:m.start()], pos, None))
            segments.append((None, m.start(), m.group()))
            pos = m.end()
        segments.append((text[pos:], pos, None))
        for piece, base, special in segments:
            if special is not None:
                tokens.append(special)
                offsets.append((base, base + len(special)))
                continue
            for word, origins in self._words(piece, base):
                for token, a, b in self._wordpiece(word):
                    tokens.append(token)
                    if isinstance(origins, int):  # ASCII fast path: origins is the word's start
                        offsets.append((origins + a, origins + b))
                    else:  # a piece spans from its first character's origin to past its last one's
                        offsets.append((origins[a], origins[b - 1] + 1))
        return tokens, offsets

    def tokenize(self, text: str) -> list[str]:
        """WordPiece tokens of a text, without special tokens added."""
        return self._encode_text(text)[0]

    def convert_tokens_to_ids(self, tokens):
        if isinstance(tokens, str):
            return self.vocab.get(tokens, self.vocab[self.unk_token])
        unk = self.vocab[self.unk_token]
        return [self.vocab.get(t, unk) for t in tokens]

    def convert_ids_to_tokens(self, ids):
        if isinstance(ids, int) or hasattr(ids, "item") and getattr(ids, "ndim", 1) == 0:
            return self._id_to_token(int(ids))
        return [self._id_to_token(int(i)) for i in ids]

    def _id_to_token(self, i: int) -> str:
        token = self.ids_to_tokens.get(i)
        if token is None:
            raise InputError(f"token id {i} is not in the vocabulary (ids are 0..{len(self.vocab) - 1})")
        return token

    # ------------------------------------------------------------- transformers' tokenizer surface
    # What code written for BertTokenizerFast reads and calls (bert-score, sentence-transformers, ...).
    @property
    def unk_token_id(self) -> int:
        return self.vocab[self.unk_token]

    @property
    def sep_token_id(self) -> int:
        return self.vocab[self.sep_token]

    @property
    def pad_token_id(self) -> int:
        return self.vocab[self.pad_token]

    @property
    def cls_token_id(self) -> int:
        return self.vocab[self.cls_token]

    @property
    def mask_token_id(self) -> int | None:
        return self.vocab.get(self.mask_token) if self.mask_token is not None else None

    @property
    def all_special_tokens_extended(self) -> list[str]:
        return list(self.all_special_tokens)

    pad_token_type_id = 0
    padding_side = "right"
    truncation_side = "right"
    model_input_names = ["input_ids", "token_type_ids", "attention_mask"]

    @property
    def max_len_single_sentence(self) -> int:
        return self.model_max_length - 2  # [CLS] a [SEP]

    @property
    def max_len_sentences_pair(self) -> int:
        return self.model_max_length - 3  # [CLS] a [SEP] b [SEP]

    def get_vocab(self) -> dict[str, int]:
        return dict(self.vocab)

    def num_special_tokens_to_add(self, pair: bool = False) -> int:
        return 3 if pair else 2

    def build_inputs_with_special_tokens(self, token_ids_0: list[int], token_ids_1: list[int] | None = None) -> list[int]:
        """``[CLS] a [SEP]`` or ``[CLS] a [SEP] b [SEP]`` as ids."""
        out = [self.cls_token_id] + list(token_ids_0) + [self.sep_token_id]
        return out + list(token_ids_1) + [self.sep_token_id] if token_ids_1 is not None else out

    def create_token_type_ids_from_sequences(self, token_ids_0, token_ids_1=None) -> list[int]:
        first = [0] * (len(token_ids_0) + 2)
        return first + [1] * (len(token_ids_1) + 1) if token_ids_1 is not None else first

    def get_special_tokens_mask(self, token_ids_0, token_ids_1=None, already_has_special_tokens: bool = False):
        """1 where a special token is (or will be, once ``build_inputs_with_special_tokens`` adds them)."""
        if already_has_special_tokens:
            special = set(self.all_special_ids)
            return [1 if i in special else 0 for i in token_ids_0]
        mask = [1] + [0] * len(token_ids_0) + [1]
        return mask + [0] * len(token_ids_1) + [1] if token_ids_1 is not None else mask

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        return " ".join(tokens).replace(" ##", "").strip()

    def encode(self, text, text_pair=None, *, add_special_tokens: bool = True, padding=False, truncation=None,
               max_length: int | None = None, return_tensors=None, **kwargs) -> list[int]:
        """The ids of one text (or pair), as transformers' ``encode``: ``tokenizer(text)["input_ids"]`` (a list
        of texts gives a list of id lists, as transformers 5 does)."""
        _no_other_options("encode", kwargs)
        out = self(text, text_pair, add_special_tokens=add_special_tokens, padding=padding, truncation=truncation,
                   max_length=max_length, return_tensors=return_tensors)
        return out["input_ids"]

    def encode_plus(self, text, text_pair=None, **kwargs) -> "Encoding":
        """One text (or pair): ``tokenizer(text, text_pair, ...)`` (transformers' older name)."""
        if isinstance(text, (list, tuple)):
            raise InputError("encode_plus takes one text; use batch_encode_plus or tokenizer([...]) for a batch")
        return self(text, text_pair, **kwargs)

    def batch_encode_plus(self, batch_text_or_text_pairs, **kwargs) -> "Encoding":
        """A batch of texts or (text, pair) tuples: ``tokenizer([...], ...)`` (transformers' older name)."""
        items = list(batch_text_or_text_pairs)
        if items and all(isinstance(x, (list, tuple)) and len(x) == 2 for x in items):
            return self([a for a, _ in items], [b for _, b in items], **kwargs)
        return self(items, **kwargs)

    def save_pretrained(self, directory) -> tuple[str, ...]:
        """Write vocab.txt, tokenizer_config.json and special_tokens_map.json; transformers' AutoTokenizer
        and ``BertTokenizer.from_pretrained`` both read them back to the same ids."""
        import json

        from .textfiles import atomic_dir

        directory = Path(directory)
        ordered = sorted(self.vocab.items(), key=lambda kv: kv[1])
        if [i for _, i in ordered] != list(range(len(ordered))):
            raise InputError("the vocabulary ids are not 0..n-1 without gaps; vocab.txt cannot hold it")
        specials = {name: getattr(self, name) for name in ("unk_token", "sep_token", "pad_token", "cls_token",
                                                           "mask_token") if getattr(self, name) is not None}
        config = {"tokenizer_class": "BertTokenizer", "do_lower_case": self.do_lower_case,
                  "strip_accents": None if self.strip_accents == self.do_lower_case else self.strip_accents,
                  "tokenize_chinese_chars": self.tokenize_chinese_chars, "model_max_length": self.model_max_length,
                  "clean_up_tokenization_spaces": True, **specials}
        written = []
        with atomic_dir(directory) as tmp:  # the three files together, or the old ones: a kill leaves no mix
            (tmp / "vocab.txt").write_text("".join(t + "\n" for t, _ in ordered), encoding="utf-8")
            for name, content in (("tokenizer_config.json", config), ("special_tokens_map.json", specials)):
                (tmp / name).write_text(json.dumps(content, indent=2) + "\n", encoding="utf-8")
                written.append(str(directory / name))
        return (str(directory / "vocab.txt"), *written)

    # ------------------------------------------------------------------------------- __call__
    def __call__(self, text, text_pair=None, *, add_special_tokens: bool = True, padding=False,
                 truncation=None, max_length: int | None = None, return_tensors=None,
                 return_offsets_mapping: bool = False, return_token_type_ids: bool = True,
                 return_attention_mask: bool = True) -> Encoding:
        """Tokenise one text or a batch, optionally paired, with transformers' calling convention."""
        batched = isinstance(text, (list, tuple))
        texts = list(text) if batched else [text]
        if not batched and text_pair == "":
            text_pair = None  # transformers treats an empty single pair as no pair (a batch keeps it)
        if text_pair is None:
            pairs = [None] * len(texts)
        else:
            if isinstance(text_pair, (list, tuple)) != batched:
                raise InputError("text and text_pair must both be strings or both be lists of strings")
            pairs = list(text_pair) if batched else [text_pair]
            if len(pairs) != len(texts):
                raise InputError(f"text has {len(texts)} entries but text_pair has {len(pairs)}")
        for name, values in (("text", texts), ("text_pair", pairs)):
            for v in values:
                if v is not None and not isinstance(v, str):
                    raise InputError(f"{name} must be a string or a list of strings, got {type(v).__name__}")

        padding = {True: "longest", False: "do_not_pad", None: "do_not_pad"}.get(padding, padding)
        if padding not in ("longest", "max_length", "do_not_pad"):
            raise InputError(f"padding={padding!r}; use False, True, 'longest' or 'max_length'")
        if truncation is None and max_length is not None and padding != "max_length":
            warnings.warn("max_length is set but truncation is not: truncating with 'longest_first', as "
                          "transformers does; pass truncation=True to silence this", stacklevel=2)
            truncation = "longest_first"
        truncation = {True: "longest_first", False: None, None: None, "do_not_truncate": None}.get(
            truncation, truncation)
        if truncation not in (None, "longest_first", "only_first", "only_second"):
            raise InputError(f"truncation={truncation!r}; use True, 'longest_first', 'only_first' or 'only_second'")
        if max_length is None and (truncation is not None or padding == "max_length"):
            max_length = self.model_max_length
        if max_length is not None and (not isinstance(max_length, int) or max_length < 1):
            raise InputError(f"max_length must be a positive integer, got {max_length!r}")

        rows, cut = [], []
        for a, b in zip(texts, pairs):
            a_tokens, a_offsets = self._encode_text(a)
            b_tokens, b_offsets = self._encode_text(b) if b is not None else (None, None)
            if truncation is not None:
                n_special = (3 if b is not None else 2) if add_special_tokens else 0
                a_len, b_len = truncated_lengths(len(a_tokens), None if b is None else len(b_tokens),
                                                 max_length - n_special, truncation)
                cut.append(len(a_tokens) - a_len + (len(b_tokens) - b_len if b is not None else 0))
                a_tokens, a_offsets = a_tokens[:a_len], a_offsets[:a_len]
                if b is not None:
                    b_tokens, b_offsets = b_tokens[:b_len], b_offsets[:b_len]
            else:
                cut.append(0)
            rows.append(self._assemble(a_tokens, a_offsets, b_tokens, b_offsets, add_special_tokens))

        longest = max(len(r["input_ids"]) for r in rows)
        if truncation is None and longest > self.model_max_length:
            warnings.warn(f"a sequence has {longest} tokens, more than model_max_length="
                          f"{self.model_max_length}; the model will refuse it. Pass truncation=True to "
                          "truncate", stacklevel=2)
        target = {"longest": longest, "max_length": max_length, "do_not_pad": None}[padding]
        pad_id = self.vocab[self.pad_token]
        for r in rows:
            missing = (target or 0) - len(r["input_ids"])
            if missing > 0:
                r["input_ids"] += [pad_id] * missing
                r["token_type_ids"] += [0] * missing
                r["attention_mask"] += [0] * missing
                r["offset_mapping"] += [(0, 0)] * missing

        keys = ["input_ids"]
        keys += ["token_type_ids"] if return_token_type_ids else []
        keys += ["attention_mask"] if return_attention_mask else []
        keys += ["offset_mapping"] if return_offsets_mapping else []
        out = Encoding()
        for key in keys:
            values = [r[key] for r in rows]
            out[key] = _as_tensor(key, values, return_tensors) if return_tensors else (
                values if batched else values[0])
        out.num_truncated_tokens = cut
        return out

    def _assemble(self, a_tokens, a_offsets, b_tokens, b_offsets, add_special_tokens):
        cls, sep = ([self.cls_token], [self.sep_token]) if add_special_tokens else ([], [])
        tokens = cls + a_tokens + sep
        offsets = [(0, 0)] * len(cls) + list(a_offsets) + [(0, 0)] * len(sep)
        types = [0] * len(tokens)
        if b_tokens is not None:
            tokens += b_tokens + sep
            offsets += list(b_offsets) + [(0, 0)] * len(sep)
            types += [1] * (len(b_tokens) + len(sep))
        return {"input_ids": self.convert_tokens_to_ids(tokens), "token_type_ids": types,
                "attention_mask": [1] * len(tokens), "offset_mapping": offsets}

    # ----------------------------------------------------------------------------------- decoding
    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        """Ids back to text as BertTokenizerFast decodes: pieces joined with spaces, ``##`` glued to the
        previous piece, and no space before . , ! ?"""
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        if isinstance(ids, int):
            ids = [ids]
        tokens = self.convert_ids_to_tokens(ids)
        if skip_special_tokens:
            special = set(self.all_special_tokens)
            tokens = [t for t in tokens if t not in special]
        parts = []
        for i, token in enumerate(tokens):
            if i > 0:
                token = token[2:] if token.startswith("##") else " " + token
            parts.append(_cleanup(token))
        return "".join(parts)

    def batch_decode(self, sequences, skip_special_tokens: bool = False) -> list[str]:
        return [self.decode(s, skip_special_tokens=skip_special_tokens) for s in sequences]


def _cleanup(piece: str) -> str:
    """The WordPiece decoder's clean-up, applied to each piece with its leading space."""
    for dirty, clean in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                         (" 'm", "'m"), (" do not", " don't"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        piece = piece.replace(dirty, clean)
    return piece


def truncated_lengths(n_a: int, n_b: int | None, budget: int, strategy: str) -> tuple[int, int | None]:
    """How many tokens of each sequence survive truncation to ``budget`` tokens (specials excluded),
    with the rules of the tokenizers library."""
    if budget < 0:
        raise InputError(f"max_length is {-budget} token(s) too small to hold the special tokens")
    if n_b is None:
        if strategy == "only_second":
            raise InputError("truncation='only_second' needs a text_pair")
        return min(n_a, budget), None
    if n_a + n_b <= budget:
        return n_a, n_b
    if strategy == "only_first":
        if n_b >= budget:
            raise InputError(f"truncation='only_first' cannot fit: the second sequence alone has {n_b} tokens, "
                             f"the budget is {budget}")
        return budget - n_b, n_b
    if strategy == "only_second":
        if n_a >= budget:
            raise InputError(f"truncation='only_second' cannot fit: the first sequence alone has {n_a} tokens, "
                             f"the budget is {budget}")
        return n_a, budget - n_a
    # longest_first: keep the shorter whole if it fits in half, else give each half the budget
    short, long_ = sorted((n_a, n_b))
    long_ = short if short > budget else max(short, budget - short)
    if short + long_ > budget:
        short = budget // 2
        long_ = short + budget % 2
    return (long_, short) if n_a > n_b else (short, long_)


def _as_tensor(key, values, return_tensors):
    lengths = {len(v) for v in values}
    if len(lengths) > 1:
        raise InputError(f"cannot make one tensor of {key} with lengths {sorted(lengths)}; pass padding=True")
    if return_tensors == "pt":
        import torch

        return torch.tensor(values, dtype=torch.long)
    if return_tensors == "np":
        import numpy as np

        return np.array(values, dtype=np.int64)
    raise InputError(f"return_tensors={return_tensors!r}; use None, 'pt' or 'np'")


def _no_other_options(method: str, kwargs: dict) -> None:
    if kwargs:
        raise InputError(f"{method}: unsupported option(s) {', '.join(sorted(kwargs))}")


def load_vocab(path) -> dict[str, int]:
    """vocab.txt: one token per line, the line number is the id. Bytes that are not UTF-8, and a token on
    two lines (which would shift every later id by one), are InputErrors naming the file and the lines."""
    from .textfiles import read_text

    vocab = {}
    text = read_text(path, "vocab.txt")
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    for i, line in enumerate(lines):
        token = line[:-1] if line.endswith("\r") else line
        if token in vocab:
            raise InputError(f"{path}: line {i + 1} repeats the token {token!r} of line {vocab[token] + 1}; each "
                             "token must appear once (its line number is its id)")
        vocab[token] = i
    if not vocab:
        raise InputError(f"{path} holds no token")
    return vocab


def _read_json(path: Path) -> dict:
    from .config import read_json_object

    return read_json_object(path) if path.exists() else {}
