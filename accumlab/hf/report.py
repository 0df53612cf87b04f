"""``TrainerAuditReport``: what :func:`accumlab.hf.audit_trainer` measured and concluded."""

from __future__ import annotations

import math
import textwrap
from dataclasses import dataclass, field

from .reference import WindowMeasure
from .verdict import CAUSES

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
    ``fix_needs_new_trainer``: the fix must run before the Trainer is built (its first line
    says so). ``windows``: per-window measurements. ``objective``: the reference objective.
    ``notes``: what this data cannot tell apart from a correct job, and how the run was
    set up. ``not_checked``: what the audit does not look at.
    """

    ok: bool
    checked: bool
    mistakes: list[str] = field(default_factory=list)
    scale: float = math.nan
    relative_error: float = math.nan
    fix: str = ""
    fix_needs_new_trainer: bool = False
    evidence: dict[str, str] = field(default_factory=dict)
    windows: list[WindowMeasure] = field(default_factory=list)
    objective: str = ""
    tolerance: float = math.nan
    reason: str = ""
    notes: list[str] = field(default_factory=list)
    not_checked: str = TRAINER_NOT_CHECKED

    @classmethod
    def unchecked(cls, reason: str, notes: list[str] | None = None) -> TrainerAuditReport:
        """A report for a job the audit could not measure: never ok."""
        return cls(ok=False, checked=False, reason=reason, notes=list(notes or []))

    def __str__(self) -> str:
        """The verdict, measured numbers, causes, fix and what was not checked; prose lines
        wrapped at :data:`WIDTH` characters (the fix's code is printed as it is)."""
        if not self.checked:
            lines = _wrap(f"accumulation audit: not checked: {self.reason}", "  ")
            for n in self.notes:
                lines += _wrap(f"  note: {n}", "    ")
            return "\n".join(lines)
        verdict = "ok" if self.ok else "WRONG: " + ", ".join(self.mistakes)
        lines = [f"accumulation audit: {verdict}"]
        lines += _wrap(f"  reference: {self.objective}", "    ")
        for i, w in enumerate(self.windows):
            counts = _counts(w.rank_trainer_counts or [w.trainer_count])
            lines += _wrap(
                f"  window {i}: gradient = {w.scale:.4f} x correct, relative error "
                f"{w.relative_error:.1e} ({w.microbatches} microbatches x {_plural(w.ranks, 'rank')}, "
                f"{w.targets} {w.unit}s, Trainer's count {counts})",
                "    ",
            )
        for name in self.mistakes:
            lines += _wrap(f"  cause {name}: {CAUSES[name]}", "    ")
            lines += _wrap(f"    measured: {self.evidence[name]}", "      ")
        if self.fix:
            lines.append("  fix (paste; then run the audit again):")
            lines += ["    " + line if line else "" for line in self.fix.rstrip("\n").split("\n")]
        for n in self.notes:
            lines += _wrap(f"  note: {n}", "    ")
        lines += _wrap(f"  not checked: {self.not_checked}", "    ")
        return "\n".join(lines)


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


__all__ = ["TRAINER_NOT_CHECKED", "TrainerAuditReport"]
