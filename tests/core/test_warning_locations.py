"""The loop's warnings point at the caller's line, not at accumlab's own helpers.

``train_window`` hands its work to small named helpers; a warning raised in one of them
must still name the line of user code that called ``train_window`` (its ``stacklevel``),
or a user cannot tell which call it is about.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

import accumlab as al


def _call_x(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(batch["x"])


def _batch() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {"x": torch.randn(3, 2), "labels": torch.randint(0, 2, (3,))}


def _caught(call) -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        call()
    return [w for w in caught if issubclass(w.category, UserWarning)]


def test_a_partial_optimizer_warning_names_the_callers_file() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    optimizer = torch.optim.SGD(model[0].parameters(), lr=0.1)  # not model[1]
    caught = _caught(
        lambda: al.train_window(model, [_batch()], optimizer, al.ExampleLoss(), forward=_call_x)
    )
    (warning,) = [w for w in caught if "does not hold" in str(w.message)]
    assert warning.filename == __file__


def test_fp16_without_a_scaler_warning_names_the_callers_file() -> None:
    model = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    caught = _caught(
        lambda: al.train_window(
            model, [_batch()], optimizer, al.ExampleLoss(), forward=_call_x, precision="fp16"
        )
    )
    (warning,) = [w for w in caught if "without a scaler" in str(w.message)]
    assert warning.filename == __file__


def test_a_warning_from_the_runs_setup_names_the_callers_file() -> None:
    """``train`` works the run out in ``TrainSettings.check_objects`` and
    ``loop.window_setup``, two calls deeper than a window does; the warning still names
    the line that called ``train``."""
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    optimizer = torch.optim.SGD(model[0].parameters(), lr=0.1)
    caught = _caught(
        lambda: al.train(
            model, [_batch()], optimizer, al.AccumulationPlan(3, 1), al.ExampleLoss(),
            forward=_call_x, progress=False,
        )
    )
    (warning,) = [w for w in caught if "does not hold" in str(w.message)]
    assert warning.filename == __file__
