"""The reference a captured window is measured against, and the fits that explain it.

The reference of a window is the gradient of the objective the job means over *all* the
window's examples, on every data-parallel rank: the sum of each example's loss sum,
divided once by the window's count ``N``. Each example runs **as its own row**
(:func:`~accumlab.hf.objectives.example_rows`: no padding, no packing; rows of equal
length share a forward pass), so a collator whose padding or packing changes what the
model sees or scores shows as a difference, never as the reference itself. The forward
passes run under the job's own autocast (the reference shares its precision).

When the job's steps drew random numbers (dropout: its RNG state moved during
``training_step``), rows cannot replay its masks; the reference then replays each
collated microbatch with the RNG state it started from, so dropout draws the same masks,
and the examples' rows are used for their counts only (integers, no forward pass).

From the same backward passes :func:`measure_window` forms the weightings a wrong job
applies (each a *pattern* of per-microbatch weights up to one constant) and fits each to
the captured gradient ``g`` by least squares (``g ≈ c · u``), keeping ``c`` and the
relative residual:

=============  ===============================================================
pattern        weight of microbatch ``i`` (on rank ``r``)
=============  ===============================================================
``token``      1 (every target alike: the correct structure)
``rank``       ``1 / N_r`` (a mean per rank: the targets of rank ``r``)
``rank_pre``   ``1 / N'_r`` (the same with labels counted before the shift)
``microbatch`` ``1 / n_i`` (a mean per microbatch)
=============  ===============================================================

Memory: the job's gradient is held as its own ``.grad`` tensors (no copy) while the
reference accumulates into fresh ``.grad`` tensors: one gradient-sized buffer in the
parameters' dtype beyond a training step's, plus one microbatch's activations (a row
group is at most a microbatch). Every inner product is taken in float64 a chunk of at
most 2**20 entries at a time. The microbatch pattern needs a second backward pass per
microbatch (accumulating the per-microbatch means), run only when the token pattern
does not explain ``g``; with several ranks each rank's sum is broadcast once into one
more gradient-sized buffer to form the ranks' inner products.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..invariance.gradients import Gradient, distance, dot
from ..least_squares import Fit, least_squares_products
from ..objectives import NextTokenLoss, Objective
from .capture import CapturedWindow, Microbatch, held_gradient
from .objectives import (
    IGNORE_INDEX,
    Intended,
    TokenLoss,
    attention_leak,
    example_rows,
    job_targets,
    packed_rows,
    scored_after_padding,
    stack_rows,
)

PATTERNS = ("token", "rank", "rank_pre", "microbatch")


# -- the measurement ----------------------------------------------------------------------


@dataclass
class WindowMeasure:
    """One window's numbers, the same on every rank.

    ``scale``: least-squares ``a`` in ``g ≈ a · g_ref``; ``relative_error``:
    ``‖g − g_ref‖ / ‖g_ref‖`` over all trainable parameters. ``targets``: the window's
    count ``N`` of the examples each in its own row, all ranks; ``counted``: labels not
    -100 before the shift (``N'``); ``job_targets``: the targets the collated microbatches
    score (more than ``N`` when a padding position predicts a real token, or a target
    crosses from one packed example into the next); ``padding_targets``: those scored at
    a padding position; ``packed_rows``: rows holding several examples; ``leak``: how much
    an example's logits in its packed row differ from its own alone (relative, forward
    passes as the job's forward runs them, under the autocast Accelerate put on it:
    :func:`~accumlab.hf.objectives.attention_leak`), beyond ``leak_tolerance`` (the
    job's precision's: 1e-3 in float32, 3e-2 under bf16/fp16 autocast or half-precision
    weights, whose rounding alone moves a logit by about 4e-3) the attention reaches the
    neighbours;
    ``rank_targets``/``rank_counted``: per rank; ``microbatch_targets``: per microbatch,
    rank by rank; ``microbatches``: on this rank; ``ranks``: D; ``trainer_count``: the
    ``num_items_in_batch`` the Trainer passed on rank 0 (None when it passed none),
    ``rank_trainer_counts``: the same rank by rank; ``rank_spread``: how far the ranks'
    gradients differ (relative; 0 when the sync left every rank the same gradient);
    ``replayed``: the reference replayed the collated microbatches (the job drew random
    numbers) instead of the examples' own rows. ``rank_loss_sums``: each microbatch's
    summed loss under the objective (nats), rank by rank, so the window's objective is
    their total over ``targets``; ``gradient_norm``: the norm of the job's gradient (before
    clipping), ``reference_norm`` that of the reference.
    """

    scale: float
    relative_error: float
    targets: int
    counted: int
    rank_targets: list[int]
    rank_counted: list[int]
    microbatch_targets: list[list[int]]
    microbatches: int
    ranks: int
    trainer_count: float | None
    rank_spread: float
    rank_trainer_counts: list[float | None] = field(default_factory=list)
    unit: str = "target"
    fits: dict[str, Fit] = field(default_factory=dict)
    job_targets: int = 0
    padding_targets: int = 0
    packed_rows: int = 0
    leak: float = 0.0
    leak_tolerance: float = 1e-3
    replayed: bool = False
    rank_loss_sums: list[list[float]] = field(default_factory=list)
    gradient_norm: float = math.nan
    reference_norm: float = math.nan


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def all_gather_objects(value: Any) -> list[Any]:
    """``value`` of every rank, in rank order (``[value]`` without a process group)."""
    world = _world()[1]
    if world == 1:
        return [value]
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, value)
    return gathered


def _collective_device(t: Tensor) -> Tensor:
    return t.cuda() if dist.get_backend() == "nccl" and t.device.type != "cuda" else t


def prepared(inputs: Mapping[str, Any], device: torch.device) -> dict[str, Any]:
    """``inputs`` with every tensor moved to ``device`` (what ``_prepare_inputs`` does)."""
    return {k: v.to(device) if isinstance(v, Tensor) else v for k, v in inputs.items()}


def pre_shift_count(batch: Mapping[str, Any]) -> int:
    """Labels that are not -100, before any shift: the count a Trainer that does not know
    the loss shifts takes."""
    return int((batch["labels"] != IGNORE_INDEX).sum())


def _model_inputs(model: nn.Module, batch: Mapping[str, Any], kind: str) -> dict[str, Any]:
    """What the reference forward pass gets: the batch without its labels (the objective
    scores the logits), except that a seq2seq model without decoder inputs gets them made
    from the labels, as the model itself would."""
    inputs = {k: v for k, v in batch.items() if k not in ("labels", "shift_labels")}
    if kind == "seq2seq" and "decoder_input_ids" not in inputs:
        make = getattr(model, "prepare_decoder_input_ids_from_labels", None)
        if callable(make):
            inputs["decoder_input_ids"] = make(labels=batch["labels"])
        else:
            inputs["labels"] = batch["labels"]
    return inputs


def _collated_labels(batch: Mapping[str, Any]) -> dict[str, Any]:
    """A collated microbatch's labels in unshifted form (``shift_labels`` put back)."""
    shifted = batch.get("shift_labels")
    if isinstance(shifted, Tensor):
        return {"labels": torch.nn.functional.pad(shifted[:, :-1], (1, 0), value=IGNORE_INDEX)}
    return {"labels": batch["labels"]}


@dataclass
class _Plan:
    """What the reference runs for one microbatch, and its counts."""

    passes: list[tuple[dict[str, Any], dict[str, Any]]]  # (model inputs, objective batch)
    rng: Any
    targets: int
    counted: int
    job_targets: int
    padding_targets: int
    packed_rows: int


def _plan(mb: Microbatch, intended: Intended, replay: bool, model: nn.Module) -> _Plan:
    objective, kind = intended.objective, intended.kind
    batch = mb.inputs
    shift = kind == "causal"
    if kind in ("user", "unknown") or objective is None:
        n = objective.count(batch) if objective is not None else 0
        return _Plan([(_model_inputs(model, batch, kind), batch)], mb.rng, n, n, n, 0, 0)
    rows = example_rows(batch, kind)
    n = sum(objective.count(r) for r in rows)
    counted = pre_shift_count(batch) if shift else n
    jt = job_targets(batch, shift) if kind != "example" else n
    if replay:
        labelled = {**batch, **_collated_labels(batch)} if shift else batch
        passes = [(_model_inputs(model, batch, kind), labelled)]
    else:
        passes = [(_model_inputs(model, r, kind), r) for r in stack_rows(rows)]
    return _Plan(
        passes,
        mb.rng if replay else None,
        n,
        counted,
        jt,
        scored_after_padding(batch, shift),
        packed_rows(batch),
    )


def _backward(
    model: nn.Module,
    plan: _Plan,
    objective: Objective,
    device: torch.device,
    context: Callable[[], Any],
    weight: float,
) -> float:
    """Accumulate ``weight`` times the microbatch's reference loss-sum gradient in
    ``.grad``; returns the loss sum (nats)."""
    if plan.rng is not None:
        plan.rng.restore()
    total = 0.0
    for inputs, scored in plan.passes:
        with context():
            output = model(**prepared(inputs, device))
        loss = objective.loss_sum(output, prepared(scored, device))
        (loss * weight if weight != 1.0 else loss).backward()
        total += float(loss.detach())
        del output, loss
    return total


def measure_window(
    model: nn.Module,
    window: CapturedWindow,
    intended: Intended,
    device: torch.device,
    context: Callable[[], Any] = contextlib.nullcontext,
    leak_tolerance: float = 1e-3,
) -> WindowMeasure:
    """Measure one captured window against its reference (a collective under
    ``torch.distributed``: every rank calls it with its own window, in the same order).

    Runs the reference forward and backward passes on ``model`` in training mode under
    ``context()`` (the job's autocast), accumulating into fresh ``.grad`` tensors (the
    caller holds and restores the old ones). ``leak_tolerance``: the relative logit
    difference the job's precision allows between an example packed and alone. Returns
    the same :class:`WindowMeasure` on every rank.
    """
    if window.gradient is None:
        raise ValueError("the window was never closed: no gradient was captured")
    objective = intended.objective
    if objective is None:
        raise ValueError("measure_window needs an objective")
    rank, world = _world()
    replay = any(mb.random for mb in window.microbatches)
    plans = [_plan(mb, intended, replay, model) for mb in window.microbatches]
    leaks = [
        attention_leak(model, mb.inputs, intended.kind, device)
        for mb, p in zip(window.microbatches, plans, strict=True)
        if p.packed_rows
    ]
    local_n = [p.targets for p in plans]
    per_rank_n = all_gather_objects(local_n)
    per_rank_pre = all_gather_objects([p.counted for p in plans])
    rank_targets = [sum(x) for x in per_rank_n]
    rank_counted = [sum(x) for x in per_rank_pre]
    total = sum(rank_targets)
    if replay:  # the reference scores what the collated microbatches score
        total = sum(all_gather_objects(sum(p.job_targets for p in plans)))
    g, f = window.gradient, window.factor

    model.train()
    model.zero_grad(set_to_none=True)
    g_dot_r = []  # <g, R_i>: the job's gradient against each microbatch's reference
    loss_sums = []
    before = 0.0
    for p in plans:
        loss_sums.append(_backward(model, p, objective, device, context, 1.0))
        now = dot(g, held_gradient(model))
        g_dot_r.append(now - before)
        before = now
    s_local = held_gradient(model)  # this rank's sum of loss-sum gradients, S_r
    gg = f * f * dot(g, g)
    gs_local = f * before
    ss_local = dot(s_local, s_local)
    rank_gram = _rank_gram(s_local, ss_local, world, rank)  # <S_r, S_q>
    gs_ranks = all_gather_objects(gs_local)
    ss = float(sum(sum(row) for row in rank_gram))
    gs = float(sum(gs_ranks))  # <g, S> with S = sum of S_r (g is the same on every synced rank)
    # the reference is S / N with S summed over ranks; the relative error is formed entry by
    # entry on this rank against its own S_r when D = 1, otherwise from the inner products
    if world == 1:
        error_norm = distance(g, f, s_local, 1.0 / total) if total else math.nan
    else:
        error_norm = math.sqrt(max(gg - 2 * gs / total + ss / total**2, 0.0)) if total else math.nan
    ref_norm = math.sqrt(ss) / total if total else 0.0
    scale = (gs / total) / ref_norm**2 if ref_norm > 0 else math.nan
    error = error_norm / ref_norm if ref_norm > 0 else math.nan

    g_norm = math.sqrt(gg)
    fits: dict[str, Fit] = {}  # each pattern u fitted to g: least squares from <g,g>, <g,u>, <u,u>
    if ss > 0 and g_norm > 0:
        fits["token"] = least_squares_products(gg, [gs], [[ss]])
    if world > 1:
        for name, counts in (("rank", rank_targets), ("rank_pre", rank_counted)):
            w = [1.0 / c if c else 0.0 for c in counts]
            uu = sum(w[a] * w[b] * rank_gram[a][b] for a in range(world) for b in range(world))
            gu = sum(w[a] * gs_ranks[a] for a in range(world))
            if uu > 0 and g_norm > 0:
                fits[name] = least_squares_products(gg, [gu], [[uu]])
    flat_n = [x for r in per_rank_n for x in r]
    if "token" in fits and len(set(flat_n)) == 1 and flat_n[0]:  # equal counts: the same pattern
        token = fits["token"]
        fits["microbatch"] = Fit([token.coefficients[0] * flat_n[0]], token.residual)
    elif g_norm > 0 and not error <= 1e-4:  # wrong (or rounded): name its weighting
        fits["microbatch"] = _microbatch_fit(
            model, plans, objective, device, context, g, f, gg, g_dot_r
        )
    model.zero_grad(set_to_none=True)
    del s_local

    spread = _rank_spread(g, f, world)
    own = _trainer_count(window)
    rank_trainer_counts = all_gather_objects(own)
    return WindowMeasure(
        scale=scale,
        relative_error=error,
        targets=sum(rank_targets),
        counted=sum(rank_counted),
        rank_targets=rank_targets,
        rank_counted=rank_counted,
        microbatch_targets=per_rank_n,
        microbatches=len(plans),
        ranks=world,
        trainer_count=rank_trainer_counts[0],
        rank_trainer_counts=rank_trainer_counts,
        unit=getattr(objective, "unit", "unit"),
        rank_spread=spread,
        fits=fits,
        job_targets=sum(all_gather_objects(sum(p.job_targets for p in plans))),
        padding_targets=sum(all_gather_objects(sum(p.padding_targets for p in plans))),
        packed_rows=sum(all_gather_objects(sum(p.packed_rows for p in plans))),
        leak=max(all_gather_objects(max(leaks, default=0.0))),
        leak_tolerance=leak_tolerance,
        replayed=replay,
        rank_loss_sums=all_gather_objects(loss_sums),
        gradient_norm=g_norm,
        reference_norm=ref_norm,
    )


def _microbatch_fit(
    model: nn.Module,
    plans: list[_Plan],
    objective: Objective,
    device: torch.device,
    context: Callable[[], Any],
    g: Gradient,
    f: float,
    gg: float,
    g_dot_r: list[float],
) -> Fit:
    """The per-microbatch-mean pattern ``Σ_i R_i / n_i`` (over every rank): a second
    backward pass per microbatch accumulates it in ``.grad``."""
    model.zero_grad(set_to_none=True)
    for p in plans:
        if p.targets:
            _backward(model, p, objective, device, context, 1.0 / p.targets)
    u_local = held_gradient(model)
    world = _world()[1]
    if world > 1:
        u_local = [t.clone() if t is not None else None for t in u_local]
        for t in u_local:
            if t is not None:
                dist.all_reduce(_collective_device(t))
    uu = dot(u_local, u_local)
    gu_local = f * sum(x / p.targets for x, p in zip(g_dot_r, plans, strict=True) if p.targets)
    gu = float(sum(all_gather_objects(gu_local)))
    del u_local
    if uu <= 0:
        return Fit([math.nan], 1.0)
    return least_squares_products(gg, [gu], [[uu]])


def _rank_gram(s_local: Gradient, ss_local: float, world: int, rank: int) -> list[list[float]]:
    """``<S_r, S_q>`` for every pair of ranks: each rank's sum broadcast once into one
    buffer, dotted with every rank's own."""
    if world == 1:
        return [[ss_local]]
    gram = [[0.0] * world for _ in range(world)]
    for q in range(world):
        received = []
        for t in s_local:
            if t is None:
                received.append(None)
                continue
            buf = _collective_device(t.detach().clone() if rank == q else torch.empty_like(t))
            dist.broadcast(buf, q)
            received.append(buf)
        row = all_gather_objects(dot(s_local, received))
        for r in range(world):
            gram[r][q] = row[r]
        del received
    return gram


def _rank_spread(g: Gradient, f: float, world: int) -> float:
    """How far the ranks' gradients differ, relative: compared through two numbers per
    rank (the squared norm and the inner product with a fixed pseudo-random direction)."""
    if world == 1:
        return 0.0
    gen = torch.Generator().manual_seed(1234)
    probe = 0.0
    for t in g:
        if t is None:
            continue
        direction = torch.randn(t.numel(), generator=gen, dtype=torch.float64)
        probe += float(torch.dot(t.reshape(-1).double().cpu(), direction))
    norm2 = f * f * dot(g, g)
    values = all_gather_objects((f * probe, norm2))
    scale = math.sqrt(max(v[1] for v in values)) or 1.0
    probes = [v[0] for v in values]
    norms = [math.sqrt(v[1]) for v in values]
    return max((max(probes) - min(probes)) / scale, (max(norms) - min(norms)) / scale)


def _trainer_count(window: CapturedWindow) -> float | None:
    nib = window.microbatches[0].num_items_in_batch if window.microbatches else None
    if isinstance(nib, Tensor):
        return float(nib.float().reshape(-1)[0])
    return float(nib) if nib is not None else None


def same_on_every_rank(values: Sequence[Any]) -> bool:
    """True when every entry of ``values`` is equal (e.g. every rank's target count)."""
    return len(set(values)) <= 1


def user_intended(objective: Objective) -> Intended:
    """An :class:`Intended` for an objective the caller passed: its kind when the audit
    knows it (a next-token loss is cut into rows like a causal LM), else ``user``."""
    if isinstance(objective, NextTokenLoss) and objective.ignore_index == IGNORE_INDEX:
        return Intended(
            TokenLoss(shift=True), "causal", f"{objective!r}: token mean over shifted targets"
        )
    if isinstance(objective, TokenLoss):
        return Intended(objective, "causal" if objective.shift else "token", f"{objective!r}")
    return Intended(
        objective, "user", f"{objective!r}: sum of its loss over the window's examples / its count"
    )


__all__ = [
    "PATTERNS",
    "all_gather_objects",
    "WindowMeasure",
    "measure_window",
    "pre_shift_count",
    "same_on_every_rank",
    "user_intended",
]
