"""Checkpoints for ``train``: everything the next update depends on, and exact resume.

A checkpoint is one file per rank, ``checkpoint-<attempts>-rank<r>.pt`` in the checkpoint
directory, where ``<attempts>`` is the run's update attempts so far (8 digits). It holds
the model, optimizer, scheduler and GradScaler state, the ledger (as plain data), the OOM
shrink state (how many times every loader microbatch is cut in half), the RNG states
(torch CPU, every CUDA device when there is one, Python's ``random``), the settings the
run started with (optimizer class and hyper-parameters, scheduler class, clipping, seed),
the position in the data (windows and loader microbatches consumed, a digest of what each
window held, the RNG states at which reading the data drew random numbers, and the
loader's own ``state_dict()`` when it has one) and a SHA-256 checksum of all of it.
``torch.load(weights_only=True)`` reads it, so it stores tensors and plain data only.

Safety: a checkpoint is written to a temporary file in the same directory, flushed and
fsynced, then renamed over its final name (``os.replace``, atomic), so a kill at any
moment leaves the previous checkpoints intact; a leftover temporary file is never read
and is removed by the rank's next write. The newest ``keep`` (2) checkpoints of a rank are
kept. Resume loads the newest intact checkpoint that every rank has (a file that is cut
short, empty or fails its checksum is skipped with a warning), and refuses one written
for another plan, model shape, world size, precision, optimizer, scheduler, clipping,
seed or data with a :class:`ResumeMismatchError` naming what differs, before it loads
anything into the model.

``train(..., checkpoint_dir=..., checkpoint_every=..., resume=...)`` drives it through
:class:`Checkpointer`; the one-window core (``train_window``, ``accumulate``) knows
nothing of checkpoints.
"""

from __future__ import annotations

import hashlib
import os
import random
import re
import tempfile
import warnings
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from . import distributed
from .ledger import Ledger
from .plan import AccumulationPlan, check_positive_int

FORMAT = 2  # bumped when the layout of a checkpoint changes
KEEP = 2  # checkpoints kept per rank
MAX_RNG_DRAWS = 1024  # RNG states kept for windows whose reading drew random numbers
_NAME = re.compile(r"^checkpoint-(\d{8,})-rank(\d+)\.pt$")
_TEMP_PREFIX = ".checkpoint-"
_FIX = "Pass the values of the run that wrote it, or start a new run in another checkpoint_dir"


class ResumeMismatchError(ValueError):
    """Resume refused: the run differs from the one that wrote the checkpoint. The
    message names each setting (or the first window of data) that differs, with the
    checkpoint's value and the given one, and the fix."""


class CorruptCheckpointError(ValueError):
    """A checkpoint file that cannot be trusted: empty, cut short, unreadable, of another
    format, or its content does not match the checksum stored with it."""


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
    """Restore what :func:`rng_state` returned, or the part of it ``state`` holds. CUDA
    states are restored for the devices present in both (all of them when the device
    count is unchanged)."""
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available():
        for device, device_state in enumerate(cuda[: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(device_state, device)
    if "python" in state:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))


def changed_generators(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """The generators (keys of :func:`rng_state`) whose state differs between two of its
    results: those something drew from in between."""
    cuda_same = (before["cuda"] is None) == (after["cuda"] is None) and (
        before["cuda"] is None
        or (len(before["cuda"]) == len(after["cuda"]) and all(map(torch.equal, before["cuda"], after["cuda"])))
    )
    same = {
        "torch": torch.equal(before["torch"], after["torch"]),
        "cuda": cuda_same,
        "python": before["python"] == after["python"],
    }
    return [name for name, unchanged in same.items() if not unchanged]


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


def check_writable(directory: str | os.PathLike[str]) -> None:
    """Create ``directory`` if needed and write (then remove) a temporary file there, so
    that a directory checkpoints cannot be written to is an ``OSError`` before training,
    not after the first window."""
    directory = Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=directory, prefix=f"{_TEMP_PREFIX}probe.", suffix=".tmp")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise OSError(
            f"cannot write checkpoints to checkpoint_dir {os.fspath(directory)!r} "
            f"({exc.strerror or exc}); give a directory you can write to"
        ) from exc


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
            torch.save({**state, "sha256": payload_checksum(state)}, f)
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
    ``load_state_dict`` methods then copy each tensor to where its parameter lives) and
    verify its checksum. :class:`CorruptCheckpointError` naming the file and why when it
    is empty, cut short, unreadable, not plain data, of another format or fails the
    checksum (e.g. a flipped bit inside a stored weight)."""
    name = os.fspath(path)

    def corrupt(why: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"checkpoint {name} is not intact: {why}")

    try:
        if os.path.getsize(path) == 0:
            raise corrupt("the file is empty (0 bytes)")
        state = torch.load(path, map_location="cpu", weights_only=True)
    except CorruptCheckpointError:
        raise
    except Exception as exc:  # a cut or damaged file fails in many ways inside torch.load
        first = (str(exc).strip().splitlines() or [""])[0].split(". ")[0][:160]
        raise corrupt(f"it is cut short or damaged ({type(exc).__name__}: {first})") from exc
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        found = state.get("format") if isinstance(state, dict) else type(state).__name__
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

    A newer one that some rank cannot read is skipped with a warning naming the file, why,
    and the checkpoint resumed from instead; all ranks move to the previous one together (one small all-reduce per
    checkpoint tried), so they load the same update. If every shared checkpoint is
    damaged: :class:`CorruptCheckpointError` naming the files, on every rank.
    """
    rank, _ = _rank_and_world()
    skipped = []
    for attempts in common_checkpoints(directory):
        path = checkpoint_path(directory, attempts, rank)
        try:
            state, why = load_checkpoint(path), ""
        except CorruptCheckpointError as exc:
            state, why = None, str(exc)
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


# ---------------------------------------------------------------------------- compatibility


def _differences(saved: Mapping[str, Any], now: Mapping[str, Any], prefix: str = "") -> list[str]:
    """One line per key whose value differs, in the order of ``saved`` then ``now``."""
    keys = list(saved) + [k for k in now if k not in saved]

    def shown(d: Mapping[str, Any], k: str) -> str:
        return repr(d[k]) if k in d else "absent"

    return [
        f"{prefix}{k} {shown(saved, k)} in the checkpoint, {shown(now, k)} now"
        for k in keys
        if k not in saved or k not in now or saved[k] != now[k]
    ]


def _shapes(state_dict: dict[str, Any]) -> dict[str, Any]:
    """Each entry's shape and dtype (the type name for a non-tensor entry)."""
    return {
        k: f"{list(v.shape)} {v.dtype}" if isinstance(v, torch.Tensor) else type(v).__name__
        for k, v in state_dict.items()
    }


def _plain(value: Any) -> Any:
    """A hyper-parameter as plain data: a tensor as its number(s), a tuple as a list."""
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def _class_name(obj: object) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def run_settings(optimizer: torch.optim.Optimizer, scheduler: Any, **options: Any) -> dict[str, Any]:
    """What a checkpoint fixes besides the plan, model and precision, as plain data, read
    when ``train`` starts (before anything is loaded): the optimizer's class, its
    parameter groups' sizes and hyper-parameters (everything but ``params``: what the run
    started with, not what a scheduler made of them later), the scheduler's class, the
    seed of torch's generator (``torch.initial_seed()``) and ``options`` (clipping, ...)."""
    return {
        "optimizer": _class_name(optimizer),
        "param_group_sizes": [len(g["params"]) for g in optimizer.param_groups],
        "hyperparameters": [
            {k: _plain(v) for k, v in g.items() if k != "params"} for g in optimizer.param_groups
        ],
        "scheduler": None if scheduler is None else _class_name(scheduler),
        "seed": torch.initial_seed(),
        **options,
    }


def _setting_differences(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    names = {"seed": "seed (torch.initial_seed())"}
    problems = [
        f"{names.get(k, k)}: {saved.get(k)!r} in the checkpoint, {now.get(k)!r} now"
        for k in list(saved) + [k for k in now if k not in saved]
        if k not in ("hyperparameters", "param_group_sizes") and saved.get(k) != now.get(k)
    ]
    if saved["optimizer"] != now["optimizer"]:
        return problems  # other hyper-parameters of another optimizer say nothing more
    if saved["param_group_sizes"] != now["param_group_sizes"]:
        problems.append(
            f"optimizer parameters per group: {saved['param_group_sizes']} in the checkpoint, "
            f"{now['param_group_sizes']} now"
        )
        return problems
    for i, (before, after) in enumerate(zip(saved["hyperparameters"], now["hyperparameters"], strict=True)):
        problems += [
            f"optimizer param_groups[{i}]['{d.split(' ', 1)[0]}']: {d.split(' ', 1)[1]}"
            for d in _differences(before, after)
        ]
    return problems


def check_compatible(
    state: dict[str, Any],
    *,
    plan: AccumulationPlan,
    model: nn.Module,
    world_size: int,
    precision: str,
    scaler: torch.amp.GradScaler | None,
    settings: dict[str, Any],
) -> None:
    """Refuse a checkpoint the run cannot continue from exactly: :class:`ResumeMismatchError`
    naming each difference in the plan, the world size, the precision and scaler, the
    model's parameter and buffer names, shapes and dtypes, and the ``settings``
    (:func:`run_settings`), each with the checkpoint's value and the given one."""
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
    problems += _setting_differences(state["settings"], settings)
    model_diff = _differences(_shapes(state["model"]), _shapes(model.state_dict()))
    problems += [f"model: {d}" for d in model_diff[:5]]
    if len(model_diff) > 5:
        problems.append(f"model: and {len(model_diff) - 5} more differences")
    if problems:
        raise ResumeMismatchError(
            "cannot resume from this checkpoint, the run differs from the one that wrote it: "
            + "; ".join(problems) + f". {_FIX}"
        )


# ---------------------------------------------------------------------------- the data


_DIGEST_BYTES = 1 << 16  # of each CPU tensor, for data without example ids


def window_digest(microbatches: Iterable[Any]) -> int:
    """A 64-bit digest (signed, to fit an int64 tensor) of what a window's microbatches
    hold: their ``example_ids`` when they have them, else each tensor's dtype and shape
    and the first 64 KiB of its bytes when it is on the CPU (only dtype and shape when
    it is not). Two windows with the same digest hold the same examples in the same order
    (same ids), or, without ids, start with the same bytes."""
    digest = hashlib.blake2b(digest_size=8)

    def feed(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            digest.update(f"T{value.dtype}{list(value.shape)}:".encode())
            if value.device.type == "cpu":
                flat = value.detach().contiguous().reshape(-1).view(torch.uint8)
                digest.update(flat[:_DIGEST_BYTES].numpy().data)
        elif isinstance(value, Mapping):
            ids = value.get("example_ids")
            items = [("example_ids", ids)] if isinstance(ids, torch.Tensor) else sorted(value.items(), key=lambda kv: str(kv[0]))
            for key, item in items:
                digest.update(f"k{key}:".encode())
                feed(item)
        elif isinstance(value, (list, tuple)):
            digest.update(f"l{len(value)}:".encode())
            for item in value:
                feed(item)
        elif value is None or isinstance(value, (bool, int, float, str)):
            digest.update(f"v{value!r};".encode())
        else:
            digest.update(f"o{type(value).__qualname__};".encode())  # never an address

    for microbatch in microbatches:
        digest.update(b"|")
        feed(microbatch)
    return int.from_bytes(digest.digest(), "little", signed=True)


def _real_microbatches(window: Any) -> list[Any]:
    """The loader microbatches of an aligned window: trained ones (no padding) and dropped ones."""
    return [*window.microbatches[: len(window.microbatches) - window.padding], *window.dropped]


def _ids_hint(window: Any) -> str:
    ids = [
        int(i)
        for mb in _real_microbatches(window)
        if isinstance(mb, Mapping) and isinstance(mb.get("example_ids"), torch.Tensor)
        for i in mb["example_ids"].reshape(-1)[:8]
    ]
    return f" (its example ids now begin {ids[:8]})" if ids else ""


def _loader_state(batches: object) -> Any:
    """The loader's own position (``state_dict()``) when it has one, else ``None``."""
    if callable(getattr(batches, "state_dict", None)) and callable(
        getattr(batches, "load_state_dict", None)
    ):
        return batches.state_dict()  # type: ignore[attr-defined]
    return None


# ---------------------------------------------------------------------------- the driver's helper


class Checkpointer:
    """What ``train`` needs for checkpoints: start (fresh or resumed), skip the windows
    already trained on, write after every ``every`` attempts and after the last one.

    Without a ``directory`` it does nothing but hand out a fresh ledger and stop the
    windows at ``max_updates``. A fresh start (``resume=False``) into a directory that
    already holds checkpoints is a ``ValueError``; a directory that cannot be written to
    is an ``OSError``, both before any data is read. In ``train``::

        ckpt = Checkpointer(checkpoint_dir, checkpoint_every, resume, model=..., ...)
        ledger, halvings = ckpt.ledger, ckpt.halvings      # restored when resuming
        for window in ckpt.windows(aligned_windows(...), max_updates):
            ...train the window, ledger.record(report)...
            ckpt.after_attempt(halvings)
        ckpt.finish(halvings)

    Resume reads the newest intact checkpoint (:func:`load_newest_intact`) and checks it
    against this run (:func:`check_compatible`) when constructed; the ledger and the
    shrink state are restored then. The model, optimizer, scheduler and GradScaler are
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
        options: Mapping[str, Any] | None = None,
        keep: int = KEEP,
    ) -> None:
        check_arguments(directory, every, resume)
        self.directory = None if directory is None else Path(directory)
        self.every = every
        self.keep = keep
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.scaler = scaler if scaler is not None and scaler.is_enabled() else None
        self.plan, self.precision, self.batches = plan, precision, batches
        # Read before anything is loaded: the values this run starts with.
        self.settings = run_settings(optimizer, scheduler, **dict(options or {}))
        self.rank, self.world_size = _rank_and_world()
        self.ledger = Ledger()
        self.halvings = 0
        self.resumed_from: int | None = None  # update attempts of the loaded checkpoint
        self._windows_done = 0  # aligned windows of the whole run fully processed
        self._digests: list[int] = []  # window_digest of each of them
        self._draws: dict[int, dict[str, Any]] = {}  # window -> RNG state its reading drew from
        self._draws_full_at: int | None = None  # first window whose draws were not kept
        self._skip = 0  # windows to skip on resume
        self._position = 0  # loader microbatches those windows must add up to
        self._pending: dict[str, Any] | None = None  # loaded state, put in place after the skip
        self._written: tuple[int, int] | None = None
        if self.directory is not None:
            check_writable(self.directory)
            if resume:
                self._resume()
            else:
                _refuse_a_used_directory(self.directory)

    def _resume(self) -> None:
        assert self.directory is not None
        found = load_newest_intact(self.directory)
        if found is None:
            return  # nothing written yet: a fresh start
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
            )
            refused = None
        except ResumeMismatchError as exc:
            refused = exc
        # Every rank raises together, so none waits for the others in the skip's collectives.
        ranks = [r for r, row in enumerate(distributed.gather_counts([refused is not None])) if row[0]]
        if refused is not None:
            raise refused
        if ranks:
            raise ResumeMismatchError(
                f"cannot resume from this checkpoint: rank(s) {ranks} differ from the run that "
                f"wrote it (their errors name what). {_FIX}"
            )
        self.ledger.load_state_dict(state["ledger"])
        self.halvings = int(state["oom_halvings"])
        data, history = state["data"], state["data_history"]
        self._windows_done = int(data["windows"])
        self._digests = [int(d) for d in history["digests"].tolist()]
        self._draws = {int(d["window"]): d["rng"] for d in history["rng_draws"]}
        self._draws_full_at = history["rng_draws_full_at"]
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

    def _read(self, source: Iterator[Any], index: int, skipping: bool) -> Any:
        """``next(source)``: window ``index``. While skipping, first restore the RNG state
        its reading drew from in the checkpoint's run; otherwise note that state when the
        reading draws (the data's own randomness, e.g. an epoch's shuffle)."""
        if skipping:
            if index in self._draws:
                set_rng_state(self._draws[index])
            return next(source, None)
        if self.directory is None:
            return next(source, None)
        before = rng_state()
        window = next(source, None)
        drawn = changed_generators(before, rng_state()) if window is not None else []
        if drawn:
            if len(self._draws) < MAX_RNG_DRAWS:
                self._draws[index] = {name: before[name] for name in drawn}  # ~5 KB for torch
            elif self._draws_full_at is None:
                self._draws_full_at = index
                warnings.warn(
                    f"reading the data drew from the global random generators in more than "
                    f"{MAX_RNG_DRAWS} windows (the last kept: window {max(self._draws, default=-1)}); "
                    f"a resume that skips past window {index} cannot replay those draws and "
                    "relies on the data check. Give the sampler or collate_fn its own "
                    "torch.Generator, or use a loader with state_dict()",
                    UserWarning,
                    stacklevel=4,
                )
        return window

    def _skip_trained(self, source: Iterator[Any]) -> None:
        """Read the windows already trained on again, checking each against the checkpoint
        (collective under data parallelism: every rank raises if one differs)."""
        if not self._skip:
            return
        read, first_bad, hint = 0, -1, ""
        for index in range(self._skip):
            window = self._read(source, index, skipping=True)
            if window is None:
                raise ResumeMismatchError(
                    f"the data ended after {index} windows, but the checkpoint was written "
                    f"after {self._skip}; resume needs the data of the run that wrote it. {_FIX}"
                )
            if first_bad < 0 and window_digest(_real_microbatches(window)) != self._digests[index]:
                first_bad, ids = index, _ids_hint(window)
                hint = (
                    f" (loader microbatches {read}-{read + window.loader_batches - 1}) holds other "
                    f"{'examples' if ids else 'data'} than the run that wrote the checkpoint "
                    f"trained on there{ids}"
                )
            read += window.loader_batches
        rows = distributed.gather_counts([first_bad, read])
        if any(row[0] >= 0 for row in rows):
            rank, bad = next((r, row[0]) for r, row in enumerate(rows) if row[0] >= 0)
            where = f"window {bad}{hint}" if bad == first_bad else f"window {bad} of rank {rank}"
            unreplayed = self._draws_full_at is not None and self._draws_full_at <= bad
            raise ResumeMismatchError(
                f"resume needs the data of the run that wrote the checkpoint: {where}; was it "
                "shuffled with another seed, extended with other examples, or an iterator "
                "already partly read?"
                + (f" (its data's random draws from window {self._draws_full_at} on were not "
                   "replayed: see the warning of that run)" if unreplayed else "")
                + f" {_FIX}"
            )
        if read != self._position:
            raise ResumeMismatchError(
                f"the first {self._skip} windows of the data hold {read} loader microbatches, "
                f"but the checkpoint's run had read {self._position}; resume needs the data of "
                f"the run that wrote it. {_FIX}"
            )

    def windows(self, windows: Iterable[Any], max_updates: int | None) -> Iterator[Any]:
        """``windows`` (``distributed.aligned_windows``) after the ones already trained on,
        until the run's update attempts reach ``max_updates``; the next window is not read
        once they have. On resume, the checkpoint is put in place after the skip."""
        def done() -> bool:
            return max_updates is not None and self.ledger.update_attempts >= max_updates

        if done():
            if self.resumed_from is not None and self.ledger.update_attempts > max_updates:  # type: ignore[operator]
                warnings.warn(
                    f"max_updates={max_updates}, but the checkpoint in {self.directory} was written "
                    f"after {self.ledger.update_attempts} update attempts: the model is returned as "
                    "those attempts left it (nothing was trained or undone)",
                    UserWarning,
                    stacklevel=3,
                )
            self._put_in_place()
            return
        source = iter(windows)
        self._skip_trained(source)
        self._put_in_place()
        while not done():
            window = self._read(source, self._windows_done, skipping=False)
            if window is None:
                return
            if self.directory is not None:
                self._digests.append(window_digest(_real_microbatches(window)))
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
            "settings": self.settings,
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
            "data_history": {  # per window: what it held, and the RNG its reading drew from
                "digests": torch.tensor(self._digests, dtype=torch.int64),
                "rng_draws": [{"window": w, "rng": s} for w, s in sorted(self._draws.items())],
                "rng_draws_full_at": self._draws_full_at,
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
