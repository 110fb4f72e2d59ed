"""The files the library reads and writes: plain text one item per line (``read_lines``), CoNLL-U
(``read_conllu``: words and one label column per sentence), and the check of a file about to be written
(``output_file``, ``output_dir``). Each names the file (and the line) when it is not what it must be (``InputError``)."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Sequence

from .errors import InputError, missing_extra, not_found


def read_text(path, what: str = "text file") -> str:
    """The whole of a UTF-8 file, line endings untranslated (a "\\r" stays). A missing file is a
    FileNotFoundError; a directory or bytes that are not UTF-8 an InputError naming the file."""
    try:
        with open(path, encoding="utf-8", newline="") as f:  # newline="": no translation of \r
            return f.read()
    except UnicodeDecodeError as e:
        raise InputError(f"{path} is not UTF-8 text ({e}); a {what} must be UTF-8") from None
    except IsADirectoryError:
        raise InputError(f"{path} is a directory, not a {what}") from None


def read_lines(path) -> list[str]:
    """The lines of a UTF-8 text file, split on "\\n" only (a "\\r\\n" ending counts as one): U+2028, form
    feeds and other characters that str.splitlines() would break on stay inside their line, so line i of
    the file is row i of the output. A final newline does not start another line."""
    lines = read_text(path).split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return [line[:-1] if line.endswith("\r") else line for line in lines]


def output_file(path, suffix: str, what: str, formats: Sequence[str] | None = None) -> Path:
    """Check a file to be written, before any work: its directory exists (never created) and is writable,
    and it is not a directory. ``suffix`` is added to a name without it, as the writer would add it, so the
    path returned (and printed) is the real one. With ``formats`` (the suffixes the writer takes, e.g. a
    plot's), ``suffix`` is added only to a name with no suffix, and another suffix is an InputError."""
    if str(path).endswith(("/", os.sep)) or Path(path).expanduser().is_dir():
        raise InputError(f"{what} {str(path)!r} is a directory; give a file name (e.g. {str(Path(path) / ('out' + suffix))!r})")
    out = Path(path).expanduser()
    if formats is None:
        if out.suffix != suffix:
            out = out.with_name(out.name + suffix)
    else:
        if not out.suffix:
            out = out.with_name(out.name + suffix)
        if out.suffix.lower() not in formats:
            raise InputError(f"{what} {str(out)!r}: {out.suffix!r} is not a supported format; use one of "
                             f"{', '.join(formats)}")
    if out.is_dir():
        raise InputError(f"{what} {str(out)!r} is a directory")
    if not out.parent.is_dir():
        raise InputError(f"{what} {str(out)!r}: the directory {str(out.parent)!r} does not exist (create it first)")
    if not os.access(out.parent, os.W_OK):
        raise InputError(f"{what} {str(out)!r}: the directory {str(out.parent)!r} is not writable")
    return out


def output_dir(path, what: str = "--out") -> Path:
    """Check a folder to be written, before any work -- the rule of every command that writes a folder: it
    exists (a folder, writable), or it will be created as the last level only, so its parent must exist
    (a typo such as ``/nope/run`` is refused, never created)."""
    out = Path(path).expanduser()
    if out.exists():
        if not out.is_dir():
            raise InputError(f"{what} {str(out)!r} is a file; give a folder")
        if not os.access(out, os.W_OK):
            raise InputError(f"{what} {str(out)!r}: the folder is not writable")
        return out
    parent = out.parent
    if not parent.is_dir():
        raise InputError(f"{what} {str(out)!r}: its parent folder {str(parent)!r} does not exist; only the last level "
                         "of an output folder is created (create the parent first)")
    if not os.access(parent, os.W_OK):
        raise InputError(f"{what} {str(out)!r}: the folder {str(parent)!r} is not writable")
    return out


_CONLLU_ID = re.compile(r"[1-9][0-9]*(-[1-9][0-9]*|\.[1-9][0-9]*)?")  # 3, 3-4 (multi-word) or 3.1 (empty node)


def read_conllu(path, column: str = "upos") -> list[tuple[list[str], list[str | None]]]:
    """(words, labels) per sentence of a CoNLL-U file, labels from ``column`` (upos, xpos, deprel, ...).
    Multi-word tokens (ranges like 1-2) and empty nodes (1.1) are skipped; the syntactic words are kept.
    ``_`` (CoNLL-U's "no value") is no label: that word's label is None, it stays in the sentence for
    context but is neither trained nor tested on. A malformed file is an InputError naming the file and
    the line."""
    try:
        import conllu
    except ImportError:
        raise missing_extra("reading CoNLL-U", "conllu", "conllu") from None
    path = Path(path)
    if not path.exists():
        raise not_found(path, "CoNLL-U file")
    lines = read_text(path, "CoNLL-U file").split("\n")

    blocks, current = [], []  # (first line number, lines) per sentence
    for number, line in enumerate(lines, start=1):
        line = line.rstrip("\r")
        if not line.strip():
            if current:
                blocks.append(current)
                current = []
            continue
        if not line.startswith("#"):
            fields = line.split("\t")
            if len(fields) != 10:
                hint = " (columns must be separated by tabs, not spaces)" if len(fields) == 1 else ""
                raise InputError(f"{path}:{number}: a CoNLL-U word line has 10 tab-separated columns, this "
                                 f"one has {len(fields)}{hint}: {line[:60]!r}")
            if not _CONLLU_ID.fullmatch(fields[0]):
                raise InputError(f"{path}:{number}: {fields[0]!r} is not a CoNLL-U word ID (1, 2, ..., a range "
                                 "like 3-4 or an empty node like 3.1)")
        current.append((number, line))
    if current:
        blocks.append(current)

    sentences = []
    for block in blocks:
        first = block[0][0]
        try:
            parsed = conllu.parse("\n".join(line for _, line in block) + "\n\n")
        except Exception as e:  # conllu.exceptions.ParseException and the like: say where
            raise InputError(f"{path}:{first}: the sentence starting here is not valid CoNLL-U: {e}") from None
        for sentence in parsed:
            words, labels = [], []
            for token in sentence:
                if not isinstance(token["id"], int):
                    continue
                if column not in token:
                    raise InputError(f"{path}:{first}: there is no column {column!r}; columns are "
                                     f"{list(token.keys())}")
                value = token[column]
                words.append(token["form"])
                labels.append(None if value is None or value == "_" else str(value))
            if words:
                sentences.append((words, labels))
    if not sentences:
        raise InputError(f"{path} holds no sentences")
    if not any(label is not None for _, labels in sentences for label in labels):
        raise InputError(f"{path}: every word's {column!r} is '_' (no value): there is nothing to probe; "
                         "pick a column that this file fills in")
    return sentences
