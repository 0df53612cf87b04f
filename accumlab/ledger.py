"""Counting what a run did: the ledger of one replica, one report per update attempt.

Every count has a unit (see the course's notebook 00): microbatches and backward passes
are per forward/backward call on this replica; examples and targets are this replica's
own; an update *attempt* is one ``optimizer.step()`` call at a window boundary, and an
attempt is *applied* unless the gradient was non-finite or the window had no targets.
The run record that renders a ledger is :mod:`accumlab.record`; the sum of the ledgers of
all ranks is :mod:`accumlab.distributed.totals`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any

import torch

from .precision import scaler_settings
from .report import UpdateReport

if TYPE_CHECKING:
    from .settings import TrainSettings


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
    ``micro_batch_size`` in a run of ``train``. ``shrinks`` holds one entry per OOM
    shrink (``train(..., on_oom="shrink")``, ``accumlab.oom``): ``update``, the attempt
    (0-based) from which it applied, ``old_micro_batch_size`` and ``new_micro_batch_size``
    (the largest microbatch before and after) and ``microbatches`` (the window's, after it);
    every loader microbatch is cut in half once per entry.

    ``settings`` is what the run used, as plain data, filled by ``train`` through
    :meth:`note_settings` (empty for a ledger built by hand): ``precision``, ``scaler``
    (``precision.scaler_settings``: its configuration, the initial and the final scale),
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
        self.microbatches += report.backward_passes  # one forward pass each
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
        settings: TrainSettings,
        optimizer: torch.optim.Optimizer,
        scaler: torch.amp.GradScaler | None,
        objective: object,
    ) -> None:
        """Record what the run uses in ``settings``: its precision and clipping (from
        ``train``'s settings), the run's ``scaler``, the optimizer's class and the
        objective's ``unit``. ``train`` calls it when it starts and when it ends, so the
        scaler's final scale is the one recorded.

        A resumed run keeps the ``init_scale`` of the run it continues: a GradScaler
        restored from a checkpoint reports the saved scale as its initial one.
        """
        scaler_now = scaler_settings(scaler)
        before = self.settings.get("scaler")
        if scaler_now is not None and isinstance(before, dict) and "init_scale" in before:
            scaler_now["init_scale"] = before["init_scale"]
        self.settings = {
            "precision": settings.precision,
            "scaler": scaler_now,
            "clip_grad_norm": settings.clip_grad_norm,
            "optimizer": type(optimizer).__qualname__,
            "unit": getattr(objective, "unit", None),
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
