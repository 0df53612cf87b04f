"""The driver: ``train`` feeds ``train_window`` windows from an iterable of microbatches.

It composes the layers above the core loop: windows from a loader, the ledger, progress
on rank 0, rank alignment under data parallelism, OOM shrinking, and checkpoints with
exact resume (``accumlab.checkpoint``).
"""

from __future__ import annotations

import math
import numbers
import os
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal

import torch
from torch import Tensor, nn

from . import checkpoint
from .distributed.alignment import aligned_windows, check_plan, gather_counts
from .ledger import Ledger
from .loop import Forward, model_device, train_window
from .objectives import Objective, check_batch, count_examples, count_window
from .oom import train_window_shrinking
from .parallel import data_parallel_group, is_distributed
from .plan import AccumulationPlan, check_positive_int
from .precision import precision_policy, resolve_scaler, update_parameters
from .report import UpdateReport


def _progress(total: int | None, enabled: bool) -> Any:
    from tqdm.auto import tqdm

    # Every rank runs the same windows, so rank 0's bar speaks for all of them.
    if is_distributed() and torch.distributed.get_rank() != 0:
        enabled = False
    # Pass disable only to switch the bar off: left unset, TQDM_DISABLE=1 can still do it.
    options = {} if enabled else {"disable": True}
    return tqdm(total=total, unit="update", desc="updates", **options)


def _planned_windows(batches: Iterable[Any], plan: AccumulationPlan) -> int | None:
    try:
        n = len(batches)  # type: ignore[arg-type]
    except TypeError:
        return None
    full, rest = divmod(n, plan.accumulation_steps)
    return full + (1 if rest and plan.last_window == "update" else 0)


def check_clip_grad_norm(clip_grad_norm: object) -> float | None:
    """``clip_grad_norm`` if it is ``None`` or a positive, finite number (the largest L2
    norm the combined gradient may have); ``TypeError``/``ValueError`` otherwise."""
    if clip_grad_norm is None:
        return None
    if isinstance(clip_grad_norm, bool) or not isinstance(clip_grad_norm, numbers.Real):
        raise TypeError(
            "clip_grad_norm must be a number (the largest L2 norm of the combined gradient) "
            f"or None, got {type(clip_grad_norm).__name__} ({clip_grad_norm!r})"
        )
    if not (clip_grad_norm > 0 and math.isfinite(clip_grad_norm)):
        raise ValueError(
            f"clip_grad_norm must be positive and finite, or None for no clipping, got "
            f"{clip_grad_norm!r}"
        )
    return float(clip_grad_norm)


def check_hyperparameters(optimizer: torch.optim.Optimizer) -> None:
    """``ValueError`` naming the group and key of a non-finite number (``inf``, ``nan``)
    among the optimizer's hyper-parameters (``lr``, ``betas``, ``weight_decay``, ...):
    every update would turn the weights into ``nan``."""
    for i, group in enumerate(optimizer.param_groups):
        for key, value in group.items():
            values = value if isinstance(value, (list, tuple)) and key != "params" else [value]
            for v in values:
                if isinstance(v, Tensor) and v.numel() == 1:
                    v = v.item()
                if isinstance(v, numbers.Real) and not isinstance(v, bool) and not math.isfinite(v):
                    raise ValueError(
                        f"optimizer.param_groups[{i}][{key!r}] is {value!r}; hyper-parameters "
                        "must be finite numbers: build the optimizer with a finite value"
                    )


def _check_callable(name: str, value: object) -> None:
    if value is not None and not callable(value):
        raise TypeError(f"{name} must be callable or None, got {type(value).__name__}")


def _check_train_arguments(
    model: object,
    batches: object,
    optimizer: object,
    plan: object,
    objective: object,
    options: Mapping[str, Any],
) -> None:
    """Every argument of ``train`` that can be checked without reading data."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(batches, Mapping) or not isinstance(batches, Iterable):
        raise TypeError(
            "batches must be an iterable of microbatches (a list, a DataLoader, a generator), "
            f"got {type(batches).__name__}; to train on one batch, pass [batch]"
        )
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    check_hyperparameters(optimizer)
    if not isinstance(plan, AccumulationPlan):
        raise TypeError(f"plan must be an AccumulationPlan, got {type(plan).__name__}")
    if not all(callable(getattr(objective, name, None)) for name in ("count", "loss_sum")):
        raise TypeError(
            "objective must have count(batch) and loss_sum(output, batch) methods, such as "
            f"accumlab.NextTokenLoss() or accumlab.ExampleLoss(), got {type(objective).__name__}"
        )
    scheduler = options["scheduler"]
    if scheduler is not None and not callable(getattr(scheduler, "step", None)):
        raise TypeError(
            "scheduler must have a step() method (a torch.optim.lr_scheduler scheduler) or "
            f"be None, got {type(scheduler).__name__}"
        )
    check_clip_grad_norm(options["clip_grad_norm"])
    if options["max_updates"] is not None:
        check_positive_int("max_updates", options["max_updates"])
    if not isinstance(options["progress"], bool):
        raise TypeError(f"progress must be True or False, got {options['progress']!r}")
    _check_callable("forward", options["forward"])
    _check_callable("on_update", options["on_update"])
    for name, allowed in (
        ("nonfinite", ("skip", "raise")),
        ("scheduler_per", ("applied", "attempt")),
        ("on_oom", ("raise", "shrink")),
        ("sync", ("window", "microbatch")),
    ):
        if options[name] not in allowed:
            raise ValueError(f"{name} must be {allowed[0]!r} or {allowed[1]!r}, got {options[name]!r}")


def _note_microbatch_sizes(
    microbatches: Sequence[Mapping[str, Tensor]],
    first: int,
    plan: AccumulationPlan,
    ledger: Ledger,
    group: Any,
) -> None:
    """Raise if a loader microbatch holds more than ``m`` examples; keep the largest seen.

    ``first`` is the loader index of ``microbatches[0]``, for the message. With a
    data-parallel ``group`` the ranks first compare their largest (one small all-reduce,
    in a window every rank trains on), so all of them raise together instead of leaving
    the peers of the offending rank waiting in the window's collectives until the
    process-group timeout.
    """
    sizes = [
        count_examples(check_batch(mb, f"microbatch {first + i}")) for i, mb in enumerate(microbatches)
    ]
    largest = max(sizes, default=0)
    per_rank = [row[0] for row in gather_counts([largest], group)] if group is not None else [largest]
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
    """Train on an iterable of microbatches, ``plan.accumulation_steps`` per window.

    Every argument is checked before the first microbatch is read (a bad one is a
    ``TypeError`` or ``ValueError`` naming it), then the model is put in training mode
    (``model.train()``; it stays there). Each window goes through ``train_window``. A
    microbatch read from ``batches`` may hold at most ``plan.micro_batch_size`` examples
    (a ``ValueError`` otherwise, before its window is trained on, on every data-parallel
    rank at once: a larger one would make every count of the plan wrong);
    ``ledger.largest_microbatch`` keeps the largest seen.
    A short last window is trained on with ``plan.last_window == "update"`` (normalised by
    its own count) or counted as dropped with ``"drop"``. ``max_updates`` stops after that
    many update attempts (the rest of the iterable is not read). ``on_update`` is called
    with each report. The progress bar (``progress=True``) shows on rank 0 only. Returns
    the ledger of this replica's counts.

    Precision: ``precision``, ``scaler``, ``nonfinite`` and ``scheduler_per`` mean what
    they mean in ``train_window``. With ``precision="fp16"`` and no scaler, one
    ``torch.amp.GradScaler`` for the model's device serves the whole run; the ledger
    counts update attempts, applied updates and skipped ones apart.

    Gradient synchronization (``accumulate``): ``sync="window"`` syncs once per window,
    the least traffic; under FSDP2 every rank then holds full unsharded gradients for the
    whole window. ``sync="microbatch"`` syncs after every backward pass, so FSDP2 keeps
    only its gradient shard (as torchtune's recipes do), for A times the traffic: pick it
    when FSDP2's full gradients do not fit; under DDP it only adds traffic. The gradient
    and the update are the same either way.

    Out of memory: ``on_oom="raise"`` lets ``torch.OutOfMemoryError`` through;
    ``on_oom="shrink"`` retries the window with every microbatch cut in half (same
    examples, same denominator, same update; see ``accumlab.oom``), keeps the
    smaller size for later windows and records each shrink in ``ledger.shrinks``.

    Checkpoints (``accumlab.checkpoint``): with ``checkpoint_dir``, a checkpoint is written
    there after every ``checkpoint_every`` update attempts and after the last one
    (atomically, with a SHA-256 checksum; the newest two are kept; a directory that
    cannot be written to is an ``OSError`` before any data is read). The run owns the
    directory from before its first write until it returns or raises: a directory
    another live run holds is a ``checkpoint.CheckpointDirectoryInUseError`` (a
    ``RuntimeError``) naming that run, and a lock left by a killed run is taken over
    with a warning (``accumlab.checkpoint.lock``). ``resume=True``
    continues from the newest intact checkpoint in ``checkpoint_dir`` (a fresh start when
    there is none; a damaged newer one is skipped with a warning), given the same model,
    optimizer, scheduler, settings and data as the run that wrote it: the windows already
    trained on are read again without a forward pass and checked against what that run
    trained on (example ids, or the tensors), then the weights, optimizer, scheduler,
    GradScaler, ledger, OOM shrink state, RNG states and data position are restored. A
    difference (optimizer class, its parameters in order or its hyper-parameters, the
    scheduler's class, hyper-parameters or learning rates so far, ``clip_grad_norm``,
    precision, seed, plan, model, data) is a ``checkpoint.ResumeMismatchError`` (a
    ``ValueError``) naming it, raised before anything is loaded into the model. What a
    scheduler made of the lr is not a difference: the same call may be repeated with
    the same objects after an interruption in one process.
    ``max_updates`` then counts the whole run's attempts, resumed ones included, so the
    same call can be repeated until the run is done (a warning when the checkpoint is
    already past it). Without ``resume``, a ``checkpoint_dir`` that already holds
    checkpoints is a ``ValueError``. Data that yields no microbatch at all is a warning.

    The ledger records what the run used (``ledger.settings``), so
    ``RunRecord.from_run(plan, ledger)`` needs nothing else.
    """
    _check_train_arguments(
        model,
        batches,
        optimizer,
        plan,
        objective,
        {
            "scheduler": scheduler,
            "clip_grad_norm": clip_grad_norm,
            "max_updates": max_updates,
            "progress": progress,
            "forward": forward,
            "nonfinite": nonfinite,
            "scheduler_per": scheduler_per,
            "on_update": on_update,
            "on_oom": on_oom,
            "sync": sync,
        },
    )
    checkpoint.check_arguments(checkpoint_dir, checkpoint_every, resume)
    check_plan(plan, model)  # the same plan on every rank, and plan.data_parallel_size is D
    update_parameters(model, optimizer)  # the optimizer must hold some trainable parameter
    # Check precision and scaler before reading any data. fp16 without a scaler gets one
    # GradScaler for the whole run, so the scale and its growth count carry across windows.
    policy = precision_policy(precision, model_device(model))
    if scaler is None:
        scaler = resolve_scaler(policy, None)
    else:
        resolve_scaler(policy, scaler)  # wrong type or device raises; disabled under fp16 warns
    model.train()  # dropout on: a model left in eval() would otherwise train without it

    # What a resume must find unchanged besides the plan, model, optimizer and precision.
    fixed = {"clip_grad_norm": check_clip_grad_norm(clip_grad_norm), "scheduler_per": scheduler_per,
             "nonfinite": nonfinite}  # fmt: skip
    ckpt = checkpoint.Checkpointer(
        checkpoint_dir, checkpoint_every, resume, model=model, optimizer=optimizer,
        scheduler=scheduler, scaler=scaler, plan=plan, precision=precision, batches=batches,
        options=fixed,
    )  # fmt: skip
    try:  # the checkpoint directory stays this run's until it returns or raises
        ledger = ckpt.ledger  # restored from the checkpoint when resuming
        halvings = ckpt.halvings  # on_oom="shrink": how often every loader microbatch is cut in half
        settings = {"precision": precision, "scaler": scaler, "clip_grad_norm": clip_grad_norm,
                    "optimizer": optimizer, "unit": getattr(objective, "unit", None)}  # fmt: skip
        ledger.note_settings(**settings)
        total = _planned_windows(batches, plan)
        if max_updates is not None and total is not None:
            total = min(total, max_updates)
        with _progress(total, progress) as bar:
            bar.update(ledger.update_attempts)  # those of the run this one resumes
            # Under data parallelism every rank gets the same number of windows and of
            # microbatches per window, padded with zero-target microbatches where it has fewer.
            group = data_parallel_group(model)
            windows = aligned_windows(plan, batches, objective, group)
            for window in ckpt.windows(windows, max_updates):  # after those already trained on
                real = window.microbatches[: len(window.microbatches) - window.padding]
                # Only windows that every rank trains on are aligned: compare sizes there.
                peers = group if window.microbatches else None
                _note_microbatch_sizes([*real, *window.dropped], ledger.loader_batches, plan, ledger, peers)
                ledger.loader_batches += window.loader_batches
                if window.dropped:
                    counts = count_window(objective, window.dropped)
                    ledger.record_dropped(sum(count_examples(mb) for mb in window.dropped), sum(counts))
                if not window.microbatches:
                    continue

                def attempt(microbatches: list[Any], window_meter: Any) -> UpdateReport:
                    return train_window(
                        model,
                        microbatches,
                        optimizer,
                        objective,
                        scaler=scaler,
                        clip_grad_norm=clip_grad_norm,
                        scheduler=scheduler,
                        precision=precision,
                        meter=window_meter,
                        forward=forward,
                        nonfinite=nonfinite,
                        scheduler_per=scheduler_per,
                        sync=sync,
                        index=ledger.update_attempts,
                    )

                if on_oom == "shrink":
                    # Counts the padding among the (possibly halved) microbatches it ran.
                    report, halvings = train_window_shrinking(
                        attempt, window.microbatches, model, optimizer, meter, ledger, halvings
                    )
                else:
                    report = attempt(window.microbatches, meter)
                    report.padding_microbatches = window.padding
                ledger.record(report)
                ckpt.after_attempt(halvings)
                bar.update(1)
                bar.set_postfix(loss=f"{report.loss:.3f}", refresh=False)
                if on_update is not None:
                    on_update(report)
                if max_updates is not None and ledger.update_attempts >= max_updates:
                    break
        ledger.note_settings(**settings)  # the scaler's final scale
        if ledger.loader_batches == 0:
            warnings.warn(
                "batches yielded no microbatch: 0 update attempts were made (an empty loader, or "
                "an iterator that was already read to its end?)",
                UserWarning,
                stacklevel=2,
            )
        ckpt.finish(halvings)
    finally:
        ckpt.close()
    return ledger
