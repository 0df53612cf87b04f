"""Out-of-memory recovery that keeps every example: shrink the microbatch, retry the window.

When a window runs out of memory, ``train_window_shrinking`` discards the partial
gradients, cuts every microbatch of the window in half and retries the *same* examples:
the window's unit count (the denominator) does not change, so neither does the gradient
nor the number of updates. Only the number of backward passes grows. ``train(...,
on_oom="shrink")`` uses it; the smaller size is kept for later windows.

Under data parallelism the replicas must retry together: :class:`OOMGuard` makes them
agree (one small all-reduce) before every point where one of them could otherwise wait
alone in a collective, and after the window. It rides on the loop's ``meter`` argument
(its ``phase`` calls mark where the window is), wrapping the caller's meter, if any.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .distributed.alignment import is_padding
from .ledger import Ledger
from .loop import PartialUpdateError, WindowSetup, train_window
from .objectives import Objective, rows, take_rows
from .parallel import Replicas
from .report import UpdateReport


def _halve(batch: Mapping[str, Any], keep_empty: bool) -> list[dict[str, Any]]:
    """Cut a microbatch into its first ``ceil(n/2)`` and last ``floor(n/2)`` examples.

    Every tensor whose first dimension is the batch size is cut; anything else is shared.
    An empty half is dropped unless ``keep_empty`` (data parallelism: every rank must run
    the same number of microbatches, and a zero-row microbatch adds nothing).
    """
    n = rows(batch)
    cut = (n + 1) // 2
    halves = [take_rows(batch, a, b) for a, b in ((0, cut), (cut, n)) if b > a or keep_empty]
    return halves or [dict(batch)]


class CannotShrinkError(torch.OutOfMemoryError):
    """An out-of-memory error that a smaller microbatch cannot fix (raised by
    ``train(..., on_oom="shrink")``): one example does not fit, or the update itself
    (weights, gradients and optimizer state) does not."""


class PeerOutOfMemory(torch.OutOfMemoryError):
    """Raised on a replica whose peer ran out of memory, so that all replicas retry together."""

    def __init__(self, fatal: bool) -> None:
        super().__init__("another data-parallel replica ran out of memory in this window")
        self.fatal = fatal


def train_window_shrinking(
    model: nn.Module,
    window: Sequence[Mapping[str, Any]],
    optimizer: torch.optim.Optimizer,
    objective: Objective,
    ledger: Ledger,
    *,
    setup: WindowSetup,
    meter: Any = None,
    **options: Any,
) -> UpdateReport:
    """``train_window`` under ``on_oom="shrink"``: the window's report. ``setup`` is the
    run's (``loop.window_setup``), ``options`` are ``train_window``'s other keyword
    arguments (``scheduler``, ``forward``); the window's index is
    ``ledger.update_attempts``.

    The window's microbatches are first cut in half once for every shrink in
    ``ledger.shrinks`` (what earlier windows learned). When an attempt raises ``torch.OutOfMemoryError``, the partial
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
    keep_empty = setup.replicas.size > 1
    pieces = list(window)
    for _ in ledger.shrinks:
        pieces = [half for mb in pieces for half in _halve(mb, keep_empty)]
    while True:
        guard = OOMGuard(meter, setup.replicas, len(pieces))
        biggest = max(rows(p) for p in pieces)
        problem = "this replica ran out of memory"
        try:
            report = train_window(
                model,
                pieces,
                optimizer,
                objective,
                meter=guard,
                index=ledger.update_attempts,
                setup=setup,
                **options,
            )
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
                report.padding_microbatches = sum(is_padding(p) for p in pieces)
                return report
            # A peer failed after this replica's last agreement point, so this replica has
            # already stepped: retrying would apply the window twice here.
            fatal = True
            problem = "another data-parallel replica ran out of memory after its backward passes"
        del guard  # drop the failed attempt's references before collecting
        _release_attempt()
        if fatal:
            raise CannotShrinkError(
                f"window {ledger.update_attempts}: {problem}, and shrinking cannot help there "
                "(one example per microbatch, or the update itself); see that rank's error"
            )
        pieces = [half for mb in pieces for half in _halve(mb, keep_empty)]
        ledger.shrinks.append(
            {
                "update": ledger.update_attempts,
                "old_micro_batch_size": biggest,
                "new_micro_batch_size": max(rows(p) for p in pieces),
                "microbatches": len(pieces),
            }
        )


def _release_attempt() -> None:
    """Free what a failed attempt held: unreachable graphs and the allocator's cached blocks
    (``train_window`` cleared every gradient on its way out)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class OOMGuard:
    """Wraps a meter for one update attempt under ``on_oom="shrink"``.

    It remembers the phase each out-of-memory error came from (an error in the update
    cannot be fixed by a smaller microbatch), and under DDP (``D > 1``) it makes the
    replicas agree before every point where they would otherwise part ways: the last
    microbatch's backward pass (DDP all-reduces gradients there), the last forward pass,
    and every forward pass when DDP may broadcast the module's buffers there
    (``Replicas.forward_collective``: ``broadcast_buffers`` and some buffers). A replica
    that ran out of memory calls :meth:`agree` with ``oom=True`` instead of reaching its
    next agreement point; the others meet it there, see the flag and stop with
    ``PeerOutOfMemory``. Every replica then retries the window with the same plan, and no
    rank waits on a collective the others skipped.

    Every agreement runs on the replicas' group (``parallel.Replicas``: the model's
    data-parallel group, as every collective of the loop). Cost: two or ``A + 1`` small
    all-reduces per window (none when ``D == 1``). Limits, where
    :meth:`can_agree` is False and ``train`` raises instead: an error inside the last,
    gradient-synchronizing backward pass (the peers' all-reduce is already under way), and
    any error under FSDP2, whose forward and backward passes gather and scatter the
    parameters as they go.
    """

    def __init__(self, inner: Any, replicas: Replicas, microbatches: int) -> None:
        self.inner = inner
        self.replicas = replicas
        self.ddp = replicas.wrapper == "ddp"
        self.every_forward = self.ddp and replicas.forward_collective  # buffer broadcasts
        self.last = microbatches - 1
        self.where: tuple[str, int | None] | None = None
        self.completed: set[tuple[str, int | None]] = set()

    def _agrees_at(self, name: str, microbatch: int | None) -> bool:
        if not self.ddp or self.replicas.size == 1 or name not in ("forward", "backward"):
            return False
        return microbatch == self.last or (name == "forward" and self.every_forward)

    @contextlib.contextmanager
    def phase(self, name: str, microbatch: int | None = None) -> Iterator[Any]:
        """The inner meter's phase, preceded by an agreement where the replicas could part."""
        if self._agrees_at(name, microbatch):
            oom, fatal = self.agree(False, False)
            if oom:
                raise PeerOutOfMemory(fatal)
        self.where = (name, microbatch)
        inner = self.inner.phase(name, microbatch) if self.inner is not None else _null()
        with inner as record:
            yield record
        self.completed.add((name, microbatch))

    def agree(self, oom: bool, fatal: bool) -> tuple[bool, bool]:
        """``(any replica ran out of memory, any replica cannot be helped by shrinking)``;
        one all-reduce (MAX) when ``D > 1``, the local flags otherwise."""
        replicas = self.replicas
        if replicas.size == 1:
            return oom, fatal
        flags = torch.tensor([int(oom), int(fatal)], dtype=torch.int64, device=replicas.device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=replicas.group)
        return bool(flags[0].item()), bool(flags[1].item())

    def can_agree(self) -> bool:
        """False when the replicas cannot meet at an agreement point after this error:
        under FSDP2, or inside the last (gradient-synchronizing) backward pass of a DDP
        window, whose all-reduce is already in flight on the other replicas."""
        if self.replicas.size == 1:
            return True
        if not self.ddp:
            return False
        in_sync_backward = (
            self.where == ("backward", self.last)
            and ("backward", self.last) not in self.completed
        )
        return not in_sync_backward


@contextlib.contextmanager
def _null() -> Iterator[None]:
    yield None
