"""AccumulationPlan: sizes, windows, shrink, and the errors for bad sizes."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from accumlab import AccumulationPlan, Window
from accumlab.plan import describe


def test_effective_batch_is_m_times_a_times_d() -> None:
    plan = AccumulationPlan(micro_batch_size=2, accumulation_steps=8, data_parallel_size=2)
    assert plan.effective_batch_size == 32
    assert AccumulationPlan(3, 5).effective_batch_size == 15
    assert describe(plan).endswith("= 32 examples/update")


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"micro_batch_size": 0, "accumulation_steps": 1}, "micro_batch_size"),
        ({"micro_batch_size": -4, "accumulation_steps": 1}, "micro_batch_size"),
        ({"micro_batch_size": 2, "accumulation_steps": 0}, "accumulation_steps"),
        (
            {"micro_batch_size": 2, "accumulation_steps": 3, "data_parallel_size": 0},
            "data_parallel_size",
        ),
    ],
)
def test_non_positive_sizes_raise_value_error_naming_the_argument(kwargs: dict, name: str) -> None:
    with pytest.raises(ValueError, match=rf"{name} must be at least 1"):
        AccumulationPlan(**kwargs)


@pytest.mark.parametrize("bad", [2.0, "2", True, None])
def test_non_int_sizes_raise_type_error(bad: object) -> None:
    with pytest.raises(TypeError, match="micro_batch_size must be an int"):
        AccumulationPlan(bad, 2)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="accumulation_steps must be an int"):
        AccumulationPlan(2, bad)  # type: ignore[arg-type]


def test_unknown_last_window_policy_raises() -> None:
    with pytest.raises(ValueError, match="last_window must be .update. or .drop."):
        AccumulationPlan(2, 2, last_window="keep")  # type: ignore[arg-type]


def test_from_effective_batch_divides() -> None:
    plan = AccumulationPlan.from_effective_batch(64, micro_batch_size=4, data_parallel_size=2)
    assert (plan.micro_batch_size, plan.accumulation_steps, plan.data_parallel_size) == (4, 8, 2)
    assert plan.effective_batch_size == 64
    assert AccumulationPlan.from_effective_batch(6, 6).accumulation_steps == 1
    drop = AccumulationPlan.from_effective_batch(8, 2, last_window="drop")
    assert drop.last_window == "drop"


def test_from_effective_batch_error_names_sizes_and_suggests_fixes() -> None:
    with pytest.raises(ValueError) as info:
        AccumulationPlan.from_effective_batch(30, micro_batch_size=4, data_parallel_size=2)
    message = str(info.value)
    assert "effective_batch_size=30" in message
    assert "not a multiple" in message
    assert "4 × 2 = 8" in message
    # the two nearest valid effective batches around 30 are suggested
    assert "24 or 32" in message


def test_from_effective_batch_smaller_than_one_window_raises() -> None:
    with pytest.raises(ValueError, match="8 or 16"):
        AccumulationPlan.from_effective_batch(4, micro_batch_size=8)


@pytest.mark.parametrize("bad", [0, -8])
def test_from_effective_batch_rejects_non_positive(bad: int) -> None:
    with pytest.raises(ValueError, match="effective_batch_size must be at least 1"):
        AccumulationPlan.from_effective_batch(bad, 2)


def test_shrink_keeps_effective_batch() -> None:
    plan = AccumulationPlan(8, 2, 2, last_window="drop")
    smaller = plan.shrink()
    assert (smaller.micro_batch_size, smaller.accumulation_steps) == (4, 4)
    assert smaller.data_parallel_size == 2 and smaller.last_window == "drop"
    assert smaller.effective_batch_size == plan.effective_batch_size
    assert smaller.shrink().shrink().micro_batch_size == 1
    assert plan.micro_batch_size == 8  # frozen: the original plan is unchanged


def test_shrink_errors_at_one_and_on_odd() -> None:
    with pytest.raises(ValueError, match="already 1"):
        AccumulationPlan(1, 4).shrink()
    with pytest.raises(ValueError, match="odd micro_batch_size=3"):
        AccumulationPlan(3, 4).shrink()


def test_windows_short_last_window() -> None:
    plan = AccumulationPlan(1, 3)
    windows = list(plan.windows(range(7)))
    assert [w.microbatches for w in windows] == [[0, 1, 2], [3, 4, 5], [6]]
    assert [w.complete for w in windows] == [True, True, False]
    assert [w.index for w in windows] == [0, 1, 2]
    assert len(windows[2]) == 1 and list(windows[1]) == [3, 4, 5] and windows[1][2] == 5
    assert isinstance(windows[0], Window)


def test_windows_of_empty_iterable() -> None:
    assert list(AccumulationPlan(2, 3).windows([])) == []


@settings(deadline=None, max_examples=60)
@given(n=st.integers(0, 40), steps=st.integers(1, 9))
def test_every_microbatch_lands_in_exactly_one_window(n: int, steps: int) -> None:
    items = [object() for _ in range(n)]
    windows = list(AccumulationPlan(2, steps).windows(iter(items)))
    flat = [mb for w in windows for mb in w]
    assert len(flat) == n
    assert all(a is b for a, b in zip(flat, items, strict=True))  # same objects, in order
    assert all(len(w) == steps and w.complete for w in windows[:-1])
    if windows:
        last = windows[-1]
        assert 1 <= len(last) <= steps
        assert last.complete == (len(last) == steps)
    assert len(windows) == -(-n // steps)


def test_to_dict_is_json_ready() -> None:
    plan = AccumulationPlan(2, 8, 2, last_window="drop")
    data = json.loads(json.dumps(plan.to_dict()))
    assert data == {
        "micro_batch_size": 2,
        "accumulation_steps": 8,
        "data_parallel_size": 2,
        "effective_batch_size": 32,
        "last_window": "drop",
    }
    rebuilt = AccumulationPlan(**{k: v for k, v in data.items() if k != "effective_batch_size"})
    assert rebuilt == plan


def test_describe_reads_as_a_sentence_in_singular_and_plural() -> None:
    assert describe(AccumulationPlan(1, 32)) == (
        "1 example/microbatch × 32 microbatches/window × 1 replica = 32 examples/update"
    )
    assert describe({"micro_batch_size": 4, "accumulation_steps": 1, "data_parallel_size": 2}) == (
        "4 examples/microbatch × 1 microbatch/window × 2 replicas = 8 examples/update"
    )
