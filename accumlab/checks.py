"""Checks that accumulation is exact: the accumulated gradient against the full-batch one.

Floating-point addition is not associative, so the two gradients agree to a tolerance,
never bit for bit: about 1e-6 relative in float32, 1e-12 in float64 for the small models
of this course.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .loop import Forward, accumulate
from .objectives import Objective, check_batch


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
    pieces, start = [], 0
    for size in sizes:
        pieces.append({k: v[start : start + size] for k, v in batch.items()})
        start += size
    return pieces


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


def full_batch_gradient(
    model: nn.Module,
    batch: Mapping[str, Tensor],
    objective: Objective,
    *,
    forward: Forward | None = None,
) -> dict[str, Tensor]:
    """The gradient of ``loss_sum(batch) / count(batch)`` in one backward pass.

    Works on the model in place (its ``.grad`` is cleared before and after).
    """
    model.zero_grad(set_to_none=True)
    accumulate(model, [batch], objective, forward=forward)
    grads = gradients(model)
    model.zero_grad(set_to_none=True)
    return grads


def accumulated_gradient(
    model: nn.Module,
    batch: Mapping[str, Tensor],
    objective: Objective,
    splits: Sequence[int],
    *,
    forward: Forward | None = None,
) -> dict[str, Tensor]:
    """The gradient the loop accumulates from ``batch`` cut into ``splits`` microbatches."""
    model.zero_grad(set_to_none=True)
    accumulate(model, split_batch(batch, splits), objective, forward=forward)
    grads = gradients(model)
    model.zero_grad(set_to_none=True)
    return grads


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
    reference = full_batch_gradient(copy.deepcopy(model), batch, objective, forward=forward)
    torch.set_rng_state(rng)
    candidate = accumulated_gradient(
        copy.deepcopy(model), batch, objective, splits, forward=forward
    )
    return compare(reference, candidate)
