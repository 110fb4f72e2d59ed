"""Text for pre-training: from files to a token store on disk, to examples, to masked batches.

    corpus files ──► TokenStore.build ──► stream.bin (token ids, [SEP] after each document)
                     (once; reused)       + sentence / document starts + meta.json
                                   │
          packed_example(i)  ◄─────┤   RoBERTa's FULL-SENTENCES: [CLS] + L - 2 consecutive tokens + [SEP],
                                   │   across sentence and document boundaries (the default)
          nsp_example(i)     ◄─────┘   BERT's two segments: [CLS] A [SEP] B [SEP], B the text that follows
                                       A (label 0) or text of another document (label 1), 50 % each
                                   │
                         mask_tokens   15 % of the tokens chosen (never [CLS], [SEP], [PAD]); of those
                                       80 % [MASK], 10 % a random token, 10 % unchanged (Devlin et al.
                                       2019); labels are the original ids there and -100 elsewhere

**Files.** ``.txt``: one document per line, or -- when the file has blank lines -- documents separated by
blank lines, one sentence per line. ``.jsonl``: one object per line with a ``text`` field. UTF-8 only.

**The store** is a folder: ``stream.bin`` holds every token id (uint16 when the vocabulary fits, else
int32), read through a memory map, so a corpus larger than memory streams from disk; ``sentences.npy``
and ``documents.npy`` hold where each sentence and document starts in it. ``meta.json`` records the
vocabulary's sha256, the lowercasing, and each source file's sha256: a store is built once and reused
while they match, and a store made with another vocabulary is refused.

**Masks are drawn per example**, from a generator seeded by (seed, the example's number in the run): the
same example gets the same mask whichever process of a torchrun job reads it and however batches are
cut, so a run resumes exactly and N processes compute what one does.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from ..errors import InputError
from ..textfiles import atomic_dir, file_sha256, read_json, read_text
from ..tools.batching import collate

log = logging.getLogger(__name__)

STORE_FORMAT = 1
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[\"'(\[]?[A-Z0-9])")  # where a document per line is split into sentences


# ------------------------------------------------------------------------------------------ reading
def read_documents(path) -> list[list[str]]:
    """The documents of one corpus file, each a list of sentences (see the module docstring)."""
    path = Path(path)
    if not path.exists():
        from ..errors import not_found

        raise not_found(path, "corpus file")
    raw = path.read_bytes()
    if b"\x00" in raw[:1 << 16]:
        raise InputError(f"{path} holds NUL bytes: a binary file, not a text corpus (UTF-8 text or JSONL)")
    text = read_text(path, "corpus file")
    if path.suffix.lower() in (".jsonl", ".ndjson"):
        docs = []
        for number, line in enumerate(text.split("\n"), start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise InputError(f"{path}:{number}: not a JSON object ({e})") from None
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise InputError(f"{path}:{number}: needs an object with a string field 'text'")
            docs.append(_sentences(record["text"]))
    elif re.search(r"\n[ \t\r]*\n", text.strip()):  # blank lines: documents, one sentence per line
        docs = [[s.strip() for s in block.split("\n") if s.strip()] for block in re.split(r"\n[ \t\r]*\n", text)]
    else:  # one document per line
        docs = [_sentences(line) for line in text.split("\n")]
    docs = [d for d in docs if d]
    if not docs:
        raise InputError(f"{path} has no text: a corpus needs at least one non-empty document")
    return docs


def _sentences(document: str) -> list[str]:
    return [s.strip() for s in _SENTENCE_END.split(document.strip()) if s.strip()]


def vocabulary_hash(tokenizer) -> str:
    """What a store's token ids mean: the vocabulary in id order and how text is normalised."""
    ordered = sorted(tokenizer.vocab.items(), key=lambda kv: kv[1])
    text = "\n".join(t for t, _ in ordered) + f"\nlower={tokenizer.do_lower_case} accents={tokenizer.strip_accents}"
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


# --------------------------------------------------------------------------------------- the store
class TokenStore:
    """Token ids of a corpus on disk (see the module docstring). ``stream`` is a read-only memory map."""

    def __init__(self, folder):
        self.folder = Path(folder)
        self.meta = read_json(self.folder / "meta.json")
        self.stream = np.memmap(self.folder / "stream.bin", dtype=self.meta["dtype"], mode="r")
        self.sentences = np.load(self.folder / "sentences.npy")  # start of each sentence in stream
        self.documents = np.load(self.folder / "documents.npy")  # start of each document's first sentence
        self.sentence_ends = np.load(self.folder / "sentence_ends.npy")

    @property
    def tokens(self) -> int:
        """Tokens of text (the [SEP] after each document not counted)."""
        return int(self.meta["tokens"])

    def __repr__(self) -> str:
        return (f"TokenStore({self.folder}: {self.meta['tokens']:,} tokens, {self.meta['documents']:,} documents, "
                f"{self.meta['sentences']:,} sentences)")

    @classmethod
    def build(cls, files: Sequence, tokenizer, folder, *, progress: bool = True) -> "TokenStore":
        """The store of ``files`` tokenised by ``tokenizer`` in ``folder``: reused when it exists and was
        made from the same files (sha256) with the same vocabulary; refused when the vocabulary differs;
        otherwise built (written atomically) and returned."""
        from ..tools.progress import progress_bar

        files = [Path(f) for f in files]
        if not files:
            raise InputError("no corpus file given")
        sources = [{"path": str(f), "sha256": file_sha256(f) if f.exists() else None} for f in files]
        vocab = vocabulary_hash(tokenizer)
        folder = Path(folder)
        if (folder / "meta.json").exists():
            meta = read_json(folder / "meta.json")
            if meta.get("vocabulary_sha256") != vocab:
                raise InputError(f"the token store {folder} was made with another vocabulary (or lowercasing); "
                                 "its ids would mean other tokens: give another store folder, or delete it")
            if [s["sha256"] for s in meta.get("sources", [])] == [s["sha256"] for s in sources]:
                log.info(f"reusing the token store {folder} ({meta['tokens']:,} tokens)")
                return cls(folder)
            log.info(f"the corpus files changed since {folder} was built: building it again")
        dtype = "uint16" if len(tokenizer.vocab) <= 65535 else "int32"
        sep = tokenizer.vocab[tokenizer.sep_token]
        with atomic_dir(folder, replaced=("*",)) as tmp:
            sentences, ends, documents, position, count = [], [], [], 0, 0
            with open(tmp / "stream.bin", "wb") as out:
                for f in files:
                    docs = read_documents(f)
                    bar = progress_bar(len(docs), f"tokenising {f.name}", progress)
                    for doc in docs:
                        ids = tokenizer(doc, add_special_tokens=False, return_attention_mask=False,
                                        return_token_type_ids=False)["input_ids"]
                        ids = [s for s in ids if s]
                        if not ids:
                            bar.update(1)
                            continue
                        documents.append(len(sentences))
                        for piece in ids:
                            sentences.append(position)
                            ends.append(position + len(piece))
                            out.write(np.asarray(piece, dtype=dtype).tobytes())
                            position += len(piece)
                            count += len(piece)
                        out.write(np.asarray([sep], dtype=dtype).tobytes())  # the document boundary
                        position += 1
                        bar.update(1)
                    bar.close()
            if not documents:
                raise InputError(f"{', '.join(map(str, files))}: no token in the corpus")
            np.save(tmp / "sentences.npy", np.asarray(sentences, dtype=np.int64))
            np.save(tmp / "sentence_ends.npy", np.asarray(ends, dtype=np.int64))
            np.save(tmp / "documents.npy", np.asarray(documents + [len(sentences)], dtype=np.int64))
            meta = {"format": STORE_FORMAT, "dtype": dtype, "tokens": count, "stream": position,
                    "documents": len(documents), "sentences": len(sentences), "vocabulary_sha256": vocab,
                    "vocab_size": len(tokenizer.vocab), "sources": sources}
            (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
        log.info(f"built the token store {folder}: {count:,} tokens, {len(documents):,} documents, "
                 f"{len(sentences):,} sentences")
        return cls(folder)

    # ------------------------------------------------------------------------------------ examples
    def packed_count(self, max_length: int) -> int:
        """Full-sentences examples of ``max_length`` tokens the stream holds (the last partial one dropped)."""
        return int(self.meta["stream"]) // (max_length - 2)

    def packed_example(self, i: int, max_length: int, cls_id: int, sep_id: int) -> dict:
        """Example ``i``: [CLS] + stream[i (L-2) : (i+1) (L-2)] + [SEP], one segment."""
        width = max_length - 2
        ids = [cls_id] + self.stream[i * width:(i + 1) * width].astype(np.int64).tolist() + [sep_id]
        return {"input_ids": ids, "token_type_ids": [0] * len(ids)}

    def _sentence(self, s: int) -> list[int]:
        return self.stream[self.sentences[s]:self.sentence_ends[s]].astype(np.int64).tolist()

    def nsp_example(self, i: int, max_length: int, cls_id: int, sep_id: int, seed: int) -> dict:
        """Example ``i`` of BERT's two-segment format, drawn with a generator seeded by (seed, i). Half the
        time (label 0, IsNext) A is a run of consecutive sentences of a document of two or more and B the
        sentences that follow it; otherwise (label 1, NotNext) B is a run from another document. The pair
        is cut to ``max_length - 3`` tokens, from the end of the longer segment."""
        rng = random.Random(seed * 1_000_003 + i)
        budget = max_length - 3
        n_docs = len(self.documents) - 1
        multi = self.multi_sentence_documents()
        label = 1 if (rng.random() >= 0.5 and n_docs > 1) or len(multi) == 0 else 0
        doc = int(multi[rng.randrange(len(multi))]) if label == 0 else rng.randrange(n_docs)
        first, last = int(self.documents[doc]), int(self.documents[doc + 1])
        start = rng.randrange(first, last - 1 if label == 0 else last)
        run, size = [], 0
        for s in range(start, last):  # consecutive sentences up to the budget (two at least for IsNext)
            run.append(self._sentence(s))
            size += len(run[-1])
            if size >= budget and len(run) >= 2 - label:
                break
        if label == 0:
            split = rng.randrange(1, len(run))
            a = [t for sentence in run[:split] for t in sentence]
            b = [t for sentence in run[split:] for t in sentence]
        else:
            a = [t for sentence in run for t in sentence]
            other = rng.randrange(n_docs - 1)
            other += other >= doc
            o_first, o_last = int(self.documents[other]), int(self.documents[other + 1])
            b, s = [], rng.randrange(o_first, o_last)
            while s < o_last and len(b) < budget - min(len(a), budget // 2):
                b += self._sentence(s)
                s += 1
        while len(a) + len(b) > budget:  # cut the longer segment from its end
            if len(a) >= len(b):
                a.pop()
            else:
                b.pop()
        ids = [cls_id] + a + [sep_id] + b + [sep_id]
        return {"input_ids": ids, "token_type_ids": [0] * (len(a) + 2) + [1] * (len(b) + 1),
                "next_sentence_label": label}

    def multi_sentence_documents(self) -> np.ndarray:
        """The documents of two or more sentences (IsNext pairs come from these)."""
        if not hasattr(self, "_multi"):
            self._multi = np.nonzero(np.diff(self.documents) >= 2)[0]
        return self._multi


# ------------------------------------------------------------------------------------------ masking
@dataclass
class MaskingRule:
    """How tokens are chosen and replaced (Devlin et al. 2019, section 3.1)."""

    probability: float = 0.15  # of the tokens that are not special
    mask: float = 0.8  # of the chosen: replaced by [MASK]
    random: float = 0.1  # ... by a token drawn uniformly from the vocabulary; the rest stay unchanged
    whole_word: bool = False  # choose whole words (a piece and its ## continuations together)


def continuation_table(tokenizer) -> torch.Tensor:
    """(V,) bool: True for the ids of ``##`` pieces (they continue the word before them)."""
    table = torch.zeros(max(tokenizer.vocab.values()) + 1, dtype=torch.bool)
    for token, i in tokenizer.vocab.items():
        if token.startswith("##"):
            table[i] = True
    return table


def mask_tokens(ids: torch.Tensor, special: torch.Tensor, rule: MaskingRule, mask_id: int, vocab_size: int,
                generator: torch.Generator, continuation: torch.Tensor | None = None):
    """(masked ids, labels) for one example's ids (T,): ``special`` (T,) marks what is never chosen. With
    ``rule.whole_word`` a word -- a piece and the ``##`` pieces after it (``continuation``) -- is chosen or
    left whole, with the rule's probability; the replacement is drawn per token, as transformers does."""
    T = ids.shape[0]
    draw = torch.rand(T, generator=generator)
    if rule.whole_word:
        if continuation is None:
            raise InputError("whole-word masking needs the tokenizer's continuation table (continuation_table)")
        starts = ~(continuation[ids] & ~special)  # a token that does not continue the word before it
        word = torch.cumsum(starts.long(), 0) - 1  # (T,) the word each token belongs to
        chosen = draw[torch.nonzero(starts).flatten()][word] < rule.probability
    else:
        chosen = draw < rule.probability
    chosen &= ~special
    labels = torch.where(chosen, ids, torch.full_like(ids, -100))
    how = torch.rand(T, generator=generator)
    random_ids = torch.randint(vocab_size, (T,), generator=generator)
    masked = ids.clone()
    masked[chosen & (how < rule.mask)] = mask_id
    swap = chosen & (how >= rule.mask) & (how < rule.mask + rule.random)
    masked[swap] = random_ids[swap]
    return masked, labels


class Examples:
    """The examples of a store in one format, numbered 0, 1, 2, ... across epochs (each epoch a seeded
    permutation), and masked batches of them: ``batch(numbers)`` for any example numbers."""

    def __init__(self, store: TokenStore, tokenizer, *, max_length: int = 128, nsp: bool = False,
                 rule: MaskingRule = MaskingRule(), seed: int = 0):
        from ..checks import check_max_length

        check_max_length("--max-length", max_length, 1 << 16, pair=nsp)  # the model's limit: by the caller
        if store.meta["vocabulary_sha256"] != vocabulary_hash(tokenizer):
            raise InputError(f"the token store {store.folder} was made with another vocabulary than this tokenizer's")
        self.store, self.max_length, self.nsp, self.rule, self.seed = store, max_length, nsp, rule, seed
        self.cls_id, self.sep_id = tokenizer.vocab[tokenizer.cls_token], tokenizer.vocab[tokenizer.sep_token]
        self.pad_id = tokenizer.vocab[tokenizer.pad_token]
        if tokenizer.mask_token is None or tokenizer.mask_token not in tokenizer.vocab:
            raise InputError("masked-LM pre-training needs a [MASK] token in the vocabulary")
        self.mask_id, self.vocab_size = tokenizer.vocab[tokenizer.mask_token], len(tokenizer.vocab)
        self.specials = torch.zeros(self.vocab_size, dtype=torch.bool)
        self.specials[[tokenizer.vocab[t] for t in tokenizer.all_special_tokens if t != tokenizer.mask_token]] = True
        self.continuation = continuation_table(tokenizer) if rule.whole_word else None
        self.per_epoch = store.packed_count(max_length) if not nsp else len(store.sentences)
        if self.per_epoch < 1:
            raise InputError(f"the corpus ({store.meta['stream']:,} tokens) is shorter than one example of "
                             f"max_length {max_length}: give more text or a smaller --max-length")
        self._orders: dict[int, np.ndarray] = {}

    def example(self, number: int) -> dict:
        """Example ``number`` of the run: epoch ``number // per_epoch``, its place in that epoch's order."""
        epoch, place = divmod(number, self.per_epoch)
        if epoch not in self._orders:
            self._orders = {epoch: np.random.default_rng([self.seed, epoch]).permutation(self.per_epoch)}
        i = int(self._orders[epoch][place])
        if self.nsp:
            return self.store.nsp_example(i, self.max_length, self.cls_id, self.sep_id, seed=self.seed + 7919 * epoch)
        return self.store.packed_example(i, self.max_length, self.cls_id, self.sep_id)

    def batch(self, numbers: Sequence[int], mask_seed: int | None = None) -> dict:
        """The masked batch of examples ``numbers``; each example's mask is drawn from a generator seeded by
        (``mask_seed`` or the run's seed, its number), so it does not depend on how batches are cut."""
        examples = [self.example(n) for n in numbers]
        batch = collate([e["input_ids"] for e in examples], range(len(examples)), self.pad_id,
                        token_type_ids=[e["token_type_ids"] for e in examples])
        if self.nsp:
            batch["next_sentence_label"] = torch.tensor([e["next_sentence_label"] for e in examples])
        labels = torch.full_like(batch["input_ids"], -100)
        seed = self.seed if mask_seed is None else mask_seed
        for r, n in enumerate(numbers):
            length = len(examples[r]["input_ids"])
            ids = batch["input_ids"][r, :length]
            generator = torch.Generator().manual_seed((seed * 0x9E3779B1 + int(n)) % (1 << 62))
            masked, row_labels = mask_tokens(ids, self.specials[ids], self.rule, self.mask_id, self.vocab_size,
                                             generator, self.continuation)
            batch["input_ids"][r, :length], labels[r, :length] = masked, row_labels
        batch["labels"] = labels
        return batch


class MixedExamples(Examples):
    """Examples of ``main``, with a ``share`` of them replaced by examples of ``other`` -- general text
    replayed during continued pre-training, so the model adapts without forgetting what it knew. Which
    source example n comes from is drawn with a generator seeded by (seed, n): fixed for the run."""

    def __init__(self, main: Examples, other: Examples, share: float):
        if (main.max_length, main.nsp) != (other.max_length, other.nsp):
            raise InputError("the mixed-in text must be cut the same way (max_length, NSP) as the corpus")
        self.__dict__.update(main.__dict__)
        self.main, self.other, self.share = main, other, float(share)

    def example(self, number: int) -> dict:
        draw = random.Random(self.seed * 2_654_435_761 + number).random()
        return (self.other if draw < self.share else self.main).example(number)


def corpus_files(paths: Sequence, what: str = "corpus file") -> list[Path]:
    """Corpus files named directly or found in folders (``*.txt``, ``*.jsonl``), sorted within a folder;
    every one checked (``textfiles.input_file``) before any is read: a missing last file is found before the
    first is tokenised."""
    from ..textfiles import input_file

    files = []
    for p in map(Path, paths):
        if p.is_dir():
            found = sorted(q for q in p.rglob("*") if q.suffix.lower() in (".txt", ".jsonl", ".ndjson"))
            if not found:
                raise InputError(f"{p} holds no .txt or .jsonl file")
            files += found
        else:
            files.append(p)
    if not files:
        raise InputError(f"no {what} given")
    return [input_file(f, what) for f in files]
