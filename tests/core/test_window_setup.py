"""What the windows of a run share, worked out once: ``parallel.Replicas`` (the wrapper,
the group, D, the device) and ``loop.WindowSetup`` (the replicas, the precision policy,
the scaler, the parameters an update steps, the modes), from ``loop.window_setup``.

A window given the run's setup derives and checks nothing; a call of ``train_window`` or
``accumulate`` without one makes its own, so a lesson's call reads as it always did and
ends on the same weights. The multi-rank count of the group lookups is
``tests/distributed/test_group_lookups.py``.
"""

from __future__ import annotations

import copy
from dataclasses import FrozenInstanceError

import pytest
import torch
from helpers.batches import token_batch
from helpers.setup_workers import counted_calls
from torch import nn

import accumlab as al
from accumlab.loop import WindowSetup, window_setup
from accumlab.parallel import Replicas


def windows(n: int = 3) -> list[list[dict[str, torch.Tensor]]]:
    return [[token_batch([(5, 0), (3, 1)], seed=2 * w + k) for k in range(2)] for w in range(n)]


def test_replicas_of_a_plain_model_outside_a_process_group() -> None:
    model = nn.Linear(2, 2).double()
    replicas = Replicas.of(model)
    assert (replicas.wrapper, replicas.group, replicas.size) == ("plain", None, 1)
    assert replicas.device == torch.device("cpu") and not replicas.forward_collective
    assert replicas.total(7) == 7 and replicas.any(True) and not replicas.any(False)
    compiled = nn.Module()  # what torch.compile wraps a model in: its module as _orig_mod
    compiled._orig_mod = model
    assert Replicas.of(compiled) == replicas
    with pytest.raises(FrozenInstanceError):
        replicas.size = 2  # type: ignore[misc]


def test_window_setup_holds_what_the_windows_need(toy64: nn.Module) -> None:
    toy64.extra = nn.Linear(2, 2)  # trainable, not in the optimizer: an orphan
    optimizer = torch.optim.SGD(toy64.head.parameters(), lr=0.1)
    with pytest.warns(UserWarning, match="does not hold"):
        setup = window_setup(toy64, optimizer, clip_grad_norm=2, nonfinite="raise")
    assert isinstance(setup, WindowSetup)
    assert setup.stepped == tuple(toy64.head.parameters())
    assert set(map(id, setup.orphans)) == {
        id(p) for n, p in toy64.named_parameters() if not n.startswith("head.")
    }
    assert setup.clip_grad_norm == 2.0 and isinstance(setup.clip_grad_norm, float)
    assert (setup.policy.name, setup.policy.device_type, setup.scaler) == ("fp32", "cpu", None)
    assert (setup.nonfinite, setup.scheduler_per, setup.sync) == ("raise", "applied", "window")


def test_an_fp16_setup_makes_a_scaler_only_for_an_update() -> None:
    model = nn.Linear(2, 2)
    made = window_setup(model, torch.optim.SGD(model.parameters(), lr=0.1), precision="fp16")
    assert isinstance(made.scaler, torch.amp.GradScaler)
    assert window_setup(model, precision="fp16").scaler is None  # accumulate alone: none


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"precision": "float16"}, ValueError, "did you mean precision='fp16'"),
        ({"nonfinite": "ignore"}, ValueError, "nonfinite must be 'skip' or 'raise'"),
        ({"scheduler_per": "step"}, ValueError, "scheduler_per must be"),
        ({"sync": "never"}, ValueError, "sync must be 'window' or 'microbatch'"),
        ({"clip_grad_norm": -1.0}, ValueError, "clip_grad_norm must be positive"),
        ({"scaler": "yes"}, TypeError, "scaler must be a torch.amp.GradScaler"),
    ],
)
def test_window_setup_names_each_bad_argument(kwargs: dict, error: type, match: str) -> None:
    model = nn.Linear(2, 2)
    with pytest.raises(error, match=match):
        window_setup(model, torch.optim.SGD(model.parameters(), lr=0.1), **kwargs)


def test_a_window_given_the_runs_setup_derives_and_checks_nothing(toy64: nn.Module) -> None:
    """The same weights as the lesson's call, and not one call of what derives the group,
    the policy, the scaler or the parameters, or checks a setting."""
    twin = copy.deepcopy(toy64)
    objective = al.NextTokenLoss()
    own, given = torch.optim.AdamW(toy64.parameters()), torch.optim.AdamW(twin.parameters())
    setup = window_setup(twin, given, clip_grad_norm=0.5)
    for index, window in enumerate(windows()):
        a = al.train_window(toy64, window, own, objective, clip_grad_norm=0.5, index=index)
        with counted_calls() as counts:
            b = al.train_window(twin, window, given, objective, index=index, setup=setup)
        assert dict(counts) == {}
        assert a == b
    for p, q in zip(toy64.parameters(), twin.parameters(), strict=True):
        assert torch.equal(p, q)


def test_accumulate_given_a_setup_derives_nothing(toy64: nn.Module) -> None:
    twin = copy.deepcopy(toy64)
    window = windows(1)[0]
    alone = al.accumulate(toy64, window, al.NextTokenLoss())
    setup = window_setup(twin)
    with counted_calls() as counts:
        given = al.accumulate(twin, window, al.NextTokenLoss(), setup=setup)
    assert dict(counts) == {} and alone == given
    for p, q in zip(toy64.parameters(), twin.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)


def test_a_window_on_its_own_still_checks_its_arguments(toy64: nn.Module) -> None:
    optimizer = torch.optim.SGD(toy64.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="nonfinite must be"):
        al.train_window(toy64, windows(1)[0], optimizer, al.NextTokenLoss(), nonfinite="no")
    with pytest.raises(ValueError, match="sync must be"):
        al.accumulate(toy64, windows(1)[0], al.NextTokenLoss(), sync="never")
