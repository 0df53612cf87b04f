"""The reference accumulation loop: one window, one update attempt.

The rule, in one line (its home, with docs/ARCHITECTURE.md; other modules point here):
every microbatch backpropagates ``loss_sum(microbatch) × D / count(window, all replicas)``
and the optimizer steps once per window. ``loss_sum`` is the sum of the microbatch's
per-unit losses (tokens for ``NextTokenLoss``, examples for ``ExampleLoss``);
``count(window, all replicas)`` is the window's units summed over the ``D``
data-parallel replicas, counted on the CPU before any forward pass; the ``× D`` cancels
the average DDP and FSDP2 take over the replicas. The gradient is then the full batch's,
whatever the split into microbatches and replicas, and every unit weighs the same. AMP,
DDP, OOM shrinking and short last windows all keep this rule.

``accumulate`` does the backward passes; ``train_window`` adds the window boundary
(unscale, check, clip, step, update the scale, clear, schedule). ``train`` is the driver
above it (``accumlab.driver``). This module imports only the core: copy it with
``objectives``, ``precision``, ``report``, ``parallel`` and ``validate``.
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

from .objectives import Objective, count_examples, count_window, upcast
from .parallel import (
    any_rank,
    check_replicas,
    data_parallel_group,
    global_count,
    gradient_sync,
    replicas_of,
)
from .precision import (
    PrecisionPolicy,
    mark_skipped,
    precision_policy,
    resolve_scaler,
    total_grad_norm,
    update_parameters,
)
from .report import UpdateReport
from .validate import check_choice, check_positive_number

Forward = Callable[[nn.Module, Mapping[str, Tensor]], Any]
NOT_MODEL_INPUTS = frozenset({"labels", "example_ids"})
#: The modes of one window: a non-finite gradient is skipped or raises; the scheduler
#: steps per applied update or per attempt; gradients sync once per window or after
#: every backward pass.
NONFINITE = ("skip", "raise")
SCHEDULER_PER = ("applied", "attempt")
SYNC = ("window", "microbatch")


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
    """``meter.phase(name, microbatch)`` (a ``MemoryMeter``, or anything with that method)."""
    return contextlib.nullcontext() if meter is None else meter.phase(name, microbatch)


@dataclass
class Accumulated:
    """What ``accumulate`` leaves besides the gradients in ``.grad``: the per-microbatch
    unit counts, their sum over the ``data_parallel_size`` replicas, the loss sum."""

    counts: list[int]
    global_count: int
    data_parallel_size: int
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
    sync: Literal["window", "microbatch"] = "window",
) -> Accumulated:
    """Backpropagate one window into ``.grad`` (added to what is there; clear it first).

    Each microbatch follows the rule above; its denominator, ``global_count``, is the
    window's unit count summed over the ``D`` replicas, counted on CPU before any forward
    pass. ``sync="window"`` syncs a DDP/FSDP2 model on the last microbatch only:
    least traffic, but FSDP2 holds full unsharded gradients all window; ``"microbatch"``
    syncs every backward, so FSDP2 keeps only its shard (pick it when full gradients do
    not fit; under DDP it only adds traffic). With a scaler each loss is multiplied by the
    window's one scale. No graph, output or loss tensor outlives its microbatch. A window
    whose global count is zero runs no forward.
    """
    check_choice("sync", sync, SYNC)
    microbatches = list(window)
    if not microbatches:
        raise ValueError("window is empty: it needs at least one microbatch")
    forward = forward or default_forward
    counts = count_window(objective, microbatches)
    device = model_device(model)
    policy = precision_policy(precision, device)
    d = replicas_of(model)
    total = global_count(sum(counts), d, device, data_parallel_group(model))
    if total == 0:
        return Accumulated(counts, 0, d, 0.0, 0)

    loss_sum = torch.zeros((), dtype=torch.float32, device=device)
    last = len(microbatches) - 1
    for i, microbatch in enumerate(microbatches):
        microbatch = to_device(microbatch, device)
        with gradient_sync(model, enabled=sync == "microbatch" or i == last):
            with _phase(meter, "forward", i), policy.autocast():
                output = forward(model, microbatch)
                part = objective.loss_sum(output, microbatch)
            loss = upcast(part) * (d / total)  # float64 models keep float64
            with _phase(meter, "backward", i):
                (scaler.scale(loss) if scaler is not None else loss).backward()
        loss_sum = loss_sum + upcast(part.detach())
        del output, part, loss  # nothing of this microbatch's graph survives the loop
    return Accumulated(counts, total, d, float(loss_sum), len(microbatches))


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
    sync: Literal["window", "microbatch"] = "window",
    index: int = 0,
) -> UpdateReport:
    """Exactly one update attempt from one window of microbatches.

    Clear the gradients; ``accumulate``; then at the boundary: ``scaler.unscale_`` once,
    measure the total gradient norm (``precision.total_grad_norm``: finite exactly when
    every entry is, global over FSDP2's shards) and decide once for all data-parallel
    ranks whether it is finite; clip with ``clip_grad_norm``; step (``scaler.step`` or
    ``optimizer.step``); ``scaler.update``; clear; advance the scheduler once per applied
    update (``scheduler_per="applied"``) or per attempt (``"attempt"``).

    ``precision`` is ``"fp32"``, ``"bf16"`` or ``"fp16"`` (``accumlab.precision``). fp16
    needs a GradScaler; without one a scaler for this window alone is made (with a
    warning): pass the same scaler to every window (``train`` does). ``sync``: ``accumulate``.

    Skipped attempts leave the weights, the optimizer and (by default) the scheduler as
    they were, with ``report.applied`` False: a window without targets, or a non-finite
    gradient. With a scaler, a skip still calls ``scaler.update()``, which backs the scale
    off (``report.scale_before``/``scale_after``). Without one, a non-finite gradient is
    skipped (``nonfinite="skip"``) or raises ``FloatingPointError`` (``"raise"``).

    The update works on the optimizer's parameters; the model's trainable parameters it does
    not hold have their gradients cleared and are left out of the norm (one warning names
    them). Every gradient is cleared on the way out, also when an exception stops the
    window. Out of memory inside the step raises ``PartialUpdateError``.
    """
    _check_window(model, clip_grad_norm, nonfinite, scheduler_per)
    stepped, orphans = update_parameters(model, optimizer)  # raises before any forward
    scaler = _window_scaler(precision_policy(precision, model_device(model)), scaler)
    _clear_gradients(optimizer, orphans)  # clear
    try:
        # accumulate: one backward per microbatch, by the rule above
        acc = accumulate(
            model,
            window,
            objective,
            forward=forward,
            precision=precision,
            scaler=scaler,
            meter=meter,
            sync=sync,
        )
        report = _new_report(index, window, acc, optimizer, scaler)
        if acc.global_count > 0:
            with _phase(meter, "update"):
                if scaler is not None:  # unscale, once, after the last contribution
                    scaler.unscale_(optimizer)
                # check: the norm is finite exactly when every entry is; one decision for
                # every data-parallel rank, so all of them step or skip together
                norm, report.grad_norm = total_grad_norm(stepped)
                nonfinite_somewhere = not math.isfinite(report.grad_norm)
                report.applied = not any_rank(nonfinite_somewhere, data_parallel_group(model))
                if report.applied and clip_grad_norm is not None:  # clip (never an inf)
                    torch.nn.utils.clip_grads_with_norm_(stepped, clip_grad_norm, norm)
                del norm  # nothing but the parameters' state outlives the update phase
                if report.applied:  # step
                    _step(optimizer, scaler, index)
                if scaler is not None:  # update the scale, backing off after a skip
                    _update_scale(scaler, optimizer, report)
                elif not report.applied and nonfinite == "raise":
                    raise FloatingPointError(
                        f"non-finite gradient (norm {report.grad_norm}) in window {index}; "
                        "the update was not applied"
                    )
            report.skipped_reason = None if report.applied else "non-finite gradient"
    finally:
        _clear_gradients(optimizer, orphans)  # clear, also on an error
    if scheduler is not None and (report.applied or scheduler_per == "attempt"):
        scheduler.step()  # schedule
    return report


def grad_norm(parameters: Iterable[nn.Parameter]) -> float:
    """L2 norm of all gradients together (``precision.total_grad_norm``, as a float)."""
    return total_grad_norm(parameters)[1]


class PartialUpdateError(torch.OutOfMemoryError):
    """Out of memory inside ``optimizer.step()``: some parameters and their optimizer
    state were updated and others not. Neither a retry nor going on is sound: restore
    the last checkpoint."""


def check_clip_grad_norm(clip_grad_norm: object) -> float | None:
    """``clip_grad_norm`` as a float (the largest L2 norm of the combined, unscaled
    gradient), or ``None`` (no clipping); ``train`` and ``train_window`` check it here."""
    return check_positive_number(
        "clip_grad_norm",
        clip_grad_norm,
        meaning="the largest L2 norm of the combined gradient",
        none_means="no clipping",
    )


def _check_window(
    model: nn.Module, clip_grad_norm: float | None, nonfinite: str, scheduler_per: str
) -> None:
    """Check ``train_window``'s arguments (the optimizer: ``update_parameters``; ``sync``
    and ``precision``: ``accumulate``)."""
    check_clip_grad_norm(clip_grad_norm)
    check_choice("nonfinite", nonfinite, NONFINITE)
    check_choice("scheduler_per", scheduler_per, SCHEDULER_PER)
    check_replicas(model)  # a plain model in a multi-rank group is an error


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
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler | None,
) -> UpdateReport:
    """The report of a window before its update: counts and loss, nothing applied yet."""
    local = sum(acc.counts)
    scale = float(scaler.get_scale()) if scaler is not None else None
    return UpdateReport(
        index=index,
        applied=False,
        examples=sum(count_examples(mb) for mb in window),
        targets=local,
        global_targets=acc.global_count,
        microbatches=acc.backward_passes,
        backward_passes=acc.backward_passes,
        loss=acc.loss_sum / local if local else math.nan,
        loss_sum=acc.loss_sum,
        grad_norm=0.0,
        lr=float(optimizer.param_groups[0]["lr"]),
        scale_before=scale,
        scale_after=scale,
        skipped_reason="no targets",
        data_parallel_size=acc.data_parallel_size,
    )


def _step(
    optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None, index: int
) -> None:
    """Step with the scaler or the optimizer; out of memory there raises ``PartialUpdateError``."""
    try:
        scaler.step(optimizer) if scaler is not None else optimizer.step()
    except torch.OutOfMemoryError as exc:
        raise PartialUpdateError(
            f"window {index}: the update itself ran out of memory, inside optimizer.step(), "
            "so the update was partly applied (some parameters and their optimizer state "
            "were updated, others not) and the weights and the optimizer state are now "
            "inconsistent. Restore the last checkpoint rather than going on; a smaller "
            "microbatch cannot help, a lighter optimizer or sharded or offloaded optimizer "
            f"state can. The error was: {exc}"
        ) from exc


def _update_scale(
    scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer, report: UpdateReport
) -> None:
    """``scaler.update()`` after the step, backing off after a skipped attempt also when
    only a peer's shard held the inf; sets ``report.scale_after``."""
    if not report.applied and report.data_parallel_size > 1:
        mark_skipped(scaler, optimizer)  # the inf may be in a peer's shard only
    scaler.update()
    report.scale_after = float(scaler.get_scale())
    if not report.applied and not report.scale_after < report.scale_before:  # type: ignore[operator]
        warnings.warn(
            f"window {report.index}: the gradient was non-finite only after unscaling "
            f"(scale {report.scale_before:g}); the update was skipped but the GradScaler "
            "did not reduce its scale",
            RuntimeWarning,
            stacklevel=3,
        )
