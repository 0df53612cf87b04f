"""Resume you can trust: exact across shuffled epochs, checked against the data,
the settings and the file's checksum, with a fallback past a corrupt newest checkpoint.

Every refusal here must leave the model as the caller built it: resume checks
everything before it loads anything into the model.
"""

from __future__ import annotations

import random
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import resume_workers as workers  # tests/helpers/resume_workers.py

from accumlab import checkpoint

SHUFFLED = workers.Config(epochs=3, microbatches=5, dropout=0.1)  # 15 microbatches, 8 windows


def fresh_weights(config: workers.Config) -> dict[str, torch.Tensor]:
    return workers._plain(workers.build(config)["model"].state_dict())


def assert_untouched(run: dict[str, Any], config: workers.Config) -> None:
    """The refused run's model still holds the weights it was built with."""
    now = run["model"].state_dict()
    assert all(torch.equal(now[k], v) for k, v in fresh_weights(config).items())


def interrupted(config: workers.Config, directory: Path, stop_after: int, **kwargs: Any) -> None:
    run = workers.build(config)
    workers.train(run, config, max_updates=stop_after, checkpoint_dir=directory, checkpoint_every=1, **kwargs)


# ----------------------------------------------------------------- item 1: shuffled epochs


def test_three_shuffled_epochs_with_dropout_resume_bit_identical(tmp_path: Path) -> None:
    """Interrupted in epoch 2 (after 4 of 8 update attempts: 8 of 15 microbatches read,
    3 of them from epoch 2), resumed with the same call."""
    result = workers.straight_and_resumed(SHUFFLED, str(tmp_path), 4, None)
    diff = workers.max_weight_diff(result["straight"], result["resumed"])
    print(f"3 shuffled epochs, dropout 0.1: largest weight difference {diff}")
    assert workers.mismatches(result["straight"], result["resumed"]) == []
    assert result["resumed"]["ledger"]["update_attempts"] == 8


@pytest.mark.parametrize("stop_after", [1, 2, 3, 5, 6, 7])
def test_every_interruption_point_of_the_shuffled_run_resumes_bit_identical(stop_after: int, tmp_path: Path) -> None:
    result = workers.straight_and_resumed(SHUFFLED, str(tmp_path), stop_after, None)
    assert workers.mismatches(result["straight"], result["resumed"]) == []


def _python_shuffled_epochs(data: list[Any], epochs: int) -> Any:
    """Epochs of the microbatches in an order drawn from Python's ``random`` (not torch's)."""
    for _ in range(epochs):
        yield from random.sample(data, len(data))


def test_epochs_shuffled_by_pythons_random_resume_bit_identical(tmp_path: Path) -> None:
    config = workers.Config(microbatches=5, dropout=0.1)  # 3 epochs: 15 microbatches, 8 windows
    run = workers.build(config)
    straight = workers.snapshot(run, workers.train(run, config, _python_shuffled_epochs(run["data"], 3)))
    first = workers.build(config)
    workers.train(first, config, _python_shuffled_epochs(first["data"], 3), max_updates=4,
                  checkpoint_dir=tmp_path, checkpoint_every=1)  # fmt: skip
    draws = checkpoint.load_checkpoint(checkpoint.checkpoint_path(tmp_path, 4))["data_history"]["rng_draws"]
    assert [(d["window"], sorted(d["rng"])) for d in draws] == [(0, ["python"]), (2, ["python"])]
    second = workers.build(config)
    ledger = workers.train(second, config, _python_shuffled_epochs(second["data"], 3),
                           checkpoint_dir=tmp_path, resume=True)  # fmt: skip
    assert workers.mismatches(straight, workers.snapshot(second, ledger)) == []


def test_the_shuffled_case_needs_the_replayed_draws(tmp_path: Path, monkeypatch: Any) -> None:
    """Control: the epochs' orders do come from the global generator. Without replaying
    the data's draws, epoch 2 is read in another order and the resume is refused."""
    monkeypatch.setattr(checkpoint.replay, "MAX_RNG_DRAWS", 0)
    with pytest.warns(UserWarning, match="drew from the global random generators"):
        interrupted(SHUFFLED, tmp_path, 4)
    run = workers.build(SHUFFLED)
    with pytest.raises(checkpoint.ResumeMismatchError, match=r"window 2 .* not replayed"):
        workers.train(run, SHUFFLED, checkpoint_dir=tmp_path, resume=True)
    assert_untouched(run, SHUFFLED)


# ----------------------------------------------------------------- item 2: the data is checked


def _swapped(data: list[Any], i: int, j: int) -> list[Any]:
    data = list(data)
    data[i], data[j] = data[j], data[i]
    return data


def _no_ids(data: list[Any]) -> list[Any]:
    return [{k: v for k, v in mb.items() if k != "example_ids"} for mb in data]


DATA_CHANGES = {
    # name: (what the resumed run reads instead of the 8 microbatches, first window that differs)
    "another order": (lambda data: _swapped(data, 2, 6), 1),
    "extra examples": (lambda data: data[:3] + workers.token_batches(1, 2, workers.SEQ, 99, 500) + data[3:], 1),
    "an iterator already partly read": (lambda data: iter(data[1:]), 0),
}


@pytest.mark.parametrize("change", list(DATA_CHANGES))
def test_resume_refuses_other_data_naming_the_first_window_that_differs(change: str, tmp_path: Path) -> None:
    config = workers.Config()
    interrupted(config, tmp_path, 3)
    alter, first = DATA_CHANGES[change]
    run = workers.build(config)
    with pytest.raises(checkpoint.ResumeMismatchError, match=f"window {first} .loader microbatches"):
        workers.train(run, config, alter(run["data"]), checkpoint_dir=tmp_path, resume=True)
    assert_untouched(run, config)


def test_without_example_ids_the_tensors_are_compared(tmp_path: Path) -> None:
    config = workers.Config()
    first = workers.build(config)
    workers.train(first, config, _no_ids(first["data"]), max_updates=3, checkpoint_dir=tmp_path)
    run = workers.build(config)
    with pytest.raises(checkpoint.ResumeMismatchError, match="window 1 .loader microbatches 2-3. holds other data"):
        workers.train(run, config, _swapped(_no_ids(run["data"]), 2, 6), checkpoint_dir=tmp_path, resume=True)
    same = workers.build(config)  # the same data without ids resumes
    ledger = workers.train(same, config, _no_ids(same["data"]), checkpoint_dir=tmp_path, resume=True)
    assert ledger.update_attempts == 4


def test_the_shuffled_run_with_a_seeded_sampler_of_another_seed_is_refused(tmp_path: Path) -> None:
    interrupted(SHUFFLED, tmp_path, 4)
    run = workers.build(SHUFFLED)
    seeded = torch.utils.data.DataLoader(workers.examples_of(run["data"]), batch_size=2, shuffle=True,
                                         generator=torch.Generator().manual_seed(7))  # fmt: skip
    epochs = (mb for _ in range(3) for mb in seeded)
    with pytest.raises(checkpoint.ResumeMismatchError, match="window 0 "):
        workers.train(run, SHUFFLED, epochs, checkpoint_dir=tmp_path, resume=True)
    assert_untouched(run, SHUFFLED)


# ----------------------------------------------------------------- item 3 and 8: the settings


def _with_optimizer(run: dict[str, Any], cls: type, scheduler: Any = None, **kwargs: Any) -> dict[str, Any]:
    run["optimizer"] = cls(run["model"].parameters(), **kwargs)
    run["scheduler"] = (scheduler or (lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda u: 1.0 / (1.0 + 0.25 * u))))(run["optimizer"])
    return run


SETTING_CHANGES = {
    # name: (change to a built run or its config, expected text of the refusal)
    "lr": (lambda run, c: (_with_optimizer(run, torch.optim.AdamW, lr=0.1, weight_decay=0.1), c),
           r"optimizer param_groups\[0\]\['lr'\]: 0.003 in the checkpoint, 0.1 now"),
    "weight_decay": (lambda run, c: (_with_optimizer(run, torch.optim.AdamW, lr=3e-3), c),
                     r"\['weight_decay'\]: 0.1 in the checkpoint, 0.01 now"),
    "betas": (lambda run, c: (_with_optimizer(run, torch.optim.AdamW, lr=3e-3, weight_decay=0.1, betas=(0.8, 0.99)), c),
              r"\['betas'\]: \[0.9, 0.999\] in the checkpoint, \[0.8, 0.99\] now"),
    "optimizer class": (lambda run, c: (_with_optimizer(run, torch.optim.SGD, lr=3e-3, momentum=0.9), c),
                        r"optimizer: 'torch.optim.adamw.AdamW' in the checkpoint, 'torch.optim.sgd.SGD' now"),
    "scheduler class": (lambda run, c: (_with_optimizer(run, torch.optim.AdamW, lambda o: torch.optim.lr_scheduler.StepLR(o, 2), lr=3e-3, weight_decay=0.1), c),
                        r"scheduler: 'torch.optim.lr_scheduler.LambdaLR' in the checkpoint, 'torch.optim.lr_scheduler.StepLR' now"),
    "clip_grad_norm": (lambda run, c: (run, workers.Config(clip_grad_norm=0.5)),
                       r"clip_grad_norm: 1.0 in the checkpoint, 0.5 now"),
    "seed": (lambda run, c: (run, c),  # torch.manual_seed(7) below
             r"seed .torch.initial_seed\(\).: 1000 in the checkpoint, 7 now"),
}


@pytest.mark.parametrize("change", list(SETTING_CHANGES))
def test_resume_refuses_a_changed_setting_before_loading_anything(change: str, tmp_path: Path) -> None:
    config = workers.Config()
    interrupted(config, tmp_path, 2)
    alter, message = SETTING_CHANGES[change]
    run, changed = alter(workers.build(config), config)
    if change == "seed":
        torch.manual_seed(7)
    with pytest.raises(checkpoint.ResumeMismatchError, match=message) as info:
        workers.train(run, changed, checkpoint_dir=tmp_path, resume=True)
    assert "start a new run in another checkpoint_dir" in str(info.value)
    assert_untouched(run, config)
    assert not run["optimizer"].state  # nothing was loaded into the optimizer either


def test_the_scheduler_moving_the_lr_is_not_a_changed_setting(tmp_path: Path) -> None:
    """The checkpoint compares the hyper-parameters the run started with: the lr the
    LambdaLR schedule reached by attempt 3 is not a difference."""
    result = workers.straight_and_resumed(workers.Config(), str(tmp_path), 3, None)
    assert workers.mismatches(result["straight"], result["resumed"]) == []
    reports = result["resumed"]["ledger"]["reports"]
    assert reports[0]["lr"] != reports[3]["lr"]


# ----------------------------------------------------------------- items 4 and 7: integrity


def _flip_a_bit_in(path: Path, tensor: torch.Tensor, seed: int) -> None:
    """Flip one bit inside ``tensor``'s bytes as stored in the file at ``path``."""
    raw = bytearray(path.read_bytes())
    stored = tensor.detach().contiguous().view(torch.uint8).numpy().tobytes()
    start = raw.find(stored)
    assert start >= 0 and raw.find(stored, start + 1) < 0  # found once
    at = start + random.Random(seed).randrange(len(stored))
    raw[at] ^= 1 << random.Random(seed + 1).randrange(8)
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("seed", range(5))
def test_a_bit_flip_inside_a_stored_weight_is_caught(seed: int, tmp_path: Path) -> None:
    config = workers.Config()
    interrupted(config, tmp_path, 1)
    path = checkpoint.checkpoint_path(tmp_path, 1)
    weight = checkpoint.load_checkpoint(path)["model"]["blocks.0.attn.qkv.weight"]
    _flip_a_bit_in(path, weight, seed)
    with pytest.raises(checkpoint.CorruptCheckpointError, match="checksum"):
        checkpoint.load_checkpoint(path)


def _cut(path: Path, keep: float) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


@pytest.mark.parametrize("damage", ["bit flip", "zero bytes", "cut at 3%", "cut at 50%", "cut at 99.9%"])
def test_a_corrupt_newest_checkpoint_falls_back_to_the_previous_one(damage: str, tmp_path: Path) -> None:
    config = workers.Config()
    run = workers.build(config)
    straight = workers.snapshot(run, workers.train(run, config))
    interrupted(config, tmp_path, 3)
    newest = checkpoint.checkpoint_path(tmp_path, 3)
    if damage == "bit flip":
        _flip_a_bit_in(newest, checkpoint.load_checkpoint(newest)["model"]["tok_emb.weight"], 0)
    else:
        _cut(newest, 0.0 if damage == "zero bytes" else float(damage.split()[-1][:-1]) / 100)
    second = workers.build(config)
    with pytest.warns(UserWarning, match=r"checkpoint-00000003-rank0.pt is not intact: .*; resuming from checkpoint-00000002-rank0.pt instead") as caught:
        ledger = workers.train(second, config, checkpoint_dir=tmp_path, resume=True)
    print(f"{damage}: {caught[0].message}")
    assert workers.mismatches(straight, workers.snapshot(second, ledger)) == []


def test_no_intact_checkpoint_is_one_error_naming_the_files(tmp_path: Path) -> None:
    config = workers.Config()
    interrupted(config, tmp_path, 3)
    for attempts in (2, 3):
        _cut(checkpoint.checkpoint_path(tmp_path, attempts), 0.5)
    run = workers.build(config)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one error, no warnings before it
        with pytest.raises(checkpoint.CorruptCheckpointError, match="no intact checkpoint") as info:
            workers.train(run, config, checkpoint_dir=tmp_path, resume=True)
    assert "checkpoint-00000003-rank0.pt" in str(info.value) and "checkpoint-00000002-rank0.pt" in str(info.value)
    assert_untouched(run, config)


@pytest.mark.parametrize("keep", [0.0, 0.01, 0.25, 0.5, 0.75, 0.98, 0.9999])
def test_a_checkpoint_cut_anywhere_is_reported_as_corrupt(keep: float, tmp_path: Path) -> None:
    state = {"format": checkpoint.FORMAT, "weights": torch.arange(4096.0)}
    path = checkpoint.save_checkpoint(state, tmp_path, 1)
    _cut(path, keep)
    with pytest.raises(checkpoint.CorruptCheckpointError, match="checkpoint-00000001-rank0.pt"):
        checkpoint.load_checkpoint(path)


# ----------------------------------------------------------------- smaller


def test_an_empty_loader_warns(tmp_path: Path) -> None:
    config = workers.Config()
    run = workers.build(config)
    with pytest.warns(UserWarning, match="no microbatch: 0 update attempts"):
        ledger = workers.train(run, config, [])
    assert ledger.update_attempts == 0


def test_max_updates_below_the_checkpoints_count_says_so(tmp_path: Path) -> None:
    config = workers.Config()
    interrupted(config, tmp_path, 3)
    run = workers.build(config)
    with pytest.warns(UserWarning, match="max_updates=2, but .* after 3 update attempts"):
        ledger = workers.train(run, config, max_updates=2, checkpoint_dir=tmp_path, resume=True)
    assert ledger.update_attempts == 3


def _never() -> Any:
    raise AssertionError("data was read")
    yield


def test_an_unwritable_checkpoint_dir_is_refused_before_training(tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("x")
    run = workers.build(workers.Config())
    with pytest.raises(OSError, match="cannot write checkpoints to checkpoint_dir"):
        workers.train(run, workers.Config(), _never(), checkpoint_dir=tmp_path / "afile" / "ckpt")


@pytest.mark.skipif(
    hasattr(__import__("os"), "geteuid") and __import__("os").geteuid() == 0,
    reason="root writes into a read-only directory",
)
def test_a_read_only_checkpoint_dir_is_refused_before_training(tmp_path: Path) -> None:
    tmp_path.chmod(0o500)
    try:
        run = workers.build(workers.Config())
        with pytest.raises(OSError, match="cannot write checkpoints to checkpoint_dir"):
            workers.train(run, workers.Config(), _never(), checkpoint_dir=tmp_path)
    finally:
        tmp_path.chmod(0o700)


@pytest.mark.parametrize("key, value", [("lr", float("inf")), ("weight_decay", float("nan")), ("betas", (0.9, float("inf")))])
def test_non_finite_hyper_parameters_are_refused_before_training(key: str, value: Any) -> None:
    run = workers.build(workers.Config())
    run["optimizer"].param_groups[0][key] = value
    with pytest.raises(ValueError, match=rf"optimizer.param_groups\[0\]\['{key}'\] is"):
        workers.train(run, workers.Config(), _never())
