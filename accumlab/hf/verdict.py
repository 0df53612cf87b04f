"""From a window's measurements to named causes, with the evidence for each.

The names are the Trainer audit's rows of the one table both audits share,
:data:`accumlab.mistakes.MISTAKES` (cause, symptom, fix); the loop audit names some of the
same mistakes (``double_division``, ``average_of_averages``, ``count_before_shift``,
``ignored_tokens_counted``).

:func:`name_causes` reads the pattern fits of :class:`~accumlab.hf.reference.WindowMeasure`:
the pattern whose residual is within ``match`` explains the *structure* of the captured
gradient (which examples weigh how much relative to one another), and its fitted constant
explains the *size* (which count the loss was divided by). Constants are compared with a
relative tolerance ``match`` too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..mistakes import MISTAKES, reported_by
from .reference import WindowMeasure, same_on_every_rank

#: Every name ``TrainerAuditReport.mistakes`` can hold, in the order they are reported:
#: the Trainer audit's names of the shared table :data:`accumlab.mistakes.MISTAKES` and the
#: split-invariance engine's (but ``sum_of_means``, which it says as ``num_items_ignored``).
TRAINER_MISTAKES: tuple[str, ...] = tuple(
    name
    for name in MISTAKES
    if name in set(reported_by("trainer")) | set(reported_by("split")) - {"sum_of_means"}
)

#: What each name means, in one sentence a person reads (the shared table's cause).
CAUSES: dict[str, str] = {name: MISTAKES[name].cause for name in TRAINER_MISTAKES}


@dataclass
class Finding:
    """The causes found in one window, each with its evidence (a sentence with numbers)."""

    mistakes: list[str]
    evidence: dict[str, str]


def _near(value: float, target: float, tol: float) -> bool:
    return target != 0 and abs(value / target - 1.0) <= tol


def name_causes(m: WindowMeasure, *, ok_tol: float, match: float) -> Finding:
    """The causes that explain window ``m``; empty when its relative error is within ``ok_tol``.

    Every pattern whose fit is within ``match`` is tried, in the order per target, per
    rank, per rank counted before the shift, per microbatch; the first whose constant is
    a known divisor names the cause (when the data cannot tell patterns apart, e.g. equal
    microbatch counts, the constant does). A per-target fit with an unknown divisor is
    ``wrong_normalization``; no fit at all is ``not_token_mean``.
    """
    found: dict[str, str] = {}
    if m.rank_spread > ok_tol:
        found["ranks_disagree"] = (
            f"rank gradients differ from their mean by up to {m.rank_spread:.2e} (relative): "
            "the model is not synchronised across ranks (is it wrapped in DDP?)"
        )
        return _ordered(found)  # each rank measures its own gradient: nothing else is common
    found.update(_collation_facts(m, ok_tol))
    token = m.fits.get("token")
    if m.relative_error <= ok_tol and (
        token is None or _nearest(m, token.coefficients[0], match) is None
    ):
        return _ordered(found)
    if found.keys() - {"ranks_disagree"}:
        return _ordered(found)
    fits = {k: f for k, f in m.fits.items() if f.residual <= match}
    if m.ranks == 1:  # a per-rank mean is the per-target pattern itself
        fits = {k: f for k, f in fits.items() if k not in ("rank", "rank_pre")}
    namers = {"token": _token, "rank": _rank, "rank_pre": _rank, "microbatch": _microbatch}
    for pattern in ("token", "rank", "rank_pre", "microbatch"):
        if pattern in fits:
            named = namers[pattern](m, pattern, fits[pattern].coefficients[0], match)
            if named:
                found.update(named)
                return _ordered(found)
    if "token" in fits:
        found["wrong_normalization"] = (
            f"every {m.unit} weighs the same but the divisor is "
            f"{1.0 / fits['token'].coefficients[0]:.4g}, "
            f"not the {m.targets} {m.unit}s"
        )
    else:
        best_residual = min((f.residual for f in m.fits.values()), default=float("nan"))
        found["not_token_mean"] = (
            f"no weighting of the per-microbatch gradients explains it (best residual "
            f"{best_residual:.2e}, tolerance {match:.0e}); measured scale {m.scale:.4f}, relative "
            f"error {m.relative_error:.2e}"
        )
    return _ordered(found)


def _collation_facts(m: WindowMeasure, ok_tol: float) -> dict[str, str]:
    """What the collated microbatches do that the examples do not: integer facts (targets
    scored at a padding position or across examples), and packed rows whose gradient
    differs from the examples' own."""
    found = {}
    crossing = m.job_targets - m.padding_targets - m.targets
    if m.padding_targets and m.job_targets > m.targets:
        found["pad_predicts_target"] = (
            f"the collated microbatches score {m.job_targets} {m.unit}s where the examples, each "
            f"in its own row, have {m.targets}: {m.padding_targets} are predicted from a padding "
            f"position; measured scale {m.scale:.4f}, relative error {m.relative_error:.2e}"
        )
    if m.packed_rows and (crossing > 0 or m.leak > m.leak_tolerance):
        across = (
            f"{crossing} targets cross from one example into the next; " if crossing > 0 else ""
        )
        leak = (
            f"an example's logits in its packed row differ from its own alone by up to "
            f"{m.leak:.1e} (relative); "
            if m.leak > m.leak_tolerance
            else ""
        )
        found["attention_crosses_examples"] = (
            f"{m.packed_rows} rows hold several examples; {across}{leak}the gradient is "
            f"{m.scale:.4f} x the examples' own, each in its own row, relative error "
            f"{m.relative_error:.2e}"
        )
    return found


def _candidates(m: WindowMeasure) -> list[tuple[float, str | None]]:
    """Divisors a job's token pattern may carry, with the name each stands for (None: the
    window's count, the right one)."""
    a, d, n, n_pre = m.microbatches, m.ranks, m.targets, m.counted
    out: list[tuple[float, str | None]] = [(float(n), None)]
    if n_pre != n:
        out += [(float(n_pre), "count_before_shift"), (float(a * n_pre), "double_division")]
    out += [(float(a * n), "double_division"), (1.0, "no_division"), (float(d), "no_division")]
    count = m.trainer_count if same_on_every_rank(m.rank_trainer_counts) else None
    if count is not None and count != n:
        out.append((count, "scored_targets_missed" if count < n else "ignored_tokens_counted"))
    return out


def _nearest(m: WindowMeasure, constant: float, match: float) -> str | None:
    """The name of the candidate divisor nearest ``1 / constant`` (None for the window's
    own count, or when none is within ``match``, relative): counts are integers, so the
    nearest one is named whatever the precision's rounding."""
    if not constant > 0:
        return "wrong_normalization"
    divisor = 1.0 / constant
    ranked = sorted(
        _candidates(m), key=lambda c: abs(math.log(divisor / c[0])) if c[0] > 0 else math.inf
    )
    value, name = ranked[0]
    if abs(divisor / value - 1.0) > match:
        return "wrong_normalization"
    return name


def _token(m: WindowMeasure, pattern: str, constant: float, match: float) -> dict[str, str]:
    """Every target weighs the same: name the divisor (empty when it is unknown)."""
    a, d, n, n_pre, unit = m.microbatches, m.ranks, m.targets, m.counted, m.unit
    divisor = 1.0 / constant
    count = m.trainer_count if same_on_every_rank(m.rank_trainer_counts) else None
    if _nearest(m, constant, match) is None:
        return {}
    if (
        _near(divisor, n_pre, match)
        and n_pre != n
        and _nearest(m, constant, match) == "count_before_shift"
    ):
        return {
            "count_before_shift": (
                f"the gradient is the correct one times {n / n_pre:.4f} = {n}/{n_pre}: "
                f"divided by {n_pre} counted labels where {n} {unit}s are scored"
            )
        }
    if _near(divisor, a * n, match) or _near(divisor, a * n_pre, match):
        out = {
            "double_division": f"divided by {divisor:.1f} = A x count (A = {a}, {n} {unit}s scored)"
        }
        if _near(divisor, a * n_pre, match) and n_pre != n:
            out["count_before_shift"] = (
                f"the count is the {n_pre} labels before the shift, not the {n} {unit}s"
            )
        return out
    if any(_near(divisor, x, match) for x in (1.0, 1.0 / d, float(d))):
        return {
            "no_division": f"the loss sums reach the gradient divided by {divisor:.3g}, not by "
            f"the {n} {unit}s"
        }
    if count is not None and _near(divisor, count, match):
        if divisor <= n:
            name = "scored_targets_missed"
        elif count == n_pre:
            name = "count_before_shift"
        else:
            name = "ignored_tokens_counted"
        return {
            name: f"divided by the Trainer's num_items_in_batch = {count:g} where {n} {unit}s "
            "are scored"
        }
    return {}


def _rank(m: WindowMeasure, pattern: str, constant: float, match: float) -> dict[str, str]:
    """Each rank divides by its own count: a per-rank mean (empty for an unknown constant)."""
    if not _near(constant, 1.0 / m.ranks, match):
        return {}
    per_rank = m.rank_targets if pattern == "rank" else m.rank_counted
    out = {
        "per_rank_mean": (
            f"each rank divides by its own count ({per_rank} by rank) instead of the {m.targets} "
            f"{m.unit}s of all {m.ranks} ranks"
        )
    }
    if pattern == "rank_pre":
        out["count_before_shift"] = (
            f"the per-rank counts {m.rank_counted} are labels before the shift; the ranks score "
            f"{m.rank_targets}"
        )
    return out


def _microbatch(m: WindowMeasure, pattern: str, constant: float, match: float) -> dict[str, str]:
    """Each microbatch is its own mean: name what multiplies the means."""
    a, d, n, c = m.microbatches, m.ranks, m.targets, constant
    sizes = "; ".join(str(x) for x in m.microbatch_targets)
    if _near(c, 1.0 / (a * d), match):
        return {
            "average_of_averages": f"each microbatch's mean over its own {m.unit}s ({sizes}), "
            f"divided by A = {a}"
        }
    if _near(c, 1.0, match) or _near(c, 1.0 / d, match):
        never = (  # transformers 4.46 for a forward without **loss_kwargs
            "; the Trainer passed no num_items_in_batch and still did not divide by A"
            if m.trainer_count is None
            else ""
        )
        return {
            "num_items_ignored": (
                f"each microbatch's mean over its own {m.unit}s ({sizes}), summed over A = {a} "
                f"microbatches: {m.scale:.3g} times the correct gradient{never}"
            )
        }
    if any(_near(c * n, x, match) for x in (1.0, float(d), 1.0 / d)):
        return {
            "double_division": f"each microbatch's mean ({sizes}) divided again by the window's "
            f"{n} {m.unit}s"
        }
    return {
        "average_of_averages": f"each microbatch's mean over its own {m.unit}s ({sizes}), "
        f"times {c:.4g}"
    }


def _ordered(found: dict[str, str]) -> Finding:
    names = [k for k in TRAINER_MISTAKES if k in found]
    return Finding(names, {k: found[k] for k in names})


def blind_spots(m: WindowMeasure, ok_tol: float) -> list[str]:
    """What this window's data cannot tell apart from a correct job (said when ok)."""
    notes = []
    flat = [x for rank in m.microbatch_targets for x in rank]
    if same_on_every_rank(flat) and len(flat) > 1:
        notes.append(
            f"every microbatch has the same {m.unit} count, so a mean per microbatch would "
            "pass too: audit a window with uneven lengths to rule it out"
        )
    if m.ranks > 1 and same_on_every_rank(m.rank_targets):
        notes.append(f"every rank has the same {m.unit} count, so per-rank means would pass too")
    if m.unit == "target" and m.counted == m.targets:
        notes.append(
            "no label before the shift is unscored here, so counting before the shift would "
            "pass too"
        )
    return notes


__all__ = ["CAUSES", "TRAINER_MISTAKES", "Finding", "blind_spots", "name_causes"]
