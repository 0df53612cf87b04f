"""The driver's helper: :class:`Checkpointer` starts a run fresh or resumed, skips the
windows already trained on, and writes a checkpoint after every ``every`` update attempts
and after the last one, holding the checkpoint directory's lock for the run's lifetime.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..atomic_write import remove_empty_directories
from ..distributed.alignment import gather_counts
from ..ledger import Ledger
from ..plan import AccumulationPlan
from .compare import (
    _FIX,
    Difference,
    ResumeMismatchError,
    _ids_hint,
    _loader_state,
    _real_microbatches,
    check_compatible,
    recorded_lrs,
    run_settings,
    scheduler_moved,
    window_digest,
)
from .files import (
    FORMAT,
    KEEP,
    _rank_and_world,
    _refuse_a_used_directory,
    check_path_name,
    check_writable,
    load_newest_intact,
    save_checkpoint,
)
from .lock import DirectoryLock, check_still_held, lock_run_directory
from .replay import DataDraws, rng_state, set_rng_state

if TYPE_CHECKING:
    from ..settings import TrainSettings


class Checkpointer:
    """What ``train`` needs for checkpoints: start (fresh or resumed), skip the windows
    already trained on, write after every ``every`` attempts and after the last one.

    It reads ``settings.checkpoint_dir``, ``checkpoint_every``, ``resume``,
    ``max_updates``, the scheduler, the precision and what a resume must find unchanged
    (:func:`run_settings`). Without a directory it does nothing but hand out a fresh
    ledger and stop the windows at ``max_updates``. With one, it first takes the
    directory's lock (:mod:`accumlab.checkpoint.lock`): a run that another live run holds
    the directory of is a :class:`~accumlab.checkpoint.lock.CheckpointDirectoryInUseError`
    naming it, before anything is written there; :meth:`close` (or leaving a ``with``
    block) lets it go. A fresh start (``resume=False``) into a directory that already
    holds checkpoints is a ``ValueError``; a directory that cannot be written to is an
    ``OSError``, all before any data is read. In ``train``::

        with Checkpointer(settings, model, optimizer, scaler, plan, batches) as ckpt:
            ledger = ckpt.ledger                             # restored when resuming
            for window in ckpt.windows(aligned_windows(...)):
                ...train the window, ledger.record(report)...
                ckpt.after_attempt()
            ckpt.finish()
        # leaving the block calls close(): the lock goes, however the run ends

    Resume reads the newest intact checkpoint (:func:`load_newest_intact`) and checks it
    against this run (:func:`check_compatible`) when constructed; the ledger (with its
    OOM shrinks) is restored then. The model, optimizer, scheduler and GradScaler are
    loaded only once :meth:`windows` has checked the data, so a refused resume leaves
    them as the caller built them.

    Data position. Outside a multi-rank group, a loader with ``state_dict()`` and
    ``load_state_dict()`` (torchdata's ``StatefulDataLoader``) is restored from its own
    state and yields only the rest. Otherwise (and always under data parallelism, whose
    windows are planned from the whole data of every rank) the loader is read again from
    the start and the windows already trained on are skipped without a forward pass.
    Each skipped window must hold what the checkpoint's run trained on there
    (:func:`window_digest`: the example ids, or the tensors without ids), and together
    they must add up to the saved position; otherwise :class:`ResumeMismatchError` names
    the first window that differs, on every rank. Reading data may draw random numbers
    (a shuffling sampler without its own generator draws its epoch's order when the epoch
    starts): the checkpoint keeps the RNG states at which each window's reading drew (up
    to ``MAX_RNG_DRAWS`` windows) and the skip restores them before reading that window
    again, so every epoch is shuffled as in the run that wrote the checkpoint. The RNG
    states of the checkpoint itself are restored after the skip.
    """

    def __init__(
        self,
        settings: TrainSettings,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scaler: torch.amp.GradScaler | None,
        plan: AccumulationPlan,
        batches: Iterable[Any],
        *,
        keep: int = KEEP,
    ) -> None:
        directory = settings.checkpoint_dir
        self.directory = None if directory is None else Path(directory)
        self.every, self.max_updates = settings.checkpoint_every, settings.max_updates
        self.keep = keep
        self.model, self.optimizer, self.scheduler = model, optimizer, settings.scheduler
        self.scaler = scaler if scaler is not None and scaler.is_enabled() else None
        self.plan, self.precision, self.batches = plan, settings.precision, batches
        # Read before anything is loaded: the values this run starts with.
        self.settings = run_settings(optimizer, settings, model=model)
        self.rank, self.world_size = _rank_and_world()
        self.ledger = Ledger()
        self.resumed_from: int | None = None  # update attempts of the loaded checkpoint
        self._windows_done = 0  # aligned windows of the whole run fully processed
        self._digests: list[int] = []  # window_digest of each of them
        self._draws = DataDraws()  # window -> RNG state its reading drew from
        self._lrs: list[list[float]] = []  # per update attempt, each group's lr it used
        self._lrs_next: list[float] = []
        self._skip = 0  # windows to skip on resume
        self._position = 0  # loader microbatches those windows must add up to
        self._pending: dict[str, Any] | None = None  # loaded state, put in place after the skip
        self._written: tuple[int, int] | None = None
        self._lock: DirectoryLock | None = None
        if directory is not None:
            check_path_name(directory)
        if self.directory is not None:
            try:  # before anything is written there
                self._lock = lock_run_directory(self.directory)
            except OSError:
                # the clear message of a directory not writable; else the lock's own error
                remove_empty_directories(check_writable(self.directory))
                raise
            try:
                check_writable(self.directory)
                if settings.resume:
                    self._resume()
                else:
                    _refuse_a_used_directory(self.directory)
            except BaseException:
                self.close()
                raise

    def close(self) -> None:
        """Let the checkpoint directory go (its lock); the run writes nothing more."""
        if self._lock is not None:
            lock, self._lock = self._lock, None
            lock.release()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()  # the lock, however the run ends

    def _resume(self) -> None:
        assert self.directory is not None
        found = load_newest_intact(self.directory)
        if found is None:  # nothing written yet: a fresh start
            if self.optimizer.state or scheduler_moved(self.scheduler):
                warnings.warn(
                    f"resume=True found no checkpoint in {self.directory}, so the run starts "
                    "fresh, but the optimizer already holds state (or the scheduler has "
                    "stepped): these objects trained before (a call interrupted before its "
                    "first checkpoint?). To repeat the run exactly, build the model, optimizer "
                    "and scheduler again",
                    UserWarning,
                    stacklevel=4,
                )
            return
        attempts, state = found
        try:
            check_compatible(
                state,
                plan=self.plan,
                model=self.model,
                world_size=self.world_size,
                precision=self.precision,
                scaler=self.scaler,
                settings=self.settings,
                scheduler=self.scheduler,
                optimizer=self.optimizer,
            )
            refused = None
        except ResumeMismatchError as exc:
            refused = exc
        # Every rank raises together, so none waits for the others in the skip's collectives.
        ranks = [r for r, row in enumerate(gather_counts([refused is not None])) if row[0]]
        if refused is not None:
            raise refused
        if ranks:
            raise ResumeMismatchError(
                f"cannot resume from this checkpoint: rank(s) {ranks} differ from the run that "
                f"wrote it (their errors name what). {_FIX}"
            )
        self.ledger.load_state_dict(state["ledger"])
        data, history = state["data"], state["data_history"]
        self._windows_done = int(data["windows"])
        self._digests = [int(d) for d in history["digests"].tolist()]
        self._draws = DataDraws.from_state(history)
        self._lrs = recorded_lrs(state)
        restorable = callable(getattr(self.batches, "load_state_dict", None))
        if data["loader"] is not None and self.world_size == 1 and restorable:
            self.batches.load_state_dict(data["loader"])  # type: ignore[attr-defined]
        else:
            self._skip, self._position = self._windows_done, int(data["microbatches"])
        self._pending = state
        self._written = (self.ledger.update_attempts, self.ledger.loader_batches)
        self.resumed_from = attempts

    def _put_in_place(self) -> None:
        """Load the checked checkpoint into the optimizer, scheduler, GradScaler and model
        and restore its RNG states (once the data is checked too)."""
        state, self._pending = self._pending, None
        if state is None:
            return
        self.optimizer.load_state_dict(state["optimizer"])  # before the scheduler: it holds lr
        if self.scheduler is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        if self.scaler is not None:
            self.scaler.load_state_dict(state["scaler"])
        self.model.load_state_dict(state["model"])
        set_rng_state(state["rng"])

    def _skip_trained(self, source: Iterator[Any]) -> None:
        """Read the windows already trained on again, checking each against the checkpoint
        (collective under data parallelism: every rank raises if one differs)."""
        if not self._skip:
            return
        read, first_bad, hint = 0, -1, ""
        for index in range(self._skip):
            window = self._draws.replay(source, index)
            if window is None:
                what = (f"the data ended after {index} windows, but the checkpoint was written "
                        f"after {self._skip}")
                raise ResumeMismatchError(
                    f"{what}; resume needs the data of the run that wrote it. {_FIX}",
                    [Difference("data", what)],
                )
            if first_bad < 0 and window_digest(_real_microbatches(window)) != self._digests[index]:
                first_bad, ids = index, _ids_hint(window)
                hint = (
                    f" (loader microbatches {read}-{read + window.loader_batches - 1}) holds other "
                    f"{'examples' if ids else 'data'} than the run that wrote the checkpoint "
                    f"trained on there{ids}"
                )
            read += window.loader_batches
        rows = gather_counts([first_bad, read])
        if any(row[0] >= 0 for row in rows):
            rank, bad = next((r, row[0]) for r, row in enumerate(rows) if row[0] >= 0)
            where = f"window {bad}{hint}" if bad == first_bad else f"window {bad} of rank {rank}"
            full_at = self._draws.full_at
            unreplayed = full_at is not None and full_at <= bad
            raise ResumeMismatchError(
                f"resume needs the data of the run that wrote the checkpoint: {where}; was it "
                "shuffled with another seed, extended with other examples, or an iterator "
                "already partly read?"
                + (f" (its data's random draws from window {full_at} on were not "
                   "replayed: see the warning of that run)" if unreplayed else "")
                + f" {_FIX}",
                [Difference("data", where)],
            )
        if read != self._position:
            what = (f"the first {self._skip} windows of the data hold {read} loader microbatches, "
                    f"but the checkpoint's run had read {self._position}")
            raise ResumeMismatchError(
                f"{what}; resume needs the data of the run that wrote it. {_FIX}",
                [Difference("data", what)],
            )

    def windows(self, windows: Iterable[Any]) -> Iterator[Any]:
        """``windows`` (``distributed.aligned_windows``) after the ones already trained on,
        until the run's update attempts reach ``max_updates``; the next window is not read
        once they have. On resume, the checkpoint is put in place after the skip."""
        limit = self.max_updates

        def done() -> bool:
            return limit is not None and self.ledger.update_attempts >= limit

        source = iter(windows)
        self._skip_trained(source)  # the data is checked even when no window is left to train
        self._put_in_place()
        if done():
            if self.resumed_from is not None and self.ledger.update_attempts > limit:  # type: ignore[operator]
                warnings.warn(
                    f"max_updates={limit}, but the checkpoint in {self.directory} was written "
                    f"after {self.ledger.update_attempts} update attempts: the model is returned as "
                    "those attempts left it (nothing was trained or undone)",
                    UserWarning,
                    stacklevel=3,
                )
            return
        while not done():
            if self.directory is None:
                window = next(source, None)
            else:
                window = self._draws.read(source, self._windows_done)
            if window is None:
                return
            if self.directory is not None:
                self._digests.append(window_digest(_real_microbatches(window)))
                self._lrs_next = [float(g["lr"]) for g in self.optimizer.param_groups]
            self._windows_done += 1  # processed by the time the caller asks for the next
            yield window

    def after_attempt(self) -> None:
        """Write a checkpoint when the run's update attempts are a multiple of ``every``."""
        if len(self._lrs) < self.ledger.update_attempts:
            self._lrs.append(self._lrs_next)  # the lr this attempt used
        if self.every is not None and self.ledger.update_attempts % self.every == 0:
            self.save()

    def finish(self) -> None:
        """Write the final checkpoint, unless nothing changed since the last one."""
        if (self.ledger.update_attempts, self.ledger.loader_batches) != self._written:
            self.save()

    def state(self) -> dict[str, Any]:
        """This rank's checkpoint as tensors and plain data (each entry is described in
        ``accumlab.checkpoint``'s docstring)."""
        return {
            "format": FORMAT,
            "update_attempts": self.ledger.update_attempts,
            "rank": self.rank,
            "world_size": self.world_size,
            "plan": self.plan.to_dict(),
            "precision": self.precision,
            "settings": self.settings,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": None if self.scheduler is None else self.scheduler.state_dict(),
            "scaler": None if self.scaler is None else self.scaler.state_dict(),
            "ledger": self.ledger.state_dict(),
            "oom_halvings": len(self.ledger.shrinks),  # for a reader of the file; not read back
            "rng": rng_state(),
            "data": {
                "windows": self._windows_done,
                "microbatches": self.ledger.loader_batches,
                "loader": _loader_state(self.batches),
            },
            "data_history": {  # per window: what it held, and the RNG its reading drew from
                "digests": torch.tensor(self._digests, dtype=torch.int64),
                **self._draws.state(),
                # per update attempt: each parameter group's lr (the scheduler's replay)
                "lrs": torch.tensor(self._lrs, dtype=torch.float64).reshape(
                    len(self._lrs), len(self.optimizer.param_groups)
                ),
            },
        }

    def save(self) -> Path | None:
        """Write this rank's checkpoint now (``None`` without a directory)."""
        if self.directory is None:
            return None
        check_still_held(self._lock, self.directory)  # another run may own it now
        path = save_checkpoint(
            self.state(), self.directory, self.ledger.update_attempts, rank=self.rank, keep=self.keep
        )
        self._written = (self.ledger.update_attempts, self.ledger.loader_batches)
        return path
