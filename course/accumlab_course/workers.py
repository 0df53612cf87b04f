"""Worker functions for data-parallel runs: the bodies that :func:`accumlab.distributed.launch`
(or ``torchrun``, through ``examples/ddp_train.py``) runs on every rank.

They live in an importable module because spawned processes start a fresh interpreter:
a function defined in a notebook cell cannot be sent to them, so notebook 04 prints the
source of each one right before launching it. Each worker assumes the process group is
already initialised, never prints, and returns plain data (counts, floats, dicts,
tensors) for the caller to check. Notebook 04, its exercise checker, the no_sync
benchmark and the runnable example use them; workers only tests need live in ``tests/``.

:func:`ddp_window` is the lesson itself: one accumulation window under DDP written out by
hand, with the count all-reduce, the ``× D`` and ``no_sync``. :func:`window_variant` is the
same window with one decision changed, to show what each mistake does.

The data is the course's instruction set, split between ranks on purpose unevenly (one
rank gets short answers, the other long ones, and a different number of microbatches),
so the global target count and rank alignment both matter.
"""

from __future__ import annotations

import contextlib
import copy
import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from accumlab.checks import compare
from accumlab.distributed import (
    SyncCounter,
    check_example_ids,
    example_ids_in,
    gather_example_ids,
    shard,
)
from accumlab.driver import train
from accumlab.loop import default_forward
from accumlab.objectives import NextTokenLoss
from accumlab.parallel import gradient_sync, local_device, replicas_of
from accumlab.plan import AccumulationPlan
from accumlab.record import RunRecord

from . import data
from .models import TinyGPT

# ----------------------------------------------------------------------------- set-up


def rank_and_world() -> tuple[int, int]:
    """``(rank, world_size)`` of the initialised process group (``(0, 1)`` without one)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def whoami() -> dict[str, Any]:
    """This rank's view of the group: rank, world size, backend and device."""
    rank, world = rank_and_world()
    return {
        "rank": rank,
        "world_size": world,
        "backend": dist.get_backend() if dist.is_initialized() else None,
        "device": str(local_device()),
    }


def small_model(seed: int = 0, n_embd: int = 32, n_layer: int = 1) -> TinyGPT:
    """The same small TinyGPT on every rank (seeded), on this rank's device."""
    torch.manual_seed(seed)
    model = TinyGPT(data.VOCAB_SIZE, block_size=128, n_layer=n_layer, n_head=2, n_embd=n_embd)
    return model.to(local_device())


def wrap(model: nn.Module, kind: str) -> nn.Module:
    """``"ddp"``: ``DistributedDataParallel``; ``"fsdp2"``: ``fully_shard`` on each block and
    the root (a 1-D device mesh over all ranks); ``"none"``: the plain model."""
    device = local_device()
    if kind == "ddp":
        return DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None
        )
    if kind == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        for block in getattr(model, "blocks", []):
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    if kind == "none":
        return model
    raise ValueError(f"kind must be 'ddp', 'fsdp2' or 'none', got {kind!r}")


def _name(name: str) -> str:
    return name.removeprefix("module.")


def _full(t: Tensor | None, like: Tensor) -> Tensor:
    """A gradient as a plain CPU tensor (gathering an FSDP2 shard into the full tensor)."""
    if t is None:
        t = torch.zeros_like(like)
    if hasattr(t, "full_tensor"):
        t = t.full_tensor()
    return t.detach().cpu().clone()


class GradientSnapshots(torch.optim.Optimizer):
    """An optimizer whose ``step`` records the full gradient it is handed and changes no
    weight: every window's synchronized gradient, all at the initial weights."""

    def __init__(self, model: nn.Module) -> None:
        named = [(_name(n), p) for n, p in model.named_parameters()]
        super().__init__([p for _, p in named], {"lr": 0.0})
        self.names = [n for n, _ in named]
        self.seen: list[dict[str, Tensor]] = []

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        params = self.param_groups[0]["params"]
        self.seen.append({n: _full(p.grad, p) for n, p in zip(self.names, params, strict=True)})


def token_mean_gradient(model: nn.Module, examples: Sequence[data.Example]) -> dict[str, Tensor]:
    """The reference: gradient of the mean token cross-entropy over ``examples`` as one
    batch, in one backward pass with plain ``F.cross_entropy`` (no accumlab loop)."""
    batch = {k: v.to(local_device()) for k, v in data.collate(examples).items()}
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=batch["input_ids"]).logits
    loss = F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
        batch["labels"][:, 1:].reshape(-1),
        ignore_index=-100,
        reduction="mean",
    )
    loss.backward()
    grads = {_name(n): _full(p.grad, p) for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return grads


# ----------------------------------------------------------------------------- data


def _targets(example: data.Example) -> int:
    return len(example.input_ids) - example.prompt_len  # response + EOS, after the shift


def uneven_examples(
    world_size: int = 2, sizes: Sequence[int] = (13, 10)
) -> list[list[data.Example]]:
    """Examples per rank with very different target counts: rank 0 gets the ``sizes[0]``
    examples with the fewest targets, rank 1 the ``sizes[1]`` with the most, and so on
    (from the first 400 of the data set). IDs are distinct across ranks."""
    if len(sizes) < world_size:
        raise ValueError(f"sizes needs one entry per rank ({world_size}), got {list(sizes)}")
    pool = sorted(data.load_examples(limit=400), key=lambda e: (_targets(e), e.id))
    out, low, high = [], 0, len(pool)
    for rank in range(world_size):
        if rank % 2 == 0:
            out.append(pool[low : low + sizes[rank]])
            low += sizes[rank]
        else:
            out.append(pool[high - sizes[rank] : high])
            high -= sizes[rank]
    return out


# ----------------------------------------------------------------------------- the window, by hand


def ddp_window(
    model: DistributedDataParallel,
    window: Sequence[Mapping[str, Tensor]],
    objective: NextTokenLoss,
) -> int:
    """One window under DDP by hand, as ``al.train`` runs it: adds the window's gradient
    (the same on every rank afterwards) to ``.grad`` and returns its target count summed
    over the ranks. ``window`` is this rank's microbatches (CPU tensors)."""
    count = torch.tensor(sum(objective.count(mb) for mb in window), device=local_device())
    dist.all_reduce(count)  # 1. the window's targets, summed over all ranks
    for i, mb in enumerate(window):
        mb = {k: v.to(count.device) for k, v in mb.items()}
        last = i == len(window) - 1
        with contextlib.nullcontext() if last else model.no_sync():  # 3. forward and backward
            loss_sum = objective.loss_sum(model(input_ids=mb["input_ids"]), mb)
            (loss_sum * dist.get_world_size() / count).backward()  # 2. × D: DDP averages
    return int(count)


def one_ddp_window(micro_batch_size: int = 2, accumulation_steps: int = 2) -> dict[str, Any]:
    """Run :func:`ddp_window` on this rank's first window of :func:`uneven_examples` and
    return the counts, the gradient synchronizations and the gradient it left."""
    rank, world = rank_and_world()
    examples = uneven_examples(world)[rank][: micro_batch_size * accumulation_steps]
    window = data.microbatches(examples, micro_batch_size)
    model = wrap(small_model(), "ddp")
    counter = SyncCounter().attach(model)  # a DDP communication hook that counts syncs
    objective = NextTokenLoss()
    global_targets = ddp_window(model, window, objective)
    return {
        "rank": rank,
        "local_targets": sum(objective.count(mb) for mb in window),
        "global_targets": global_targets,
        "syncs": counter.syncs,
        "gradient": {_name(n): _full(p.grad, p) for n, p in model.named_parameters()},
    }


def first_windows(
    world_size: int = 2, micro_batch_size: int = 2, accumulation_steps: int = 2
) -> list[list[data.Example]]:
    """The examples of each rank's first window in :func:`one_ddp_window`, per rank."""
    per_window = micro_batch_size * accumulation_steps
    return [exs[:per_window] for exs in uneven_examples(world_size)]


# ----------------------------------------------------------------------------- the whole window


def amp_ddp_window(
    model: DistributedDataParallel,
    window: Sequence[Mapping[str, Tensor]],
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    objective: NextTokenLoss,
    max_norm: float,
    dtype: torch.dtype = torch.float16,
) -> bool:
    """One window of DDP and mixed precision by hand, boundary included. ``window`` is this
    rank's microbatches (CPU tensors; ranks may hold different numbers of them) and holds
    targets on some rank. Returns whether the update was applied: False when the gradient
    holds an inf or nan, which the all-reduce hands to every rank, so all ranks skip."""
    device = local_device()
    count = torch.tensor(sum(objective.count(mb) for mb in window), device=device)
    dist.all_reduce(count)  # 1. the window's targets, summed over all ranks
    for i, mb in enumerate(window):
        mb = {k: v.to(device) for k, v in mb.items()}
        last = i == len(window) - 1
        with contextlib.nullcontext() if last else model.no_sync():  # 3. one sync per window
            with torch.autocast(device.type, dtype=dtype):  # 16-bit forward
                output = model(input_ids=mb["input_ids"])
            loss = objective.loss_sum(output, mb) * dist.get_world_size() / count  # 2. × D
            scaler.scale(loss).backward()  # one scale for the whole window
    scaler.unscale_(optimizer)  # 4. once, after the last backward: the true gradient
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads)  # the same on every rank: .grad is synced
    applied = bool(torch.isfinite(norm))
    if applied:  # 5. clip the window's gradient, step, and advance the schedule
        torch.nn.utils.clip_grads_with_norm_(model.parameters(), max_norm, norm)
        scaler.step(optimizer)
        scheduler.step()  # per applied update
    scaler.update()  # the only place the scale changes: halved after an inf
    optimizer.zero_grad(set_to_none=True)  # the next window starts from no gradient
    return applied


class SteppedGradients(torch.optim.SGD):
    """SGD that also keeps a copy of the gradient each ``step`` applies (clipped, unscaled)
    and the learning rate it used."""

    def __init__(self, params: Any, lr: float) -> None:
        super().__init__(params, lr=lr)
        self.seen: list[tuple[float, list[Tensor]]] = []

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> Any:  # type: ignore[override]
        params = self.param_groups[0]["params"]
        self.seen.append((self.param_groups[0]["lr"], [_full(p.grad, p) for p in params]))
        return super().step(closure)


#: Notebook 04's whole window: microbatches of 2, rank r's windows hold
#: ``COMPOSED_MICROBATCHES[r]`` of them, 3 windows, an inf injected on rank 0 in window 1.
COMPOSED_MICROBATCHES, COMPOSED_WINDOWS, COMPOSED_POISONED = (3, 2), 3, (1,)


def composed_examples(
    world_size: int = 2, microbatches: Sequence[int] = COMPOSED_MICROBATCHES
) -> list[list[list[data.Example]]]:
    """The examples of each window on each rank in :func:`composed_run`: ``[rank][window]``,
    ``microbatches[r]`` microbatches of 2 per window on rank ``r``, from
    :func:`uneven_examples` (short answers on rank 0, long ones on rank 1)."""
    if len(microbatches) != world_size or min(microbatches) < 1:
        raise ValueError(
            f"microbatches needs one count of at least 1 per rank ({world_size}), got "
            f"{list(microbatches)}"
        )
    per_window = [2 * n for n in microbatches]
    pools = uneven_examples(world_size, [COMPOSED_WINDOWS * n for n in per_window])
    return [
        [pool[w * n : (w + 1) * n] for w in range(COMPOSED_WINDOWS)]
        for pool, n in zip(pools, per_window, strict=True)
    ]


def lr_schedule(update: int) -> float:
    """The learning-rate factor of notebook 04's whole window: ``1 / (u + 1)`` after ``u``
    applied updates."""
    return 1.0 / (update + 1)


def composed_run(
    max_norm: float = 1.0, lr: float = 0.1, microbatches: Sequence[int] = COMPOSED_MICROBATCHES
) -> dict[str, Any]:
    """Train :data:`COMPOSED_WINDOWS` windows of :func:`composed_examples` with
    :func:`amp_ddp_window` (fp16 autocast, one ``GradScaler``, SGD with
    :func:`lr_schedule`, clipping to ``max_norm``) on a fresh DDP model, an inf injected
    into rank 0's gradient in the windows of :data:`COMPOSED_POISONED`. Returns per window
    this rank's microbatches, the gradient syncs, whether the update was applied, the scale
    before and after, and (applied windows) the learning rate and the gradient the
    optimizer stepped with; and the final weights."""
    from accumlab.checks import inject_nonfinite

    rank, world = rank_and_world()
    model = wrap(small_model(), "ddp")
    counter = SyncCounter().attach(model)
    optimizer = SteppedGradients(model.parameters(), lr=lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_schedule)
    scaler = torch.amp.GradScaler(local_device().type)
    objective = NextTokenLoss()
    windows = []
    for w, examples in enumerate(composed_examples(world, microbatches)[rank]):
        window = data.microbatches(examples, 2)
        poisoned = w in COMPOSED_POISONED and rank == 0
        syncs, steps, scale = counter.syncs, len(optimizer.seen), scaler.get_scale()
        with inject_nonfinite(model.module.lm_head.weight) if poisoned else contextlib.nullcontext():
            applied = amp_ddp_window(model, window, optimizer, scaler, scheduler, objective, max_norm)
        stepped = optimizer.seen[steps:]
        windows.append({
            "microbatches": len(window), "syncs": counter.syncs - syncs, "applied": applied,
            "scale_before": scale, "scale_after": scaler.get_scale(),
            "lr": stepped[0][0] if stepped else None,
            "gradient": dict(zip(_param_names(model), stepped[0][1], strict=True)) if stepped else None,
        })  # fmt: skip
    weights = {_name(n): _full(p.detach(), p) for n, p in model.named_parameters()}
    return {"rank": rank, "windows": windows, "weights": weights}


def _param_names(model: nn.Module) -> list[str]:
    return [_name(n) for n, _ in model.named_parameters()]


def full_batch_run(
    windows: Sequence[Sequence[data.Example]],
    applied: Sequence[bool],
    max_norm: float = 1.0,
    lr: float = 0.1,
) -> dict[str, Any]:
    """The single-process reference of :func:`composed_run`: one process, float32, each
    window's examples of every rank as one batch (:func:`token_mean_gradient`), the
    gradient clipped to ``max_norm``, SGD with :func:`lr_schedule`; the windows marked not
    ``applied`` are skipped. Returns the clipped gradient of each applied window (None for a
    skipped one) and the final weights."""
    model = small_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_schedule)
    gradients: list[dict[str, Tensor] | None] = []
    for examples, apply in zip(windows, applied, strict=True):
        if not apply:
            gradients.append(None)
            continue
        grads = token_mean_gradient(model, examples)
        norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads.values()))
        grads = {k: g * min(1.0, max_norm / (norm + 1e-6)) for k, g in grads.items()}
        for name, p in model.named_parameters():
            p.grad = grads[_name(name)].clone()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        gradients.append(grads)
    weights = {_name(n): p.detach().clone() for n, p in model.named_parameters()}
    return {"gradients": gradients, "weights": weights}


#: Exercise ``ex04.uneven_window``: per window, the ranks whose microbatches have no
#: targets (every label -100). Window 1: rank 0 has none; window 2: no rank has any.
NO_TARGETS = ((), (0,), (0, 1))


def without_targets(microbatch: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """A copy of ``microbatch`` whose every label is -100 (ignored): no targets."""
    return {**microbatch, "labels": torch.full_like(microbatch["labels"], -100)}


def window_examples(
    rank: int, world: int, window: int, micro_batch_size: int = 2, accumulation_steps: int = 2
) -> list[data.Example]:
    """The examples of ``rank``'s window ``window`` in :func:`run_window_answers` (all of
    them, also when the window's labels are then removed)."""
    per_window = micro_batch_size * accumulation_steps
    return uneven_examples(world)[rank][window * per_window : (window + 1) * per_window]


def run_window_answers(
    answers: Sequence[tuple[str, str]],
    micro_batch_size: int = 2,
    accumulation_steps: int = 2,
    no_targets: Sequence[Sequence[int]] = NO_TARGETS,
) -> list[dict[str, Any]]:
    """Exercise ``ex04.uneven_window``: for each ``(source, name)`` define the learner's
    function from its source and call it as ``fn(model, window, optimizer, objective)``
    for ``len(no_targets)`` windows of this rank's :func:`uneven_examples` (window ``w``
    without targets on the ranks in ``no_targets[w]``), on a fresh DDP model with a
    :class:`SyncCounter` and an optimizer that records the gradient handed to each
    ``step()`` and changes no weight. Returns per answer, per window, the syncs and steps
    counted, the value returned, whether a nonzero ``.grad`` was left; the recorded
    gradients; and ``error`` (the exception it raised, as text, or None)."""
    import accumlab as al  # a learner's answer may use the package

    rank, world = rank_and_world()
    a = accumulation_steps
    windows = []
    for w, empty in enumerate(no_targets):
        window = data.microbatches(
            window_examples(rank, world, w, micro_batch_size, a), micro_batch_size
        )
        windows.append([without_targets(mb) for mb in window] if rank in empty else window)
    results = []
    for source, name in answers:
        namespace = {"torch": torch, "dist": dist, "contextlib": contextlib, "F": F, "nn": nn}
        namespace["al"] = al
        model = wrap(small_model(), "ddp")
        counter = SyncCounter().attach(model)
        optimizer = GradientSnapshots(model)
        out: dict[str, Any] = {
            "syncs": [], "steps": [], "grads_left": [], "returned": [], "error": None,
        }  # fmt: skip
        try:
            exec(compile(source, "<your answer>", "exec"), namespace)  # the learner's code
            for window in windows:
                syncs, steps = counter.syncs, len(optimizer.seen)
                returned = namespace[name](model, window, optimizer, NextTokenLoss())
                plain = returned is None or isinstance(returned, (bool, int, float))
                out["returned"].append(returned if plain else repr(returned))
                out["syncs"].append(counter.syncs - syncs)
                out["steps"].append(len(optimizer.seen) - steps)
                left = any(p.grad is not None and bool(p.grad.any()) for p in model.parameters())
                out["grads_left"].append(left)
        except Exception as exc:  # report the learner's error instead of failing the launch
            out["error"] = f"{type(exc).__name__}: {exc}"
        out["seen"] = optimizer.seen
        results.append(out)
    return results


def gradient_agreement(
    kind: str = "ddp",
    micro_batch_size: int = 2,
    accumulation_steps: int = 3,
    sizes: Sequence[int] = (13, 10),
    lazy: bool = False,
) -> dict[str, Any]:
    """Train with ``accumlab.train`` on uneven ranks and compare every window's
    synchronized gradient with the single-process full batch over both ranks' data.

    Rank r trains on ``uneven_examples(sizes)[r]`` in microbatches of
    ``micro_batch_size`` with ``accumulation_steps`` per window; the optimizer records
    gradients and changes nothing, so window i's gradient is compared with the token-mean
    gradient of the union of window i's examples over all ranks, at the same weights.
    ``lazy=True`` hands ``train`` an iterator without ``len`` (ranks agree window by
    window). Returns per-window relative errors, this rank's ledger and the run record
    summed over ranks, the example-ID check, and (FSDP2) whether gradients stayed local
    until the last microbatch.
    """
    rank, world = rank_and_world()
    per_rank = uneven_examples(world, sizes)
    mine = per_rank[rank]
    batches = data.microbatches(mine, micro_batch_size)
    plain = small_model()
    reference_model = copy.deepcopy(plain)
    model = wrap(plain, kind)
    plan = AccumulationPlan(micro_batch_size, accumulation_steps, data_parallel_size=world)
    objective = NextTokenLoss()

    local_until_last = _gradients_local_until_last(model, batches, accumulation_steps)
    snapshots = GradientSnapshots(model)
    ledger = train(
        model,
        iter(batches) if lazy else batches,
        snapshots,
        plan,
        objective,
        progress=False,
    )
    record = RunRecord.from_run(plan, ledger, unit=objective.unit, reduce_over_ranks=True)
    ids = gather_example_ids(example_ids_in(batches))

    # Window i of the union: rank r's examples m*A*i .. m*A*(i+1) - 1, for every rank.
    per_window = micro_batch_size * accumulation_steps
    errors = []
    for i, grads in enumerate(snapshots.seen):
        union = [ex for exs in per_rank for ex in exs[i * per_window : (i + 1) * per_window]]
        reference = token_mean_gradient(reference_model, union)
        errors.append(compare(reference, grads).max_rel_error)
    return {
        "rank": rank,
        "kind": kind,
        "replicas": replicas_of(model),
        "rel_errors": errors,
        "targets_per_window": [r.targets for r in ledger.reports],
        "global_targets": [r.global_targets for r in ledger.reports],
        "microbatches_per_window": [r.microbatches for r in ledger.reports],
        "padding_per_window": [r.padding_microbatches for r in ledger.reports],
        "loader_microbatches": len(batches),
        "ledger": ledger,
        "record": record.to_dict(),
        "ids": check_example_ids(ids, expected=[e.id for exs in per_rank for e in exs]),
        "local_until_last": local_until_last,
    }


def _gradients_local_until_last(
    model: nn.Module, batches: Sequence[Mapping[str, Tensor]], accumulation_steps: int
) -> list[bool] | None:
    """FSDP2 only: after each microbatch of one window, is every sharded ``.grad`` still
    None? With ``set_requires_gradient_sync(False)`` the gradient stays unsharded and local
    until the last microbatch reduce-scatters it. Clears the gradients afterwards."""
    if isinstance(model, DistributedDataParallel) or not hasattr(
        model, "set_requires_gradient_sync"
    ):
        return None
    device = local_device()
    window = batches[:accumulation_steps]
    still_local = []
    for i, mb in enumerate(window):
        mb = {k: v.to(device) for k, v in mb.items()}
        with gradient_sync(model, enabled=i == len(window) - 1):
            loss = NextTokenLoss().loss_sum(default_forward(model, mb), mb)
            loss.backward()
        still_local.append(all(p.grad is None for p in model.parameters()))
    model.zero_grad(set_to_none=True)
    return still_local


#: How :func:`window_variant` normalizes each microbatch's ``loss_sum``.
NORMALIZATIONS = ("× D / global count", "/ global count", "/ local count")
#: What :func:`window_variant` puts inside ``no_sync`` for every microbatch but the last.
SYNC_MODES = ("forward and backward", "none", "forward only", "backward only")


def window_variant(
    model: DistributedDataParallel,
    window: Sequence[Mapping[str, Tensor]],
    objective: NextTokenLoss,
    normalization: str = "× D / global count",
    no_sync_around: str = "forward and backward",
) -> None:
    """:func:`ddp_window` with one decision changed: how each microbatch's ``loss_sum`` is
    normalized (one of :data:`NORMALIZATIONS`) and what ``no_sync`` covers for every
    microbatch but the last (one of :data:`SYNC_MODES`). The defaults are the right ones."""
    device, world = local_device(), dist.get_world_size()
    local = sum(objective.count(mb) for mb in window)
    total = torch.tensor(local, device=device)  # nccl reduces device tensors only
    dist.all_reduce(total)
    factor, denominator = {
        "× D / global count": (world, int(total)),
        "/ global count": (1, int(total)),  # forgets that DDP averages
        "/ local count": (1, local),  # each rank's own mean, then DDP averages them
    }[normalization]
    for i, mb in enumerate(window):
        skip = i < len(window) - 1  # every microbatch but the last may skip the sync
        mb = {k: v.to(device) for k, v in mb.items()}
        with model.no_sync() if skip and "forward" in no_sync_around else contextlib.nullcontext():
            output = model(input_ids=mb["input_ids"])
            loss = objective.loss_sum(output, mb) * factor / denominator
        with model.no_sync() if skip and "backward" in no_sync_around else contextlib.nullcontext():
            loss.backward()


def scaled_without_d(micro_batch_size: int = 2, accumulation_steps: int = 2) -> dict[str, Any]:
    """One window on uneven ranks, once per normalization in :data:`NORMALIZATIONS`.

    Returns this rank's view of the group, its local and the global target count, and per
    normalization the relative error of the synchronized gradient against the
    single-process full batch over both ranks' examples, and the gradient's norm.
    """
    rank, world = rank_and_world()
    per_rank = uneven_examples(world)
    per_window = micro_batch_size * accumulation_steps
    window = data.microbatches(per_rank[rank][:per_window], micro_batch_size)
    plain = small_model()
    reference = token_mean_gradient(
        copy.deepcopy(plain), [e for exs in per_rank for e in exs[:per_window]]
    )
    model = wrap(plain, "ddp")
    objective = NextTokenLoss()
    local = sum(objective.count(mb) for mb in window)
    out: dict[str, Any] = {**whoami(), "local_targets": local, "reference_norm": _norm(reference)}
    total = torch.tensor(local, device=local_device())
    dist.all_reduce(total)
    out["global_targets"] = int(total)
    for name in NORMALIZATIONS:
        model.zero_grad(set_to_none=True)
        window_variant(model, window, objective, normalization=name)
        grads = {_name(n): _full(p.grad, p) for n, p in model.named_parameters()}
        out[name] = {"rel_error": compare(reference, grads).max_rel_error, "norm": _norm(grads)}
    return out


def _norm(grads: Mapping[str, Tensor]) -> float:
    return math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads.values()))


def count_syncs(accumulation_steps: int = 4, windows: int = 2) -> dict[str, dict[str, Any]]:
    """DDP gradient synchronizations per window for each placement of ``no_sync`` in
    :data:`SYNC_MODES`, counted by a :class:`SyncCounter` on a fresh DDP model per mode
    (same weights, same data, ``windows`` windows of ``accumulation_steps`` microbatches).
    Returns per mode the counted ``syncs`` and bucket all-reduce ``calls``, the number of
    ``windows``, and the relative error of its last window's gradient against the
    ``"forward and backward"`` one."""
    rank, world = rank_and_world()
    examples = shard(
        data.load_examples(limit=2 * accumulation_steps * windows * world), rank, world
    )
    batches = data.microbatches(examples, 2)
    objective = NextTokenLoss()
    out: dict[str, dict[str, Any]] = {}
    for mode in SYNC_MODES:
        model = wrap(small_model(), "ddp")
        counter = SyncCounter().attach(model)
        for w in range(windows):
            model.zero_grad(set_to_none=True)
            window = batches[w * accumulation_steps : (w + 1) * accumulation_steps]
            window_variant(model, window, objective, no_sync_around=mode)
        grads = {_name(n): _full(p.grad, p) for n, p in model.named_parameters()}
        out[mode] = {
            "syncs": counter.syncs,
            "calls": counter.calls,
            "windows": windows,
            "grads": grads,
        }
    reference = out["forward and backward"]["grads"]
    for mode in SYNC_MODES:
        out[mode]["rel_error"] = compare(reference, out[mode].pop("grads")).max_rel_error
    return out


def uneven_ranks(
    windows_per_rank: Sequence[int] = (1, 4), accumulation_steps: int = 2, kind: str = "ddp"
) -> dict[str, Any]:
    """Real training (AdamW, a warm-up scheduler) where rank r has
    ``windows_per_rank[r]`` windows' worth of microbatches (rank 0 runs out first).

    Returns this rank's ledger, the run record summed over ranks, the optimizer's step
    count, the scheduler's learning rate and a checksum of the weights: identical on every
    rank when the ranks stayed aligned.
    """
    rank, world = rank_and_world()
    m = 2
    need = [m * accumulation_steps * w for w in windows_per_rank[:world]]
    pool = data.load_examples(limit=sum(need))
    start = sum(need[:rank])
    mine = pool[start : start + need[rank]]
    batches = data.microbatches(mine, m)
    model = wrap(small_model(), kind)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda u: min(1.0, (u + 1) / 3))
    plan = AccumulationPlan(m, accumulation_steps, data_parallel_size=world)
    objective = NextTokenLoss()
    ledger = train(model, batches, optimizer, plan, objective, scheduler=scheduler, progress=False)
    record = RunRecord.from_run(plan, ledger, unit=objective.unit, reduce_over_ranks=True)
    steps = [int(s["step"]) for s in optimizer.state.values() if "step" in s]
    checksum = sum(float(_full(p.data, p).double().sum()) for p in model.parameters())
    return {
        "rank": rank,
        "ledger": ledger,
        "record": record.to_dict(),
        "optimizer_steps": sorted(set(steps)),
        "lr": scheduler.get_last_lr()[0],
        "weights_checksum": checksum,
    }


def unaligned_windows(windows_per_rank: Sequence[int] = (1, 3), accumulation_steps: int = 2) -> int:
    """The bug ``aligned_windows`` prevents: each rank loops over its own windows with
    ``train_window``. The rank with fewer windows leaves while its peer waits in a
    collective for it; the peer fails when the process-group timeout expires. Returns
    the number of update attempts if, against expectation, it finishes."""
    from accumlab.loop import train_window

    rank, world = rank_and_world()
    m = 2
    need = [m * accumulation_steps * w for w in windows_per_rank[:world]]
    pool = data.load_examples(limit=sum(need))
    start = sum(need[:rank])
    batches = data.microbatches(pool[start : start + need[rank]], m)
    model = wrap(small_model(), "ddp")
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    plan = AccumulationPlan(m, accumulation_steps, data_parallel_size=world)
    attempts = 0
    for window in plan.windows(batches):
        train_window(model, window.microbatches, optimizer, NextTokenLoss())
        attempts += 1
    return attempts


def memory_per_rank(micro_batch_size: int = 2, accumulation_steps: int = 2) -> dict[str, Any]:
    """Notebook 05: one DDP window measured by this rank's own ``MemoryMeter`` on this
    rank's device (:func:`local_device`), with this rank's :func:`uneven_examples` (short
    answers on rank 0, long ones on rank 1) and SGD. Returns :func:`whoami` and, in bytes,
    the window's baseline, its peak and what each microbatch's forward saved for backward:
    this rank's figures, for its own device."""
    from accumlab.loop import train_window
    from accumlab.memory import MemoryMeter

    rank, world = rank_and_world()
    examples = uneven_examples(world)[rank][: micro_batch_size * accumulation_steps]
    window = data.microbatches(examples, micro_batch_size)
    model = wrap(small_model(), "ddp")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    meter = MemoryMeter(local_device())
    train_window(model, window, optimizer, NextTokenLoss(), meter=meter)
    record = meter.last_window
    return {
        **whoami(),
        "baseline_bytes": record.baseline_bytes,
        "peak_bytes": record.peak_bytes,
        "saved_bytes": record.saved_bytes,
    }


def window_timeline(accumulation_steps: int = 4, sync: str = "window") -> list[Any]:
    """Record one DDP window on this rank with :class:`accumlab_course.plots.TimelineRecorder`
    and return its events (this rank's forward, backward, gradient syncs, check, step,
    clear, in order). The window is ``al.train_window`` on a fresh DDP model with SGD and
    ``clip_grad_norm=1.0``, ``accumulation_steps`` microbatches of 2 of this rank's
    :func:`uneven_examples`; ``sync="window"`` puts every microbatch but the last in
    ``no_sync`` (one gradient sync), ``"microbatch"`` syncs after every backward (``A``)."""
    from accumlab.loop import train_window

    from .plots import TimelineRecorder

    rank, world = rank_and_world()
    examples = uneven_examples(world)[rank][: 2 * accumulation_steps]
    window = data.microbatches(examples, 2)
    model = wrap(small_model(), "ddp")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with TimelineRecorder(model, optimizer) as recorder:
        train_window(model, window, optimizer, NextTokenLoss(), clip_grad_norm=1.0, sync=sync)
    return recorder.events


def no_sync_timing(
    accumulation_steps: int = 8, windows: int = 6, n_embd: int = 128, n_layer: int = 2
) -> dict[str, Any]:
    """Wall time per window and synchronizations per window, with and without ``no_sync``
    (forward and backward inside it for all but the last microbatch), interleaved window
    by window so both modes see the same machine load. The first window of each mode is
    a warm-up and not timed. Returns per mode the median seconds per window and the
    counted syncs and bucket all-reduces per window, and ``paired_ratio``: the median over
    windows of (seconds without ``no_sync``) / (seconds with it), both taken back to back."""
    rank, world = rank_and_world()
    examples = shard(data.load_examples(limit=2 * accumulation_steps * world), rank, world)
    window = data.microbatches(examples, 2)[:accumulation_steps]
    objective = NextTokenLoss()
    modes = {"no_sync": "forward and backward", "sync every microbatch": "none"}
    models = {}
    counters = {}
    for label in modes:
        models[label] = wrap(small_model(n_embd=n_embd, n_layer=n_layer), "ddp")
        counters[label] = SyncCounter().attach(models[label])
    seconds: dict[str, list[float]] = {label: [] for label in modes}
    for w in range(windows + 1):
        for label, mode in modes.items():
            dist.barrier()
            start = time.perf_counter()
            window_variant(models[label], window, objective, no_sync_around=mode)
            elapsed = time.perf_counter() - start
            models[label].zero_grad(set_to_none=True)
            if w:
                seconds[label].append(elapsed)
    params = sum(p.numel() for p in models["no_sync"].parameters())
    return {
        "rank": rank,
        "parameters": params,
        "accumulation_steps": accumulation_steps,
        "windows": windows + 1,
        "syncs_per_window": {k: c.syncs / (windows + 1) for k, c in counters.items()},
        "allreduce_calls_per_window": {k: c.calls / (windows + 1) for k, c in counters.items()},
        "seconds_per_window": {k: statistics.median(v) for k, v in seconds.items()},
        "paired_ratio": statistics.median(
            a / b for a, b in zip(seconds["sync every microbatch"], seconds["no_sync"], strict=True)
        ),
    }


def train_tiny_gpt(
    examples: int = 64,
    micro_batch_size: int = 4,
    accumulation_steps: int = 2,
    kind: str = "ddp",
    seed: int = 0,
    lr: float = 3e-3,
) -> dict[str, Any]:
    """The runnable example: train the tiny GPT on the first ``examples`` examples of the
    data set, sharded over ranks without repeats, with ``kind`` (``"ddp"``/``"fsdp2"``).

    Works under ``launch`` and under ``torchrun`` alike (and single-process with kind
    ``"none"``). Returns the run record summed over ranks (a dict), this rank's ledger
    summary and the example-ID check over all ranks.
    """
    rank, world = rank_and_world()
    pool = data.load_examples(limit=examples)
    mine = shard(pool, rank, world)
    batches = data.microbatches(mine, micro_batch_size, shuffle=True, seed=seed)
    model = wrap(small_model(seed), kind)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    plan = AccumulationPlan(micro_batch_size, accumulation_steps, data_parallel_size=world)
    objective = NextTokenLoss()
    ledger = train(model, batches, optimizer, plan, objective, progress=False)
    record = RunRecord.from_run(plan, ledger, unit=objective.unit, reduce_over_ranks=True)
    ids = check_example_ids(gather_example_ids(example_ids_in(batches)), [e.id for e in pool])
    return {"rank": rank, "record": record.to_dict(), "ledger": ledger.summary(), "ids": ids}
