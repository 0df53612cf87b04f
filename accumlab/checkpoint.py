"""Checkpoints for ``train``: everything the next update depends on, and exact resume.

A checkpoint is one file per rank, ``checkpoint-<attempts>-rank<r>.pt`` in the checkpoint
directory, where ``<attempts>`` is the run's update attempts so far (8 digits). It holds
the model, optimizer, scheduler and GradScaler state, the ledger (as plain data), the OOM
shrink state (how many times every loader microbatch is cut in half), the RNG states
(torch CPU, every CUDA device when there is one, Python's ``random``) and the position in
the data: the windows and loader microbatches consumed, and the loader's own
``state_dict()`` when it has one. ``torch.load(weights_only=True)`` reads it, so it stores
tensors and plain data only.

Safety: a checkpoint is written to a temporary file in the same directory, flushed and
fsynced, then renamed over its final name (``os.replace``, atomic), so a kill at any
moment leaves the previous checkpoints intact; a leftover temporary file is never read
and is removed by the rank's next write. The newest ``keep`` (2) checkpoints of a rank are
kept. Resume loads the newest checkpoint that every rank has, and refuses one written for
another plan, model shape, world size or precision with a message naming what differs.

``train(..., checkpoint_dir=..., checkpoint_every=..., resume=...)`` drives it through
:class:`Checkpointer`; the one-window core (``train_window``, ``accumulate``) knows
nothing of checkpoints.
"""

from __future__ import annotations

import os
import random
import re
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from . import distributed
from .ledger import Ledger
from .plan import AccumulationPlan, check_positive_int

FORMAT = 1  # bumped when the layout of a checkpoint changes
KEEP = 2  # checkpoints kept per rank
_NAME = re.compile(r"^checkpoint-(\d{8,})-rank(\d+)\.pt$")
_TEMP_PREFIX = ".checkpoint-"


def check_arguments(checkpoint_dir: object, checkpoint_every: object, resume: object) -> None:
    """Check ``train``'s checkpoint keywords before any data is read.

    ``checkpoint_dir`` is ``None`` (no checkpoints) or a non-empty path that is not an
    existing file; ``checkpoint_every`` is ``None`` (write after the last update attempt
    only) or a positive int of update attempts and needs ``checkpoint_dir``; ``resume`` is
    a bool and ``True`` needs ``checkpoint_dir``.
    """
    if checkpoint_dir is not None:
        if not isinstance(checkpoint_dir, (str, os.PathLike)):
            raise TypeError(
                "checkpoint_dir must be a path (str or os.PathLike) or None, got "
                f"{type(checkpoint_dir).__name__}"
            )
        if not os.fspath(checkpoint_dir):
            raise ValueError("checkpoint_dir is an empty path; give a directory such as 'runs/x'")
        if Path(checkpoint_dir).exists() and not Path(checkpoint_dir).is_dir():
            raise ValueError(f"checkpoint_dir {os.fspath(checkpoint_dir)!r} is a file, not a directory")
    if checkpoint_every is not None:
        check_positive_int("checkpoint_every", checkpoint_every)
        if checkpoint_dir is None:
            raise ValueError("checkpoint_every needs checkpoint_dir: where should the checkpoints go?")
    if not isinstance(resume, bool):
        raise TypeError(f"resume must be True or False, got {resume!r}")
    if resume and checkpoint_dir is None:
        raise ValueError("resume=True needs checkpoint_dir, the directory of the run to continue")


# ---------------------------------------------------------------------------- RNG states


def rng_state() -> dict[str, Any]:
    """The generators a training step draws from: torch's CPU generator, every CUDA
    device's (``None`` without CUDA) and Python's ``random`` (tensors and plain data)."""
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        "python": random.getstate(),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` returned. CUDA states are restored for the devices
    present in both (all of them when the device count is unchanged)."""
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available():
        for device, device_state in enumerate(cuda[: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(device_state, device)
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))


# ---------------------------------------------------------------------------- files


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
    for entry in directory.iterdir():
        match = _NAME.match(entry.name)
        if match and int(match.group(2)) == rank and entry.is_file():
            found.append(int(match.group(1)))
    return sorted(found, reverse=True)


def _fsync_directory(directory: Path) -> None:
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


def save_checkpoint(
    state: dict[str, Any],
    directory: str | os.PathLike[str],
    update_attempts: int,
    *,
    rank: int = 0,
    keep: int = KEEP,
) -> Path:
    """Write ``state`` atomically as rank ``rank``'s checkpoint after ``update_attempts``
    attempts; then delete the rank's checkpoints beyond the newest ``keep`` and its
    leftover temporary files. Returns the checkpoint's path.

    The bytes go to a temporary file in the same directory (so the rename stays on one
    file system), which is flushed and fsynced before ``os.replace`` gives it its final
    name: a reader sees the old checkpoint or the whole new one, never part of one.
    """
    check_positive_int("keep", keep)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    final = checkpoint_path(directory, update_attempts, rank)
    fd, temp = tempfile.mkstemp(dir=directory, prefix=f"{_TEMP_PREFIX}{final.stem}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, final)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise
    for old in list_checkpoints(directory, rank)[keep:]:
        checkpoint_path(directory, old, rank).unlink(missing_ok=True)
    for leftover in directory.glob(f"{_TEMP_PREFIX}checkpoint-*-rank{rank}.*.tmp"):
        leftover.unlink(missing_ok=True)  # from a write that was killed
    _fsync_directory(directory)
    return final


def load_checkpoint(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a checkpoint with ``torch.load(weights_only=True)`` onto the CPU (the
    ``load_state_dict`` methods then copy each tensor to where its parameter lives)."""
    state = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        found = state.get("format") if isinstance(state, dict) else type(state).__name__
        raise ValueError(
            f"{os.fspath(path)} is not an accumlab checkpoint of format {FORMAT} (found {found!r})"
        )
    return state


def _rank_and_world() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def newest_common(directory: str | os.PathLike[str]) -> int | None:
    """The update-attempt count of the newest checkpoint every rank has, ``None`` when no
    rank has any (collective under a process group: every rank must call it).

    Ranks write their files one after another, so a kill can leave one rank a checkpoint
    ahead; keeping two per rank means the ranks still share one. Raises ``ValueError`` on
    every rank when some rank has checkpoints but none is shared (e.g. the directory was
    written by a run with another world size).
    """
    rank, world = _rank_and_world()
    mine = list_checkpoints(directory, rank)
    if world == 1:
        return mine[0] if mine else None
    width = max(row[0] for row in distributed.gather_counts([len(mine)]))
    if width == 0:
        return None
    rows = distributed.gather_counts(mine + [-1] * (width - len(mine)))
    shared = set.intersection(*({v for v in row if v >= 0} for row in rows))
    if shared:
        return max(shared)
    have = [r for r, row in enumerate(rows) if any(v >= 0 for v in row)]
    raise ValueError(
        f"{os.fspath(directory)}: ranks {have} have checkpoints but no checkpoint is shared by "
        f"all {world} ranks; was it written by a run with another world size? Use a new "
        "checkpoint_dir, or resume with the world size that wrote it"
    )


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


# ---------------------------------------------------------------------------- compatibility


def _differences(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """One line per key whose value differs, in the order of ``saved`` then ``now``."""
    keys = list(saved) + [k for k in now if k not in saved]

    def shown(d: dict[str, Any], k: str) -> str:
        return repr(d[k]) if k in d else "absent"

    return [
        f"{k} {shown(saved, k)} in the checkpoint, {shown(now, k)} now"
        for k in keys
        if k not in saved or k not in now or saved[k] != now[k]
    ]


def _shapes(state_dict: dict[str, Any]) -> dict[str, Any]:
    """Each entry's shape and dtype (the type name for a non-tensor entry)."""
    return {
        k: f"{list(v.shape)} {v.dtype}" if isinstance(v, torch.Tensor) else type(v).__name__
        for k, v in state_dict.items()
    }


def check_compatible(
    state: dict[str, Any],
    *,
    plan: AccumulationPlan,
    model: nn.Module,
    world_size: int,
    precision: str,
    scaler: torch.amp.GradScaler | None,
    scheduler: Any,
) -> None:
    """Refuse a checkpoint the run cannot continue from exactly: ``ValueError`` naming each
    difference in the plan, the world size, the precision and scaler, the scheduler's
    presence, and the model's parameter and buffer names, shapes and dtypes."""
    problems = [f"plan: {d}" for d in _differences(state["plan"], plan.to_dict())]
    if state["world_size"] != world_size:
        problems.append(f"world size: {state['world_size']} in the checkpoint, {world_size} now")
    if state["precision"] != precision:
        problems.append(f"precision: {state['precision']!r} in the checkpoint, {precision!r} now")
    scaling = scaler is not None and scaler.is_enabled()
    if bool(state["scaler"]) != scaling:
        problems.append(
            f"GradScaler: {'an enabled' if state['scaler'] else 'none'} in the checkpoint, "
            f"{'an enabled' if scaling else 'none'} now"
        )
    if (state["scheduler"] is None) != (scheduler is None):
        problems.append(
            f"scheduler: {'none' if state['scheduler'] is None else 'one'} in the checkpoint, "
            f"{'none' if scheduler is None else 'one'} now"
        )
    model_diff = _differences(_shapes(state["model"]), _shapes(model.state_dict()))
    problems += [f"model: {d}" for d in model_diff[:5]]
    if len(model_diff) > 5:
        problems.append(f"model: and {len(model_diff) - 5} more differences")
    if problems:
        raise ValueError(
            "cannot resume from this checkpoint, the run differs from the one that wrote it: "
            + "; ".join(problems)
        )


# ---------------------------------------------------------------------------- the driver's helper


def _loader_state(batches: object) -> Any:
    """The loader's own position (``state_dict()``) when it has one, else ``None``."""
    if callable(getattr(batches, "state_dict", None)) and callable(
        getattr(batches, "load_state_dict", None)
    ):
        return batches.state_dict()  # type: ignore[attr-defined]
    return None


class Checkpointer:
    """What ``train`` needs for checkpoints: start (fresh or resumed), skip the windows
    already trained on, write after every ``every`` attempts and after the last one.

    Without a ``directory`` it does nothing but hand out a fresh ledger and stop the
    windows at ``max_updates``. A fresh start (``resume=False``) into a directory that
    already holds checkpoints is a ``ValueError``. In ``train``::

        ckpt = Checkpointer(checkpoint_dir, checkpoint_every, resume, model=..., ...)
        ledger, halvings = ckpt.ledger, ckpt.halvings      # restored when resuming
        for window in ckpt.windows(aligned_windows(...), max_updates):
            ...train the window, ledger.record(report)...
            ckpt.after_attempt(halvings)
        ckpt.finish(halvings)

    Data position. Outside a multi-rank group, a loader with ``state_dict()`` and
    ``load_state_dict()`` (torchdata's ``StatefulDataLoader``) is restored from its own
    state and yields only the rest. Otherwise (and always under data parallelism, whose
    windows are planned from the whole data of every rank) the loader is read again from
    the start and the windows already trained on are skipped without a forward pass;
    their loader microbatches must add up to the saved position (``ValueError``
    otherwise: the data is not the first run's). The RNG states are restored after the
    skip, so the data order drawn when the loader starts (e.g. a shuffling sampler without
    its own generator) is the first run's, given the same seeds before ``train``.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str] | None,
        every: int | None,
        resume: bool,
        *,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        scaler: torch.amp.GradScaler | None,
        plan: AccumulationPlan,
        precision: str,
        batches: Iterable[Any],
        keep: int = KEEP,
    ) -> None:
        check_arguments(directory, every, resume)
        self.directory = None if directory is None else Path(directory)
        self.every = every
        self.keep = keep
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.scaler = scaler if scaler is not None and scaler.is_enabled() else None
        self.plan, self.precision, self.batches = plan, precision, batches
        self.rank, self.world_size = _rank_and_world()
        self.ledger = Ledger()
        self.halvings = 0
        self.resumed_from: int | None = None  # update attempts of the loaded checkpoint
        self._windows_done = 0  # aligned windows of the whole run fully processed
        self._skip = 0  # windows to skip on resume
        self._position = 0  # loader microbatches those windows must add up to
        self._rng: dict[str, Any] | None = None  # restored once the skip is done
        self._written: tuple[int, int] | None = None
        if self.directory is not None:
            if resume:
                self._resume()
            else:
                _refuse_a_used_directory(self.directory)

    def _resume(self) -> None:
        assert self.directory is not None
        attempts = newest_common(self.directory)
        if attempts is None:
            return  # nothing written yet: a fresh start
        path = checkpoint_path(self.directory, attempts, self.rank)
        state = load_checkpoint(path)
        check_compatible(
            state,
            plan=self.plan,
            model=self.model,
            world_size=self.world_size,
            precision=self.precision,
            scaler=self.scaler,
            scheduler=self.scheduler,
        )
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])  # before the scheduler: it holds lr
        if self.scheduler is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        if self.scaler is not None:
            self.scaler.load_state_dict(state["scaler"])
        self.ledger.load_state_dict(state["ledger"])
        self.halvings = int(state["oom_halvings"])
        data = state["data"]
        self._windows_done = int(data["windows"])
        restorable = callable(getattr(self.batches, "load_state_dict", None))
        if data["loader"] is not None and self.world_size == 1 and restorable:
            self.batches.load_state_dict(data["loader"])  # type: ignore[attr-defined]
        else:
            self._skip, self._position = self._windows_done, int(data["microbatches"])
        self._rng = state["rng"]
        self._written = (self.ledger.update_attempts, self.ledger.loader_batches)
        self.resumed_from = attempts

    def windows(self, windows: Iterable[Any], max_updates: int | None) -> Iterator[Any]:
        """``windows`` (``distributed.aligned_windows``) after the ones already trained on,
        until the run's update attempts reach ``max_updates``; the next window is not read
        once they have."""
        def done() -> bool:
            return max_updates is not None and self.ledger.update_attempts >= max_updates

        if done():
            return
        source = iter(windows)
        read = 0
        for skipped in range(self._skip):
            window = next(source, None)
            if window is None:
                raise ValueError(
                    f"the data ended after {skipped} windows, but the checkpoint was written "
                    f"after {self._skip}; resume needs the data of the run that wrote it"
                )
            read += window.loader_batches
        if read != self._position:
            raise ValueError(
                f"the first {self._skip} windows of the data hold {read} loader microbatches, "
                f"but the checkpoint's run had read {self._position}; resume needs the data of "
                "the run that wrote it"
            )
        if self._rng is not None:
            set_rng_state(self._rng)
            self._rng = None
        while not done():
            window = next(source, None)
            if window is None:
                return
            self._windows_done += 1  # processed by the time the caller asks for the next
            yield window

    def after_attempt(self, halvings: int) -> None:
        """Write a checkpoint when the run's update attempts are a multiple of ``every``."""
        self.halvings = halvings
        if self.every is not None and self.ledger.update_attempts % self.every == 0:
            self.save()

    def finish(self, halvings: int) -> None:
        """Write the final checkpoint, unless nothing changed since the last one."""
        self.halvings = halvings
        if (self.ledger.update_attempts, self.ledger.loader_batches) != self._written:
            self.save()

    def state(self) -> dict[str, Any]:
        """This rank's checkpoint as tensors and plain data."""
        return {
            "format": FORMAT,
            "update_attempts": self.ledger.update_attempts,
            "rank": self.rank,
            "world_size": self.world_size,
            "plan": self.plan.to_dict(),
            "precision": self.precision,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": None if self.scheduler is None else self.scheduler.state_dict(),
            "scaler": None if self.scaler is None else self.scaler.state_dict(),
            "ledger": self.ledger.state_dict(),
            "oom_halvings": self.halvings,
            "rng": rng_state(),
            "data": {
                "windows": self._windows_done,
                "microbatches": self.ledger.loader_batches,
                "loader": _loader_state(self.batches),
            },
        }

    def save(self) -> Path | None:
        """Write this rank's checkpoint now (``None`` without a directory)."""
        if self.directory is None:
            return None
        path = save_checkpoint(
            self.state(), self.directory, self.ledger.update_attempts, rank=self.rank, keep=self.keep
        )
        self._written = (self.ledger.update_attempts, self.ledger.loader_batches)
        return path
