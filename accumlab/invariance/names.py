"""The name each comparison gives, from the one table (:data:`accumlab.mistakes.MISTAKES`),
and the sentence of numbers that shows it.

A full split ``s`` against the reference ``r`` (the same examples; ``ρ = A_s / A_r``):
within the tolerance, nothing; else, with a residual within ``match``, a factor of
``1/ρ`` is ``double_division`` (the gradient shrinks as ``A`` grows: one division by ``A``
too many) and a factor of ``ρ`` is ``sum_of_means`` (it grows with ``A``); anything else
waits for the structure. The structure writes ``g(s)`` as ``c`` times the sum of its
microbatches' gradients, each run as a window of its own: ``c = 1/A`` (every microbatch
weighs the same, whatever it holds) is ``average_of_averages``, ``c = 1`` is
``sum_of_means``, and a dependence no such ``c`` explains is ``depends_on_split``.
A short window of ``k`` microbatches against the same microbatches with ``A = k``: a factor
of ``k/A`` is ``short_window_divided_by_a``. The configured split against an intended
objective (when a split-invariant job still differs): a pure factor is
``wrong_normalization``, anything else ``not_token_mean``.
"""

from __future__ import annotations

from .report import SplitMeasure


def near(value: float, target: float, match: float) -> bool:
    """True when ``value`` is within ``match`` of ``target``, relatively."""
    return target != 0 and abs(value / target - 1.0) <= match


def _fraction(k: int, a: int) -> str:
    return f"{k}/{a}" if k != a else "1"


def name_split(m: SplitMeasure, *, tolerance: float, match: float) -> tuple[str, str] | None:
    """``(name, evidence)`` for a full split against the reference by its factor alone, or
    None (within the tolerance, or a dependence only the structure can name)."""
    if m.relative_error <= tolerance or not isinstance(m.against, type(m.split)):
        return None
    a_s, a_r = m.split.accumulation_steps, m.against.accumulation_steps
    said = (f"the same {m.split.examples} examples: the gradient at {m.split.label} is "
            f"{m.factor:.4g} x the one at {m.against.label} (relative error "
            f"{m.relative_error:.2e}, residual {m.residual:.1e})")
    if m.residual > match:
        return None
    if near(m.factor, a_r / a_s, match):
        return "double_division", (
            f"{said}: A went from {a_r} to {a_s} and the gradient shrank by the same factor: "
            "one division by A too many")
    if near(m.factor, a_s / a_r, match):
        return "sum_of_means", (
            f"{said}: A went from {a_r} to {a_s} and the gradient grew by the same factor: "
            "nothing divides the per-microbatch losses by A")
    return None


def name_structure(m: SplitMeasure, difference: SplitMeasure, *, match: float) -> tuple[str, str]:
    """``(name, evidence)`` for a dependent split ``difference`` whose structure ``m`` (the
    split against the sum of its microbatches run alone) was measured."""
    a = m.split.accumulation_steps
    differs = (f"the gradient at {difference.split.label} differs from the one at "
               f"{difference.against} by relative error {difference.relative_error:.2e}")
    if m.residual <= match and near(m.factor, 1.0 / a, match):
        return "average_of_averages", (
            f"{differs}, and it is {m.factor:.4g} (= 1/{a}) x the sum of its "
            f"{m.split.microbatches} microbatches' gradients, each run as a window of its own "
            f"(residual {m.residual:.1e}): every microbatch weighs the same, whatever it holds")
    if m.residual <= match and near(m.factor, 1.0, match):
        return "sum_of_means", (
            f"{differs}, and it is {m.factor:.4g} x the sum of its {m.split.microbatches} "
            f"microbatches' gradients, each run as a window of its own (residual "
            f"{m.residual:.1e}): each microbatch is normalized on its own and nothing divides "
            "by A")
    return "depends_on_split", (
        f"{differs} (= {difference.factor:.4g} x it, residual {difference.residual:.1e}); it is "
        f"no multiple of the sum of its microbatches' gradients each run alone (best "
        f"{m.factor:.4g} x, residual {m.residual:.1e})")


def name_short(m: SplitMeasure, *, tolerance: float, match: float) -> tuple[str, str] | None:
    """``(name, evidence)`` for a short window against its microbatches with ``A`` their
    number, or None within the tolerance."""
    if m.relative_error <= tolerance:
        return None
    k, a = m.split.microbatches, m.split.accumulation_steps
    said = (f"a short window of {k} microbatch{'es' if k != 1 else ''} in a job configured "
            f"with A = {a}: its gradient is {m.factor:.4g} x the one of the same microbatches "
            f"with A = {k} (relative error {m.relative_error:.2e}, residual {m.residual:.1e})")
    if m.residual <= match and near(m.factor, k / a, match):
        return "short_window_divided_by_a", f"{said}: = {_fraction(k, a)}, divided by the full A"
    return "depends_on_split", said


def name_objective(m: SplitMeasure, *, tolerance: float, match: float) -> tuple[str, str] | None:
    """``(name, evidence)`` for the configured split against the intended objective, when
    no split showed a dependence; None within the tolerance."""
    if m.relative_error <= tolerance:
        return None
    said = (f"the gradient at {m.split.label} is {m.factor:.4g} x {m.against}'s (relative "
            f"error {m.relative_error:.2e}, residual {m.residual:.1e})")
    if m.residual <= match:
        return "wrong_normalization", (
            f"{said}, though it does not depend on the split: every target weighs the same, "
            "divided by another count")
    return "not_token_mean", (
        f"{said}, though it does not depend on the split: the loss is not {m.against}")


__all__ = ["name_objective", "name_short", "name_split", "name_structure", "near"]
