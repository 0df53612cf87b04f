"""Reference gradients computed *without* accumlab (plain ``F.cross_entropy(...,
reduction="mean")`` on the whole batch), so a test that compares the package against them
checks the package, not the package against itself; and an optimizer that records the
gradient it is handed."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .models import IGNORE


def grads(model: nn.Module) -> dict[str, Tensor]:
    """A copy of every parameter's ``.grad`` (zeros where there is none)."""
    return {
        n: p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
        for n, p in model.named_parameters()
    }


def params(model: nn.Module) -> dict[str, Tensor]:
    """A copy of every parameter's value."""
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def rel_error(reference: Mapping[str, Tensor], candidate: Mapping[str, Tensor]) -> float:
    """Largest over parameters of ``max |candidate - reference| / max |reference|``."""
    assert reference.keys() == candidate.keys()
    worst = 0.0
    for name, ref in reference.items():
        err = float((candidate[name].double() - ref.double()).abs().max())
        scale = float(ref.double().abs().max())
        worst = max(worst, err / scale if scale > 0 else (0.0 if err == 0 else math.inf))
    return worst


def reference_gradient(
    model: nn.Module, loss_fn: Callable[[nn.Module], Tensor]
) -> dict[str, Tensor]:
    """The gradient of ``loss_fn(model)`` in one backward pass; ``.grad`` cleared after."""
    model.zero_grad(set_to_none=True)
    loss_fn(model).backward()
    out = grads(model)
    model.zero_grad(set_to_none=True)
    return out


def token_mean_gradient(model: nn.Module, batches: Iterable[Mapping[str, Tensor]]) -> dict:
    """Gradient of the token-mean cross-entropy over all examples of ``batches`` taken as
    one batch (padded to a common width), computed with plain ``F.cross_entropy``."""
    parts = list(batches)
    width = max(int(b["input_ids"].shape[1]) for b in parts)

    def pad(t: Tensor, value: int) -> Tensor:
        return F.pad(t, (0, width - t.shape[1]), value=value)

    ids = torch.cat([pad(b["input_ids"], 0) for b in parts])
    labels = torch.cat([pad(b["labels"], IGNORE) for b in parts])

    def loss(m: nn.Module) -> Tensor:
        out = m(input_ids=ids)
        logits = out if isinstance(out, Tensor) else out.logits
        return F.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]),
            labels[:, 1:].reshape(-1),
            ignore_index=IGNORE,
            reduction="mean",
        )

    return reference_gradient(model, loss)


class CaptureOptimizer(torch.optim.Optimizer):
    """An optimizer whose ``step`` records the gradients it is given and changes nothing.

    Lets a test see the exact gradient ``train_window`` hands to the optimizer (after
    accumulation, unscaling and clipping), with no round trip through the weights.
    """

    def __init__(self, parameters: Iterable[nn.Parameter], names: Sequence[str]) -> None:
        super().__init__(list(parameters), {"lr": 1.0})
        self.names = list(names)
        self.seen: list[dict[str, Tensor]] = []

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        flat = [p for group in self.param_groups for p in group["params"]]
        self.seen.append(
            {
                n: p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
                for n, p in zip(self.names, flat, strict=True)
            }
        )


def capture(model: nn.Module) -> CaptureOptimizer:
    """A :class:`CaptureOptimizer` over ``model``'s parameters, keyed by name."""
    named = list(model.named_parameters())
    return CaptureOptimizer([p for _, p in named], [n for n, _ in named])
