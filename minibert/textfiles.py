"""The files the library reads and writes: plain text one item per line (``read_lines``), CoNLL-U
(``read_conllu``: words and one label column per sentence), JSON (``read_json``, with ``field`` to take
one typed value out of it), a path named inside a folder's files (``inside``), the check of a file about
to be read (``input_file``) or written (``output_file``, ``output_dir``) and writes a killed process cannot leave half done
(``atomic_file``, ``atomic_dir``), a file's sha256 (``file_sha256``). Each names the file (and the line or
field) when it is not what it must be (``InputError``)."""

from __future__ import annotations

import fnmatch
import glob
import os
import re
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Sequence

from .errors import InputError, missing_extra, not_found

PLOT_SUFFIXES = (".png", ".svg", ".pdf")  # what a plot may be written as (``analysis.plots``)


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


#: the deepest nesting a JSON file we read may have: configs are 2-3 levels deep; deeper is a hostile or
#: broken file (and Python's decoder would raise RecursionError past ~1000)
JSON_DEPTH = 64


def _depth(value, limit: int) -> int:
    depth, level = 0, [value]
    while level:
        depth += 1
        if depth > limit:
            return depth
        level = [v for item in level for v in (item.values() if isinstance(item, dict) else item
                                               if isinstance(item, list) else ())]
        level = [v for v in level if isinstance(v, (dict, list))]
    return depth


def read_json(path, kind: type = dict, what: str = "JSON file"):
    """A UTF-8 JSON file holding one ``kind`` (dict or list), nested at most ``JSON_DEPTH`` deep. Anything
    else -- not UTF-8, not JSON, truncated, another top-level type, deeper -- is an InputError naming the
    file; a missing file a FileNotFoundError."""
    import json

    text = read_text(path, what)
    try:
        data = json.loads(text)
    except RecursionError:
        raise InputError(f"{path} nests JSON too deeply to read; a {what} is a few levels at most") from None
    except json.JSONDecodeError as e:
        raise InputError(f"{path} is not valid JSON (truncated or corrupt?): {e}") from None
    if not isinstance(data, kind):
        raise InputError(f"{path} must hold a JSON {'object' if kind is dict else 'array'}, found "
                         f"{_json_type(data)}")
    if _depth(data, JSON_DEPTH) > JSON_DEPTH:
        raise InputError(f"{path} nests JSON more than {JSON_DEPTH} levels deep; a {what} is a few levels at most")
    return data


def _json_type(value) -> str:
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
             dict: "an object", type(None): "null"}
    return names.get(type(value), type(value).__name__)


_MISSING = object()


def field(data: dict, key: str, kinds, where, default=_MISSING, check=None):
    """``data[key]`` if it is of one of ``kinds`` (``bool`` is never taken for ``int``; ``float`` takes an
    int too), else an InputError naming the file (``where``), the field, what it holds and what it must
    be. A missing key gives ``default``, or is an error when there is none. ``check``: a further test
    (value -> message or None)."""
    kinds = kinds if isinstance(kinds, tuple) else (kinds,)
    if key not in data:
        if default is _MISSING:
            raise InputError(f"{where}: the field {key!r} is missing")
        return default
    value = data[key]
    ok = any(value is None if k is None else
             (isinstance(value, (int, float)) and not isinstance(value, bool)) if k is float else
             (isinstance(value, int) and not isinstance(value, bool)) if k is int else
             isinstance(value, k) for k in kinds)
    problem = None if ok else "it must be " + " or ".join(_json_type(k()) if k is not None else "null"
                                                          for k in kinds)
    if problem is None and check is not None:
        problem = check(value)
    if problem:
        shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
        raise InputError(f"{where}: {key!r} is {_json_type(value)} ({shown}); {problem}")
    return value


def inside(folder, name, where: str) -> Path:
    """``folder / name`` for a path named in one of the folder's own files (a sentence-transformers module,
    a shard of an index), required to stay inside ``folder``: an absolute path, ``..``, or a link that
    leads out is an InputError naming the file that said it. The one place links may lead is where the
    hub cache keeps a snapshot's files: a snapshot (``.../models--org--name/snapshots/<commit>``) holds
    links into its repository's ``blobs/``."""
    if not isinstance(name, str):
        raise InputError(f"{where}: a path must be a string, got {_json_type(name)} ({name!r})")
    folder = Path(folder)
    root = folder.resolve()
    allowed = root.parent.parent if root.parent.name == "snapshots" else root  # a hub snapshot: its repository
    target = folder / name
    lexical = Path(os.path.normpath(root / name))
    resolved = target.resolve()
    if (Path(name).is_absolute() or not lexical.is_relative_to(root)
            or not (resolved == root or resolved.is_relative_to(allowed))):
        raise InputError(f"{where}: the path {name!r} leads outside {folder} (to {resolved}); paths in a model "
                         "folder's files must stay inside it")
    return target


def file_sha256(path, chunk: int = 1 << 20) -> str:
    """sha256 (hex) of a file's bytes, read in 1 MB chunks: what a cache, a run's record of its inputs and
    the record of the files minibert wrote compare."""
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(chunk), b""):
            h.update(block)
    return h.hexdigest()


def read_lines(path) -> list[str]:
    """The lines of a UTF-8 text file, split on "\\n" only (a "\\r\\n" ending counts as one): U+2028, form
    feeds and other characters that str.splitlines() would break on stay inside their line, so line i of
    the file is row i of the output. A final newline does not start another line."""
    lines = read_text(path).split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return [line[:-1] if line.endswith("\r") else line for line in lines]


def input_file(path, what: str = "file") -> Path:
    """Check a file to be read, before any work: it exists (``errors.not_found`` otherwise), is a regular
    file and is readable; returns it as a Path."""
    path = Path(path)
    if not path.exists():
        raise not_found(path, what)
    if not path.is_file():
        raise InputError(f"{what} {str(path)!r} is not a regular file")
    if not os.access(path, os.R_OK):
        raise InputError(f"{what} {str(path)!r} is not readable (permissions)")
    return path


def output_file(path, suffix: str, what: str, formats: Sequence[str] | None = None) -> Path:
    """Check a file to be written, before any work: its directory exists (never created) and is writable,
    and it is not a directory. ``suffix`` is added to a name without it, as the writer would add it, so the
    path returned (and printed) is the real one. With ``formats`` (the suffixes the writer takes, e.g. a
    plot's), ``suffix`` is added only to a name with no suffix, and another suffix is an InputError."""
    if not str(path).strip():
        raise InputError(f"{what} is empty; give a file name")
    if str(path).endswith(("/", os.sep)) or Path(path).expanduser().is_dir():
        folder = Path(path).expanduser()
        beside = folder.parent / (folder.resolve().name + suffix)  # beside the folder, never inside what it holds
        raise InputError(f"{what} {str(path)!r} is a directory; give a file name (e.g. {str(beside)!r})")
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
    if not str(path).strip():
        raise InputError(f"{what} is empty; give a folder (it is never taken as the current one)")
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


# ------------------------------------------------------------------------------------ atomic writes
def _fsync(path: Path) -> None:
    """Flush a file, or a folder's entries, to the disk (where the platform lets a folder be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextmanager
def atomic_file(path):
    """Write ``path`` so that a process killed at any moment leaves either the old file or the new one:
    the caller writes to the temporary path this yields (same folder, a name starting with ``.``); on
    success it is flushed to the disk and renamed over ``path`` (one atomic rename); on an error it is
    removed and ``path`` is untouched."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        yield tmp
        _fsync(tmp)
        os.replace(tmp, path)
        _fsync(path.parent)
    finally:
        if tmp.exists():
            tmp.unlink()


def write_text_atomic(path, text: str) -> None:
    """``Path(path).write_text(text)`` through ``atomic_file`` (UTF-8)."""
    with atomic_file(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


_AT_FDCWD, _RENAME_EXCHANGE = -100, 2


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux ``renameat2(RENAME_EXCHANGE)``); False where the platform or
    the file system cannot."""
    import ctypes
    import errno

    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(code, os.strerror(code), str(b))


def _carry_over(old: Path, new: Path, replaced=()) -> None:
    """Put into ``new`` every file of ``old`` that ``new`` has not got and no ``replaced`` pattern names
    (hard links, copies where links cannot be made): the files other writers keep in the folder (a
    tokenizer, metrics) survive; stale files of the writer's own kind (an old shard) do not."""
    for item in old.iterdir():
        target = new / item.name
        if any(fnmatch.fnmatch(item.name, pattern) for pattern in replaced):
            continue
        if item.is_dir() and not item.is_symlink():
            target.mkdir(exist_ok=True)
            _carry_over(item, target)
        elif not target.exists() and not target.is_symlink():
            try:
                os.link(item, target, follow_symlinks=False)
            except OSError:
                shutil.copy2(item, target, follow_symlinks=False)


def _remove_stale(path: Path) -> None:
    """Delete what earlier writes to ``path`` left beside it when their process was killed mid-way: the
    ``.<name>.<pid>.*.tmp`` folders of processes that no longer run."""
    for item in path.parent.glob(f".{glob.escape(path.name)}.*.tmp*"):
        parts = item.name[len(path.name) + 2:].split(".", 1)
        if not parts[0].isdigit() or int(parts[0]) == os.getpid():
            continue
        try:
            os.kill(int(parts[0]), 0)
            continue  # its writer still runs
        except ProcessLookupError:
            shutil.rmtree(item, ignore_errors=True)
        except (PermissionError, OSError):
            continue


def _umask() -> int:
    """The process's umask, read without changing it where Linux says it (/proc), else set and restored."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def temporary_dir(prefix: str, parent) -> Path:
    """A new folder in ``parent`` for a write that is renamed into place afterwards, with the permissions a
    plain ``mkdir`` gives under the umask (``tempfile.mkdtemp`` makes it 0700: the folder it becomes would
    then be closed to everyone but its owner, unlike a folder the same command creates directly)."""
    import tempfile

    tmp = Path(tempfile.mkdtemp(prefix=prefix, suffix=".tmp", dir=parent))
    os.chmod(tmp, 0o777 & ~_umask())
    return tmp


@contextmanager
def atomic_dir(path, replaced=()):
    """Write the files of folder ``path`` so that a process killed at any moment leaves either the old
    folder's content or the new one, never a mix: the caller writes into the temporary folder this yields
    (beside ``path``, named ``.<name>.<pid>.<random>.tmp``); on success the old folder's other files are
    linked in, every file is flushed to the disk, and the two folders are swapped in one step
    (``renameat2`` with ``RENAME_EXCHANGE`` on Linux; elsewhere two renames, a window of microseconds); the
    old content is then deleted. ``replaced``: name patterns of the old folder's files that the new
    content replaces whether or not it has them (``model*.safetensors`` for a checkpoint: an old shard is
    not kept beside a new single file). A write killed half-way leaves its temporary folder, which the next
    write to the same path deletes once its process is gone. The parent folder is created when missing,
    as ``save_pretrained`` always did."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise InputError(f"{path} is a file; a checkpoint is written to a folder")
    path.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale(path)
    tmp = temporary_dir(f".{path.name}.{os.getpid()}.", path.parent)
    try:
        yield tmp
        mode = 0o666 & ~_umask()  # the writers' files as open() makes them (safetensors' are 0600 otherwise)
        for root, _, files in os.walk(tmp):
            for name in files:
                if not (Path(root) / name).is_symlink():
                    os.chmod(Path(root) / name, mode)
        if path.is_dir():
            _carry_over(path, tmp, replaced)
        for root, _, files in os.walk(tmp):
            for name in files:
                _fsync(Path(root) / name)
        if not path.exists():
            os.rename(tmp, path)
        elif not _exchange(tmp, path):
            old = tmp.with_name(tmp.name + ".old")
            os.rename(path, old)
            os.rename(tmp, path)
            tmp = old
        _fsync(path.parent)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
