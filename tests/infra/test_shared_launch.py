"""tests/helpers/shared_launch.py: a module's workers in one launch, each test its own result,
and each worker launched alone when the shared launch fails. ``launch`` is replaced by a
recorder here (the distributed tests run the real one)."""

from __future__ import annotations

import pytest
import torch
from helpers import shared_launch
from helpers.shared_launch import SharedLaunch


def double(x: int) -> int:
    return 2 * x


def negate(x: int) -> int:
    return -x


class Recorder:
    """Stands in for ``accumlab.distributed.launch``: runs ``fn`` once per rank in this
    process (``in_turn`` with its barrier made a no-op) and records each call."""

    def __init__(self, fail_shared: bool = False) -> None:
        self.calls: list[tuple[str, float | None]] = []
        self.fail_shared = fail_shared

    def __call__(self, fn, nprocs, args, *, timeout_s, deadline_s):
        self.calls.append((fn.__name__, deadline_s))
        if fn is shared_launch.in_turn and self.fail_shared:
            raise RuntimeError("rank 1: a worker failed")
        return [fn(*args) for _ in range(nprocs)]


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> Recorder:
    rec = Recorder()
    monkeypatch.setattr(shared_launch.ald, "launch", rec)
    monkeypatch.setattr(shared_launch.dist, "barrier", lambda: None)
    return rec


def test_one_launch_runs_every_worker_and_each_name_gets_its_own_results(recorder):
    shared = SharedLaunch(2, {"d": (double, (3,)), "n": (negate, (5,))}, deadline_s=10)
    assert shared["n"] == [-5, -5] and shared["d"] == [6, 6]
    assert recorder.calls == [("in_turn", 20)]  # one launch, a deadline per worker
    with pytest.raises(KeyError, match="no worker named 'x'"):
        shared["x"]


def test_after_a_failed_shared_launch_each_worker_is_launched_alone(recorder):
    recorder.fail_shared = True
    shared = SharedLaunch(2, {"d": (double, (3,)), "n": (negate, (5,))}, deadline_s=10)
    assert shared["d"] == [6, 6]
    assert shared["n"] == [-5, -5]
    assert recorder.calls == [("in_turn", 20), ("double", 10), ("negate", 10)]


def test_a_failing_worker_fails_its_own_test_with_its_own_error(recorder):
    recorder.fail_shared = True
    shared = SharedLaunch(2, {"d": (double, (3,)), "bad": (double, (None,))}, deadline_s=None)
    assert shared["d"] == [6, 6]
    with pytest.raises(TypeError):
        shared["bad"]
    assert recorder.calls == [("in_turn", None), ("double", None), ("double", None)]


def test_each_worker_draws_what_it_would_draw_in_a_fresh_interpreter(recorder):
    torch.manual_seed(shared_launch.FRESH_SEED)
    fresh = torch.rand(3)
    torch.manual_seed(123)  # whatever state the caller left
    shared = SharedLaunch(1, {"a": (torch.rand, (3,)), "b": (torch.rand, (3,))}, deadline_s=None)
    assert torch.equal(shared["a"][0], fresh) and torch.equal(shared["b"][0], fresh)


def test_no_workers_is_an_error():
    with pytest.raises(ValueError, match="calls is empty"):
        SharedLaunch(2, {}, deadline_s=None)
