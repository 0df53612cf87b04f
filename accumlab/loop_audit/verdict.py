"""The verdict: the measurements of every window (shares, label shift, calls, lost,
duplicated and cleared examples) turned into mistake names and notes."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .controlled_set import _TOL
from .evidence import (
    _count_evidence,
    _Evidence,
    _kept_evidence,
    _numbers,
    _windows_text,
)
from .mistakes import MISTAKES
from .report import AuditReport, WindowAudit
from .shares import _choose_weighting, _near, _Weighting


def _cleared_before_step(kinds: Sequence[str]) -> int:
    """How often ``zero_grad`` cleared a backward pass's gradient before any step used it
    (only counted when a later step of the window then ran on what was left)."""
    pending, cleared, lost = False, 0, 0
    for kind in kinds:
        if kind == "backward":
            pending = True
        elif kind == "zero_grad":
            cleared, pending = cleared + pending, False
        elif kind == "step":
            lost, cleared, pending = lost + cleared, 0, False
    return lost


_SHIFTS = {0: "labels_not_shifted", 2: "labels_shifted_twice"}


class _Verdict(_Evidence):
    """Everything measured on the watched run, turned into an :class:`AuditReport`."""

    def _window(
        self,
        k: int,
        found: dict[str, list[int]],
        notes: dict[str, list[int]],
        residual_at_1: dict[int, float],
    ) -> tuple[WindowAudit, dict[str, tuple[_Weighting, list[float]]] | None]:
        """Window ``k``'s measurements, the mistakes and notes they show (added to
        ``found`` and ``notes``), and the weightings its example shares agree with."""
        watch, rows, a = self.watch, self.rows[k], len(self.windows[k])
        events = [(kind, i) for (w, kind, i) in watch.events if w == k]
        kinds = [kind for kind, _ in events]
        forwards = [i for kind, i in events if kind == "forward"]
        steps = [i for kind, i in events if kind == "step"]
        index = {row.key: j for j, row in enumerate(rows)}
        trained = [0] * len(rows)  # backward passes through each example
        for f in forwards:
            for key in watch.forwards[f].rows:
                if key is not None:
                    trained[index[key]] += watch.forwards[f].backward

        fit, shift = self._fit_window(k, steps, 1), 1
        residual_at_1[k] = fit.residual
        if steps and fit.residual > _TOL:  # is it the targets that are misaligned?
            for other_shift in _SHIFTS:
                alt = self._fit_window(k, steps, other_shift)
                if alt.residual <= _TOL:
                    fit, shift = alt, other_shift
                    found[_SHIFTS[shift]].append(k)
                    break
        weights = fit.weights
        reference_grad = sum(
            (self.contribution(row.key, self.starts[k]) for row in rows),
            torch.zeros_like(self.final),
        )
        stepped = sum((watch.steps[s].grad for s in steps), torch.zeros_like(self.final))
        error = float((stepped - reference_grad).norm() / reference_grad.norm())

        if not steps:
            found["no_update"].append(k)
        if len(steps) > 1:
            found["step_per_microbatch"].append(k)
        if kinds.count("scheduler") > 1:
            found["scheduler_per_microbatch"].append(k)
        lost = [j for j in range(len(rows)) if trained[j] == 0]
        if lost:
            found["lost_microbatches"].append(k)
        used = [j for j in range(len(rows)) if abs(weights[j]) > _TOL]
        if steps and any(trained[j] > 1 for j in used):
            found["duplicated_microbatch"].append(k)
        # examples whose backward ran before the window's last step but did not reach it
        lost_clears = _cleared_before_step(kinds)
        last_step = max((p for p, kind in enumerate(kinds) if kind == "step"), default=-1)
        backed = {
            index[key]
            for p, (kind, f) in enumerate(events)
            if kind == "backward" and p < last_step
            for key in watch.forwards[f].rows
            if key is not None and key[0] == k  # (a delayed backward of an earlier window)
        }
        cleared = [j for j in backed if abs(weights[j]) <= _TOL]
        if lost_clears or (cleared and fit.residual <= _TOL):
            found["zero_grad_in_window"].append(k)
        late = [  # trained only after the window's last step: no update of it used them
            j for j in range(len(rows)) if steps and trained[j] and j not in backed
        ]
        if late and fit.residual <= _TOL and all(abs(weights[j]) <= _TOL for j in late):
            found["lost_microbatches"].append(k)
            self.late.update(rows[j].key for j in late)
        if fit.carried > _TOL and fit.residual <= _TOL:  # else the shares mean nothing
            notes["stale" if steps and not used else "carried"].append(k)
        if fit.residual > _TOL:
            notes["unexplained"].append(k)
        if any(None in watch.forwards[f].rows for f in forwards if watch.forwards[f].backward):
            notes["unmatched"].append(k)
        audit = WindowAudit(
            index=k,
            microbatches=a,
            targets=self.totals[k],
            forwards=len(forwards),
            backward_passes=kinds.count("backward"),
            optimizer_steps=len(steps),
            scheduler_steps=kinds.count("scheduler"),
            zero_grad_calls=kinds.count("zero_grad"),
            weights=self._per_microbatch(rows, weights, a) if steps else None,
            update_error=error if steps else None,
            carried=fit.carried,
            residual=fit.residual,
            cleared_gradients=lost_clears,
            kept_tensors=0,
            example_weights=self._nested(rows, [round(x, 12) for x in weights], a)
            if steps
            else None,
            example_backward_passes=self._nested(rows, trained, a),
            label_shift=shift if fit.residual <= _TOL else None,
            examples=len(rows),
            rows_forwarded=sum(len(watch.forwards[f].rows) for f in forwards),
        )
        constrained = steps and used and fit.residual <= _TOL
        return audit, self._matching(k, weights, trained, used, lost) if constrained else None

    def report(self, optimizer: torch.optim.Optimizer, changed: list[str]) -> AuditReport:
        found: dict[str, list[int]] = {name: [] for name in MISTAKES}  # windows showing each
        evidence: dict[str, str] = {}
        other: list[str] = []
        notes: dict[str, list[int]] = {
            "carried": [],
            "stale": [],
            "unexplained": [],
            "unmatched": [],
        }
        residual_at_1: dict[int, float] = {}
        audits: list[WindowAudit] = []
        matches: list[dict[str, tuple[_Weighting, list[float]]] | None] = []
        for k in range(len(self.windows)):
            audit, match = self._window(k, found, notes, residual_at_1)
            audits.append(audit)
            matches.append(match)

        self._notes(notes, audits, other)
        self._weighting_findings(matches, audits, found, evidence, other)
        self._scheduler_order(audits, found, evidence)
        for shift, name in _SHIFTS.items():
            if found[name]:
                evidence[name] = self._shift_evidence(shift, found[name], audits, residual_at_1)
        if changed:
            found["window_modified_in_place"].append(0)
            shown = "; ".join(changed[:3]) + (
                f"; and {len(changed) - 3} more" if len(changed) > 3 else ""
            )
            evidence["window_modified_in_place"] = (
                f"the loop changed {len(changed)} tensors of the windows it was given: {shown}. "
                "A data set that is read again (the next epoch, a retried window) then trains "
                "on the changed data"
            )
        self._lost_evidence(found, audits, evidence)
        _kept_evidence(self.watch, optimizer, audits, found, evidence)
        _count_evidence(audits, found, evidence)
        mistakes = [name for name in MISTAKES if found[name]]
        off = [w.index for w in audits if w.update_error is not None and w.update_error > _TOL]
        if not mistakes and not other and off:
            other.append(  # never an ok text quoting a large error
                f"{_windows_text(off)}: the update differs from the correct one (largest "
                f"relative error {max(audits[k].update_error or 0.0 for k in off):.2g}, "
                f"tolerance {_TOL:.0e}) in a way the audit cannot attribute"
            )
        return AuditReport(
            mistakes,
            {n: evidence[n] for n in mistakes},
            other,
            audits,
            reference_forwards=len(self._cache),
        )

    def _scheduler_order(
        self, audits: list[WindowAudit], found: dict[str, list[int]], evidence: dict[str, str]
    ) -> None:
        """A ``scheduler.step()`` that runs before the ``optimizer.step()`` it belongs to: at
        a window's first step, more schedule steps than earlier updates. A schedule stepped
        per microbatch is ahead too, and already named for it."""
        schedules, updates, seen = 0, 0, set()
        for window, kind, _ in self.watch.events:
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
            else f"an update {_numbers(before)} later (per window)"
        )
        evidence["scheduler_before_optimizer"] = (
            f"at the first optimizer.step() of {_windows_text(ahead)} the scheduler had "
            f"already been stepped {_numbers(stepped)} times "
            f"for {_numbers(earlier)} earlier updates: scheduler.step() ran before the "
            "optimizer.step() it belongs to, so each update ran at the learning rate the "
            f"schedule gives {later}"
        )

    def _weighting_findings(
        self,
        matches: list[dict[str, tuple[_Weighting, list[float]]] | None],
        audits: list[WindowAudit],
        found: dict[str, list[int]],
        evidence: dict[str, str],
        other: list[str],
    ) -> None:
        """The weighting every analysed window agrees with names its mistakes; none is a
        finding outside the vocabulary, described as a factor when it is one."""
        weighting = _choose_weighting(matches)
        constrained = [k for k, m in enumerate(matches) if m is not None]
        if constrained and weighting is None:
            shown = ", ".join(
                f"window {k}: " + _numbers(audits[k].weights or []) for k in constrained[:2]
            )
            other.append(
                "the updates weight the microbatches in a way no known mistake explains "
                f"(share of each microbatch's correct contribution, {shown})"
            )
            flat = [[x for mb in audits[k].example_weights or [] for x in mb] for k in constrained]
            if all(all(_near(x, w[0]) for x in w) for w in flat):
                implied = [audits[k].targets / w[0] for k, w in zip(constrained, flat, strict=True)]
                other.append(
                    "every example's share is the same within each window: each update is the "
                    "correct one times a factor, as if the loss sums were divided by "
                    f"{_numbers(implied)} in {_windows_text(constrained)} instead of their "
                    f"{_numbers([audits[k].targets for k in constrained])} targets (a count of "
                    "something else, a constant factor, or clipping below the gradient norm)"
                )
        elif weighting is not None:
            for name in weighting.mistakes:
                if name == "count_before_shift" and found["labels_not_shifted"]:
                    # a loss that does not shift scores each row's first label, so counting
                    # the labels before the shift counts what it scores: the shift is named
                    continue
                found[name].extend(constrained)
                evidence[name] = self._weighting_evidence(
                    name, weighting, audits, matches, constrained
                )
            if weighting.note:
                other.append(weighting.note)

    def _notes(
        self, notes: dict[str, list[int]], audits: list[WindowAudit], other: list[str]
    ) -> None:
        if notes["carried"]:
            other.append(
                f"{_windows_text(notes['carried'])}: gradients of earlier windows were still in "
                ".grad at optimizer.step() (largest share "
                f"{max(audits[k].carried for k in notes['carried']):.3g}); clear the gradients "
                "once per window with optimizer.zero_grad()"
            )
        if notes["stale"]:
            other.append(
                f"{_windows_text(notes['stale'])}: optimizer.step() applied only gradients of "
                "earlier windows: it ran before this window's backward passes; call it after "
                "the window's last backward pass"
            )
        if notes["unexplained"]:
            other.append(
                f"{_windows_text(notes['unexplained'])}: the gradient at optimizer.step() is not "
                "a combination of the microbatch gradients (largest relative residual "
                f"{max(audits[k].residual for k in notes['unexplained']):.2g}): something else "
                "changed it (clipping below the gradient norm, another loss, other inputs)"
            )
        if notes["unmatched"]:
            other.append(
                f"{_windows_text(notes['unmatched'])}: backward passes through inputs that are "
                "not rows of the window's microbatches; the audit cannot attribute them"
            )
        if not any(w.scheduler_steps for w in audits):
            other.append(
                "scheduler.step() was never called: a schedule defined in updates needs one "
                "call per update, after optimizer.step()"
            )
        elif skipped := [w.index for w in audits if not w.scheduler_steps and w.optimizer_steps]:
            other.append(
                f"{_windows_text(skipped)}: an update without scheduler.step(); the schedule "
                "falls behind the updates (call it once per update, after optimizer.step())"
            )
        moved = [
            w.index
            for w in audits
            if not w.optimizer_steps
            and w.index + 1 < len(audits)
            and self.starts[w.index + 1] != self.starts[w.index]
        ]
        if not audits[-1].optimizer_steps and not torch.equal(
            self.final, self.watch.thetas[self.starts[-1]]
        ):
            moved.append(audits[-1].index)
        if moved:
            other.append(
                f"{_windows_text(moved)}: the weights changed without optimizer.step(); the "
                "audit can only check updates made by the optimizer"
            )
