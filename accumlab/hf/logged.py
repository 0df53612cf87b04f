"""The numbers the Trainer logs for an audited window, against what they should be.

Users see an accumulation mistake in a logged number first ("the loss is 8 times
larger at A = 8", "grad_norm is 4 times higher"), and a logged number can be wrong while
the update is right, or right while the update is wrong. The Trainer adds what each
``training_step`` returns to its running loss, so the ``loss`` it logs for a window is
the sum of those returns (the mean over ranks of each rank's sum); its ``grad_norm`` is
the norm of the window's gradient before clipping (``_get_grad_norm``, or the clip's
total on releases without it; none at all when an older release does not clip).

:func:`logged_numbers` compares them with the window's objective and with the gradient
the audit measured, and names each as one of :data:`FINDINGS`:

- ``"right"``: the loss is the window's objective (its loss sum over its count); the
  norm is the norm of the update's own gradient and that update is right;
- ``"as the update"``: the number follows a wrong update (the loss scaled like the
  gradient, the norm of the wrong gradient): the logs show the update's mistake;
- ``"x A"``, ``"/ A"``: off by the accumulation steps, apart from the update;
- ``"average of averages"``: the mean of the microbatches' own means (the loss a
  per-microbatch mean divided by ``A`` logs); ``"sum of means"``: their sum;
- ``"off"``: none of these (the ratio is given).

A finding is a logging mistake "apart from the update" (the report says "update ok;
logged loss x A") when the update is right and the number is not, or when the update is
wrong and the number is off by a factor of ``A`` or a mean of means that the update's own
named mistake does not explain; a number that follows a wrong update shows that
update's mistake. The objective's value comes from the reference's
loss sums (a known objective) or from the whole window as one microbatch (split
invariance), both at the window's own weights.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .capture import CapturedWindow
from .reference import all_gather_objects

#: What a logged number can be found to be, in the order they are tried.
FINDINGS = ("right", "as the update", "x A", "/ A", "average of averages", "sum of means", "off")

#: The logged form each update mistake takes: the number then shows the update's mistake.
AS_THE_UPDATE = {
    "num_items_ignored": "sum of means",
    "average_of_averages": "average of averages",
    "double_division": "/ A",
}


@dataclass
class LoggedNumber:
    """One number the Trainer logs for window ``window``: ``name`` (``"loss"`` or
    ``"grad_norm"``), the ``logged`` value, the ``expected`` one (the window's
    objective; for ``grad_norm`` the norm of the update's own gradient, before
    clipping), their ``ratio`` and the ``finding`` (one of :data:`FINDINGS`);
    ``apart`` is True when it is a logging mistake apart from the update's."""

    name: str
    window: int
    logged: float
    expected: float
    ratio: float
    finding: str
    apart: bool

    def text(self, accumulation: int) -> str:
        """One line of the report."""
        what = WHAT[self.name]
        head = f"logged {self.name} {self.logged:.6g}"
        if self.finding == "right":
            return f"{head}: right, {what}"
        if self.finding == "as the update" and self.name == "grad_norm":
            return f"{head}: {what}, wrong as the update is"
        how = {"x A": f"{accumulation} x", "/ A": f"1/{accumulation} of"}.get(self.finding)
        if how:
            body = f"{how} {what} {self.expected:.6g} (A = {accumulation})"
        elif self.finding in ("off", "as the update"):
            body = f"{self.ratio:.4g} x {what} {self.expected:.6g}"
        else:
            body = (
                f"the {MEANS[self.finding]}, not {what} {self.expected:.6g} (ratio "
                f"{self.ratio:.4g})"
            )
        return f"{head}: {body}, {'apart from' if self.apart else 'as'} the update"


#: What each logged number should be, as the report says it.
WHAT = {
    "loss": "the window's objective",
    "grad_norm": "the norm of the update's gradient before clipping",
}
MEANS = {
    "average of averages": "average of the microbatches' own means",
    "sum of means": "sum of the microbatches' own means",
}


def _near(value: float, target: float, tol: float) -> bool:
    return target != 0 and math.isfinite(value) and abs(value / target - 1.0) <= tol


def _find(logged: float, candidates: list[tuple[str, float]], tol: float) -> str:
    """The first candidate ``logged`` is within ``tol`` of (relative), else ``"off"``."""
    for name, value in candidates:
        if _near(logged, value, tol):
            return name
    return "off"


def _apart(finding: str, update_ok: bool, mistakes: Sequence[str]) -> bool:
    """Whether ``finding`` is a logging mistake apart from the update's: any finding but
    ``right`` when the update is right; when it is wrong, a factor of A or a mean of
    means the update's own named mistake does not explain (a number merely off, or
    following the update, shows the update's mistake)."""
    if finding == "right":
        return False
    if update_ok:
        return True
    explained = {AS_THE_UPDATE.get(m) for m in mistakes}
    return finding not in ("as the update", "off") and finding not in explained


def _logged_loss(window: CapturedWindow) -> float | None:
    """The window's logged loss: the sum of its steps' returns, the mean over ranks."""
    returns = [mb.returned for mb in window.microbatches]
    local = None if any(r is None for r in returns) else float(sum(returns))  # type: ignore[arg-type]
    every = all_gather_objects(local)
    return None if any(v is None for v in every) else sum(every) / len(every)


def _loss(
    window: CapturedWindow,
    index: int,
    measure: Any,
    invariance: Any,
    update_ok: bool,
    mistakes: Sequence[str],
    accumulation: int,
    tol: float,
) -> LoggedNumber | None:
    logged = _logged_loss(window)
    if logged is None:
        return None
    if measure is not None:  # a known objective: the reference's loss sums and counts
        sums, counts = measure.rank_loss_sums, measure.microbatch_targets
        expected = sum(sum(r) for r in sums) / measure.targets if measure.targets else math.nan
        means = [
            s / n
            for r_s, r_n in zip(sums, counts, strict=True)
            for s, n in zip(r_s, r_n, strict=True)
            if n
        ]
        scale = measure.scale
        extra = [
            ("average of averages", sum(means) / (accumulation * len(sums))),
            ("sum of means", sum(means) / len(sums)),
        ]
    else:  # the whole window as one microbatch, the engine's reference
        reference = invariance.reference
        if (
            reference is None
            or reference.accumulation_steps != 1
            or reference not in invariance.logged
        ):
            return None
        own = (
            invariance.report.measure(invariance.configured)
            if invariance.report is not None
            else None
        )
        expected, extra = invariance.logged[reference], []
        scale = own.factor if own is not None else 1.0
    candidates = [("right", expected)]
    if not update_ok:
        candidates.append(("as the update", scale * expected))
    candidates += [("x A", accumulation * expected), ("/ A", expected / accumulation), *extra]
    if accumulation == 1:
        candidates = [c for c in candidates if c[0] in ("right", "as the update")]
    finding = _find(logged, candidates, tol)
    return LoggedNumber(
        "loss",
        index,
        logged,
        expected,
        logged / expected if expected else math.nan,
        finding,
        _apart(finding, update_ok, mistakes),
    )


def _grad_norm(
    window: CapturedWindow,
    index: int,
    measured: float,
    update_ok: bool,
    mistakes: Sequence[str],
    accumulation: int,
    tol: float,
) -> LoggedNumber | None:
    # rank 0's, as the Trainer logs on the main process (the ranks' differ only when the
    # gradient was never synchronised, a mistake of its own)
    logged, measured = all_gather_objects((window.grad_norm, measured))[0]
    if logged is None or not measured > 0:
        return None
    own = "right" if update_ok else "as the update"
    candidates = [
        (own, measured),
        ("x A", accumulation * measured),
        ("/ A", measured / accumulation),
    ]
    if accumulation == 1:
        candidates = candidates[:1]
    finding = _find(logged, candidates, tol)
    return LoggedNumber(
        "grad_norm",
        index,
        logged,
        measured,
        logged / measured,
        finding,
        _apart(finding, update_ok, mistakes),
    )


def logged_numbers(
    report: Any, windows: Sequence[CapturedWindow], trainer: Any
) -> list[LoggedNumber]:
    """The logged ``loss`` and ``grad_norm`` of each audited window, judged (see the module
    docstring). ``report`` is the update's verdict (a checked
    :class:`~accumlab.hf.report.TrainerAuditReport`), ``windows`` the captured windows
    it was measured on, in the same order. A collective under ``torch.distributed``."""
    windows = [w for w in windows if w.microbatches]
    tol = max(report.tolerance, 1e-4) if math.isfinite(report.tolerance) else 1e-4
    out: list[LoggedNumber] = []
    for i, window in enumerate(windows):
        accumulation = len(window.microbatches)
        measure = report.windows[i] if i < len(report.windows) else None
        invariance = report.invariance[i] if i < len(report.invariance) else None
        if measure is None and (invariance is None or not invariance.splits):
            continue
        ok = report.ok
        loss = _loss(window, i, measure, invariance, ok, report.mistakes, accumulation, tol)
        measured = measure.gradient_norm if measure is not None else invariance.gradient_norm
        norm = _grad_norm(window, i, measured, ok, report.mistakes, accumulation, tol)
        out += [n for n in (loss, norm) if n is not None]
    return out


__all__ = ["AS_THE_UPDATE", "FINDINGS", "LoggedNumber", "logged_numbers"]
