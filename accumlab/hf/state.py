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
import random
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from .capture import RngState


@contextlib.contextmanager
def preserved_rng() -> Iterator[None]:
    """Restore Python's, NumPy's (when installed) and torch's (CPU and CUDA) RNG states on exit."""
    py = random.getstate()
    try:
        import numpy as np

        np_state: Any = np.random.get_state()
    except ImportError:  # pragma: no cover - numpy comes with torch's usual installs
        np, np_state = None, None
    torch_state = RngState.now()
    try:
        yield
    finally:
        random.setstate(py)
        if np is not None:
            np.random.set_state(np_state)
        torch_state.restore()


@contextlib.contextmanager
def preserved_model(model: nn.Module) -> Iterator[None]:
    """On exit: every parameter's ``.grad`` is its original tensor (or None), each module's
    training flag and buffer values are as before, the top module's instance attributes
    (an Accelerate ``forward`` patch) are the original ones, and the RNG states are restored.

    Inside, gradients start cleared (``None``).
    """
    params = list(model.parameters())
    grads = [p.grad for p in params]
    modes = [(m, m.training) for m in model.modules()]
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    attributes = dict(vars(model))
    for p in params:
        p.grad = None
    try:
        with preserved_rng():
            yield
    finally:
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        for m, training in modes:
            m.training = training
        with torch.no_grad():
            for b, saved in buffers:
                if not torch.equal(b, saved):
                    b.copy_(saved)
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


__all__ = ["preserved_model", "preserved_rng", "preserved_trainer"]
