"""``AuditCallback``: check the first updates of a real ``Trainer`` run, on its real data.

``Trainer(..., callbacks=[AuditCallback()])`` audits the first ``steps`` optimizer steps
of each ``trainer.train()`` call. For each, a :class:`~accumlab.hf.capture.TrainerCapture`
records the microbatches the Trainer trains on (inputs, ``num_items_in_batch``, random
state, what each step returned; for a trainer that generates, the generated buffer) and
the gradient after the window's last backward pass and the data-parallel sync, before
clipping; then, at ``on_pre_optimizer_step`` (before ``optimizer.step()``),
:func:`accumlab.hf.audit.measured_report` compares it with the reference (the same
examples as one batch under the objective the job means) or, for a loss the audit does
not know, with the same examples at other splits, names what differs and checks the
numbers the Trainer logs. With ``on_mistake="raise"`` a wrong gradient stops the run
right there, before the update is applied; with ``"warn"`` the report is a warning and
the run goes on.

**It never breaks the run.** The only exception it raises into ``trainer.train()`` is
:class:`AccumulationError`, when asked to (``on_mistake="raise"``) and the update is
found wrong. Any failure of its own (a job it cannot follow, an error while measuring)
becomes a report that says "not checked" and why, warned like any other; the Trainer's
own steps run as without it, and the weights are bit for bit those of a run without it.

Costs: an audited update runs one extra forward and backward pass over its examples (the
reference; a second one only when the gradient is wrong and its weighting is to be
named), or, for a loss the audit does not know, the same examples at two other splits;
it keeps a copy of the window's inputs and holds the window's own ``.grad`` tensors
while one more gradient is accumulated beside them. Once the audited updates are done
the wrappers are removed and the run continues exactly as it would have without the
callback (the reference replays each microbatch's random state, so dropout draws the
same masks, and the gradients, buffers, modes and random states are put back).

A ``TrainerCallback`` is handed the model, optimizer and scheduler but not the trainer,
whose ``training_step`` and accelerator the recorder wraps: the callback finds the
trainer as the ``self`` of ``train()``'s frame on the call stack of ``on_train_begin``.
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
from typing import Literal

from transformers import Trainer, TrainerCallback

from ..objectives import Objective
from .audit import unmeasurable
from .capture import TrainerCapture
from .report import TrainerAuditReport

ON_MISTAKE = ("warn", "raise")


class AccumulationWarning(UserWarning):
    """An audited update of a ``Trainer`` run does not apply the full-batch gradient, or
    could not be checked; the message is the audit's report."""


class AccumulationError(RuntimeError):
    """Raised by ``AuditCallback(on_mistake="raise")`` before a wrong update is applied;
    ``.report`` holds the :class:`~accumlab.hf.report.TrainerAuditReport`."""

    def __init__(self, report: TrainerAuditReport) -> None:
        super().__init__(str(report))
        self.report = report


class AuditCallback(TrainerCallback):
    """Check the first ``steps`` optimizer steps of a ``Trainer`` run (see the module doc).

    ``steps``: how many optimizer steps (updates) of each ``trainer.train()`` call to audit,
    from its first. ``on_mistake``: ``"warn"`` (an :class:`AccumulationWarning` carrying the
    report; the run goes on) or ``"raise"`` (an :class:`AccumulationError` out of
    ``trainer.train()`` before the first wrong update is applied: the weights, the
    optimizer's state and the scheduler are as they were before that update).
    ``objective``: the reference objective, None to infer it from the model and labels
    (token mean over shifted targets for a causal LM, example mean for one label per
    example), as in :func:`accumlab.hf.audit_trainer`.

    A job the audit cannot measure (DeepSpeed, FSDP, a frozen model, several GPUs in one
    process, an objective it cannot infer) gets an :class:`AccumulationWarning` saying
    "not checked" and why, never an error and never an ok. Gradient (activation)
    checkpointing is audited on the checkpointed path the run takes. ``callback.reports`` holds one
    :class:`~accumlab.hf.report.TrainerAuditReport` per audited update of the last
    ``train()`` call, in order.
    """

    def __init__(
        self,
        steps: int = 1,
        on_mistake: Literal["warn", "raise"] = "warn",
        *,
        objective: Objective | None = None,
    ) -> None:
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(
                f"steps is the number of optimizer steps to audit, a positive int; got {steps!r}"
            )
        if on_mistake not in ON_MISTAKE:
            raise ValueError(f"on_mistake must be 'warn' or 'raise', got {on_mistake!r}")
        self.steps = steps
        self.on_mistake = on_mistake
        self.objective = objective
        self.reports: list[TrainerAuditReport] = []
        self._trainer: Trainer | None = None
        self._recorder: TrainerCapture | None = None
        self._left = 0

    # -- the Trainer's events --------------------------------------------------------------

    def on_train_begin(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        self._stop()  # a previous train() that ended in an exception
        self._trainer = _calling_trainer()
        self.reports = []
        try:
            reason = unmeasurable(self._trainer, in_run=True)
            if reason is None:
                self._left = self.steps
                self._recorder = TrainerCapture()
                self._recorder.install(self._trainer)  # removed by _stop()
        except Exception as err:  # noqa: BLE001 - the run goes on whatever the audit meets
            reason = _failed("start", err)
            self._stop()
        if reason is not None:
            self._judge(TrainerAuditReport.unchecked(reason))

    def on_step_begin(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        if self._recorder is not None:
            self._recorder.open_window()

    def on_pre_optimizer_step(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        recorder, trainer = self._recorder, self._trainer
        if recorder is None or trainer is None:
            return
        self._left -= 1
        try:
            report = self._audit(recorder, trainer)
        except Exception as err:  # noqa: BLE001 - never break the run: the report says why
            report = TrainerAuditReport.unchecked(_failed("measure this update", err))
        finally:
            if self._left <= 0:
                self._stop()
        self._judge(report)

    def on_train_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        self._stop()  # a run with fewer updates than `steps`

    # -- helpers ---------------------------------------------------------------------------

    def _audit(self, recorder: TrainerCapture, trainer: Trainer) -> TrainerAuditReport:
        """The report of the window that just ended (the weights are still its own)."""
        recorder.close_window(trainer.model)  # a no-op when clipping already closed it
        windows, recorder.windows = recorder.windows, []
        if recorder.broken:
            return TrainerAuditReport.unchecked(
                f"the audit could not follow this run: {recorder.broken}"
            )
        from .audit import measured_report

        return measured_report(trainer, windows, self.objective)

    def _judge(self, report: TrainerAuditReport) -> None:
        self.reports.append(report)
        if report.checked and not report.ok and self.on_mistake == "raise":
            self._stop()
            raise AccumulationError(report)
        if report.ok and report.logged_ok:
            return
        # stacklevel: the warning points at the Trainer's loop rather than this file
        warnings.warn(str(report), AccumulationWarning, stacklevel=4)

    def _stop(self) -> None:
        recorder, self._recorder = self._recorder, None
        if recorder is not None:
            with contextlib.suppress(Exception):
                recorder.remove()


def _failed(what: str, err: BaseException) -> str:
    """The "not checked" reason for an error of the audit's own."""
    return (
        f"the audit could not {what}: {type(err).__name__}: {err} (the run goes on as "
        "without the audit; please report this job)"
    )


def _calling_trainer() -> Trainer:
    """The ``Trainer`` whose ``train()`` fired this event: the ``self`` of a frame further
    up the stack (callbacks are not handed the trainer)."""
    frame = inspect.currentframe()
    try:
        while frame is not None:
            candidate = frame.f_locals.get("self")
            if isinstance(candidate, Trainer):
                return candidate
            frame = frame.f_back
    finally:
        del frame  # no reference cycle through the frames
    raise RuntimeError(
        "AuditCallback runs inside trainer.train(): pass it as Trainer(..., "
        "callbacks=[AuditCallback()]) or trainer.add_callback(AuditCallback())"
    )


__all__ = ["AccumulationError", "AccumulationWarning", "AuditCallback"]
