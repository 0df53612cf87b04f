"""Counting what a run did: per-update reports, the run's ledger, and the run record.

Every count has a unit (see the course's notebook 00): microbatches and backward passes
are per forward/backward call on this replica; examples and targets are this replica's
own; an update *attempt* is one ``optimizer.step()`` call at a window boundary, and an
attempt is *applied* unless the gradient was non-finite or the window had no targets.
"""

from __future__ import annotations

import json
import math
import warnings
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from typing import Any

import torch
import torch.distributed as dist

from .distributed.alignment import gather_counts
from .parallel import is_distributed, local_device
from .plan import AccumulationPlan
from .precision import PRECISIONS
from .report import UpdateReport


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

    ``settings`` is what the run used, as plain data, filled by ``train`` through
    :meth:`note_settings` (empty for a ledger built by hand): ``precision``, ``scaler``
    (:func:`scaler_settings`: its configuration, the initial and the final scale),
    ``clip_grad_norm``, ``optimizer`` (the class name) and ``unit`` (the objective's).
    ``RunRecord.from_run`` reads it; the learning rates and gradient norms it records come
    from ``reports``. ``state_dict``/``load_state_dict`` save and restore the whole ledger
    as plain data (a checkpoint reads it back with ``torch.load(weights_only=True)``).
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
    settings: dict[str, Any] = field(default_factory=dict)

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

    def note_settings(
        self,
        *,
        precision: str,
        scaler: torch.amp.GradScaler | None,
        clip_grad_norm: float | None,
        optimizer: torch.optim.Optimizer,
        unit: str | None,
    ) -> None:
        """Record what the run uses in ``settings``; ``train`` calls it when it starts and
        when it ends, so the scaler's final scale is the one recorded.

        A resumed run keeps the ``init_scale`` of the run it continues: a GradScaler
        restored from a checkpoint reports the saved scale as its initial one.
        """
        scaler_now = scaler_settings(scaler)
        before = self.settings.get("scaler")
        if scaler_now is not None and isinstance(before, dict) and "init_scale" in before:
            scaler_now["init_scale"] = before["init_scale"]
        self.settings = {
            "precision": precision,
            "scaler": scaler_now,
            "clip_grad_norm": None if clip_grad_norm is None else float(clip_grad_norm),
            "optimizer": type(optimizer).__qualname__,
            "unit": unit,
        }

    def state_dict(self) -> dict[str, Any]:
        """The whole ledger as plain data (ints, floats, strings, None, lists, dicts), so
        that ``torch.save`` stores it and ``torch.load(weights_only=True)`` reads it back.
        Reports become dicts; a non-finite float (the loss of a window without targets)
        stays as it is."""
        state: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "reports":
                value = [asdict(r) for r in value]
            elif isinstance(value, (list, dict)):
                value = _plain_copy(value, f"Ledger.{f.name}")
            state[f.name] = value
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replace every field with what :meth:`state_dict` returned.

        Raises ``ValueError`` naming the missing and unknown fields of a state written by
        another version of the ledger."""
        if not isinstance(state, dict):
            raise TypeError(f"state must be a dict from Ledger.state_dict(), got {type(state).__name__}")
        names = {f.name for f in fields(self)}
        missing, unknown = sorted(names - set(state)), sorted(set(state) - names)
        if missing or unknown:
            raise ValueError(
                "state is not a Ledger.state_dict() of this version of accumlab: missing "
                f"fields {missing}, unknown fields {unknown}"
            )
        for name in names:
            value = state[name]
            if name == "reports":
                value = [UpdateReport(**r) for r in value]
            elif isinstance(value, (list, dict)):
                value = _plain_copy(value, f"state[{name!r}]")
            setattr(self, name, value)

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


def scaler_settings(scaler: torch.amp.GradScaler | None) -> dict[str, Any] | None:
    """A GradScaler's configuration and current scale, for the run record.

    Returns ``None`` for no scaler, ``{"enabled": False}`` for a disabled one, else
    ``enabled``, ``device``, ``init_scale``, ``scale`` (now), ``growth_factor``, ``backoff_factor`` and
    ``growth_interval`` (in applied updates). Raises ``TypeError`` for anything else.
    """
    if scaler is None:
        return None
    if not isinstance(scaler, torch.amp.GradScaler):
        raise TypeError(
            f"scaler must be a torch.amp.GradScaler or None, got {type(scaler).__name__}"
        )
    if not scaler.is_enabled():
        return {"enabled": False}
    init_scale = getattr(scaler, "_init_scale", None)  # no public getter in torch.amp
    return {
        "enabled": True,
        "device": str(getattr(scaler, "_device", "")),
        "init_scale": None if init_scale is None else float(init_scale),
        "scale": float(scaler.get_scale()),
        "growth_factor": float(scaler.get_growth_factor()),
        "backoff_factor": float(scaler.get_backoff_factor()),
        "growth_interval": int(scaler.get_growth_interval()),
    }


#: Ledger counts that are the same on every aligned rank (a sum would multiply them by
#: the world size) and the one that is a maximum; every other ``int`` field of ``Ledger``
#: is a count that adds up over ranks.
_SAME_ON_EVERY_RANK = ("update_attempts", "updates_applied", "updates_skipped")
_LARGEST = "largest_microbatch"
#: The counts of one ``UpdateReport`` that add up over ranks.
_REPORT_COUNTS = ("examples", "targets", "microbatches", "backward_passes", "padding_microbatches")


def summed_counts() -> list[str]:
    """The ``Ledger`` fields that add up over ranks, in field order: every ``int`` field but
    the attempt counts (the same on every aligned rank) and ``largest_microbatch`` (a max)."""
    return [
        f.name
        for f in fields(Ledger)
        if f.type == "int" and f.name not in (*_SAME_ON_EVERY_RANK, _LARGEST)
    ]


def reduce_ledger(ledger: Ledger, group: Any = None) -> Ledger:
    """The ledger summed over the ranks of ``group``, the model's data-parallel group
    (``parallel.data_parallel_group``; ``None``: the world) (collective).

    Examples, targets, microbatches, backward passes, loader batches, padding and dropped
    counts are summed (:func:`summed_counts`); update attempts/applied/skipped are the
    same on every aligned rank and kept; ``largest_microbatch`` is the largest on any rank. Each report's counts and ``loss_sum`` are summed too, so its ``loss``
    becomes the window's mean over all ranks. Without a multi-rank group, returns
    ``ledger`` itself. Raises ``ValueError`` (on every rank) when the ranks made different
    numbers of update attempts (they were not aligned).
    """
    if not isinstance(ledger, Ledger):
        raise TypeError(f"ledger must be a Ledger, got {type(ledger).__name__}")
    if not is_distributed():
        return ledger
    rows = gather_counts([len(ledger.reports), ledger.largest_microbatch], group)
    attempts = [row[0] for row in rows]
    if len(set(attempts)) > 1:
        raise ValueError(
            f"ranks made different numbers of update attempts {attempts}; train with "
            "accumlab.train (it aligns ranks) before summing their ledgers"
        )
    names = summed_counts()
    values = [float(getattr(ledger, name)) for name in names]
    for report in ledger.reports:
        values.extend(float(getattr(report, name)) for name in _REPORT_COUNTS)
        values.append(report.loss_sum)
    summed = torch.tensor(values, dtype=torch.float64, device=local_device())
    dist.all_reduce(summed, op=dist.ReduceOp.SUM, group=group)
    totals = summed.cpu().tolist()
    head, rest = totals[: len(names)], totals[len(names) :]
    width = len(_REPORT_COUNTS) + 1
    reports = []
    for k, report in enumerate(ledger.reports):
        row = rest[k * width : (k + 1) * width]
        counts = {name: int(round(v)) for name, v in zip(_REPORT_COUNTS, row, strict=False)}
        loss_sum = row[-1]
        loss = loss_sum / counts["targets"] if counts["targets"] else float("nan")
        reports.append(replace(report, loss_sum=loss_sum, loss=loss, **counts))
    return replace(
        ledger,
        reports=reports,
        shrinks=list(ledger.shrinks),
        largest_microbatch=max(row[1] for row in rows),
        **{name: int(round(v)) for name, v in zip(names, head, strict=True)},
    )


def rank_totals(ledger: Ledger, group: Any = None) -> tuple[Ledger, dict[str, Any]]:
    """``(reduce_ledger(ledger, group), per-rank fields)`` for ``RunRecord.from_run(...,
    reduce_over_ranks=True)`` (collective). The fields: ``ranks``, ``examples_per_rank``,
    ``targets_per_rank`` and ``padding_microbatches_per_rank``, in rank order."""
    rows = gather_counts([ledger.examples, ledger.targets, ledger.padding_microbatches], group)
    totals = {
        "ranks": len(rows),
        "examples_per_rank": [row[0] for row in rows],
        "targets_per_rank": [row[1] for row in rows],
        "padding_microbatches_per_rank": [row[2] for row in rows],
    }
    return reduce_ledger(ledger, group), totals

def _plain_copy(value: Any, where: str) -> Any:
    """A deep copy of nested lists, tuples (as lists) and str-keyed dicts of ints, floats,
    strings, bools and None; ``TypeError`` naming ``where`` for anything else."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain_copy(v, where) for v in value]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {k: _plain_copy(v, f"{where}[{k!r}]") for k, v in value.items()}
    raise TypeError(f"{where} must hold plain data only, found {type(value).__name__}")


NORMALIZATION = {
    "target": "sum of token losses / targets in the window (summed over replicas) × D",
    "example": "sum of example losses / examples in the window (summed over replicas) × D",
}


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


def sizes_after_halving(micro_batch_size: int, halvings: int, keep_empty: bool = False) -> tuple[int, int]:
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
        out.append({"update": int(shrink["update"]), "from_micro_batch_size": m,
                    "from_accumulation_steps": a, "to_micro_batch_size": largest,
                    "to_accumulation_steps": new_a})  # fmt: skip
        m, a = largest, new_a
    return out


class RecordExtra(dict):
    """``RunRecord.extra``: a plain dict of the fields later chapters add, except that the
    deprecated key ``"oom_shrinks"`` still answers (with a ``DeprecationWarning``) for a
    record built by ``from_run`` after an OOM shrink: the ledger's own shrink entries
    (``update``, ``old_micro_batch_size``, ``new_micro_batch_size``, ``microbatches``).
    The record states each shrink once, in ``RunRecord.shrinks``; the alias is not stored,
    so ``to_dict``, ``to_json`` and ``to_markdown`` do not repeat it."""

    def __init__(self, *args: Any, oom_shrinks: list[dict[str, int]] | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._oom_shrinks = [dict(s) for s in oom_shrinks or []]

    def __missing__(self, key: str) -> Any:
        if key == "oom_shrinks" and self._oom_shrinks:
            warnings.warn(
                'record.extra["oom_shrinks"] is deprecated: read record.shrinks (each shrink '
                "as the plan it changed) or ledger.shrinks (the same entries as before)",
                DeprecationWarning,
                stacklevel=2,
            )
            return [dict(s) for s in self._oom_shrinks]
        raise KeyError(key)


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
    one); ``skipped_nonfinite`` and ``skipped_no_targets`` split ``updates_skipped`` by
    reason. From what ``train`` noted in the ledger: ``clip_grad_norm`` (``None``: no
    clipping), ``optimizer`` (its class name), ``lr_first``/``lr_last`` (the learning rate
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
    before any shrink (so it can exceed ``micro_batch_size`` after one). Each shrink is
    stated once, in ``shrinks``; ``extra["oom_shrinks"]`` (the ledger's own entries) is a
    deprecated alias that still answers but is not stored (:class:`RecordExtra`).
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
    # Precision details: the GradScaler's settings (scaler_settings) and why
    # attempts were skipped; updates_skipped = skipped_nonfinite + skipped_no_targets.
    scaler: dict[str, Any] | None = None
    skipped_nonfinite: int = 0
    skipped_no_targets: int = 0
    clip_grad_norm: float | None = None
    optimizer: str | None = None
    lr_first: float | None = None
    lr_last: float | None = None
    grad_norm_first: float | None = None
    grad_norm_last: float | None = None
    grad_norm_largest: float | None = None
    largest_microbatch: int = 0
    planned_micro_batch_size: int | None = None  # None (a record from before): micro_batch_size
    planned_accumulation_steps: int | None = None
    shrinks: list[dict[str, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.planned_micro_batch_size is None:
            self.planned_micro_batch_size = self.micro_batch_size
        if self.planned_accumulation_steps is None:
            self.planned_accumulation_steps = self.accumulation_steps

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
        if precision is not None and precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {list(PRECISIONS)}, got {precision!r}")
        settings = scaler_settings(scaler)  # TypeError for anything but a GradScaler
        if not isinstance(plan, AccumulationPlan):
            raise TypeError(f"plan must be an AccumulationPlan, got {type(plan).__name__}")
        if not isinstance(ledger, Ledger):
            raise TypeError(f"ledger must be a Ledger, got {type(ledger).__name__}")
        used = ledger.settings
        unit = _chosen(unit, used.get("unit"), "target")
        precision = _chosen(precision, used.get("precision"), "fp32")
        if settings is None and used.get("scaler") is not None:
            settings = dict(used["scaler"])
        if unit not in NORMALIZATION:
            raise ValueError(f"unit must be one of {sorted(NORMALIZATION)}, got {unit!r}")
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
            extra=RecordExtra(extra or {}, oom_shrinks=shrinks),
            scaler=settings,
            skipped_nonfinite=sum(
                r.skipped_reason == "non-finite gradient" for r in ledger.reports
            ),
            skipped_no_targets=sum(r.skipped_reason == "no targets" for r in ledger.reports),
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
        required = {n for n, f in names.items() if f.default is MISSING and f.default_factory is MISSING}
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
