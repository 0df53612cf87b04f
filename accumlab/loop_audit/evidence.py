"""The evidence each mistake's name quotes: the measured shares, counts and changes, as
sentences (one function per kind of evidence)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from .contributions import Contributions
from .controlled_set import AUDIT_TOLERANCE, Row, RowKey
from .report import WindowAudit
from .weightings import (
    MEAN_BY_EXAMPLES,
    MEAN_TIMES_LABELS,
    PER_EXAMPLE,
    UNITS,
    Matches,
    Weighting,
)

Found = dict[str, list[int]]  # each mistake's name: the windows that show it


def fraction(x: float) -> str:
    """``0.25`` as ``1/4``, ``2.0`` as ``2``: the ratios the report quotes."""
    if x > 0 and abs(1 / x - round(1 / x)) < 1e-6 and round(1 / x) > 1:
        return f"1/{round(1 / x)}"
    return f"{x:.3g}"


def windows_text(indices: Sequence[int]) -> str:
    """``window 2`` or ``windows 0, 1, 3``."""
    return (
        "window " + str(indices[0])
        if len(indices) == 1
        else "windows " + ", ".join(str(i) for i in indices)
    )


def numbers(values: Sequence[float], digits: int = 3) -> str:
    """``values`` to ``digits`` significant digits, comma-separated."""
    return ", ".join(f"{v + 0.0:.{digits}g}" for v in values)  # + 0.0: no "-0"


def microbatch_counts(rows: Sequence[Row], attr: str, a: int) -> list[int]:
    """Count ``attr`` of the window's ``rows`` summed per microbatch."""
    out = [0] * a
    for row in rows:
        out[row.microbatch] += getattr(row, attr)
    return out


#: How the evidence describes each count a loop may divide by instead of the targets.
_DESCRIBED = {
    "label positions": "label positions after the shift, -100 included",
    "attention-mask tokens": "attention-mask tokens (prompt included, no shift)",
    "attention-mask tokens after the shift": (
        "attention-mask tokens minus one per row (shifted, but the prompt included)"
    ),
    "labels before the shift": (
        "labels before the shift (each row's first label included, which no prediction scores)"
    ),
}


def weighting_evidence(
    name: str,
    weighting: Weighting,
    audits: Sequence[WindowAudit],
    matches: Sequence[Matches | None],
    constrained: Sequence[int],
    rows: Sequence[Sequence[Row]],
) -> str:
    """Why ``weighting``, the one every analysed window (``constrained``) agrees with,
    names ``name``: the measured shares beside the counts they equal."""
    if name == "double_division":
        return _double_division(weighting, audits, matches, constrained)
    if name == "average_of_averages":
        return _average_of_averages(weighting, audits[constrained[0]], rows[constrained[0]])
    if name in ("ignored_tokens_counted", "count_before_shift"):
        return _other_count(name, weighting, audits, constrained, rows)
    if name == "short_window_divided_by_a":
        return _short_window(weighting, audits, constrained, rows)
    raise AssertionError(name)


def _short_window(
    weighting: Weighting,
    audits: Sequence[WindowAudit],
    constrained: Sequence[int],
    rows: Sequence[Sequence[Row]],
) -> str:
    """The windows shorter than the full ones, divided by the full A all the same."""
    full = max(audits[k].microbatches for k in constrained)
    short = [k for k in constrained if audits[k].microbatches < full]
    k = short[0]
    a = audits[k].microbatches
    per_mb = microbatch_counts(rows[k], "targets", a)
    return (
        f"{windows_text(short)} {'holds' if len(short) == 1 else 'hold'} {a} microbatches, "
        f"fewer than the {full} of the full windows; window {k}'s microbatches hold "
        f"{numbers(per_mb)} targets and reached the update with weights "
        f"{numbers(audits[k].weights or [])} (1 = correct), equal to {audits[k].targets} / "
        f"({weighting.key}) with the full A = {full}: each loss is divided by {full}, not by "
        f"the {a} microbatches the window holds (its gradient {a}/{full} of an average of "
        "averages over them)"
    )


def _double_division(
    weighting: Weighting,
    audits: Sequence[WindowAudit],
    matches: Sequence[Matches | None],
    constrained: Sequence[int],
) -> str:
    ratios = []
    for j in constrained:
        d = matches[j][weighting.key][1]  # type: ignore[index]
        a = audits[j].microbatches
        flat = [x for mb in audits[j].example_weights or [] for x in mb]
        used = [i for i, x in enumerate(flat) if abs(x) > AUDIT_TOLERANCE]
        ratios.append(
            (a, sum(flat[i] * d[i] / (audits[j].targets * a) for i in used) / max(1, len(used)))
        )
    sizes = sorted({a for a, _ in ratios}, reverse=True)
    base = (
        "the reference update"
        if weighting.key == "A × targets in the window"
        else "what the rest of the loop's weighting gives"
    )
    parts = []
    for j, a in enumerate(sizes):
        plural = "s" if sum(size == a for size, _ in ratios) > 1 else ""
        of = f" of {base}" if j == 0 else ""
        parts.append(f"{fraction(1 / a)}{of} in the window{plural} of {a} microbatches")
    return (
        "each contribution is divided by A once more than the loss needs: the update is "
        f"{', '.join(parts)} (measured ratios {numbers([r for _, r in ratios], 4)})"
    )


def _average_of_averages(weighting: Weighting, first: WindowAudit, rows: Sequence[Row]) -> str:
    k, weights = first.index, first.weights or []
    per_mb = microbatch_counts(rows, "targets", first.microbatches)
    if weighting.key == PER_EXAMPLE:
        flat = [x for mb in first.example_weights or [] for x in mb]
        return (
            f"in window {k} the examples hold {numbers([r.targets for r in rows])} "
            f"targets and reached the update with weights {numbers(flat)} (1 = "
            f"correct), equal to {first.targets} / ({weighting.key}): each example's "
            f"mean counts the same whatever its length; a target in the shortest "
            f"example weighs {max(flat) / min(flat):.3g} × one in the longest"
        )
    if weighting.key == MEAN_BY_EXAMPLES:
        examples = [sum(r.microbatch == i for r in rows) for i in range(first.microbatches)]
        text = (
            f"in window {k} the microbatches hold {numbers(per_mb)} targets in "
            f"{numbers(examples)} examples and reached the update with weights "
            f"{numbers(weights)} (1 = correct), equal to {first.targets} / "
            f"({weighting.key}): each microbatch's mean is weighted by its examples, "
            "not by its targets"
        )
    else:
        text = (
            f"in window {k} the microbatches hold {numbers(per_mb)} targets and reached "
            f"the update with weights {numbers(weights)} (1 = correct), equal to "
            f"{first.targets} / ({weighting.key}): each microbatch's mean counts the "
            "same whatever its size"
        )
    w = [x for x in weights if abs(x) > AUDIT_TOLERANCE]
    if len(w) > 1 and min(w) > 0:
        by_examples = weighting.key == MEAN_BY_EXAMPLES
        which = "one microbatch weighs up to" if by_examples else "the smallest microbatch weighs"
        text += (
            f"; a target in {which} {max(w) / min(w):.3g} × one in "
            f"{'another' if by_examples else 'the largest'}, and "
            "another split of the same examples gives another update"
        )
    return text


def _other_count(
    name: str,
    weighting: Weighting,
    audits: Sequence[WindowAudit],
    constrained: Sequence[int],
    rows: Sequence[Sequence[Row]],
) -> str:
    unit = weighting.unit
    attr = UNITS[unit][0]
    # quote a window where the count differs from the targets
    k = next(
        (j for j in constrained if any(getattr(r, attr) != r.targets for r in rows[j])),
        constrained[0],
    )
    first = audits[k]
    per_mb = microbatch_counts(rows[k], "targets", first.microbatches)
    counted = microbatch_counts(rows[k], attr, first.microbatches)
    text = (
        f"the denominator counts {_DESCRIBED[unit]}, not supervised targets: in window "
        f"{k} the microbatches hold {numbers(per_mb)} targets but {numbers(counted)} "
        f"{unit}, and the measured weights {numbers(first.weights or [])} (1 = correct) "
        f"equal {first.targets} / ({weighting.key})"
    )
    if weighting.key == MEAN_TIMES_LABELS:
        text = (
            f"each microbatch's mean loss is multiplied by its labels counted before the shift "
            f"and the window divided by their sum (torchtune's num_tokens): in window {k} the "
            f"microbatches hold {numbers(per_mb)} targets but {numbers(counted)} labels before "
            f"the shift ({sum(counted)} in the window for its {first.targets} targets), and the "
            f"measured weights {numbers(first.weights or [])} (1 = correct) equal "
            f"{first.targets} / ({weighting.key})"
        )
    if name == "count_before_shift":
        firsts = [r.key for r in rows[k] if r.labels > r.targets]
        shown = ", ".join(f"example {r} of microbatch {i}" for _, i, r in firsts)
        text += f"; the first label of {shown} is a target"
    return text


def shift_evidence(
    shift: int, bad: Sequence[int], audits: Sequence[WindowAudit], residual_at_1: Sequence[float]
) -> str:
    """The updates are exact combinations at label shift ``shift`` (0 or 2), not at 1."""
    what = (
        "its own input token (labels[:, t], no shift)"
        if shift == 0
        else "the token two places ahead (labels[:, t + 2], shifted twice)"
    )
    return (
        f"in {windows_text(bad)} the updates are exact combinations of the gradients of "
        f"each position predicting {what} (relative residual "
        f"{max(audits[k].residual for k in bad):.1g}), not of the next token "
        f"(labels[:, t + 1]: residual {max(residual_at_1[k] for k in bad):.2g})"
    )


def lost_evidence(
    found: Found,
    audits: Sequence[WindowAudit],
    late: set[RowKey],
    contributions: Contributions,
) -> dict[str, str]:
    """The examples lost (never trained, or trained only after the window's ``late``
    step) or trained twice, window by window, with the targets they hold."""
    groups: dict[str, list[tuple[str, Callable[[RowKey, int], bool]]]] = {
        "lost_microbatches": [
            ("never reached a backward pass whole", lambda key, n: n == 0),
            (
                "reached a backward pass only after the window's last optimizer.step()",
                lambda key, n: key in late,
            ),
        ],
        "duplicated_microbatch": [
            ("went through more than one backward pass", lambda key, n: n > 1)
        ],
    }
    out = {}
    for name, tests in groups.items():
        if not found[name]:
            continue
        windows, sentences, targets = sorted(set(found[name])), [], 0
        for verb, test in tests:
            parts = []
            for k in windows:
                items = []
                for i, passes in enumerate(audits[k].example_backward_passes):
                    hit = [r for r, n in enumerate(passes) if test((k, i, r), n)]
                    if not hit:
                        continue
                    targets += sum(contributions.by_key[(k, i, r)].targets for r in hit)
                    times = "" if name == "lost_microbatches" else f" ({max(passes)} ×)"
                    if len(hit) == len(passes):
                        items.append(f"microbatch {i}{times}")
                    else:
                        ex = ", ".join(map(str, hit))
                        plural = "s" if len(hit) > 1 else ""
                        items.append(f"example{plural} {ex} of microbatch {i}{times}")
                if items:
                    parts.append(f"window {k}: {', '.join(items)}")
            if parts:
                sentences.append(f"{'; '.join(parts)} {verb}")
        weights = audits[windows[0]].weights
        shares = (
            f"; weights in window {windows[0]}: {numbers(weights)} (1 = correct)" if weights else ""
        )
        out[name] = (
            f"{'; and '.join(sentences)} ({targets} of the controlled set's "
            f"{sum(contributions.totals)} targets){shares}"
        )
    return out


def count_evidence(audits: Sequence[WindowAudit], found: Found) -> dict[str, str]:
    """The calls per window: optimizer steps, scheduler steps, gradients cleared."""
    out = {}
    sizes = ", ".join(str(w.microbatches) for w in audits)
    if found["no_update"]:
        idle = found["no_update"]
        out["no_update"] = (
            f"optimizer.step() was not called in {windows_text(idle)} (of {len(audits)}), "
            f"after {sum(audits[k].backward_passes for k in idle)} backward passes"
        )
    if found["step_per_microbatch"]:
        steps = ", ".join(str(w.optimizer_steps) for w in audits)
        out["step_per_microbatch"] = (
            f"optimizer.step() ran {steps} times in windows of {sizes} microbatches (expected "
            f"once each): {sum(w.optimizer_steps for w in audits)} updates instead of "
            f"{len(audits)}"
        )
    if found["scheduler_per_microbatch"]:
        calls = [w.scheduler_steps for w in audits]
        out["scheduler_per_microbatch"] = (
            f"scheduler.step() ran {', '.join(map(str, calls))} times in windows of {sizes} "
            f"microbatches: {sum(calls)} schedule steps for {len(audits)} windows, so a "
            f"schedule counted in updates runs {sum(calls) / len(audits):.3g} × too fast"
        )
    if found["zero_grad_in_window"]:
        bad = sorted(set(found["zero_grad_in_window"]))
        w = audits[bad[0]]
        cleared = sum(audits[k].cleared_gradients for k in bad)
        how = (
            f"zero_grad ran {cleared} times between a backward pass and the optimizer.step() "
            "that should use it; "
            if cleared
            else ""
        )
        shares = f"weights {numbers(w.weights)}" if w.weights else "no gradient at all"
        out["zero_grad_in_window"] = (
            f"{how}in window {w.index} the update received {shares} of the "
            f"{w.microbatches} microbatches' contributions (1 = correct): the earlier "
            "microbatches' gradients were cleared before the step"
        )
    return out


def clip_evidence(audits: Sequence[WindowAudit], windows: Sequence[int]) -> str:
    """The clips of partial sums in ``windows``: how often, by which factors, and the
    weights the microbatches reached the update with."""
    first = audits[windows[0]]
    weights = (
        f"; the microbatches reached the update of window {first.index} with weights "
        f"{numbers(first.weights)} (1 = correct)"
        if first.weights
        else ""
    )
    return (
        "the gradient shrank between two backward passes of the same window "
        f"{', '.join(str(len(audits[k].clips)) for k in windows)} times "
        f"({windows_text(windows)}), its norm by factors {numbers(first.clips)} in window "
        f"{first.index}: each clip ran on a partial sum of the window's gradient, and every "
        f"later one shrank the earlier microbatches again{weights}. What each loss sum is "
        "divided by is not read in a window a clip distorted"
    )


def in_place_evidence(changed: Sequence[str]) -> str:
    """The tensors of the windows the loop changed (the first three named)."""
    shown = "; ".join(changed[:3]) + (f"; and {len(changed) - 3} more" if len(changed) > 3 else "")
    return (
        f"the loop changed {len(changed)} tensors of the windows it was given: {shown}. "
        "A data set that is read again (the next epoch, a retried window) then trains "
        "on the changed data"
    )
