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

import math
from collections.abc import Sequence
from typing import Any

import torch

from ..objectives import ExampleLoss, NextTokenLoss, Objective
from .capture import CapturedWindow
from .fixes import fix_for
from .reference import intended_objective, measure_window
from .report import TrainerAuditReport
from .state import preserved_model
from .verdict import TRAINER_MISTAKES, blind_spots, name_causes

#: Relative error within which a full-precision job is ok (float32 gives about 1e-7 on the
#: tiny GPT-2; the bound leaves room for larger models' rounding).
FP32_TOLERANCE = 1e-4
#: The same under bf16/fp16 autocast, where the Trainer's forward runs in half precision
#: and the reference in the parameters' precision.
MIXED_TOLERANCE = 3e-2


def tolerances(trainer: Any) -> tuple[float, float]:
    """``(ok, match)``: the relative error a correct job stays within, and the residual
    within which a weighting pattern explains the gradient."""
    args = getattr(trainer, "args", None)
    mixed = bool(getattr(args, "bf16", False) or getattr(args, "fp16", False))
    ok = MIXED_TOLERANCE if mixed else FP32_TOLERANCE
    return ok, max(10 * ok, 1e-3)


def unwrapped_model(trainer: Any) -> torch.nn.Module:
    """The Trainer's model without DDP or compile wrappers."""
    model = trainer.model
    accelerator = getattr(trainer, "accelerator", None)
    return accelerator.unwrap_model(model) if accelerator is not None else model


def objective_kind(objective: Objective) -> str:
    """``"causal"`` (next-token, -100 ignored), ``"example"`` (cross-entropy per example)
    or ``"custom"``: which correct loss a fix writes out."""
    if isinstance(objective, NextTokenLoss) and objective.ignore_index == -100:
        return "causal"
    if isinstance(objective, ExampleLoss) and objective.name == "cross_entropy":
        return "example"
    return "custom"


def diagnose(
    windows: Sequence[CapturedWindow], trainer: Any, *, objective: Objective | None = None
) -> TrainerAuditReport:
    """Measure every window against its reference and name the causes (see the module docstring)."""
    windows = [w for w in windows if w.microbatches]
    if not windows:
        return TrainerAuditReport.unchecked("no microbatch was trained in the audited windows")
    model = unwrapped_model(trainer)
    labels = windows[0].microbatches[0].inputs.get("labels")
    if objective is None:
        objective, described = intended_objective(model, labels)
        if objective is None:
            return TrainerAuditReport.unchecked(described)
    else:
        described = f"{objective!r}: sum of its loss over the window's examples / its count"
    device = getattr(getattr(trainer, "args", None), "device", None) or next(model.parameters()).device
    ok_tol, match = tolerances(trainer)
    try:
        with preserved_model(model):
            measures = [measure_window(model, w, objective, device) for w in windows]
    except (TypeError, ValueError, KeyError) as err:
        return TrainerAuditReport.unchecked(
            f"the reference forward pass of {type(model).__name__} failed: {err}"
        )
    mistakes: list[str] = []
    evidence: dict[str, str] = {}
    for m in measures:
        finding = name_causes(m, ok_tol=ok_tol, match=match)
        for name in finding.mistakes:
            evidence.setdefault(name, finding.evidence[name])
    mistakes = [k for k in TRAINER_MISTAKES if k in evidence]
    worst = max(measures, key=lambda m: -1.0 if math.isnan(m.relative_error) else m.relative_error)
    ok = not mistakes and all(m.relative_error <= ok_tol for m in measures)
    fix, needs_new = fix_for(mistakes, trainer, model, objective_kind(objective), measures[0].ranks)
    notes = []
    if ok:
        for note in blind_spots(measures[0], ok_tol):
            notes.append(note)
    if any(m.targets == 0 for m in measures):
        notes.append("a window had no target at all: its reference is zero")
    return TrainerAuditReport(
        ok=ok,
        checked=True,
        mistakes=mistakes,
        scale=worst.scale,
        relative_error=worst.relative_error,
        fix=fix,
        fix_needs_new_trainer=needs_new,
        evidence=evidence,
        windows=measures,
        objective=described,
        tolerance=ok_tol,
        notes=notes,
    )


__all__ = ["FP32_TOLERANCE", "MIXED_TOLERANCE", "diagnose", "tolerances", "unwrapped_model"]
