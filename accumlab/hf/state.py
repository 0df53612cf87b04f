"""Leave a Trainer exactly as it was: snapshot what a training step touches, restore it.

:func:`preserved_model` covers the model alone (gradients, modes, buffers, the instance
attributes Accelerate patches, the RNG states): a callback can run the reference inside a
real run with it. :func:`preserved_trainer` adds the Trainer's and Accelerate's attributes,
the data loaders Accelerate tracks and its shared gradient state, so
:func:`accumlab.hf.audit_trainer` can run the Trainer's own training path and leave the
trainer, model, optimizer, scheduler, RNG states and data position as before.

Restoring puts back the *same objects* (each parameter's original ``.grad`` tensor, the
original attribute values): nothing is copied back into them, so the state is bit for bit
what it was. Parameter values are never written by the audit (no optimizer step runs).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import nn

from ..invariance.state import ModelState


@contextlib.contextmanager
def preserved_model(model: nn.Module) -> Iterator[None]:
    """On exit: every parameter's ``.grad`` is its original tensor (or None), each module's
    training flag and buffer values are as before, the top module's instance attributes
    (an Accelerate ``forward`` patch) are the original ones, and the RNG states are restored
    (the split-invariance engine's :class:`~accumlab.invariance.state.ModelState`, plus the
    attributes).

    Inside, gradients start cleared (``None``).
    """
    attributes = dict(vars(model))
    state = ModelState(model)
    try:
        yield
    finally:
        state.close()
        for key in list(vars(model)):
            if key not in attributes:
                delattr(model, key)
        vars(model).update(attributes)


def _snapshot(obj: object) -> dict[str, tuple[Any, Any]]:
    """Each instance attribute with a shallow copy of its contents when it is a list or dict."""
    return {
        k: (v, list(v) if isinstance(v, list) else dict(v) if isinstance(v, dict) else None)
        for k, v in vars(obj).items()
    }


def _restore(obj: object, saved: dict[str, tuple[Any, Any]]) -> None:
    """Put back the same attribute objects, lists and dicts refilled with their old items."""
    state = vars(obj)
    for key in list(state):
        if key not in saved:
            del state[key]
    for key, (value, contents) in saved.items():
        if isinstance(value, list):
            value[:] = contents
        elif isinstance(value, dict):
            value.clear()
            value.update(contents)
        state[key] = value


@contextlib.contextmanager
def preserved_trainer(trainer: Any) -> Iterator[None]:
    """:func:`preserved_model` on ``trainer.model`` plus the Trainer's own attributes,
    its ``state`` and ``control`` objects' fields, Accelerate's attributes and tracked
    models and data loaders, and Accelerate's shared gradient state."""
    objects = [trainer]
    for name in ("state", "control", "accelerator"):
        if getattr(trainer, name, None) is not None:
            objects.append(getattr(trainer, name))
    gradient_state = getattr(getattr(trainer, "accelerator", None), "gradient_state", None)
    if gradient_state is not None:
        objects.append(gradient_state)
    saved = [(o, _snapshot(o)) for o in objects]
    try:
        with preserved_model(trainer.model):
            yield
    finally:
        for o, attrs in reversed(saved):
            _restore(o, attrs)


__all__ = ["preserved_model", "preserved_trainer"]
