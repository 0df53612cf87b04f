"""Turn captured windows into a :class:`~accumlab.hf.report.TrainerAuditReport`.

``diagnose(windows, trainer, objective=None)`` is the second half of the audit, shared by
:func:`accumlab.hf.audit_trainer` and a Trainer callback:

- ``windows``: :class:`~accumlab.hf.capture.CapturedWindow` objects, closed (each holds the
  gradient after the sync, before clipping), in the order they ran;
- ``trainer``: the Trainer they ran in; its ``model`` must still hold the weights the
  windows ran at (call it before the optimizer step of the last audited window);
- ``objective``: None to infer it from the model and labels (see
  :func:`accumlab.hf.reference.intended_objective`), or an accumlab ``Objective``
  (``NextTokenLoss()``, ``ExampleLoss()``, or one with the same two methods).

It is a collective under ``torch.distributed`` (every rank calls it, with its own windows)
and returns the same report on every rank. It leaves the model as it found it (gradients,
modes, buffers, RNG states: :func:`accumlab.hf.state.preserved_model`).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from typing import Any

import torch

from ..objectives import ExampleLoss, Objective
from .capture import CapturedWindow, trainable_parameters, unwrapped_model
from .fixes import fix_for, has_code
from .objectives import Intended, TokenLoss, intended_objective
from .reference import measure_window, user_intended
from .report import TrainerAuditReport
from .state import preserved_model
from .verdict import TRAINER_MISTAKES, blind_spots, name_causes

#: Relative error within which a full-precision job is ok (float32 gives about 1e-7 on the
#: tiny GPT-2; the bound leaves room for larger models' rounding).
FP32_TOLERANCE = 1e-4
#: The same under bf16/fp16 (autocast or half-precision weights): the reference runs under
#: the job's own autocast, but rows and padded microbatches round differently. Counts are
#: integers: a divisor off by even one target in the window is still named (the fitted
#: divisor's nearest candidate, see :func:`accumlab.hf.verdict.name_causes`).
MIXED_TOLERANCE = 3e-2
#: How far an example's logits in a packed row may differ from its logits alone (relative)
#: before the attention is said to reach its neighbours: float32 rounding gives about 1e-7;
#: under bf16/fp16 (Accelerate's autocast on the forward, or half weights) rounding alone
#: gives about 1e-3 (1.4e-3 measured on TRL's padding-free SFT of a tiny GPT-2).
LEAK_FP32 = 1e-3
LEAK_MIXED = 3e-2


def tolerances(trainer: Any) -> tuple[float, float]:
    """``(ok, match)``: the relative error a correct job stays within, and the residual
    within which a weighting pattern explains the gradient."""
    ok = MIXED_TOLERANCE if mixed_precision(trainer) else FP32_TOLERANCE
    return ok, max(10 * ok, 1e-3)


def mixed_precision(trainer: Any) -> bool:
    """True under bf16/fp16 autocast or with half-precision trainable weights."""
    args = getattr(trainer, "args", None)
    if getattr(args, "bf16", False) or getattr(args, "fp16", False):
        return True
    return any(
        p.dtype in (torch.float16, torch.bfloat16)
        for p in trainer.model.parameters()
        if p.requires_grad
    )


def autocast_context(trainer: Any) -> Any:
    """The job's autocast, as its ``compute_loss`` runs under it (a no-op in fp32)."""
    make = getattr(trainer, "compute_loss_context_manager", None) or getattr(
        trainer, "autocast_smart_context_manager", None
    )
    return make if callable(make) else contextlib.nullcontext


def own_loss(trainer: Any, model: torch.nn.Module) -> str | None:
    """Why the job's loss is not the cross-entropy its model and labels imply, or None: a
    ``loss_type`` of the Trainer's arguments other than plain negative log-likelihood (TRL's
    ``dft``), or a model that adds a router balance loss (a mixture of experts with
    ``output_router_logits``)."""
    loss_type = getattr(getattr(trainer, "args", None), "loss_type", None)
    if isinstance(loss_type, str) and loss_type != "nll":
        return f"the Trainer's loss_type is {loss_type!r}, its own loss"
    for m in (model, *model.modules()):
        config = getattr(m, "config", None)
        coef = float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0)
        if getattr(config, "output_router_logits", False) and coef > 0:
            return (
                f"{type(m).__name__} adds a router balance loss (router_aux_loss_coef {coef:g}) "
                "to its cross-entropy"
            )
    return None


def intended_for(
    trainer: Any, model: torch.nn.Module, batch: Any, objective: Objective | None
) -> Intended:
    """The objective the job means: the caller's, or the one its model and labels imply
    (with the Trainer's label smoothing); unknown when the loss is the job's own."""
    if objective is not None:
        return user_intended(objective)
    own = own_loss(trainer, model)
    if own is not None:
        return Intended(None, "unknown", own)
    smoothing = float(getattr(getattr(trainer, "args", None), "label_smoothing_factor", 0.0) or 0.0)
    return intended_objective(model, batch, smoothing)


def objective_kind(intended: Intended) -> str:
    """Which correct loss a fix writes out: ``"causal"``, ``"unshifted"`` (masked LM, token
    classification, seq2seq), ``"example"`` or ``"custom"``."""
    objective = intended.objective
    if isinstance(objective, TokenLoss):
        return "causal" if objective.shift else "unshifted"
    if isinstance(objective, ExampleLoss) and objective.name == "cross_entropy":
        return "example"
    return "custom"


def nonfinite(trainer: Any, windows: Sequence[CapturedWindow]) -> str | None:
    """Why the windows cannot be compared because a weight or a gradient is NaN or
    infinite (a plain message: no normalization explains it), or None."""
    model = unwrapped_model(trainer)
    bad = [name for name, p in trainable_parameters(model) if not bool(torch.isfinite(p).all())]
    if bad:
        return (
            f"the model's weights hold NaN or inf ({len(bad)} tensors, first {bad[0]}): every "
            "gradient is undefined; load or train finite weights first, then check the accumulation"
        )
    for w in windows:
        if any(g is not None and not bool(torch.isfinite(g).all()) for g in w.gradient or []):
            if any(_zero(mb.num_items_in_batch) for mb in w.microbatches):
                return (
                    "the audited window has no target (the Trainer's num_items_in_batch is 0), so "
                    "its loss divides 0 by 0 and the gradient is NaN: audit a window that has "
                    "targets"
                )
            return (
                "the window's gradient holds NaN or inf with finite weights (an overflow, or a "
                "loss "
                "divided by a count of zero): fix that first; the accumulation was not compared"
            )
    return None


def _zero(count: Any) -> bool:
    try:
        return (
            count is not None
            and float(count.float().sum() if isinstance(count, torch.Tensor) else count) == 0
        )
    except (TypeError, ValueError):
        return False


def no_targets(measures: Sequence[Any], kind: str) -> str:
    """The plain message for windows without a single target."""
    what = {
        "masked": "no token was masked (every label is -100): the MLM collator masked none",
        "causal": "every label is -100 after the shift",
    }.get(kind, "every label is -100")
    return (
        f"the audited window has no target ({what}), so every normalization gives the same zero "
        "gradient: audit a window that has targets"
    )


def diagnose(
    windows: Sequence[CapturedWindow], trainer: Any, *, objective: Objective | None = None
) -> TrainerAuditReport:
    """Measure every window against its reference and name the causes (see the module docstring)."""
    windows = [w for w in windows if w.microbatches]
    if not windows:
        return TrainerAuditReport.unchecked("no microbatch was trained in the audited windows")
    reason = nonfinite(trainer, windows)
    if reason is not None:
        return TrainerAuditReport.unchecked(reason)
    model = unwrapped_model(trainer)
    intended = intended_for(trainer, model, windows[0].microbatches[0].inputs, objective)
    if intended.objective is None:
        return TrainerAuditReport.unchecked(intended.described, unknown_objective=True)
    described = intended.described
    device = (
        getattr(getattr(trainer, "args", None), "device", None) or next(model.parameters()).device
    )
    ok_tol, match = tolerances(trainer)
    try:
        with preserved_model(model):
            leak = LEAK_MIXED if mixed_precision(trainer) else LEAK_FP32
            measures = [
                measure_window(model, w, intended, device, autocast_context(trainer), leak)
                for w in windows
            ]
    except (TypeError, ValueError, KeyError, IndexError, RuntimeError, AttributeError) as err:
        return TrainerAuditReport.unchecked(  # split invariance needs no reference: it takes over
            f"the reference (each example alone through {type(model).__name__}) cannot run on this "
            f"job ({type(err).__name__}: {err})",
            unknown_objective=True,
        )
    if all(m.targets == 0 for m in measures):
        return TrainerAuditReport.unchecked(no_targets(measures, intended.kind))
    empty = sum(m.targets == 0 for m in measures)
    measures = [m for m in measures if m.targets]
    mistakes: list[str] = []
    evidence: dict[str, str] = {}
    for m in measures:
        finding = name_causes(m, ok_tol=ok_tol, match=match)
        for name in finding.mistakes:
            evidence.setdefault(name, finding.evidence[name])
    mistakes = [k for k in TRAINER_MISTAKES if k in evidence]
    worst = max(measures, key=lambda m: -1.0 if math.isnan(m.relative_error) else m.relative_error)
    ok = not mistakes and all(m.relative_error <= ok_tol for m in measures)
    if mistakes == ["not_token_mean"]:  # the loss is not the audited one: check the property
        return TrainerAuditReport.unchecked(
            f"the gradient is no weighting of the {described} (scale {worst.scale:.4f}, relative "
            f"error {worst.relative_error:.1e}): the loss is the job's own",
            unknown_objective=True,
        )
    fix = fix_for(mistakes, trainer, model, objective_kind(intended), measures[0].ranks)
    notes = []
    if ok:
        for note in blind_spots(measures[0], ok_tol):
            notes.append(note)
    if empty:
        notes.append(f"{empty} audited window(s) had no target at all: left out")
    if any(m.replayed for m in measures):
        notes.append(
            "the job's steps draw random numbers (dropout): the reference replays its collated "
            "microbatches with the same masks, so padding and packing were checked by their "
            "counts only (turn dropout off to compare with each example in its own row)"
        )
    if mixed_precision(trainer):
        notes.append(
            f"mixed precision: the reference runs under the job's autocast; the relative error "
            f"is allowed {ok_tol:g} of rounding, the divisor is checked as an integer count"
        )
    return TrainerAuditReport(
        ok=ok,
        checked=True,
        mistakes=mistakes,
        scale=worst.scale,
        relative_error=worst.relative_error,
        fix=fix,
        fix_is_advice=bool(fix) and not has_code(fix),
        evidence=evidence,
        windows=measures,
        objective=described,
        tolerance=ok_tol,
        notes=notes,
    )


__all__ = [
    "FP32_TOLERANCE",
    "MIXED_TOLERANCE",
    "diagnose",
    "no_targets",
    "nonfinite",
    "own_loss",
    "tolerances",
]
