"""The evidence each mistake's name quotes: the measured shares, counts and tensors,
as sentences."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor
from torch.utils._pytree import tree_leaves

from .controlled_set import _TOL, RowKey, _Row
from .report import WindowAudit
from .shares import _UNITS, MEAN_BY_EXAMPLES, PER_EXAMPLE, _Shares, _Weighting
from .watch import _Watch


def _fraction(x: float) -> str:
    """``0.25`` as ``1/4``, ``2.0`` as ``2``: the ratios the report quotes."""
    if x > 0 and abs(1 / x - round(1 / x)) < 1e-6 and round(1 / x) > 1:
        return f"1/{round(1 / x)}"
    return f"{x:.3g}"


def _windows_text(indices: Sequence[int]) -> str:
    return (
        "window " + str(indices[0])
        if len(indices) == 1
        else "windows " + ", ".join(str(i) for i in indices)
    )


def _numbers(values: Sequence[float], digits: int = 3) -> str:
    return ", ".join(f"{v + 0.0:.{digits}g}" for v in values)  # + 0.0: no "-0"


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


class _Evidence(_Shares):
    """The evidence sentences that quote the measured shares (for the weighting, shift
    and lost or duplicated examples)."""

    def _weighting_evidence(
        self,
        name: str,
        weighting: _Weighting,
        audits: list[WindowAudit],
        matches: list[dict[str, tuple[_Weighting, list[float]]] | None],
        constrained: list[int],
    ) -> str:
        k = constrained[0]
        first = audits[k]
        weights = first.weights or []
        rows = self.rows[k]
        per_mb = _microbatch_counts(rows, "targets", first.microbatches)
        if name == "double_division":
            ratios = []
            for j in constrained:
                d = matches[j][weighting.key][1]  # type: ignore[index]
                a = audits[j].microbatches
                flat = [x for mb in audits[j].example_weights or [] for x in mb]
                used = [i for i, x in enumerate(flat) if abs(x) > _TOL]
                ratios.append(
                    (
                        a,
                        sum(flat[i] * d[i] / (audits[j].targets * a) for i in used)
                        / max(1, len(used)),
                    )
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
                parts.append(f"{_fraction(1 / a)}{of} in the window{plural} of {a} microbatches")
            return (
                "each contribution is divided by A once more than the loss needs: the update is "
                f"{', '.join(parts)} (measured ratios {_numbers([r for _, r in ratios], 4)})"
            )
        if name == "average_of_averages":
            if weighting.key == PER_EXAMPLE:
                flat = [x for mb in first.example_weights or [] for x in mb]
                return (
                    f"in window {k} the examples hold {_numbers([r.targets for r in rows])} "
                    f"targets and reached the update with weights {_numbers(flat)} (1 = "
                    f"correct), equal to {first.targets} / ({weighting.key}): each example's "
                    f"mean counts the same whatever its length; a target in the shortest "
                    f"example weighs {max(flat) / min(flat):.3g} × one in the longest"
                )
            if weighting.key == MEAN_BY_EXAMPLES:
                examples = [sum(r.microbatch == i for r in rows) for i in range(first.microbatches)]
                text = (
                    f"in window {k} the microbatches hold {_numbers(per_mb)} targets in "
                    f"{_numbers(examples)} examples and reached the update with weights "
                    f"{_numbers(weights)} (1 = correct), equal to {first.targets} / "
                    f"({weighting.key}): each microbatch's mean is weighted by its examples, "
                    "not by its targets"
                )
            else:
                text = (
                    f"in window {k} the microbatches hold {_numbers(per_mb)} targets and reached "
                    f"the update with weights {_numbers(weights)} (1 = correct), equal to "
                    f"{first.targets} / ({weighting.key}): each microbatch's mean counts the "
                    "same whatever its size"
                )
            w = [x for x in weights if abs(x) > _TOL]
            if len(w) > 1 and min(w) > 0:
                which = (
                    "one microbatch weighs up to"
                    if weighting.key == MEAN_BY_EXAMPLES
                    else "the smallest microbatch weighs"
                )
                text += (
                    f"; a target in {which} {max(w) / min(w):.3g} × one in "
                    f"{'another' if weighting.key == MEAN_BY_EXAMPLES else 'the largest'}, and "
                    "another split of the same examples gives another update"
                )
            return text
        if name in ("ignored_tokens_counted", "count_before_shift"):
            unit = weighting.unit
            attr = _UNITS[unit][0]
            # quote a window where the count differs from the targets
            k = next(
                (
                    j
                    for j in constrained
                    if any(getattr(r, attr) != r.targets for r in self.rows[j])
                ),
                k,
            )
            first, rows = audits[k], self.rows[k]
            per_mb = _microbatch_counts(rows, "targets", first.microbatches)
            counted = _microbatch_counts(rows, attr, first.microbatches)
            text = (
                f"the denominator counts {_DESCRIBED[unit]}, not supervised targets: in window "
                f"{k} the microbatches hold {_numbers(per_mb)} targets but {_numbers(counted)} "
                f"{unit}, and the measured weights {_numbers(first.weights or [])} (1 = correct) "
                f"equal {first.targets} / ({weighting.key})"
            )
            if name == "count_before_shift":
                firsts = [r.key for r in rows if r.labels > r.targets]
                shown = ", ".join(f"example {r} of microbatch {i}" for _, i, r in firsts)
                text += f"; the first label of {shown} is a target"
            return text
        raise AssertionError(name)

    def _shift_evidence(
        self, shift: int, bad: list[int], audits: list[WindowAudit], residual_at_1: dict[int, float]
    ) -> str:
        what = (
            "its own input token (labels[:, t], no shift)"
            if shift == 0
            else "the token two places ahead (labels[:, t + 2], shifted twice)"
        )
        return (
            f"in {_windows_text(bad)} the updates are exact combinations of the gradients of "
            f"each position predicting {what} (relative residual "
            f"{max(audits[k].residual for k in bad):.1g}), not of the next token "
            f"(labels[:, t + 1]: residual {max(residual_at_1[k] for k in bad):.2g})"
        )

    def _lost_evidence(
        self, found: dict[str, list[int]], audits: list[WindowAudit], evidence: dict[str, str]
    ) -> None:
        groups: dict[str, list[tuple[str, Callable[[RowKey, int], bool]]]] = {
            "lost_microbatches": [
                ("never reached a backward pass whole", lambda key, n: n == 0),
                (
                    "reached a backward pass only after the window's last optimizer.step()",
                    lambda key, n: key in self.late,
                ),
            ],
            "duplicated_microbatch": [
                ("went through more than one backward pass", lambda key, n: n > 1)
            ],
        }
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
                        targets += sum(self.by_key[(k, i, r)].targets for r in hit)
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
                f"; weights in window {windows[0]}: {_numbers(weights)} (1 = correct)"
                if weights
                else ""
            )
            evidence[name] = (
                f"{'; and '.join(sentences)} ({targets} of the controlled set's "
                f"{sum(self.totals)} targets){shares}"
            )


def _microbatch_counts(rows: Sequence[_Row], attr: str, a: int) -> list[int]:
    out = [0] * a
    for row in rows:
        out[row.microbatch] += getattr(row, attr)
    return out


def _count_evidence(
    audits: list[WindowAudit], found: dict[str, list[int]], evidence: dict[str, str]
) -> None:
    sizes = ", ".join(str(w.microbatches) for w in audits)
    if found["no_update"]:
        idle = found["no_update"]
        evidence["no_update"] = (
            f"optimizer.step() was not called in {_windows_text(idle)} (of {len(audits)}), "
            f"after {sum(audits[k].backward_passes for k in idle)} backward passes"
        )
    if found["step_per_microbatch"]:
        steps = ", ".join(str(w.optimizer_steps) for w in audits)
        evidence["step_per_microbatch"] = (
            f"optimizer.step() ran {steps} times in windows of {sizes} microbatches (expected "
            f"once each): {sum(w.optimizer_steps for w in audits)} updates instead of "
            f"{len(audits)}"
        )
    if found["scheduler_per_microbatch"]:
        calls = [w.scheduler_steps for w in audits]
        evidence["scheduler_per_microbatch"] = (
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
        shares = f"weights {_numbers(w.weights)}" if w.weights else "no gradient at all"
        evidence["zero_grad_in_window"] = (
            f"{how}in window {w.index} the update received {shares} of the "
            f"{w.microbatches} microbatches' contributions (1 = correct): the earlier "
            "microbatches' gradients were cleared before the step"
        )


def _kept_evidence(
    watch: _Watch,
    optimizer: torch.optim.Optimizer,
    audits: list[WindowAudit],
    found: dict[str, list[int]],
    evidence: dict[str, str],
) -> None:
    """Tensors created during a window and alive after the last one (after gc.collect())."""
    owned = {id(p) for p in watch.params} | {id(p.grad) for p in watch.params if p.grad is not None}
    owned |= {id(t) for t in tree_leaves(list(optimizer.state.values())) if isinstance(t, Tensor)}
    graph, nbytes, storages, earlier = 0, 0, set(), []
    last = len(watch.created) - 1
    for k, mode in enumerate(watch.created):
        alive = {}
        for ref in mode.refs:
            t = ref()
            if t is None or id(t) in owned or (t.dim() == 0 and t.grad_fn is None):
                continue  # a detached scalar (a logged loss value) holds no activations
            alive[id(t)] = t
        audits[k].kept_tensors = len(alive)
        if k < last and alive:
            earlier.append(k)
            for t in alive.values():
                graph += t.grad_fn is not None
                key = t.untyped_storage().data_ptr()
                if key not in storages:
                    storages.add(key)
                    nbytes += t.untyped_storage().nbytes()
    # The first window may make what lives on once (a cache, a scaler's state); a leak
    # leaves tensors behind window after window, so it shows in the middle ones too.
    if any(0 < k < last for k in earlier):
        found["kept_references"].extend(earlier)
        left = ", ".join(str(w.kept_tensors) for w in audits)
        total = sum(audits[k].kept_tensors for k in earlier)
        evidence["kept_references"] = (
            f"{total} tensors created in earlier windows were still alive after the last "
            f"window and gc.collect() ({graph} attached to an autograd graph, {nbytes} bytes "
            f"of storage); tensors left alive per window: {left}"
        )
