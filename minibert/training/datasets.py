"""Reading labelled data for fine-tuning: tables (CSV, TSV, JSON lines) for classification and
regression, and tagged sentences (CoNLL-U, or two-column BIO files) for token classification.
Every problem is an InputError naming the file (and line or column)."""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path

from ..errors import InputError, not_found
from ..textfiles import read_text


@dataclass
class Table:
    texts: list[str]
    labels: list  # strings (classification) or floats (regression)
    pairs: list[str] | None = None


def read_table(path, *, text_column: str = "text", label_column: str = "label", pair_column: str | None = None,
               regression: bool = False) -> Table:
    """Rows of a .csv, .tsv or .jsonl file (chosen by the extension)."""
    path = Path(path)
    if not path.exists():
        raise not_found(path, "data file")
    suffix = path.suffix.lower()
    text = read_text(path, "table")
    if suffix in (".csv", ".tsv"):
        reader = csv.DictReader(text.splitlines(), delimiter="," if suffix == ".csv" else "\t")
        rows = list(reader)
        columns = reader.fieldnames or []
        where = lambda i: f"{path}:{i + 2}"  # noqa: E731 (header is line 1)
    elif suffix in (".jsonl", ".json"):
        rows = []
        for number, line in enumerate(text.split("\n"), start=1):
            if line.strip():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise InputError(f"{path}:{number}: not a JSON object per line: {e}") from None
                if not isinstance(row, dict):
                    raise InputError(f"{path}:{number}: each line must be a JSON object")
                rows.append(row)
        columns = sorted({k for row in rows for k in row})
        where = lambda i: f"{path} row {i + 1}"  # noqa: E731
    else:
        raise InputError(f"{path}: unknown format {suffix!r}; use .csv, .tsv or .jsonl")
    if not rows:
        raise InputError(f"{path} has no rows")
    wanted = [c for c in (text_column, label_column, pair_column) if c]
    missing = [c for c in wanted if c not in columns]
    if missing:
        raise InputError(f"{path} has no column {missing[0]!r}; its columns are {columns}")
    texts, labels, pairs = [], [], []
    for i, row in enumerate(rows):
        values = {c: row.get(c) for c in wanted}
        empty = [c for c, v in values.items() if v is None or (isinstance(v, str) and not v.strip())]
        if empty:
            raise InputError(f"{where(i)}: column {empty[0]!r} is empty")
        texts.append(str(values[text_column]))
        if pair_column:
            pairs.append(str(values[pair_column]))
        label = values[label_column]
        if regression:
            try:
                label = float(label)
            except (TypeError, ValueError):
                raise InputError(f"{where(i)}: label {label!r} is not a number (--task regress)") from None
        labels.append(label if regression else str(label))
    return Table(texts, labels, pairs if pair_column else None)


def read_tagged(path, *, column: str = "upos") -> tuple[list[list[str]], list[list[str]]]:
    """(words, tags) per sentence: a .conllu file (tags from ``column``; a word whose value is ``_`` has the
    tag None: neither trained nor scored), or a two-column file (token, tab or space, BIO tag; a blank line
    between sentences)."""
    path = Path(path)
    if path.suffix.lower() == ".conllu":
        from ..textfiles import read_conllu

        data = read_conllu(path, column=column)
        return [w for w, _ in data], [list(tags) for _, tags in data]  # None: "_" in the file, no tag
    if not path.exists():
        raise not_found(path, "data file")
    lines = read_text(path, "tagged text file").split("\n")
    sentences, tags, words, labels = [], [], [], []
    for number, line in enumerate(lines, start=1):
        line = line.rstrip("\r")
        if not line.strip():
            if words:
                sentences.append(words)
                tags.append(labels)
                words, labels = [], []
            continue
        parts = line.split("\t") if "\t" in line else line.split()
        if len(parts) != 2:
            raise InputError(f"{path}:{number}: expected two columns (token and BIO tag), got {len(parts)}")
        word, tag = parts[0].strip(), parts[1].strip()
        if tag != "O" and not (tag[:2] in ("B-", "I-") and len(tag) > 2):
            raise InputError(f"{path}:{number}: {tag!r} is not a BIO tag (O, B-TYPE or I-TYPE)")
        words.append(word)
        labels.append(tag)
    if words:
        sentences.append(words)
        tags.append(labels)
    if not sentences:
        raise InputError(f"{path} has no sentences")
    return sentences, tags
