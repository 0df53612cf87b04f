"""From a window's measurements to named causes, with the evidence for each.

The vocabulary extends :data:`accumlab.checks.MISTAKES` (``double_division``,
``average_of_averages``, ``ignored_tokens_counted``) with names for what only a framework
job shows: ``scored_targets_missed``, ``num_items_ignored``, ``per_rank_mean``,
``no_division``, ``wrong_normalization``, ``not_token_mean`` and ``ranks_disagree``.

:func:`name_causes` reads the pattern fits of :class:`~accumlab.hf.reference.WindowMeasure`:
the pattern whose residual is within ``match`` explains the *structure* of the captured
gradient (which examples weigh how much relative to one another), and its fitted constant
explains the *size* (which count the loss was divided by). Constants are compared with a
relative tolerance ``match`` too.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..checks import MISTAKES as LOOP_MISTAKES
from .reference import WindowMeasure, same_on_every_rank

#: Every name ``TrainerAuditReport.mistakes`` can hold, in the order they are reported.
TRAINER_MISTAKES: tuple[str, ...] = (
    "ignored_tokens_counted",
    "scored_targets_missed",
    "num_items_ignored",
    "average_of_averages",
    "per_rank_mean",
    "double_division",
    "no_division",
    "wrong_normalization",
    "not_token_mean",
    "ranks_disagree",
)
assert {"ignored_tokens_counted", "average_of_averages", "double_division"} <= set(LOOP_MISTAKES)

#: What each name means, in one sentence a person reads.
CAUSES: dict[str, str] = {
    "ignored_tokens_counted": (
        "the loss is divided by a count that includes labels the loss never scores "
        "(num_items_in_batch counted over labels before the causal shift)"
    ),
    "scored_targets_missed": "the loss is divided by a count that misses targets the loss scores",
    "num_items_ignored": (
        "the model accepts num_items_in_batch but ignores it and returns its own mean per "
        "microbatch, and the Trainer, trusting it, no longer divides by the accumulation "
        "steps: the gradient is about A times too large and weights targets by their "
        "microbatch"
    ),
    "average_of_averages": (
        "each microbatch's loss is its own mean, divided by the accumulation steps: a target "
        "in a short microbatch weighs more than one in a long microbatch"
    ),
    "per_rank_mean": (
        "each data-parallel rank divides by its own target count and the ranks' gradients "
        "are averaged: a target on a rank with fewer targets weighs more"
    ),
    "double_division": "the loss is divided twice: by the window's count and again (by A or by a count)",
    "no_division": "the loss sums are never divided by the window's count",
    "wrong_normalization": "every target weighs the same, but the loss is divided by a count the audit cannot name",
    "not_token_mean": (
        "the gradient is no weighting of the objective's per-microbatch gradients: the loss "
        "is not the audited mean (label smoothing, a custom weighting, a different loss)"
    ),
    "ranks_disagree": "the data-parallel ranks hold different gradients after the sync",
}


@dataclass
class Finding:
    """The causes found in one window, each with its evidence (a sentence with numbers)."""

    mistakes: list[str]
    evidence: dict[str, str]


def _near(value: float, target: float, tol: float) -> bool:
    return target != 0 and abs(value / target - 1.0) <= tol


def name_causes(m: WindowMeasure, *, ok_tol: float, match: float) -> Finding:
    """The causes that explain window ``m``; empty when its relative error is within ``ok_tol``."""
    found: dict[str, str] = {}
    if m.rank_spread > ok_tol:
        found["ranks_disagree"] = (
            f"rank gradients differ from their mean by up to {m.rank_spread:.2e} (relative): "
            "the model is not synchronised across ranks (is it wrapped in DDP?)"
        )
    if m.relative_error <= ok_tol:
        return _ordered(found)
    fits = {k: f for k, f in m.fits.items() if f.residual <= match}
    a, d, n, n_pre = m.microbatches, m.ranks, m.targets, m.counted
    counts = f"{n} targets scored, {n_pre} labels not -100 before the shift"
    order = ["token", "rank", "rank_pre", "microbatch"]
    best = next((k for k in order if k in fits), None)
    count = m.trainer_count if same_on_every_rank(m.rank_trainer_counts) else None
    if best == "token":
        divisor = 1.0 / fits["token"].constant
        if _near(divisor, n_pre, match) and n_pre != n:
            found["ignored_tokens_counted"] = (
                f"the gradient is the correct one times {n / n_pre:.4f} = {n}/{n_pre}: "
                f"divided by {n_pre} counted labels where {n} targets are scored"
            )
        elif _near(divisor, a * n, match) or _near(divisor, a * n_pre, match):
            found["double_division"] = f"divided by {divisor:.1f} = A × count (A = {a}, {counts})"
            if _near(divisor, a * n_pre, match) and n_pre != n:
                found["ignored_tokens_counted"] = f"the count is the {n_pre} labels before the shift, not the {n} targets"
        elif any(_near(divisor, x, match) for x in (1.0, 1.0 / d, float(d))):
            found["no_division"] = f"the loss sums reach the gradient divided by {divisor:.3g}, not by the {n} targets"
        elif divisor > n and count is not None and _near(divisor, count, match):
            found["ignored_tokens_counted"] = (
                f"divided by the Trainer's num_items_in_batch = {count:g} where {n} targets are scored"
            )
        elif divisor < n and count is not None and _near(divisor, count, match):
            found["scored_targets_missed"] = (
                f"divided by the Trainer's num_items_in_batch = {count:g} where {n} targets are scored"
            )
        else:
            found["wrong_normalization"] = f"every target weighs the same but the divisor is {divisor:.4g}, not {n}"
    elif best in ("rank", "rank_pre"):
        c = fits[best].constant
        per_rank = m.rank_targets if best == "rank" else m.rank_counted
        found["per_rank_mean"] = (
            f"each rank divides by its own count ({per_rank} by rank) instead of the {n} "
            f"targets of all {d} ranks"
        )
        if best == "rank_pre":
            found["ignored_tokens_counted"] = (
                f"the per-rank counts {m.rank_counted} are labels before the shift; the ranks score {m.rank_targets}"
            )
        if not _near(c, 1.0 / d, match):
            found["wrong_normalization"] = f"and an extra factor {c * d:.4g} on top of the per-rank means"
    elif best == "microbatch":
        c = fits["microbatch"].constant
        sizes = "; ".join(str(x) for x in m.microbatch_targets)
        if _near(c, 1.0 / (a * d), match):
            found["average_of_averages"] = (
                f"each microbatch's mean over its own targets ({sizes}), divided by A = {a}"
            )
        elif _near(c, 1.0, match) or _near(c, 1.0 / d, match):
            found["num_items_ignored"] = (
                f"each microbatch's mean over its own targets ({sizes}), summed over A = {a} "
                f"microbatches: {m.scale:.3g} times the correct gradient"
            )
        elif any(_near(c * n, x, match) for x in (1.0, float(d), 1.0 / d)):
            found["double_division"] = f"each microbatch's mean ({sizes}) divided again by the window's {n} targets"
        else:
            found["average_of_averages"] = (
                f"each microbatch's mean over its own targets ({sizes}), times {c:.4g}"
            )
    else:
        best_residual = min((f.residual for f in m.fits.values()), default=float("nan"))
        found["not_token_mean"] = (
            f"no weighting of the per-microbatch gradients explains it (best residual "
            f"{best_residual:.2e}, tolerance {match:.0e}); measured scale {m.scale:.4f}, relative "
            f"error {m.relative_error:.2e}"
        )
    return _ordered(found)


def _ordered(found: dict[str, str]) -> Finding:
    names = [k for k in TRAINER_MISTAKES if k in found]
    return Finding(names, {k: found[k] for k in names})


def blind_spots(m: WindowMeasure, ok_tol: float) -> list[str]:
    """What this window's data cannot tell apart from a correct job (said when ok)."""
    notes = []
    flat = [x for rank in m.microbatch_targets for x in rank]
    if same_on_every_rank(flat) and len(flat) > 1:
        notes.append(
            "every microbatch has the same target count, so a mean per microbatch would "
            "pass too: audit a window with uneven lengths to rule it out"
        )
    if m.ranks > 1 and same_on_every_rank(m.rank_targets):
        notes.append(
            "every rank has the same target count, so per-rank means would pass too"
        )
    if m.counted == m.targets and m.microbatch_targets and flat and m.ranks:
        notes.append("no label before the shift is unscored here, so counting before the shift would pass too")
    return notes


__all__ = ["CAUSES", "TRAINER_MISTAKES", "Finding", "blind_spots", "name_causes"]
