"""One window's measurements: the shares of its updates, its label shift, its calls, the
examples it lost, trained twice or cleared, and the clips of partial sums; the mistakes
and notes they show on their own (the weighting is named over all windows, in
:mod:`.verdict`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .contributions import Contributions
from .controlled_set import AUDIT_TOLERANCE, RowKey
from .report import WindowAudit
from .shares import fit_shares, nested, per_microbatch
from .trace import UpdateTrace
from .weightings import Matches, matching

#: A fit at label shift 1 that nothing explains is tried at these shifts, named so.
SHIFTS = {0: "labels_not_shifted", 2: "labels_shifted_twice"}


@dataclass
class WindowMeasurement:
    """What :func:`measure_window` found in one window.

    ``audit``: the measurements (the report's :class:`WindowAudit`); ``names``: the
    mistakes this window shows on its own, in the order found (one may repeat);
    ``notes``: findings outside the vocabulary, by kind (``"carried"``, ``"stale"``,
    ``"unexplained"``, ``"unmatched"``); ``matches``: the weightings its shares agree with
    (None when they cannot be read); ``late``: examples trained only after the window's
    last step; ``residual_at_1``: the fit's residual at the next-token shift;
    ``shrunk``: whether the gradient shrank after a backward pass before the last step
    (a clip, between backward passes or before the step).
    """

    audit: WindowAudit
    names: list[str]
    notes: list[str]
    matches: Matches | None
    late: list[RowKey]
    residual_at_1: float
    shrunk: bool


def cleared_before_step(kinds: Sequence[str]) -> int:
    """``zero_grad`` calls that cleared gradients of a backward pass before any step used
    them (only counted when a later step of the window then ran on what was left)."""
    pending, cleared, lost = False, 0, 0
    for kind in kinds:
        if kind == "backward":
            pending = True
        elif kind == "zero_grad":
            cleared, pending = cleared + pending, False
        elif kind == "step":
            lost, cleared, pending = lost + cleared, 0, False
    return lost


def measure_window(
    k: int, trace: UpdateTrace, contributions: Contributions, starts: Sequence[int], final: Tensor
) -> WindowMeasurement:
    """Window ``k``'s measurements and what they show; ``starts[k]`` is the index in
    ``trace.thetas`` of the weights the window began at, ``final`` the weights after the
    last window."""
    rows, a = trace.rows[k], len(contributions.windows[k])
    names: list[str] = []
    notes: list[str] = []
    events = [(kind, i) for (w, kind, i) in trace.events if w == k]
    kinds = [kind for kind, _ in events]
    forwards = [i for kind, i in events if kind == "forward"]
    steps = [i for kind, i in events if kind == "step"]
    index = {row.key: j for j, row in enumerate(rows)}
    trained = [0] * len(rows)  # backward passes through each example
    for f in forwards:
        for key in trace.forwards[f].rows:
            if key is not None:
                trained[index[key]] += trace.forwards[f].backward

    # the gradient shrank after a backward pass and before the last step: a clip
    last_step = max((p for p, kind in enumerate(kinds) if kind == "step"), default=-1)
    backwards = [p for p, kind in enumerate(kinds) if kind == "backward"]
    shrinks = [p for p, kind in enumerate(kinds) if kind == "shrink" and p < last_step]
    shrinks = [p for p in shrinks if backwards and backwards[0] < p]
    clips = [p for p in shrinks if any(p < q < last_step for q in backwards)]
    if clips:
        names.append("clip_per_microbatch")

    fit, shift = fit_shares(trace, contributions, rows, k, steps, 1), 1
    residual_at_1 = fit.residual
    if steps and fit.residual > AUDIT_TOLERANCE:  # is it the targets that are misaligned?
        for other_shift, name in SHIFTS.items():
            alt = fit_shares(trace, contributions, rows, k, steps, other_shift)
            if alt.residual <= AUDIT_TOLERANCE:
                fit, shift = alt, other_shift
                names.append(name)
                break
    weights = fit.weights
    reference_grad = sum(
        (contributions.of(row.key, starts[k]) for row in rows), torch.zeros_like(final)
    )
    stepped = sum((trace.steps[s].grad for s in steps), torch.zeros_like(final))
    error = float((stepped - reference_grad).norm() / reference_grad.norm())
    exact = fit.residual <= AUDIT_TOLERANCE

    if not steps:
        names.append("no_update")
    if len(steps) > 1:
        names.append("step_per_microbatch")
    if kinds.count("scheduler") > 1:
        names.append("scheduler_per_microbatch")
    lost = [j for j in range(len(rows)) if trained[j] == 0]
    if lost:
        names.append("lost_microbatches")
    used = [j for j in range(len(rows)) if abs(weights[j]) > AUDIT_TOLERANCE]
    if steps and any(trained[j] > 1 for j in used):
        names.append("duplicated_microbatch")
    # examples whose backward ran before the window's last step but did not reach it
    lost_clears = cleared_before_step(kinds)
    backed = {
        index[key]
        for p, (kind, f) in enumerate(events)
        if kind == "backward" and p < last_step
        for key in trace.forwards[f].rows
        if key is not None and key[0] == k  # (a delayed backward of an earlier window)
    }
    cleared = [j for j in backed if abs(weights[j]) <= AUDIT_TOLERANCE]
    # a clip of partial sums shrinks the early examples towards 0 without clearing them
    if lost_clears or (cleared and exact and not clips):
        names.append("zero_grad_in_window")
    late = [  # trained only after the window's last step: no update of it used them
        j for j in range(len(rows)) if steps and trained[j] and j not in backed
    ]
    late_keys: list[RowKey] = []
    if late and exact and all(abs(weights[j]) <= AUDIT_TOLERANCE for j in late):
        names.append("lost_microbatches")
        late_keys = [rows[j].key for j in late]
    if fit.carried > AUDIT_TOLERANCE and exact:  # else the shares mean nothing
        notes.append("stale" if steps and not used else "carried")
    if not exact and not clips:  # a clamp of each entry is no combination: the clip says it
        notes.append("unexplained")
    if any(None in trace.forwards[f].rows for f in forwards if trace.forwards[f].backward):
        notes.append("unmatched")
    audit = WindowAudit(
        index=k,
        microbatches=a,
        targets=contributions.totals[k],
        forwards=len(forwards),
        backward_passes=kinds.count("backward"),
        optimizer_steps=len(steps),
        scheduler_steps=kinds.count("scheduler"),
        zero_grad_calls=kinds.count("zero_grad"),
        weights=per_microbatch(rows, weights, a) if steps else None,
        update_error=error if steps else None,
        carried=fit.carried,
        residual=fit.residual,
        cleared_gradients=lost_clears,
        kept_tensors=0,
        example_weights=nested(rows, [round(x, 12) for x in weights], a) if steps else None,
        example_backward_passes=nested(rows, trained, a),
        label_shift=shift if exact else None,
        examples=len(rows),
        rows_forwarded=sum(len(trace.forwards[f].rows) for f in forwards),
        clips=[trace.shrinks[events[p][1]] for p in clips],
    )
    readable = steps and used and exact and not clips
    matches = (
        matching(
            rows, contributions.totals[k], weights, trained, used, bool(lost),
            full_a=max(len(w) for w in contributions.windows),
        )
        if readable
        else None
    )
    return WindowMeasurement(audit, names, notes, matches, late_keys, residual_at_1, bool(shrinks))
