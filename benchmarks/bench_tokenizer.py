#!/usr/bin/env python3
"""Tokenizer throughput: minibert's pure-Python BertTokenizer vs transformers' pure-Python tokenizer
(BertTokenizerLegacy in transformers 5, the old "slow" BertTokenizer) and BertTokenizerFast (Rust).

The same 10,000 sentences (built deterministically from the vocabulary: words, sub-words, numbers,
punctuation, accented and non-Latin words) are encoded as one batch call per tokenizer, alternating
the tokenizers over several rounds; each round starts from a fresh minibert tokenizer so its word
cache starts cold. Reports the median sentences per second and writes benchmarks/results/tokenizer.md.

    python benchmarks/bench_tokenizer.py [--model weights/all-MiniLM-L6-v2] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from minibert import BertTokenizer  # noqa: E402

from minibert.tools import timing as harness  # noqa: E402  (the one timing loop)


def make_sentences(vocab: list[str], n: int = 10_000, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    words = [w for w in vocab if w.isalpha() and not w.startswith("[")]
    extras = ["café", "naïve", "Zürich", "東京", "Москва", "العربية", "2024", "3.14", "e-mail", "U.S.",
              "don't", "(see", "above)", "#1", "$20", "50%", "Ünïcödé", "😀"]
    sentences = []
    for _ in range(n):
        k = rng.randint(5, 40)
        toks = [rng.choice(extras) if rng.random() < 0.08 else rng.choice(words) for _ in range(k)]
        if rng.random() < 0.5:
            toks[0] = toks[0].capitalize()
        sentences.append(" ".join(toks) + rng.choice([".", "!", "?", ",", ""]))
    return sentences


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(ROOT / "weights" / "all-MiniLM-L6-v2"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "tokenizer.md"))
    args = parser.parse_args(argv)

    import transformers
    from transformers.models.bert.tokenization_bert_legacy import BertTokenizerLegacy

    vocab = (Path(args.model) / "vocab.txt").read_text(encoding="utf-8").splitlines()
    sentences = make_sentences(vocab)
    fast = transformers.BertTokenizerFast.from_pretrained(args.model)
    slow = BertTokenizerLegacy.from_pretrained(args.model)
    assert BertTokenizer.from_pretrained(args.model)(sentences[:500])["input_ids"] == fast(sentences[:500])["input_ids"]

    runners = {
        "minibert BertTokenizer (pure Python)": lambda: BertTokenizer.from_pretrained(args.model)(sentences),
        "transformers BertTokenizerLegacy (pure Python, 'slow')": lambda: slow(sentences),
        "transformers BertTokenizerFast (Rust)": lambda: fast(sentences),
    }
    times = harness.alternate(runners, args.rounds, warmup=0)  # A, B, C, A, B, C, ...
    rate = {name: len(sentences) / statistics.median(ts) for name, ts in times.items()}
    ours = rate["minibert BertTokenizer (pure Python)"]
    lines = [f"# Tokenizer throughput ({len(sentences):,} sentences, median of {args.rounds} alternating rounds)", "",
             f"Machine: {platform.processor() or platform.machine()}, Python {platform.python_version()}, "
             f"transformers {transformers.__version__}.", "",
             "| tokenizer | sentences/s | minibert is x faster |", "|---|---:|---:|"]
    for name, r in rate.items():
        lines.append(f"| {name} | {r:,.0f} | {ours / r:.2f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.out).write_text(text)
    Path(args.out).with_suffix(".json").write_text(json.dumps({"sentences_per_second": rate}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
