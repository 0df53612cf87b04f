"""A whole model's gradient held once, and another one compared with it entry by entry.

A gradient here is what an adapter's ``run`` returns: one tensor (or ``None``, read as
zeros) per trainable parameter, always in the same order. :class:`HeldGradient` keeps one
copy (float32, or float64 for a float64 gradient: never narrower than float32), the only
gradient-sized memory the check adds; the gradient it is compared with stays where the
adapter left it (the parameters' ``.grad``). :meth:`HeldGradient.compare` reads both a
chunk of at most ``CHUNK`` entries at a time, in float64 (the only float64 temporaries),
and gives the three numbers the check reads (:func:`compare` does the same for two gradients
held elsewhere, without a copy): the factor ``a`` of the least-squares fit
``g ≈ a · held`` (:func:`accumlab.least_squares.least_squares_products`), the relative
error ``‖g − held‖ / ‖held‖`` (formed entry by entry, so a float32 rounding error is
measured, not lost) and the fit's residual ``‖g − a · held‖ / ‖g‖``. :func:`dot` and
:func:`distance` read two gradients the same way (the Trainer audit's fits).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ..least_squares import least_squares_products

#: One entry per trainable parameter, in a fixed order; ``None`` is a zero gradient.
Gradient = Sequence[Tensor | None]
#: Entries read into float64 at a time (8 MiB per temporary), whatever a parameter's size.
CHUNK = 1 << 20


def float64_chunks(a: Tensor | None, b: Tensor | None) -> Iterator[tuple[Tensor | None, Tensor | None]]:
    """Aligned float64 chunks of two same-shaped (flattened) tensors, ``b``'s on ``a``'s
    device; None reads as zeros (its chunks are None)."""
    ref = a if a is not None else b
    if ref is None:
        return
    n = ref.numel()
    fa = a.detach().reshape(-1) if a is not None else None
    fb = b.detach().reshape(-1) if b is not None else None
    for s in range(0, n, CHUNK):
        e = min(n, s + CHUNK)
        ca = fa[s:e].double() if fa is not None else None
        cb = fb[s:e].to(ca.device if ca is not None else fb.device).double() if fb is not None else None
        yield ca, cb


def dot(a: Gradient, b: Gradient) -> float:
    """``<a, b>`` over every parameter, in float64."""
    total = 0.0
    for x, y in zip(a, b, strict=True):
        for cx, cy in float64_chunks(x, y):
            if cx is not None and cy is not None:
                total += float(torch.dot(cx, cy))
    return total


def distance(a: Gradient, fa: float, b: Gradient, fb: float) -> float:
    """``‖fa·a − fb·b‖`` over every parameter, in float64 (no cancellation: the difference
    is formed entry by entry)."""
    total = 0.0
    for x, y in zip(a, b, strict=True):
        for cx, cy in float64_chunks(x, y):
            d = (fa * cx if cx is not None else 0.0) - (fb * cy if cy is not None else 0.0)
            if isinstance(d, Tensor):
                total += float(d.dot(d))
    return math.sqrt(total)


@dataclass(frozen=True)
class Comparison:
    """``g`` against the held gradient ``h``: ``factor`` minimises ``‖g − factor · h‖``,
    ``relative_error`` is ``‖g − h‖ / ‖h‖`` and ``residual`` is ``‖g − factor · h‖ / ‖g‖``
    (0 when ``g`` is zero). ``norm`` is ``‖g‖`` and ``held_norm`` is ``‖h‖``."""

    factor: float
    relative_error: float
    residual: float
    norm: float
    held_norm: float

    @property
    def finite(self) -> bool:
        """True when both gradients were finite."""
        return math.isfinite(self.norm) and math.isfinite(self.held_norm)


def _check_entries(gradient: object, expected: int | None) -> list[Tensor | None]:
    if isinstance(gradient, Tensor) or not isinstance(gradient, Sequence):
        raise TypeError(
            "a split's gradient must be a sequence with one tensor (or None) per trainable "
            f"parameter, got {type(gradient).__name__}"
        )
    entries = list(gradient)
    for i, g in enumerate(entries):
        if g is not None and not (isinstance(g, Tensor) and g.is_floating_point()):
            raise TypeError(
                f"entry {i} of a split's gradient must be a floating-point tensor or None, "
                f"got {type(g).__name__}"
            )
    if expected is not None and len(entries) != expected:
        raise ValueError(
            f"a split's gradient has {len(entries)} entries where the first had {expected}: "
            "return one entry per trainable parameter, in the same order every time"
        )
    return entries


def _held_dtype(g: Tensor) -> torch.dtype:
    return torch.float64 if g.dtype == torch.float64 else torch.float32


class HeldGradient:
    """One copy of a gradient, in float32 (float64 for a float64 gradient), reused: setting
    or adding another gradient writes into the same buffers."""

    def __init__(self) -> None:
        self.tensors: list[Tensor | None] | None = None

    def _entries(self, gradient: Gradient) -> list[Tensor | None]:
        entries = _check_entries(gradient, None if self.tensors is None else len(self.tensors))
        if self.tensors is None:
            self.tensors = [None] * len(entries)
        for i, (h, g) in enumerate(zip(self.tensors, entries, strict=True)):
            if g is not None and h is not None and h.shape != g.shape:
                raise ValueError(
                    f"entry {i} of a split's gradient has shape {tuple(g.shape)}, the held one "
                    f"{tuple(h.shape)}: return one entry per trainable parameter, in the same "
                    "order every time"
                )
        return entries

    def set(self, gradient: Gradient) -> None:
        """Hold a copy of ``gradient`` (zeros where it is None)."""
        self.zero()
        self.add(gradient)

    def zero(self) -> None:
        """Hold zeros (buffers kept)."""
        for h in self.tensors or []:
            if h is not None:
                h.zero_()

    def add(self, gradient: Gradient) -> None:
        """Add ``gradient`` into the held one."""
        entries = self._entries(gradient)
        assert self.tensors is not None
        for i, g in enumerate(entries):
            if g is None:
                continue
            g = g.detach()
            if self.tensors[i] is None:
                self.tensors[i] = torch.zeros(g.shape, dtype=_held_dtype(g), device=g.device)
            held = self.tensors[i]
            assert held is not None
            held.add_(g.to(held.device, held.dtype))

    @property
    def dtype(self) -> torch.dtype | None:
        """The held copy's dtype (None before anything is held)."""
        for h in self.tensors or []:
            if h is not None:
                return h.dtype
        return None

    def compare(self, gradient: Gradient) -> Comparison:
        """``gradient`` against the held one (see :class:`Comparison`)."""
        entries = self._entries(gradient)
        assert self.tensors is not None
        return compare(entries, self.tensors)


def compare(gradient: Gradient, held: Gradient) -> Comparison:
    """``gradient`` against ``held`` (see :class:`Comparison`), both read where they are,
    ``CHUNK`` entries at a time in float64: no copy of either is made."""
    entries = _check_entries(gradient, None)
    others = _check_entries(held, len(entries))
    gg = hh = gh = dd = 0.0
    for i, (g, h) in enumerate(zip(entries, others, strict=True)):
        if g is not None and h is not None and g.shape != h.shape:
            raise ValueError(f"entry {i}: shapes {tuple(g.shape)} and {tuple(h.shape)} differ")
        for x, y in float64_chunks(g, h):
            if x is not None:
                gg += float(x.dot(x))
            if y is not None:
                hh += float(y.dot(y))
            if x is not None and y is not None:
                gh += float(x.dot(y))
                dd += float((x - y).square().sum())
            else:
                dd += float((x if x is not None else y).square().sum())  # type: ignore[union-attr]
    norm, held_norm = math.sqrt(gg), math.sqrt(hh)
    if not (math.isfinite(gg) and math.isfinite(hh) and math.isfinite(gh)):
        return Comparison(math.nan, math.nan, math.nan, norm, held_norm)
    if hh == 0.0:
        return Comparison(math.nan, 0.0 if gg == 0.0 else math.inf, 0.0 if gg == 0.0 else 1.0,
                          norm, held_norm)
    fit = least_squares_products(gg, [gh], [[hh]])
    return Comparison(fit.coefficients[0], math.sqrt(dd) / held_norm, fit.residual, norm, held_norm)


__all__ = ["CHUNK", "Comparison", "Gradient", "HeldGradient", "compare", "distance", "dot", "float64_chunks"]
