"""The data-parallel helper of the core: the replicas, their collectives, one sync per window.

DDP averages gradients over its ``D`` replicas, and FSDP2 (``fully_shard``) averages in
its reduce-scatter the same way: the ``× D`` of the loop's rule (``accumlab.loop``)
cancels that average, so the update is the gradient of all replicas' losses over all
replicas' units. :class:`Replicas` holds what a run needs of them (the wrapper, the
group, ``D``, the device), found once. Every collective here runs on the model's
data-parallel group, never on ranks that share the same data (tensor- or
pipeline-parallel peers). Without a process group every function is a no-op.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

__all__ = [
    "Replicas",
    "data_parallel_group",
    "global_count",
    "gradient_sync",
    "is_distributed",
    "local_device",
    "model_device",
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


def model_device(model: nn.Module) -> torch.device:
    """The device of the model's first parameter (CPU for a parameterless model)."""
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def global_count(local: int, replicas: int, device: torch.device, group: Any = None) -> int:
    """The window's unit count summed over the ``replicas`` ranks of ``group`` (``None``:
    the world): one all-reduce, none (``local``) when D is 1."""
    if replicas == 1:
        return local
    total = torch.tensor([local], dtype=torch.int64, device=device)
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    return int(total.item())


Wrapper = Literal["plain", "ddp", "fsdp2"]


@dataclass(frozen=True)
class Replicas:
    """The model's data-parallel replicas, found once (:meth:`of`) and read by every window.

    ``wrapper``: ``"ddp"`` (``DistributedDataParallel``), ``"fsdp2"`` (``fully_shard``) or
    ``"plain"``; ``group``: the process group of the replicas (:func:`data_parallel_group`,
    ``None`` for a plain model); ``size``: ``D``, the number of replicas (1 for a plain
    model); ``device``: this replica's device (:func:`model_device`), where its windows'
    tensors go and its collectives' tensors live; ``forward_collective``: whether a
    forward pass runs a collective too (FSDP2 gathers the parameters; DDP broadcasts the
    module's buffers, when ``broadcast_buffers`` and it has some). :meth:`total` and
    :meth:`any` are the loop's collectives of a window, both on ``group``.
    """

    wrapper: Wrapper
    group: Any
    size: int
    device: torch.device
    forward_collective: bool = False

    @classmethod
    def of(cls, model: nn.Module) -> Replicas:
        """The replicas of ``model`` (under ``torch.compile`` or not); ``ValueError`` when a
        process group of several ranks is active but the model is not wrapped (each rank
        would update its own copy from its own data and the copies would drift apart)."""
        inner = unwrap(model)
        group = data_parallel_group(inner)
        size = 1 if group is None else dist.get_world_size(group)
        if size == 1 and is_distributed():
            raise ValueError(
                f"the model is not wrapped in DistributedDataParallel or fully_shard, but a "
                f"process group of {dist.get_world_size()} ranks is active: each rank would "
                "update its own copy from its own data and the copies would drift apart. Wrap "
                "it (DistributedDataParallel(model) or fully_shard(model)), or run "
                "single-process code outside the process group"
            )
        if isinstance(inner, DistributedDataParallel):
            buffers = inner.broadcast_buffers and len(inner.modules_buffers) > 0
            return cls("ddp", group, size, model_device(model), forward_collective=buffers)
        if _is_fsdp2(inner):
            return cls("fsdp2", group, size, model_device(model), forward_collective=True)
        return cls("plain", None, 1, model_device(model))

    def total(self, count: int) -> int:
        """``count`` summed over the replicas (:func:`global_count`: one all-reduce on
        ``group``, none when ``D`` is 1). Every replica must call it."""
        return global_count(count, self.size, self.device, self.group)

    def any(self, flag: bool) -> bool:
        """True when ``flag`` is True on any replica: one all-reduce (MAX) on ``group``,
        none (``flag`` itself) when ``D`` is 1. Every replica must call it."""
        if self.size == 1:
            return flag
        value = torch.tensor([int(flag)], dtype=torch.int64, device=self.device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self.group)
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
