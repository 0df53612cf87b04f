"""Exact resume: a run interrupted after j update attempts and resumed from its checkpoint
ends bit-identical to the run trained straight through.

"Bit-identical" is ``torch.equal`` on every weight and every optimizer state tensor, and
equality of the learning rate, the scheduler state, the GradScaler's scale and growth
tracker, and the ledger (counts and every report). Each case prints the largest weight
difference it measured (``pytest -rP`` shows it; it must be 0). The runs are built by
``tests/helpers/resume_workers.py`` from a ``Config`` alone, so a straight run and a resumed one
start from the same seeds.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import resume_workers as workers  # tests/helpers/resume_workers.py

import accumlab as al
from accumlab import checkpoint
from accumlab.memory import MemoryMeter

FP16_SCALER = {"init_scale": 2.0**18, "growth_interval": 1}  # grows, overflows, backs off
FORK = multiprocessing.get_context("fork")


def assert_identical(result: dict[str, Any], case: str) -> None:
    straight, resumed = result["straight"], result["resumed"]
    diff = workers.max_weight_diff(straight, resumed)
    print(f"{case}: largest weight difference {diff}")
    assert workers.mismatches(straight, resumed) == []
    assert diff == 0.0


def oom_budget() -> int:
    """A MemoryMeter budget that window 0 at m=8 exceeds and every window at m=4 fits."""
    def peak(m: int, n: int, first_window: bool) -> int:
        config = workers.Config(m=m, microbatches=n)
        run = workers.build(config)
        run["meter"] = meter = MemoryMeter("cpu")
        workers.train(run, config)
        return meter.windows[0].peak_bytes if first_window else meter.peak_bytes

    big, small = peak(8, 2, True), peak(4, 4, False)
    assert small < big
    return (small + big) // 2


CASES = {
    # name: (config, attempts before the interruption)
    "fp32": (workers.Config(), 2),
    "fp16 with GradScaler": (workers.Config(precision="fp16", scaler=FP16_SCALER, microbatches=12), 2),
    "dropout": (workers.Config(dropout=0.2), 3),
    "short last window": (workers.Config(microbatches=7), 3),
    "short last window dropped": (workers.Config(microbatches=7, last_window="drop"), 2),
}


@pytest.mark.parametrize("case", list(CASES))
def test_interrupted_and_resumed_run_is_bit_identical(case: str, tmp_path: Path) -> None:
    config, stop_after = CASES[case]
    result = workers.straight_and_resumed(config, str(tmp_path), stop_after, None)
    assert_identical(result, case)
    ledger = result["resumed"]["ledger"]
    assert ledger["update_attempts"] > stop_after  # the resumed run trained on
    if case == "fp16 with GradScaler":  # the scale moved both ways across the resume
        reports = ledger["reports"]
        assert {r["applied"] for r in reports} == {True, False}
        assert len({r["scale_after"] for r in reports[stop_after:]}) == 2
    if case == "short last window":
        assert [r["microbatches"] for r in ledger["reports"]] == [2, 2, 2, 1]
    if case == "short last window dropped":
        assert (ledger["update_attempts"], ledger["dropped_windows"]) == (3, 1)


def test_resume_after_an_oom_shrink_is_bit_identical(tmp_path: Path) -> None:
    config = workers.Config(m=8, microbatches=8, budget_bytes=oom_budget())
    result = workers.straight_and_resumed(config, str(tmp_path), 2, None)
    assert_identical(result, "after an OOM shrink")
    # The shrink happened before the interruption and the resumed run kept the smaller
    # microbatch: no second shrink, and every later window ran 4 microbatches of 4.
    ledger = result["resumed"]["ledger"]
    assert ledger["shrinks"] == [
        {"update": 0, "old_micro_batch_size": 8, "new_micro_batch_size": 4, "microbatches": 4}
    ]
    assert [r["microbatches"] for r in ledger["reports"]] == [4, 4, 4, 4]


def test_the_dropout_case_depends_on_the_restored_rng(tmp_path: Path, monkeypatch: Any) -> None:
    """Control: the comparison does see the RNG. Without restoring it, dropout draws
    other masks after the resume and the weights differ."""
    monkeypatch.setattr(checkpoint.resume, "set_rng_state", lambda state: None)
    result = workers.straight_and_resumed(workers.Config(dropout=0.2), str(tmp_path), 3, None)
    assert workers.max_weight_diff(result["straight"], result["resumed"]) > 0


# ----------------------------------------------------------------- the run's own count


def test_max_updates_counts_the_whole_run(tmp_path: Path) -> None:
    """The same call rerun until done: each call trains up to max_updates attempts of the
    whole run; once there, a rerun trains nothing and writes nothing."""
    config = workers.Config(microbatches=12)
    straight = workers.build(config)
    expected = workers.snapshot(straight, workers.train(straight, config, max_updates=5))
    attempts = []
    for stop in (2, 5, 5):
        run = workers.build(config)
        ledger = workers.train(
            run, config, max_updates=stop, checkpoint_dir=tmp_path, checkpoint_every=2, resume=True
        )
        attempts.append(ledger.update_attempts)
    assert attempts == [2, 5, 5]
    assert workers.mismatches(expected, workers.snapshot(run, ledger)) == []
    # every 2 attempts (2, 4) and after the last (5); the newest two are kept
    assert checkpoint.list_checkpoints(tmp_path) == [5, 4]


def test_resume_without_a_checkpoint_starts_fresh(tmp_path: Path) -> None:
    config = workers.Config()
    straight = workers.build(config)
    expected = workers.snapshot(straight, workers.train(straight, config))
    run = workers.build(config)
    ledger = workers.train(run, config, checkpoint_dir=tmp_path / "new", resume=True)
    assert workers.mismatches(expected, workers.snapshot(run, ledger)) == []
    assert checkpoint.list_checkpoints(tmp_path / "new") == [4]  # written after the last attempt


def test_resume_skips_the_trained_windows_without_a_forward_pass(tmp_path: Path) -> None:
    config = workers.Config()  # 8 microbatches, A=2: 4 windows
    first = workers.build(config)
    workers.train(first, config, max_updates=3, checkpoint_dir=tmp_path)
    second = workers.build(config)
    forwards = []
    second["model"].register_forward_pre_hook(lambda module, args: forwards.append(1))
    ledger = workers.train(second, config, checkpoint_dir=tmp_path, resume=True)
    assert len(forwards) == 2  # window 3's two microbatches only
    assert (ledger.loader_batches, ledger.microbatches, ledger.update_attempts) == (8, 8, 4)


def test_a_loader_with_its_own_state_is_restored_not_skipped(tmp_path: Path) -> None:
    config = workers.Config()
    straight = workers.build(config)
    expected = workers.snapshot(straight, workers.train(straight, config))
    first = workers.build(config)
    workers.train(
        first,
        config,
        workers.StatefulBatches(first["data"]),
        max_updates=3,
        checkpoint_dir=tmp_path,
        checkpoint_every=1,
    )
    second = workers.build(config)
    loader = workers.StatefulBatches(second["data"])
    ledger = workers.train(second, config, loader, checkpoint_dir=tmp_path, resume=True)
    assert loader.yielded == 2  # only the last window's microbatches were read again
    assert workers.mismatches(expected, workers.snapshot(second, ledger)) == []


def test_a_stateful_loaders_checkpoint_resumes_a_plain_list_by_skipping(tmp_path: Path) -> None:
    config = workers.Config()
    straight = workers.build(config)
    expected = workers.snapshot(straight, workers.train(straight, config))
    first = workers.build(config)
    workers.train(
        first,
        config,
        workers.StatefulBatches(first["data"]),
        max_updates=3,
        checkpoint_dir=tmp_path,
    )
    second = workers.build(config)
    ledger = workers.train(second, config, checkpoint_dir=tmp_path, resume=True)  # a list
    assert workers.mismatches(expected, workers.snapshot(second, ledger)) == []


def test_resume_refuses_other_data(tmp_path: Path) -> None:
    config = workers.Config()
    run = workers.build(config)
    workers.train(run, config, max_updates=3, checkpoint_dir=tmp_path)
    again = workers.build(config)
    with pytest.raises(ValueError, match="data ended after 1 windows, but the checkpoint was written after 3"):
        workers.train(again, config, again["data"][:2], checkpoint_dir=tmp_path, resume=True)


def test_resume_refuses_another_plan_or_model(tmp_path: Path) -> None:
    config = workers.Config()
    run = workers.build(config)
    workers.train(run, config, max_updates=1, checkpoint_dir=tmp_path)
    other = workers.build(config)
    other["plan"] = al.AccumulationPlan(2, 4)
    with pytest.raises(ValueError, match=r"plan: accumulation_steps 2 in the checkpoint, 4 now"):
        workers.train(other, config, checkpoint_dir=tmp_path, resume=True)
    wider = workers.build(workers.Config(n_embd=32))
    with pytest.raises(ValueError, match=r"model: tok_emb.weight '\[32, 16\] torch.float32' in the checkpoint, '\[32, 32\] torch"):
        workers.train(wider, config, checkpoint_dir=tmp_path, resume=True)
    fp16 = workers.build(workers.Config(precision="fp16", scaler=FP16_SCALER))
    with pytest.raises(ValueError, match=r"precision: 'fp32' in the checkpoint, 'fp16' now"):
        workers.train(fp16, workers.Config(precision="fp16"), checkpoint_dir=tmp_path, resume=True)


def test_a_fresh_run_refuses_a_directory_with_checkpoints(tmp_path: Path) -> None:
    """Its checkpoints could be older than the directory's, which resume would then pick."""
    config = workers.Config()
    run = workers.build(config)
    workers.train(run, config, max_updates=3, checkpoint_dir=tmp_path)
    again = workers.build(config)
    with pytest.raises(ValueError, match="already holds checkpoints .the newest after 3 update attempts.; pass resume=True"):
        workers.train(again, config, max_updates=1, checkpoint_dir=tmp_path)
    assert checkpoint.list_checkpoints(tmp_path) == [3]


def test_checkpoint_arguments_are_checked_before_any_data_is_read(tmp_path: Path) -> None:
    run = workers.build(workers.Config())

    def never() -> Any:
        raise AssertionError("data was read")
        yield

    cases = [
        ({"checkpoint_every": 2}, ValueError, "checkpoint_every needs checkpoint_dir"),
        ({"resume": True}, ValueError, "resume=True needs checkpoint_dir"),
        ({"checkpoint_dir": tmp_path, "checkpoint_every": 0}, ValueError, "checkpoint_every"),
        ({"checkpoint_dir": tmp_path, "resume": "yes"}, TypeError, "resume must be True or False"),
        ({"checkpoint_dir": ""}, ValueError, "empty path"),
        ({"checkpoint_dir": 3}, TypeError, "checkpoint_dir must be a path"),
        ({"checkpoint_dir": Path(__file__)}, ValueError, "is a file, not a directory"),
    ]
    for kwargs, error, message in cases:
        with pytest.raises(error, match=message):
            workers.train(run, workers.Config(), never(), **kwargs)


# ----------------------------------------------------------------- the record comes from the run


def test_record_from_run_alone_records_what_an_fp16_run_used() -> None:
    config = workers.Config(precision="fp16", scaler={"init_scale": 2.0**18, "growth_interval": 1}, microbatches=8)
    run = workers.build(config)
    ledger = workers.train(run, config)
    record = al.RunRecord.from_run(run["plan"], ledger)
    applied = [r for r in ledger.reports if r.applied]
    assert record.precision == "fp16" and record.unit == "target"
    assert record.scaler is not None
    assert record.scaler["init_scale"] == 2.0**18
    assert record.scaler["scale"] == run["scaler"].get_scale() == ledger.reports[-1].scale_after
    assert record.scaler["growth_interval"] == 1
    assert record.clip_grad_norm == config.clip_grad_norm
    assert record.optimizer == "AdamW"
    assert (record.lr_first, record.lr_last) == (applied[0].lr, applied[-1].lr)
    assert record.lr_first != record.lr_last  # the scheduler moved it
    assert record.grad_norm_first == applied[0].grad_norm
    assert record.grad_norm_last == applied[-1].grad_norm
    assert record.grad_norm_largest == max(r.grad_norm for r in applied)
    assert record.largest_microbatch == config.m
    assert record.skipped_nonfinite == ledger.updates_skipped > 0


def test_resumed_run_records_the_first_runs_initial_scale(tmp_path: Path) -> None:
    config = workers.Config(precision="fp16", scaler={"init_scale": 2.0**18, "growth_interval": 1}, microbatches=8)
    first = workers.build(config)
    workers.train(first, config, max_updates=2, checkpoint_dir=tmp_path, checkpoint_every=1)
    second = workers.build(config)
    ledger = workers.train(second, config, checkpoint_dir=tmp_path, resume=True)
    assert ledger.settings["scaler"]["init_scale"] == 2.0**18
    assert ledger.settings["scaler"]["scale"] == second["scaler"].get_scale()


# ----------------------------------------------------------------- the kill test


KILLS = 5


@pytest.mark.skipif(sys.platform == "win32", reason="fork and SIGKILL")
def test_a_loop_of_sigkills_over_shuffled_epochs_with_dropout_resumes_bit_identical(tmp_path: Path) -> None:
    """A child process trains ``workers.KILL_CONFIG`` (three epochs of a shuffled
    DataLoader, dropout 0.1) with a checkpoint after every attempt, resuming from the
    directory. Up to ``KILLS`` times, once it has written a checkpoint newer than the last
    kill left, it is SIGKILLed after a random delay (mid-window, mid-write or between
    epochs) and another is started. Finished with resume=True (here, in this process), the
    run ends with the weights of the run trained straight through.

    Each child is forked from this process (it starts in milliseconds: torch is imported),
    never from a killed one: all that passes from one run to the next is what the killed
    run left in the directory, as between two interpreters."""
    started = time.monotonic()
    directory, out = tmp_path / "ckpt", tmp_path / "weights.pt"
    config = workers.KILL_CONFIG
    total = -(-config.epochs * config.microbatches // config.a)  # the last window is short
    chooser = random.Random()  # its own generator: build() seeds the global one
    landed = []  # the newest checkpoint after each kill that landed mid-run
    killed = None  # the pid of the last run killed, whose lock is left behind
    for _ in range(KILLS):
        before = (checkpoint.list_checkpoints(directory) or [-1])[0]
        if before >= total:
            break  # the last kill landed after the final checkpoint: no window is left to kill
        child = FORK.Process(target=workers.kill_run, args=(str(directory), str(out), workers.KILL_PAUSE_S))
        child.start()
        killed = None
        try:
            while (checkpoint.list_checkpoints(directory) or [-1])[0] <= before:
                assert child.is_alive(), f"the run ended with exit code {child.exitcode} (its stderr is above)"
                assert time.monotonic() - started < 120, "no new checkpoint within 120 s"
                time.sleep(0.01)
            time.sleep(chooser.uniform(0.0, 0.25))
            os.kill(child.pid, signal.SIGKILL)
        finally:
            child.kill()
            child.join()
        if out.exists():
            break  # it finished before the kill
        assert child.exitcode == -signal.SIGKILL
        killed = child.pid
        landed.append(checkpoint.list_checkpoints(directory)[0])
    # Killed mid-run more than once. A kill may also land after the final checkpoint but
    # before the weights are written (a valid moment too: the resume then trains nothing).
    assert len([c for c in landed if c < total]) >= 2, landed
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        workers.kill_run(str(directory), str(out), pause_s=0.0)
    if killed is not None:  # the last run was killed: its lock is taken over, naming it
        assert any(f"taking over the lock left by process {killed} " in str(w.message) for w in caught)
    resumed = torch.load(out, weights_only=True)
    straight = workers.straight_weights()
    diff = max(float((resumed[k] - straight[k]).abs().max()) for k in straight)
    print(f"{len(landed)} kills (newest checkpoint after each: {landed} of {total}); "
          f"largest weight difference {diff}; {time.monotonic() - started:.1f} s")
    assert all(torch.equal(resumed[k], straight[k]) for k in straight)
