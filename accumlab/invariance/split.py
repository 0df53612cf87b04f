"""A split: how a window's examples are cut into microbatches, and the ``A`` the job divides by.

A job configured with microbatches of ``m`` examples and ``A`` accumulation steps runs a
window as ``Split.uniform(m, A)``: ``A`` microbatches of ``m`` examples, each loss divided
(if the framework divides) by ``A``. The same examples can be run at another split:
``(m·A, 1)`` (the whole window in one microbatch, nothing to accumulate), ``(1, m·A)``
(one example per microbatch), or as a **short window**: fewer microbatches than the
``A`` the job is configured with, as the last window of an epoch is (``Split((2,), 4)``:
one microbatch of two examples in a job that divides by 4). A correct window-level
objective gives the same gradient for the same examples at every full split.

The examples a split covers are ``start, start + 1, ..., start + examples - 1`` of the
list the adapter holds, in order; microbatch ``j`` holds ``ranges()[j]`` of them.
Plain data, torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Split:
    """``sizes[j]`` examples in microbatch ``j`` (in order, from example ``start``), in a
    job configured with ``accumulation_steps`` (the ``A`` it divides by, which may exceed
    ``len(sizes)``: a short window)."""

    sizes: tuple[int, ...]
    accumulation_steps: int
    start: int = 0

    def __post_init__(self) -> None:
        sizes = tuple(self.sizes) if isinstance(self.sizes, (list, tuple)) else self.sizes
        if not isinstance(sizes, tuple) or not sizes or any(
            isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in sizes
        ):
            raise ValueError(
                f"sizes must be a non-empty tuple of positive ints (examples per microbatch), "
                f"got {self.sizes!r}"
            )
        object.__setattr__(self, "sizes", sizes)
        a = self.accumulation_steps
        if isinstance(a, bool) or not isinstance(a, int) or a < len(sizes):
            raise ValueError(
                f"accumulation_steps must be an int of at least len(sizes) = {len(sizes)} (the "
                f"A the job divides by; more than the microbatches is a short window), got {a!r}"
            )
        if isinstance(self.start, bool) or not isinstance(self.start, int) or self.start < 0:
            raise ValueError(f"start must be an int of at least 0, got {self.start!r}")

    @classmethod
    def uniform(cls, micro_batch_size: int, accumulation_steps: int, start: int = 0) -> Split:
        """``accumulation_steps`` microbatches of ``micro_batch_size`` examples each."""
        return cls((micro_batch_size,) * accumulation_steps, accumulation_steps, start)

    @property
    def microbatches(self) -> int:
        """How many microbatches the window holds."""
        return len(self.sizes)

    @property
    def examples(self) -> int:
        """How many examples the window holds."""
        return sum(self.sizes)

    @property
    def short(self) -> bool:
        """True when the window holds fewer microbatches than the job's ``A``."""
        return self.microbatches < self.accumulation_steps

    def ranges(self) -> list[range]:
        """The example indices of each microbatch, in order."""
        out, first = [], self.start
        for n in self.sizes:
            out.append(range(first, first + n))
            first += n
        return out

    def covers_same_examples(self, other: Split) -> bool:
        """True when ``other`` holds exactly this split's examples (cut otherwise)."""
        return self.start == other.start and self.examples == other.examples

    def full(self) -> Split:
        """The same microbatches in a job configured with ``A`` = their number (for a short
        window: what its division should have been)."""
        return Split(self.sizes, self.microbatches, self.start)

    def alone(self) -> list[Split]:
        """Each microbatch as a window of its own (``A`` = 1)."""
        return [Split((len(r),), 1, r.start) for r in self.ranges()]

    @property
    def label(self) -> str:
        """``(m, A)`` when every microbatch holds ``m`` examples and ``A`` is their number;
        otherwise the sizes and ``A``: ``(2, 2, 2, 1) A=4``, ``(2,) A=4`` (a short window).
        Examples from a ``start`` other than 0 are named ``from example k``."""
        if len(set(self.sizes)) == 1 and not self.short:
            text = f"({self.sizes[0]}, {self.accumulation_steps})"
        else:
            inner = ", ".join(map(str, self.sizes)) + ("," if len(self.sizes) == 1 else "")
            text = f"({inner}) A={self.accumulation_steps}"
        return text + (f" from example {self.start}" if self.start else "")

    def __str__(self) -> str:
        return self.label


def default_splits(configured: Split) -> list[Split]:
    """The splits a check runs for a job configured as ``configured``, the reference first:

    - ``(N, 1)``, the window's ``N`` examples in one microbatch (nothing is accumulated: the
      reference every other full split is compared with);
    - ``configured`` itself (``(m, A)``);
    - ``(1, N)``, one example per microbatch;
    - a short window: the first microbatch alone in a job still configured with ``A``
      (``(m,) A=A``, as an epoch's last window of one microbatch), when ``A`` > 1.

    Duplicates are left out (``m = 1`` makes ``(m, A)`` the ``(1, N)`` split)."""
    n, a = configured.examples, configured.accumulation_steps
    candidates = [
        Split((n,), 1, configured.start),
        configured.full() if configured.short else configured,
        Split((1,) * n, n, configured.start),
    ]
    if a > 1:
        candidates.append(Split((configured.sizes[0],), a, configured.start))
    out: list[Split] = []
    for split in candidates:
        if split not in out:
            out.append(split)
    return out


__all__ = ["Split", "default_splits"]
