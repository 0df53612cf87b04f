"""Every numeric flag of the ``accumlab`` command is checked at parse time, naming the flag
and its range, before anything runs: a value torch would take badly later (a seed past
2**64 - 1, a learning rate AdamW's step cannot hold in float32) is a usage error."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from accumlab_course.cli import FLOAT32_MAX, MAX_LR, MAX_SEED, main

TINY = ["train", "--micro", "2", "--steps", "2", "--updates", "1", "--examples", "8", "--quiet"]


def usage_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The last stderr line of a command argparse refuses (exit 2, usage above it)."""
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.startswith("usage: ")
    return err.splitlines()[-1]


@pytest.mark.parametrize(
    ("argv", "flag"),
    [(["train", "--seed", str(2**64)], "--seed"), (["train", "--seed", "-1"], "--seed"),
     (["train", "--seed", "1.5"], "--seed"), (["train", "--micro", "0"], "--micro"),
     (["train", "--steps", "-3"], "--steps"), (["train", "--updates", "0"], "--updates"),
     (["train", "--examples", "0"], "--examples"), (["train", "--examples", "-1"], "--examples"),
     (["train", "--checkpoint-dir", "x", "--checkpoint-every", "0"], "--checkpoint-every"),
     (["plan", "--effective", "0", "--micro", "4"], "--effective"),
     (["plan", "--effective", "64", "--micro", "-4"], "--micro"),
     (["plan", "--effective", "64", "--micro", "4", "--dp", "0"], "--dp")],
)
def test_an_integer_flag_out_of_range_is_a_usage_error_naming_it(argv, flag, capsys):
    last = usage_error(argv, capsys)
    value = argv[argv.index(flag) + 1]
    assert f"error: argument {flag}: must be a whole number" in last and repr(value) in last
    if flag == "--seed":
        assert f"from 0 to {MAX_SEED}" in last and MAX_SEED == 2**64 - 1


def test_the_seed_range_is_what_torch_takes():
    """The ends of the range run; one past the top is what torch itself cannot take."""
    for seed in (0, MAX_SEED):
        torch.Generator().manual_seed(seed)
        assert main([*TINY, "--seed", str(seed)]) == 0
    with pytest.raises((RuntimeError, ValueError)):  # "Overflow when unpacking long long"
        torch.manual_seed(MAX_SEED + 1)


@pytest.mark.parametrize("flag", ["--lr", "--clip"])
@pytest.mark.parametrize("value", ["inf", "nan", "-1", "0", "1e300", "ten"])
def test_a_number_flag_out_of_range_is_a_usage_error_naming_it(flag, value, capsys):
    last = usage_error([*TINY, flag, value], capsys)
    assert f"error: argument {flag}: must be a positive, finite number, at most " in last
    assert repr(value) in last


def test_lr_above_its_top_is_refused_naming_the_flag(capsys):
    """1e38 is a float32 number, but AdamW's first step (10 × lr) is not: refused at parse
    time instead of failing in the first update with "value cannot be converted to type
    float without overflow", naming no flag."""
    last = usage_error([*TINY, "--lr", "1e38"], capsys)
    assert "argument --lr: " in last and "at most 3.4e+37" in last and "'1e38'" in last
    assert "argument --clip" in usage_error([*TINY, "--clip", "3.5e38"], capsys)


def test_the_lr_range_is_what_adamw_takes_in_float32(capsys):
    """Measured on AdamW itself, apart from the command: its first step at MAX_LR runs, a
    little above it fails; the command runs at MAX_LR and at FLOAT32_MAX for --clip."""

    def first_step(lr: float) -> None:
        weight = torch.nn.Parameter(torch.ones(3))
        weight.grad = torch.ones(3)
        torch.optim.AdamW([weight], lr=lr).step()

    first_step(MAX_LR)
    with pytest.raises(RuntimeError, match="cannot be converted to type float without overflow"):
        first_step(3.5e37)
    assert main([*TINY, "--lr", str(MAX_LR), "--clip", repr(FLOAT32_MAX)]) == 0
    assert "| update_attempts | 1 |" in capsys.readouterr().out


@pytest.mark.parametrize(("flag", "value"), [("--seed", str(2**64)), ("--seed", "-1"),
                                           ("--nproc", "0"), ("--micro", "0"),
                                           ("--examples", "-5"), ("--steps", "0")])
def test_the_ddp_example_checks_its_integer_flags_the_same_way(flag, value, capsys):
    """examples/ddp_train.py (run by notebook 04) takes the CLI's checks: a bad value is a
    usage error naming the flag before any process is spawned."""
    spec = importlib.util.spec_from_file_location(
        "ddp_train", Path(__file__).resolve().parents[2] / "examples" / "ddp_train.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    assert example.parse([]).seed == 0
    with pytest.raises(SystemExit) as exit_:
        example.parse([flag, value])
    assert exit_.value.code == 2
    assert f"error: argument {flag}: must be a whole number" in capsys.readouterr().err
