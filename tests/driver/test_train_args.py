"""train(): every argument checked before any data is read, the plan's microbatch size
enforced, training mode, and what the ledger reports."""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator, Mapping
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers.batches import token_batch
from helpers.gradients import params
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

import accumlab as al
from accumlab.distributed import launch
from accumlab_course.data import VOCAB_SIZE
from accumlab_course.models import TinyGPT


def counted(batches: list[Mapping[str, Tensor]], read: list[int]) -> Iterator[Mapping[str, Tensor]]:
    """Yield ``batches``, appending each index to ``read`` as it is taken."""
    for i, batch in enumerate(batches):
        read.append(i)
        yield batch


def sgd(model: nn.Module, lr: float = 0.1) -> torch.optim.SGD:
    return torch.optim.SGD(model.parameters(), lr=lr)


class NoStep:
    """An object without ``step``: not a scheduler."""


class HalfObjective:
    """Has ``count`` but no ``loss_sum``."""

    unit = "target"

    def count(self, batch: Mapping[str, Tensor]) -> int:
        return 1


# ------------------------------------------------------------------- item 11


BAD_ARGUMENTS = [
    ({"clip_grad_norm": "1"}, TypeError, "clip_grad_norm must be a number"),
    ({"clip_grad_norm": True}, TypeError, "clip_grad_norm must be a number"),
    ({"clip_grad_norm": 0.0}, ValueError, "clip_grad_norm must be positive"),
    ({"clip_grad_norm": math.nan}, ValueError, "clip_grad_norm must be positive"),
    ({"clip_grad_norm": math.inf}, ValueError, "clip_grad_norm must be positive and finite"),
    ({"max_updates": 1.5}, TypeError, "max_updates must be an int"),
    ({"max_updates": True}, TypeError, "max_updates must be an int"),
    ({"max_updates": 0}, ValueError, "max_updates must be at least 1"),
    ({"nonfinite": "ignore"}, ValueError, "nonfinite must be 'skip' or 'raise'"),
    ({"scheduler_per": "microbatch"}, ValueError, "scheduler_per must be 'applied' or 'attempt'"),
    ({"scheduler": NoStep()}, TypeError, "scheduler must have a step"),
    ({"objective": object()}, TypeError, "objective must have count.*and loss_sum"),
    ({"objective": HalfObjective()}, TypeError, "objective must have count.*and loss_sum"),
    ({"optimizer": "sgd"}, TypeError, "optimizer must be a torch.optim.Optimizer"),
    ({"on_update": 3}, TypeError, "on_update must be callable or None"),
    ({"forward": "model"}, TypeError, "forward must be callable or None"),
    ({"progress": "yes"}, TypeError, "progress must be True or False"),
    ({"on_oom": "retry"}, ValueError, "on_oom must be 'raise' or 'shrink'"),
    ({"model": "gpt"}, TypeError, "model must be a torch.nn.Module"),
]


@pytest.mark.parametrize(("kwargs", "error", "match"), BAD_ARGUMENTS)
def test_every_bad_argument_is_rejected_before_the_first_microbatch_is_read(
    toy64: nn.Module, kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    read: list[int] = []
    batches = [token_batch([(4, 0)], seed=s) for s in range(4)]
    arguments: dict[str, Any] = {
        "model": toy64,
        "optimizer": sgd(toy64),
        "objective": al.NextTokenLoss(),
        **kwargs,
    }
    model, optimizer, objective = (arguments.pop(k) for k in ("model", "optimizer", "objective"))
    with pytest.raises(error, match=match):
        al.train(
            model,
            counted(batches, read),
            optimizer,
            al.AccumulationPlan(1, 2),
            objective,
            **{"progress": False, **arguments},
        )
    assert read == []  # nothing was taken from the generator


def test_a_single_batch_instead_of_an_iterable_of_microbatches_is_rejected(
    toy64: nn.Module,
) -> None:
    # Iterating a mapping yields its keys; train would fail deep inside instead.
    with pytest.raises(TypeError, match="batches must be an iterable of microbatches"):
        al.train(
            toy64, token_batch([(4, 0)]), sgd(toy64), al.AccumulationPlan(1, 1),
            al.NextTokenLoss(), progress=False,
        )


@pytest.mark.parametrize("optimizer", ["SGD", "AdamW"])
def test_a_learning_rate_the_float32_weights_cannot_hold_is_named_before_any_data(optimizer: str) -> None:
    """``lr=1e300`` is a finite Python float but overflows float32: the update could not
    even be computed. ``train`` names the hyper-parameter before it reads data, where a
    float64 model takes the same value."""
    torch.manual_seed(0)
    model = TinyGPT(VOCAB_SIZE, block_size=8, n_layer=1, n_head=2, n_embd=8)
    read: list[int] = []
    batches = [token_batch([(6, 0)] * 2, seed=s) for s in range(2)]
    build = getattr(torch.optim, optimizer)
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['lr'\] is 1e\+300, more than torch.float32"):
        al.train(model, counted(batches, read), build(model.parameters(), lr=1e300),
                 al.AccumulationPlan(2, 1), al.NextTokenLoss(), progress=False)
    assert read == []
    model64 = TinyGPT(VOCAB_SIZE, block_size=8, n_layer=1, n_head=2, n_embd=8).double()
    ledger = al.train(model64, batches, torch.optim.SGD(model64.parameters(), lr=1e300),
                      al.AccumulationPlan(2, 1), al.NextTokenLoss(), progress=False)
    assert ledger.update_attempts == 2


def test_valid_numbers_of_every_kind_are_accepted(toy64: nn.Module) -> None:
    batches = [token_batch([(4, 0)], seed=s) for s in range(4)]
    ledger = al.train(
        toy64, batches, sgd(toy64), al.AccumulationPlan(1, 2), al.NextTokenLoss(),
        clip_grad_norm=1, max_updates=5, progress=False,
    )
    assert ledger.updates_applied == 2


# ------------------------------------------------------------------- item 12


def test_a_microbatch_larger_than_the_plan_is_an_error_naming_both_sizes(
    toy64: nn.Module,
) -> None:
    before = params(toy64)
    batches = [token_batch([(4, 0)] * 16, seed=s) for s in range(2)]
    with pytest.raises(ValueError, match=r"16 examples.*micro_batch_size=4"):
        al.train(
            toy64, batches, sgd(toy64), al.AccumulationPlan(4, 2), al.NextTokenLoss(),
            progress=False,
        )
    after = params(toy64)
    assert all(torch.equal(before[k], after[k]) for k in before)  # the window was not trained


def test_the_ledger_keeps_the_largest_microbatch_it_saw(toy64: nn.Module) -> None:
    sizes = [3, 1, 4, 2, 4]
    batches = [token_batch([(5, 1)] * n, seed=i) for i, n in enumerate(sizes)]
    ledger = al.train(
        toy64, batches, sgd(toy64), al.AccumulationPlan(4, 2, last_window="drop"),
        al.NextTokenLoss(), progress=False,
    )
    assert ledger.largest_microbatch == 4
    assert al.Ledger().largest_microbatch == 0


# ------------------------------------------------------------------- item 13


def test_train_puts_a_model_left_in_eval_mode_into_training_mode() -> None:
    torch.manual_seed(0)
    model = TinyGPT(VOCAB_SIZE, block_size=16, n_layer=1, n_head=2, n_embd=16, dropout=0.5)
    model.eval()
    seen: list[bool] = []

    def forward(m: nn.Module, batch: Mapping[str, Tensor]) -> Any:
        seen.append(all(module.training for module in m.modules()))
        return m(input_ids=batch["input_ids"])

    batch = token_batch([(8, 0), (6, 2)], vocab=VOCAB_SIZE)
    al.train(
        model, [batch], sgd(model), al.AccumulationPlan(2, 1), al.NextTokenLoss(),
        forward=forward, progress=False,
    )
    assert seen == [True]  # dropout was on in the forward pass
    assert model.training


# ------------------------------------------------------------------- item 6


def test_scheduler_per_attempt_also_steps_on_a_window_without_targets(toy64: nn.Module) -> None:
    empty = token_batch([(4, 4)])  # every label is prompt: no targets
    batches = [token_batch([(4, 0)], seed=1), empty, token_batch([(4, 0)], seed=2)]
    for per, expected in (("attempt", 3), ("applied", 2)):
        model = copy.deepcopy(toy64)
        optimizer = sgd(model, lr=1.0)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda u: 1.0 / (u + 1))
        ledger = al.train(
            model, batches, optimizer, al.AccumulationPlan(1, 1), al.NextTokenLoss(),
            scheduler=scheduler, scheduler_per=per, progress=False,  # type: ignore[arg-type]
        )
        assert [r.skipped_reason for r in ledger.reports] == [None, "no targets", None]
        assert scheduler.last_epoch == expected, per


# ------------------------------------------------------------ items 7 and 13, two ranks


class _Recorder:
    """Stands in for tqdm: records the options the progress bar was made with."""

    made: list[dict[str, Any]] = []

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        _Recorder.made.append(kwargs)

    def __enter__(self) -> _Recorder:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def update(self, n: int = 1) -> None:
        pass

    def set_postfix(self, **kwargs: Any) -> None:
        pass


def padding_after_shrink_worker() -> dict[str, Any]:
    """Rank 0 has 3 microbatches of 2, rank 1 has 4: in window 1 rank 0 pads one
    microbatch. Rank 0 runs out of memory in window 0, so both ranks halve every
    microbatch; rank 0's padding microbatch of window 1 becomes two."""
    import tqdm.auto

    rank = dist.get_rank()
    g = torch.Generator().manual_seed(rank)
    count = (3, 4)[rank]
    ids = torch.randint(2, VOCAB_SIZE, (2 * count, 6), generator=g)
    examples = {
        "input_ids": ids,
        "labels": ids.clone(),
        "example_ids": torch.arange(2 * count) + 100 * rank,
    }
    torch.manual_seed(0)
    model = TinyGPT(VOCAB_SIZE, block_size=8, n_layer=1, n_head=2, n_embd=8)
    ddp = DistributedDataParallel(model)

    def forward(m: nn.Module, batch: Mapping[str, Tensor]) -> Any:
        if rank == 0 and batch["input_ids"].shape[0] > 1:
            raise torch.OutOfMemoryError("simulated: two examples do not fit on rank 0")
        return m(input_ids=batch["input_ids"])

    tqdm.auto.tqdm = _Recorder  # type: ignore[misc,assignment]
    ledger = al.train(
        ddp,
        al.split_batch(examples, [2] * count),
        torch.optim.SGD(ddp.parameters(), lr=0.1),
        al.AccumulationPlan(2, 2, data_parallel_size=2),
        al.NextTokenLoss(),
        forward=forward,
        on_oom="shrink",
        progress=True,
    )
    return {
        "padding": [r.padding_microbatches for r in ledger.reports],
        "microbatches": [r.backward_passes for r in ledger.reports],
        "ledger_padding": ledger.padding_microbatches,
        "shrinks": len(ledger.shrinks),
        "bar": _Recorder.made,
    }


@pytest.mark.distributed
def test_padding_after_an_oom_shrink_counts_the_halved_padding_and_only_rank_0_shows_a_bar(
) -> None:
    rank0, rank1 = launch(padding_after_shrink_worker, 2, timeout_s=30, deadline_s=180)
    assert rank0["shrinks"] == rank1["shrinks"] == 1
    assert rank0["microbatches"] == rank1["microbatches"] == [4, 4]
    # Rank 0's one padding microbatch of window 1 was cut into two padding halves.
    assert rank0["padding"] == [0, 2] and rank0["ledger_padding"] == 2
    assert rank1["padding"] == [0, 0] and rank1["ledger_padding"] == 0
    assert [bar.get("disable", False) for bar in rank0["bar"]] == [False]
    assert [bar.get("disable", False) for bar in rank1["bar"]] == [True]


def test_train_settings_are_trains_keyword_arguments_with_its_defaults() -> None:
    """``TrainSettings`` is built from ``train``'s keywords, so the two lists are one: the
    same names, in the same order, with the same defaults."""
    import dataclasses
    import inspect

    from accumlab.settings import TrainSettings

    keywords = [
        (p.name, p.default)
        for p in inspect.signature(al.train).parameters.values()
        if p.kind is inspect.Parameter.KEYWORD_ONLY
    ]
    fields = [(f.name, f.default) for f in dataclasses.fields(TrainSettings)]
    assert keywords == fields
