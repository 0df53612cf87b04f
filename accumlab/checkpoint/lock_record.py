"""What a checkpoint directory's lock file holds: the record of the run that holds it.

A record is one JSON object of about 100 bytes: ``pid``, ``host``, ``started`` (UTC, ISO
8601) and ``process_start`` (the process's start in clock ticks since boot, Linux; None
elsewhere), which tells the process that wrote it from a later one that got its pid.
This module reads a lock file's bytes as a record or says what is wrong with them
(:class:`Unreadable`: too long, NUL bytes, not UTF-8, not JSON, no object), judges a
record (:func:`corrupt`: a pid that is no process id, a host that is no name;
:func:`alive`: whether its process still runs on this host) and describes it in a
message. :mod:`accumlab.checkpoint.lock` holds the lock itself: who may take it and when.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

_MAX_RECORD_BYTES = 4096  # a record is about 100 bytes; more is read as no record

#: The largest process id any system gives (``pid_t`` is a C int): a record naming a
#: larger one is corrupt (``os.kill`` would raise ``OverflowError`` on it).
_MAX_PID = 2**31 - 1


def process_start(pid: int) -> str | None:
    """The start time of process ``pid`` in clock ticks since boot (Linux), to tell the
    process that wrote a record from another one that got its pid later; ``None``
    where it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


@dataclass(frozen=True)
class Unreadable:
    """A lock file whose bytes are no lock record; ``why`` says what is wrong with them."""

    why: str


#: A lock file's content: its record, :class:`Unreadable`, or ``None`` while it is empty.
Content = dict[str, Any] | Unreadable | None


def _preview(data: bytes) -> str:
    return repr(data[:24]) + (f"... ({len(data)} bytes)" if len(data) > 24 else "")


def parse_record(data: bytes) -> Content:
    """A lock file's bytes as its record (see :data:`Content`)."""
    if not data:
        return None
    if len(data) > _MAX_RECORD_BYTES:
        return Unreadable(f"it holds over {_MAX_RECORD_BYTES} bytes, a record about 100; it "
                          f"begins {_preview(data)}")
    if b"\0" in data:
        first = data.index(b"\0")
        return Unreadable(f"it holds NUL bytes, the first at offset {first} (as a crash can "
                          f"leave a file being written): {_preview(data)}")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        return Unreadable(f"its bytes are not UTF-8 text (byte {data[exc.start]:#04x} at offset "
                          f"{exc.start}): {_preview(data)}")
    try:
        record = json.loads(text)
    except ValueError as exc:
        where = f" ({exc.msg} at character {exc.pos})" if isinstance(exc, json.JSONDecodeError) else ""
        return Unreadable(f"it is not JSON{where}: {_preview(data)}")
    if not isinstance(record, dict):
        return Unreadable(f"it holds a JSON {type(record).__name__}, not an object naming a pid "
                          f"and a host: {_preview(data)}")
    return record


def corrupt(record: Content) -> str | None:
    """Why a lock file's content read back cannot be a run's record, or ``None`` when it
    can be (or is absent: a file still empty)."""
    if record is None:
        return None
    if isinstance(record, Unreadable):
        return record.why
    pid, host = record.get("pid"), record.get("host")
    if isinstance(pid, bool) or not isinstance(pid, int) or not 0 < pid <= _MAX_PID:
        return f"its pid {pid!r} is not a process id"
    if not isinstance(host, str):
        return f"its host {host!r} is not a host name"
    return None


def alive(record: dict[str, Any]) -> bool | None:
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
    start = process_start(pid)
    return start is None or record.get("process_start") in (None, start)


def describe(record: Content) -> str:
    if record is None:
        return "a process that has not written its name yet"
    why = corrupt(record)
    if why or not isinstance(record, dict):
        return f"a corrupt lock record ({why})"
    return (f"process {record.get('pid')} on host {record.get('host')!r}, started "
            f"{record.get('started')}")


def read_bytes(fd: int) -> bytes:
    os.lseek(fd, 0, os.SEEK_SET)
    data = b""
    while len(data) <= _MAX_RECORD_BYTES and (chunk := os.read(fd, 4096)):
        data += chunk
    return data


def read_record(fd: int) -> Content:
    return parse_record(read_bytes(fd))


def record_bytes(record: dict[str, Any]) -> bytes:
    return (json.dumps(record) + "\n").encode("utf-8")


def write_record(fd: int, record: dict[str, Any]) -> None:
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, os.SEEK_SET)
    data = record_bytes(record)
    while data:  # a write may take part of the bytes
        data = data[os.write(fd, data):]
    os.fsync(fd)


def my_record() -> dict[str, Any]:
    """The record of this process, as a run that takes the lock writes it."""
    return {"pid": os.getpid(), "host": socket.gethostname(),
            "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "process_start": process_start(os.getpid())}


__all__ = [
    "Content",
    "Unreadable",
    "alive",
    "corrupt",
    "describe",
    "my_record",
    "parse_record",
    "process_start",
    "read_bytes",
    "read_record",
    "record_bytes",
    "write_record",
]
