"""The audit's report: what it measured on each window (:class:`WindowAudit`) and the
verdict (:class:`AuditReport`), printed with evidence, symptom and fix, then what the
audit ran and what it does not check (:data:`NOT_CHECKED`)."""

from __future__ import annotations

import textwrap
from dataclasses import dataclass, field

from ..mistakes import MISTAKES
from .controlled_set import AUDIT_TOLERANCE

#: What the audit does not check, said in every report.
NOT_CHECKED = (
    "Not checked by the audit: non-finite gradients and loss scaling, mixed precision, "
    "the clipping threshold (a clip is seen only where it changes the controlled set's "
    "gradients), data-parallel averaging and no_sync, and your own model, data and "
    "optimizer (it runs the loop on its float64 model, SGD and controlled set)."
)
#: The printed report's lines are at most this many characters (a notebook prints it).
REPORT_WIDTH = 100


def _wrap(text: str, first: str = "", rest: str = "") -> str:
    """``text`` after ``first``, wrapped at :data:`REPORT_WIDTH` with ``rest`` before each
    further line; words (identifiers, numbers, hyphenated words) are never split, so the
    text with its whitespace collapsed is unchanged."""
    return textwrap.fill(
        text,
        REPORT_WIDTH,
        initial_indent=first,
        subsequent_indent=rest,
        break_long_words=False,
        break_on_hyphens=False,
    )


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
    ``examples``: the window's examples (rows); ``rows_forwarded``: rows that went through
    the loop's forward passes in this window (an example run twice counts twice).
    ``scheduler_ahead``: ``scheduler.step()`` calls made by this window's first
    ``optimizer.step()`` beyond the updates before it (0 for a correct loop; 1 when the
    scheduler steps before the optimizer; negative when it falls behind).
    ``clips``: the factors by which the gradient's norm shrank between two backward passes
    of this window before its step (a clip of a partial sum; empty for a correct loop).
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
    examples: int = 0
    rows_forwarded: int = 0
    scheduler_ahead: int = 0
    clips: list[float] = field(default_factory=list)


@dataclass
class AuditReport:
    """The verdict of :func:`audit`.

    ``mistakes``: names of the shared table :data:`accumlab.mistakes.MISTAKES` that the
    loop audit reports, in the table's order; ``evidence[name]``: what was measured for it. ``other``: findings outside that vocabulary (gradients carried over
    from an earlier window, a scheduler that never advances, an update nothing explains).
    ``ok`` is True when both are empty and every window's update matches the correct one
    within :data:`AUDIT_TOLERANCE`. ``str(report)`` gives, per mistake, the evidence, the
    symptom a user would see in a real run, and the fix, then two paragraphs that explain
    the audit (:attr:`explanation`: what it ran and what it does not check), each wrapped
    at :data:`REPORT_WIDTH` characters a line. To print several reports with the
    explanation once, print ``report.text(explain=False)`` for each (the same text without
    those two paragraphs) and ``report.explanation`` once.

    What the audit ran: ``examples`` in the controlled set (``microbatches`` of them);
    ``loop_forwards`` forward passes of your loop over ``loop_rows`` rows; and
    ``reference_forwards`` forward and backward passes of one example each that the audit
    ran itself (each example's correct contribution at the weights your loop's forward ran
    at, and at another label shift when the updates needed one); ``forward_passes`` and
    ``rows_forwarded`` are the totals.
    """

    mistakes: list[str]
    evidence: dict[str, str]
    other: list[str]
    windows: list[WindowAudit]
    reference_forwards: int = 0

    @property
    def examples(self) -> int:
        return sum(w.examples for w in self.windows)

    @property
    def microbatches(self) -> int:
        return sum(w.microbatches for w in self.windows)

    @property
    def loop_forwards(self) -> int:
        return sum(w.forwards for w in self.windows)

    @property
    def loop_rows(self) -> int:
        return sum(w.rows_forwarded for w in self.windows)

    @property
    def forward_passes(self) -> int:
        return self.loop_forwards + self.reference_forwards

    @property
    def rows_forwarded(self) -> int:
        return self.loop_rows + self.reference_forwards

    @property
    def ran(self) -> str:
        """What the audit ran, in one sentence."""
        return (
            f"The audit ran {self.forward_passes} forward passes over {self.rows_forwarded} "
            f"rows: your loop's {self.loop_forwards} over {self.loop_rows} rows, and "
            f"{self.reference_forwards} of one example each for the reference."
        )

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

    @property
    def explanation(self) -> str:
        """The two closing paragraphs of every report: what the audit ran
        (:attr:`ran`) and what it does not check (:data:`NOT_CHECKED`)."""
        return "\n".join((_wrap(self.ran), _wrap(NOT_CHECKED)))

    def text(self, *, explain: bool = True) -> str:
        """The printed report; ``explain=False`` leaves out :attr:`explanation` (print it
        once for several reports). ``str(report)`` is ``report.text()``."""
        head = (
            f"{len(self.windows)} windows, {self.microbatches} microbatches, {self.examples} "
            "examples of a controlled set"
        )
        if self.ok:
            worst = max((w.update_error or 0.0) for w in self.windows)
            error = "below 1e-12" if worst < 1e-12 else f"{worst:.1e}"  # float64 rounding only
            once = self.windows[0].kept_tensors if len(self.windows) > 1 else 0
            kept = f" but {once} made once in the first window" if once else ""
            lines = [
                _wrap(
                    f"audit: ok ({head}). Every update matches the reference (largest relative "
                    f"error {error}); one optimizer.step and, after it, one scheduler.step per "
                    f"window; no tensor outlived its window{kept}."
                )
            ]
        else:
            count = len(self.mistakes)
            lines = [_wrap(f"audit: {count} mistake{'s' if count != 1 else ''} found ({head})")]
            indent = " " * len("    evidence: ")
            for name in self.mistakes:
                mistake = MISTAKES[name]
                lines += [
                    f"- {name}",
                    _wrap(self.evidence[name], "    evidence: ", indent),
                    _wrap(mistake.symptom, "    symptom:  ", indent),
                    _wrap(mistake.fix, "    fix:      ", indent),
                ]
            for note in self.other:
                lines.append(_wrap(note, "- also: ", "    "))
        if explain:
            lines.append(self.explanation)
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.text()
