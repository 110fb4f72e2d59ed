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
3. **One writer per folder.** ``claim()`` holds a lock file (``.minibert.lock``: an advisory ``flock``
   plus the pid, host and command) for the run; a second run into the same folder is refused in one line.
   A lock left by a killed process is seen as stale -- on this host the kernel released its ``flock``;
   a lock from another host is refused, naming the host and pid, since only that host can tell.
4. **A record of the run.** ``.minibert-run.json`` says which command wrote the folder, with which
   settings, and whether it finished, stopped (and why) or was interrupted. ``--resume`` reads it: a
   finished run has nothing to resume, a run of another command or with other settings is refused naming
   the setting. A run that fails before it wrote anything leaves nothing behind (a folder it created is
   removed).

A ``KeyboardInterrupt`` (Ctrl-C) inside ``claim()`` comes out with the place the run can resume from as
its message (the command line prints it).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Mapping

from .errors import InputError
from .textfiles import _exchange, output_dir, write_text_atomic

LOCK_FILE = ".minibert.lock"
RECORD_FILE = ".minibert-run.json"
#: what a folder holds, recognised by the files minibert and BERT checkpoints write (first match wins)
KNOWN_CONTENTS = (
    ("study.json", "a depth study"),
    ("adapter.json", "a task module"),
    ("pretrain.json", "a pre-training run"),
    ("checkpoints", "a pre-training run"),
    ("exits.json", "a classifier with early exits"),
    ("metrics.json", "a fine-tuned model"),
    ("modules.json", "a sentence-transformers model"),
    ("config.json", "a model"),
    ("model.safetensors", "a model"),
    ("log.jsonl", "a training run"),
)


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


def check_not_reading(out, reads: Mapping[str, object], what: str = "--out") -> None:
    """Refuse an output path that is, contains or sits inside a model folder the command reads. ``reads``:
    {option name: model source} (hub ids and None are skipped)."""
    target = Path(out).expanduser().resolve()
    for option, source in reads.items():
        folder = model_folder(source)
        if folder is None:
            continue
        if target == folder:
            how = "is"
        elif target.is_relative_to(folder):
            how = "sits inside"
        elif folder.is_relative_to(target):
            how = "contains"
        else:
            continue
        raise InputError(f"{what} {str(out)!r} {how} the model folder {option} reads ({folder}): a run written there "
                         f"would {'replace or mix with' if how != 'contains' else 'bury'} that model's files; give "
                         f"{what} a folder of its own")


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


def describe(folder) -> tuple[str, bool]:
    """(what the folder holds, in words; whether it is something minibert or a checkpoint wrote)."""
    folder = Path(folder)
    names = contents(folder)
    record = read_record(folder)
    if record is not None:
        status = record.get("status", "unknown")
        if status == "running" and not _alive(record.get("host"), record.get("pid"), record.get("process_start")):
            status = "unfinished: its process is gone (killed?)"
        return f"a `minibert {record['command']}` run ({status})", True
    for name, kind in KNOWN_CONTENTS:
        if name in names:
            shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
            return f"{kind} ({shown})", True
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    return f"{len(names)} file(s) minibert did not write ({shown})", False


# ----------------------------------------------------------------------------------------- the lock
def _process_start(pid: int) -> str | None:
    """When a process started (field 22 of /proc/PID/stat, in clock ticks since boot): with the pid it names
    one process, even after the pid is reused. None where /proc is not there."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text.rsplit(")", 1)[1].split()[19]


def _alive(host, pid, start) -> bool:
    """Whether the process a lock or record names still runs (on another host: assumed so)."""
    if host != socket.gethostname():
        return True
    if not isinstance(pid, int):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        pass  # it exists, but is not ours to signal
    return start is None or _process_start(pid) in (None, start)


def _flock(fd: int) -> bool | None:
    """Take an exclusive flock without waiting: True, False when another process holds it, None where the
    platform or file system has no flock."""
    try:
        import fcntl
    except ImportError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    except OSError:
        return None


class Lock:
    """The lock file of an output folder, held from ``acquire`` to ``release``."""

    def __init__(self, folder: Path, command: str, shown: str):
        self.folder, self.command, self.shown = folder, command, shown
        self.fd: int | None = None

    @property
    def path(self) -> Path:
        return self.folder / LOCK_FILE

    def acquire(self) -> "Lock":
        for _ in range(5):  # the lock file may be replaced between open and flock: then try again
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            taken = _flock(fd)
            info = _read_lock(fd)
            if taken is False:
                os.close(fd)
                raise InputError(held_message(self.shown, self.path, info))
            if info and info.get("pid") != os.getpid() and (taken is None or info.get("host") != socket.gethostname()):
                if _alive(info.get("host"), info.get("pid"), info.get("process_start")):
                    os.close(fd)
                    raise InputError(held_message(self.shown, self.path, info,
                                                  stale_hint=info.get("host") != socket.gethostname()))
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if not same:
                os.close(fd)
                continue
            self.fd = fd
            record = {"pid": os.getpid(), "host": socket.gethostname(), "process_start": _process_start(os.getpid()),
                      "command": self.command, "started": time.strftime("%Y-%m-%d %H:%M:%S")}
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
            return self
        raise InputError(f"{self.shown}: could not take its lock file {self.path} (it kept being replaced)")

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            if os.fstat(self.fd).st_ino == os.stat(self.path).st_ino:
                os.unlink(self.path)
        except OSError:
            pass
        os.close(self.fd)
        self.fd = None


def held_message(shown: str, lock_path: Path, info: dict, stale_hint: bool = False) -> str:
    """The one line that refuses a second writer: who holds the folder (``info``: what the lock file says)."""
    who = (f"`minibert {info.get('command', '?')}` (pid {info.get('pid', '?')} on {info.get('host', '?')}, "
           f"since {info.get('started', '?')})" if info else "another process")
    text = (f"{shown} is being written by {who}: one run writes a folder at a time; wait for it to end, or choose "
            "another folder")
    if stale_hint:
        text += f" (if that run is no longer running, delete {lock_path})"
    return text


def held_by(folder) -> dict | None:
    """Who holds the folder's lock now (what the lock file says), or None when no live process does. Takes
    nothing and creates nothing: a look before any work."""
    path = Path(folder) / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        info = _read_lock(fd)
        taken = _flock(fd)
        if taken is True:  # nobody holds it: a stale file, unless it names a live run on another host
            import fcntl

            fcntl.flock(fd, fcntl.LOCK_UN)
            if info and info.get("host") != socket.gethostname() and _alive(info.get("host"), info.get("pid"), None):
                return info
            return None
        if taken is False:
            return info or {}
        return info if info and _alive(info.get("host"), info.get("pid"), info.get("process_start")) else None
    finally:
        os.close(fd)


def _read_lock(fd: int) -> dict:
    try:
        data = os.pread(fd, 4096, 0)
        info = json.loads(data.decode("utf-8")) if data.strip() else {}
    except (OSError, ValueError, UnicodeDecodeError):
        return {}
    return info if isinstance(info, dict) else {}


# ------------------------------------------------------------------------------------ the run folder
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
        check_not_reading(self.path, reads or {}, what)
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
            raise InputError(f"--overwrite replaces a model or a run folder; {self.what} {self.shown!r} holds {held}: "
                             "empty it yourself, or choose another folder")

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
            if self.state in ("new", "overwrite") or self.record is None:
                self.record = {"command": self.command, "settings": settings, "status": "running",
                               "started": time.strftime("%Y-%m-%d %H:%M:%S")}
            elif self.record.get("status") != "finished":  # resumed or continued: the same run goes on
                self.record["resumed"] = time.strftime("%Y-%m-%d %H:%M:%S")
            finished_before = self.record.get("status") == "finished"
            self._write_record(status=self.record.get("status") if finished_before else "running")
        except BaseException:
            self._let_go(lock, created, wrote_record=not had_record)
            raise
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

    def _hint(self) -> str | None:
        try:
            return self.resume_hint() if self.resume_hint is not None else None
        except Exception:  # a hint must never hide the interruption
            return None

    def _write_record(self, status: str, ended: bool = False) -> None:
        self.record = {**(self.record or {}), "status": status, "pid": os.getpid(), "host": socket.gethostname(),
                       "process_start": _process_start(os.getpid())}
        if ended:
            self.record["ended"] = time.strftime("%Y-%m-%d %H:%M:%S")
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
        new = Path(tempfile.mkdtemp(prefix=f".{self.real.name}.{os.getpid()}.", suffix=".tmp", dir=self.real.parent))
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
        write_text_atomic(self.real / RECORD_FILE, json.dumps(self.record, indent=2) + "\n")


def _differences(saved: dict, now: dict) -> list[str]:
    return [f"{k}={saved.get(k)!r} then, {now.get(k)!r} now" for k in sorted(set(saved) | set(now))
            if saved.get(k) != now.get(k)]
