"""The reference accumulation loop: one window, one update attempt.

The rule, in one line: every microbatch backpropagates
``loss_sum(microbatch) × D / count(window, all replicas)`` and the optimizer steps once
per window. ``accumulate`` does the backward passes; ``train_window`` adds the window
boundary (unscale, clip, step, update the scale, clear, schedule). ``train``, which
feeds it windows from an iterable of microbatches and keeps the ledger, is the driver
above it, in ``accumlab.driver``.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor, nn

from . import distributed
from .ledger import UpdateReport
from .objectives import Objective, count_window, upcast
from .oom import PartialUpdateError
from .precision import (
    PrecisionPolicy,
    mark_skipped,
    precision_policy,
    resolve_scaler,
    total_grad_norm,
    update_parameters,
)

Forward = Callable[[nn.Module, Mapping[str, Tensor]], Any]
NOT_MODEL_INPUTS = frozenset({"labels", "example_ids"})


def default_forward(model: nn.Module, batch: Mapping[str, Tensor]) -> Any:
    """Call the model like a Hugging Face model: every entry but labels and example_ids
    as a keyword argument."""
    return model(**{k: v for k, v in batch.items() if k not in NOT_MODEL_INPUTS})


def model_device(model: nn.Module) -> torch.device:
    """The device of the model's first parameter (CPU for a parameterless model)."""
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def to_device(batch: Mapping[str, Any], device: torch.device) -> dict[str, Any]:
    """Move every tensor of a batch to ``device`` (others are passed through)."""
    return {
        k: v.to(device, non_blocking=True) if isinstance(v, Tensor) else v
        for k, v in batch.items()
    }


def _phase(meter: Any, name: str, microbatch: int | None = None) -> Any:
    return contextlib.nullcontext() if meter is None else meter.phase(name, microbatch)


def _examples(batch: Mapping[str, Tensor]) -> int:
    return distributed.count_examples(batch)  # rows, less data-parallel padding rows


@dataclass
class Accumulated:
    """What ``accumulate`` leaves besides the gradients in ``.grad``: counts and loss sum."""

    counts: list[int]
    global_count: int
    replicas: int
    loss_sum: float
    backward_passes: int


def accumulate(
    model: nn.Module,
    window: Sequence[Mapping[str, Tensor]],
    objective: Objective,
    *,
    forward: Forward | None = None,
    precision: str = "fp32",
    scaler: torch.amp.GradScaler | None = None,
    meter: Any = None,
) -> Accumulated:
    """Backpropagate one window into ``.grad`` (added to what is there; clear it first).

    Each microbatch backpropagates ``loss_sum × D / global_count`` where ``global_count``
    is the window's unit count summed over the ``D`` replicas, counted on CPU before any
    forward pass. All but the last microbatch run forward and backward without gradient
    synchronization, so a DDP/FSDP2 model syncs once per window. With a scaler, each
    loss is multiplied by the scale, which is the same for the whole window. No graph,
    output or loss tensor outlives its microbatch. A window whose global count is zero
    runs no forward pass at all.
    """
    microbatches = list(window)
    if not microbatches:
        raise ValueError("window is empty: it needs at least one microbatch")
    forward = forward or default_forward
    counts = count_window(objective, microbatches)
    device = model_device(model)
    policy = precision_policy(precision, device)
    replicas = distributed.replicas_of(model)
    group = distributed.data_parallel_group(model)
    total = distributed.global_count(sum(counts), replicas, device, group)
    if total == 0:
        return Accumulated(counts, 0, replicas, 0.0, 0)

    loss_sum = torch.zeros((), dtype=torch.float32, device=device)
    last = len(microbatches) - 1
    for i, microbatch in enumerate(microbatches):
        microbatch = to_device(microbatch, device)
        with distributed.gradient_sync(model, enabled=i == last):
            with _phase(meter, "forward", i), policy.autocast():
                output = forward(model, microbatch)
                part = objective.loss_sum(output, microbatch)
            loss = upcast(part) * (replicas / total)  # float64 models keep float64
            with _phase(meter, "backward", i):
                (scaler.scale(loss) if scaler is not None else loss).backward()
        loss_sum = loss_sum + upcast(part.detach())  # promotes to float64 for float64 models
        del output, part, loss  # nothing of this microbatch's graph survives the loop
    return Accumulated(counts, total, replicas, float(loss_sum), len(microbatches))


def grad_norm(parameters: Iterable[nn.Parameter]) -> float:
    """L2 norm of all gradients together; finite exactly when every entry is (a float64
    fallback catches the overflow of large finite entries; see
    ``precision.total_grad_norm``). A collective for FSDP2's sharded gradients."""
    return float(total_grad_norm(parameters))


def _lr(optimizer: torch.optim.Optimizer) -> float:
    return float(optimizer.param_groups[0]["lr"])


def train_window(
    model: nn.Module,
    window: Sequence[Mapping[str, Tensor]],
    optimizer: torch.optim.Optimizer,
    objective: Objective,
    *,
    scaler: torch.amp.GradScaler | None = None,
    clip_grad_norm: float | None = None,
    scheduler: Any = None,
    precision: str = "fp32",
    meter: Any = None,
    forward: Forward | None = None,
    nonfinite: Literal["skip", "raise"] = "skip",
    scheduler_per: Literal["applied", "attempt"] = "applied",
    index: int = 0,
) -> UpdateReport:
    """Exactly one update attempt from one window of microbatches.

    Order: clear gradients; ``accumulate`` (one backward pass per microbatch, each loss
    divided by the window's unit count summed over replicas and, with a scaler, multiplied
    by the scale, which is read when the window starts and is the same for all of its
    microbatches); then at the boundary: ``scaler.unscale_`` once, after the last
    contribution; check every gradient tensor for inf/nan; measure and, with
    ``clip_grad_norm``, clip the combined unscaled gradient; ``scaler.step`` (or
    ``optimizer.step`` without a scaler); ``scaler.update``; clear gradients; advance the
    scheduler.

    ``precision`` is ``"fp32"``, ``"bf16"`` or ``"fp16"`` (see ``accumlab.precision``):
    bf16 and fp16 run the forward under ``torch.autocast`` for the model's device type.
    fp16 needs a ``torch.amp.GradScaler`` for that device; with ``scaler=None`` one is
    created for this window alone (with a warning), so a caller running many windows
    passes the same scaler to each (``train`` does) for the scale to carry over.

    Skipped attempts. An attempt is skipped, ``report.applied`` is False and the weights,
    the optimizer state and the scheduler are left as they were, when the window has no
    targets or when any gradient is non-finite after unscaling. The check is the total
    gradient norm, computed once (``precision.total_grad_norm``: float64 where float32
    overflows, so it is finite exactly when every entry is) and reused for clipping; it
    does not trust the return value of ``scaler.step`` (``None`` whether or not the
    optimizer ran). Under data parallelism the decision is taken once for all replicas
    (FSDP2's norm covers every shard, and one all-reduce over the data-parallel group
    settles the rest), so every rank applies or skips together. With a scaler a skipped attempt still
    calls ``scaler.update()``, which multiplies the scale by its backoff factor;
    ``report.scale_before`` and ``report.scale_after`` show it. Without a scaler (fp32,
    bf16, or fp16 with a disabled scaler) a non-finite gradient skips the update
    (``nonfinite="skip"``, the default) or raises ``FloatingPointError`` after clearing
    the gradients (``nonfinite="raise"``); with a scaler, skipping is the scaler's normal
    way of finding its scale, so ``nonfinite`` does not apply.

    The scheduler advances once per applied update (``scheduler_per="applied"``, the
    default: the schedule counts updates that changed the weights, so a skipped attempt
    does not shift it), or once per attempt, skipped or not (``scheduler_per="attempt"``,
    the choice of loops that step the scheduler unconditionally).

    The parameters. The update works on the parameters the optimizer holds. The model's
    trainable parameters it does not hold get their gradients cleared every window and
    are left out of the norm, the clipping and the check (one warning names them); an
    optimizer holding none of them, or a model with none, is a ``ValueError`` before any
    forward pass. Every gradient is cleared on the way out, also when an exception or a
    ``KeyboardInterrupt`` stops the window half way. Out of memory inside
    ``optimizer.step`` raises ``accumlab.oom.PartialUpdateError`` (a
    ``torch.OutOfMemoryError``): the update was partly applied, restore a checkpoint.
    """
    if clip_grad_norm is not None and not clip_grad_norm > 0:
        raise ValueError(f"clip_grad_norm must be positive or None, got {clip_grad_norm!r}")
    if nonfinite not in ("skip", "raise"):
        raise ValueError(f"nonfinite must be 'skip' or 'raise', got {nonfinite!r}")
    if scheduler_per not in ("applied", "attempt"):
        raise ValueError(f"scheduler_per must be 'applied' or 'attempt', got {scheduler_per!r}")
    distributed.check_replicas(model)  # a plain model in a multi-rank group is an error
    stepped, orphans = update_parameters(model, optimizer)  # raises before any forward
    scaler = _window_scaler(precision_policy(precision, model_device(model)), scaler)
    scale_before = float(scaler.get_scale()) if scaler is not None else None
    lr = _lr(optimizer)

    _clear_gradients(optimizer, orphans)
    try:
        acc = accumulate(
            model, window, objective, forward=forward, precision=precision, scaler=scaler,
            meter=meter,
        )  # fmt: skip
        report = _new_report(index, window, acc, lr, scale_before)
        if acc.global_count == 0:
            report.skipped_reason = "no targets"
            if scheduler is not None and scheduler_per == "attempt":
                scheduler.step()  # an attempt, skipped or not
            return report
        with _phase(meter, "update"):
            report.applied = _update(
                model, optimizer, stepped, scaler, clip_grad_norm, nonfinite, report
            )
    finally:
        # Also on an error or KeyboardInterrupt: a caller who catches it and goes on must
        # not add this window's partial gradients to the next one.
        _clear_gradients(optimizer, orphans)
    report.skipped_reason = None if report.applied else "non-finite gradient"
    if scheduler is not None and (report.applied or scheduler_per == "attempt"):
        scheduler.step()
    return report


def _window_scaler(
    policy: PrecisionPolicy, scaler: torch.amp.GradScaler | None
) -> torch.amp.GradScaler | None:
    """``resolve_scaler``, with a warning when fp16 runs without the caller's scaler."""
    if scaler is None and policy.needs_scaler:
        warnings.warn(
            "train_window(precision='fp16') without a scaler makes a GradScaler for this "
            "window alone, so its scale cannot adapt from window to window; create one "
            "torch.amp.GradScaler and pass it to every window (train() does this)",
            UserWarning,
            stacklevel=3,
        )
    return resolve_scaler(policy, scaler)


def _clear_gradients(optimizer: torch.optim.Optimizer, orphans: Sequence[Tensor]) -> None:
    """Set every gradient the next window could see to None: the optimizer's parameters'
    and those of the model's trainable parameters it does not hold (``orphans``)."""
    optimizer.zero_grad(set_to_none=True)
    for p in orphans:
        p.grad = None


def _new_report(
    index: int,
    window: Sequence[Mapping[str, Tensor]],
    acc: Accumulated,
    lr: float,
    scale: float | None,
) -> UpdateReport:
    """The report of a window before its update: counts and loss, nothing applied yet."""
    local = sum(acc.counts)
    return UpdateReport(
        index=index,
        applied=False,
        examples=sum(_examples(mb) for mb in window),
        targets=local,
        global_targets=acc.global_count,
        microbatches=acc.backward_passes,
        backward_passes=acc.backward_passes,
        loss=acc.loss_sum / local if local else math.nan,
        loss_sum=acc.loss_sum,
        grad_norm=0.0,
        lr=lr,
        scale_before=scale,
        scale_after=scale,
        replicas=acc.replicas,
    )


def _update(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    params: Sequence[Tensor],
    scaler: torch.amp.GradScaler | None,
    clip_grad_norm: float | None,
    nonfinite: str,
    report: UpdateReport,
) -> bool:
    """The window boundary: unscale, measure, decide, clip, step, update the scale.

    Returns whether the update was applied; sets ``report.grad_norm`` and
    ``report.scale_after``. The norm of ``params``' gradients is computed once
    (``total_grad_norm``: finite exactly when every entry is, and global over FSDP2's
    shards) and reused for clipping. The decision is then made the same on every
    data-parallel rank (one small all-reduce when D > 1), so all of them step or skip
    together and none enters the step's collectives alone.
    """
    if scaler is not None:
        scaler.unscale_(optimizer)  # once, after the last contribution
    norm = total_grad_norm(params)
    report.grad_norm = float(norm)
    nonfinite_anywhere = distributed.any_rank(
        not math.isfinite(report.grad_norm), distributed.data_parallel_group(model)
    )
    finite = not nonfinite_anywhere
    if finite and clip_grad_norm is not None:  # clipping inf/nan would make every entry nan
        torch.nn.utils.clip_grads_with_norm_(params, clip_grad_norm, norm)
    if scaler is not None:
        # A finite unscaled gradient was finite when scaled, so the scaler agrees and
        # steps; a non-finite one is never handed to scaler.step.
        if finite:
            _step(lambda: scaler.step(optimizer), report.index)
        elif report.replicas > 1:
            mark_skipped(scaler, optimizer)  # the inf may be in a peer's shard only
        scaler.update()  # backs the scale off after a skipped attempt
        report.scale_after = float(scaler.get_scale())
        if not finite and not report.scale_after < report.scale_before:  # type: ignore[operator]
            warnings.warn(
                f"window {report.index}: the gradient was non-finite only after unscaling "
                f"(scale {report.scale_before:g}); the update was skipped but the GradScaler "
                "did not reduce its scale",
                RuntimeWarning,
                stacklevel=3,
            )
    elif finite:
        _step(optimizer.step, report.index)
    elif nonfinite == "raise":
        raise FloatingPointError(
            f"non-finite gradient (norm {report.grad_norm}) in window {report.index}; "
            "the update was not applied"
        )
    return finite


def _step(step: Callable[[], Any], index: int) -> None:
    """Run ``optimizer.step`` (or ``scaler.step``); out of memory there is not retryable."""
    try:
        step()
    except torch.OutOfMemoryError as exc:
        raise PartialUpdateError(
            f"window {index}: the update itself ran out of memory, inside optimizer.step(), "
            "so the update was partly applied (some parameters and their optimizer state "
            "were updated, others not) and the weights and the optimizer state are now "
            "inconsistent. Restore the last checkpoint rather than going on; a smaller "
            "microbatch cannot help, a lighter optimizer or sharded or offloaded optimizer "
            f"state can. The error was: {exc}"
        ) from exc
