"""``SplitInvarianceCallback``: the first window of a Lightning run checked by split
invariance, without changing the run.

It keeps a clone of each microbatch Lightning hands ``training_step`` until the first
optimizer step, and the random state the window started from. At
``on_before_optimizer_step`` (after the window's last backward pass, before clipping and
the step) it sets the run's gradients aside (the same tensors are put back), replays the
window (:class:`~accumlab.lightning.replay.Replay`) at the configured split first, to
confirm the replay gives the run's own gradient, then at the engine's splits
(:func:`accumlab.invariance.check_splits`), and against the token mean when the module
returns a Hugging Face causal LM's ``.loss``. Then everything is as it was: gradients,
modes, buffers, random states, ``trainer.accumulate_grad_batches``. Anything that goes
wrong becomes the report's "not checked: why"; the run goes on. The report is
``callback.report``; when it is not ok a :class:`AccumulationCheckWarning` carries its text.
"""

from __future__ import annotations

import warnings
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor

from ..invariance import (
    TOLERANCES,
    InvarianceReport,
    ModelState,
    NotChecked,
    RandomState,
    Split,
    check_splits,
    compare,
    rows_in,
)
from ..validate import check_bool, check_choice, check_positive_number
from .replay import Replay, hf_causal_lm

MIXED = ("16", "bf16")


class AccumulationCheckWarning(UserWarning):
    """The first window's check found a mistake or could not run: the report's text."""


def _clone(batch: Any) -> Any:
    if isinstance(batch, Tensor):
        return batch.detach().clone()
    if isinstance(batch, dict):
        return {k: _clone(v) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(_clone(v) for v in batch)
    return batch


class SplitInvarianceCallback(pl.Callback):
    """Check the run's first window by split invariance (see the module docstring).

    ``tolerance``: the relative error within which two gradients agree (default 1e-4 for a
    float32 run, 3e-2 under a 16-bit precision). ``token_mean``: also compare with the
    window's token mean when the module returns a Hugging Face causal LM's ``.loss``
    (``False``: never). ``on_mistake``: ``"warn"`` (an :class:`AccumulationCheckWarning` with the
    report's text when it is not ok) or ``"ignore"`` (read ``callback.report``).

    Costs, once: the first window's batches cloned, one float32 copy of the gradient, and
    about ``5 + A + N`` windows' worth of forward and backward passes for a window of ``N``
    examples in ``A`` microbatches (more when the structure of a dependence is read).
    """

    def __init__(self, *, tolerance: float | None = None, token_mean: bool = True,
                 on_mistake: str = "warn") -> None:
        super().__init__()
        self.tolerance = (None if tolerance is None
                          else check_positive_number("tolerance", tolerance))
        self.token_mean = check_bool("token_mean", token_mean)
        self.on_mistake = check_choice("on_mistake", on_mistake, ("warn", "ignore"))
        self.report: InvarianceReport | None = None
        self._batches: list[Any] = []
        self._start: RandomState | None = None
        self._done = False

    # -- hooks: each catches everything, so the run goes on --------------------------------

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                             batch: Any, batch_idx: int) -> None:
        if self._done:
            return
        try:
            if not self._batches:
                self._start = RandomState.now()
            self._batches.append(_clone(batch))
        except Exception as exc:  # never break the run
            self._finish(self._failed(trainer, exc))

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                                 optimizer: Any) -> None:
        if self._done or not self._batches:
            return
        try:
            report = self._check(trainer, pl_module)
        except Exception as exc:  # never break the run
            report = self._failed(trainer, exc)
        self._finish(report)

    # -- the check ---------------------------------------------------------------------------

    def _configured(self, trainer: pl.Trainer) -> Split:
        sizes = tuple(rows_in(b) for b in self._batches)
        a = max(int(trainer.accumulate_grad_batches), len(sizes))
        return Split(sizes, a) if all(sizes) else Split((1,), 1)

    def _tolerance(self, trainer: pl.Trainer) -> float:
        if self.tolerance is not None:
            return self.tolerance
        precision = str(getattr(trainer, "precision", "32-true"))
        mixed = any(precision.startswith(p) for p in MIXED)
        return TOLERANCES[torch.float16] if mixed else TOLERANCES[torch.float32]

    def _refusal(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> str:
        if not pl_module.automatic_optimization:
            return ("the module optimizes manually (automatic_optimization is False): check its "
                    "window code with accumlab.split_invariance")
        if int(getattr(trainer, "world_size", 1)) > 1:
            return (f"a data-parallel run (world size {trainer.world_size}): the callback checks "
                    "a single process; check the job on one device")
        if not any(p.requires_grad for p in pl_module.parameters()):
            return "the module has no trainable parameter"
        return ""

    def _check(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> InvarianceReport:
        configured = self._configured(trainer)
        tol = self._tolerance(trainer)
        refusal = self._refusal(trainer, pl_module)
        if refusal:
            return _not_checked(configured, tol, refusal)
        state = ModelState(pl_module, runs_from=self._start)
        notes: list[str] = []
        try:
            replay = Replay(trainer, pl_module, self._batches, state)
            real = [g for p, g in zip(state.params, state.grads, strict=True) if p.requires_grad]
            objective = None
            hf = hf_causal_lm(pl_module) if self.token_mean else None
            if hf is not None:
                ok, said = replay.returns_hf_loss(hf, tol)
                objective = replay.token_mean(hf) if ok else None
                notes.append(said if ok else f"not compared with the token mean: {said}")
            try:
                again = compare(replay(configured), real)
            except NotChecked as why:
                return _not_checked(configured, tol, str(why))
            if not again.relative_error <= tol:
                return _not_checked(configured, tol, (
                    f"the replay of the first window gives another gradient than the run's own "
                    f"(relative error {again.relative_error:.2e}): its training_step depends on "
                    "something the replay does not repeat (a hook, a callback, the batch index)"))
            report = check_splits(replay, configured, objective=objective, tolerance=tol)
        finally:
            state.close()
        report.notes += notes
        report.ran = (f"{report.ran}; the run's first window replayed through the module's "
                      "training_step and Lightning's division by accumulate_grad_batches, after "
                      "a replay of its own split gave the run's gradient")
        return report

    def _failed(self, trainer: pl.Trainer, exc: BaseException) -> InvarianceReport:
        configured = self._configured(trainer) if self._batches else Split((1,), 1)
        return _not_checked(configured, 0.0, f"the check failed: {type(exc).__name__}: {exc}")

    def _finish(self, report: InvarianceReport) -> None:
        self.report, self._done = report, True
        self._batches, self._start = [], None
        if not report.ok and self.on_mistake == "warn":
            try:
                warnings.warn(report.text(), AccumulationCheckWarning, stacklevel=2)
            except Exception:  # warnings turned into errors: the report stays readable
                pass


def _not_checked(configured: Split, tolerance: float, reason: str) -> InvarianceReport:
    return InvarianceReport(configured, tolerance, checked=False, reason=reason)


__all__ = ["AccumulationCheckWarning", "SplitInvarianceCallback"]
