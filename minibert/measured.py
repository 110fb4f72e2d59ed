"""Choices measured once per machine and kept: which kernel is fastest here (``tools.kernels``' fp32
routes and whole-block plans, ``tools.varlen``'s attention kernels, ``quantize``'s int8 engine).

A choice holds for a machine key -- the CPU model and a hash of its flags (two generations may share a
model name), torch's thread count and version -- and is kept in a JSON file under ``$MINIBERT_CACHE``
(default ``$XDG_CACHE_HOME/minibert`` or ``~/.cache/minibert``), {machine: {what: entry}}, so later
processes do not measure again. A damaged file is measured again; a folder that cannot be written is
skipped (the choice then lasts for the process).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import threading
from pathlib import Path

import torch

from .errors import InputError
from .hardware import cpu_info

CACHE_ENV = "MINIBERT_CACHE"


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "minibert"))


def machine_key() -> str:
    """What a measured choice holds for: the CPU model and its flags, torch's thread count and version."""
    name, flags = cpu_info()
    digest = hashlib.sha256(" ".join(sorted(flags)).encode()).hexdigest()[:8]
    return f"{name or 'unknown CPU'} (flags {digest}) | {torch.get_num_threads()} threads | torch {torch.__version__}"


def read_json(path: Path) -> dict:
    """A cache file of measured choices ({machine: {what: entry}}); {} when there is none or it is damaged."""
    try:
        saved = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return saved if isinstance(saved, dict) else {}


def saved_entry(path: Path, machine: str, what: str) -> dict | None:
    """The entry kept for ``what`` on ``machine`` in the cache file ``path``, or None."""
    mine = read_json(path).get(machine)
    entry = mine.get(what) if isinstance(mine, dict) else None
    return entry if isinstance(entry, dict) else None


def write_json_entry(path: Path, machine: str, what: str, entry: dict) -> None:
    """Add one choice to the cache file ``path``: read, updated and written under a lock (a thread lock, and
    an exclusive ``flock`` on ``.NAME.lock`` beside it where the system has one), so two processes measuring
    at once each keep their entry; written to a temporary name and renamed into place, so a reader never
    sees half a file. A folder that cannot be written is skipped."""
    path = Path(path)
    with _WRITING:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with _file_lock(path.with_name(f".{path.name}.lock")):
                saved = read_json(path)
                mine = saved.get(machine) if isinstance(saved.get(machine), dict) else {}
                saved[machine] = {**mine, what: entry}
                tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
                tmp.write_text(json.dumps(saved, indent=1, sort_keys=True) + "\n", encoding="utf-8")
                os.replace(tmp, path)
        except OSError:
            pass


_WRITING = threading.Lock()
_MEASURING = threading.Lock()


def measure_once(path: Path, machine: str, what: str, usable, measure) -> dict:
    """The entry for ``what`` on ``machine`` in the cache file ``path``: the saved one when ``usable(entry)``
    says so, else ``measure()``'s, written there. Measuring happens under a lock (a thread lock and an
    exclusive ``flock`` on ``.NAME.measure.lock``), and the file is read again once the lock is held: processes
    that start together -- Ray actors sharing one GPU, say -- measure one at a time, and those after the first
    take its entry instead of measuring under its load (a choice made under contention would be kept for
    good)."""
    path = Path(path)
    entry = saved_entry(path, machine, what)
    if entry is not None and usable(entry):
        return entry
    with _MEASURING:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            lock = _file_lock(path.with_name(f".{path.name}.measure.lock"))
        except OSError:  # a folder that cannot be written: measure without the lock, keep nothing
            lock = contextlib.nullcontext()
        with lock:
            entry = saved_entry(path, machine, what)
            if entry is not None and usable(entry):
                return entry
            entry = measure()
            write_json_entry(path, machine, what, entry)
            return entry


@contextlib.contextmanager
def _file_lock(lock_path: Path):
    """An exclusive lock on ``lock_path`` across processes (``fcntl.flock``; nothing where there is no fcntl)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        yield
        return
    with open(lock_path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def forced_choice(variable: str, choices: tuple) -> str | None:
    """The choice an environment variable fixes instead of measuring (checked against ``choices``), or None
    when it is not set."""
    forced = os.environ.get(variable, "").strip()
    if not forced:
        return None
    if forced not in choices:
        raise InputError(f"{variable}={forced!r}: use one of {choices} (or unset it to measure)")
    return forced
