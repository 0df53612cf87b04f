"""The reference accumulation loop: one window, one update attempt.

The rule, in one line: every microbatch backpropagates
``loss_sum(microbatch) × D / count(window, all replicas)`` and the optimizer steps once
per window. ``accumulate`` does the backward passes; ``train_window`` adds the window
boundary (unscale, clip, step, update the scale, clear, schedule); ``train`` feeds it
windows from an iterable of microbatches and keeps the ledger.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor, nn

from . import distributed
from .ledger import Ledger, UpdateReport
from .objectives import Objective, count_window
from .plan import AccumulationPlan
from .precision import precision_policy, resolve_scaler

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
    labels = batch["labels"]
    return int(labels.shape[0]) if labels.dim() else 0


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
    total = distributed.global_count(sum(counts), replicas, device)
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
            loss = part.float() * (replicas / total)
            with _phase(meter, "backward", i):
                (scaler.scale(loss) if scaler is not None else loss).backward()
        loss_sum += part.detach().float()
        del output, part, loss  # nothing of this microbatch's graph survives the loop
    return Accumulated(counts, total, replicas, float(loss_sum), len(microbatches))


def grad_norm(parameters: Iterable[nn.Parameter], max_norm: float | None = None) -> float:
    """L2 norm of all gradients together; with ``max_norm``, also clip them to it.

    Returns the norm before clipping (``inf``/``nan`` when a gradient is non-finite).
    """
    params = [p for p in parameters if p.grad is not None]
    if not params:
        return 0.0
    if max_norm is not None:
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm))
    norms = torch.stack([torch.linalg.vector_norm(p.grad.detach().float()) for p in params])
    return float(torch.linalg.vector_norm(norms))


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
    divided by the window's unit count summed over replicas); then at the boundary:
    unscale once (fp16), measure and optionally clip the combined gradient, step (or skip
    when the gradient is non-finite or the window has no targets), update the scale,
    clear gradients, and advance the scheduler once per applied update
    (``scheduler_per="attempt"`` advances it on skipped attempts too).

    Without a scaler a non-finite gradient skips the step (``nonfinite="skip"``, the
    default) or raises ``FloatingPointError`` (``nonfinite="raise"``); the weights are
    never touched by it.
    """
    if clip_grad_norm is not None and not clip_grad_norm > 0:
        raise ValueError(f"clip_grad_norm must be positive or None, got {clip_grad_norm!r}")
    if nonfinite not in ("skip", "raise"):
        raise ValueError(f"nonfinite must be 'skip' or 'raise', got {nonfinite!r}")
    if scheduler_per not in ("applied", "attempt"):
        raise ValueError(f"scheduler_per must be 'applied' or 'attempt', got {scheduler_per!r}")
    policy = precision_policy(precision, model_device(model))
    scaler = resolve_scaler(policy, scaler)
    scale_before = float(scaler.get_scale()) if scaler is not None else None
    lr = _lr(optimizer)

    optimizer.zero_grad(set_to_none=True)
    acc = accumulate(
        model, window, objective, forward=forward, precision=precision, scaler=scaler, meter=meter
    )
    report = UpdateReport(
        index=index,
        applied=False,
        examples=sum(_examples(mb) for mb in window),
        targets=sum(acc.counts),
        global_targets=acc.global_count,
        microbatches=acc.backward_passes,
        backward_passes=acc.backward_passes,
        loss=acc.loss_sum / sum(acc.counts) if sum(acc.counts) else math.nan,
        loss_sum=acc.loss_sum,
        grad_norm=0.0,
        lr=lr,
        scale_before=scale_before,
        scale_after=scale_before,
        replicas=acc.replicas,
    )
    if acc.global_count == 0:
        report.skipped_reason = "no targets"
        return report

    with _phase(meter, "update"):
        if scaler is not None:
            scaler.unscale_(optimizer)  # once, after the last contribution
        report.grad_norm = grad_norm(model.parameters(), clip_grad_norm)
        finite = math.isfinite(report.grad_norm)
        if scaler is not None:
            scaler.step(optimizer)  # skips the step itself when it found inf/nan
            scaler.update()
            report.scale_after = float(scaler.get_scale())
        elif finite:
            optimizer.step()
        elif nonfinite == "raise":
            optimizer.zero_grad(set_to_none=True)
            raise FloatingPointError(
                f"non-finite gradient (norm {report.grad_norm}) in window {index}; "
                "the update was not applied"
            )
        optimizer.zero_grad(set_to_none=True)
    report.applied = finite
    report.skipped_reason = None if finite else "non-finite gradient"
    if scheduler is not None and (finite or scheduler_per == "attempt"):
        scheduler.step()
    return report


def _progress(total: int | None, enabled: bool) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, disable=not enabled, unit="update", desc="updates")


def _planned_windows(batches: Iterable[Any], plan: AccumulationPlan) -> int | None:
    try:
        n = len(batches)  # type: ignore[arg-type]
    except TypeError:
        return None
    full, rest = divmod(n, plan.accumulation_steps)
    return full + (1 if rest and plan.last_window == "update" else 0)


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
) -> Ledger:
    """Train on an iterable of microbatches, ``plan.accumulation_steps`` per window.

    Each window goes through ``train_window``. A short last window is trained on with
    ``plan.last_window == "update"`` (normalised by its own count) or counted as dropped
    with ``"drop"``. ``max_updates`` stops after that many update attempts (the rest of
    the iterable is not read). ``on_update`` is called with each report. Returns the
    ledger of this replica's counts.
    """
    if not isinstance(plan, AccumulationPlan):
        raise TypeError(f"plan must be an AccumulationPlan, got {type(plan).__name__}")
    if max_updates is not None and (isinstance(max_updates, bool) or max_updates < 1):
        raise ValueError(f"max_updates must be a positive int or None, got {max_updates!r}")
    precision_policy(precision, model_device(model))  # fail before reading any data
    if scaler is None and precision == "fp16":
        scaler = torch.amp.GradScaler(model_device(model).type)

    ledger = Ledger()
    total = _planned_windows(batches, plan)
    if max_updates is not None and total is not None:
        total = min(total, max_updates)
    with _progress(total, progress) as bar:
        for window in plan.windows(batches):
            ledger.loader_batches += len(window)
            if not window.complete and plan.last_window == "drop":
                counts = count_window(objective, window)
                ledger.record_dropped(sum(_examples(mb) for mb in window), sum(counts))
                continue
            report = train_window(
                model,
                window.microbatches,
                optimizer,
                objective,
                scaler=scaler,
                clip_grad_norm=clip_grad_norm,
                scheduler=scheduler,
                precision=precision,
                meter=meter,
                forward=forward,
                nonfinite=nonfinite,
                scheduler_per=scheduler_per,
                index=ledger.update_attempts,
            )
            ledger.record(report)
            bar.update(1)
            bar.set_postfix(loss=f"{report.loss:.3f}", refresh=False)
            if on_update is not None:
                on_update(report)
            if max_updates is not None and ledger.update_attempts >= max_updates:
                break
    return ledger
