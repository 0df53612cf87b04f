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
process: the start time differs), or is no lock record at all (bytes that are not UTF-8,
NUL bytes, text that is not JSON, JSON that is not an object, a pid that is no process
id: the warning names the file and what is wrong with it). A record of another host is
never taken over: no process here can tell whether that run still lives; the error says
to delete the file once it is sure. A lock path that is not a regular file (a symlink,
even to a regular file, a directory, a FIFO) is never opened through, written or
deleted: a run makes its lock itself, so such a thing was put there by something else,
and writing through a symlink would overwrite the file it points to; the ``OSError``
names it and says to remove it.

Failures. Every filesystem error is an ``OSError`` naming the lock file and the operation
(``cannot write the lock file ...: No space left on device``), and a run that cannot take
the lock leaves nothing behind: the lock file it created and the directories it created
for it are removed. The directories a run created are removed again when it lets the
lock go, if they are empty then (a run that failed before its first checkpoint).

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
import os
import stat
import threading
import time
import warnings
from pathlib import Path
from typing import Any

from ..atomic_write import file_kind, make_directories, remove_empty_directories
from .lock_record import (
    Content,
    alive,
    corrupt,
    describe,
    my_record,
    read_bytes,
    read_record,
    record_bytes,
    write_record,
)

try:
    import fcntl
except ImportError:  # Windows: the record and O_EXCL only
    fcntl = None  # type: ignore[assignment]

LOCK_NAME = ".checkpoint-lock"
_SETTLE_S = 0.05  # pause before a fallback takeover reads its record back
#: How the lock file is opened: never through a symlink (``O_NOFOLLOW``: the open fails
#: instead), and without blocking on a FIFO put at its name.
_OPEN = os.O_RDWR | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)


class _Named(OSError):
    """An ``OSError`` whose message names the lock file and the operation already."""


class CheckpointDirectoryInUseError(RuntimeError):
    """Another run (a live process, or one whose state cannot be told) holds the
    checkpoint directory's lock, or the lock this run held is no longer its own; the
    message names the lock file, the holder where known, and what to do."""


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
    """Whether ``path`` itself (not a symlink's target) names the file open as ``fd``
    (same device and inode)."""
    try:
        named = os.lstat(path)
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
        self._created: list[Path] = []  # directories this lock created, outermost first
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
            self._created = make_directories(self.directory)
            try:
                self._take()
            except BaseException:
                remove_empty_directories(self._created)
                raise
            _HELD[self._key] = os.getpid()
            return self

    def _take(self) -> None:
        me = my_record()
        for _ in range(20):  # a holder that deletes the file as we open it: try again
            try:
                fd, created = os.open(self.path, _OPEN | os.O_CREAT | os.O_EXCL, 0o644), True
            except FileExistsError:
                try:
                    fd, created = os.open(self.path, _OPEN), False
                except FileNotFoundError:
                    continue
                except OSError as exc:
                    raise self._unusable(exc, "open") from exc
            except FileNotFoundError:  # an ending run removed the empty directory it made
                self._created += make_directories(self.directory)
                continue
            except OSError as exc:
                raise self._unusable(exc, "create") from exc
            state, step = None, "check"
            try:
                kind = os.fstat(fd).st_mode
                if not stat.S_ISREG(kind):  # a FIFO or a device put at its name
                    raise self._not_a_lock(kind)
                state = _flock(fd)
                if state == "busy":
                    step = "read"
                    raise self._in_use(self._holder(fd), flocked=True)
                if not _same_file(self.path, fd):  # released (deleted) between our open and our flock
                    os.close(fd)
                    continue
                if not created:
                    step = "read"
                    self._take_over(fd, state)
                step = "write"
                write_record(fd, me)
                if not created and state == "unsupported":
                    time.sleep(_SETTLE_S)  # another taker may have written after us
                    step = "read"
                    if read_record(fd) != me:
                        raise self._in_use(read_record(fd), flocked=False)
            except BaseException as exc:
                self._discard(fd, created=created, state=state, mine=record_bytes(me))
                if isinstance(exc, OSError) and not isinstance(exc, _Named):
                    raise _Named(exc.errno, f"cannot {step} the lock file {self.path}: "
                                            f"{exc.strerror or exc}") from exc
                raise
            self._fd, self.record = fd, me
            return
        raise CheckpointDirectoryInUseError(
            f"could not take the lock {self.path}: other processes keep creating and deleting "
            "it; is another run starting in this directory?"
        )

    def _discard(self, fd: int, *, created: bool, state: str | None, mine: bytes) -> None:
        """Close ``fd`` after a failure to take the lock, first deleting the file when this
        run created it and no other run has taken it since: under ``flock`` one that got
        the flock (``state`` "held"), else one that holds nothing or (part of) ``mine``."""
        try:
            if created and state != "busy" and _same_file(self.path, fd):
                if state == "held" or mine.startswith(read_bytes(fd)):
                    os.unlink(self.path)
        except OSError:
            pass  # left as it is: the next run takes over an empty or dead lock with a warning
        finally:
            os.close(fd)

    def _not_a_lock(self, mode: int) -> _Named:
        """The error for a lock path that is not a regular file (``mode``: its ``lstat``)."""
        kind = file_kind(mode)
        if stat.S_ISLNK(mode):
            with contextlib.suppress(OSError):
                kind += f" to {os.readlink(self.path)}"
        return _Named(
            errno.EEXIST,
            f"the lock file {self.path} is {kind}, not a lock a run made (a run creates its "
            "lock itself, as a regular file, and never writes through a symlink: that would "
            "overwrite the file it points to); remove it once no run uses checkpoint directory "
            f"{os.fspath(self.directory)}, and run again",
        )

    def _unusable(self, error: OSError, step: str) -> OSError:
        """``error``, raised opening the lock file, as one that names it: what it is when
        it is no regular file (a symlink makes ``O_NOFOLLOW`` fail), else the operation."""
        with contextlib.suppress(OSError):
            mode = os.lstat(self.path).st_mode
            if not stat.S_ISREG(mode):
                return self._not_a_lock(mode)
        return _Named(error.errno, f"cannot {step} the lock file {self.path}: "
                                   f"{error.strerror or error}")

    def _holder(self, fd: int) -> Content:
        """The holder's record; a holder that has just created the file writes it within
        moments (what is there then, when it never becomes a record)."""
        for _ in range(20):
            record = read_record(fd)
            if isinstance(record, dict):
                return record
            time.sleep(0.01)
        return record

    def _take_over(self, fd: int, state: str) -> None:
        """Take the lock file a run left behind, or raise when its holder may live (it
        runs, or it is on another host). A file that stays empty was left by a run killed
        between creating it and writing its name; a corrupt record by no run of accumlab."""
        record = self._holder(fd)  # an empty file: its creator may be writing its name now
        why = corrupt(record)
        if isinstance(record, dict) and not why and alive(record) is not False:
            raise self._in_use(record, flocked=state == "held")
        left = (f"the lock file {self.path}, whose record is corrupt ({why}) and which no "
                "process holds" if why else
                f"the lock left by {describe(record)}, which no longer runs (killed?)")
        warnings.warn(
            f"checkpoint directory {os.fspath(self.directory)}: taking over {left}; this run "
            "owns the directory now",
            UserWarning,
            stacklevel=7,
        )

    def _in_use(self, record: Content, *, flocked: bool) -> CheckpointDirectoryInUseError:
        where = os.fspath(self.directory)
        valid = isinstance(record, dict) and not corrupt(record)
        if valid and alive(record) is None:  # type: ignore[arg-type]
            return CheckpointDirectoryInUseError(
                f"checkpoint directory {where} is in use by {describe(record)} (lock file "
                f"{self.path}); a run on another host cannot be checked from here: wait for it "
                "to end, or, once you are sure it has ended, delete the lock file and run again"
            )
        gone = valid and flocked and alive(record) is False  # type: ignore[arg-type]
        why = ("; that process is gone, but a process it started (a DataLoader worker?) still "
               "holds the lock: run again once they have exited") if gone else ""
        return CheckpointDirectoryInUseError(
            f"checkpoint directory {where} is in use by another run: {describe(record)} (lock "
            f"file {self.path}){why}. Two runs in one directory would delete each other's "
            "checkpoints: wait for that run to end, or give this one another directory"
        )

    def held(self) -> bool:
        """Whether this process holds the lock: the file at its name is still the one it
        took, holding its record (not deleted, replaced or overwritten since; a child made
        by fork holds nothing)."""
        if self._fd is None or self.record.get("pid") != os.getpid():
            return False
        return _same_file(self.path, self._fd) and read_record(self._fd) == self.record

    def lost(self) -> str:
        """How the lock file stopped being this run's, in words (for an error message):
        deleted, replaced by another file, or overwritten (and with what)."""
        if self._fd is not None and _same_file(self.path, self._fd):
            return f"was overwritten while the run lived (it now names {describe(read_record(self._fd))})"
        if not os.path.lexists(self.path):
            return "was deleted while the run lived"
        if os.path.islink(self.path):
            return f"was replaced by a symlink to {os.readlink(self.path)} while the run lived"
        try:
            fd = os.open(self.path, _OPEN)
        except OSError:
            return "was replaced by something else while the run lived"
        try:
            now = describe(read_record(fd)) if stat.S_ISREG(os.fstat(fd).st_mode) else "no lock"
        except OSError:
            now = "a file that cannot be read"
        finally:
            os.close(fd)
        return f"was replaced by another while the run lived (which names {now})"

    def release(self) -> None:
        """Let the directory go: delete the lock file if it is still this run's
        (:meth:`held`; a file another run created at that name since is left alone), then
        the directories it created for the run, if they are empty. A lock file that
        cannot be deleted is a warning naming it (the next run takes it over), never an
        error that would hide how the run ended."""
        with _HELD_GUARD:
            if self._fd is None:
                return
            if _HELD.get(self._key) == os.getpid():
                del _HELD[self._key]
            try:
                if self.held():
                    try:
                        os.unlink(self.path)  # while flocked: a later opener makes a new file
                    except FileNotFoundError:
                        pass
                    except OSError as exc:
                        warnings.warn(
                            f"could not delete the lock file {self.path} ({exc.strerror or exc}); "
                            "the next run in this directory takes it over with a warning",
                            UserWarning, stacklevel=4,
                        )
                    else:
                        remove_empty_directories(self._created)
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
    because its file was deleted, replaced or overwritten while the run lived (another run
    may have taken the directory since); the message names the file and what happened."""
    lost = None
    if lock is not None and not lock.held():
        lost = CheckpointDirectoryInUseError(
            f"checkpoint directory {os.fspath(directory)} is no longer this run's: its lock file "
            f"{lock.path} {lock.lost()}, so another run may be writing there; this run stopped "
            "before writing another checkpoint. Let one run at a time use the directory, then "
            "resume"
        )
    _together(lost, f"rank 0 found that the lock of checkpoint directory "
                    f"{os.fspath(directory)} is no longer this run's (its error says why)")
