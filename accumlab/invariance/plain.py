"""Split invariance on the user's own job: :func:`split_invariance`, the plain adapter.

The user gives what the job already has: the model, examples, the collate function that
makes a microbatch of examples, and the window code, ``window(model, microbatches,
accumulation_steps)``, which runs forward and backward for each microbatch of a list (no
optimizer step; everything up to the step, such as ``accelerator.backward``, torchtune's
``scale_grads`` or a closure the code calls itself). ``accumulation_steps`` is the ``A`` a
job configured for that split would have: the number of microbatches, except in a short
window; code that sets a framework's ``A`` (Accelerate's
``accelerator.gradient_accumulation_steps``) sets it from there, code that counts its
window itself ignores it. The check reads each trainable parameter's ``.grad`` once the
window code returns.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ..objectives import Objective
from ..validate import check_positive_int, check_positive_number
from .engine import NotChecked, check_splits
from .gradients import Gradient
from .report import InvarianceReport
from .split import Split
from .state import ModelState

Window = Callable[[nn.Module, list[Any], int], Any]


def _forward_default(model: nn.Module, batch: Any) -> Any:
    """The model called like a Hugging Face model: every entry of a mapping but labels and
    example_ids as a keyword argument."""
    return model(**{k: v for k, v in batch.items() if k not in ("labels", "example_ids")})


def _check_window(window: object) -> None:
    if not callable(window):
        raise TypeError(
            "window must be your window code, window(model, microbatches, accumulation_steps), "
            f"got {type(window).__name__}")
    try:
        inspect.signature(window).bind(None, None, None)
    except TypeError:
        raise TypeError(
            "window must accept three arguments (model, microbatches, accumulation_steps); "
            f"{getattr(window, '__name__', window)!r} has the signature {inspect.signature(window)}"
        ) from None
    except ValueError:
        pass  # a callable whose signature Python cannot read: let the call decide


def _check_objective(objective: object, forward: object) -> None:
    if objective is not None and not isinstance(objective, Objective):
        raise TypeError(
            "objective must be an accumlab Objective (count(batch) and loss_sum(output, batch), "
            f"such as al.NextTokenLoss()) or None, got {type(objective).__name__}")
    if forward is not None and not callable(forward):
        raise TypeError(f"forward must be a callable forward(model, batch) or None, got {type(forward).__name__}")


def split_invariance(
    model: nn.Module,
    examples: Sequence[Any],
    collate: Callable[[list[Any]], Any],
    window: Window,
    *,
    micro_batch_size: int,
    accumulation_steps: int,
    splits: Sequence[Split] | None = None,
    objective: Objective | None = None,
    forward: Callable[[nn.Module, Any], Any] | None = None,
    tolerance: float | None = None,
) -> InvarianceReport:
    """Check that your job's gradient for the same examples does not depend on how they are
    split into microbatches, on your own model, loss and window code.

    ``examples``: the first ``micro_batch_size × accumulation_steps`` (``N``) of them form
    the window (more are counted in the report's notes, never silently dropped).
    ``collate(list_of_examples)`` makes one microbatch. ``window(model, microbatches,
    accumulation_steps)`` is your code for one window without the step: forward and
    backward for each microbatch of the list (see the module docstring for
    ``accumulation_steps``). The window is run, from the same weights and random state, at
    ``(N, 1)`` (the reference), ``(m, A)`` as configured, ``(1, N)``, and as a short window
    (the first microbatch alone in a job still configured with ``A``), or at ``splits``; a
    dependence no factor explains is run once more per microbatch, alone, to see its
    structure. With ``objective`` (an :class:`accumlab.Objective` such as
    ``al.NextTokenLoss()``, called on ``forward(model, microbatch)``'s output, by default
    ``model(**microbatch)`` without labels), the configured split is also compared with the
    objective's window mean (its ``loss_sum`` summed over the window divided by its
    ``count`` summed over the window). ``tolerance``: the relative error within which two
    gradients agree (by default 1e-9 for float64 gradients, 1e-4 for float32, 3e-2 for
    half precision; pass a larger one for code that runs under autocast).

    Needs a window whose code draws no random numbers (dropout 0, no random masking in the
    collate: a draw falls differently at each split; the check stops and says so) and does
    not step. Extra memory: one copy of the trainable parameters' gradient (float32, or
    float64), float64 temporaries of one parameter at a time, and the activations of the
    largest microbatch a split runs (the ``(N, 1)`` reference holds all ``N`` examples: an
    out-of-memory error makes ``(m, A)`` the reference). The parameters' ``.grad`` (the
    same tensors), modes, buffers and random states are as before when it returns.

    Returns an :class:`~accumlab.invariance.report.InvarianceReport` (``ok``, ``mistakes``,
    ``measures``, ``text()``). Exceptions from your code propagate, with a note naming the
    split.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    m = check_positive_int("micro_batch_size", micro_batch_size)
    a = check_positive_int("accumulation_steps", accumulation_steps)
    if isinstance(examples, (str, bytes, Mapping)) or not isinstance(examples, Sequence):
        raise TypeError(
            "examples must be a sequence of examples (a list, a Dataset with len), "
            f"got {type(examples).__name__}")
    if len(examples) < m * a:
        raise ValueError(
            f"examples holds {len(examples)} examples; a window of micro_batch_size × "
            f"accumulation_steps = {m} × {a} needs {m * a}: pass more, or a smaller window")
    if not callable(collate):
        raise TypeError(f"collate must be a callable collate(list_of_examples) -> microbatch, got {type(collate).__name__}")
    _check_window(window)
    _check_objective(objective, forward)
    if tolerance is not None:
        tolerance = check_positive_number("tolerance", tolerance, dtype=torch.float64)
    if type(model).__module__.startswith("deepspeed."):
        return _deepspeed_refused(m, a)
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("model has no trainable parameter (requires_grad=True): nothing to check")
    state = ModelState(model)
    try:
        run = _Runner(model, params, examples, collate, window, state)
        target = None
        if objective is not None:
            target = _objective_run(model, params, examples, collate, objective, forward or _forward_default, state)
        report = check_splits(run, Split.uniform(m, a), splits=splits, objective=target,
                              tolerance=tolerance)
    finally:
        state.close()
    unused = len(examples) - m * a
    if unused:
        report.notes.append(
            f"{unused} example{'s' if unused != 1 else ''} beyond the window's {m * a} were not used")
    report.ran += ("; the window code's gradient read from .grad after it returned"
                   + (f"; the objective: {objective!r}" if objective is not None else ""))
    return report


def _deepspeed_refused(m: int, a: int) -> InvarianceReport:
    return InvarianceReport(Split.uniform(m, a), 0.0, checked=False, reason=(
        "a DeepSpeed engine owns the gradient: its backward steps the optimizer at the "
        "window's last microbatch (accelerator.backward calls engine.step) and ZeRO keeps the "
        "gradient in its own partitions, so there is none to read between backward and step; "
        "check the same window code on the model before accelerator.prepare, without the "
        "DeepSpeed plugin (DeepSpeed's own gradient_clipping, 1.0 unless its config says "
        "otherwise, is then not checked)"))


class _Runner:
    """``run(split)`` for the engine: the window code on the split's microbatches."""

    def __init__(self, model: nn.Module, params: list[nn.Parameter], examples: Sequence[Any],
                 collate: Callable[[list[Any]], Any], window: Window, state: ModelState) -> None:
        self.model, self.params, self.examples = model, params, examples
        self.collate, self.window, self.state = collate, window, state

    def __call__(self, split: Split) -> Gradient:
        self.state.reset()
        microbatches = [self.collate([self.examples[i] for i in r]) for r in split.ranges()]
        try:
            self.window(self.model, microbatches, split.accumulation_steps)
        except torch.OutOfMemoryError:
            raise
        except Exception as exc:
            if hasattr(exc, "add_note"):  # Python 3.11+
                exc.add_note(f"(raised by the window code at split {split.label})")
            raise
        del microbatches
        _refuse_side_effects(self.state, split)
        return [p.grad for p in self.params]


def _refuse_side_effects(state: ModelState, split: Split) -> None:
    drew = state.drew()
    if drew:
        raise NotChecked(
            f"the window at {split.label} drew random numbers ({', '.join(drew)} moved: dropout, "
            "random masking or shuffling in the collate), which fall differently at each split: "
            "set dropout to 0 and make the collate deterministic to check")
    written = state.weights_written()
    if written:
        raise NotChecked(
            f"the window code wrote into {len(written)} parameter(s) at {split.label} (an "
            "optimizer step?): give the code up to the step, forward and backward only")


def _objective_run(model: nn.Module, params: list[nn.Parameter], examples: Sequence[Any],
                   collate: Callable[[list[Any]], Any], objective: Objective,
                   forward: Callable[[nn.Module, Any], Any], state: ModelState) -> Callable[[Split], Gradient]:
    """``objective(split)``: the objective's window mean over the split's examples, one
    backward per microbatch of the split (``loss_sum / the window's count``)."""

    def run(split: Split) -> Gradient:
        state.reset()
        microbatches = [collate([examples[i] for i in r]) for r in split.ranges()]
        total = sum(int(objective.count(mb)) for mb in microbatches)
        if total <= 0:
            raise NotChecked(f"the objective counts no {objective.unit} in the window's examples")
        for mb in microbatches:
            loss = objective.loss_sum(forward(model, mb), mb)
            if not isinstance(loss, Tensor):
                raise TypeError(f"objective.loss_sum must return a tensor, got {type(loss).__name__}")
            (loss / total).backward()
        _refuse_side_effects(state, split)
        return [p.grad for p in params]

    return run


__all__ = ["Window", "split_invariance"]
