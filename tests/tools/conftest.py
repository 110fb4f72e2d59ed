"""The MiniLM model and a batch of sentence pairs, shared by the tests of tools/ (hooks, surgery, accounting)."""

from __future__ import annotations

import pytest

from conftest import PAIRS
from minibert import BertModel, BertTokenizer


@pytest.fixture(scope="module")
def model(minilm_dir):
    return BertModel.from_pretrained(minilm_dir).eval()


@pytest.fixture(scope="module")
def batch(minilm_dir):
    tok = BertTokenizer.from_pretrained(minilm_dir)
    return dict(tok([a for a, _ in PAIRS], [b for _, b in PAIRS], padding=True, return_tensors="pt"))
