"""Out-of-memory recovery that keeps every example: shrink the microbatch, retry the window.

When a window runs out of memory, ``train_window_shrinking`` discards the partial
gradients, cuts every microbatch of the window in half and retries the *same* examples:
the window's unit count (the denominator) does not change, so neither does the gradient
nor the number of updates. Only the number of backward passes grows. ``train(...,
on_oom="shrink")`` uses it; the smaller size is kept for later windows.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from . import distributed
from .ledger import Ledger, UpdateReport
from .memory import CannotShrinkError, OOMGuard, PeerOutOfMemory


def _rows(batch: Mapping[str, Any]) -> int:
    labels = batch["labels"]
    return int(labels.shape[0]) if labels.dim() else 0


def _halve(batch: Mapping[str, Any], keep_empty: bool) -> list[dict[str, Any]]:
    """Cut a microbatch into its first ``ceil(n/2)`` and last ``floor(n/2)`` examples.

    Every tensor whose first dimension is the batch size is cut; anything else is shared.
    An empty half is dropped unless ``keep_empty`` (data parallelism: every rank must run
    the same number of microbatches, and a zero-row microbatch adds nothing).
    """
    n = _rows(batch)
    cut = (n + 1) // 2
    halves = []
    for start, stop in ((0, cut), (cut, n)):
        if stop > start or keep_empty:
            halves.append(
                {
                    k: v[start:stop] if isinstance(v, Tensor) and v.dim() and v.shape[0] == n else v
                    for k, v in batch.items()
                }
            )
    return halves or [dict(batch)]


class PartialUpdateError(torch.OutOfMemoryError):
    """Out of memory inside ``optimizer.step()``: the update was partly applied.

    Optimizers update parameter by parameter (or group by group), so some weights and
    their optimizer state already hold the new values while others do not. Neither a
    retry (it would step the first ones twice) nor going on is sound: restore the last
    checkpoint. A ``torch.OutOfMemoryError``, so code that catches those catches it too.
    """


def train_window_shrinking(
    attempt: Callable[[list[Any], Any], UpdateReport],
    microbatches: Sequence[Mapping[str, Any]],
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    meter: Any,
    ledger: Ledger,
    halvings: int,
) -> tuple[UpdateReport, int]:
    """One window under ``on_oom="shrink"``: returns its report and the halvings in force.

    The window's microbatches are first cut in half ``halvings`` times (what earlier
    windows learned). When an attempt raises ``torch.OutOfMemoryError``, the partial
    gradients are discarded, what the attempt held is released, every microbatch is cut
    in half again and the *same* window is retried: the same examples, the same global
    count (denominator), so the same gradient and one update as before. Each shrink is
    appended to ``ledger.shrinks``. Under data parallelism the replicas agree on every
    failure (``OOMGuard``), so all of them retry together.

    Raises ``CannotShrinkError`` when the failed attempt already ran one example per
    microbatch, when the update itself ran out of memory (a smaller microbatch cannot
    help either), or where the replicas cannot meet to agree (``OOMGuard.can_agree``:
    inside DDP's gradient-synchronizing backward pass, or under FSDP2).
    """
    keep_empty = distributed.replicas_of(model) > 1
    pieces = list(microbatches)
    for _ in range(halvings):
        pieces = [half for mb in pieces for half in _halve(mb, keep_empty)]
    while True:
        guard = OOMGuard(meter, model, len(pieces))
        biggest = max(_rows(p) for p in pieces)
        problem = "this replica ran out of memory"
        try:
            report = attempt(pieces, guard)
        except PeerOutOfMemory as peer:
            fatal = peer.fatal
            problem = "another data-parallel replica ran out of memory"
        except torch.OutOfMemoryError as exc:
            where = guard.where
            if not guard.can_agree():
                raise CannotShrinkError(
                    f"window {ledger.update_attempts}: out of memory where the replicas "
                    f"cannot retry together ({where}: inside the gradient-synchronizing "
                    "backward pass, or under FSDP2, whose passes run collectives); start "
                    f"with a smaller micro_batch_size. The error was: {exc}"
                ) from exc
            in_update = where is not None and where[0] == "update"
            _, fatal = guard.agree(True, in_update or biggest <= 1)
            if isinstance(exc, PartialUpdateError):
                raise CannotShrinkError(str(exc)) from exc
            if in_update:
                raise CannotShrinkError(
                    f"window {ledger.update_attempts}: the update itself ran out of memory "
                    "(weights + gradients + optimizer state); a smaller microbatch cannot "
                    "help. Use a lighter optimizer, shard the state (FSDP2) or offload it"
                ) from exc
            if biggest <= 1:
                raise CannotShrinkError(
                    f"window {ledger.update_attempts}: a microbatch of one example still "
                    "does not fit in memory, so gradient accumulation cannot help: it splits "
                    "examples between backward passes, never one example. Use activation "
                    "checkpointing (e.g. TinyGPT(checkpoint=True) or torch.utils.checkpoint) "
                    f"or a shorter sequence. The error was: {exc}"
                ) from exc
        else:
            oom, _ = guard.agree(False, False)
            if not oom:
                report.padding_microbatches = sum(distributed.is_padding(p) for p in pieces)
                return report, halvings
            # A peer failed after this replica's last agreement point, so this replica has
            # already stepped: retrying would apply the window twice here.
            fatal = True
            problem = "another data-parallel replica ran out of memory after its backward passes"
        del guard  # drop the failed attempt's references before collecting
        _release_attempt(model, optimizer)
        if fatal:
            raise CannotShrinkError(
                f"window {ledger.update_attempts}: {problem}, and shrinking cannot help there "
                "(one example per microbatch, or the update itself); see that rank's error"
            )
        pieces = [half for mb in pieces for half in _halve(mb, keep_empty)]
        halvings += 1
        ledger.shrinks.append(
            {
                "update": ledger.update_attempts,
                "old_micro_batch_size": biggest,
                "new_micro_batch_size": max(_rows(p) for p in pieces),
                "microbatches": len(pieces),
            }
        )


def _release_attempt(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Free what a failed attempt held: partial gradients, unreachable graphs, cached blocks."""
    optimizer.zero_grad(set_to_none=True)
    model.zero_grad(set_to_none=True)  # parameters the optimizer does not hold
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
