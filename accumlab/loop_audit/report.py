"""The audit's report: what it measured on each window (:class:`WindowAudit`) and the
verdict (:class:`AuditReport`), printed with evidence, symptom and fix."""

from __future__ import annotations

from dataclasses import dataclass, field

from .controlled_set import AUDIT_TOLERANCE
from .mistakes import ADVICE, NOT_CHECKED


@dataclass
class WindowAudit:
    """What the audit measured on one window of the controlled set.

    ``weights[i]``: how much of microbatch ``i``'s correct contribution (its loss sum over
    the window's targets) reached this window's updates, summed over its optimizer steps
    (1.0 each for a correct loop; 0 for a lost microbatch; ``None`` when no step could be
    analysed); ``example_weights[i][r]`` the same per example (row ``r`` of microbatch
    ``i``), of which ``weights[i]`` is the target-weighted mean.
    ``example_backward_passes[i][r]``: backward passes that went through that example.
    ``update_error``: ``|sum of step gradients - reference gradient| / |reference|``.
    ``carried``: the largest share of a previous window's gradient found in this one.
    ``label_shift``: the shift between positions and targets the updates match (1, the
    next token, is correct; 0 or 2 is a mistake; None when none matches).
    """

    index: int
    microbatches: int
    targets: int
    forwards: int
    backward_passes: int
    optimizer_steps: int
    scheduler_steps: int
    zero_grad_calls: int
    weights: list[float] | None
    update_error: float | None
    carried: float
    residual: float
    cleared_gradients: int
    kept_tensors: int
    example_weights: list[list[float]] | None = None
    example_backward_passes: list[list[int]] = field(default_factory=list)
    label_shift: int | None = 1


@dataclass
class AuditReport:
    """The verdict of :func:`audit`.

    ``mistakes``: names from :data:`MISTAKES`, in that order; ``evidence[name]``: what was
    measured for it. ``other``: findings outside that vocabulary (gradients carried over
    from an earlier window, a scheduler that never advances, an update nothing explains).
    ``ok`` is True when both are empty and every window's update matches the correct one
    within :data:`AUDIT_TOLERANCE`. ``str(report)`` gives, per mistake, the evidence, the
    symptom a user would see in a real run, and the fix, then what the audit does not check.
    """

    mistakes: list[str]
    evidence: dict[str, str]
    other: list[str]
    windows: list[WindowAudit]

    @property
    def ok(self) -> bool:
        return (
            not self.mistakes
            and not self.other
            and all(
                w.update_error is not None and w.update_error <= AUDIT_TOLERANCE
                for w in self.windows
            )
        )

    def __str__(self) -> str:
        n_mb = sum(w.microbatches for w in self.windows)
        head = f"{len(self.windows)} windows, {n_mb} microbatches of a controlled set"
        if self.ok:
            worst = max((w.update_error or 0.0) for w in self.windows)
            error = "below 1e-12" if worst < 1e-12 else f"{worst:.1e}"  # float64 rounding only
            once = self.windows[0].kept_tensors if len(self.windows) > 1 else 0
            kept = f" but {once} made once in the first window" if once else ""
            return (
                f"audit: ok ({head}). Every update matches the reference (largest relative "
                f"error {error}); one optimizer.step and one scheduler.step per window; no "
                f"tensor outlived its window{kept}.\n{NOT_CHECKED}"
            )
        count = len(self.mistakes)
        lines = [f"audit: {count} mistake{'s' if count != 1 else ''} found ({head})"]
        for name in self.mistakes:
            symptom, fix = ADVICE[name]
            lines += [
                f"- {name}",
                f"    evidence: {self.evidence[name]}",
                f"    symptom:  {symptom}",
                f"    fix:      {fix}",
            ]
        for note in self.other:
            lines.append(f"- also: {note}")
        lines.append(NOT_CHECKED)
        return "\n".join(lines)
