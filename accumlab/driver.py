"""The driver: ``train`` feeds ``train_window`` windows from an iterable of microbatches.

It composes the layers above the core loop: windows from a loader, aligned across ranks
(``accumlab.distributed.alignment``), the ledger, progress on rank 0, OOM shrinking
(``accumlab.oom``), and checkpoints with exact resume (``accumlab.checkpoint``). Its
settings are one :class:`~accumlab.settings.TrainSettings`.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal

import torch
from torch import Tensor, nn

from .checkpoint import Checkpointer
from .distributed.alignment import AlignedWindow, aligned_windows, check_plan, gather_counts
from .ledger import Ledger
from .loop import Forward, train_window
from .objectives import Objective, check_batch, count_examples, count_window
from .oom import train_window_shrinking
from .parallel import is_distributed
from .plan import AccumulationPlan
from .report import UpdateReport
from .settings import TrainSettings


def train(
    model: nn.Module,
    batches: Iterable[Mapping[str, Tensor]],
    optimizer: torch.optim.Optimizer,
    plan: AccumulationPlan,
    objective: Objective,
    *,
    scheduler: Any = None,
    clip_grad_norm: float | None = None,
    max_updates: int | None = None,
    progress: bool = True,
    forward: Forward | None = None,
    precision: str = "fp32",
    scaler: torch.amp.GradScaler | None = None,
    meter: Any = None,
    nonfinite: Literal["skip", "raise"] = "skip",
    scheduler_per: Literal["applied", "attempt"] = "applied",
    on_update: Callable[[UpdateReport], None] | None = None,
    on_oom: Literal["raise", "shrink"] = "raise",
    sync: Literal["window", "microbatch"] = "window",
    checkpoint_dir: str | os.PathLike[str] | None = None,
    checkpoint_every: int | None = None,
    resume: bool = False,
) -> Ledger:
    """Train on an iterable of microbatches, ``plan.accumulation_steps`` per window, one
    update attempt per window; return the ``Ledger`` of this replica's counts.

    Every argument is checked before the first microbatch is read
    (:class:`~accumlab.settings.TrainSettings`: a ``TypeError`` or ``ValueError`` naming
    it), then the model is put in training mode (``model.train()``; it stays there).

    - **Windows**: each goes through ``train_window`` (``accumlab.loop``: the rule every
      microbatch follows, ``nonfinite``, ``scheduler_per``, ``sync``, ``precision``,
      ``scaler``, ``clip_grad_norm``, ``forward``, ``meter``). fp16 without a scaler gets
      one ``torch.amp.GradScaler`` for the whole run. A loader microbatch holds at most
      ``plan.micro_batch_size`` examples (a ``ValueError`` on every rank at once
      otherwise; ``ledger.largest_microbatch`` keeps the largest). A short last window
      follows ``plan.last_window`` (``accumlab.plan``). Under data parallelism every rank
      runs the same windows (``accumlab.distributed.alignment``).
    - **Counts**: the ledger counts update attempts, applied and skipped updates, examples,
      targets, microbatches and what was dropped (``accumlab.ledger``), and what the run
      used (``ledger.settings``, so ``RunRecord.from_run(plan, ledger)`` needs nothing
      else). ``max_updates`` stops after that many update attempts of the whole run (the
      rest of the data is not read); ``on_update`` is called with each window's report;
      ``progress`` shows a bar on rank 0. Data that yields no microbatch is a warning.
    - **Out of memory**: ``on_oom="raise"`` lets ``torch.OutOfMemoryError`` through;
      ``"shrink"`` retries the window with every microbatch cut in half, the same
      examples and denominator (``accumlab.oom``), recorded in ``ledger.shrinks``.
    - **Checkpoints**: with ``checkpoint_dir``, one after every ``checkpoint_every``
      update attempts and after the last; the run holds the directory's lock from before
      the first write until it returns or raises. ``resume=True`` continues bit for bit
      from the newest intact checkpoint given the same objects, settings and data, and
      refuses (``ResumeMismatchError``) anything else (``accumlab.checkpoint``: what a
      checkpoint holds, what a resume compares, the lock).
    """
    settings = TrainSettings.of_call(locals())  # the 16 keyword arguments, each checked
    setup = settings.check_objects(model, batches, optimizer, plan, objective)  # once a run
    check_plan(plan, setup.replicas)  # the same plan on every rank, and D is plan's
    # The run's GradScaler, which checkpoints save and the ledger records: the one given
    # (a disabled one too, which the windows run without), or the one made for fp16.
    scaler = setup.scaler if settings.scaler is None else settings.scaler
    model.train()  # dropout on: a model left in eval() would otherwise train without it
    options = settings.window_options()  # train_window's keywords, alike in every window
    group = setup.replicas.group  # every collective of the run is on the replicas' group
    windows = aligned_windows(plan, batches, objective, group)  # the same on every rank, lazily
    # The checkpoint directory stays this run's (its lock) until train returns or raises.
    with Checkpointer(settings, model, optimizer, scaler, plan, batches) as ckpt:
        ledger = ckpt.ledger  # restored from the checkpoint when resuming
        ledger.note_settings(settings, optimizer, scaler, objective)
        with _progress(batches, plan, settings, ledger.update_attempts) as bar:
            for window in ckpt.windows(windows):  # after those already trained, to max_updates
                _note_read(window, plan, objective, ledger, group)
                microbatches, index = window.microbatches, ledger.update_attempts
                if not microbatches:  # a short last window dropped
                    continue
                if settings.on_oom == "shrink":  # out of memory: halve the microbatches, retry
                    report = train_window_shrinking(
                        model, microbatches, optimizer, objective, ledger, setup=setup, **options
                    )
                else:
                    report = train_window(
                        model, microbatches, optimizer, objective, index=index, setup=setup,
                        **options,
                    )
                    report.padding_microbatches = window.padding
                ledger.record(report)
                ckpt.after_attempt()
                bar.update(1)
                bar.set_postfix(loss=f"{report.loss:.3f}", refresh=False)
                if settings.on_update is not None:
                    settings.on_update(report)
        ledger.note_settings(settings, optimizer, scaler, objective)  # the final scale
        _warn_if_nothing_read(ledger)
        ckpt.finish()
    return ledger


def _progress(
    batches: Iterable[Any], plan: AccumulationPlan, settings: TrainSettings, done: int
) -> Any:
    """A bar over the run's update attempts, at ``done`` (those of a resumed run); shown on
    rank 0 only: every rank runs the same windows, so rank 0's bar speaks for all."""
    from tqdm.auto import tqdm

    try:
        full, rest = divmod(len(batches), plan.accumulation_steps)  # type: ignore[arg-type]
        total: int | None = full + (1 if rest and plan.last_window == "update" else 0)
    except TypeError:  # an iterable without len
        total = None
    if settings.max_updates is not None and total is not None:
        total = min(total, settings.max_updates)
    shown = settings.progress and not (is_distributed() and torch.distributed.get_rank() != 0)
    # Pass disable only to switch the bar off: left unset, TQDM_DISABLE=1 can still do it.
    bar = tqdm(total=total, unit="update", desc="updates", **({} if shown else {"disable": True}))
    bar.update(done)
    return bar


def _note_read(
    window: AlignedWindow, plan: AccumulationPlan, objective: Objective, ledger: Ledger, group: Any
) -> None:
    """Count what the loader gave for ``window``: its loader microbatches and the examples
    and targets of a dropped short window; first raise if one of them holds more than
    ``m`` examples (a larger one would make every count of the plan wrong).

    Only windows that every rank trains on are aligned, so only there do the ranks compare
    their largest microbatch (one small all-reduce over ``group``): all of them raise
    together instead of leaving the peers of the offending rank waiting in the window's
    collectives until the process-group timeout.
    """
    first = ledger.loader_batches  # the loader index of the window's first microbatch
    real = window.microbatches[: len(window.microbatches) - window.padding] + window.dropped
    sizes = [
        count_examples(check_batch(mb, f"microbatch {first + i}")) for i, mb in enumerate(real)
    ]
    largest = max(sizes, default=0)
    peers = group if window.microbatches else None
    per_rank = (
        [row[0] for row in gather_counts([largest], peers)] if peers is not None else [largest]
    )
    m = plan.micro_batch_size
    if max(per_rank) > m:
        if largest > m:
            i = next(k for k, n in enumerate(sizes) if n > m)
            where = f"microbatch {first + i} has {sizes[i]} examples"
        else:
            rank = next(r for r, n in enumerate(per_rank) if n > m)
            where = f"a microbatch of data-parallel rank {rank} has {per_rank[rank]} examples"
        raise ValueError(
            f"{where}, more than the plan's micro_batch_size={m}; the effective batch "
            f"{plan.effective_batch_size} would be wrong. Make the loader's batch size "
            "the plan's micro_batch_size, or build the plan from the loader's"
        )
    ledger.largest_microbatch = max(ledger.largest_microbatch, largest)
    ledger.loader_batches += window.loader_batches
    if window.dropped:
        targets = sum(count_window(objective, window.dropped))
        ledger.record_dropped(sum(count_examples(mb) for mb in window.dropped), targets)


def _warn_if_nothing_read(ledger: Ledger) -> None:
    if ledger.loader_batches == 0:
        warnings.warn(
            "batches yielded no microbatch: 0 update attempts were made (an empty loader, or "
            "an iterator that was already read to its end?)",
            UserWarning,
            stacklevel=3,
        )
