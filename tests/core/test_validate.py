"""accumlab.validate: each kind of argument check accepts what it promises, and names the
argument, what is accepted and what was given otherwise."""

from __future__ import annotations

import math

import pytest
import torch

from accumlab.validate import (
    check_bool,
    check_callable_or_none,
    check_choice,
    check_hyperparameters,
    check_instance,
    check_methods,
    check_positive_int,
    check_positive_number,
)


def test_positive_int_accepts_ints_from_one_and_none_only_when_it_means_something() -> None:
    assert check_positive_int("n", 1) == 1 and check_positive_int("n", 10**12) == 10**12
    assert check_positive_int("n", None, none_means="no limit") is None
    for bad, error, match in [
        (0, ValueError, "n must be at least 1, got 0"),
        (-3, ValueError, "n must be at least 1, got -3"),
        (True, TypeError, r"n must be an int, got bool \(True\)"),
        (2.0, TypeError, r"n must be an int, got float \(2.0\)"),
        (None, TypeError, r"n must be an int, got NoneType \(None\)"),
    ]:
        with pytest.raises(error, match=match):
            check_positive_int("n", bad)
    with pytest.raises(TypeError, match="n must be an int, or None for no limit"):
        check_positive_int("n", "3", none_means="no limit")


def test_positive_number_must_fit_the_dtype_it_is_used_in() -> None:
    assert check_positive_number("lr", 2) == 2.0 and isinstance(
        check_positive_number("lr", 2), float
    )
    assert check_positive_number("lr", 3.0e38) == 3.0e38  # float32 holds up to about 3.40e38
    assert check_positive_number("lr", 1e300, dtype=torch.float64) == 1e300
    with pytest.raises(ValueError, match=r"lr is 1e\+300, more than torch.float32 holds"):
        check_positive_number("lr", 1e300)
    with pytest.raises(ValueError, match="more than torch.float16 holds"):
        check_positive_number("lr", 70000.0, dtype=torch.float16)  # fp16's largest is 65504
    for bad in (0, 0.0, -1e-3, math.inf, -math.inf, math.nan):
        with pytest.raises(ValueError, match="lr must be positive and finite, got"):
            check_positive_number("lr", bad)
    for bad in ("1", True, None, [1.0]):
        with pytest.raises(TypeError, match=r"lr must be a number \(the step size\), got"):
            check_positive_number("lr", bad, meaning="the step size")
    assert check_positive_number("clip", None, none_means="no clipping") is None
    with pytest.raises(
        ValueError, match="clip must be positive and finite, or None for no clipping"
    ):
        check_positive_number("clip", -1.0, none_means="no clipping")


def test_choice_is_a_string_among_the_choices_and_an_alias_is_named_not_taken() -> None:
    assert check_choice("sync", "window", ("window", "microbatch")) == "window"
    with pytest.raises(ValueError, match=r"^sync must be 'window' or 'microbatch', got 'all'$"):
        check_choice("sync", "all", ("window", "microbatch"))
    with pytest.raises(ValueError, match=r"^mode must be one of \['a', 'b', 'c'\], got 'A'$"):
        check_choice("mode", "A", ("a", "b", "c"))
    with pytest.raises(
        TypeError, match=r"sync must be a string, 'window' or 'microbatch', got NoneType"
    ):
        check_choice("sync", None, ("window", "microbatch"))
    with pytest.raises(ValueError, match=r"did you mean precision='fp16'\?"):
        check_choice("precision", " Half", ("fp32", "fp16"), aliases={"half": "fp16"})


def test_bool_callable_instance_and_methods() -> None:
    assert check_bool("progress", False) is False
    for bad in (0, 1, "yes", None):
        with pytest.raises(TypeError, match="progress must be True or False, got"):
            check_bool("progress", bad)
    assert (
        check_callable_or_none("hook", None) is None
        and check_callable_or_none("hook", print) is print
    )
    with pytest.raises(TypeError, match="hook must be callable or None, got int"):
        check_callable_or_none("hook", 3)
    module = torch.nn.Linear(1, 1)
    assert check_instance("model", module, torch.nn.Module, "a torch.nn.Module") is module
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got str"):
        check_instance("model", "gpt", torch.nn.Module, "a torch.nn.Module")

    class Counts:
        def count(self, batch: object) -> int:
            return 1

        loss_sum = None  # an attribute, not a method

    methods = ("count(batch)", "loss_sum(output, batch)")
    with pytest.raises(
        TypeError,
        match=r"objective must have count\(batch\) and loss_sum\(output, batch\) methods, such as X, got Counts",
    ):
        check_methods("objective", Counts(), methods, example="X")
    with pytest.raises(
        TypeError, match=r"scheduler must have a step\(\) method, such as S, or be None, got int"
    ):
        check_methods("scheduler", 3, ("step()",), example="S", none_ok=True)
    assert check_methods("scheduler", None, ("step()",), example="S", none_ok=True) is None
    with pytest.raises(TypeError, match="got NoneType"):
        check_methods("scheduler", None, ("step()",), example="S")


class _Shapes:
    """Methods of every call shape ``check_methods`` reads."""

    def step(self, epoch: int | None = None) -> None: ...

    def needs_metric(self, metrics: float, epoch: int | None = None) -> None: ...

    def needs_keyword(self, *, mode: str) -> None: ...

    def takes_none(self) -> None: ...

    def takes_any(self, *args: object) -> None: ...

    builtin = [].append  # a method whose signature Python reads: one argument


@pytest.mark.parametrize(
    ("method", "problem"),
    [
        ("needs_metric()", "also needs metrics"),
        ("needs_keyword()", "also needs mode"),
        ("takes_none(batch)", r"takes 0 argument\(s\), not 1"),
        ("builtin()", "also needs object"),
    ],
)
def test_a_method_that_cannot_be_called_as_written_is_named(method: str, problem: str) -> None:
    with pytest.raises(
        TypeError, match=rf"thing\.{method.split('(')[0]}\(.*\) cannot be called that way: "
        rf"_Shapes\.\w+\(\) {problem}\. do this"
    ):
        check_methods("thing", _Shapes(), (method,), example="X", fix="do this")


@pytest.mark.parametrize("method", ["step()", "step(epoch)", "takes_any(a, b, c)", "builtin(x)"])
def test_a_method_that_can_be_called_as_written_passes(method: str) -> None:
    shapes = _Shapes()
    assert check_methods("thing", shapes, (method,), example="X") is shapes


def test_hyperparameters_must_be_usable_and_fit_the_parameters_dtype() -> None:
    w32 = torch.nn.Parameter(torch.zeros(2))
    w64 = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
    check_hyperparameters(torch.optim.AdamW([w32], lr=1e-3, maximize=True))
    check_hyperparameters(torch.optim.SGD([w64], lr=1e300))  # float64 holds it
    with pytest.raises(
        ValueError, match=r"param_groups\[0\]\['lr'\] is inf; a learning rate must be a finite"
    ):
        check_hyperparameters(torch.optim.SGD([w32], lr=math.inf))
    sgd = torch.optim.SGD([w32], lr=0.1)
    sgd.param_groups[0]["lr"] = -0.1  # SGD refuses it when built, not later
    with pytest.raises(ValueError, match=r"\['lr'\] is -0.1; a learning rate must be 0 or more"):
        check_hyperparameters(sgd)
    sgd.param_groups[0]["lr"] = 0.1
    sgd.param_groups[0]["momentum"] = math.nan
    with pytest.raises(ValueError, match=r"\['momentum'\] is nan; hyper-parameters must be finite"):
        check_hyperparameters(sgd)
    adamw = torch.optim.AdamW([w32])
    adamw.param_groups[0]["betas"] = (0.9, math.nan)  # AdamW refuses it when built, not later
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['betas'\] is \(0.9, nan\)"):
        check_hyperparameters(adamw)
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['lr'\] is tensor\(inf\)"):
        check_hyperparameters(torch.optim.AdamW([w32], lr=torch.tensor(math.inf)))
    two = torch.optim.SGD([{"params": [w64], "lr": 1e300}, {"params": [w32], "lr": 1e300}])
    with pytest.raises(
        ValueError,
        match=r"param_groups\[1\]\['lr'\] is 1e\+300, more than torch.float32 \(its parameters' dtype\)",
    ):
        check_hyperparameters(two)
