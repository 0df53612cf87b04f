"""Data-parallel helpers the loop relies on: replica count, the global target count, and
turning gradient synchronization off for all but the last microbatch of a window.

DDP averages gradients over its ``D`` replicas. The loop wants the gradient of
``sum of all replicas' losses / all replicas' targets``, so each replica backpropagates
``loss_sum × D / global_count``: DDP's average (÷ D) then cancels the ``× D``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def is_distributed() -> bool:
    """True inside an initialised process group with more than one rank."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _is_fsdp2(model: nn.Module) -> bool:
    return hasattr(model, "set_requires_gradient_sync")


def replicas_of(model: nn.Module) -> int:
    """``D`` for this model: the world size when the model is DDP- or FSDP2-wrapped, else 1."""
    if isinstance(model, DistributedDataParallel):
        return dist.get_world_size(model.process_group)
    if _is_fsdp2(model) and is_distributed():
        return dist.get_world_size()
    return 1


def global_count(local: int, replicas: int, device: torch.device) -> int:
    """The window's unit count summed over replicas (one all-reduce; ``local`` if D is 1)."""
    if replicas == 1:
        return local
    total = torch.tensor([local], dtype=torch.int64, device=device)
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return int(total.item())


@contextlib.contextmanager
def gradient_sync(model: nn.Module, enabled: bool) -> Iterator[None]:
    """Synchronize gradients in this block only when ``enabled``.

    Wrap the forward *and* the backward of a microbatch: DDP decides at forward time
    whether the following backward will all-reduce. For a plain module this does nothing.
    """
    if enabled:
        yield
    elif isinstance(model, DistributedDataParallel):
        with model.no_sync():
            yield
    elif _is_fsdp2(model):
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        yield
