"""One writer per output folder (``outputs``' rule 3): the lock file a run holds while it writes, and whether the
process a lock or a run record names still runs.

``Lock(folder, command, shown).acquire()`` takes ``.minibert.lock`` in the folder: an advisory ``flock`` (released
by the kernel when the process ends, however it ends) plus the pid, host, process start time and command, so that
a second writer is refused in one line naming the first (``held_message``). A lock left by a killed process on
this host is stale (its ``flock`` is gone, or the pid it names is not running, or is another process now: the
start time tells); a lock from another host is refused, naming the host and pid, since only that host can tell.
``held_by(folder)`` looks without taking anything.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

from .errors import InputError

LOCK_FILE = ".minibert.lock"


def process_start(pid: int) -> str | None:
    """When a process started (field 22 of /proc/PID/stat, in clock ticks since boot): with the pid it names
    one process, even after the pid is reused. None where /proc is not there."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text.rsplit(")", 1)[1].split()[19]


def alive(host, pid, start) -> bool:
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
    return start is None or process_start(pid) in (None, start)


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
                if alive(info.get("host"), info.get("pid"), info.get("process_start")):
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
            record = {"pid": os.getpid(), "host": socket.gethostname(), "process_start": process_start(os.getpid()),
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
            if info and info.get("host") != socket.gethostname() and alive(info.get("host"), info.get("pid"), None):
                return info
            return None
        if taken is False:
            return info or {}
        return info if info and alive(info.get("host"), info.get("pid"), info.get("process_start")) else None
    finally:
        os.close(fd)


def _read_lock(fd: int) -> dict:
    try:
        data = os.pread(fd, 4096, 0)
        info = json.loads(data.decode("utf-8")) if data.strip() else {}
    except (OSError, ValueError, UnicodeDecodeError):
        return {}
    return info if isinstance(info, dict) else {}
