"""Test-only workers for the ``sync`` argument of ``train_window`` (tests/distributed/test_sync_modes.py).

Spawned ranks import this module as ``sync_workers`` (pytest puts ``tests/`` on
``sys.path`` and spawn copies it to the children). Every worker returns plain data.

The probes look inside FSDP2 (``fully_shard``): gradients that a rank holds between
microbatches live on FSDP2's unsharded parameters, which ``model.parameters()`` does not
show, so ``held_gradient_bytes`` reads them from FSDP2's parameter groups (torch 2.13
internals, test and benchmark code only). Reduce-scatters are counted by wrapping
``torch.distributed``'s reduce-scatter functions, which FSDP2 calls through the module.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.nn.parallel import DistributedDataParallel

import accumlab as al
from accumlab.distributed import SyncCounter
from helpers.rank_workers import call_x, mlp, squared_error

#: Examples per microbatch on each rank: A = 3, uneven within and across ranks, so the
#: global count (not an average of averages) decides the gradient.
SIZES = {0: (1, 3, 2), 1: (2, 1, 2)}
LR = 0.1


def microbatches(rank: int) -> list[dict[str, Tensor]]:
    """Rank ``rank``'s window: ``SIZES[rank]`` examples per microbatch (seeded)."""
    g = torch.Generator().manual_seed(100 + rank)
    return [
        {"x": torch.randn(m, 4, generator=g), "labels": torch.randn(m, 2, generator=g)}
        for m in SIZES[rank]
    ]


def full(t: Tensor) -> Tensor:
    """A plain CPU copy, gathering a DTensor (a collective: every rank must call it)."""
    if hasattr(t, "full_tensor"):
        t = t.full_tensor()
    return t.detach().cpu().clone()


def _nbytes(t: Tensor | None) -> int:
    if t is None:
        return 0
    if hasattr(t, "to_local"):
        t = t.to_local()
    return t.numel() * t.element_size()


def held_gradient_bytes(model: nn.Module) -> int:
    """Bytes of gradient storage this rank holds now: ``.grad`` of the model's parameters
    (sharded DTensors under FSDP2) plus, under FSDP2, the unsharded gradients it keeps
    between backward passes that did not reduce-scatter."""
    total = sum(_nbytes(p.grad) for p in model.parameters())
    for module in model.modules():
        group = (
            fully_shard.state(module)._fsdp_param_group if isinstance(module, FSDPModule) else None
        )
        for fsdp_param in group.fsdp_params if group is not None else ():
            unsharded = getattr(fsdp_param, "_unsharded_param", None)
            total += _nbytes(None if unsharded is None else unsharded.grad)
            total += _nbytes(fsdp_param.unsharded_accumulated_grad)
    return total


def full_gradient_bytes(model: nn.Module) -> int:
    """Bytes of one full (unsharded) gradient of every parameter."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


class ReduceScatterCounter:
    """Counts reduce-scatter calls (``reduce_scatter_single`` / ``reduce_scatter_tensor``)
    while installed (``with counter.installed():``); a call made inside another counts once."""

    NAMES = ("reduce_scatter_single", "reduce_scatter_tensor")

    def __init__(self) -> None:
        self.calls = 0
        self._depth = 0

    def _wrap(self, fn: Any) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls += self._depth == 0
            self._depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1

        return counted

    @contextlib.contextmanager
    def installed(self) -> Iterator[ReduceScatterCounter]:
        originals = {n: getattr(dist, n) for n in self.NAMES if hasattr(dist, n)}
        for name, fn in originals.items():
            setattr(dist, name, self._wrap(fn))
        try:
            yield self
        finally:
            for name, fn in originals.items():
                setattr(dist, name, fn)


class BackwardProbe:
    """A ``meter`` for ``train_window``: after each microbatch's backward pass records the
    gradient bytes the rank holds and whether every gradient on ``model.parameters()`` is
    a DTensor shard."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.held: list[int] = []
        self.sharded: list[bool] = []

    @contextlib.contextmanager
    def phase(self, name: str, microbatch: int | None = None) -> Iterator[None]:
        yield
        if name == "backward":
            self.held.append(held_gradient_bytes(self.model))
            grads = [p.grad for p in self.model.parameters()]
            self.sharded.append(all(g is not None and hasattr(g, "to_local") for g in grads))


def wrap(model: nn.Module, wrapper: str) -> nn.Module:
    """``DistributedDataParallel(model)``, or ``fully_shard`` on each Linear and the root
    (two parameter groups, so two reduce-scatters per synchronized backward)."""
    if wrapper == "ddp":
        return DistributedDataParallel(model)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model


def one_window(wrapper: str, sync: str, windows: int = 1) -> dict[str, Any]:
    """Train ``windows`` windows (the same microbatches each time) with SGD; returns the
    full gradient the optimizer saw in each, the full weights after, the syncs per window
    (DDP: ``SyncCounter.syncs``; FSDP2: reduce-scatter calls), the probe's records of the
    first window, and the full-gradient bytes."""
    model = wrap(mlp(), wrapper)
    counter: Any = SyncCounter().attach(model) if wrapper == "ddp" else ReduceScatterCounter()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    seen: list[list[Tensor]] = []
    optimizer.register_step_pre_hook(
        lambda opt, args, kwargs: seen.append([full(p.grad) for p in model.parameters()])
    )
    probe = BackwardProbe(model)
    syncs = []
    window = microbatches(dist.get_rank())
    for index in range(windows):
        before = counter.syncs if wrapper == "ddp" else counter.calls
        with counter.installed() if wrapper != "ddp" else contextlib.nullcontext():
            al.train_window(
                model,
                window,
                optimizer,
                al.ExampleLoss(squared_error),
                forward=call_x,
                sync=sync,
                meter=probe if index == 0 else None,
                index=index,
            )
        syncs.append((counter.syncs if wrapper == "ddp" else counter.calls) - before)
    return {
        "gradients": seen,
        "weights": [full(p) for p in model.parameters()],
        "syncs": syncs,
        "held": probe.held,
        "sharded": probe.sharded,
        "full_bytes": full_gradient_bytes(model),
    }


def reference(windows: int = 1) -> dict[str, Any]:
    """The rule without accumlab: one process, one pass over both ranks' examples,
    gradient of the mean per-example loss, SGD; the gradient of each window and the
    weights after."""
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    batches = microbatches(0) + microbatches(1)
    x = torch.cat([b["x"] for b in batches])
    y = torch.cat([b["labels"] for b in batches])
    gradients = []
    for _ in range(windows):
        optimizer.zero_grad(set_to_none=True)
        squared_error(model(x), y).mean().backward()
        gradients.append([p.grad.detach().clone() for p in model.parameters()])
        optimizer.step()
    return {"gradients": gradients, "weights": [p.detach().clone() for p in model.parameters()]}


def sync_modes(cases: Sequence[tuple[str, str]], windows: int) -> dict[str, Any]:
    """Every ``(wrapper, sync)`` case on this rank, and the single-process reference."""
    return {
        "cases": {f"{w}/{s}": one_window(w, s, windows) for w, s in cases},
        "reference": reference(windows),
        "accumulation_steps": len(SIZES[0]),
    }
