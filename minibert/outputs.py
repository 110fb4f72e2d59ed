"""Where a command writes a run: one rule for every output folder, and one writer at a time.

Every command that trains or writes a folder of results (``pretrain``, ``finetune``, ``distill``,
``exits``, ``depth-study``, ``embed --engine ray``) goes through ``RunFolder``; ``embed`` and ``search
--index``, which write one file, through ``check_not_reading``. The rule, checked before any work:

1. **Never into what the command reads.** ``--out`` may not be, contain or sit inside a model folder the
   command reads (``--model``, ``--teacher``, ``--vocab``, a task module's base): a run written there
   would replace the model's ``config.json`` and weights, or bury a model inside a run.
2. **Never over another run or model.** A folder that holds anything is refused unless the command is
   told what to do with it: ``--resume`` continues the unfinished run of the same command that is there
   (same settings, checked), ``--overwrite`` replaces the folder -- what it held is gone in one step
   (``textfiles``' exchange of two folders), never mixed with the new run. ``--overwrite`` only replaces
   a folder minibert or a checkpoint wrote (a model, a run, a study, a task module); a folder of other
   files is left to its owner.
   ``--overwrite`` replaces only what minibert wrote: a folder whose run record (rule 4) accounts for every
   file in it. A file minibert cannot account for (a user's notes, a checkpoint copied in) is never deleted:
   the folder is refused, naming the files.
3. **One writer per folder.** ``claim()`` holds a lock file (``locks.Lock``: ``.minibert.lock``, an advisory ``flock``
   plus the pid, host and command) for the run; a second run into the same folder is refused in one line.
   A lock left by a killed process is seen as stale -- on this host the kernel released its ``flock``;
   a lock from another host is refused, naming the host and pid, since only that host can tell.
4. **A record of the run.** ``.minibert-run.json`` says which command wrote the folder, with which
   settings, and whether it finished, stopped (and why) or was interrupted. ``--resume`` reads it: a
   finished run has nothing to resume, a run of another command or with other settings is refused naming
   the setting. A run that fails before it wrote anything leaves nothing behind (a folder it created is
   removed).

The same rule holds for every *file* a command writes (``--json``, ``--index``, ``--plot``, embed's ``--out``):
``check_paths`` reads each command's declared paths (``settings.Setting.path``: a model read, a data file
read, a run folder written, a file written) and refuses, before any work, a written path that any read
path points to or lies inside, and an existing file minibert did not write -- told by the record it keeps
of what it wrote (``.minibert-files.json`` in the file's folder: name, size, sha256), never by the file's
name -- unless ``--overwrite``, which replaces that one file the user named. After the command,
``note_written`` records what it wrote.

A ``KeyboardInterrupt`` (Ctrl-C) inside ``claim()`` comes out with the place the run can resume from as
its message (the command line prints it).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Mapping

from .errors import InputError
from .locks import LOCK_FILE, Lock, alive, held_by, held_message, process_start
from .textfiles import _exchange, file_sha256, output_dir, output_file, temporary_dir, write_text_atomic

RECORD_FILE = ".minibert-run.json"
FILES_RECORD = ".minibert-files.json"  # what minibert wrote into a folder, file by file (``note_written``)


# ------------------------------------------------------------------------------------ what a path is
def model_folder(source) -> Path | None:
    """The local folder a model source lives in (a folder, or the folder of a ``.safetensors`` file),
    resolved; None for a hub id, a model object or nothing."""
    if source is None or not isinstance(source, (str, os.PathLike)):
        return None
    path = Path(source).expanduser()
    if not path.exists():
        return None
    return (path if path.is_dir() else path.parent).resolve()


@dataclass(frozen=True)
class Read:
    """A path a command reads: ``kind`` "model" (a model or run folder, or a checkpoint file: its whole folder
    is protected) or "read" (a data file or folder: that path is protected). ``source`` may be one path or
    several; hub ids, objects and paths that do not exist are skipped."""

    kind: str
    source: object


def _data_path(value) -> Path | None:
    """The file or folder a data argument names (``FILE:share`` -- pretrain's ``--mix`` -- its FILE), resolved;
    None when it names nothing on disk (a glob, a missing file: the reader says so)."""
    if not isinstance(value, (str, os.PathLike)) or not str(value):
        return None
    path = Path(value).expanduser()
    if not path.exists() and ":" in str(value):
        path = Path(str(value).rsplit(":", 1)[0]).expanduser()
    return path.resolve() if path.exists() else None


#: how many entries of a read folder are followed for links out of it (a model folder holds a few dozen)
LINK_SCAN_LIMIT = 20_000


def linked_out(folder: Path) -> list[Path]:
    """The resolved targets of the links under ``folder`` that point outside it: what the folder's readers
    really read there. A folder of links to another model's files reads that model, which a run must then
    not delete or replace either."""
    out: list[Path] = []
    seen = 0
    for root, dirs, files in os.walk(folder):
        here = Path(root)
        for name in files + dirs:
            seen += 1
            if seen > LINK_SCAN_LIMIT:
                return out
            item = here / name
            if item.is_symlink():
                target = item.resolve()
                if not target.is_relative_to(folder) and target not in out:
                    out.append(target)
    return out


def protected(reads: Mapping[str, object]) -> list[tuple[str, str, Path]]:
    """(option, kind, resolved path) of everything ``reads`` names on disk: a model's folder, a data path,
    and (kind "link") what a link inside a read folder points to outside it."""
    out = []
    for option, source in reads.items():
        kind, values = (source.kind, source.source) if isinstance(source, Read) else ("model", source)
        for value in values if isinstance(values, (list, tuple)) else [values]:
            path = model_folder(value) if kind == "model" else _data_path(value)
            if path is not None:
                out.append((option, kind, path))
                if path.is_dir():
                    out += [(option, "link", target) for target in linked_out(path)]
    return out


def check_not_reading(out, reads: Mapping[str, object], what: str = "--out") -> None:
    """Refuse an output path that is, contains or sits inside a path the command reads. ``reads``: {option
    name: model source or ``Read``} (a bare source is a model: its whole folder is protected; hub ids and None
    are skipped)."""
    target = Path(out).expanduser().resolve()
    for option, kind, path in protected(reads):
        if target == path:
            how = "is"
        elif target.is_relative_to(path):
            how = "sits inside"
        elif path.is_relative_to(target):
            how = "contains"
        else:
            continue
        if kind == "link":
            raise InputError(f"{what} {str(out)!r} {how} {path}, which a link in the folder {option} reads points to: "
                             f"the command reads that file, so writing there would {'destroy' if how == 'is' else 'replace or delete'} "
                             f"its own input; give {what} a path of its own")
        if kind == "model":
            raise InputError(f"{what} {str(out)!r} {how} the model folder {option} reads ({path}): what is written "
                             f"there would {'replace or mix with' if how != 'contains' else 'bury'} that model's "
                             f"files; give {what} a path of its own")
        raise InputError(f"{what} {str(out)!r} {how} {path}, which {option} reads: writing there would "
                         f"{'destroy' if how == 'is' else 'replace or delete'} the command's own input; give {what} "
                         "a path of its own")


# ------------------------------------------------------------------------------- files minibert wrote
def _files_record(folder: Path) -> dict:
    try:
        data = json.loads((folder / FILES_RECORD).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    files = data.get("files") if isinstance(data, dict) else None
    return files if isinstance(files, dict) else {}


def written_by_minibert(path) -> dict | None:
    """What minibert recorded when it wrote the file ``path`` (command, size, sha256), or None when it did
    not write it or the file changed since (its size or sha256 differ): then it is the user's."""
    path = Path(path).expanduser()
    entry = _files_record(path.parent).get(path.name)
    if not isinstance(entry, dict) or path.is_symlink() or not path.is_file():
        return None
    if entry.get("size") != path.stat().st_size or entry.get("sha256") != file_sha256(path):
        return None
    return entry


def note_written(path, command: str) -> None:
    """Record that ``command`` wrote the file ``path`` (as it is now) in its folder's ``.minibert-files.json``,
    so that a later run may replace it without ``--overwrite``. Entries of files gone are dropped."""
    path = Path(path).expanduser()
    if not path.is_file():
        return
    folder = path.parent
    files = {name: entry for name, entry in _files_record(folder).items() if (folder / name).is_file()}
    files[path.name] = {"command": command, "size": path.stat().st_size, "sha256": file_sha256(path),
                        "written": time.strftime("%Y-%m-%d %H:%M:%S")}
    write_text_atomic(folder / FILES_RECORD, json.dumps({"files": files}, indent=1, sort_keys=True) + "\n")


def check_output_file(path, reads: Mapping[str, object], what: str, overwrite: bool = False,
                      companion_of: Path | None = None) -> Path:
    """The one rule for a file a command writes, before any work: never a path the command reads (nor inside a
    model folder it reads), never an existing file minibert did not write (``written_by_minibert``) unless
    ``overwrite``. ``companion_of``: the file the user named, when ``path`` is one written beside it (an
    index's .json), which ``--overwrite`` never replaces unless minibert wrote it. Returns the path."""
    path = Path(path)
    check_not_reading(path, reads, what)
    if path.name == FILES_RECORD:
        raise InputError(f"{what} {str(path)!r}: {FILES_RECORD} is minibert's record of the files it wrote; choose "
                         "another name")
    if (path.exists() or path.is_symlink()) and not overwrite and written_by_minibert(path) is None:
        if companion_of is not None:
            raise InputError(f"{what} {str(companion_of)!r} is written with a file beside it, and {str(path)!r} exists "
                             "and minibert did not write it (or it changed since): --overwrite replaces the file you "
                             "named, never one beside it that is not minibert's; move it away, or choose another name")
        raise InputError(f"{what} {str(path)!r} exists and minibert did not write it (or it changed since): it is "
                         f"never replaced unasked; pass --overwrite to replace it, or choose another name")
    return path


# ------------------------------------------------------------------- the paths a command declares
def reads_of(run) -> dict[str, Read]:
    """{option: ``Read``} of every path the settings dataclass instance ``run`` declares it reads
    (``settings.Setting.path`` "model" or "read")."""
    from .settings import described, flag_of

    out = {}
    for field, about, _ in described(type(run)):
        value = getattr(run, field.name)
        # a list (not a tuple of paths) is what Python gives for texts themselves: no path to protect
        if about.path in ("model", "read") and value is not None and not isinstance(value, list):
            out[flag_of(field, about)] = Read(about.path, value)
    return out


def check_paths(run) -> list[Path]:
    """The one rule for every path ``run`` (a command's settings) declares it writes, before any work: a run
    folder (``path="run"``) is not, inside or around a path it reads (``RunFolder`` checks the rest when it
    is claimed); a file (``path="file"``, with its ``companions``) is checked by ``check_output_file``
    (``--overwrite``, where the command has it, lets it replace a file minibert did not write), and no two
    written files are one. Returns the files' real paths (suffix added), to ``note_written`` afterwards."""
    from .settings import described, flag_of

    reads, overwrite = reads_of(run), bool(getattr(run, "overwrite", False))
    written: dict[Path, str] = {}
    for field, about, _ in described(type(run)):
        value = getattr(run, field.name)
        if value is None or about.path not in ("run", "file"):
            continue
        kind = (run.path_kind(field.name) if hasattr(run, "path_kind") else None) or about.path
        flag = flag_of(field, about)
        if kind == "run":
            folder = output_dir(value, flag)
            check_not_reading(folder, reads, flag)
            if overwrite and contents(folder):  # what --overwrite would delete: all of it minibert's, or nothing
                check_replaceable(folder, flag, str(value))
            continue
        path = output_file(value, about.suffix or "", flag, about.formats)
        for each in [path, *(path.with_name(path.name[:-len(path.suffix)] + c) for c in about.companions)]:
            # --overwrite replaces the file the user named; a file beside it (the index's .json) only if minibert
            # wrote it: a file it cannot account for, and the user did not name, is never deleted
            check_output_file(each, reads, flag, overwrite and each == path, None if each == path else path)
            real = each.expanduser().resolve()
            if real in written:
                raise InputError(f"{flag} {str(value)!r} and {written[real]} name the same file ({real}); give each "
                                 "output a file of its own")
            written[real] = flag
    return list(written)


#: the files of a model folder that make the model (what a run's fingerprint of it covers)
MODEL_FILES = ("config.json", "vocab.txt", "tokenizer_config.json", "*.safetensors")


def fingerprint_reads(reads: Mapping[str, object]) -> dict[str, dict]:
    """{resolved file: {"size", "sha256"}} of every file ``reads`` names on disk: a data file, the files of a
    data folder, a model's own files (``MODEL_FILES`` of its folder). A resumed run compares them
    (``changed_reads``): a run that goes on over other data would silently be another run."""
    found: dict[str, dict] = {}
    for _, kind, path in protected(reads):
        if kind == "link":  # read through the folder's own files below
            continue
        if kind == "model":
            files = [f for pattern in MODEL_FILES for f in sorted(path.glob(pattern)) if f.is_file()]
        elif path.is_dir():
            files = sorted(f for f in path.rglob("*") if f.is_file())
        else:
            files = [path]
        for f in files:
            if str(f) not in found:
                found[str(f)] = {"size": f.stat().st_size, "sha256": file_sha256(f)}
    return found


def changed_reads(saved: Mapping[str, dict], now: Mapping[str, dict]) -> list[str]:
    """The files whose fingerprint differs from the one a run recorded (gone, added, or changed)."""
    out = []
    for name in sorted(set(saved) | set(now)):
        if name not in now:
            out.append(f"{name} is gone")
        elif name not in saved:
            out.append(f"{name} was not read then")
        elif saved[name] != now[name]:
            out.append(f"{name} changed (size {saved[name].get('size')} -> {now[name]['size']} bytes, sha256 differs)")
    return out


def read_record(folder) -> dict | None:
    """The run record of a folder (``.minibert-run.json``), or None when it has none or it is unreadable."""
    try:
        record = json.loads((Path(folder) / RECORD_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and isinstance(record.get("command"), str) else None


def contents(folder) -> list[str]:
    """The names a folder holds, its lock file left out (sorted); [] for a folder that does not exist."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    return sorted(p.name for p in folder.iterdir() if p.name != LOCK_FILE)


def _files_under(folder: Path) -> list[str]:
    """Every file under ``folder`` (relative paths, symbolic links as files), its lock and record left out."""
    out = []
    for root, dirs, files in os.walk(folder):
        here = Path(root)
        for name in files + [d for d in dirs if (here / d).is_symlink()]:
            rel = (here / name).relative_to(folder).as_posix()
            if rel not in (LOCK_FILE, RECORD_FILE):
                out.append(rel)
    return sorted(out)


def unaccounted(folder) -> list[str]:
    """The files under ``folder`` that no minibert record accounts for: a run record lists what its run had
    written when it last wrote the record (``files``); a sub-folder with a record of its own (a depth
    study's runs) answers for itself. Without a record, every file."""
    folder = Path(folder)
    record = read_record(folder) or {}
    known = set(record.get("files") or [])
    declared = tuple(str(name) for name in record.get("declared") or [])  # ``RunFolder.will_write``
    out, own = [], {}
    for rel in _files_under(folder):
        if rel in known or rel in declared or rel.startswith(tuple(f"{d}/" for d in declared)):
            continue
        parts = rel.split("/")
        sub = next((Path(*parts[:i]) for i in range(1, len(parts))
                    if (folder / Path(*parts[:i]) / RECORD_FILE).is_file()), None)
        if sub is None:
            out.append(rel)
        elif sub not in own:
            own[sub] = [f"{sub.as_posix()}/{r}" for r in unaccounted(folder / sub)]
    return sorted(out + [r for rs in own.values() for r in rs])


def check_replaceable(folder, what: str, shown: str) -> None:
    """Refuse ``--overwrite`` of a folder holding a file no minibert record accounts for (``unaccounted``)."""
    held, ours = describe(folder)
    if not ours:
        raise InputError(f"--overwrite replaces only what minibert wrote, and {what} {shown!r} holds {held}: nothing "
                         "is deleted. Move those files out (or empty the folder yourself), or choose another folder")


def describe(folder) -> tuple[str, bool]:
    """(what the folder holds, in words; whether minibert wrote all of it: a run record accounting for every
    file, ``unaccounted``)."""
    folder = Path(folder)
    record = read_record(folder)
    foreign = unaccounted(folder)
    shown = ", ".join(foreign[:4]) + (f" and {len(foreign) - 4} more" if len(foreign) > 4 else "")
    if record is not None:
        status = record.get("status", "unknown")
        if status == "running" and not alive(record.get("host"), record.get("pid"), record.get("process_start")):
            status = "unfinished: its process is gone (killed?)"
        held = f"a `minibert {record['command']}` run ({status})"
        if foreign:
            held += f" and {len(foreign)} file(s) its record does not account for ({shown})"
        return held, not foreign
    return f"{len(foreign)} file(s) no minibert run wrote ({shown})", False


# ------------------------------------------------------------------------------------ the run folder
_HELD: list["RunFolder"] = []  # the run folders this process has claimed now (``account_for``)


def account_for(path) -> None:
    """After a checkpoint is written at ``path`` (the moment a run becomes resumable): the record of the run
    folder this process holds around it lists every file the run has written so far, so that a run killed
    later is still replaced whole by ``--overwrite`` (``unaccounted``). Outside a claimed folder: nothing."""
    target = Path(path).resolve()
    for folder in _HELD:
        if target.is_relative_to(folder.real):
            folder.account()


class RunFolder:
    """An output folder a command writes one run into (see the module docstring for the rule).

    ``RunFolder(path, command=..., reads={"--model": source}, resume=..., overwrite=...)`` checks
    everything that can be checked before any work -- the path, the models read, what the folder holds --
    and creates nothing. ``claim(settings)`` then takes the folder for the run: the lock, the contents
    checked again under it (a run may have finished there meanwhile), the old contents replaced for
    ``overwrite``, the run record written. ``state`` says what the run found: "new" (an empty or new
    folder), "resume" (the unfinished run of this command), "continue" (``continues`` accepted what is
    there: a study picks up its own runs) or "overwrite".

    ``resumable``: the command has ``--resume``. ``writer``: False for the processes of a torchrun job
    other than the first -- they check the path only and write nothing of their own."""

    def __init__(self, path, *, command: str, what: str = "--out", reads: Mapping[str, object] | None = None,
                 resume: bool = False, overwrite: bool = False, resumable: bool = True,
                 continues: Callable[[Path], bool] | None = None, writer: bool = True):
        if resume and overwrite:
            raise InputError("--resume and --overwrite exclude each other: continue the run there, or replace it")
        if resume and not resumable:
            raise InputError(f"`{command}` has no --resume")
        self.shown, self.what, self.command = str(path), what, command
        self.path = output_dir(path, what)
        self.reads = dict(reads or {})
        check_not_reading(self.path, self.reads, what)
        self.real = self.path.resolve()
        self.resume, self.overwrite, self.resumable = resume, overwrite, resumable
        self.continues, self.writer = continues, writer
        self.state: str | None = None
        self.record: dict | None = None  # the record found there (resume, continue)
        self.resume_hint: Callable[[], str | None] | None = None  # where an interrupted run can go on from
        if writer:
            self._decide()

    # what the folder holds, and what may be done with it -------------------------------------------
    def _decide(self) -> str:
        lock = self.real / LOCK_FILE
        if lock.is_symlink() or (lock.exists() and not lock.is_file()):
            raise InputError(f"{self.what} {self.shown!r}: {lock} is not a file, so it is not minibert's lock (which "
                             "is a file it writes): move it away, or choose another folder")
        names = contents(self.real)
        record = read_record(self.real)
        holder = held_by(self.real)
        if holder is not None and holder.get("pid") != os.getpid():
            raise InputError(held_message(f"{self.what} {self.shown!r}", self.real / LOCK_FILE, holder,
                                          stale_hint=holder.get("host") not in (None, socket.gethostname())))
        if not names:
            return "new"
        held, ours = describe(self.real)
        if self.overwrite:
            self._check_replaceable(held, ours)
            return "overwrite"
        same = record is not None and record["command"] == self.command
        finished = same and record.get("status") == "finished"
        if self.resume:
            if not same:
                raise InputError(f"--resume: {self.what} {self.shown!r} holds {held}, not a `minibert {self.command}` "
                                 "run to continue; pass --overwrite to replace it, or choose another folder")
            return "resume"
        if self.continues is not None and self.continues(self.real):
            return "continue"
        ways = []
        if same and not finished and self.resumable:
            ways.append("pass --resume to continue it (same settings)")
        ways.append("pass --overwrite to replace it (everything in it is deleted)" if ours else
                    "empty it yourself")
        ways.append("choose another folder")
        raise InputError(f"{self.what} {self.shown!r} holds {held}; a run is written into an empty or new folder: "
                         + ", or ".join(ways))

    def _check_replaceable(self, held: str, ours: bool) -> None:
        cwd, home = Path.cwd().resolve(), Path.home().resolve()
        if (self.real in (home, Path(self.real.anchor)) or cwd.is_relative_to(self.real)
                or (self.real / ".git").exists()):
            raise InputError(f"--overwrite will not replace {self.shown!r}: it is the working directory, an ancestor "
                             "of it, the home folder or a repository; choose a folder of its own")
        if not ours:
            check_replaceable(self.real, self.what, self.shown)

    # taking the folder for the run -------------------------------------------------------------------
    @contextmanager
    def claim(self, settings: Mapping | None = None, *, compare: Callable[[dict, dict], list[str]] | None = None
              ) -> Iterator["RunFolder"]:
        """Hold the folder for the run inside the ``with`` block (see the class docstring). ``settings``:
        what defines the run (JSON values), recorded; with ``resume`` they must equal the record's
        (``compare(saved, now)`` lists the differences in words; default: every key). A block that ends
        in an error records it as the run's end ("stopped: ..."); one that wrote nothing leaves nothing."""
        if not self.writer:
            yield self
            return
        try:
            self.real.mkdir()
            created = True
        except FileExistsError:
            created = False
        lock = Lock(self.real, self.command, f"{self.what} {self.shown!r}")
        try:
            lock.acquire()
        except BaseException:
            self._let_go(None, created)  # the folder may be the other run's by now: removed only if empty
            raise
        settings = json.loads(json.dumps(dict(settings or {}), default=str))
        had_record = False
        try:
            self.state = self._decide()
            self.record = read_record(self.real)
            if self.state == "overwrite":
                self._replace(lock)
                self.record = None
            had_record = self.record is not None
            if self.state == "resume" and self.record is not None:
                saved = self.record.get("settings") or {}
                differs = (compare or _differences)(saved, settings)
                if differs:
                    raise InputError(f"--resume: {self.what} {self.shown!r} holds a `minibert {self.command}` run made "
                                     f"with other settings ({'; '.join(differs)}): give the same settings, pass "
                                     "--overwrite to replace it, or choose another folder")
            if self.state == "resume" and self.record is not None and "inputs" in self.record:
                changed = changed_reads(self.record["inputs"], fingerprint_reads(self.reads))
                if changed:
                    raise InputError(f"--resume: what {self.what} {self.shown!r}'s run read has changed since it "
                                     f"started ({'; '.join(changed[:3])}{'; ...' if len(changed) > 3 else ''}): "
                                     "going on would make another run than the one recorded. Restore the file, or "
                                     "start again with --overwrite")
            if self.state in ("new", "overwrite") or self.record is None:
                self.record = {"command": self.command, "settings": settings, "status": "running",
                               "started": time.strftime("%Y-%m-%d %H:%M:%S"), "inputs": fingerprint_reads(self.reads)}
            elif self.record.get("status") != "finished":  # resumed or continued: the same run goes on
                self.record["resumed"] = time.strftime("%Y-%m-%d %H:%M:%S")
            finished_before = self.record.get("status") == "finished"
            self._write_record(status=self.record.get("status") if finished_before else "running")
        except BaseException:
            self._let_go(lock, created, wrote_record=not had_record)
            raise
        _HELD.append(self)
        try:
            yield self
        except KeyboardInterrupt:
            hint = self._hint()
            self._write_record(status="interrupted", ended=True)
            lock.release()
            raise KeyboardInterrupt(hint or f"{self.shown}: interrupted") from None
        except BaseException as error:
            if self.state in ("new", "overwrite") and set(contents(self.real)) <= {RECORD_FILE}:
                self._let_go(lock, created, wrote_record=True)  # it failed before writing anything: nothing is left
            else:
                reason = str(error).splitlines()[0] if str(error) else type(error).__name__
                self._write_record(status=f"stopped: {reason}"[:500], ended=True)
                lock.release()
            raise
        else:
            if not finished_before:
                self._write_record(status="finished", ended=True)
            lock.release()
        finally:
            _HELD.remove(self)

    def _hint(self) -> str | None:
        try:
            return self.resume_hint() if self.resume_hint is not None else None
        except Exception:  # a hint must never hide the interruption
            return None

    def _write_record(self, status: str, ended: bool = False) -> None:
        self.record = {**(self.record or {}), "status": status, "pid": os.getpid(), "host": socket.gethostname(),
                       "process_start": process_start(os.getpid())}
        if ended:
            self.record["ended"] = time.strftime("%Y-%m-%d %H:%M:%S")
        self._save_record()

    def _save_record(self) -> None:
        """The run record, written with the files the run has written so far (what ``--overwrite`` may
        replace: ``unaccounted``)."""
        self.record["files"] = _files_under(self.real)
        write_text_atomic(self.real / RECORD_FILE, json.dumps(self.record, indent=2) + "\n")

    def _let_go(self, lock: Lock | None, created: bool, wrote_record: bool = False) -> None:
        """Nothing was written: take back the record this run wrote, release the lock, and remove the folder
        when this run created it and it is empty (never what another run put there meanwhile)."""
        if wrote_record:
            (self.real / RECORD_FILE).unlink(missing_ok=True)
        if lock is not None:
            lock.release()
        if created:
            try:
                self.real.rmdir()
            except OSError:
                pass

    def _replace(self, lock: Lock) -> None:
        """Swap the folder for an empty one holding only the lock, in one step; then delete the old one."""
        new = temporary_dir(f".{self.real.name}.{os.getpid()}.", self.real.parent)
        try:
            os.link(lock.path, new / LOCK_FILE)  # the same lock, held all along
            linked = True
        except OSError:  # a file system without hard links: the lock is taken again in the new folder
            linked = False
        if not _exchange(new, self.real):
            old = new.with_name(new.name + ".old")
            os.rename(self.real, old)
            os.rename(new, self.real)
            new = old
        if not linked:
            lock.release()
            lock.acquire()
        shutil.rmtree(new, ignore_errors=True)

    @property
    def finished(self) -> bool:
        """``--resume`` found the run already finished: nothing to do (every torchrun process sees it)."""
        if not self.resume:
            return False
        record = self.record if self.writer else read_record(self.real)
        return (self.state == "resume" or not self.writer) and (record or {}).get("status") == "finished"

    def finished_summary(self, key: str):
        """What a finished run recorded under ``key`` (``record``'s "summary"), for a resume that finds
        nothing to do."""
        return ((self.record or {}).get("summary") or {}).get(key)

    def note(self, **values) -> None:
        """Keep ``values`` in the run record (a summary the run reached), written now."""
        if not self.writer or self.record is None:
            return
        self.record.setdefault("summary", {}).update(json.loads(json.dumps(values, default=str)))
        self._save_record()

    def will_write(self, *names: str) -> None:
        """Declare, before writing them, the files (or folders) the run is about to write in its folder: a
        process killed while writing one leaves a file its record accounts for, which ``--overwrite`` may
        then replace (otherwise a half-written file would look like a user's)."""
        if self.writer and self.record is not None:
            self.record["declared"] = sorted({*(self.record.get("declared") or []), *names})
            self._save_record()

    def account(self) -> None:
        """Write the record again with the files the run has written so far (after a checkpoint): a run killed
        later can still be replaced by ``--overwrite``, every file accounted for."""
        if self.writer and self.record is not None:
            self._save_record()


def _differences(saved: dict, now: dict) -> list[str]:
    return [f"{k}={saved.get(k)!r} then, {now.get(k)!r} now" for k in sorted(set(saved) | set(now))
            if saved.get(k) != now.get(k)]
