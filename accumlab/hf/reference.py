"""The reference a captured window is measured against, and the fits that explain it.

The reference of a window is the gradient of the objective the job means over *all* the
window's examples, on every data-parallel rank, as one batch: for a causal language model
the token mean over shifted targets (``NextTokenLoss``: ``labels[:, 1:] != -100``), for a
sequence-level task (one label per example) the example mean (``ExampleLoss``). It is
computed one recorded microbatch at a time, as the *sum* of that microbatch's losses
(``G_i``, the gradient of ``loss_sum``), each forward pass replaying the RNG state the
Trainer's forward pass started from (so dropout draws the same masks), and divided once by
the window's global count ``N``. By linearity ``Σ G_i / N`` is the gradient of the one-batch
mean, without padding the microbatches to a common length.

:func:`measure_window` also forms, from the same ``G_i``, the gradients of the weightings a
wrong job applies (each a *pattern* of per-microbatch weights up to one constant):

=============  ===============================================================
pattern        weight of microbatch ``i`` (on rank ``r``)
=============  ===============================================================
``token``      1 (every target alike: the correct structure)
``rank``       ``1 / N_r`` (a mean per rank: the targets of rank ``r``)
``rank_pre``   ``1 / N'_r`` (the same with labels counted before the shift)
``microbatch`` ``1 / n_i`` (a mean per microbatch)
=============  ===============================================================

and fits each to the captured gradient ``g`` by least squares (``g ≈ c · u_pattern``),
keeping the constant ``c`` and the residual. :mod:`accumlab.hf.verdict` reads those fits.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..objectives import ExampleLoss, NextTokenLoss, Objective
from .capture import CapturedWindow, flat_gradient

IGNORE_INDEX = -100
PATTERNS = ("token", "rank", "rank_pre", "microbatch")


def is_causal_lm(model: nn.Module) -> bool:
    """True when ``model`` is, or wraps at its top, a Hugging Face causal language model.

    Reads class names (``...ForCausalLM``, ``...LMHeadModel``, the Trainer's causal-LM
    mapping) and ``loss_type`` of the model and of its direct children; an encoder-decoder
    model is not causal (its labels are not shifted by the loss).
    """
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        names = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    except ImportError:  # pragma: no cover - the mapping moved
        names = set()
    for module in [model, *model.children()]:
        config = getattr(module, "config", None)
        if getattr(config, "is_encoder_decoder", False):
            return False
        cls = type(module).__name__
        loss_type = getattr(module, "loss_type", None)
        if cls in names or cls.endswith(("ForCausalLM", "LMHeadModel")):
            return True
        if isinstance(loss_type, str) and loss_type.startswith("ForCausalLM"):
            return True
    return False


def intended_objective(model: nn.Module, labels: Tensor) -> tuple[Objective | None, str]:
    """The objective the job means, from the model and the first microbatch's labels.

    Returns ``(objective, description)``, or ``(None, why not)`` when the audit cannot tell.
    """
    if not isinstance(labels, Tensor):
        return None, f"the batches' labels are a {type(labels).__name__}, not a tensor"
    if labels.is_floating_point():
        return None, "the labels are floating point (a regression or soft targets): no token or example mean to compare with"
    if labels.dim() == 2 and is_causal_lm(model):
        return NextTokenLoss(IGNORE_INDEX), "token mean of cross-entropy over shifted targets (labels[:, 1:] != -100)"
    if labels.dim() == 1:
        return ExampleLoss("cross_entropy"), "example mean of cross-entropy (one class label per example)"
    return None, (
        f"labels of shape {tuple(labels.shape)} on a {type(model).__name__} that is not a causal "
        "language model: the audit knows the objective of causal LMs and of one-label-per-example "
        "tasks only (pass objective=...)"
    )


def prepared(inputs: Mapping[str, Any], device: torch.device) -> dict[str, Any]:
    """``inputs`` with every tensor moved to ``device`` (what ``_prepare_inputs`` does)."""
    return {k: v.to(device) if isinstance(v, Tensor) else v for k, v in inputs.items()}


def pre_shift_count(batch: Mapping[str, Any]) -> int:
    """Labels that are not -100, before any shift: the count a Trainer that does not know
    the loss shifts takes."""
    return int((batch["labels"] != IGNORE_INDEX).sum())


@dataclass
class PatternFit:
    """``g ≈ constant · u`` for one weighting pattern: the constant and the residual
    ``‖g − constant·u‖ / ‖g‖``."""

    constant: float
    residual: float


@dataclass
class WindowMeasure:
    """One window's numbers, the same on every rank.

    ``scale``: least-squares ``a`` in ``g ≈ a · g_ref``; ``relative_error``:
    ``‖g − g_ref‖ / ‖g_ref‖`` over all trainable parameters. ``targets``: the window's
    count ``N`` under the objective, all ranks; ``counted``: labels not -100 before the
    shift (``N'``); ``rank_targets``/``rank_counted``: per rank; ``microbatch_targets``: per
    microbatch, rank by rank; ``microbatches``: on this rank; ``ranks``: D;
    ``trainer_count``: the ``num_items_in_batch`` the Trainer passed on rank 0 (None when it
    passed none), ``rank_trainer_counts``: the same rank by rank; ``rank_spread``: the largest ``‖g_r − g‖ / ‖g‖`` over ranks (0 when the sync
    left every rank the same gradient).
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
    fits: dict[str, PatternFit] = field(default_factory=dict)


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _all_gather_objects(value: Any) -> list[Any]:
    """``value`` of every rank, in rank order (``[value]`` without a process group)."""
    world = _world()[1]
    if world == 1:
        return [value]
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, value)
    return gathered


def _sum_across_ranks(t: Tensor) -> Tensor:
    if _world()[1] > 1:
        # gloo reduces CPU tensors; nccl needs the device: move there and back
        backend = dist.get_backend()
        if backend == "nccl":
            t = t.cuda()
            dist.all_reduce(t)
            return t.cpu()
        dist.all_reduce(t)
    return t


def _reference_forward(model: nn.Module, inputs: Mapping[str, Any]) -> Any:
    """The model's own forward (not an autocast wrapper Accelerate installed) on ``inputs``."""
    forward = getattr(model, "_original_forward", None) or model.forward
    return forward(**inputs)


def measure_window(
    model: nn.Module, window: CapturedWindow, objective: Objective, device: torch.device
) -> WindowMeasure:
    """Measure one captured window against its reference (a collective under
    ``torch.distributed``: every rank calls it with its own window, in the same order).

    Runs one forward and backward pass per recorded microbatch on ``model`` (in training
    mode, the caller restores the mode and ``.grad``); the RNG state is set to each
    microbatch's recorded one. Returns the same :class:`WindowMeasure` on every rank.
    """
    if window.gradient is None:
        raise ValueError("the window was never closed: no gradient was captured")
    rank, world = _world()
    batches = [mb.inputs for mb in window.microbatches]
    local_n = [objective.count(b) for b in batches]
    local_pre = [pre_shift_count(b) for b in batches] if isinstance(objective, NextTokenLoss) else local_n
    per_rank_n = _all_gather_objects(local_n)
    per_rank_pre = _all_gather_objects(local_pre)
    rank_targets = [sum(x) for x in per_rank_n]
    rank_counted = [sum(x) for x in per_rank_pre]
    total = sum(rank_targets)
    n_r, pre_r = rank_targets[rank], rank_counted[rank]

    numel = window.gradient.numel()
    u = torch.zeros(len(PATTERNS) + 1, numel, dtype=torch.float64)  # patterns, then g
    u[-1] = window.gradient
    model.train()
    for mb, n_i in zip(window.microbatches, local_n, strict=True):
        model.zero_grad(set_to_none=True)
        mb.rng.restore()
        batch = prepared(mb.inputs, device)
        loss_sum = objective.loss_sum(_reference_forward(model, batch), batch)
        loss_sum.backward()
        g_i = flat_gradient(model)
        u[0] += g_i
        if n_r:
            u[1] += g_i / n_r
        if pre_r:
            u[2] += g_i / pre_r
        if n_i:
            u[3] += g_i / n_i
    model.zero_grad(set_to_none=True)
    g_local = u[-1].clone()
    u = _sum_across_ranks(u)
    g = u[-1] / world  # the ranks' mean: equal to each rank's gradient after a sync
    spread_local = torch.tensor([float((g_local - g).norm() / g.norm()) if g.norm() > 0 else 0.0])
    spread = float(_max_across_ranks(spread_local))

    reference = u[0] / total if total else torch.zeros_like(g)
    ref_sq = float(reference.dot(reference))
    scale = float(g.dot(reference)) / ref_sq if ref_sq > 0 else math.nan
    error = float((g - reference).norm()) / math.sqrt(ref_sq) if ref_sq > 0 else math.nan
    fits = {}
    g_norm = float(g.norm())
    for k, name in enumerate(PATTERNS):
        v = u[k]
        vv = float(v.dot(v))
        if vv == 0 or g_norm == 0:
            continue
        c = float(g.dot(v)) / vv
        fits[name] = PatternFit(c, float((g - c * v).norm()) / g_norm)
    nib = window.microbatches[0].num_items_in_batch if window.microbatches else None
    own_count = float(nib.float().reshape(-1)[0]) if isinstance(nib, Tensor) else (
        float(nib) if nib is not None else None
    )
    rank_trainer_counts = _all_gather_objects(own_count)
    return WindowMeasure(
        scale=scale,
        relative_error=error,
        targets=total,
        counted=sum(rank_counted),
        rank_targets=rank_targets,
        rank_counted=rank_counted,
        microbatch_targets=per_rank_n,
        microbatches=len(batches),
        ranks=world,
        trainer_count=rank_trainer_counts[0],
        rank_trainer_counts=rank_trainer_counts,
        unit=getattr(objective, "unit", "unit"),
        rank_spread=spread,
        fits=fits,
    )


def _max_across_ranks(t: Tensor) -> Tensor:
    if _world()[1] > 1:
        if dist.get_backend() == "nccl":
            t = t.cuda()
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            return t.cpu()
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t


def same_on_every_rank(values: Sequence[int]) -> bool:
    """True when every entry of ``values`` is equal (e.g. every rank's target count)."""
    return len(set(values)) <= 1


__all__ = [
    "IGNORE_INDEX",
    "PATTERNS",
    "PatternFit",
    "WindowMeasure",
    "intended_objective",
    "is_causal_lm",
    "measure_window",
    "pre_shift_count",
    "same_on_every_rank",
]
