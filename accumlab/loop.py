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
(check the hyper-parameters, unscale, check the gradient, clip, step, update the scale,
clear, schedule). What every window of a run shares is worked out once
(:func:`window_setup`) and handed to each. ``train`` is the driver above it
(``accumlab.driver``). This module imports only the core: copy it with ``objectives``,
``precision``, ``report``, ``parallel`` and ``validate``.
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
from .parallel import Replicas, gradient_sync
from .precision import (
    PrecisionPolicy,
    precision_policy,
    resolve_scaler,
    total_grad_norm,
    update_parameters,
)
from .report import NO_TARGETS, NONFINITE_GRADIENT, UNUSABLE_HYPERPARAMETER, UpdateReport
from .validate import (
    check_choice,
    check_methods,
    check_positive_number,
    outside_stacklevel,
    unusable_hyperparameter,
)

Forward = Callable[[nn.Module, Mapping[str, Tensor]], Any]
NOT_MODEL_INPUTS = frozenset({"labels", "example_ids"})
#: The modes of one window: a non-finite gradient is skipped or raises; the scheduler
#: steps per applied update or per attempt; gradients sync once per window or after
#: every backward pass.
NONFINITE = ("skip", "raise")
SCHEDULER_PER = ("applied", "attempt")
SYNC = ("window", "microbatch")
#: What to do with a scheduler whose ``step()`` needs an argument (``ReduceLROnPlateau``).
SCHEDULER_FIX = (
    "train and train_window call scheduler.step() with no argument after each update; "
    "step one that needs a metric yourself: pass scheduler=None and call its step after "
    "each update (under train: on_update=lambda report: plateau.step(report.loss))"
)


def default_forward(model: nn.Module, batch: Mapping[str, Tensor]) -> Any:
    """Call the model like a Hugging Face model: every entry but labels and example_ids
    as a keyword argument."""
    return model(**{k: v for k, v in batch.items() if k not in NOT_MODEL_INPUTS})


def to_device(batch: Mapping[str, Any], device: torch.device) -> dict[str, Any]:
    """Move every tensor of a batch to ``device`` (others are passed through)."""
    return {
        k: v.to(device, non_blocking=True) if isinstance(v, Tensor) else v
        for k, v in batch.items()
    }


def _phase(meter: Any, name: str, microbatch: int | None = None) -> Any:
    """``meter.phase(name, microbatch)`` (a ``MemoryMeter``, or anything with that method)."""
    return contextlib.nullcontext() if meter is None else meter.phase(name, microbatch)


@dataclass(frozen=True)
class WindowSetup:
    """What every window of a run shares, checked and derived once (:func:`window_setup`):
    the model's ``replicas`` (``D``, their group, the device), the precision ``policy``,
    the ``scaler`` the windows use (``None`` without one, or for a disabled one), the
    parameters an update steps (``stepped``), the model's trainable parameters the
    optimizer does not hold (``orphans``: each window clears their gradients) and the
    modes of a window. ``train`` makes one per run and hands it to every window; a call
    of ``train_window`` or ``accumulate`` without one makes its own."""

    replicas: Replicas
    policy: PrecisionPolicy
    scaler: torch.amp.GradScaler | None
    stepped: tuple[Tensor, ...]
    orphans: tuple[Tensor, ...]
    clip_grad_norm: float | None
    nonfinite: Literal["skip", "raise"]
    scheduler_per: Literal["applied", "attempt"]
    sync: Literal["window", "microbatch"]


def window_setup(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    precision: str = "fp32",
    scaler: torch.amp.GradScaler | None = None,
    clip_grad_norm: float | None = None,
    nonfinite: Literal["skip", "raise"] = "skip",
    scheduler_per: Literal["applied", "attempt"] = "applied",
    sync: Literal["window", "microbatch"] = "window",
) -> WindowSetup:
    """Check what the windows of a run share, and derive once what they need of it.

    The modes, each checked (a ``TypeError`` or ``ValueError`` naming it); the replicas
    (``parallel.Replicas.of``: ``ValueError`` for a model that is not wrapped while a
    process group of several ranks is active); the precision policy for their device
    (``precision.precision_policy``); the scaler (``precision.resolve_scaler``: with an
    ``optimizer``, fp16 without a scaler gets a new GradScaler, the run's); the
    parameters an update steps and the orphans (``precision.update_parameters``:
    ``ValueError`` when the optimizer holds none of the model's trainable parameters).
    Without an ``optimizer`` (``accumulate`` on its own) nothing is stepped and no scaler
    is made: the loss is scaled by the caller's, if any.
    """
    clip = check_clip_grad_norm(clip_grad_norm)
    check_choice("nonfinite", nonfinite, NONFINITE)
    check_choice("scheduler_per", scheduler_per, SCHEDULER_PER)
    check_choice("sync", sync, SYNC)
    replicas = Replicas.of(model)
    policy = precision_policy(precision, replicas.device)
    stepped: list[Tensor] = []
    orphans: list[Tensor] = []
    if optimizer is not None:
        stepped, orphans = update_parameters(model, optimizer)
    if optimizer is not None or scaler is not None:
        scaler = resolve_scaler(policy, scaler)
    return WindowSetup(
        replicas, policy, scaler, tuple(stepped), tuple(orphans), clip, nonfinite,
        scheduler_per, sync,
    )


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
    setup: WindowSetup | None = None,
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

    ``setup``: what the windows of a run share (:class:`WindowSetup`); ``train_window``
    passes its own, and ``precision``, ``scaler`` and ``sync`` are then read from it
    (leave them out). Without one they are checked and a setup is made for this call.
    """
    if setup is None:  # a call on its own checks its arguments and derives what it needs
        setup = _own_setup(model, precision=precision, scaler=scaler, sync=sync)
    microbatches = list(window)
    if not microbatches:
        raise ValueError("window is empty: it needs at least one microbatch")
    forward = forward or default_forward
    counts = count_window(objective, microbatches)
    replicas, scaler = setup.replicas, setup.scaler
    total = replicas.total(sum(counts))
    if total == 0:
        return Accumulated(counts, 0, replicas.size, 0.0, 0)

    loss_sum = torch.zeros((), dtype=torch.float32, device=replicas.device)
    last = len(microbatches) - 1
    for i, microbatch in enumerate(microbatches):
        microbatch = to_device(microbatch, replicas.device)
        with gradient_sync(model, enabled=setup.sync == "microbatch" or i == last):
            with _phase(meter, "forward", i), setup.policy.autocast():
                output = forward(model, microbatch)
                part = objective.loss_sum(output, microbatch)
            loss = upcast(part) * (replicas.size / total)  # float64 models keep float64
            with _phase(meter, "backward", i):
                (scaler.scale(loss) if scaler is not None else loss).backward()
        loss_sum = loss_sum + upcast(part.detach())
        del output, part, loss  # nothing of this microbatch's graph survives the loop
    return Accumulated(counts, total, replicas.size, float(loss_sum), len(microbatches))


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
    setup: WindowSetup | None = None,
) -> UpdateReport:
    """Exactly one update attempt from one window of microbatches.

    Clear the gradients; ``accumulate``; then at the boundary: check the optimizer's
    hyper-parameters as the scheduler left them, ``scaler.unscale_`` once, measure the
    total gradient norm (``precision.total_grad_norm``: finite exactly when every entry
    is, global over FSDP2's shards) and decide once for all data-parallel ranks whether
    it is finite; clip with ``clip_grad_norm``; step (``scaler.step`` or
    ``optimizer.step``); ``scaler.update``; clear; advance the scheduler once per applied
    update (``scheduler_per="applied"``) or per attempt (``"attempt"``).

    ``precision`` is ``"fp32"``, ``"bf16"`` or ``"fp16"`` (``accumlab.precision``). fp16
    needs a GradScaler; without one a scaler for this window alone is made (with a
    warning): pass the same scaler to every window (``train`` does). ``sync``: ``accumulate``.
    ``setup``: what the windows of a run share (:class:`WindowSetup`, from
    :func:`window_setup`), checked and derived once; ``train`` passes the run's, and
    ``scaler``, ``clip_grad_norm``, ``precision``, ``nonfinite``, ``scheduler_per`` and
    ``sync`` are then read from it (leave them out). Without one they are checked, with
    the scheduler (its ``step()`` must need no argument), and a setup is made for this call.

    Skipped attempts leave the weights, the optimizer and (by default) the scheduler as
    they were, with ``report.applied`` False: a window without targets; a hyper-parameter
    the update cannot use (``validate.unusable_hyperparameter``: not finite, or a learning
    rate below 0), found before the unscale, which leaves a scaler as it was; or a
    non-finite gradient. With a scaler, that skip still calls ``scaler.update()``, which
    backs the scale off (``report.scale_before``/``scale_after``). Without one, a
    non-finite gradient is skipped (``nonfinite="skip"``) or raises
    ``FloatingPointError`` (``"raise"``); an unusable hyper-parameter is skipped or raises
    ``ValueError``, with a scaler or without. Every data-parallel rank holds the same
    hyper-parameters (each steps the same attempts), so all of them skip it together.

    The update works on the optimizer's parameters; the model's trainable parameters it does
    not hold have their gradients cleared and are left out of the norm (one warning names
    them). Every gradient is cleared on the way out, also when an exception stops the
    window. Out of memory inside the step raises ``PartialUpdateError``.
    """
    if setup is None:  # a call on its own checks its arguments and derives what it needs
        setup = _own_setup(
            model, optimizer, scheduler, precision=precision, scaler=scaler,
            clip_grad_norm=clip_grad_norm, nonfinite=nonfinite, scheduler_per=scheduler_per,
            sync=sync,
        )
    scaler, stepped = setup.scaler, setup.stepped
    _clear_gradients(optimizer, setup.orphans)  # clear
    try:
        # accumulate: one backward per microbatch, by the rule above
        acc = accumulate(model, window, objective, forward=forward, meter=meter, setup=setup)
        report = _new_report(index, window, acc, optimizer, scaler)  # skipped: no targets
        if acc.global_count > 0:  # check the hyper-parameters, as the scheduler left them
            report.skipped_reason = _hyperparameter_problem(optimizer, index, setup.nonfinite)
        if report.skipped_reason is None:
            with _phase(meter, "update"):
                if scaler is not None:  # unscale, once, after the last contribution
                    scaler.unscale_(optimizer)
                # check: the norm is finite exactly when every entry is; one decision for
                # every data-parallel rank, so all of them step or skip together
                norm, report.grad_norm = total_grad_norm(stepped)
                report.applied = not setup.replicas.any(not math.isfinite(report.grad_norm))
                if report.applied and setup.clip_grad_norm is not None:  # clip (never an inf)
                    torch.nn.utils.clip_grads_with_norm_(stepped, setup.clip_grad_norm, norm)
                del norm  # nothing but the parameters' state outlives the update phase
                if report.applied:  # step
                    _step(optimizer, scaler, index)
                if scaler is not None:  # update the scale, backing off after a skip
                    _update_scale(scaler, optimizer, report)
                elif not report.applied and setup.nonfinite == "raise":
                    raise FloatingPointError(
                        f"non-finite gradient (norm {report.grad_norm}) in window {index}; "
                        "the update was not applied"
                    )
            report.skipped_reason = None if report.applied else NONFINITE_GRADIENT
    finally:
        _clear_gradients(optimizer, setup.orphans)  # clear, also on an error
    if scheduler is not None and (report.applied or setup.scheduler_per == "attempt"):
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


def _own_setup(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    *,
    precision: str,
    scaler: torch.amp.GradScaler | None,
    **modes: Any,
) -> WindowSetup:
    """The setup of a ``train_window`` or ``accumulate`` call made without one: the
    scheduler checked (its ``step()`` must need no argument), then :func:`window_setup`,
    with a warning when fp16 runs a window without the caller's scaler."""
    check_methods(
        "scheduler",
        scheduler,
        ("step()",),
        example="a torch.optim.lr_scheduler scheduler",
        none_ok=True,
        fix=SCHEDULER_FIX,
    )
    setup = window_setup(model, optimizer, precision=precision, scaler=scaler, **modes)
    if scaler is None and setup.scaler is not None:
        warnings.warn(
            "train_window(precision='fp16') without a scaler makes a GradScaler for this "
            "window alone, so its scale cannot adapt from window to window; create one "
            "torch.amp.GradScaler and pass it to every window (train() does this)",
            UserWarning,
            stacklevel=outside_stacklevel(),
        )
    return setup


def _hyperparameter_problem(
    optimizer: torch.optim.Optimizer, index: int, nonfinite: str
) -> str | None:
    """``None`` when the update can use every hyper-parameter of ``optimizer``; else the
    skipped reason, naming the first one it cannot use and the update (a ``ValueError``
    under ``nonfinite="raise"``)."""
    problem = unusable_hyperparameter(optimizer)
    if problem is None:
        return None
    reason = f"{UNUSABLE_HYPERPARAMETER} in update {index}: {problem}"
    if nonfinite == "raise":
        raise ValueError(
            f"{reason}; the update was not applied (set by a scheduler, or by hand?)"
        )
    return reason


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
        backward_passes=acc.backward_passes,
        loss=acc.loss_sum / local if local else math.nan,
        loss_sum=acc.loss_sum,
        grad_norm=0.0,
        lr=float(optimizer.param_groups[0]["lr"]),
        scale_before=scale,
        scale_after=scale,
        skipped_reason=NO_TARGETS,
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
    """``scaler.update()`` after the step; sets ``report.scale_after``.

    A skipped attempt backs the scale off also when only a peer's shard held the inf:
    ``scaler.unscale_`` records inf/nan in this rank's gradients only, and under FSDP2
    another rank's shard can hold the nan; every rank skips the step together, so each
    must back off its scale too, or the ranks' scales part.
    """
    if not report.applied and report.data_parallel_size > 1:
        # GradScaler keeps its per-optimizer inf flags in a private dict; update() reads
        # them (torch's own sharded scaler all-reduces the same entries).
        state = scaler._per_optimizer_states.get(id(optimizer), {})
        for found_inf in state.get("found_inf_per_device", {}).values():
            found_inf.fill_(1.0)
    scaler.update()
    report.scale_after = float(scaler.get_scale())
    if not report.applied and not report.scale_after < report.scale_before:  # type: ignore[operator]
        warnings.warn(
            f"window {report.index}: the gradient was non-finite only after unscaling "
            f"(scale {report.scale_before:g}); the update was skipped but the GradScaler "
            "did not reduce its scale",
            RuntimeWarning,
            stacklevel=outside_stacklevel(),
        )
