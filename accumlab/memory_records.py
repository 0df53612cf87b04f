"""What a :class:`~accumlab.memory.MemoryMeter` measured: one record per phase of a window
(a forward pass, a backward pass, the update) and one per window, in bytes on the meter's
device."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class PhaseRecord:
    """One phase of a window, in bytes on the meter's device.

    ``start_bytes``/``end_bytes`` are the live bytes at entry and exit; ``peak_bytes`` the
    highest live bytes while it ran. ``kept_bytes`` (CPU only, ``None`` on CUDA) counts bytes
    allocated during the phase and still live at its end: activations and output for a
    forward pass, new gradients for the first backward pass, optimizer state for the first
    update. ``saved_bytes`` (forward passes only) counts the bytes autograd saved for the
    backward pass, storages of trainable parameters excluded, each storage once.
    ``failed`` is True when an exception (an out-of-memory error) ended the phase.
    """

    window: int
    name: str
    microbatch: int | None
    start_bytes: int
    end_bytes: int
    peak_bytes: int
    kept_bytes: int | None = None
    saved_bytes: int | None = None
    failed: bool = False

    @property
    def net_bytes(self) -> int:
        """``end_bytes - start_bytes``: what the phase left behind (negative when it freed)."""
        return self.end_bytes - self.start_bytes


@dataclass
class WindowRecord:
    """The phases of one window (one update attempt) as the meter saw them.

    ``baseline_bytes`` is what was live before the first microbatch: the weights, the
    optimizer state once it exists, anything else still referenced (a leak shows up here,
    growing window after window). ``complete`` is True once an ``"update"`` phase finished
    without an exception; a window cut short by an out-of-memory error stays incomplete.
    """

    index: int
    baseline_bytes: int
    phases: list[PhaseRecord] = field(default_factory=list)
    complete: bool = False

    @property
    def peak_bytes(self) -> int:
        """The highest live bytes in any phase of the window (the baseline if none ran)."""
        return max([self.baseline_bytes, *(p.peak_bytes for p in self.phases)])

    @property
    def saved_bytes(self) -> list[int]:
        """Bytes saved for backward by each forward pass of the window, in order."""
        return [p.saved_bytes or 0 for p in self.phases if p.name == "forward"]

    def phase(self, name: str, microbatch: int | None = None) -> PhaseRecord:
        """The first record of phase ``name`` (and ``microbatch``, when given)."""
        for p in self.phases:
            if p.name == name and (microbatch is None or p.microbatch == microbatch):
                return p
        raise KeyError(f"window {self.index} has no phase {name!r} (microbatch {microbatch})")

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "baseline_bytes": self.baseline_bytes,
            "peak_bytes": self.peak_bytes,
            "complete": self.complete,
            "saved_bytes": self.saved_bytes,
            "phases": [asdict(p) for p in self.phases],
        }
