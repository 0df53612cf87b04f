"""What a split-invariance check found: one :class:`SplitMeasure` per comparison, and the
verdict (:class:`InvarianceReport`): ok, or the mistakes by name from the one table
(:data:`accumlab.mistakes.MISTAKES`) with their evidence, symptom and fix; or not checked,
and why; then what the check ran and what it does not check, printed in every report."""

from __future__ import annotations

import math
import textwrap
from dataclasses import dataclass, field

from ..mistakes import MISTAKES
from .split import Split

#: The printed report's lines are at most this many characters (a notebook prints it).
REPORT_WIDTH = 100

#: What split invariance cannot see, said in every report.
NOT_CHECKED = (
    "not checked: a loss wrong the same way at every split (a wrong formula, a constant "
    "factor, a count taken the same wrong way for every split, such as before the causal "
    "shift: the token mean against an intended objective shows it where one was given), "
    "the optimizer, its step and learning rate, clipping, loss scaling, other windows than "
    "the one checked, and data-parallel ranks"
)


def wrap(text: str, first: str = "", rest: str = "") -> str:
    """``text`` after ``first``, wrapped at :data:`REPORT_WIDTH` with ``rest`` before each
    further line; words are never split, so the text with its whitespace collapsed is
    unchanged."""
    return textwrap.fill(text, REPORT_WIDTH, initial_indent=first, subsequent_indent=rest,
                         break_long_words=False, break_on_hyphens=False)


def _number(x: float) -> str:
    return "nan" if math.isnan(x) else f"{x:.4g}"


@dataclass(frozen=True)
class SplitMeasure:
    """The gradient of ``split`` against the one of ``against`` (a :class:`Split` over the
    same examples, or a phrase: ``"the token mean"``, ``"the sum of its microbatches run
    alone"``): it is ``factor`` times that one (least squares), with ``relative_error``
    ``‖g − g_against‖ / ‖g_against‖`` and ``residual`` ``‖g − factor · g_against‖ / ‖g‖``.
    ``kind`` says which comparison it is: ``"split"`` (a full split against the reference),
    ``"short"`` (a short window against the same microbatches with ``A`` their number),
    ``"structure"`` (a split against the sum of its microbatches, each run as a window of
    its own) or ``"objective"`` (the configured split against the intended objective)."""

    split: Split
    against: Split | str
    factor: float
    relative_error: float
    residual: float
    kind: str = "split"

    def line(self) -> str:
        """``(2, 4) = 0.9703 x (8, 1): relative error 1.00e-01``; a structure measure gives
        the fit's residual instead (its gradient is not meant to equal the sum)."""
        if self.kind == "structure":
            return f"{self.split.label} = {_number(self.factor)} x {self.against} (residual {self.residual:.1e})"
        return (f"{self.split.label} = {_number(self.factor)} x {self.against}: relative error "
                f"{self.relative_error:.2e}")


@dataclass
class InvarianceReport:
    """The verdict of a split-invariance check.

    ``ok``: checked, and every measure within ``tolerance``. ``checked``: False when the
    check could not run; ``reason`` then says why ("not checked: ..." in the text).
    ``configured``: the job's split. ``measures``: every comparison made, in order.
    ``mistakes``: names of :data:`accumlab.mistakes.MISTAKES`, in the table's order;
    ``evidence[name]``: the numbers that show it. ``skipped``: splits that could not run,
    with why (out of memory). ``ran``: what the check ran (one sentence, adapters add theirs);
    ``notes``: what else the reader should know (examples left unused, a release not
    tested); ``not_checked``: what it does not check.
    """

    configured: Split
    tolerance: float
    checked: bool = True
    reason: str = ""
    measures: list[SplitMeasure] = field(default_factory=list)
    mistakes: list[str] = field(default_factory=list)
    evidence: dict[str, str] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)
    ran: str = ""
    notes: list[str] = field(default_factory=list)
    not_checked: str = NOT_CHECKED

    @property
    def ok(self) -> bool:
        """Checked, no mistake, and every comparison of gradients meant to be equal within
        the tolerance (a structure measure is a fit, not such a comparison)."""
        return (self.checked and not self.mistakes
                and all(m.relative_error <= self.tolerance for m in self.measures
                        if m.kind != "structure"))

    def measure(self, split: Split, kind: str = "split") -> SplitMeasure | None:
        """The measure of ``split`` of that kind, if made."""
        for m in self.measures:
            if m.split == split and m.kind == kind:
                return m
        return None

    def headline(self) -> str:
        """The first line: ok, the names, or not checked and why."""
        if not self.checked:
            return f"split invariance: not checked: {self.reason}"
        if self.ok:
            return (f"split invariance: ok (every split within relative error {self.tolerance:.0e} "
                    "of the reference)")
        return f"split invariance: not ok: {', '.join(self.mistakes)}"

    def text(self) -> str:
        """The printed report: the headline, each measure, each mistake with its evidence,
        symptom and fix, the skipped splits and notes, what ran and what is not checked."""
        lines = [wrap(self.headline(), rest="  ")]
        if self.measures:
            lines.append(wrap(
                f"the job is configured as {self.configured.label}; the gradient of the same "
                "examples, from the same weights and random state, at each split:"))
            lines += [wrap(m.line(), "  ", "    ") for m in self.measures]
        for name in self.mistakes:
            mistake = MISTAKES[name]
            lines.append(f"- {name}")
            lines.append(wrap(self.evidence.get(name, ""), "  evidence: ", "    "))
            lines.append(wrap(mistake.symptom, "  symptom: ", "    "))
            lines.append(wrap(mistake.fix, "  fix: ", "    "))
        lines += [wrap(f"skipped: {s}", rest="  ") for s in self.skipped]
        lines += [wrap(f"note: {n}", rest="  ") for n in self.notes]
        if self.ran:
            lines.append(wrap(self.ran))
        lines.append(wrap(self.not_checked))
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.text()


__all__ = ["NOT_CHECKED", "REPORT_WIDTH", "InvarianceReport", "SplitMeasure", "wrap"]
