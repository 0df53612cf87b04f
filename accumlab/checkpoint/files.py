"""A checkpoint's files: names, the atomic write with its checksum, rotation, and reading
back the newest intact one that every rank has.

A checkpoint is one file per rank, ``checkpoint-<attempts>-rank<r>.pt`` in the checkpoint
directory, where ``<attempts>`` is the run's update attempts so far (8 digits). It is
written by :func:`accumlab.atomic_write.write_atomically` (a temporary file in the same
directory, flushed and fsynced, then renamed over its final name), so a kill, a full disk
or a file-size limit at any moment leaves the previous checkpoints intact; a leftover
temporary file is never read and is removed by the rank's next write. The newest
``keep`` (2) checkpoints of a rank are kept. ``torch.load(weights_only=True)`` reads it
back, and its SHA-256 checksum must match. Only the run that holds the directory's lock
(:mod:`accumlab.checkpoint.lock`) writes there.
"""

from __future__ import annotations

import hashlib
import os
import re
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from .. import distributed
from ..atomic_write import (
    NotWritableError,
    check_directory,
    fsync_directory,
    temp_pattern,
    write_atomically,
)
from ..validate import check_positive_int

FORMAT = 3  # bumped when the layout of a checkpoint changes
KEEP = 2  # checkpoints kept per rank
_NAME = re.compile(r"^checkpoint-(\d{8,})-rank(\d+)\.pt$")


class CorruptCheckpointError(ValueError):
    """A checkpoint file that cannot be trusted: empty, cut short, unreadable, not an
    accumlab checkpoint, or its content does not match the checksum stored with it."""


class CheckpointFormatError(ValueError):
    """An intact checkpoint of another :data:`FORMAT`, written by another version of
    accumlab: this one cannot resume from it."""


def checkpoint_path(directory: str | os.PathLike[str], update_attempts: int, rank: int = 0) -> Path:
    """Where rank ``rank``'s checkpoint after ``update_attempts`` attempts lives."""
    return Path(directory) / f"checkpoint-{update_attempts:08d}-rank{rank}.pt"


def list_checkpoints(directory: str | os.PathLike[str], rank: int = 0) -> list[int]:
    """The update-attempt counts of rank ``rank``'s complete checkpoints, newest first.

    Only files with a checkpoint's final name count: a write in progress or one killed
    midway is a temporary file and is ignored.
    """
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = []
    try:
        for entry in directory.iterdir():
            match = _NAME.match(entry.name)
            if match and int(match.group(2)) == rank and entry.is_file():
                found.append(int(match.group(1)))
    except OSError as exc:
        raise _failed(exc, f"list the checkpoints in {os.fspath(directory)}") from exc
    return sorted(found, reverse=True)


def _failed(error: OSError, what: str) -> OSError:
    """``error`` as an ``OSError`` whose message says what failed (``what``: the operation
    and the path, "delete ..."), and why."""
    return OSError(error.errno, f"cannot {what}: {error.strerror or error}")


def check_path_name(directory: str | os.PathLike[str]) -> None:
    """``ValueError`` naming ``checkpoint_dir`` and the path when the path holds a NUL
    byte, which no file system takes (``os`` would say "embedded null byte", naming
    neither)."""
    text = os.fspath(directory)
    nul = "\0" if isinstance(text, str) else b"\0"
    if nul in text:
        raise ValueError(
            f"checkpoint_dir {text!r} holds a NUL byte (at position {text.index(nul)}), which no "
            "file system takes in a path; give a directory without one"
        )


def check_writable(directory: str | os.PathLike[str]) -> list[Path]:
    """Create ``directory`` if needed and prove that it takes new files, so that a
    directory checkpoints cannot be written to is an ``OSError`` before training, not
    after the first window. Returns the directories it created, outermost first."""
    try:
        return check_directory(directory)
    except NotWritableError as exc:
        raise OSError(
            exc.errno, f"cannot write checkpoints to checkpoint_dir {os.fspath(directory)!r} "
            f"({exc.why}); give a directory you can write to"
        ) from exc


def _feed(digest: Any, value: Any) -> None:
    """Add ``value`` (tensors and plain data, nested) to ``digest`` in a form that does not
    depend on how it was stored: a tensor's dtype, shape and bytes; containers item by item."""
    if isinstance(value, torch.Tensor):
        local = value.to_local() if callable(getattr(value, "to_local", None)) else value
        flat = local.detach().to("cpu").contiguous().reshape(-1)  # a DTensor: this rank's shard
        digest.update(f"T{flat.dtype}{list(value.shape)}:".encode())
        digest.update(flat.view(torch.uint8).numpy().data)
    elif isinstance(value, Mapping):
        digest.update(f"d{len(value)}:".encode())
        for key, item in value.items():
            _feed(digest, key)
            _feed(digest, item)
    elif isinstance(value, (list, tuple)):  # a tuple may come back as either
        digest.update(f"l{len(value)}:".encode())
        for item in value:
            _feed(digest, item)
    else:
        text = repr(value)
        digest.update(f"{type(value).__name__}{len(text)}:{text}".encode())


def payload_checksum(state: Mapping[str, Any]) -> str:
    """The SHA-256 of a checkpoint's content (hex): every tensor's bytes and every value.
    A checkpoint stores it under ``"sha256"``; :func:`load_checkpoint` recomputes it."""
    digest = hashlib.sha256()
    _feed(digest, {k: v for k, v in state.items() if k != "sha256"})
    return digest.hexdigest()


def save_checkpoint(
    state: dict[str, Any],
    directory: str | os.PathLike[str],
    update_attempts: int,
    *,
    rank: int = 0,
    keep: int = KEEP,
) -> Path:
    """Write ``state`` with its checksum (``"sha256"``) atomically as rank ``rank``'s
    checkpoint after ``update_attempts`` attempts; then delete the rank's checkpoints
    beyond the newest ``keep`` and its leftover temporary files. Returns the path.

    A reader sees the old checkpoints or the whole new one, never part of one. A write
    that fails (a full disk, a file-size limit) is an ``OSError`` naming the file and the
    cause; the checkpoints before it are left as they were.
    """
    check_positive_int("keep", keep)
    directory = Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise _failed(exc, f"create the checkpoint directory {directory}") from exc
    final = checkpoint_path(directory, update_attempts, rank)
    try:
        write_atomically(final, lambda f: torch.save({**state, "sha256": payload_checksum(state)}, f))
    except OSError as exc:
        raise OSError(exc.errno, f"{exc.strerror}; the checkpoints written before it are "
                      "intact") from exc
    old = [checkpoint_path(directory, n, rank) for n in list_checkpoints(directory, rank)[keep:]]
    for path in old + list(directory.glob(temp_pattern(f"checkpoint-*-rank{rank}.pt"))):
        try:  # the checkpoints beyond keep, and temporary files of writes that were killed
            path.unlink(missing_ok=True)
        except OSError as exc:
            raise _failed(exc, f"delete {path} (a checkpoint older than the newest {keep}, or "
                               f"a write's leftover), after writing {final.name}") from exc
    fsync_directory(directory)
    return final


def load_checkpoint(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a checkpoint with ``torch.load(weights_only=True)`` onto the CPU (the
    ``load_state_dict`` methods then copy each tensor to where its parameter lives) and
    verify its checksum. :class:`CheckpointFormatError` for a checkpoint of another
    format; :class:`CorruptCheckpointError` naming the file and why when it is empty, cut
    short, unreadable, not plain data, not a checkpoint or fails the checksum (e.g. a
    flipped bit inside a stored weight); an ``OSError`` naming it when it cannot be opened
    (no permission, a directory at its name)."""
    name = os.fspath(path)

    def corrupt(why: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"checkpoint {name} is not intact: {why}")

    try:  # a file that cannot be opened is no damage: an OSError naming it and the cause
        with open(path, "rb") as file:
            empty = os.fstat(file.fileno()).st_size == 0
    except OSError as exc:
        raise _failed(exc, f"read checkpoint {name}") from exc
    if empty:
        raise corrupt("the file is empty (0 bytes)")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # a cut or damaged file fails in many ways inside torch.load
        first = (str(exc).strip().splitlines() or [""])[0].split(". ")[0][:160]
        raise corrupt(f"it is cut short or damaged ({type(exc).__name__}: {first})") from exc
    found = state.get("format") if isinstance(state, dict) else type(state).__name__
    if isinstance(found, int) and found != FORMAT:
        raise CheckpointFormatError(
            f"cannot resume from {name}: it is a checkpoint of format {found} (another version "
            f"of accumlab), this version reads format {FORMAT}; start the run in a new checkpoint_dir"
        )
    if found != FORMAT:
        raise corrupt(f"it is not an accumlab checkpoint of format {FORMAT} (found {found!r})")
    stored = state.pop("sha256", None)
    if stored != payload_checksum(state):
        raise corrupt(
            "its content does not match the checksum written with it (a flipped bit, a "
            "partial copy or an edited file)"
        )
    return state


def _rank_and_world() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def common_checkpoints(directory: str | os.PathLike[str]) -> list[int]:
    """The update-attempt counts of the checkpoints every rank has, newest first (empty
    when no rank has any; collective under a process group: every rank must call it).

    Ranks write their files one after another, so a kill can leave one rank a checkpoint
    ahead; keeping two per rank means the ranks still share one. Raises ``ValueError`` on
    every rank when some rank has checkpoints but none is shared (e.g. the directory was
    written by a run with another world size).
    """
    rank, world = _rank_and_world()
    mine = list_checkpoints(directory, rank)
    if world == 1:
        return mine
    width = max(row[0] for row in distributed.gather_counts([len(mine)]))
    if width == 0:
        return []
    rows = distributed.gather_counts(mine + [-1] * (width - len(mine)))
    shared = set.intersection(*({v for v in row if v >= 0} for row in rows))
    if shared:
        return sorted(shared, reverse=True)
    have = [r for r, row in enumerate(rows) if any(v >= 0 for v in row)]
    raise ValueError(
        f"{os.fspath(directory)}: ranks {have} have checkpoints but no checkpoint is shared by "
        f"all {world} ranks; was it written by a run with another world size? Use a new "
        "checkpoint_dir, or resume with the world size that wrote it"
    )


def newest_common(directory: str | os.PathLike[str]) -> int | None:
    """The update-attempt count of the newest checkpoint every rank has, ``None`` when no
    rank has any (collective; see :func:`common_checkpoints`)."""
    shared = common_checkpoints(directory)
    return shared[0] if shared else None


def load_newest_intact(directory: str | os.PathLike[str]) -> tuple[int, dict[str, Any]] | None:
    """``(update attempts, state)`` of the newest checkpoint every rank has and every
    rank can read intact (:func:`load_checkpoint`); ``None`` when there is none yet.

    A newer one that some rank cannot read (damaged, or an ``OSError`` reading it) is
    skipped with a warning naming the file, why, and the checkpoint resumed from instead; all ranks move to the previous one together (one small all-reduce per
    checkpoint tried), so they load the same update. If every shared checkpoint is
    damaged: :class:`CorruptCheckpointError` naming the files, on every rank.
    """
    rank, _ = _rank_and_world()
    skipped = []
    for attempts in common_checkpoints(directory):
        path = checkpoint_path(directory, attempts, rank)
        try:
            state, why = load_checkpoint(path), ""
        except (CorruptCheckpointError, OSError) as exc:  # OSError: the file cannot be read
            state, why = None, exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        bad = [r for r, row in enumerate(distributed.gather_counts([bool(why)])) if row[0]]
        if not bad:
            for reason in skipped:
                warnings.warn(f"{reason}; resuming from {path.name} instead", UserWarning, stacklevel=3)
            return attempts, state  # type: ignore[return-value]
        skipped.append(why or f"checkpoint {path} is intact, but rank(s) {bad} cannot read theirs")
    if skipped:
        raise CorruptCheckpointError(
            f"no intact checkpoint in {os.fspath(directory)}: " + "; ".join(skipped)
            + ". Move these files away to start the run afresh in this directory, or restore "
            "them from a copy"
        )
    return None


def _refuse_a_used_directory(directory: Path) -> None:
    """``ValueError`` (on every rank: collective) when a fresh run would write into a
    directory that holds checkpoints: its newer ones would later pass for this run's."""
    rank, world = _rank_and_world()
    mine = list_checkpoints(directory, rank)
    newest = max(row[0] for row in distributed.gather_counts([mine[0] if mine else -1]))
    if newest >= 0:
        raise ValueError(
            f"checkpoint_dir {os.fspath(directory)!r} already holds checkpoints (the newest after "
            f"{newest} update attempts); pass resume=True to continue that run, or give a new "
            "directory (or delete them) to start another"
        )


