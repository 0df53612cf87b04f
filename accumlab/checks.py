"""Checks that accumulation is exact: the accumulated gradient against the full-batch one.

Floating-point addition is not associative, so the two gradients agree to a tolerance,
never bit for bit: about 1e-6 relative in float32, 1e-12 in float64 for the small models
of this course. The audit of a user's window loop is :func:`accumlab.audit`
(:mod:`accumlab.loop_audit`).
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .loop import Forward, accumulate
from .objectives import Objective, check_batch, take_rows


def split_batch(batch: Mapping[str, Tensor], sizes: Sequence[int]) -> list[dict[str, Tensor]]:
    """Cut a batch into consecutive microbatches of ``sizes`` examples (rows of dim 0).

    ``sizes`` must be positive and sum to the batch size: no example is left out or reused.
    """
    batch = check_batch(batch)
    n = int(batch["labels"].shape[0])
    sizes = list(sizes)
    if not sizes or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in sizes):
        raise ValueError(f"splits must be a non-empty list of positive ints, got {sizes!r}")
    if sum(sizes) != n:
        raise ValueError(
            f"splits {sizes} add up to {sum(sizes)} examples but the batch has {n}; every "
            "example must land in exactly one microbatch"
        )
    for key, value in batch.items():
        if isinstance(value, Tensor) and (value.dim() == 0 or value.shape[0] != n):
            raise ValueError(
                f"batch[{key!r}] has shape {tuple(value.shape)}; every tensor needs the "
                f"batch size {n} as its first dimension"
            )
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [take_rows(batch, start, start + size) for start, size in zip(starts, sizes, strict=True)]


def gradients(model: nn.Module) -> dict[str, Tensor]:
    """A detached copy of every parameter's ``.grad`` (zeros where it is None)."""
    return {
        name: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
        for name, p in model.named_parameters()
        if p.requires_grad
    }


@dataclass
class GradientComparison:
    """Per-parameter and overall errors of ``candidate`` against ``reference`` gradients.

    ``max_abs[name]`` is ``max |candidate - reference|``; ``relative[name]`` divides it by
    ``max |reference|`` of that parameter (0 where both are zero). ``max_abs_error`` and
    ``max_rel_error`` are the largest over all parameters.
    """

    max_abs: dict[str, float]
    relative: dict[str, float]

    @property
    def max_abs_error(self) -> float:
        return max(self.max_abs.values(), default=0.0)

    @property
    def max_rel_error(self) -> float:
        return max(self.relative.values(), default=0.0)

    def ok(self, rtol: float = 1e-5) -> bool:
        """True when every parameter's relative error is at most ``rtol``."""
        return self.max_rel_error <= rtol

    def __str__(self) -> str:
        worst = max(self.relative, key=self.relative.__getitem__, default="-")
        return (
            f"max abs error {self.max_abs_error:.2e}, max relative error "
            f"{self.max_rel_error:.2e} (worst parameter: {worst})"
        )


def compare(reference: Mapping[str, Tensor], candidate: Mapping[str, Tensor]) -> GradientComparison:
    """Compare two gradient dictionaries with the same names and shapes."""
    if reference.keys() != candidate.keys():
        raise ValueError(
            f"gradient names differ: {sorted(set(reference) ^ set(candidate))}"
        )
    max_abs, relative = {}, {}
    for name, ref in reference.items():
        cand = candidate[name]
        if cand.shape != ref.shape:
            raise ValueError(f"{name}: shapes {tuple(cand.shape)} and {tuple(ref.shape)} differ")
        err = float((cand.double() - ref.double()).abs().max()) if ref.numel() else 0.0
        scale = float(ref.double().abs().max()) if ref.numel() else 0.0
        max_abs[name] = err
        relative[name] = err / scale if scale > 0 else (0.0 if err == 0 else float("inf"))
    return GradientComparison(max_abs, relative)


# -- finiteness: checks and a fault injector for tests and notebooks -------------------


def gradients_finite(parameters: Iterable[Tensor]) -> bool:
    """True when every existing ``.grad`` among ``parameters`` is free of inf and nan.

    Checks each gradient tensor element-wise (``torch.isfinite(grad).all()``), so it never
    reports a finite gradient as non-finite the way ``isfinite(total norm)`` can: the sum
    of squares of finite float32 values above about 1.8e19 overflows to ``inf``. Parameters
    without a gradient are ignored; with none at all the answer is True. One device
    synchronization per call.
    """
    flags = [
        torch.isfinite(p.grad.detach()).all()
        for p in parameters
        if p.grad is not None and p.grad.numel()
    ]
    if not flags:
        return True
    devices = {f.device for f in flags}
    if len(devices) > 1:  # a model split over devices: gather the flags on the CPU
        flags = [f.cpu() for f in flags]
    return bool(torch.stack(flags).all())


def parameters_of(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[Tensor]:
    """The model's parameters followed by any parameter the optimizer holds beyond them,
    each once: the set whose gradients decide whether an update attempt may be applied."""
    seen: set[int] = set()
    out: list[Tensor] = []
    candidates = [*model.parameters(), *(p for g in optimizer.param_groups for p in g["params"])]
    for p in candidates:
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


@contextlib.contextmanager
def inject_nonfinite(parameter: Tensor, value: float = math.inf) -> Iterator[None]:
    """Make every gradient that reaches ``parameter`` inside the block non-finite.

    Registers a tensor hook that multiplies each incoming gradient contribution by
    ``value`` (``inf`` by default; entries that were zero become ``nan``), and removes it
    on exit. A fault injector for tests and demonstrations: wrap one window in it and that
    window's update attempt must be skipped while every other window applies normally.
    """
    if not isinstance(parameter, Tensor) or not parameter.requires_grad:
        raise TypeError(
            "parameter must be a tensor that requires grad (e.g. a model parameter), got "
            f"{type(parameter).__name__}"
        )
    if math.isfinite(value):
        raise ValueError(f"value must be inf, -inf or nan, got {value!r}")
    handle = parameter.register_hook(lambda grad: grad * value)
    try:
        yield
    finally:
        handle.remove()


def accumulated_gradient(
    model: nn.Module,
    batch: Mapping[str, Tensor],
    objective: Objective,
    splits: Sequence[int] | None = None,
    *,
    forward: Forward | None = None,
) -> dict[str, Tensor]:
    """The gradient the loop accumulates from ``batch`` cut into microbatches of
    ``splits`` examples; ``splits=None`` is the whole batch in one backward pass, the
    gradient of ``loss_sum(batch) / count(batch)``.

    Works on the model in place (its ``.grad`` is cleared before and after).
    """
    window = [batch] if splits is None else split_batch(batch, splits)
    model.zero_grad(set_to_none=True)
    accumulate(model, window, objective, forward=forward)
    grads = gradients(model)
    model.zero_grad(set_to_none=True)
    return grads


#: The full-batch reference: ``accumulated_gradient`` without ``splits``.
full_batch_gradient = accumulated_gradient


def compare_gradients(
    model: nn.Module,
    batch: Mapping[str, Tensor],
    objective: Objective,
    splits: Sequence[int],
    *,
    forward: Forward | None = None,
) -> GradientComparison:
    """Full-batch gradient against the accumulated one for the split ``splits``.

    Runs on two deep copies of ``model`` (the original's weights and ``.grad`` are left
    alone), each seeded the same so dropout, if active, draws the same way at the start.
    Returns the per-parameter errors of the accumulated gradient relative to the full one.
    """
    rng = torch.get_rng_state()
    reference = accumulated_gradient(copy.deepcopy(model), batch, objective, forward=forward)
    torch.set_rng_state(rng)
    candidate = accumulated_gradient(
        copy.deepcopy(model), batch, objective, splits, forward=forward
    )
    return compare(reference, candidate)


__all__ = [
    "GradientComparison",
    "accumulated_gradient",
    "compare",
    "compare_gradients",
    "full_batch_gradient",
    "gradients",
    "gradients_finite",
    "inject_nonfinite",
    "parameters_of",
    "split_batch",
]
