"""The data-parallel helper of the core: D, the global count, one sync per window.

DDP averages gradients over its ``D`` replicas, and FSDP2 (``fully_shard``) averages in
its reduce-scatter the same way: the ``× D`` of the loop's rule (``accumlab.loop``)
cancels that average, so the update is the gradient of all replicas' losses over all
replicas' units. Every collective here
runs on the model's data-parallel group, never on ranks that share the same data
(tensor- or pipeline-parallel peers). Without a process group every function is a no-op.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

__all__ = [
    "any_rank",
    "check_replicas",
    "data_parallel_group",
    "global_count",
    "gradient_sync",
    "is_distributed",
    "local_device",
    "replicas_of",
    "unwrap",
]

def is_distributed() -> bool:
    """True inside an initialised process group with more than one rank."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def local_device() -> torch.device:
    """This rank's device: its CUDA device under nccl, the CPU otherwise."""
    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def unwrap(model: nn.Module) -> nn.Module:
    """The module under any ``torch.compile`` wrappers (``OptimizedModule._orig_mod``), so
    that ``torch.compile(DistributedDataParallel(model))`` is seen as the DDP model it is."""
    while isinstance(getattr(model, "_orig_mod", None), nn.Module):
        model = model._orig_mod
    return model


def _is_fsdp2(model: nn.Module) -> bool:
    return hasattr(unwrap(model), "set_requires_gradient_sync")


def _fsdp2_group(model: nn.Module) -> Any:
    """The group over every rank of ``fully_shard``'s mesh, 1-D (FSDP) or 2-D (HSDP: both
    dimensions hold replicas); from FSDP2's state (no public getter in torch 2.13), else a
    1-D DTensor mesh of the first parameter, else the world."""
    mesh = None
    try:
        from torch.distributed.fsdp import fully_shard

        mesh = fully_shard.state(unwrap(model))._fsdp_param_group.mesh_info.mesh  # type: ignore[attr-defined]
    except (AttributeError, ImportError, RuntimeError):
        first = next(iter(model.parameters()), None)
        candidate = getattr(first, "device_mesh", None)
        mesh = candidate if candidate is not None and candidate.ndim == 1 else None
    if mesh is None:
        return dist.group.WORLD
    return mesh.get_group() if mesh.ndim == 1 else mesh._flatten().get_group()


def data_parallel_group(model: nn.Module) -> Any:
    """The process group of the model's data-parallel replicas (DDP's ``process_group``,
    or FSDP2's mesh); ``None`` for a model that is not data parallel."""
    inner = unwrap(model)
    if isinstance(inner, DistributedDataParallel):
        return inner.process_group
    if _is_fsdp2(inner) and is_distributed():
        return _fsdp2_group(inner)
    return None


def replicas_of(model: nn.Module) -> int:
    """``D``: the size of the model's data-parallel group; 1 for a model that is not DDP-
    or FSDP2-wrapped (under ``torch.compile`` or not)."""
    group = data_parallel_group(model)
    return 1 if group is None else dist.get_world_size(group)


def check_replicas(model: nn.Module) -> int:
    """``D`` for ``model``; ``ValueError`` when a process group of several ranks is active
    but the model is not wrapped (each rank would update its own copy from its own data
    and the copies would drift apart)."""
    replicas = replicas_of(model)
    if replicas == 1 and is_distributed():
        raise ValueError(
            f"the model is not wrapped in DistributedDataParallel or fully_shard, but a "
            f"process group of {dist.get_world_size()} ranks is active: each rank would "
            "update its own copy from its own data and the copies would drift apart. Wrap "
            "it (DistributedDataParallel(model) or fully_shard(model)), or run "
            "single-process code outside the process group"
        )
    return replicas


def global_count(local: int, replicas: int, device: torch.device, group: Any = None) -> int:
    """The window's unit count summed over the ``replicas`` ranks of ``group`` (``None``:
    the world): one all-reduce, none (``local``) when D is 1."""
    if replicas == 1:
        return local
    total = torch.tensor([local], dtype=torch.int64, device=device)
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    return int(total.item())


def any_rank(flag: bool, group: Any) -> bool:
    """True when ``flag`` is True on any rank of ``group`` (one all-reduce); ``flag``
    itself for ``group=None`` or without a process group. Every rank must call it."""
    if group is None or not is_distributed():
        return flag
    value = torch.tensor([int(flag)], dtype=torch.int64, device=local_device())
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return bool(value.item())


@contextlib.contextmanager
def gradient_sync(model: nn.Module, enabled: bool) -> Iterator[None]:
    """Synchronize gradients in this block only when ``enabled`` (DDP's ``no_sync``,
    FSDP2's ``set_requires_gradient_sync(False)`` otherwise; nothing for a plain module).

    Wrap the forward *and* the backward of a microbatch: DDP decides at forward time whether
    the following backward will all-reduce.
    """
    model = unwrap(model)
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
