"""The verdict: every window's measurements (:mod:`.window`) turned into mistake names,
each with its evidence (:mod:`.evidence`), and findings outside the vocabulary."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ..mistakes import reported_by
from .contributions import Contributions
from .controlled_set import AUDIT_TOLERANCE
from .evidence import (
    Found,
    clip_evidence,
    count_evidence,
    in_place_evidence,
    lost_evidence,
    numbers,
    shift_evidence,
    weighting_evidence,
    windows_text,
)
from .kept import kept_references
from .report import AuditReport, WindowAudit
from .trace import UpdateTrace
from .weightings import Matches, choose_weighting, near
from .window import SHIFTS, measure_window

#: Every name the loop audit can report, in the shared table's order.
LOOP_MISTAKES = reported_by("loop")


def verdict(
    trace: UpdateTrace,
    contributions: Contributions,
    starts: Sequence[int],
    final: Tensor,
    optimizer: torch.optim.Optimizer,
    changed: Sequence[str],
) -> AuditReport:
    """Measure every window of the traced run and name what differs from the correct
    updates; ``changed`` lists the tensors the loop changed in its windows."""
    measured = [
        measure_window(k, trace, contributions, starts, final) for k in range(len(trace.rows))
    ]
    audits = [m.audit for m in measured]
    found: Found = {name: [] for name in LOOP_MISTAKES}
    notes: dict[str, list[int]] = {"carried": [], "stale": [], "unexplained": [], "unmatched": []}
    for k, m in enumerate(measured):
        for name in m.names:
            found[name].append(k)
        for note in m.notes:
            notes[note].append(k)
    matches = [m.matches for m in measured]
    if found["clip_per_microbatch"]:  # a clip before the step distorts a window's weighting
        matches = [None if m.shrunk else m.matches for m in measured]
    evidence: dict[str, str] = {}
    other: list[str] = []

    _notes(notes, audits, trace, starts, final, other)
    _weighting_findings(matches, audits, trace, found, evidence, other)
    _scheduler_order(trace, audits, found, evidence)
    residual_at_1 = [m.residual_at_1 for m in measured]
    for shift, name in SHIFTS.items():
        if found[name]:
            evidence[name] = shift_evidence(shift, found[name], audits, residual_at_1)
    if found["clip_per_microbatch"]:
        evidence["clip_per_microbatch"] = clip_evidence(
            audits, sorted(set(found["clip_per_microbatch"]))
        )
    if changed:
        found["window_modified_in_place"].append(0)
        evidence["window_modified_in_place"] = in_place_evidence(changed)
    late = {key for m in measured for key in m.late}
    evidence.update(lost_evidence(found, audits, late, contributions))
    kept, kept_text = kept_references(trace, optimizer, audits)
    if kept_text is not None:
        found["kept_references"].extend(kept)
        evidence["kept_references"] = kept_text
    evidence.update(count_evidence(audits, found))
    mistakes = [name for name in LOOP_MISTAKES if found[name]]
    off = [
        w.index for w in audits if w.update_error is not None and w.update_error > AUDIT_TOLERANCE
    ]
    if not mistakes and not other and off:
        other.append(  # never an ok text quoting a large error
            f"{windows_text(off)}: the update differs from the correct one (largest "
            f"relative error {max(audits[k].update_error or 0.0 for k in off):.2g}, "
            f"tolerance {AUDIT_TOLERANCE:.0e}) in a way the audit cannot attribute"
        )
    return AuditReport(
        mistakes,
        {n: evidence[n] for n in mistakes},
        other,
        audits,
        reference_forwards=contributions.computed,
    )


def _scheduler_order(
    trace: UpdateTrace, audits: Sequence[WindowAudit], found: Found, evidence: dict[str, str]
) -> None:
    """A ``scheduler.step()`` that runs before the ``optimizer.step()`` it belongs to: at a
    window's first step, more schedule steps than earlier updates. A schedule stepped per
    microbatch is ahead too, and already named for it."""
    schedules, updates, seen = 0, 0, set()
    for window, kind, _ in trace.events:
        if kind == "scheduler":
            schedules += 1
        elif kind == "step":
            if window >= 0 and window not in seen:
                seen.add(window)
                audits[window].scheduler_ahead = schedules - updates
            updates += 1
    ahead = [w.index for w in audits if w.scheduler_ahead > 0]
    if not ahead or found["scheduler_per_microbatch"]:
        return
    found["scheduler_before_optimizer"].extend(ahead)
    before = [audits[k].scheduler_ahead for k in ahead]
    earlier = [sum(w.optimizer_steps for w in audits[:k]) for k in ahead]
    stepped = [b + e for b, e in zip(before, earlier, strict=True)]
    later = (
        "the next update"
        if set(before) == {1}
        else f"an update {numbers(before)} later (per window)"
    )
    evidence["scheduler_before_optimizer"] = (
        f"at the first optimizer.step() of {windows_text(ahead)} the scheduler had "
        f"already been stepped {numbers(stepped)} times "
        f"for {numbers(earlier)} earlier updates: scheduler.step() ran before the "
        "optimizer.step() it belongs to, so each update ran at the learning rate the "
        f"schedule gives {later}"
    )


def _weighting_findings(
    matches: Sequence[Matches | None],
    audits: Sequence[WindowAudit],
    trace: UpdateTrace,
    found: Found,
    evidence: dict[str, str],
    other: list[str],
) -> None:
    """The weighting every analysed window agrees with names its mistakes; none is a
    finding outside the vocabulary, described as a factor when it is one."""
    weighting = choose_weighting(matches)
    constrained = [k for k, m in enumerate(matches) if m is not None]
    if constrained and weighting is None:
        shown = ", ".join(
            f"window {k}: " + numbers(audits[k].weights or []) for k in constrained[:2]
        )
        other.append(
            "the updates weight the microbatches in a way no known mistake explains "
            f"(share of each microbatch's correct contribution, {shown})"
        )
        flat = [[x for mb in audits[k].example_weights or [] for x in mb] for k in constrained]
        if all(all(near(x, w[0]) for x in w) for w in flat):
            implied = [audits[k].targets / w[0] for k, w in zip(constrained, flat, strict=True)]
            other.append(
                "every example's share is the same within each window: each update is the "
                "correct one times a factor, as if the loss sums were divided by "
                f"{numbers(implied)} in {windows_text(constrained)} instead of their "
                f"{numbers([audits[k].targets for k in constrained])} targets (a count of "
                "something else, a constant factor, or clipping below the gradient norm)"
            )
    elif weighting is not None:
        for name in weighting.mistakes:
            if name == "count_before_shift" and found["labels_not_shifted"]:
                # a loss that does not shift scores each row's first label, so counting
                # the labels before the shift counts what it scores: the shift is named
                continue
            found[name].extend(constrained)
            evidence[name] = weighting_evidence(
                name, weighting, audits, matches, constrained, trace.rows
            )
        if weighting.note:
            other.append(weighting.note)


def _notes(
    notes: dict[str, list[int]],
    audits: Sequence[WindowAudit],
    trace: UpdateTrace,
    starts: Sequence[int],
    final: Tensor,
    other: list[str],
) -> None:
    """The findings outside the vocabulary, one sentence each."""
    if notes["carried"]:
        other.append(
            f"{windows_text(notes['carried'])}: gradients of earlier windows were still in "
            ".grad at optimizer.step() (largest share "
            f"{max(audits[k].carried for k in notes['carried']):.3g}); clear the gradients "
            "once per window with optimizer.zero_grad()"
        )
    if notes["stale"]:
        other.append(
            f"{windows_text(notes['stale'])}: optimizer.step() applied only gradients of "
            "earlier windows: it ran before this window's backward passes; call it after "
            "the window's last backward pass"
        )
    if notes["unexplained"]:
        other.append(
            f"{windows_text(notes['unexplained'])}: the gradient at optimizer.step() is not "
            "a combination of the microbatch gradients (largest relative residual "
            f"{max(audits[k].residual for k in notes['unexplained']):.2g}): something else "
            "changed it (clipping below the gradient norm, another loss, other inputs)"
        )
    if notes["unmatched"]:
        other.append(
            f"{windows_text(notes['unmatched'])}: backward passes through inputs that are "
            "not rows of the window's microbatches; the audit cannot attribute them"
        )
    if not any(w.scheduler_steps for w in audits):
        other.append(
            "scheduler.step() was never called: a schedule defined in updates needs one "
            "call per update, after optimizer.step()"
        )
    elif skipped := [w.index for w in audits if not w.scheduler_steps and w.optimizer_steps]:
        other.append(
            f"{windows_text(skipped)}: an update without scheduler.step(); the schedule "
            "falls behind the updates (call it once per update, after optimizer.step())"
        )
    moved = [
        w.index
        for w in audits
        if not w.optimizer_steps
        and w.index + 1 < len(audits)
        and starts[w.index + 1] != starts[w.index]
    ]
    if not audits[-1].optimizer_steps and not torch.equal(final, trace.thetas[starts[-1]]):
        moved.append(audits[-1].index)
    if moved:
        other.append(
            f"{windows_text(moved)}: the weights changed without optimizer.step(); the "
            "audit can only check updates made by the optimizer"
        )
