"""Test-only workers for ``accumlab.distributed.launch`` (imported by spawned ranks).

pytest puts ``tests/`` on ``sys.path`` (the directory has no ``__init__.py``), and
``multiprocessing``'s spawn start method copies the parent's ``sys.path`` into each child,
so the children import this module as ``rank_workers`` just as the test file does.

Every worker returns plain data (numbers, lists, CPU tensors) for the test to compare
across ranks; none prints.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

import accumlab as al


def squared_error(output: Tensor, labels: Tensor) -> Tensor:
    """One loss per example: the squared error summed over the output features."""
    return ((output.float() - labels) ** 2).sum(dim=-1)


def mlp(seed: int = 0) -> nn.Sequential:
    """The same small MLP on every rank (seeded): 4 inputs, 8 hidden, 2 outputs."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def regression_batches(n: int, m: int, seed: int) -> list[dict[str, Tensor]]:
    """``n`` microbatches of ``m`` examples each (inputs ``x``, targets ``labels``)."""
    g = torch.Generator().manual_seed(seed)
    return [
        {"x": torch.randn(m, 4, generator=g), "labels": torch.randn(m, 2, generator=g)}
        for _ in range(n)
    ]


def call_x(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    """The forward hook for these batches: the model takes ``x`` positionally."""
    return model(batch["x"])


def _full(t: Tensor) -> Tensor:
    """A plain CPU copy of a tensor, gathering a DTensor shard into the full tensor."""
    if hasattr(t, "full_tensor"):
        t = t.full_tensor()
    return t.detach().cpu().clone()


class Capture(torch.optim.Optimizer):
    """An optimizer whose ``step`` records the full gradient it is handed and changes nothing."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__(list(model.parameters()), {"lr": 0.0})
        self.seen: list[list[Tensor]] = []

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        self.seen.append([_full(p.grad) for p in self.param_groups[0]["params"]])


def _reference(model: nn.Module, batches: Sequence[dict[str, Tensor]]) -> list[Tensor]:
    """Gradient of the mean per-example loss over every example of ``batches`` (one pass)."""
    x = torch.cat([b["x"] for b in batches])
    y = torch.cat([b["labels"] for b in batches])
    model.zero_grad(set_to_none=True)
    squared_error(model(x), y).mean().backward()
    out = [p.grad.detach().clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return out


# ------------------------------------------------------------------ item 1: FSDP2 skip


def fsdp2_nonfinite_shard(combos: Sequence[tuple[float | None, str]]) -> list[dict[str, Any]]:
    """For each ``(clip_grad_norm, precision)``: an MLP under ``fully_shard`` trains three
    windows of two microbatches; in window 1 a hook puts NaN into row 0 of the first
    layer's output gradient, so only row 0 of the first layer's weight and bias gradients
    is NaN, and row 0 lies in rank 0's shard alone. Returns, per combo, what each window
    reported, the learning rate and scheduler count after it, the scale, and whether the
    weights changed in each window."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    out = []
    for clip, precision in combos:
        model = mlp()
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        fully_shard(model, mesh=mesh)
        poison = {"on": False}

        def nan_row(grad: Tensor) -> Tensor:
            grad = grad.clone()
            grad[:, 0] = float("nan")
            return grad

        def hook(module: nn.Module, args: Any, output: Tensor, poison: dict = poison) -> None:
            if poison["on"]:
                output.register_hook(nan_row)

        model[0].register_forward_hook(hook)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda u: 1 / (u + 1))
        scaler = torch.amp.GradScaler("cpu", init_scale=8.0) if precision == "fp16" else None
        data = regression_batches(6, 2, seed=dist.get_rank())
        windows = []
        for index in range(3):
            poison["on"] = index == 1
            before = [_full(p) for p in model.parameters()]
            report = al.train_window(
                model,
                data[2 * index : 2 * index + 2],
                optimizer,
                al.ExampleLoss(squared_error),
                scaler=scaler,
                clip_grad_norm=clip,
                scheduler=scheduler,
                precision=precision,
                forward=call_x,
                index=index,
            )
            after = [_full(p) for p in model.parameters()]
            windows.append(
                {
                    "applied": report.applied,
                    "reason": report.skipped_reason,
                    "lr": optimizer.param_groups[0]["lr"],
                    "scheduler_steps": scheduler.last_epoch,
                    "scale": None if scaler is None else float(scaler.get_scale()),
                    "changed": any(
                        not torch.equal(a, b) for a, b in zip(before, after, strict=True)
                    ),
                    "finite_weights": all(bool(torch.isfinite(a).all()) for a in after),
                }
            )
        out.append({"clip": clip, "precision": precision, "windows": windows})
    return out


# ------------------------------------------------------------------ item 2: DP sub-group


def dp_subgroups(windows: int, accumulation_steps: int) -> dict[str, Any]:
    """4 ranks = 2 data-parallel replicas × 2 peers. Ranks 2k and 2k+1 are peers holding
    the same data (shard k, as tensor- or pipeline-parallel peers would); the data-parallel
    groups are {0, 2} and {1, 3}, and DDP is built on this rank's group. Returns the
    gradient each window handed to the optimizer, the rule's gradient on the data the
    data-parallel group saw, and the ledger summed over the group."""
    rank = dist.get_rank()
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]  # every rank creates both
    group = groups[rank % 2]
    shard = rank // 2
    model = DistributedDataParallel(mlp(), process_group=group)
    optimizer = Capture(model)
    a = accumulation_steps
    # shard 1 has one microbatch fewer, so the ranks must align with padding
    mine = regression_batches(windows * a - shard, 2, seed=10 + shard)
    plan = al.AccumulationPlan(2, a, data_parallel_size=2)
    ledger = al.train(
        model, mine, optimizer, plan, al.ExampleLoss(squared_error), forward=call_x, progress=False
    )
    shards = [regression_batches(windows * a - s, 2, seed=10 + s) for s in (0, 1)]
    reference = mlp()
    expected = [
        _reference(reference, [mb for data in shards for mb in data[w * a : (w + 1) * a]])
        for w in range(windows)
    ]
    summed = al.distributed.reduce_ledger(ledger, group=group)
    return {
        "seen": optimizer.seen,
        "expected": expected,
        "examples": summed.examples,
        "attempts": ledger.update_attempts,
        "global_targets": [r.global_targets for r in ledger.reports],
    }


# ------------------------------------------------------------------ item 3: compiled DDP


def compiled_ddp(accumulation_steps: int) -> dict[str, Any]:
    """``torch.compile(DistributedDataParallel(model), backend="eager")`` trained by
    ``al.train``: the gradient handed to the optimizer and the rule's gradient."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = torch.compile(DistributedDataParallel(mlp()), backend="eager")
    optimizer = Capture(model)
    a = accumulation_steps
    plan = al.AccumulationPlan(2, a, data_parallel_size=world)
    ledger = al.train(
        model,
        regression_batches(a, 2, seed=20 + rank),
        optimizer,
        plan,
        al.ExampleLoss(squared_error),
        forward=call_x,
        progress=False,
    )
    expected = _reference(
        mlp(), [mb for r in range(world) for mb in regression_batches(a, 2, 20 + r)]
    )
    return {"seen": optimizer.seen, "expected": expected, "replicas": ledger.reports[0].data_parallel_size}


# ------------------------------------------------------------------ item 14c: plans


def disagreeing_plans(fields: Sequence[str]) -> dict[str, str]:
    """For each field, rank 1 builds its plan with a different value and ``al.train`` must
    refuse on every rank before training. Returns each field's error message."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = DistributedDataParallel(mlp())
    messages = {}
    for field in fields:
        sizes: dict[str, Any] = {"micro_batch_size": 2, "accumulation_steps": 2}
        sizes["last_window"] = "update"
        if rank == 1:
            sizes[field] = {"micro_batch_size": 4, "accumulation_steps": 3, "last_window": "drop"}[
                field
            ]
        plan = al.AccumulationPlan(data_parallel_size=world, **sizes)
        try:
            al.train(
                model,
                regression_batches(4, 2, seed=rank),
                torch.optim.SGD(model.parameters(), lr=0.1),
                plan,
                al.ExampleLoss(squared_error),
                forward=call_x,
                progress=False,
            )
        except ValueError as exc:
            messages[field] = str(exc)
        else:
            messages[field] = "trained"
    return messages
