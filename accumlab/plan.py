"""The accumulation plan: how many examples go into one forward pass, one window, one update.

Units (see the course's notebook 00): a *microbatch* is the ``m`` examples of one forward
pass on one replica; a *window* is the ``A`` microbatches whose gradients feed one update;
``D`` data-parallel replicas each run their own window. The *effective batch* is
``m × A × D`` examples per update when every microbatch is full.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

from .validate import check_choice, check_positive_int

LastWindow = Literal["update", "drop"]
#: What happens to a short last window: an update from it, or it is dropped and counted.
LAST_WINDOW = ("update", "drop")


@dataclass(frozen=True)
class Window:
    """The microbatches of one accumulation window, in order.

    ``complete`` is False for a short last window (fewer than ``accumulation_steps``
    microbatches). ``index`` counts windows from 0 in the order they were produced,
    dropped ones included.
    """

    microbatches: list[Any]
    index: int
    complete: bool

    def __len__(self) -> int:
        return len(self.microbatches)

    def __iter__(self) -> Iterator[Any]:
        return iter(self.microbatches)

    def __getitem__(self, i: int) -> Any:
        return self.microbatches[i]


@dataclass(frozen=True)
class AccumulationPlan:
    """Sizes of one update: ``micro_batch_size`` (m) examples per forward pass,
    ``accumulation_steps`` (A) microbatches per window, ``data_parallel_size`` (D) replicas.

    ``last_window`` says what happens to a short last window (fewer than A microbatches):
    ``"update"`` makes an update from it, normalised by its own (smaller) target count;
    ``"drop"`` skips it, and the ledger counts its examples and targets as dropped.
    """

    micro_batch_size: int
    accumulation_steps: int
    data_parallel_size: int = 1
    last_window: LastWindow = "update"

    def __post_init__(self) -> None:
        check_positive_int("micro_batch_size", self.micro_batch_size)
        check_positive_int("accumulation_steps", self.accumulation_steps)
        check_positive_int("data_parallel_size", self.data_parallel_size)
        check_choice("last_window", self.last_window, LAST_WINDOW)

    @property
    def effective_batch_size(self) -> int:
        """Examples per update across all replicas when every microbatch is full: m × A × D."""
        return self.micro_batch_size * self.accumulation_steps * self.data_parallel_size

    @classmethod
    def from_effective_batch(
        cls,
        effective_batch_size: int,
        micro_batch_size: int,
        data_parallel_size: int = 1,
        last_window: LastWindow = "update",
    ) -> AccumulationPlan:
        """The plan with ``A = effective / (m × D)``; a ``ValueError`` when it does not divide."""
        check_positive_int("effective_batch_size", effective_batch_size)
        check_positive_int("micro_batch_size", micro_batch_size)
        check_positive_int("data_parallel_size", data_parallel_size)
        per_window = micro_batch_size * data_parallel_size
        steps, remainder = divmod(effective_batch_size, per_window)
        if remainder or steps == 0:
            lower = max(steps, 1) * per_window
            raise ValueError(
                f"effective_batch_size={effective_batch_size} is not a multiple of "
                f"micro_batch_size × data_parallel_size = {micro_batch_size} × "
                f"{data_parallel_size} = {per_window}; choose an effective batch such as "
                f"{lower} or {lower + per_window}, or a micro_batch_size that divides it"
            )
        return cls(micro_batch_size, steps, data_parallel_size, last_window)

    def shrink(self) -> AccumulationPlan:
        """Half the microbatch, twice the steps: the same effective batch with less memory.

        Raises ``ValueError`` at ``micro_batch_size == 1`` (nothing left to halve) and when
        the microbatch is odd (halving would change the effective batch).
        """
        m = self.micro_batch_size
        if m == 1:
            raise ValueError(
                "cannot shrink a plan whose micro_batch_size is already 1: accumulation "
                "cannot make a single example fit; use activation checkpointing or a "
                "shorter sequence"
            )
        if m % 2:
            raise ValueError(
                f"cannot halve an odd micro_batch_size={m} without changing the effective "
                "batch; pick an even or power-of-two micro_batch_size"
            )
        return replace(self, micro_batch_size=m // 2, accumulation_steps=self.accumulation_steps * 2)

    def windows(self, batches: Iterable[Any]) -> Iterator[Window]:
        """Group an iterable of microbatches into windows of ``accumulation_steps``.

        Every microbatch lands in exactly one window. The last window may be short; it is
        yielded either way, marked ``complete=False``, and the caller applies
        ``last_window`` (``train`` updates from it or records it as dropped), so no
        example is silently lost. Microbatches are not re-split: their own sizes are used.
        """
        pending: list[Any] = []
        index = 0
        for batch in batches:
            pending.append(batch)
            if len(pending) == self.accumulation_steps:
                yield Window(pending, index, complete=True)
                pending = []
                index += 1
        if pending:
            yield Window(pending, index, complete=False)

    def to_dict(self) -> dict[str, Any]:
        """The plan as plain JSON-ready values (used by ``RunRecord``)."""
        return {
            "micro_batch_size": self.micro_batch_size,
            "accumulation_steps": self.accumulation_steps,
            "data_parallel_size": self.data_parallel_size,
            "effective_batch_size": self.effective_batch_size,
            "last_window": self.last_window,
        }


def data_parallel_size(
    world_size: int, *, tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1
) -> int:
    """``D``, the data-parallel replicas among ``world_size`` processes (GPUs).

    Processes that hold parts of one model copy, through tensor parallelism (a layer split
    over ``tensor_parallel_size`` GPUs) or pipeline parallelism (the layers split over
    ``pipeline_parallel_size`` stages), see the same examples, so they are not extra
    replicas: ``D = world_size / (tensor_parallel_size × pipeline_parallel_size)``. For
    plain DDP or FSDP2, ``D`` is the world size. Raises ``ValueError`` when the sizes do
    not divide the world.
    """
    check_positive_int("world_size", world_size)
    check_positive_int("tensor_parallel_size", tensor_parallel_size)
    check_positive_int("pipeline_parallel_size", pipeline_parallel_size)
    per_replica = tensor_parallel_size * pipeline_parallel_size
    replicas, remainder = divmod(world_size, per_replica)
    if remainder or replicas == 0:
        raise ValueError(
            f"world_size={world_size} is not a multiple of tensor_parallel_size × "
            f"pipeline_parallel_size = {tensor_parallel_size} × {pipeline_parallel_size} = "
            f"{per_replica}: every model copy needs all of its {per_replica} processes"
        )
    return replicas


def describe(plan: AccumulationPlan | Mapping[str, int]) -> str:
    """One line a reader can check: ``m × A × D = effective``."""
    if isinstance(plan, Mapping):
        plan = AccumulationPlan(**plan)  # type: ignore[arg-type]
    return (
        f"{_count(plan.micro_batch_size, 'example')}/microbatch × "
        f"{_count(plan.accumulation_steps, 'microbatch', 'microbatches')}/window × "
        f"{_count(plan.data_parallel_size, 'replica')} = {plan.effective_batch_size} examples/update"
    )


def _count(n: int, singular: str, plural: str | None = None) -> str:
    return f"{n} {singular if n == 1 else plural or singular + 's'}"
