"""Counting what a run did: per-update reports, the run's ledger, and the run record.

Every count has a unit (see the course's notebook 00): microbatches and backward passes
are per forward/backward call on this replica; examples and targets are this replica's
own; an update *attempt* is one ``optimizer.step()`` call at a window boundary, and an
attempt is *applied* unless the gradient was non-finite or the window had no targets.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from .plan import AccumulationPlan
from .precision import PRECISIONS, scaler_settings

if TYPE_CHECKING:
    import torch


@dataclass
class UpdateReport:
    """What one window did. Counts are this replica's; ``global_targets`` is the window's
    denominator summed over all replicas.

    ``loss`` is the window's mean loss per unit on this replica (``loss_sum / targets``,
    ``nan`` when it had none). ``grad_norm`` is the L2 norm of the combined, unscaled
    gradient before clipping. ``skipped_reason`` is ``None`` for an applied update,
    ``"no targets"`` or ``"non-finite gradient"`` otherwise. ``padding_microbatches``
    counts the zero-target microbatches (included in ``microbatches``) a data-parallel
    rank ran so that it synchronizes at the same index as its peers.
    """

    index: int
    applied: bool
    examples: int
    targets: int
    global_targets: int
    microbatches: int
    backward_passes: int
    loss: float
    loss_sum: float
    grad_norm: float
    lr: float | None = None
    scale_before: float | None = None
    scale_after: float | None = None
    skipped_reason: str | None = None
    replicas: int = 1
    padding_microbatches: int = 0


@dataclass
class Ledger:
    """Running totals of a training run on this replica, plus one report per attempt.

    ``loader_batches`` counts what the data iterable yielded; ``microbatches`` counts
    forward passes (they differ when a loader batch is re-split, e.g. after an OOM
    shrink). ``dropped_*`` count a short last window discarded by
    ``last_window="drop"``: those examples were read but never trained on.
    ``padding_microbatches`` counts zero-target microbatches a data-parallel rank ran to
    stay aligned with its peers; they are in ``microbatches`` and ``backward_passes``
    but add no examples or targets. ``largest_microbatch`` is the most examples in one
    microbatch read from the data (before any OOM shrink), never more than the plan's
    ``micro_batch_size`` in a run of ``train``.
    """

    microbatches: int = 0
    backward_passes: int = 0
    update_attempts: int = 0
    updates_applied: int = 0
    updates_skipped: int = 0
    examples: int = 0
    targets: int = 0
    loader_batches: int = 0
    dropped_windows: int = 0
    dropped_examples: int = 0
    dropped_targets: int = 0
    padding_microbatches: int = 0
    largest_microbatch: int = 0
    reports: list[UpdateReport] = field(default_factory=list)
    shrinks: list[dict[str, int]] = field(default_factory=list)

    def record(self, report: UpdateReport) -> None:
        """Add one window's report to the totals."""
        self.reports.append(report)
        self.microbatches += report.microbatches
        self.backward_passes += report.backward_passes
        self.update_attempts += 1
        self.updates_applied += int(report.applied)
        self.updates_skipped += int(not report.applied)
        self.examples += report.examples
        self.targets += report.targets
        self.padding_microbatches += report.padding_microbatches

    def record_dropped(self, examples: int, targets: int) -> None:
        """Count a window that was read but not trained on (``last_window="drop"``)."""
        self.dropped_windows += 1
        self.dropped_examples += examples
        self.dropped_targets += targets

    @property
    def losses(self) -> list[float]:
        """Window mean losses of the applied updates, in order."""
        return [r.loss for r in self.reports if r.applied]

    def summary(self) -> str:
        """One line with every count, for a print at the end of a run."""
        return (
            f"{self.update_attempts} update attempts ({self.updates_applied} applied, "
            f"{self.updates_skipped} skipped) from {self.microbatches} microbatches / "
            f"{self.backward_passes} backward passes; {self.examples} examples, "
            f"{self.targets} targets; {self.loader_batches} loader batches; dropped "
            f"{self.dropped_examples} examples / {self.dropped_targets} targets"
        )


NORMALIZATION = {
    "target": "sum of token losses / targets in the window (summed over replicas) × D",
    "example": "sum of example losses / examples in the window (summed over replicas) × D",
}


def _finite_or_none(value: float | None) -> float | None:
    return None if value is None or not math.isfinite(value) else value


@dataclass
class RunRecord:
    """What a reader needs to reproduce or audit a run: sizes, counts, policies.

    Build it with ``RunRecord.from_run(plan, ledger, ...)``; ``to_json()`` and
    ``to_markdown()`` render it. ``extra`` holds fields later chapters add (memory peaks,
    per-rank totals) without changing the core. ``scaler`` holds the GradScaler's
    settings and final scale (``None`` without one); ``skipped_nonfinite`` and
    ``skipped_no_targets`` split ``updates_skipped`` by reason.
    """

    micro_batch_size: int
    accumulation_steps: int
    data_parallel_size: int
    effective_batch_size: int
    last_window: str
    unit: str
    normalization: str
    precision: str
    examples: int
    targets: int
    loader_batches: int
    microbatches: int
    backward_passes: int
    update_attempts: int
    updates_applied: int
    updates_skipped: int
    dropped_examples: int
    dropped_targets: int
    first_loss: float | None
    last_loss: float | None
    extra: dict[str, Any] = field(default_factory=dict)
    # Precision details: the GradScaler's settings (precision.scaler_settings) and why
    # attempts were skipped; updates_skipped = skipped_nonfinite + skipped_no_targets.
    scaler: dict[str, Any] | None = None
    skipped_nonfinite: int = 0
    skipped_no_targets: int = 0

    @classmethod
    def from_run(
        cls,
        plan: AccumulationPlan,
        ledger: Ledger,
        *,
        unit: str = "target",
        precision: str = "fp32",
        extra: dict[str, Any] | None = None,
        scaler: torch.amp.GradScaler | None = None,
        reduce_over_ranks: bool = False,
        meter: Any = None,
    ) -> RunRecord:
        """Collect the plan's sizes and the ledger's counts; ``unit`` is the objective's
        ``unit`` (``"target"`` or ``"example"``).

        ``precision`` is the run's ``"fp32"``, ``"bf16"`` or ``"fp16"``; ``scaler`` the
        ``torch.amp.GradScaler`` the run used (its settings and final scale are recorded)
        or None. Skipped attempts are split by their report's ``skipped_reason``.

        ``reduce_over_ranks=True`` (collective: every rank calls it) records the whole
        run: examples, targets, microbatches and the window losses summed over the ranks
        of the process group (``distributed.reduce_ledger``), with the per-rank examples
        and targets and the padding microbatches in ``extra``. A ledger is otherwise
        this rank's own.

        ``meter``: a ``MemoryMeter`` (or a list of them, one per device) whose
        ``summary()`` goes into ``extra["memory"]`` keyed by device: the first window's
        baseline, the steady baseline, the peak, and per phase the bytes at entry and the
        peak; the OOM shrinks of the ledger, if any, go into ``extra["oom_shrinks"]``.
        """
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {list(PRECISIONS)}, got {precision!r}")
        settings = scaler_settings(scaler)  # TypeError for anything but a GradScaler
        if not isinstance(plan, AccumulationPlan):
            raise TypeError(f"plan must be an AccumulationPlan, got {type(plan).__name__}")
        if not isinstance(ledger, Ledger):
            raise TypeError(f"ledger must be a Ledger, got {type(ledger).__name__}")
        if unit not in NORMALIZATION:
            raise ValueError(f"unit must be one of {sorted(NORMALIZATION)}, got {unit!r}")
        shrinks = [dict(s) for s in ledger.shrinks]  # this rank's, before any reduction
        if reduce_over_ranks:
            from .distributed import rank_totals

            ledger, totals = rank_totals(ledger)
            extra = {**totals, **(extra or {})}
        if meter is not None:
            meters = meter if isinstance(meter, (list, tuple)) else [meter]
            memory = {str(m.device): m.summary() for m in meters}
            extra = {"memory": memory, **(extra or {})}
        if shrinks:
            extra = {"oom_shrinks": shrinks, **(extra or {})}
        losses = ledger.losses
        return cls(
            micro_batch_size=plan.micro_batch_size,
            accumulation_steps=plan.accumulation_steps,
            data_parallel_size=plan.data_parallel_size,
            effective_batch_size=plan.effective_batch_size,
            last_window=plan.last_window,
            unit=unit,
            normalization=NORMALIZATION[unit],
            precision=precision,
            examples=ledger.examples,
            targets=ledger.targets,
            loader_batches=ledger.loader_batches,
            microbatches=ledger.microbatches,
            backward_passes=ledger.backward_passes,
            update_attempts=ledger.update_attempts,
            updates_applied=ledger.updates_applied,
            updates_skipped=ledger.updates_skipped,
            dropped_examples=ledger.dropped_examples,
            dropped_targets=ledger.dropped_targets,
            first_loss=_finite_or_none(losses[0]) if losses else None,
            last_loss=_finite_or_none(losses[-1]) if losses else None,
            extra=dict(extra or {}),
            scaler=settings,
            skipped_nonfinite=sum(
                r.skipped_reason == "non-finite gradient" for r in ledger.reports
            ),
            skipped_no_targets=sum(r.skipped_reason == "no targets" for r in ledger.reports),
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self, indent: int = 2) -> str:
        """The record as JSON (strict: no NaN)."""
        return json.dumps(self.to_dict(), indent=indent, allow_nan=False, default=str)

    def to_markdown(self) -> str:
        """The record as a two-column Markdown table."""
        rows = ["| field | value |", "| --- | --- |"]
        for key, value in self.to_dict().items():
            if key == "extra":
                rows.extend(f"| {k} | {v} |" for k, v in value.items())
            elif isinstance(value, dict):  # e.g. scaler settings: one row per entry
                rows.extend(f"| {key}.{k} | {v} |" for k, v in value.items())
            else:
                shown = f"{value:.4f}" if isinstance(value, float) else value
                rows.append(f"| {key} | {shown} |")
        return "\n".join(rows)
