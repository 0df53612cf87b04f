"""Kept references: tensors a window created that are still alive after the last window
(after ``gc.collect()``), the sign of a loop whose memory grows window after window."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor
from torch.utils._pytree import tree_leaves

from .report import WindowAudit
from .trace import UpdateTrace


def kept_references(
    trace: UpdateTrace, optimizer: torch.optim.Optimizer, audits: Sequence[WindowAudit]
) -> tuple[list[int], str | None]:
    """The windows that left tensors alive, and the evidence (None when none leaked).

    Sets each ``audits[k].kept_tensors``. The parameters, their gradients, the optimizer's
    state and detached scalars (a logged loss value) do not count. The first window may
    make what lives on once (a cache, a scaler's state); a leak leaves tensors behind
    window after window, so it is named only when a middle window left some too.
    """
    owned = {id(p) for p in trace.params} | {id(p.grad) for p in trace.params if p.grad is not None}
    owned |= {id(t) for t in tree_leaves(list(optimizer.state.values())) if isinstance(t, Tensor)}
    graph, nbytes, storages, earlier = 0, 0, set(), []
    last = len(trace.created) - 1
    for k, mode in enumerate(trace.created):
        alive = {}
        for ref in mode.refs:
            t = ref()
            if t is None or id(t) in owned or (t.dim() == 0 and t.grad_fn is None):
                continue  # a detached scalar (a logged loss value) holds no activations
            alive[id(t)] = t
        audits[k].kept_tensors = len(alive)
        if k < last and alive:
            earlier.append(k)
            for t in alive.values():
                graph += t.grad_fn is not None
                key = t.untyped_storage().data_ptr()
                if key not in storages:
                    storages.add(key)
                    nbytes += t.untyped_storage().nbytes()
    if not any(0 < k < last for k in earlier):
        return [], None
    left = ", ".join(str(w.kept_tensors) for w in audits)
    total = sum(audits[k].kept_tensors for k in earlier)
    return earlier, (
        f"{total} tensors created in earlier windows were still alive after the last "
        f"window and gc.collect() ({graph} attached to an autograd graph, {nbytes} bytes "
        f"of storage); tensors left alive per window: {left}"
    )
