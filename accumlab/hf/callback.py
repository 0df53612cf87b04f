"""``AuditCallback``: check the first updates of a real ``Trainer`` run, on its real data.

``Trainer(..., callbacks=[AuditCallback()])`` audits the first ``steps`` optimizer steps
of ``trainer.train()``: for each, once the last microbatch of the window has been
through ``training_step`` (its backward pass done and the gradient synchronised across
data-parallel ranks, before clipping and ``optimizer.step()``), it compares the gradient
the step is about to apply with the reference, the gradient of the same examples as one
batch under the objective the job means, and names what differs. With
``on_mistake="raise"`` a wrong gradient stops the run right there, before the update is
applied; with ``"warn"`` the run goes on and the report is a warning.

Costs: an audited update runs one extra forward and backward pass over its examples (the
reference) and keeps a copy of the gradient; once the audited updates are done nothing of
the callback is left in the training path (``trainer.training_step`` is the class's own
again), and the run continues exactly as it would have without the callback: the
reference runs on the random state each microbatch had (dropout draws the same masks),
and the gradients, buffers and random state are put back as they were.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor, nn
from transformers import Trainer, TrainerCallback

ON_MISTAKE = ("warn", "raise")


class AccumulationWarning(UserWarning):
    """An audited update of a ``Trainer`` run does not apply the full-batch gradient."""


class AccumulationError(RuntimeError):
    """Raised by ``AuditCallback(on_mistake="raise")`` before a wrong update is applied;
    ``.report`` holds the audit's report."""

    def __init__(self, report: Any) -> None:
        super().__init__(str(report))
        self.report = report


@dataclass
class _Microbatch:
    """What one ``training_step`` call of an audited window was given."""

    inputs: dict[str, Any]
    num_items_in_batch: Tensor | int | None
    rng: tuple[Tensor, Tensor | None]  # CPU and current CUDA generator states before it


class AuditCallback(TrainerCallback):
    """Check the first ``steps`` optimizer steps of a ``Trainer`` run (see the module doc).

    ``steps``: how many optimizer steps (updates) of each ``trainer.train()`` call to audit,
    from its first. ``on_mistake``: ``"warn"`` (an :class:`AccumulationWarning` with the
    report, the run goes on) or ``"raise"`` (an :class:`AccumulationError` from
    ``trainer.train()`` before the first wrong update is applied: the weights, optimizer
    and scheduler are as they were before that update).

    After the run, ``callback.reports`` holds one report per audited update, in order.
    """

    def __init__(self, steps: int = 1, on_mistake: Literal["warn", "raise"] = "warn") -> None:
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(
                f"steps is the number of optimizer steps to audit, a positive int; got {steps!r}"
            )
        if on_mistake not in ON_MISTAKE:
            raise ValueError(f"on_mistake must be 'warn' or 'raise', got {on_mistake!r}")
        self.steps = steps
        self.on_mistake = on_mistake
        self.reports: list[Any] = []
        self._trainer: Trainer | None = None
        self._window: list[_Microbatch] = []
        self._left = 0

    # -- the Trainer's events -------------------------------------------------------------

    def on_train_begin(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        self._trainer = _calling_trainer()
        self.reports = []
        self._left = self.steps
        self._install()

    def on_step_begin(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        self._window = []

    def on_train_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        self._uninstall()  # a run shorter than `steps` updates

    # -- the wrapper around training_step, present only during the audited updates ---------

    def _install(self) -> None:
        trainer = self._trainer
        assert trainer is not None
        # An instance attribute shadows the class's method; deleting it restores the class's.
        self._shadowed = trainer.__dict__.get("training_step")
        self._original = trainer.training_step
        trainer.training_step = self._training_step  # type: ignore[method-assign]

    def _uninstall(self) -> None:
        trainer = self._trainer
        if trainer is None or trainer.__dict__.get("training_step") != self._training_step:
            return
        if self._shadowed is None:
            del trainer.training_step
        else:
            trainer.training_step = self._shadowed  # type: ignore[method-assign]
        self._window = []

    def _training_step(
        self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None
    ) -> Tensor:
        trainer = self._trainer
        assert trainer is not None
        self._window.append(
            _Microbatch(dict(inputs), num_items_in_batch, _rng_state(_device_of(model)))
        )
        loss = self._original(model, inputs, num_items_in_batch)
        if trainer.accelerator.sync_gradients:  # the window's last microbatch
            window, self._window = self._window, []
            report = _audit_window(trainer, model, window)
            self.reports.append(report)
            self._left -= 1
            if self._left == 0 or (not report.ok and self.on_mistake == "raise"):
                self._uninstall()
            if not report.ok:
                if self.on_mistake == "raise":
                    raise AccumulationError(report)
                warnings.warn(str(report), AccumulationWarning, stacklevel=2)
        return loss


def _calling_trainer() -> Trainer:
    """The ``Trainer`` whose ``train()`` fired this event. A ``TrainerCallback`` is given
    the model, optimizer and scheduler but not the trainer, whose ``training_step`` and
    accelerator the audit needs: it is the ``self`` of a frame further up the stack."""
    frame = inspect.currentframe()
    while frame is not None:
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, Trainer):
            return candidate
        frame = frame.f_back
    raise RuntimeError(
        "AuditCallback works inside trainer.train(): pass it as Trainer(..., "
        "callbacks=[AuditCallback()]) or trainer.add_callback(AuditCallback())"
    )


def _device_of(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def _rng_state(device: torch.device) -> tuple[Tensor, Tensor | None]:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


# -- the reference and the comparison (to be shared with audit_trainer) ---------------------


@dataclass
class _Report:
    ok: bool
    scale: float
    relative_error: float
    targets: int
    counted: int | None

    def __str__(self) -> str:
        return (
            f"audit: {'ok' if self.ok else 'wrong'} scale {self.scale:.4g} "
            f"relative error {self.relative_error:.2e} targets {self.targets} "
            f"counted {self.counted}"
        )


def _logits(output: Any) -> Tensor:
    if isinstance(output, Tensor):
        return output
    if isinstance(output, Mapping) and "logits" in output:
        return output["logits"]
    logits = getattr(output, "logits", None)
    if isinstance(logits, Tensor):
        return logits
    raise TypeError("the model's output has no logits")


def _audit_window(trainer: Trainer, model: nn.Module, window: list[_Microbatch]) -> _Report:
    params = [p for p in model.parameters() if p.requires_grad]
    scaler = getattr(trainer.accelerator, "scaler", None)
    unscale = 1.0 / float(scaler.get_scale()) if scaler is not None else 1.0
    applied = torch.cat(
        [
            (p.grad.detach().double().flatten() if p.grad is not None else p.new_zeros(p.numel()))
            for p in params
        ]
    ) * unscale
    saved_grads = [p.grad for p in params]
    buffers = list(model.buffers())
    saved_buffers = [b.detach().clone() for b in buffers]
    device = _device_of(model)
    targets = sum(int((mb.inputs["labels"][:, 1:] != -100).sum()) for mb in window)
    try:
        for p in params:
            p.grad = None
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            with trainer.accelerator.no_sync(model):
                for mb in window:
                    torch.set_rng_state(mb.rng[0])
                    if mb.rng[1] is not None:
                        torch.cuda.set_rng_state(mb.rng[1], device)
                    inputs = trainer._prepare_inputs(mb.inputs)
                    labels = inputs.pop("labels")
                    logits = _logits(model(**inputs))
                    loss_sum = torch.nn.functional.cross_entropy(
                        logits[:, :-1].flatten(0, 1).float(),
                        labels[:, 1:].flatten(),
                        ignore_index=-100,
                        reduction="sum",
                    )
                    (loss_sum / targets).backward()
        reference = torch.cat(
            [
                (p.grad.detach().double().flatten() if p.grad is not None else p.new_zeros(p.numel()))
                for p in params
            ]
        )
    finally:
        for p, g in zip(params, saved_grads, strict=True):
            p.grad = g
        with torch.no_grad():
            for b, saved in zip(buffers, saved_buffers, strict=True):
                b.copy_(saved)
    norm = float(reference.norm())
    scale = float(applied @ reference) / norm**2
    error = float((applied - reference).norm()) / norm
    counted = window[0].num_items_in_batch
    return _Report(error < 1e-4, scale, error, targets, None if counted is None else int(counted))
