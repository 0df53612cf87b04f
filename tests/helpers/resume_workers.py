"""Test-only helpers and workers for checkpoint/resume (tests/checkpoint/).

Spawned ranks (``accumlab.distributed.launch``) import this module as
``resume_workers``: pytest puts ``tests/`` on ``sys.path`` and ``multiprocessing``'s spawn
start method copies it into each child (the kill test's children are forked). Workers
return plain data and CPU tensors; none prints.

A *run* here is built from a :class:`Config` alone (seeded model, optimizer, scheduler,
scaler and data), so building it twice gives two identical runs: one trained straight
through, one interrupted and resumed from its checkpoint.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

import accumlab as al
from accumlab import checkpoint
from accumlab.memory import MemoryMeter
from accumlab_course.models import TinyGPT

VOCAB = 32
SEQ = 12


@dataclass(frozen=True)
class Config:
    """Everything that defines one run; ``build`` turns it into the objects ``train`` takes."""

    microbatches: int = 8  # loader microbatches (this rank's)
    m: int = 2
    a: int = 2
    last_window: str = "update"
    dropout: float = 0.0
    precision: str = "fp32"
    scaler: dict[str, Any] | None = None  # GradScaler("cpu", **scaler) when given
    scheduler: bool = True
    clip_grad_norm: float | None = 1.0
    budget_bytes: int | None = None  # MemoryMeter budget, with on_oom="shrink"
    n_embd: int = 16
    seq: int = SEQ
    seed: int = 0
    data_seed: int = 1
    epochs: int = 0  # > 0: that many epochs of a shuffled DataLoader over the data's examples
    wrapper: str = "ddp"  # in a process group: "ddp" (DistributedDataParallel) or "fsdp2"
    extra: dict[str, Any] = field(default_factory=dict)


def token_batches(n: int, m: int, seq: int, seed: int, first_id: int = 0) -> list[dict[str, Tensor]]:
    """``n`` microbatches of ``m`` token rows each; every position after the first is a
    target. Example ids count up from ``first_id``."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        ids = torch.randint(0, VOCAB, (m, seq), generator=g)
        out.append(
            {
                "input_ids": ids,
                "labels": ids.clone(),
                "example_ids": torch.arange(first_id + i * m, first_id + (i + 1) * m),
            }
        )
    return out


def build(config: Config, rank: int = 0) -> dict[str, Any]:
    """A fresh run: model, optimizer, scheduler, scaler, meter and data, seeded.

    The model is the same on every rank; the RNG the training draws from (dropout) is
    seeded per rank afterwards, so each rank has its own state to save and restore.
    """
    torch.manual_seed(config.seed)
    model: nn.Module = TinyGPT(
        VOCAB,
        block_size=config.seq,
        n_layer=1,
        n_head=2,
        n_embd=config.n_embd,
        dropout=config.dropout,
    )
    torch.manual_seed(1000 + rank)
    random.seed(1000 + rank)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        if config.wrapper == "fsdp2":
            from torch.distributed.fsdp import fully_shard

            model = fully_shard(model)
        else:
            model = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    scheduler = (
        torch.optim.lr_scheduler.LambdaLR(optimizer, lambda update: 1.0 / (1.0 + 0.25 * update))
        if config.scheduler
        else None
    )
    scaler = torch.amp.GradScaler("cpu", **config.scaler) if config.scaler is not None else None
    meter = MemoryMeter("cpu", budget_bytes=config.budget_bytes) if config.budget_bytes else None
    data = token_batches(
        config.microbatches, config.m, config.seq, config.data_seed + rank, 10_000 * rank
    )
    plan = al.AccumulationPlan(
        config.m,
        config.a,
        data_parallel_size=al.parallel.replicas_of(model),
        last_window=config.last_window,
    )
    return {
        "model": model,
        "optimizer": optimizer,
        "scheduler": scheduler,
        "scaler": scaler,
        "meter": meter,
        "data": data,
        "plan": plan,
    }


def examples_of(microbatches: list[dict[str, Tensor]]) -> list[dict[str, Tensor]]:
    """The single examples (rows) of ``microbatches``, each a dict with a 0-dim example id."""
    return [
        {key: value[row] for key, value in mb.items()}
        for mb in microbatches
        for row in range(int(mb["input_ids"].shape[0]))
    ]


def shuffled_epochs(data: list[dict[str, Tensor]], m: int, epochs: int) -> Iterator[Any]:
    """``epochs`` epochs of ``DataLoader(examples, batch_size=m, shuffle=True)`` chained:
    the sampler draws each epoch's order from torch's global generator when the epoch
    starts, as a training script that loops over epochs does."""
    loader = torch.utils.data.DataLoader(examples_of(data), batch_size=m, shuffle=True)
    for _ in range(epochs):
        yield from loader


def train(run: dict[str, Any], config: Config, batches: Any = None, **kwargs: Any) -> al.Ledger:
    """``al.train`` on a built run (``batches`` replaces its data when given; with
    ``config.epochs``, the data is that many shuffled DataLoader epochs)."""
    if batches is None and config.epochs:
        batches = shuffled_epochs(run["data"], config.m, config.epochs)
    return al.train(
        run["model"],
        run["data"] if batches is None else batches,
        run["optimizer"],
        run["plan"],
        al.NextTokenLoss(),
        scheduler=run["scheduler"],
        scaler=run["scaler"],
        meter=run["meter"],
        precision=config.precision,
        clip_grad_norm=config.clip_grad_norm,
        on_oom="shrink" if config.budget_bytes else "raise",
        progress=False,
        **kwargs,
    )


def _plain(value: Any) -> Any:
    """A detached CPU copy of nested state (tensors cloned), for comparing two runs."""
    if isinstance(value, Tensor):
        if callable(getattr(value, "to_local", None)):  # an FSDP2 DTensor: this rank's shard
            value = value.to_local()
        return value.detach().cpu().clone()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def snapshot(run: dict[str, Any], ledger: al.Ledger) -> dict[str, Any]:
    """Everything that must match after a resume: weights, optimizer state (incl. the
    learning rate), scheduler, scaler (the scale) and the ledger's counts and reports."""
    scheduler, scaler = run["scheduler"], run["scaler"]
    return {
        "model": _plain(run["model"].state_dict()),
        "optimizer": _plain(run["optimizer"].state_dict()),
        "lr": [g["lr"] for g in run["optimizer"].param_groups],
        "scheduler": None if scheduler is None else _plain(scheduler.state_dict()),
        "scaler": None if scaler is None else scaler.state_dict(),
        "ledger": _plain(ledger.state_dict()),
    }


def mismatches(a: Any, b: Any, where: str = "") -> list[str]:
    """Where two snapshots differ: tensors must be ``torch.equal`` (same dtype), floats
    equal (nan equals nan), everything else ``==``."""
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        same = isinstance(a, Tensor) and isinstance(b, Tensor) and a.dtype == b.dtype
        return [] if same and torch.equal(a, b) else [where]
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [f"{where} keys {sorted(map(str, set(a) ^ set(b)))}"]
        return [m for k in a for m in mismatches(a[k], b[k], f"{where}.{k}")]
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{where} length {len(a)} vs {len(b)}"]
        return [m for i, (x, y) in enumerate(zip(a, b, strict=True)) for m in mismatches(x, y, f"{where}[{i}]")]
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return []
    return [] if a == b else [f"{where}: {a!r} vs {b!r}"]


def max_weight_diff(a: dict[str, Any], b: dict[str, Any]) -> float:
    """The largest absolute difference between two snapshots' weights."""
    return max(
        float((a["model"][k].double() - b["model"][k].double()).abs().max()) if a["model"][k].numel() else 0.0
        for k in a["model"]
    )


def straight_and_resumed(
    config: Config, directory: str, stop_after: int, total: int | None, rank: int = 0, **kwargs: Any
) -> dict[str, Any]:
    """Train ``config`` straight through (``total`` attempts, ``None``: all the data), and
    again interrupted after ``stop_after`` attempts then resumed from ``directory`` in a
    fresh run (new objects, same seeds). Returns both snapshots."""
    run = build(config, rank)
    straight = snapshot(run, train(run, config, max_updates=total))
    first = build(config, rank)
    train(first, config, max_updates=stop_after, checkpoint_dir=directory, checkpoint_every=1, **kwargs)
    second = build(config, rank)
    resumed = snapshot(second, train(second, config, max_updates=total, checkpoint_dir=directory, resume=True))
    return {"straight": straight, "resumed": resumed}


# ------------------------------------------------------------------ two gloo ranks


def two_rank_resume(directory: str) -> dict[str, Any]:
    """Two DDP ranks with uneven data (rank 0: 7 microbatches, rank 1: 5; A=2, so rank 1
    pads from window 2 on) and dropout, each rank with its own RNG state; once with lists
    (windows planned from ``len``) and once with iterators without ``len`` (windows agreed
    one at a time).

    Interrupted after 3 attempts, the ranks are left one checkpoint apart, as a kill
    between the two ranks' writes would leave them: both train on to 4 attempts and rank
    1's checkpoint 4 is removed. The resumed run must agree on checkpoint 3 and end as
    the straight run does. Returns this rank's snapshots per mode.
    """
    rank = torch.distributed.get_rank()
    config = Config(microbatches=7 - 2 * rank, dropout=0.2)
    results = {}
    for mode in ("len", "lazy"):
        where = f"{directory}/{mode}"

        def data(run: dict[str, Any], lazy: bool = mode == "lazy") -> Any:
            return iter(run["data"]) if lazy else run["data"]

        run = build(config, rank)
        straight = snapshot(run, train(run, config, data(run)))
        first = build(config, rank)
        train(first, config, data(first), max_updates=4, checkpoint_dir=where, checkpoint_every=1)
        torch.distributed.barrier()
        if rank == 1:
            checkpoint.checkpoint_path(where, 4, rank=1).unlink()
        torch.distributed.barrier()
        agreed = checkpoint.newest_common(where)
        second = build(config, rank)
        ledger = train(second, config, data(second), checkpoint_dir=where, resume=True)
        results[mode] = {"straight": straight, "resumed": snapshot(second, ledger), "agreed": agreed}
    return results


def two_rank_fsdp2_resume(directory: str) -> dict[str, Any]:
    """Two FSDP2 ranks (``fully_shard``; uneven data, dropout, three checkpoints written)
    interrupted after 2 attempts and resumed: this rank's snapshots, straight and resumed
    (each rank compares its own shards of the weights and optimizer state)."""
    rank = torch.distributed.get_rank()
    config = Config(microbatches=7 - 2 * rank, dropout=0.2, wrapper="fsdp2")
    return straight_and_resumed(config, directory, 2, None, rank)


def two_rank_refusal(directory: str) -> str:
    """Two DDP ranks write checkpoints; resumed with another lr on rank 1 only, every rank
    must refuse (none may wait for the other in a collective). Returns this rank's error."""
    rank = torch.distributed.get_rank()
    config = Config(microbatches=6)
    first = build(config, rank)
    train(first, config, max_updates=2, checkpoint_dir=directory, checkpoint_every=1)
    second = build(config, rank)
    if rank == 1:
        second["optimizer"].param_groups[0]["lr"] = 0.1
    try:
        train(second, config, checkpoint_dir=directory, resume=True)
    except checkpoint.ResumeMismatchError as exc:
        return str(exc)
    return "no error"


def two_rank_fallback(directory: str) -> dict[str, Any]:
    """Two DDP ranks (uneven data, dropout) with a checkpoint after every attempt, stopped
    after 4; then rank 0's checkpoint 4 is cut in half. Resumed, rank 0 cannot read its
    newest checkpoint and rank 1 can: both must fall back to checkpoint 3 together and end
    as the straight run does. Returns this rank's snapshots and the warnings it gave."""
    import warnings

    rank = torch.distributed.get_rank()
    config = Config(microbatches=7 - 2 * rank, dropout=0.2)
    run = build(config, rank)
    straight = snapshot(run, train(run, config))
    first = build(config, rank)
    train(first, config, max_updates=4, checkpoint_dir=directory, checkpoint_every=1)
    torch.distributed.barrier()
    if rank == 0:
        path = checkpoint.checkpoint_path(directory, 4, rank=0)
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    torch.distributed.barrier()
    second = build(config, rank)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ledger = train(second, config, checkpoint_dir=directory, resume=True)
    return {
        "straight": straight,
        "resumed": snapshot(second, ledger),
        "warnings": [str(w.message) for w in caught],
        "newest": checkpoint.list_checkpoints(directory, rank)[0],
    }


def two_rank_cases(directory: str) -> dict[str, Any]:
    """Every two-rank case in one process group (one launch instead of four: two fresh
    interpreters and a group each cost seconds), each in its own directory under
    ``directory``: this rank's result of each, by name. The refusal comes last: it is the
    case that would leave a rank waiting in a collective if every rank did not raise."""
    return {
        "resume": two_rank_resume(f"{directory}/resume"),
        "fallback": two_rank_fallback(f"{directory}/fallback"),
        "fsdp2": two_rank_fsdp2_resume(f"{directory}/fsdp2"),
        "refusal": two_rank_refusal(f"{directory}/refusal"),
    }


# ------------------------------------------------------------------ the kill test


# Three epochs of a shuffled DataLoader over 14 examples (7 microbatches of 2 per epoch:
# epochs 2 and 3 start inside windows 3 and 7 of 11), dropout 0.1: each epoch's order is
# drawn from the global generator when it starts.
KILL_CONFIG = Config(epochs=3, microbatches=7, m=2, a=2, dropout=0.1)
KILL_PAUSE_S = 0.1  # per update attempt, so that a kill lands mid-run


def kill_run(directory: str, out: str, pause_s: float) -> None:
    """Train ``KILL_CONFIG`` on one thread with a checkpoint after every attempt, resuming
    from ``directory`` if it holds one; save the final weights to ``out``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run = build(KILL_CONFIG)
        train(
            run,
            KILL_CONFIG,
            checkpoint_dir=directory,
            checkpoint_every=1,
            resume=True,
            on_update=lambda report: time.sleep(pause_s),
        )
        torch.save(_plain(run["model"].state_dict()), out)
    finally:
        torch.set_num_threads(threads)


def straight_weights(config: Config = KILL_CONFIG) -> dict[str, Tensor]:
    """The weights of ``config`` trained straight through (one thread, as ``kill_run``)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run = build(config)
        train(run, config)
        return _plain(run["model"].state_dict())
    finally:
        torch.set_num_threads(threads)


class StatefulBatches:
    """A loader with its own position (like torchdata's ``StatefulDataLoader``):
    ``state_dict()`` says how many microbatches it has yielded, and after
    ``load_state_dict`` the next iteration starts there. ``yielded`` counts what it gave."""

    def __init__(self, items: list[dict[str, Tensor]]) -> None:
        self.items = items
        self.position = 0
        self.start = 0
        self.yielded = 0

    def __iter__(self) -> Iterator[dict[str, Tensor]]:
        start, self.start = self.start, 0
        for i in range(start, len(self.items)):
            self.position = i + 1
            self.yielded += 1
            yield self.items[i]

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.start = int(state["position"])
