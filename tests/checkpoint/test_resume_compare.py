"""What a resume compares (parameter order, the scheduler, implementation switches, a
retry in one process), and the refusal of a checkpoint of another format.

Each refusal must leave the model and the optimizer as the caller built them: resume
compares before it loads anything.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import resume_workers as workers  # tests/helpers/resume_workers.py

import accumlab as al
from accumlab import checkpoint


def assert_untouched(run: dict[str, Any], config: workers.Config) -> None:
    fresh = workers._plain(workers.build(config)["model"].state_dict())
    now = run["model"].state_dict()
    assert all(torch.equal(now[k], v) for k, v in fresh.items())
    assert not run["optimizer"].state


def interrupted(config: workers.Config, directory: Path, stop_after: int, **parts: Any) -> None:
    """Train ``config`` (its parts replaced by ``parts``: a scheduler factory, ...) for
    ``stop_after`` update attempts with a checkpoint after each."""
    run = workers.build(config)
    for name, make in parts.items():
        run[name] = make(run)
    workers.train(run, config, max_updates=stop_after, checkpoint_dir=directory, checkpoint_every=1)


# ----------------------------------------------------------------- item 3: parameter order


def _swapped_optimizer(run: dict[str, Any], first: str, second: str) -> dict[str, Any]:
    """The run's optimizer rebuilt over the same parameters with ``first`` and ``second``
    swapped in the list (two parameters of one shape), and its scheduler rebuilt on it."""
    named = dict(run["model"].named_parameters())
    order = list(named)
    i, j = order.index(first), order.index(second)
    order[i], order[j] = order[j], order[i]
    run["optimizer"] = torch.optim.AdamW([named[n] for n in order], lr=3e-3, weight_decay=0.1)
    run["scheduler"] = torch.optim.lr_scheduler.LambdaLR(run["optimizer"], lambda u: 1.0 / (1.0 + 0.25 * u))
    return run


def test_an_optimizer_over_the_same_parameters_in_another_order_is_refused(tmp_path: Path) -> None:
    """ln_1.weight and ln_2.weight have one shape ([16]); swapped, Adam's moments would
    land on the other layer (3.3e-2 off the straight run in the issue)."""
    config = workers.Config()
    interrupted(config, tmp_path, 2)
    run = _swapped_optimizer(workers.build(config), "blocks.0.ln_1.weight", "blocks.0.ln_2.weight")
    with pytest.raises(checkpoint.ResumeMismatchError) as info:
        workers.train(run, config, checkpoint_dir=tmp_path, resume=True)
    message = str(info.value)
    assert (
        "optimizer param_groups[0] params[2]: 'blocks.0.ln_1.weight' [16] in the checkpoint, "
        "'blocks.0.ln_2.weight' [16] now" in message
    )
    assert "params[8]: 'blocks.0.ln_2.weight' [16] in the checkpoint, 'blocks.0.ln_1.weight' [16] now" in message
    assert "another order" in message
    assert_untouched(run, config)


def test_parameters_the_model_does_not_name_are_compared_by_shape_in_order(tmp_path: Path) -> None:
    """An optimizer over tensors outside the model (no names): two of other shapes swapped
    are refused by shape before Adam's moments of one shape meet a tensor of another."""
    torch.manual_seed(0)
    tensors = [torch.randn(3, 4, requires_grad=True), torch.randn(5, requires_grad=True)]
    state = {"settings": checkpoint.run_settings(torch.optim.Adam(tensors), None)}
    swapped = checkpoint.run_settings(torch.optim.Adam(tensors[::-1]), None)
    assert state["settings"]["param_names"] == [[None, None]]
    problems = [d.text for d in checkpoint.compare._setting_differences(state["settings"], swapped)]
    assert problems[:2] == [
        "optimizer param_groups[0] params[0]: [3, 4] in the checkpoint, [5] now",
        "optimizer param_groups[0] params[1]: [5] in the checkpoint, [3, 4] now",
    ]


# ----------------------------------------------------------------- item 4: the scheduler


def _lambda(rate: float) -> Any:
    return lambda run: torch.optim.lr_scheduler.LambdaLR(run["optimizer"], lambda u: 1.0 / (1.0 + rate * u))


def _sequential(run: dict[str, Any], gamma: float) -> Any:
    """Warm-up for 2 updates, then exponential decay: a change of ``gamma`` shows in the
    learning rate only from update attempt 3, after the checkpoint of attempt 2."""
    o = run["optimizer"]
    L = torch.optim.lr_scheduler
    return L.SequentialLR(o, [L.LinearLR(o, 0.1, 1.0, 2), L.ExponentialLR(o, gamma)], [2])


SCHEDULER_CHANGES = {
    # name: (scheduler of the run that wrote the checkpoint, of the resumed run, refusal)
    "StepLR gamma": (
        lambda run: torch.optim.lr_scheduler.StepLR(run["optimizer"], step_size=1, gamma=0.5),
        lambda run: torch.optim.lr_scheduler.StepLR(run["optimizer"], step_size=1, gamma=0.9),
        r"scheduler gamma 0.5 in the checkpoint, 0.9 now",
    ),
    "CosineAnnealingLR T_max": (
        lambda run: torch.optim.lr_scheduler.CosineAnnealingLR(run["optimizer"], T_max=4),
        lambda run: torch.optim.lr_scheduler.CosineAnnealingLR(run["optimizer"], T_max=40),
        r"scheduler T_max 4 in the checkpoint, 40 now",
    ),
    "SequentialLR a chained scheduler's gamma": (
        lambda run: _sequential(run, 0.9),
        lambda run: _sequential(run, 0.5),
        r"scheduler _schedulers \[.*'gamma': 0.9.* in the checkpoint, \[.*'gamma': 0.5",
    ),
    "LambdaLR another lambda": (
        _lambda(0.25),
        _lambda(0.5),
        r"scheduler: replayed over the 2 update attempts already trained, it gives lr "
        r"0.002 at update attempt 1, where the run used 0.0024",
    ),
}


@pytest.mark.parametrize("change", list(SCHEDULER_CHANGES))
def test_the_same_scheduler_class_with_other_arguments_is_refused(change: str, tmp_path: Path) -> None:
    config = workers.Config()
    then, now, message = SCHEDULER_CHANGES[change]
    interrupted(config, tmp_path, 2, scheduler=then)
    run = workers.build(config)
    run["scheduler"] = now(run)
    with pytest.raises(checkpoint.ResumeMismatchError, match=message):
        workers.train(run, config, checkpoint_dir=tmp_path, resume=True)
    assert_untouched(run, config)


_L = torch.optim.lr_scheduler
EVERY_SCHEDULER = {
    "StepLR": lambda o: _L.StepLR(o, 2, 0.5),
    "MultiStepLR": lambda o: _L.MultiStepLR(o, [1, 3], 0.5),
    "ExponentialLR": lambda o: _L.ExponentialLR(o, 0.9),
    "CosineAnnealingLR": lambda o: _L.CosineAnnealingLR(o, 5),
    "CosineAnnealingWarmRestarts": lambda o: _L.CosineAnnealingWarmRestarts(o, 2, 2),
    "OneCycleLR": lambda o: _L.OneCycleLR(o, max_lr=0.01, total_steps=10),  # cycles betas[0] too
    "CyclicLR": lambda o: _L.CyclicLR(o, 1e-4, 1e-2, step_size_up=2),
    "LinearLR": lambda o: _L.LinearLR(o, 0.1, 1.0, 3),
    "PolynomialLR": lambda o: _L.PolynomialLR(o, 6, 2.0),
    "ConstantLR": lambda o: _L.ConstantLR(o, 0.5, 2),
    "SequentialLR": lambda o: _L.SequentialLR(o, [_L.LinearLR(o, 0.1, 1.0, 2), _L.ExponentialLR(o, 0.9)], [2]),
    "ChainedScheduler": lambda o: _L.ChainedScheduler([_L.ConstantLR(o, 0.5, 2), _L.ExponentialLR(o, 0.9)]),
}


@pytest.mark.parametrize("name", list(EVERY_SCHEDULER))
def test_every_torch_scheduler_resumes_fresh_and_retried_without_a_false_refusal(name: str, tmp_path: Path) -> None:
    """No false refusal: with each of torch's schedulers, a run stopped after 3 of 6
    update attempts resumes bit-identical in a new process (new objects: the replay
    runs) and in the same one (the same objects, moved by the scheduler)."""
    config = workers.Config(microbatches=12)

    def build() -> dict[str, Any]:
        run = workers.build(config)
        run["scheduler"] = EVERY_SCHEDULER[name](run["optimizer"])
        return run

    run = build()
    straight = workers.snapshot(run, workers.train(run, config))
    first = build()
    workers.train(first, config, max_updates=3, checkpoint_dir=tmp_path / "new", checkpoint_every=1)
    fresh = build()
    ledger = workers.train(fresh, config, checkpoint_dir=tmp_path / "new", resume=True)
    assert workers.mismatches(straight, workers.snapshot(fresh, ledger)) == []

    same = build()
    with pytest.raises(KeyboardInterrupt):
        workers.train(
            same,
            config,
            InterruptOnce(same["data"], at=7),
            checkpoint_dir=tmp_path / "same",
            checkpoint_every=1,
        )
    ledger = workers.train(same, config, same["data"], checkpoint_dir=tmp_path / "same", resume=True)
    assert workers.mismatches(straight, workers.snapshot(same, ledger)) == []


def _two_groups(run: dict[str, Any], second_rate: float) -> dict[str, Any]:
    """AdamW over two parameter groups (the embeddings, the rest) with one lambda each."""
    params = list(run["model"].parameters())
    run["optimizer"] = torch.optim.AdamW([{"params": params[:2]}, {"params": params[2:]}], lr=3e-3)
    run["scheduler"] = torch.optim.lr_scheduler.LambdaLR(
        run["optimizer"], [lambda u: 1.0 / (1.0 + 0.25 * u), lambda u: 1.0 / (1.0 + second_rate * u)]
    )
    return run


def test_a_lambda_changed_for_the_second_group_only_is_seen(tmp_path: Path) -> None:
    """The checkpoint keeps every group's learning rate per update attempt, so a schedule
    changed for group 1 only is refused (the ledger's reports hold group 0's alone)."""
    config = workers.Config()
    first = _two_groups(workers.build(config), 0.25)
    workers.train(first, config, max_updates=2, checkpoint_dir=tmp_path, checkpoint_every=1)
    kept = checkpoint.load_checkpoint(checkpoint.checkpoint_path(tmp_path, 2))["data_history"]["lrs"]
    assert kept.tolist() == [[3e-3, 3e-3], [3e-3 / 1.25, 3e-3 / 1.25]]
    run = _two_groups(workers.build(config), 0.5)
    with pytest.raises(checkpoint.ResumeMismatchError, match=r"gives lr \[0.0024, 0.002\] at update attempt 1"):
        workers.train(run, config, checkpoint_dir=tmp_path, resume=True)
    same = _two_groups(workers.build(config), 0.25)
    workers.train(same, config, checkpoint_dir=tmp_path, resume=True)  # the same schedule resumes


def test_the_replay_leaves_the_given_scheduler_and_optimizer_as_built(tmp_path: Path) -> None:
    config = workers.Config()
    interrupted(config, tmp_path, 3)
    run = workers.build(config)
    before = (run["scheduler"].state_dict(), [dict(g, params=None) for g in run["optimizer"].param_groups])
    state = checkpoint.load_checkpoint(checkpoint.checkpoint_path(tmp_path, 3))
    assert checkpoint.scheduler_differences(state, run["scheduler"], run["optimizer"]) == []
    after = (run["scheduler"].state_dict(), [dict(g, params=None) for g in run["optimizer"].param_groups])
    assert after == before


@pytest.mark.parametrize("switch", [{"foreach": True}, {"foreach": False}, {"fused": True}])
def test_an_optimizer_built_with_another_implementation_switch_resumes(switch: dict[str, bool], tmp_path: Path) -> None:
    """AdamW's ``foreach`` and ``fused`` choose how the update is computed, not what it
    is: a resume with only one of them changed is not refused and trains on; a value
    changed beside the switch still is."""
    config = workers.Config()
    interrupted(config, tmp_path, 2)

    def adamw(run: dict[str, Any], lr: float) -> dict[str, Any]:
        run["optimizer"] = torch.optim.AdamW(run["model"].parameters(), lr=lr, weight_decay=0.1, **switch)
        run["scheduler"] = torch.optim.lr_scheduler.LambdaLR(run["optimizer"], lambda u: 1.0 / (1.0 + 0.25 * u))
        return run

    with pytest.raises(checkpoint.ResumeMismatchError, match=r"\['lr'\]: 0.003 in the checkpoint, 0.001 now") as info:
        workers.train(adamw(workers.build(config), 1e-3), config, checkpoint_dir=tmp_path, resume=True)
    assert "foreach" not in str(info.value) and "fused" not in str(info.value)
    ledger = workers.train(adamw(workers.build(config), 3e-3), config, checkpoint_dir=tmp_path, resume=True)
    assert ledger.update_attempts == 4


# ----------------------------------------------------------------- item 7: retry in one process


class InterruptOnce:
    """The microbatches of ``data``, but the first pass raises ``KeyboardInterrupt``
    before microbatch ``at`` (Ctrl-C in a notebook, while the loader reads)."""

    def __init__(self, data: list[Any], at: int) -> None:
        self.data, self.at, self.armed = data, at, True

    def __iter__(self) -> Iterator[Any]:
        for i, microbatch in enumerate(self.data):
            if self.armed and i == self.at:
                self.armed = False
                raise KeyboardInterrupt
            yield microbatch


@pytest.mark.parametrize("where", ["loader", "on_update"])
def test_retrying_with_the_same_objects_in_one_process_resumes_bit_identical(where: str, tmp_path: Path) -> None:
    """Interrupted mid-run (after update attempt 2 of 4; the LambdaLR has moved the lr
    to 3e-3/1.5), then ``train(..., resume=True)`` again with the very same model,
    optimizer, scheduler and data: it resumes and ends as the straight run, bit for bit."""
    config = workers.Config(microbatches=8, dropout=0.1)
    run = workers.build(config)
    straight = workers.snapshot(run, workers.train(run, config))

    run = workers.build(config)
    if where == "loader":
        data: Any = InterruptOnce(run["data"], at=5)  # inside window 2, after 2 attempts
        kwargs: dict[str, Any] = {}
    else:
        data = run["data"]

        def on_update(report: al.UpdateReport) -> None:
            if report.index == 2 and not seen:
                seen.append(report.index)
                raise KeyboardInterrupt

        seen: list[int] = []
        kwargs = {"on_update": on_update}
    with pytest.raises(KeyboardInterrupt):
        workers.train(run, config, data, checkpoint_dir=tmp_path, checkpoint_every=1, **kwargs)
    assert run["optimizer"].param_groups[0]["lr"] != 3e-3  # the scheduler moved it
    assert not (tmp_path / ".checkpoint-lock").exists()  # the interrupted run let go
    ledger = workers.train(run, config, data, checkpoint_dir=tmp_path, resume=True, **kwargs)
    assert workers.mismatches(straight, workers.snapshot(run, ledger)) == []


def test_a_retry_before_the_first_checkpoint_starts_fresh_and_says_the_objects_trained(tmp_path: Path) -> None:
    """Interrupted before any checkpoint was written, the same objects cannot resume: the
    run starts fresh from weights that already moved, and says so."""
    config = workers.Config(dropout=0.1)
    run = workers.build(config)
    data = InterruptOnce(run["data"], at=5)
    with pytest.raises(KeyboardInterrupt):
        workers.train(run, config, data, checkpoint_dir=tmp_path, checkpoint_every=10)
    assert checkpoint.list_checkpoints(tmp_path) == []
    with pytest.warns(UserWarning, match="found no checkpoint .* the optimizer already holds state"):
        workers.train(run, config, data, checkpoint_dir=tmp_path, resume=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # new objects: no warning
        workers.train(workers.build(config), config, checkpoint_dir=tmp_path / "new", resume=True)


def test_a_changed_lr_is_still_refused_when_the_scheduler_has_moved(tmp_path: Path) -> None:
    """The retry tolerates what the scheduler moved, not another lr: rebuilt with lr 0.1
    (its initial_lr) and stepped, the run is refused naming lr."""
    config = workers.Config()
    interrupted(config, tmp_path, 2)
    run = workers.build(config)
    run["optimizer"] = torch.optim.AdamW(run["model"].parameters(), lr=0.1, weight_decay=0.1)
    run["scheduler"] = torch.optim.lr_scheduler.LambdaLR(run["optimizer"], lambda u: 1.0 / (1.0 + 0.25 * u))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # step() before any optimizer.step(): on purpose here
        run["scheduler"].step()
    with pytest.raises(checkpoint.ResumeMismatchError, match=r"\['lr'\]: 0.003 in the checkpoint, 0.1 now"):
        workers.train(run, config, checkpoint_dir=tmp_path, resume=True)


# ----------------------------------------------------------------- the file format


def test_a_checkpoint_of_an_older_format_is_refused_in_one_line_naming_the_format(tmp_path: Path) -> None:
    """An intact checkpoint of another format (an older accumlab's) is not resumed from,
    nor reported as damaged: one line names its format and this version's, before
    anything is loaded."""
    config = workers.Config()
    interrupted(config, tmp_path, 2)
    path = checkpoint.checkpoint_path(tmp_path, 2)
    older = {**checkpoint.load_checkpoint(path), "format": checkpoint.FORMAT - 1}
    checkpoint.save_checkpoint(older, tmp_path, 2)  # intact: a checksum of its own
    run = workers.build(config)
    with pytest.raises(checkpoint.CheckpointFormatError) as info:
        workers.train(run, config, checkpoint_dir=tmp_path, resume=True)
    message = str(info.value)
    assert "\n" not in message and not isinstance(info.value, checkpoint.CorruptCheckpointError)
    assert f"{path}: it is a checkpoint of format {checkpoint.FORMAT - 1} " in message
    assert f"this version reads format {checkpoint.FORMAT}" in message
    assert_untouched(run, config)
    assert not (tmp_path / checkpoint.LOCK_NAME).exists()  # the refused run let go
