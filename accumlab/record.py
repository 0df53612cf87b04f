"""The run record: what a reader needs to reproduce or audit a run, from a plan and a
ledger, as JSON or Markdown (:class:`RunRecord`)."""

from __future__ import annotations

import json
import math
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any

import torch

from .distributed.totals import rank_totals
from .ledger import Ledger
from .plan import AccumulationPlan
from .precision import check_precision, scaler_settings
from .report import NO_TARGETS, NONFINITE_GRADIENT, UNUSABLE_HYPERPARAMETER
from .validate import check_choice, check_instance

#: The rule of ``accumlab.loop`` as a record states it, for each unit an objective counts.
NORMALIZATION = {
    "target": "sum of token losses / targets in the window (summed over replicas) × D",
    "example": "sum of example losses / examples in the window (summed over replicas) × D",
}
UNITS = tuple(NORMALIZATION)


def _finite_or_none(value: float | None) -> float | None:
    return None if value is None or not math.isfinite(value) else value


def _json_safe(value: Any) -> Any:
    """``value`` with every non-finite float in nested dicts, lists and tuples replaced by
    None (strict JSON has no NaN or Infinity)."""
    if isinstance(value, float):
        return _finite_or_none(value)
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def sizes_after_halving(
    micro_batch_size: int, halvings: int, keep_empty: bool = False
) -> tuple[int, int]:
    """``(largest microbatch, microbatches)`` that one loader microbatch of
    ``micro_batch_size`` examples becomes after ``halvings`` OOM shrinks (``accumlab.oom``
    cuts each piece into its first ``ceil(n/2)`` and last ``floor(n/2)`` examples; an
    empty half is kept only under data parallelism, ``keep_empty``)."""
    pieces = [micro_batch_size]
    for _ in range(halvings):
        pieces = [h for n in pieces for h in ((n + 1) // 2, n // 2) if h > 0 or keep_empty]
    return max(pieces), len(pieces)


def _shrinks_of(plan: AccumulationPlan, shrinks: list[dict[str, int]]) -> list[dict[str, int]]:
    """Each OOM shrink of a run as the plan it changed: the update attempt (0-based) from
    which it applied and ``from_``/``to_`` microbatch size and accumulation steps."""
    keep_empty = plan.data_parallel_size > 1
    out = []
    m, a = plan.micro_batch_size, plan.accumulation_steps
    for k, shrink in enumerate(shrinks, start=1):
        largest, pieces = sizes_after_halving(plan.micro_batch_size, k, keep_empty)
        new_a = plan.accumulation_steps * pieces
        out.append(
            {
                "update": int(shrink["update"]),
                "from_micro_batch_size": m,
                "from_accumulation_steps": a,
                "to_micro_batch_size": largest,
                "to_accumulation_steps": new_a,
            }
        )
        m, a = largest, new_a
    return out


def _chosen(given: str | None, used: str | None, default: str) -> str:
    """The value a record shows: the caller's, else what the run used, else ``default``."""
    return given if given is not None else used if used is not None else default


@dataclass
class RunRecord:
    """What a reader needs to reproduce or audit a run: sizes, counts, policies.

    Build it with ``RunRecord.from_run(plan, ledger, ...)``; ``to_json()`` and
    ``to_markdown()`` render it and ``RunRecord.from_json(text)`` reads it back. ``extra``
    holds fields later chapters add (memory peaks, per-rank totals) without changing the
    core. ``scaler`` holds the GradScaler's settings and final scale (``None`` without
    one); ``skipped_nonfinite`` (a non-finite gradient), ``skipped_no_targets`` and
    ``skipped_hyperparameters`` (a hyper-parameter the update could not use, such as a
    learning rate a scheduler turned ``nan``) split ``updates_skipped`` by reason. From
    what ``train`` noted in the ledger: ``clip_grad_norm`` (``None``: no clipping),
    ``optimizer`` (its class name), ``lr_first``/``lr_last`` (the learning rate
    of the first and last applied update), ``grad_norm_first``/``grad_norm_last``/
    ``grad_norm_largest`` (the L2 norm of the combined, unscaled gradient before clipping
    of the first, last and largest applied update) and ``largest_microbatch`` (examples).

    The plan that ran: ``micro_batch_size`` and ``accumulation_steps`` are the sizes the
    run's last update used, which after an OOM shrink (``train(..., on_oom="shrink")``)
    are not the plan given: ``planned_micro_batch_size`` and ``planned_accumulation_steps``
    keep that, and ``shrinks`` lists each shrink as the update attempt (0-based) from
    which it applied with ``from_``/``to_`` ``micro_batch_size`` and
    ``accumulation_steps`` (``micro_batch_size`` is the largest microbatch: an odd size
    halves into unequal pieces). ``effective_batch_size`` (examples per update) does not
    change. Without a shrink both pairs are the plan given and ``shrinks`` is empty.
    ``largest_microbatch`` is the most examples in one microbatch *read from the data*,
    before any shrink (so it can exceed ``micro_batch_size`` after one).
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
    # Precision details: the GradScaler's settings (scaler_settings) and why attempts
    # were skipped: updates_skipped = skipped_nonfinite + skipped_no_targets
    # + skipped_hyperparameters.
    scaler: dict[str, Any] | None = None
    skipped_nonfinite: int = 0
    skipped_no_targets: int = 0
    skipped_hyperparameters: int = 0
    clip_grad_norm: float | None = None
    optimizer: str | None = None
    lr_first: float | None = None
    lr_last: float | None = None
    grad_norm_first: float | None = None
    grad_norm_last: float | None = None
    grad_norm_largest: float | None = None
    largest_microbatch: int = 0
    planned_micro_batch_size: int = field(kw_only=True)
    planned_accumulation_steps: int = field(kw_only=True)
    shrinks: list[dict[str, int]] = field(default_factory=list)

    @classmethod
    def from_run(
        cls,
        plan: AccumulationPlan,
        ledger: Ledger,
        *,
        unit: str | None = None,
        precision: str | None = None,
        extra: dict[str, Any] | None = None,
        scaler: torch.amp.GradScaler | None = None,
        reduce_over_ranks: bool = False,
        group: Any = None,
        meter: Any = None,
    ) -> RunRecord:
        """Collect the plan's sizes, the ledger's counts and what the run used.

        A ledger from ``train`` knows what the run used (``ledger.settings``): its
        precision, scaler, clipping, optimizer and the objective's unit, so
        ``from_run(plan, ledger)`` records them all. The keywords are for a ledger built
        by hand: ``unit`` is the objective's ``unit`` (``"target"``, the default, or
        ``"example"``); ``precision`` the run's ``"fp32"`` (default), ``"bf16"`` or
        ``"fp16"``; ``scaler`` the ``torch.amp.GradScaler`` the run used (its settings and
        current scale are recorded). A keyword given overrides what the ledger noted.
        Skipped attempts are split by their report's ``skipped_reason``. After an OOM
        shrink, ``micro_batch_size`` and ``accumulation_steps`` are what the last update
        ran at and ``shrinks`` says from which update (``plan`` stays in ``planned_*``).

        ``reduce_over_ranks=True`` (collective: every rank calls it) records the whole
        run: examples, targets, microbatches and the window losses summed over the ranks
        of ``group`` (:func:`reduce_ledger`), with the per-rank examples and targets and
        the padding microbatches in ``extra``. ``group`` is the model's data-parallel
        group, ``accumlab.parallel.data_parallel_group(model)``: under tensor or pipeline
        parallelism the world holds ranks that share data; ``None`` means the world. A
        ledger is otherwise this rank's own.

        ``meter``: a ``MemoryMeter`` (or a list of them, one per device) whose
        ``summary()`` goes into ``extra["memory"]`` keyed by device: the first window's
        baseline, the steady baseline, the peak, and per phase the bytes at entry and the
        peak. The OOM shrinks of the ledger, if any, become ``shrinks``.
        """
        if precision is not None:
            check_precision(precision)
        settings = scaler_settings(scaler)  # TypeError for anything but a GradScaler
        check_instance("plan", plan, AccumulationPlan, "an AccumulationPlan")
        check_instance("ledger", ledger, Ledger, "a Ledger")
        used = ledger.settings
        unit = check_choice("unit", _chosen(unit, used.get("unit"), "target"), UNITS)
        precision = _chosen(precision, used.get("precision"), "fp32")
        if settings is None and used.get("scaler") is not None:
            settings = dict(used["scaler"])
        shrinks = [dict(s) for s in ledger.shrinks]  # this rank's, before any reduction
        if reduce_over_ranks:
            ledger, totals = rank_totals(ledger, group)
            extra = {**totals, **(extra or {})}
        if meter is not None:
            meters = meter if isinstance(meter, (list, tuple)) else [meter]
            memory = {str(m.device): m.summary() for m in meters}
            extra = {"memory": memory, **(extra or {})}
        losses = ledger.losses
        applied = [r for r in ledger.reports if r.applied]
        skipped = [r for r in ledger.reports if not r.applied]
        shrunk = _shrinks_of(plan, shrinks)
        ran = shrunk[-1] if shrunk else None
        return cls(
            micro_batch_size=ran["to_micro_batch_size"] if ran else plan.micro_batch_size,
            accumulation_steps=ran["to_accumulation_steps"] if ran else plan.accumulation_steps,
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
            skipped_nonfinite=sum(r.skipped_reason == NONFINITE_GRADIENT for r in skipped),
            skipped_no_targets=sum(r.skipped_reason == NO_TARGETS for r in skipped),
            skipped_hyperparameters=sum(
                (r.skipped_reason or "").startswith(UNUSABLE_HYPERPARAMETER) for r in skipped
            ),
            clip_grad_norm=used.get("clip_grad_norm"),
            optimizer=used.get("optimizer"),
            lr_first=applied[0].lr if applied else None,
            lr_last=applied[-1].lr if applied else None,
            grad_norm_first=_finite_or_none(applied[0].grad_norm) if applied else None,
            grad_norm_last=_finite_or_none(applied[-1].grad_norm) if applied else None,
            grad_norm_largest=max(r.grad_norm for r in applied) if applied else None,
            largest_microbatch=ledger.largest_microbatch,
            planned_micro_batch_size=plan.micro_batch_size,
            planned_accumulation_steps=plan.accumulation_steps,
            shrinks=shrunk,
        )

    @classmethod
    def from_json(cls, text: str) -> RunRecord:
        """Read a record written by :meth:`to_json` (a ``null`` stays ``None``).

        Raises ``ValueError`` for text that is not a JSON object or whose fields are not
        this class's (naming the missing and unknown ones)."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"not a run record: the text is not JSON ({exc})") from exc
        if not isinstance(data, dict):
            raise ValueError(f"not a run record: expected a JSON object, got {type(data).__name__}")
        names = {f.name: f for f in fields(cls)}
        required = {
            n for n, f in names.items() if f.default is MISSING and f.default_factory is MISSING
        }
        missing, unknown = sorted(required - set(data)), sorted(set(data) - set(names))
        if missing or unknown:
            raise ValueError(
                f"not a run record of this version: missing fields {missing}, unknown fields {unknown}"
            )
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self, indent: int = 2) -> str:
        """The record as strict JSON: every non-finite float, at any depth (``extra``
        included), becomes ``null``; a value JSON has no type for is written as its
        ``str``."""
        return json.dumps(_json_safe(self.to_dict()), indent=indent, allow_nan=False, default=str)

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
