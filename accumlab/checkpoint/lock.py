"""The directory lock: a run owns its checkpoint directory for its lifetime.

Two runs writing into one directory destroy each other (one's rotation deletes the
other's checkpoints, one's cleanup deletes the other's file mid-write), so a run takes
the lock before it writes anything there and holds it until it returns or raises. A
second run is refused at once with :class:`CheckpointDirectoryInUseError`, naming the
holder (process id, host, start time). The lock is the file ``.checkpoint-lock`` in the
directory, created with ``O_EXCL``, holding that record as JSON, and ``flock``-ed while
the run lives; the run deletes it when it ends, but only while the file at that name is
still the one it created (same device and inode, its own record): a lock file deleted by
hand while the run lived, and since taken by another run, is that run's. Before each
checkpoint write the run checks that the lock is still its own
(:func:`check_still_held`) and stops with :class:`CheckpointDirectoryInUseError` when it
is not: another run may be writing there.

A lock left behind (the run was killed) is recognised and taken over with a warning:
``flock`` is released by the kernel when a process dies, however it dies, and the record
names a process of this host that no longer runs (its pid is gone, or is another
process: the start time differs), or is no lock record at all (not JSON, or a pid that
is no process id: the warning names the file and why). A record of another host is never
taken over: no process here can tell whether that run still lives; the error says to
delete the file once it is sure.

File systems. On a local file system ``flock`` is exact. On NFS (Linux clients since
2.6.12) ``flock`` is carried by NFS byte-range locks, held by the server, so runs on two
machines exclude each other, provided the mount has locking (not ``nolock`` or
``local_lock=flock``/``all``, under which each machine sees only its own locks: then only
the record and ``O_EXCL`` protect the directory). Where ``flock`` is not supported at all
(Lustre without ``-o flock``, some FUSE file systems) the lock falls back to the record
alone: created with ``O_EXCL`` (atomic on NFSv3 and later), and a takeover of a dead
process's record is written, read back after a pause, and kept only if it is still this
run's. Under data parallelism rank 0 holds the lock for the run, and every rank raises
together when it cannot take it.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import threading
import time
import warnings
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

try:
    import fcntl
except ImportError:  # Windows: the record and O_EXCL only
    fcntl = None  # type: ignore[assignment]

LOCK_NAME = ".checkpoint-lock"
_SETTLE_S = 0.05  # pause before a fallback takeover reads its record back


class CheckpointDirectoryInUseError(RuntimeError):
    """Another run (a live process, or one whose state cannot be told) holds the
    checkpoint directory's lock, or the lock this run held is no longer its own; the
    message names the lock file, the holder where known, and what to do."""


#: The largest process id any system gives (``pid_t`` is a C int): a record naming a
#: larger one is corrupt (``os.kill`` would raise ``OverflowError`` on it).
_MAX_PID = 2**31 - 1


def _process_start(pid: int) -> str | None:
    """The start time of process ``pid`` in clock ticks since boot (Linux), to tell the
    process that wrote a record from another one that got its pid later; ``None``
    where it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _corrupt(record: dict[str, Any] | None) -> str | None:
    """Why a lock record read back cannot be a run's, or ``None`` when it can be (or is
    absent: a file still empty)."""
    if record is None:
        return None
    pid, host = record.get("pid"), record.get("host")
    if isinstance(pid, bool) or not isinstance(pid, int) or not 0 < pid <= _MAX_PID:
        return f"its pid {pid!r} is not a process id"
    if not isinstance(host, str):
        return f"its host {host!r} is not a host name"
    return None


def _alive(record: dict[str, Any]) -> bool | None:
    """Whether the process a valid record names runs: ``None`` when it is on another host."""
    if record.get("host") != socket.gethostname():
        return None
    pid = record["pid"]
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # it exists, under another user
    start = _process_start(pid)
    return start is None or record.get("process_start") in (None, start)


def _describe(record: dict[str, Any] | None) -> str:
    if not record:
        return "a process that has not written its name yet"
    if _corrupt(record):
        return f"a corrupt lock record ({_corrupt(record)})"
    return (f"process {record.get('pid')} on host {record.get('host')!r}, started "
            f"{record.get('started')}")


def _read(fd: int) -> dict[str, Any] | None:
    os.lseek(fd, 0, os.SEEK_SET)
    data = b""
    while chunk := os.read(fd, 4096):
        data += chunk
    try:
        record = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _write(fd: int, record: dict[str, Any]) -> None:
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, os.SEEK_SET)
    os.write(fd, (json.dumps(record) + "\n").encode("utf-8"))
    os.fsync(fd)


def _flock(fd: int) -> str:
    """``"held"``, ``"busy"`` (another open file holds it) or ``"unsupported"``."""
    if fcntl is None:
        return "unsupported"
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return "held"
    except BlockingIOError:
        return "busy"
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return "busy"
        return "unsupported"  # ENOLCK, ENOSYS, EOPNOTSUPP, EINVAL: no flock on this file system


# Locks this process holds, by directory, with the pid that took them (a child made by
# fork inherits the dict, not the locks): another train() call of this process (another
# thread) is refused with a message that says so.
_HELD: dict[str, int] = {}
_HELD_GUARD = threading.Lock()


def _same_file(path: Path, fd: int) -> bool:
    """Whether ``path`` names the file open as ``fd`` (same device and inode)."""
    try:
        named = os.stat(path)
    except FileNotFoundError:
        return False
    opened = os.fstat(fd)
    return (named.st_dev, named.st_ino) == (opened.st_dev, opened.st_ino)


class DirectoryLock:
    """The lock of one checkpoint directory, held by this run (see the module's text).

    ``with DirectoryLock(directory):`` or :meth:`acquire` / :meth:`release`. Taking it
    creates the directory. Raises :class:`CheckpointDirectoryInUseError` when a live run
    (another process, or another train() call of this one) holds it, or when the holder
    is on another host; warns when it takes over the lock of a process that is gone.
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        self.path = self.directory / LOCK_NAME
        self._key = os.path.realpath(self.directory)
        self._fd: int | None = None
        self.record: dict[str, Any] = {}

    def __enter__(self) -> DirectoryLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()

    def acquire(self) -> DirectoryLock:
        with _HELD_GUARD:
            if _HELD.get(self._key) == os.getpid():
                raise CheckpointDirectoryInUseError(
                    f"checkpoint directory {os.fspath(self.directory)} is in use by another "
                    "train() call of this process (in another thread, or one this call runs "
                    "inside); wait for it to return, or give this run another directory"
                )
            self.directory.mkdir(parents=True, exist_ok=True)
            self._take()
            _HELD[self._key] = os.getpid()
            return self

    def _take(self) -> None:
        me = {"pid": os.getpid(), "host": socket.gethostname(),
              "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "process_start": _process_start(os.getpid())}
        for _ in range(20):  # a holder that deletes the file as we open it: try again
            try:
                fd, created = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644), True
            except FileExistsError:
                try:
                    fd, created = os.open(self.path, os.O_RDWR), False
                except FileNotFoundError:
                    continue
            try:
                state = _flock(fd)
                if state == "busy":
                    raise self._in_use(self._holder(fd), flocked=True)
                if not _same_file(self.path, fd):  # released (deleted) between our open and our flock
                    os.close(fd)
                    continue
                if not created:
                    self._take_over(fd, state)
                _write(fd, me)
                if not created and state == "unsupported":
                    time.sleep(_SETTLE_S)  # another taker may have written after us
                    if _read(fd) != me:
                        raise self._in_use(_read(fd), flocked=False)
            except BaseException:
                os.close(fd)
                raise
            self._fd, self.record = fd, me
            return
        raise CheckpointDirectoryInUseError(
            f"could not take the lock {self.path}: other processes keep creating and deleting "
            "it; is another run starting in this directory?"
        )

    def _holder(self, fd: int) -> dict[str, Any] | None:
        """The holder's record; a holder that has just created the file writes it within
        moments."""
        for _ in range(20):
            record = _read(fd)
            if record:
                return record
            time.sleep(0.01)
        return None

    def _take_over(self, fd: int, state: str) -> None:
        """Take the lock file a run left behind, or raise when its holder may live (it
        runs, or it is on another host). A file that stays empty was left by a run killed
        between creating it and writing its name; a corrupt record by no run of accumlab."""
        record = self._holder(fd)  # an empty file: its creator may be writing its name now
        why = _corrupt(record)
        if record and not why and _alive(record) is not False:
            raise self._in_use(record, flocked=state == "held")
        left = (f"the lock file {self.path}, whose record is corrupt ({why}) and which no "
                "process holds" if why else
                f"the lock left by {_describe(record)}, which no longer runs (killed?)")
        warnings.warn(
            f"checkpoint directory {os.fspath(self.directory)}: taking over {left}; this run "
            "owns the directory now",
            UserWarning,
            stacklevel=7,
        )

    def _in_use(self, record: dict[str, Any] | None, *, flocked: bool) -> CheckpointDirectoryInUseError:
        where = os.fspath(self.directory)
        valid = record is not None and not _corrupt(record)
        if valid and _alive(record) is None:  # type: ignore[arg-type]
            return CheckpointDirectoryInUseError(
                f"checkpoint directory {where} is in use by {_describe(record)} (lock file "
                f"{self.path}); a run on another host cannot be checked from here: wait for it "
                "to end, or, once you are sure it has ended, delete the lock file and run again"
            )
        gone = valid and flocked and _alive(record) is False  # type: ignore[arg-type]
        why = ("; that process is gone, but a process it started (a DataLoader worker?) still "
               "holds the lock: run again once they have exited") if gone else ""
        return CheckpointDirectoryInUseError(
            f"checkpoint directory {where} is in use by another run: {_describe(record)} (lock "
            f"file {self.path}){why}. Two runs in one directory would delete each other's "
            "checkpoints: wait for that run to end, or give this one another directory"
        )

    def held(self) -> bool:
        """Whether this process holds the lock: the file at its name is still the one it
        took, holding its record (not deleted, replaced or overwritten since; a child made
        by fork holds nothing)."""
        if self._fd is None or self.record.get("pid") != os.getpid():
            return False
        return _same_file(self.path, self._fd) and _read(self._fd) == self.record

    def release(self) -> None:
        """Let the directory go: delete the lock file if it is still this run's
        (:meth:`held`; a file another run created at that name since is left alone)."""
        with _HELD_GUARD:
            if self._fd is None:
                return
            if _HELD.get(self._key) == os.getpid():
                del _HELD[self._key]
            try:
                if self.held():
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(self.path)  # while flocked: a later opener makes a new file
            finally:
                fd, self._fd = self._fd, None
                os.close(fd)


def _together(mine: Exception | None, others: str) -> None:
    """Raise ``mine`` (rank 0's error, ``None`` when it has none) on rank 0 and
    :class:`CheckpointDirectoryInUseError` saying ``others`` on every other rank, or
    nothing anywhere (one small all-reduce under a process group)."""
    from ..distributed import gather_counts
    from .files import _rank_and_world

    if _rank_and_world()[1] > 1 and gather_counts([mine is not None])[0][0] and mine is None:
        raise CheckpointDirectoryInUseError(others)
    if mine is not None:
        raise mine


def lock_run_directory(directory: str | os.PathLike[str]) -> DirectoryLock | None:
    """Take ``directory``'s lock for a run: rank 0 takes it, then every rank learns the
    outcome and all raise together when it was refused. Returns the lock on rank 0,
    ``None`` on the other ranks."""
    from .files import _rank_and_world

    lock, refused = None, None
    if _rank_and_world()[0] == 0:
        try:
            lock = DirectoryLock(directory).acquire()
        except (CheckpointDirectoryInUseError, OSError) as exc:  # OSError: cannot write there
            refused = exc
    _together(refused, f"rank 0 could not take the lock of checkpoint directory "
                       f"{os.fspath(directory)} (its error says why: another run holds it, or "
                       "the directory cannot be written)")
    return lock


def check_still_held(lock: DirectoryLock | None, directory: str | os.PathLike[str]) -> None:
    """Before a checkpoint write: :class:`CheckpointDirectoryInUseError` on every rank when
    the lock rank 0 holds (``lock``; ``None`` on the other ranks) is no longer this run's,
    because its file was deleted or replaced while the run lived (another run may have
    taken the directory since); the message names the file."""
    lost = None
    if lock is not None and not lock.held():
        lost = CheckpointDirectoryInUseError(
            f"checkpoint directory {os.fspath(directory)} is no longer this run's: its lock file "
            f"{lock.path} was deleted or replaced while the run lived, so another run may be "
            "writing there; this run stopped before writing another checkpoint. Let one run "
            "at a time use the directory, then resume"
        )
    _together(lost, f"rank 0 found that the lock of checkpoint directory "
                    f"{os.fspath(directory)} is no longer this run's (its error says why)")
