"""Put a model back as it was between the check's runs and after them, and tell when a
run drew random numbers or wrote into the weights.

:class:`ModelState` snapshots what a window touches without a step: each parameter's
``.grad`` (the same tensor objects are put back, nothing is copied into them), each
module's training flag, the buffers' values (running statistics), and the random states
(Python's, NumPy's when installed, torch's CPU and initialized CUDA generators). Between
runs it restores the modes, buffers and random states and clears the gradients; on close
it puts everything back. A run drew random numbers when a random state differs from the
snapshot after it (dropout falls differently at each split), and wrote into the weights
when a parameter's version counter moved (an optimizer step) or its values' sum and sum of
squares did (a write through ``p.data``, which no version counter sees).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from .gradients import float64_chunks


@dataclass
class RandomState:
    """Python's, NumPy's (None without NumPy) and torch's CPU and CUDA generator states."""

    python: Any
    numpy: Any
    cpu: Tensor
    cuda: list[Tensor]

    @classmethod
    def now(cls) -> RandomState:
        try:
            import numpy as np

            numpy_state: Any = np.random.get_state()
        except ImportError:  # pragma: no cover - NumPy comes with torch's usual installs
            numpy_state = None
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else []
        return cls(random.getstate(), numpy_state, torch.get_rng_state(), cuda)

    def restore(self) -> None:
        random.setstate(self.python)
        if self.numpy is not None:
            import numpy as np

            np.random.set_state(self.numpy)
        torch.set_rng_state(self.cpu)
        if self.cuda:
            torch.cuda.set_rng_state_all(self.cuda)

    def moved(self) -> list[str]:
        """The generators whose state differs from this snapshot now (empty: none drew)."""
        now = RandomState.now()
        out = []
        if now.python != self.python:
            out.append("Python's random")
        if self.numpy is not None and not _same_numpy(now.numpy, self.numpy):
            out.append("NumPy's")
        if not torch.equal(now.cpu, self.cpu):
            out.append("torch's CPU generator")
        if len(now.cuda) != len(self.cuda) or not all(torch.equal(a, b) for a, b in zip(now.cuda, self.cuda, strict=True)):
            out.append("torch's CUDA generator")
        return out


def _fingerprint(p: Tensor) -> tuple[float, float]:
    """The sum and the sum of squares of a parameter's values, in float64 (a chunk at a time)."""
    total = squares = 0.0
    for x, _ in float64_chunks(p, None):
        assert x is not None
        total += float(x.sum())
        squares += float(x.dot(x))
    return total, squares


def _same_numpy(a: Any, b: Any) -> bool:
    import numpy as np

    return a[0] == b[0] and np.array_equal(a[1], b[1]) and tuple(a[2:]) == tuple(b[2:])


class ModelState:
    """The model's state before the check (see the module docstring)."""

    def __init__(self, model: nn.Module, runs_from: RandomState | None = None) -> None:
        """``runs_from``: the random state each run starts from (default: the state now,
        which :meth:`close` puts back either way; a callback checking a window that already
        ran passes the state the window started from)."""
        self.model = model
        self.params = list(model.parameters())
        self.grads = [p.grad for p in self.params]
        self.modes = [(m, m.training) for m in model.modules()]
        self.buffers = [(b, b.detach().clone()) for b in model.buffers()]
        self.versions = [p._version for p in self.params]
        self.fingerprints = [_fingerprint(p) for p in self.params]
        self.random = RandomState.now()
        self.runs_from = runs_from if runs_from is not None else self.random
        for p in self.params:
            p.grad = None

    def reset(self) -> None:
        """Before a run: gradients cleared, modes and buffers as snapshot, the random
        states as each run starts."""
        for p in self.params:
            p.grad = None
        for m, training in self.modes:
            m.training = training
        with torch.no_grad():
            for b, saved in self.buffers:
                if not torch.equal(b, saved):
                    b.copy_(saved)
        self.runs_from.restore()

    def drew(self) -> list[str]:
        """The generators a run since :meth:`reset` drew from."""
        return self.runs_from.moved()

    def weights_written(self) -> list[int]:
        """Indices of the parameters written since the snapshot."""
        return [i for i, (p, v, f) in enumerate(zip(self.params, self.versions, self.fingerprints, strict=True))
                if p._version != v or _fingerprint(p) != f]

    def close(self) -> None:
        """Everything as before the check: the original ``.grad`` objects too."""
        self.reset()
        self.random.restore()
        for p, g in zip(self.params, self.grads, strict=True):
            p.grad = g


__all__ = ["ModelState", "RandomState"]
