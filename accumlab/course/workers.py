"""Worker functions for data-parallel runs: the bodies that :func:`accumlab.distributed.launch`
(or ``torchrun``, through ``examples/ddp_train.py``) runs on every rank.

They live in an importable module because spawned processes start a fresh interpreter:
a function defined in a notebook cell cannot be sent to them. Each one assumes the
process group is already initialised, never prints, and returns plain data (counts,
floats, dicts, tensors) for the caller to check. Tests, notebook 04 and the no_sync
benchmark all use them.

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

from ..checks import compare
from ..distributed import (
    SyncCounter,
    check_example_ids,
    example_ids_in,
    gather_example_ids,
    gradient_sync,
    local_device,
    replicas_of,
    shard,
)
from ..ledger import RunRecord
from ..loop import default_forward, train
from ..objectives import NextTokenLoss
from ..plan import AccumulationPlan
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


# ----------------------------------------------------------------------------- workers


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


#: The three normalizations ``scaled_without_d`` compares: (name, × factor, denominator).
NORMALIZATIONS = ("× D / global count", "/ global count", "/ local count")


def scaled_without_d(micro_batch_size: int = 2, accumulation_steps: int = 2) -> dict[str, Any]:
    """One window on uneven ranks, each microbatch backpropagating its ``loss_sum``

    - ``"× D / global count"``: × D / the window's targets over all ranks (the loop's rule);
    - ``"/ global count"``: forgetting that DDP averages (the gradient is D times too small);
    - ``"/ local count"``: each rank's own mean, which DDP then averages (the average of
      averages: a target on the rank with fewer targets weighs more).

    Returns this rank's view of the group, its local and the global target count, and per
    normalization the relative error against the single-process full batch over both
    ranks' examples and the gradient norm.
    """
    rank, world = rank_and_world()
    per_rank = uneven_examples(world)
    per_window = micro_batch_size * accumulation_steps
    window = data.microbatches(per_rank[rank][:per_window], micro_batch_size)
    union = [ex for exs in per_rank for ex in exs[:per_window]]
    plain = small_model()
    reference = token_mean_gradient(copy.deepcopy(plain), union)
    model = wrap(plain, "ddp")
    objective = NextTokenLoss()
    local = sum(objective.count(mb) for mb in window)
    total = torch.tensor([local], device=local_device())
    dist.all_reduce(total)
    out: dict[str, Any] = {**whoami(), "local_targets": local, "global_targets": int(total)}
    variants = dict(
        zip(NORMALIZATIONS, ((world, int(total)), (1, int(total)), (1, local)), strict=True)
    )
    for label, (factor, denominator) in variants.items():
        model.zero_grad(set_to_none=True)
        for i, mb in enumerate(window):
            mb = {k: v.to(local_device()) for k, v in mb.items()}
            with gradient_sync(model, enabled=i == len(window) - 1):
                loss = objective.loss_sum(default_forward(model, mb), mb) * factor / denominator
                loss.backward()
        grads = {_name(n): _full(p.grad, p) for n, p in model.named_parameters()}
        norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads.values()))
        out[label] = {"rel_error": compare(reference, grads).max_rel_error, "norm": norm}
    reference_norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in reference.values()))
    out["reference_norm"] = reference_norm
    return out


#: Where ``no_sync`` goes around a microbatch that must not synchronize (all but the last).
SYNC_MODES = ("forward and backward", "none", "forward only", "backward only")


def count_syncs(accumulation_steps: int = 4, windows: int = 2) -> dict[str, dict[str, Any]]:
    """DDP gradient synchronizations per window for each placement of ``no_sync``.

    ``"forward and backward"`` (what ``accumlab.train`` does, and it is the run used for
    that mode), ``"none"`` (no ``no_sync`` at all), ``"forward only"`` (forward inside,
    backward outside) and ``"backward only"`` (forward outside, backward inside). Each mode
    runs ``windows`` windows of ``accumulation_steps`` microbatches on a fresh DDP model
    with a :class:`SyncCounter`, at the same weights. Returns per mode the counted
    ``syncs`` and bucket all-reduce ``calls``, and the relative error of its last window's
    gradient against the ``"forward and backward"`` one.
    """
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
        snapshots = GradientSnapshots(model)
        if mode == "forward and backward":
            plan = AccumulationPlan(2, accumulation_steps, data_parallel_size=world)
            train(model, batches, snapshots, plan, objective, progress=False)
        else:
            for w in range(windows):
                window = batches[w * accumulation_steps : (w + 1) * accumulation_steps]
                _manual_window(model, window, objective, mode)
                snapshots.step()
                model.zero_grad(set_to_none=True)
        out[mode] = {
            "syncs": counter.syncs,
            "calls": counter.calls,
            "windows": len(snapshots.seen),
            "last_gradient": snapshots.seen[-1],
        }
    reference = out["forward and backward"]["last_gradient"]
    for mode in SYNC_MODES:
        out[mode]["rel_error"] = compare(reference, out[mode].pop("last_gradient")).max_rel_error
    return out


def _manual_window(
    model: nn.Module, window: Sequence[Mapping[str, Tensor]], objective: NextTokenLoss, mode: str
) -> None:
    """One window's backward passes with ``no_sync`` placed as ``mode`` says, normalised by
    the global target count × D, as the loop does."""
    device = local_device()
    world = dist.get_world_size()
    total = torch.tensor([sum(objective.count(mb) for mb in window)], device=device)
    dist.all_reduce(total)
    last = len(window) - 1
    for i, mb in enumerate(window):
        mb = {k: v.to(device) for k, v in mb.items()}

        def skip(part: str, i: int = i) -> Any:
            if i == last or mode == "none" or part not in mode:
                return contextlib.nullcontext()
            return model.no_sync()

        with skip("forward"):
            output = default_forward(model, mb)
            loss = objective.loss_sum(output, mb) * world / int(total)
        with skip("backward"):
            loss.backward()


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
    from ..loop import train_window

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


def misuse(case: str) -> None:
    """Bad input under a 2-rank group, to see the errors: ``"plain model"`` calls
    ``train_window`` with an unwrapped model; ``"plan mismatch"`` calls ``train`` with a DDP
    model and a plan whose ``data_parallel_size`` is 1."""
    from ..loop import train_window

    batches = data.microbatches(data.load_examples(limit=4), 2)
    objective = NextTokenLoss()
    if case == "plain model":
        model = small_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        train_window(model, batches, optimizer, objective)
    elif case == "plan mismatch":
        model = wrap(small_model(), "ddp")
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        train(model, batches, optimizer, AccumulationPlan(2, 2), objective, progress=False)
    else:
        raise ValueError(f"case must be 'plain model' or 'plan mismatch', got {case!r}")


def sampler_ids(n_examples: int = 9) -> dict[str, Any]:
    """Which example IDs each rank gets from ``DistributedSampler`` (it repeats examples
    so every rank has as many) and from ``accumlab.distributed.shard`` (no repeats),
    gathered over ranks and checked against ``range(n_examples)``."""
    from torch.utils.data.distributed import DistributedSampler

    ids = list(range(n_examples))
    from_sampler = list(DistributedSampler(ids, shuffle=False))  # rank and world from the group
    from_shard = shard(ids)
    return {
        "DistributedSampler": check_example_ids(gather_example_ids(from_sampler), expected=ids),
        "shard": check_example_ids(gather_example_ids(from_shard), expected=ids),
    }


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
            _manual_window(models[label], window, objective, mode)
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


def fail_on_rank(failing_rank: int = 1) -> str:
    """Rank ``failing_rank`` warns (to its stderr) and raises ``ValueError`` at once; every
    other rank waits in a barrier its failed peer never reaches. Shows that ``launch``
    stops all workers at the first failure instead of waiting for the process-group
    timeout, and reports the failed rank's output with its traceback."""
    import warnings

    rank, _ = rank_and_world()
    if rank == failing_rank:
        warnings.warn(f"rank {rank} is about to fail", UserWarning, stacklevel=1)
        raise ValueError(f"deliberate failure on rank {rank}")
    dist.barrier()
    return "unreachable: the barrier needs the failed rank"
