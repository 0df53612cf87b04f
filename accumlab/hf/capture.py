"""Record what a Hugging Face ``Trainer`` trains on and the gradient it would apply.

A :class:`TrainerCapture` is the audit's eye inside the Trainer's own training path. It
differs from the course's ``accumlab_course.plots.TimelineRecorder`` (which draws the
timeline of a window loop a lesson writes) and from the loop audit's
``accumlab.loop_audit.trace.UpdateTrace``: it captures the microbatches a ``Trainer``
hands its own ``training_step``, on the job's real data. Its internal API (used by
:func:`accumlab.hf.audit_trainer` and by :class:`accumlab.hf.AuditCallback`):

- ``recorder.install(trainer)`` wraps ``trainer.training_step`` (on the instance, so a
  subclass's override still runs) to record each microbatch the Trainer trains on: the
  ``inputs`` as handed to ``training_step`` (tensors cloned, before the Trainer moves
  them to its device; a list of dataset rows for a trainer that generates), what
  ``training_step`` returned (the number the Trainer adds to its logged ``loss``),
  ``num_items_in_batch`` as the Trainer computed it, and the torch RNG state at entry and
  at exit (equal when the step drew no random number: no dropout; otherwise the reference
  replays the entry state, so dropout draws the same masks). For a trainer that
  generates inside ``training_step`` (its ``_prepare_inputs`` turns dataset rows into
  completions, masks and advantages: TRL's GRPO and RLOO) it also records what
  ``_prepare_inputs`` returned, the frozen buffer a replay trains on, and the RNG state
  after it. It wraps ``trainer.accelerator.clip_grad_norm_`` so the window's gradient is
  taken *before* clipping, and notes the gradient norm the Trainer logs (the clip's
  return, or ``_get_grad_norm``'s where the release has it). ``recorder.remove()`` undoes
  every wrapper; ``install`` is also a context manager (``with recorder.install(trainer):
  ...``). A wrapper never raises into the Trainer: a recording that fails marks the
  capture ``broken`` (with the reason) and the Trainer's own step runs as without it.
- ``recorder.open_window()`` starts a window; microbatches recorded while a window is open
  belong to it (outside a window they are ignored).
- ``recorder.close_window(model)`` snapshots the gradient now in ``model``'s trainable
  parameters (the ``.grad`` tensors themselves, no copy; with the factor that undoes an
  enabled GradScaler's loss scale, or the clip the Trainer applies in place right after)
  and ends the window. It is idempotent
  per window: the clip wrapper calls it before the first clip of a sync step, and a
  callback's ``on_pre_optimizer_step`` may call it again harmlessly (with
  ``max_grad_norm=0`` there is no clip on older Trainers, so that call is the one that
  counts). Call it after the window's last backward pass and the data-parallel gradient
  sync, before the optimizer step.
- ``recorder.windows``: the closed :class:`CapturedWindow` objects, in order.

Memory: each recorded microbatch is kept (a clone of its inputs, on the CPU as the loader
gave them) and each window holds one float32 copy of the trainable gradient on the
model's device, until the capture is dropped.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn


@dataclass
class RngState:
    """The torch generators' states: the CPU one and each CUDA device's (empty without CUDA)."""

    cpu: Tensor
    cuda: list[Tensor]

    @classmethod
    def now(cls) -> RngState:
        cuda = (
            torch.cuda.get_rng_state_all()
            if torch.cuda.is_available() and torch.cuda.is_initialized()
            else []
        )
        return cls(torch.get_rng_state(), cuda)

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda:
            torch.cuda.set_rng_state_all(self.cuda)

    def same_as(self, other: RngState) -> bool:
        return (
            torch.equal(self.cpu, other.cpu)
            and len(self.cuda) == len(other.cuda)
            and all(torch.equal(a, b) for a, b in zip(self.cuda, other.cuda, strict=True))
        )


@dataclass
class Microbatch:
    """One ``training_step`` call: its inputs, the Trainer's count, the RNG state at entry.

    ``random``: the loss drew random numbers (dropout): the RNG state moved between the
    start of the loss and the step's exit. ``returned``: what ``training_step`` returned,
    the number the Trainer adds to its logged ``loss`` (None until the step returned).
    ``prepared``: for a trainer that generates inside ``training_step``, the microbatch
    its ``_prepare_inputs`` returned (completions, masks, advantages, old
    log-probabilities, tensors cloned), and ``loss_rng`` the RNG state right after it.
    """

    inputs: Any
    num_items_in_batch: Tensor | int | None
    rng: RngState
    random: bool = False
    returned: float | None = None
    prepared: dict[str, Any] | None = None
    loss_rng: RngState | None = None


@dataclass
class CapturedWindow:
    """One accumulation window as the Trainer ran it on this rank.

    ``gradient``: the trainable parameters' gradients after the window's last backward pass
    and the gradient sync, in ``named_parameters`` order (None for a parameter without one):
    the ``.grad`` tensors themselves, not copies (the audit never writes into them; a sharded
    gradient is gathered into its full tensor); None until closed. The gradient the window
    computed is ``factor`` times them: ``1 / loss scale`` under an enabled GradScaler, and
    ``1 / clip coefficient`` when the Trainer clipped them in place after the snapshot.
    ``grad_norm``: the gradient norm the Trainer computed for its log (None when it
    computed none, or before it did).
    """

    microbatches: list[Microbatch] = field(default_factory=list)
    gradient: list[Tensor | None] | None = None
    factor: float = 1.0
    grad_norm: float | None = None


def unwrapped_model(trainer: Any) -> nn.Module:
    """The Trainer's model without DDP or compile wrappers."""
    model = trainer.model
    accelerator = getattr(trainer, "accelerator", None)
    return accelerator.unwrap_model(model) if accelerator is not None else model


def trainable_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """``(name, parameter)`` for every parameter that requires grad, in a fixed order."""
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def held_gradient(model: nn.Module) -> list[Tensor | None]:
    """The trainable parameters' ``.grad`` tensors themselves (a sharded one gathered)."""
    grads: list[Tensor | None] = []
    for _, p in trainable_parameters(model):
        g = p.grad
        if g is not None and hasattr(g, "full_tensor"):
            g = g.full_tensor()
        grads.append(None if g is None else g.detach())
    return grads


def gradient_norm(gradient: list[Tensor | None]) -> float:
    """The 2-norm of a gradient held as tensors (float64 accumulation)."""
    total = 0.0
    for g in gradient:
        if g is not None:
            total += float(g.detach().double().pow(2).sum())
    return total**0.5


def clone_inputs(inputs: Any) -> Any:
    """A copy of a (nested) batch: tensors cloned, mappings and sequences rebuilt."""
    if isinstance(inputs, Tensor):
        return inputs.detach().clone()
    if isinstance(inputs, Mapping):
        return {k: clone_inputs(v) for k, v in inputs.items()}
    if isinstance(inputs, (list, tuple)):
        return type(inputs)(clone_inputs(v) for v in inputs)
    return inputs


def _number(value: Any) -> float | None:
    """A returned loss as a float (None for anything that is not one number)."""
    try:
        return float(value.detach().float().mean()) if isinstance(value, Tensor) else float(value)
    except (TypeError, ValueError, RuntimeError):
        return None


class TrainerCapture:
    """Captures a Trainer's microbatches and pre-clip gradients (see the module docstring)."""

    def __init__(self) -> None:
        self.windows: list[CapturedWindow] = []
        self.broken = ""  # why a recording failed; the capture then records nothing more
        self._open: CapturedWindow | None = None
        self._closed: CapturedWindow | None = (
            None  # the last window closed, until its norm is noted
        )
        self._model: nn.Module | None = None
        self._scaler: Any = None
        self._undo: list[tuple[object, str, bool, Any]] = []

    # -- windows ---------------------------------------------------------------------

    def open_window(self) -> None:
        """Start a window: microbatches recorded from now on belong to it."""
        self._open = None if self.broken else CapturedWindow()
        self._closed = None

    @property
    def window_open(self) -> bool:
        return self._open is not None

    def close_window(self, model: nn.Module | None = None) -> CapturedWindow | None:
        """Snapshot the gradient of ``model`` (default: the installed trainer's model) and
        end the open window; returns it, or None when no window was open."""
        window, self._open = self._open, None
        if window is None:
            return None
        model = model if model is not None else self._model
        if model is None:
            raise ValueError("close_window needs the model whose gradient to snapshot")
        window.gradient = held_gradient(model)
        if self._scaler is not None and self._scaler.is_enabled():
            # fp16 with a GradScaler: the gradient is still multiplied by the loss scale
            # here (the Trainer unscales inside the clip this snapshot comes before).
            window.factor = 1.0 / float(self._scaler.get_scale())
        self.windows.append(window)
        self._closed = window
        return window

    def record(self, inputs: Any, num_items_in_batch: Tensor | int | None) -> None:
        """Record one microbatch into the open window (ignored when none is open)."""
        if self._open is None:
            return
        nib = num_items_in_batch
        if isinstance(nib, Tensor):
            nib = nib.detach().clone()
        self._open.microbatches.append(Microbatch(clone_inputs(inputs), nib, RngState.now()))

    def prepared(self, batch: Any) -> None:
        """Note what the last recorded step's ``_prepare_inputs`` returned (a trainer
        that generates): the frozen microbatch, and the RNG state its loss starts from."""
        if self._open is not None and self._open.microbatches and isinstance(batch, Mapping):
            last = self._open.microbatches[-1]
            last.prepared = clone_inputs(dict(batch))
            last.loss_rng = RngState.now()

    def step_done(self, returned: Any) -> None:
        """Note what the last recorded step returned, and whether its loss drew random
        numbers (the RNG moved since the loss started)."""
        if self._open is not None and self._open.microbatches:
            last = self._open.microbatches[-1]
            start = last.loss_rng or last.rng
            last.random = last.random or not start.same_as(RngState.now())
            last.returned = _number(returned)

    def note_grad_norm(self, norm: Any) -> None:
        """The gradient norm the Trainer computed for the window just closed."""
        if self._closed is not None and self._closed.grad_norm is None:
            self._closed.grad_norm = _number(norm)

    def _guarded(self, what: str, action: Any, *args: Any) -> None:
        """Run a recording step; a failure marks the capture broken instead of raising
        into the Trainer."""
        if self.broken:
            return
        try:
            action(*args)
        except Exception as err:  # noqa: BLE001 - the run must go on whatever the audit meets
            self.broken = f"recording {what} failed: {type(err).__name__}: {err}"
            self._open = None

    # -- hooks into a Trainer ----------------------------------------------------------

    def install(self, trainer: Any) -> contextlib.AbstractContextManager[TrainerCapture]:
        """Wrap ``trainer.training_step``, ``_prepare_inputs`` (for a trainer that
        generates), ``accelerator.clip_grad_norm_`` and ``_get_grad_norm``.

        Returns a context manager that calls :meth:`remove` on exit; calling ``install``
        without ``with`` leaves the wrappers until ``remove()``.
        """
        if self._undo:
            raise RuntimeError("this capture is already installed; call remove() first")
        self._model = trainer.model
        step = trainer.training_step

        def training_step(
            model: nn.Module, inputs: Any, num_items_in_batch: Any = None, *a: Any, **k: Any
        ) -> Any:
            self._guarded("a microbatch", self.record, inputs, num_items_in_batch)
            returned = None
            try:
                returned = step(model, inputs, num_items_in_batch, *a, **k)
                return returned
            finally:
                self._guarded("a step's loss", self.step_done, returned)

        self._patch(trainer, "training_step", training_step)
        prepare = getattr(trainer, "_prepare_inputs", None)
        if callable(prepare):

            def _prepare_inputs(inputs: Any, *a: Any, **k: Any) -> Any:
                batch = prepare(inputs, *a, **k)
                if not isinstance(inputs, Mapping):  # dataset rows in, a generated batch out
                    self._guarded("a generated microbatch", self.prepared, batch)
                return batch

            self._patch(trainer, "_prepare_inputs", _prepare_inputs)
        accelerator = getattr(trainer, "accelerator", None)
        self._scaler = getattr(accelerator, "scaler", None)
        if accelerator is not None and hasattr(accelerator, "clip_grad_norm_"):
            clip = accelerator.clip_grad_norm_

            def clip_grad_norm_(*a: Any, **k: Any) -> Any:
                window, before = None, 0.0
                if self._open is not None:
                    try:
                        window = self.close_window()
                        before = gradient_norm(window.gradient or [])
                    except Exception as err:  # noqa: BLE001 - never raise into the Trainer
                        self.broken = f"closing the window failed: {type(err).__name__}: {err}"
                total = clip(*a, **k)
                if window is not None and before > 0:
                    # unscaled and clipped in place, in the tensors held: what undoes both
                    # is the ratio of their norms, whatever the clip did
                    after = gradient_norm(window.gradient or [])
                    if after > 0:
                        window.factor *= before / after
                if not hasattr(trainer, "_get_grad_norm"):  # older releases log the clip's total
                    self._guarded("the gradient norm", self.note_grad_norm, total)
                return total

            self._patch(accelerator, "clip_grad_norm_", clip_grad_norm_)
        norm = getattr(trainer, "_get_grad_norm", None)
        if callable(norm):

            def _get_grad_norm(*a: Any, **k: Any) -> Any:
                value = norm(*a, **k)
                self._guarded("the gradient norm", self.note_grad_norm, value)
                return value

            self._patch(trainer, "_get_grad_norm", _get_grad_norm)
        return self._installed()

    @contextlib.contextmanager
    def _installed(self) -> Iterator[TrainerCapture]:
        try:
            yield self
        finally:
            self.remove()

    def _patch(self, obj: object, name: str, value: Any) -> None:
        had = name in vars(obj)
        self._undo.append((obj, name, had, vars(obj).get(name)))
        setattr(obj, name, value)

    def remove(self) -> None:
        """Undo :meth:`install`: the instance attributes are as they were before."""
        while self._undo:
            obj, name, had, old = self._undo.pop()
            if had:
                setattr(obj, name, old)
            else:
                with contextlib.suppress(AttributeError):
                    delattr(obj, name)


__all__ = [
    "CapturedWindow",
    "Microbatch",
    "RngState",
    "TrainerCapture",
    "clone_inputs",
    "held_gradient",
    "gradient_norm",
    "trainable_parameters",
    "unwrapped_model",
]
