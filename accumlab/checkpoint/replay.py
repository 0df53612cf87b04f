"""The replay of RNG states: what a checkpoint keeps of the random generators, and how a
resume draws the same random numbers as the run that wrote it.

Two kinds of state are kept. The generators' state at the checkpoint (:func:`rng_state`),
restored once the model is in place, so dropout draws the same masks. And the state at
which reading a window of data drew random numbers (a shuffling sampler without its own
generator draws its epoch's order when the epoch starts): :class:`DataDraws` notes it
while a run reads its data and restores it when a resume reads the same windows again
(to skip them), so every epoch is shuffled as it was.
"""

from __future__ import annotations

import random
import warnings
from collections.abc import Iterator
from typing import Any

import torch

MAX_RNG_DRAWS = 1024  # RNG states kept for windows whose reading drew random numbers



def rng_state() -> dict[str, Any]:
    """The generators a training step draws from: torch's CPU generator, every CUDA
    device's (``None`` without CUDA) and Python's ``random`` (tensors and plain data)."""
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        "python": random.getstate(),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` returned, or the part of it ``state`` holds. CUDA
    states are restored for the devices present in both (all of them when the device
    count is unchanged)."""
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available():
        for device, device_state in enumerate(cuda[: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(device_state, device)
    if "python" in state:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))


def changed_generators(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """The generators (keys of :func:`rng_state`) whose state differs between two of its
    results: those something drew from in between."""
    cuda_same = (before["cuda"] is None) == (after["cuda"] is None) and (
        before["cuda"] is None
        or (len(before["cuda"]) == len(after["cuda"]) and all(map(torch.equal, before["cuda"], after["cuda"])))
    )
    same = {
        "torch": torch.equal(before["torch"], after["torch"]),
        "cuda": cuda_same,
        "python": before["python"] == after["python"],
    }
    return [name for name, unchanged in same.items() if not unchanged]




class DataDraws:
    """The RNG states at which reading each window drew random numbers, by window index.

    ``draws`` maps a window to the part of :func:`rng_state` that its reading changed, as
    it was before; at most :data:`MAX_RNG_DRAWS` windows are kept (~5 KB each for torch's
    generator), and ``full_at`` is the first window whose draws were not (``None`` while
    all were), after a warning. :meth:`state` and :meth:`from_state` give and take the
    checkpoint's ``data_history["rng_draws"]`` and ``["rng_draws_full_at"]``.
    """

    def __init__(self, draws: dict[int, dict[str, Any]] | None = None, full_at: int | None = None) -> None:
        self.draws = dict(draws or {})
        self.full_at = full_at

    @classmethod
    def from_state(cls, history: dict[str, Any]) -> DataDraws:
        return cls({int(d["window"]): d["rng"] for d in history["rng_draws"]}, history["rng_draws_full_at"])

    def state(self) -> dict[str, Any]:
        return {
            "rng_draws": [{"window": w, "rng": s} for w, s in sorted(self.draws.items())],
            "rng_draws_full_at": self.full_at,
        }

    def replay(self, source: Iterator[Any], index: int) -> Any:
        """``next(source, None)`` as window ``index`` of a resume's skip: first restore the
        RNG state its reading drew from in the run that wrote the checkpoint."""
        if index in self.draws:
            set_rng_state(self.draws[index])
        return next(source, None)

    def read(self, source: Iterator[Any], index: int) -> Any:
        """``next(source, None)`` as window ``index``, noting the RNG state it drew from."""
        before = rng_state()
        window = next(source, None)
        drawn = changed_generators(before, rng_state()) if window is not None else []
        if drawn:
            if len(self.draws) < MAX_RNG_DRAWS:
                self.draws[index] = {name: before[name] for name in drawn}
            elif self.full_at is None:
                self.full_at = index
                warnings.warn(
                    f"reading the data drew from the global random generators in more than "
                    f"{MAX_RNG_DRAWS} windows (the last kept: window {max(self.draws, default=-1)}); "
                    f"a resume that skips past window {index} cannot replay those draws and "
                    "relies on the data check. Give the sampler or collate_fn its own "
                    "torch.Generator, or use a loader with state_dict()",
                    UserWarning,
                    stacklevel=5,
                )
        return window
