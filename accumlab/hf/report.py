"""``TrainerAuditReport``: what :func:`accumlab.hf.audit_trainer` measured and concluded."""

from __future__ import annotations

import math
import textwrap
from dataclasses import dataclass, field
from typing import Any

from .invariance import Invariance
from .logged import LoggedNumber
from .reference import WindowMeasure
from .verdict import CAUSES, TRAINER_MISTAKES

#: Said in every report: what the audit does not look at.
TRAINER_NOT_CHECKED = (
    "clipping, the optimizer, the learning-rate schedule and loss scaling (the gradient is "
    "taken after the sync, before clipping); windows after the audited ones (the weights are "
    "held at their starting values while the audited windows run)"
)


@dataclass
class TrainerAuditReport:
    """The verdict on a Trainer's accumulation, with its measured evidence.

    ``ok``: True only when every audited window's gradient matched its reference within
    ``tolerance`` (relative). ``checked``: False when the audit could not measure (then
    ``ok`` is False and ``reason`` says why). ``mistakes``: names from
    :data:`accumlab.hf.TRAINER_MISTAKES`, in that order; ``evidence[name]``: the numbers
    behind each. ``scale``: least-squares ``a`` in ``g ≈ a·g_ref`` (1 when right);
    ``relative_error``: ``‖g − g_ref‖ / ‖g_ref‖`` over all trainable parameters (both from the
    window with the largest error). ``fix``: Python to paste (empty when ok);
    ``fix_is_advice``: the fix says what to change in comments only (a loss the audit
    cannot write for you), no code to paste. ``invariance``: the split-invariance
    results when the objective is not one the audit knows. ``windows``: per-window
    measurements. ``objective``: the reference objective.
    ``notes``: what this data cannot tell apart from a correct job, and how the run was
    set up. ``not_checked``: what the audit does not look at. ``logged``: the numbers the
    Trainer logs for each audited window (``loss``, ``grad_norm``), judged apart from the
    update (:mod:`accumlab.hf.logged`); ``logged_ok`` is False when one is wrong in a way
    the update is not ("update ok; logged loss x A"), and only those are printed.
    """

    ok: bool
    checked: bool
    mistakes: list[str] = field(default_factory=list)
    scale: float = math.nan
    relative_error: float = math.nan
    fix: str = ""
    fix_is_advice: bool = False
    evidence: dict[str, str] = field(default_factory=dict)
    windows: list[WindowMeasure] = field(default_factory=list)
    objective: str = ""
    tolerance: float = math.nan
    reason: str = ""
    notes: list[str] = field(default_factory=list)
    not_checked: str = TRAINER_NOT_CHECKED
    unknown_objective: bool = False
    invariance: list[Invariance] = field(default_factory=list)
    logged: list[LoggedNumber] = field(default_factory=list)

    @property
    def logged_ok(self) -> bool:
        """No logged number is wrong apart from the update (see :mod:`accumlab.hf.logged`)."""
        return not any(n.apart for n in self.logged)

    @property
    def accumulation_steps(self) -> int:
        """A of the first audited window (1 when nothing was measured)."""
        if self.windows:
            return self.windows[0].microbatches
        return self.invariance[0].accumulation_steps if self.invariance else 1

    @classmethod
    def unchecked(
        cls, reason: str, notes: list[str] | None = None, *, unknown_objective: bool = False
    ) -> TrainerAuditReport:
        """A report for a job the audit could not measure: never ok."""
        return cls(
            ok=False,
            checked=False,
            reason=reason,
            notes=list(notes or []),
            unknown_objective=unknown_objective,
        )

    @classmethod
    def from_invariance(
        cls, results: list[Invariance], why: str, tolerance: float, trainer: Any, model: Any
    ) -> TrainerAuditReport:
        """The report of a split-invariance check (see :mod:`accumlab.hf.invariance`)."""
        from .fixes import has_code, invariance_fix

        why = why.rstrip(".")
        unable = [r.reason for r in results if r.reason]
        if unable or not results:
            reason = unable[0] if unable else "no window was trained"
            return cls.unchecked(f"{why}; split invariance: {reason}", unknown_objective=True)
        mistakes: list[str] = []
        evidence: dict[str, str] = {}
        for r in results:
            for name in r.mistakes:
                if name not in evidence:
                    mistakes.append(name)
                    evidence[name] = r.evidence[name]
        mistakes = [name for name in TRAINER_MISTAKES if name in evidence]
        own = [
            m for r in results for m in r.splits if m.kind == "split" and m.split == r.configured
        ]
        splits = own or [m for r in results for m in r.splits if m.kind == "split"]
        worst = max(
            splits,
            key=lambda m: -1.0 if math.isnan(m.relative_error) else m.relative_error,
            default=None,
        )
        fix = invariance_fix(mistakes, trainer, model, why)
        notes = [f"split {skip}: not compared" for r in results for skip in r.skipped]
        notes += [note for r in results for note in r.notes]
        return cls(
            ok=not mistakes,
            checked=True,
            mistakes=mistakes,
            scale=worst.factor if worst else 1.0,
            relative_error=worst.relative_error if worst else 0.0,
            fix=fix,
            fix_is_advice=bool(fix) and not has_code(fix),
            evidence=evidence,
            objective=f"{why}: checked by split invariance",
            tolerance=tolerance,
            invariance=results,
            not_checked=INVARIANCE_NOT_CHECKED,
            notes=notes,
        )

    def __str__(self) -> str:
        """The verdict, measured numbers, causes, fix and what was not checked; prose lines
        wrapped at :data:`WIDTH` characters (the fix's code is printed as it is)."""
        if not self.checked:
            lines = _wrap(f"accumulation audit: not checked: {self.reason}", "  ")
            for n in self.notes:
                lines += _wrap(f"  note: {n}", "    ")
            return "\n".join(lines)
        verdict = "ok" if self.ok else "WRONG: " + ", ".join(self.mistakes)
        apart = [n for n in self.logged if n.apart]
        if apart:
            said = ", ".join(f"logged {n.name} {n.finding}" for n in apart)
            verdict = f"update {verdict}; {said}" if self.ok else f"{verdict}; {said}"
        lines = [f"accumulation audit: {verdict}"]
        lines += _wrap(
            f"  {'objective' if self.invariance else 'reference'}: {self.objective}", "    "
        )
        for i, r in enumerate(self.invariance):
            lines += _wrap(
                f"  window {i}: configured as {r.configured.label}; the gradient of its "
                f"{r.examples} examples at each split:",
                "    ",
            )
            lines += [line for m in r.splits for line in _wrap(f"    {m.line()}", "      ")]
        for i, w in enumerate(self.windows):
            counts = _counts(w.rank_trainer_counts or [w.trainer_count])
            lines += _wrap(
                f"  window {i}: gradient = {w.scale:.4f} x correct, relative error "
                f"{w.relative_error:.1e} ({w.microbatches} microbatches x "
                f"{_plural(w.ranks, 'rank')}, "
                f"{w.targets} {w.unit}s, Trainer's count {counts})",
                "    ",
            )
        for name in self.mistakes:
            lines += _wrap(f"  cause {name}: {CAUSES[name]}", "    ")
            lines += _wrap(f"    measured: {self.evidence[name]}", "      ")
        for n in self.logged:  # a logging mistake of its own; the rest is in .logged
            if n.apart:
                lines += _wrap(f"  {n.text(self.accumulation_steps)}", "    ")
        if self.fix:
            lines.append(
                "  fix (what to change; then run the audit again):"
                if self.fix_is_advice
                else "  fix (paste; then run the audit again):"
            )
            lines += ["    " + line if line else "" for line in self.fix.rstrip("\n").split("\n")]
        for n in self.notes:
            lines += _wrap(f"  note: {n}", "    ")
        lines += _wrap(f"  not checked: {self.not_checked}", "    ")
        return "\n".join(lines)


#: Said in a split-invariance report: what that check does not look at.
INVARIANCE_NOT_CHECKED = (
    "the objective's definition (a loss wrong the same way at every split passes), splits "
    "other than the ones listed, clipping, the optimizer, the schedule and loss scaling; "
    "windows after the audited ones"
)

#: The widest prose line ``str(report)`` prints.
WIDTH = 100


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _wrap(text: str, indent: str) -> list[str]:
    return textwrap.wrap(text, WIDTH, subsequent_indent=indent, break_on_hyphens=False) or [""]


def _counts(counts: list[float | None]) -> str:
    """The Trainer's num_items_in_batch: one number, or one per rank when they differ."""
    shown = ["none" if c is None else f"{c:g}" for c in counts]
    return shown[0] if len(set(shown)) == 1 else " | ".join(shown) + " by rank"


__all__ = ["INVARIANCE_NOT_CHECKED", "TRAINER_NOT_CHECKED", "TrainerAuditReport"]
