"""Write a file so that a reader sees the old file or the whole new one, never a part.

The bytes go to a temporary file beside the target, ``.<name>.<random>.tmp`` (the same
directory: the rename stays on one file system), created as any new file is (mode 0o666
less the umask); it is flushed and fsynced, takes the target's name with ``os.replace``
(atomic on POSIX and Windows), and the directory is fsynced so that the rename survives
a crash. A file replaced keeps its permission bits. Anything at the target that is not a
regular file (a directory, a FIFO, a device, a symlink) is never replaced, and the
temporary file is removed on any failure, so a full disk leaves the old file as it was.

Standard library only: ``tools/learner_copies.py`` loads this file by its path with the
system's Python, where torch may not be installed.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

#: What every temporary file of :func:`write_atomically` ends with.
TEMP_SUFFIX = ".tmp"


class NotARegularFileError(OSError):
    """The target is (or has become) something :func:`write_atomically` never replaces."""


class NotWritableError(OSError):
    """A directory that cannot take new files (:func:`check_directory`); ``why`` is the
    cause in words, the message names the directory too."""

    def __init__(self, code: int | None, directory: Path, why: str) -> None:
        super().__init__(code, f"cannot write to {directory}: {why}")
        self.why = why


def file_kind(mode: int) -> str:
    """What a ``stat`` mode is, in words: ``"a regular file"``, ``"a directory"``, ..."""
    kinds = [(stat.S_ISREG, "a regular file"), (stat.S_ISDIR, "a directory"),
             (stat.S_ISLNK, "a symlink"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
             (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
             (stat.S_ISSOCK, "a socket")]
    return next((kind for test, kind in kinds if test(mode)), "not a regular file")


def temp_pattern(name: str) -> str:
    """The glob of the temporary files of writes to the file ``name`` (itself a glob, such
    as ``"checkpoint-*.pt"``): a write killed midway leaves one."""
    return f".{name}.*{TEMP_SUFFIX}"


def _cannot_write(path: Path, error: OSError) -> OSError:
    """``error`` as one sentence that names ``path`` (not the temporary file) and the cause."""
    why = error.strerror or str(error)
    if error.errno == errno.EFBIG:
        why += " (over a file-size limit: the process's `ulimit -f`, or the file system's)"
    return OSError(error.errno, f"cannot write {path}: {why}")


class _Sink:
    """The temporary file as the writer sees it (``write``, ``flush``), remembering the
    first ``OSError`` a write raised: ``torch.save`` reports one as a position mismatch
    (``[enforce fail at inline_container.cc] ... unexpected pos``), not as the full disk."""

    def __init__(self, file: Any) -> None:
        self.file, self.error = file, None

    def write(self, data: bytes) -> int:
        try:
            view = memoryview(data)
            while view:  # an unbuffered write may take part of the bytes
                view = view[self.file.write(view):]
            return len(data)
        except OSError as exc:
            self.error = self.error or exc
            raise

    def flush(self) -> None:
        pass  # each write went to the file already


def fsync_directory(directory: str | os.PathLike[str]) -> None:
    """Make a rename or an unlink in ``directory`` durable (a no-op where unsupported)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _new_temp(path: Path) -> tuple[int, Path]:
    while True:
        temp = path.with_name(f".{path.name}.{secrets.token_hex(4)}{TEMP_SUFFIX}")
        try:
            return os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), temp
        except FileExistsError:
            continue


def make_directories(directory: str | os.PathLike[str]) -> list[Path]:
    """Create ``directory`` and its missing parents (as ``mkdir -p``); returns the ones
    this call created, outermost first, for :func:`remove_empty_directories` to undo.
    A directory another process creates meanwhile is not counted as created; on a
    failure the ones created are removed again."""
    directory = Path(directory)
    missing, path = [], Path(os.path.abspath(directory))
    while not os.path.lexists(path) and path != path.parent:
        missing.append(path)
        path = path.parent
    created: list[Path] = []
    try:
        for path in reversed(missing):
            try:
                path.mkdir()
            except FileExistsError:
                if not path.is_dir():
                    raise
                continue
            created.append(path)
        directory.mkdir(parents=True, exist_ok=True)  # what stood there already: its own error
    except BaseException:
        remove_empty_directories(created)
        raise
    return created


def remove_empty_directories(directories: list[Path]) -> None:
    """Remove ``directories`` (as :func:`make_directories` returns them), innermost first,
    while they are empty; what holds anything stays, and so do the ones above it."""
    for path in reversed(directories):
        try:
            path.rmdir()
        except OSError:
            return


def check_directory(directory: str | os.PathLike[str]) -> list[Path]:
    """Create ``directory`` (and its parents) if needed and prove that it takes new files
    (a temporary file created and removed); :class:`NotWritableError` naming it and why
    otherwise (nothing created is left then). Returns the directories it created,
    outermost first (:func:`make_directories`)."""
    directory = Path(directory)
    created: list[Path] = []
    try:
        created = make_directories(directory)
        fd, temp = _new_temp(directory / ".probe")
        os.close(fd)
        os.unlink(temp)
    except OSError as exc:
        remove_empty_directories(created)
        why = exc.strerror or str(exc)
        if os.path.islink(directory) and not os.path.exists(directory):
            why = f"it is a symlink to {os.readlink(directory)}, which does not exist"
        raise NotWritableError(exc.errno, directory, why) from exc
    return created


def write_atomically(
    path: str | os.PathLike[str],
    write: Callable[[Any], object] | bytes,
    *,
    overwrite: bool = True,
) -> Path:
    """Write ``write`` (bytes, or a function given a binary file to write to) to ``path``
    atomically, as the module says; returns ``path``.

    ``path`` must be absent or a regular file when the write ends, else
    :class:`NotARegularFileError` (a symlink too: resolve it first to write through it).
    With ``overwrite=False`` a file at ``path`` is a ``FileExistsError`` and is left
    alone. A failure to write (a full disk, a file-size limit, no permission) is an
    ``OSError`` with its ``errno`` whose message names ``path`` and the cause.
    """
    path = Path(path)
    try:
        fd, temp = _new_temp(path)
    except OSError as exc:
        raise _cannot_write(path, exc) from exc
    try:
        with os.fdopen(fd, "wb", buffering=0) as file:  # unbuffered: closing it writes nothing
            sink = _Sink(file)
            try:
                sink.write(write) if isinstance(write, bytes) else write(sink)
                os.fsync(file.fileno())
            except BaseException as exc:
                error = sink.error or (exc if isinstance(exc, OSError) else None)
                if error is None:
                    raise
                raise _cannot_write(path, error) from exc
        try:
            old = os.lstat(path).st_mode
        except FileNotFoundError:
            old = None
        if old is not None and not stat.S_ISREG(old):
            raise NotARegularFileError(
                errno.EEXIST, f"{path} is {file_kind(old)}, not a regular file; it was left alone")
        if old is not None and not overwrite:
            raise FileExistsError(errno.EEXIST, f"{path} exists; it was left alone")
        if old is not None:
            os.chmod(temp, stat.S_IMODE(old))
        try:
            os.replace(temp, path)
        except OSError as exc:
            raise _cannot_write(path, exc) from exc
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise
    fsync_directory(path.parent)
    return path
