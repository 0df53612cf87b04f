"""Exercises of notebooks 03-04 (05's: test_exercises_05.py): every checker passes its
reference solution and names each usual wrong answer; the committed notebooks ship every
exercise unsolved (a stub, and a checker cell that prints the "not attempted yet" line
instead of asserting).

``ex04.uneven_window`` is checked on two gloo ranks: its answers go through one launch.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
import torch.distributed as dist

from accumlab_course.exercises import NOT_ATTEMPTED, ex03, ex04

# ---------------------------------------------------------------- 03: the boundary


def _boundary(*order, returns="right"):
    """A window boundary that makes the named calls in the given order and returns
    ``(applied, norm)`` as ``returns`` says."""
    seen = {}

    def clip(m, o, s, n):
        seen["clip"] = float(torch.nn.utils.clip_grad_norm_(m.parameters(), n))

    calls = {
        "unscale": lambda m, o, s, n: s.unscale_(o),
        "clip": clip,
        "norm": lambda m, o, s, n: seen.update(norm=ex03._norm_of(m)),
        "step": lambda m, o, s, n: seen.update(step=s.step(o)),
        "optimizer.step": lambda m, o, s, n: o.step(),
        "update": lambda m, o, s, n: s.update(),
        "zero": lambda m, o, s, n: o.zero_grad(set_to_none=True),
    }

    def boundary(model, optimizer, scaler, max_norm):
        for name in order:
            calls[name](model, optimizer, scaler, max_norm)
        norm = seen.get("norm", seen.get("clip", math.nan))
        applied = {
            "right": math.isfinite(norm),
            "step's return": seen.get("step"),
            "always": True,
            "nothing": None,
        }[returns]
        return None if returns == "nothing" else (applied, norm)

    return boundary


RIGHT_ORDER = ("unscale", "clip", "step", "update", "zero")


def test_window_boundary_passes_the_reference(capsys):
    assert ex03.window_boundary.check(ex03.reference_window_boundary)
    assert capsys.readouterr().out.count("✓ window_boundary: correct") == 1


def test_the_numbered_block_plus_isfinite_fails_on_an_overflow_the_scaler_misses(capsys):
    """Notebook 03's numbered boundary (clip and step every window) with
    ``math.isfinite(norm)`` is no answer: at a scale below 1 a gradient that overflows only
    when unscaled is clipped into nan and stepped on, since the scaler found no inf."""
    assert not ex03.window_boundary.check(_boundary(*RIGHT_ORDER))
    out = capsys.readouterr().out
    assert "the scaler found no inf and scaler.step stepped" in out, out


def test_the_reference_boundary_reports_what_the_optimizer_did():
    """``applied`` is True exactly when optimizer.step() ran, on all three windows the
    checker builds, the overflow the scaler misses included."""
    for seed, poison, overflow in ((3, False, False), (4, True, False), (5, False, True)):
        model, window = ex03._case(seed)
        log, _, error = ex03._run(
            ex03.reference_window_boundary, model, window, 0.01, poison, overflow
        )
        assert error is None
        applied, norm = log.returned
        assert applied == ("optimizer.step" in log.calls) == math.isfinite(norm)
        assert applied == (not poison and not overflow)


@pytest.mark.parametrize(
    ("order", "named"),
    [
        (
            ("clip", "unscale", "step", "update", "zero"),
            "clipped while still multiplied by the scale",
        ),
        (
            ("unscale", "clip", "optimizer.step", "update", "zero"),
            "with an inf gradient the weights changed",
        ),
        (("unscale", "clip", "update", "step", "zero"), "scaler.update() ran before scaler.step"),
        (("zero", "unscale", "clip", "step", "update"), "zero_grad() ran before the step"),
        (("unscale", "norm", "step", "update", "zero"), "unclipped gradient"),
        (("unscale", "clip", "step", "zero"), "call scaler.update()"),
        (("unscale", "unscale", "clip", "step", "update", "zero"), "called 2 times"),
        (("clip", "step", "update", "zero"), "call scaler.unscale_(optimizer) yourself"),
        (("unscale", "step", "clip", "update", "zero"), "unclipped gradient"),
        (("unscale", "clip", "step", "update"), "gradients are left after the boundary"),
        (("norm", "unscale", "clip", "step", "update", "zero"), "times the true norm"),
        (("unscale", "clip", "norm", "step", "update", "zero"), "measured after clipping"),
    ],
)
def test_window_boundary_names_each_mistake(order, named, capsys):
    assert not ex03.window_boundary.check(_boundary(*order))
    out = capsys.readouterr().out
    assert out.startswith("✗ window_boundary:") and named in out, out


@pytest.mark.parametrize(
    ("returns", "named"),
    [
        ("step's return", "applied is None"),
        ("always", "applied is True on a window with an inf gradient"),
        ("nothing", "return (applied, norm)"),
    ],
)
def test_window_boundary_names_each_wrong_return(returns, named, capsys):
    assert not ex03.window_boundary.check(_boundary(*RIGHT_ORDER, returns=returns))
    out = capsys.readouterr().out
    assert out.startswith("✗ window_boundary:") and named in out, out


# Right boundaries written from the exercise's text, not from the reference: another way to
# clear (through the model, or each .grad by hand), the norm from clip_grad_norm_'s return
# value, optimizer.step() called directly once the norm has decided. The checker judges
# what the boundary leaves (weights, scale, gradients, the returned pair), so each passes.


def boundary_clears_through_the_model(model, optimizer, scaler, max_norm):
    scaler.unscale_(optimizer)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)  # the norm before
    applied = bool(torch.isfinite(norm))  # a non-finite gradient was clipped into nan: unused
    if applied:
        scaler.step(optimizer)
    scaler.update()
    model.zero_grad(set_to_none=True)
    return applied, float(norm)


def boundary_steps_the_optimizer_once_the_norm_decided(model, optimizer, scaler, max_norm):
    scaler.unscale_(optimizer)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    applied = bool(torch.isfinite(norm))
    if applied:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        optimizer.step()  # unscaled already, and finite: nothing for the scaler to skip
    scaler.update()
    for p in model.parameters():
        p.grad = None
    return applied, norm.item()


def boundary_zeroes_in_place(model, optimizer, scaler, max_norm):
    scaler.unscale_(optimizer)
    norm = float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]))
    if math.isfinite(norm):
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        scaler.step(optimizer)
    scaler.update()
    for p in model.parameters():
        p.grad.zero_()  # zeros instead of None: a cleared gradient all the same
    return math.isfinite(norm), norm


@pytest.mark.parametrize(
    "answer",
    [boundary_clears_through_the_model, boundary_steps_the_optimizer_once_the_norm_decided,
     boundary_zeroes_in_place],
    ids=lambda f: f.__name__,
)
def test_window_boundary_accepts_any_right_clear_and_step(answer, capsys):
    assert ex03.window_boundary.check(answer), capsys.readouterr().out


# ---------------------------------------------------------------- 03: the scale schedule


def test_scale_schedule_reference_is_what_a_real_gradscaler_does():
    for case in ex03._schedule_cases():
        assert ex03.reference_scale_schedule(*case) == ex03.real_scale_schedule(*case), case


def test_scale_schedule_passes_the_reference(capsys):
    assert ex03.scale_schedule.check(ex03.reference_scale_schedule)
    assert "✓ scale_schedule: correct" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("wrong", "named"),
    [
        (ex03._scale_after, "the scale after that window's update()"),
        (ex03._never_reset, "a skipped window resets"),
        (ex03._grows_every_window, "starts again from zero"),
        (lambda nonfinite, init, interval: [init] * len(nonfinite), "expected ['"),
        (lambda nonfinite, init, interval: [init], "one scale per window"),
        (lambda nonfinite, init, interval: init, "return a list of floats"),
    ],
)
def test_scale_schedule_names_each_mistake(wrong, named, capsys):
    assert not ex03.scale_schedule.check(wrong)
    out = capsys.readouterr().out
    assert out.startswith("✗ scale_schedule:") and named in out, out


def test_checkers_03_leave_torch_and_the_random_state_alone():
    clip, state = torch.nn.utils.clip_grad_norm_, torch.get_rng_state()
    ex03.window_boundary.check(_boundary("clip", "unscale", "step", "update", "zero"))
    ex03.scale_schedule.check(ex03._never_reset)
    assert torch.nn.utils.clip_grad_norm_ is clip
    assert torch.equal(torch.get_rng_state(), state)


def test_stubs_print_the_not_attempted_line(capsys):
    def stub(*args):
        raise NotImplementedError

    for exercise in (
        ex03.scale_schedule,
        ex03.window_boundary,
        ex04.padding_plan,
        ex04.uneven_window,
    ):
        assert exercise.check(stub) is False
        out = capsys.readouterr().out
        assert out.startswith(f"○ {exercise.name}: {NOT_ATTEMPTED}.") and ".solution()" in out


# ---------------------------------------------------------------- 03 and 04: predict first


def test_predictions_03_04_match_what_the_notebooks_compute(capsys):
    half = float(torch.tensor(4e-8).half())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        softmax = str(torch.softmax(torch.randn(2, 3) @ torch.randn(3, 3), dim=-1).dtype)
    right = {
        ex03.fp16_of_4e_8: half,
        ex03.cpu_softmax_dtype: softmax,
        ex03.adamw_steps_after_skip: 2,
        ex04.local_count_mean: (40 / 10 + 270 / 90) / 2,
        ex04.syncs_forward_only: 1,
    }
    wrong = {
        ex03.fp16_of_4e_8: (0, "half of the smallest subnormal"),
        ex03.cpu_softmax_dtype: ("torch.float32", "CUDA autocast's rule"),
        ex03.adamw_steps_after_skip: (3, "number of update attempts"),
        ex04.local_count_mean: (3.1, "the true window mean"),
        ex04.syncs_forward_only: (4, "decides in the forward"),
    }
    for question, answer in right.items():
        assert question.check(...) is False
        assert f"○ {question.name}: {NOT_ATTEMPTED}" in capsys.readouterr().out
        assert question.check(answer), question.name
        bad, named = wrong[question]
        assert not question.check(bad)
        out = capsys.readouterr().out
        assert f"✗ {question.name}:" in out and named in out, out


# ---------------------------------------------------------------- 04: padding plan


def test_padding_plan_passes_the_reference(capsys):
    assert ex04.padding_plan.check(ex04.reference_padding_plan)
    assert "✓ padding_plan: correct" in capsys.readouterr().out


def _own(counts, a):
    return [[a] * (n // a) + ([n % a] if n % a else []) for n in counts]


def _stops_early(counts, a):
    own = _own(counts, a)
    longest = [max(ls[i] for ls in own if i < len(ls)) for i in range(max(map(len, own)))]
    return [[longest[i] - n for i, n in enumerate(ls)] for ls in own]


def _pads_to_a(counts, a):
    own = _own(counts, a)
    attempts = max(map(len, own))
    return [[a - (ls[i] if i < len(ls) else 0) for i in range(attempts)] for ls in own]


def _removes(counts, a):
    own = _own(counts, a)
    attempts = max(map(len, own))
    target = [min(ls[i] if i < len(ls) else 0 for ls in own) for i in range(attempts)]
    return [[t - (ls[i] if i < len(ls) else 0) for i, t in enumerate(target)] for ls in own]


@pytest.mark.parametrize(
    ("wrong", "named"),
    [
        (_stops_early, "different numbers of update attempts"),
        (_pads_to_a, "padded up to A"),
        (_removes, "negative"),
        (lambda counts, a: [[0] for _ in counts], "expected [["),
    ],
)
def test_padding_plan_names_each_mistake(wrong, named, capsys):
    assert not ex04.padding_plan.check(wrong)
    out = capsys.readouterr().out
    assert out.startswith("✗ padding_plan:") and named in out, out


# ---------------------------------------------------------------- 04: the uneven DDP window
# The answers are sent to the ranks as source text, so they are plain top-level functions.
# Windows: both ranks have targets; rank 0 has none; no rank has any.


def right_window(model, window, optimizer, objective):
    optimizer.zero_grad(set_to_none=True)
    count = torch.tensor(sum(objective.count(mb) for mb in window))
    dist.all_reduce(count)
    if int(count) == 0:
        return float("nan")
    logged = torch.zeros(())
    for i, mb in enumerate(window):
        with contextlib.nullcontext() if i == len(window) - 1 else model.no_sync():
            logits = model(input_ids=mb["input_ids"]).logits
            part = objective.loss_sum(logits, mb)
            (part * dist.get_world_size() / count).backward()
        logged += part.detach()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    dist.all_reduce(logged)
    return float(logged / count)


def logs_local_mean(model, window, optimizer, objective):
    # Right update, but the log is this rank's own mean (no all-reduce of the loss).
    optimizer.zero_grad(set_to_none=True)
    mine = sum(objective.count(mb) for mb in window)
    count = torch.tensor(mine)
    dist.all_reduce(count)
    if int(count) == 0:
        return float("nan")
    logged = torch.zeros(())
    for i, mb in enumerate(window):
        with contextlib.nullcontext() if i == len(window) - 1 else model.no_sync():
            part = objective.loss_sum(model(input_ids=mb["input_ids"]).logits, mb)
            (part * dist.get_world_size() / count).backward()
        logged += part.detach()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(logged) / max(mine, 1)


def without_d(model, window, optimizer, objective):
    optimizer.zero_grad(set_to_none=True)
    count = torch.tensor(sum(objective.count(mb) for mb in window))
    dist.all_reduce(count)
    if int(count) == 0:
        return False
    for i, mb in enumerate(window):
        with contextlib.nullcontext() if i == len(window) - 1 else model.no_sync():
            logits = model(input_ids=mb["input_ids"]).logits
            (objective.loss_sum(logits, mb) / count).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return True


def local_count(model, window, optimizer, objective):
    optimizer.zero_grad(set_to_none=True)
    count = torch.tensor(sum(objective.count(mb) for mb in window))
    total = count.clone()
    dist.all_reduce(total)
    if int(total) == 0:
        return False
    for i, mb in enumerate(window):
        with contextlib.nullcontext() if i == len(window) - 1 else model.no_sync():
            logits = model(input_ids=mb["input_ids"]).logits
            (objective.loss_sum(logits, mb) / count).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return True


def steps_without_targets(model, window, optimizer, objective):
    optimizer.zero_grad(set_to_none=True)
    count = torch.tensor(sum(objective.count(mb) for mb in window))
    dist.all_reduce(count)
    for i, mb in enumerate(window):
        with contextlib.nullcontext() if i == len(window) - 1 else model.no_sync():
            logits = model(input_ids=mb["input_ids"]).logits
            (objective.loss_sum(logits, mb) * dist.get_world_size() / count).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return True


def backward_only_no_sync(model, window, optimizer, objective):
    optimizer.zero_grad(set_to_none=True)
    count = torch.tensor(sum(objective.count(mb) for mb in window))
    dist.all_reduce(count)
    if int(count) == 0:
        return False
    for i, mb in enumerate(window):
        loss = objective.loss_sum(model(input_ids=mb["input_ids"]).logits, mb)
        with contextlib.nullcontext() if i == len(window) - 1 else model.no_sync():
            (loss * dist.get_world_size() / count).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return True


def step_per_microbatch(model, window, optimizer, objective):
    count = torch.tensor(sum(objective.count(mb) for mb in window))
    dist.all_reduce(count)
    if int(count) == 0:
        return False
    for mb in window:
        logits = model(input_ids=mb["input_ids"]).logits
        (objective.loss_sum(logits, mb) * dist.get_world_size() / count).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return True


def never_clears(model, window, optimizer, objective):
    count = torch.tensor(sum(objective.count(mb) for mb in window))
    dist.all_reduce(count)
    if int(count) == 0:
        return False
    for i, mb in enumerate(window):
        with contextlib.nullcontext() if i == len(window) - 1 else model.no_sync():
            logits = model(input_ids=mb["input_ids"]).logits
            (objective.loss_sum(logits, mb) * dist.get_world_size() / count).backward()
    optimizer.step()
    return True


def all_inside_no_sync(model, window, optimizer, objective):
    optimizer.zero_grad(set_to_none=True)
    count = torch.tensor(sum(objective.count(mb) for mb in window))
    dist.all_reduce(count)
    if int(count) == 0:
        return False
    with model.no_sync():
        for mb in window:
            logits = model(input_ids=mb["input_ids"]).logits
            (objective.loss_sum(logits, mb) * dist.get_world_size() / count).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return True


def returns_nothing(model, window, optimizer, objective):
    optimizer.zero_grad(set_to_none=True)
    count = torch.tensor(sum(objective.count(mb) for mb in window))
    dist.all_reduce(count)
    if int(count) == 0:
        return
    for i, mb in enumerate(window):
        with contextlib.nullcontext() if i == len(window) - 1 else model.no_sync():
            logits = model(input_ids=mb["input_ids"]).logits
            (objective.loss_sum(logits, mb) * dist.get_world_size() / count).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def forward_only_no_sync(model, window, optimizer, objective):
    # Written from the exercise text in another style: no_sync around the
    # forward only (the notebook measures that this is enough), a float64 count and log,
    # gradients zeroed rather than set to None, None for the window without targets.
    count = torch.tensor(float(sum(objective.count(mb) for mb in window)), dtype=torch.float64)
    dist.all_reduce(count, op=dist.ReduceOp.SUM)
    if count.item() == 0:
        return None
    optimizer.zero_grad(set_to_none=False)
    scale = dist.get_world_size() / count.item()
    last, total_loss = len(window) - 1, torch.zeros((), dtype=torch.float64)
    for i, mb in enumerate(window):
        with model.no_sync() if i < last else contextlib.nullcontext():
            loss_sum = objective.loss_sum(model(input_ids=mb["input_ids"]).logits, mb)
        (loss_sum * scale).backward()
        total_loss += loss_sum.detach().double()
    optimizer.step()
    optimizer.zero_grad(set_to_none=False)
    dist.all_reduce(total_loss)
    return (total_loss / count).item()


def exit_stack_window(model, window, optimizer, objective):
    # Another order: the counts and the log gathered as lists over ranks, no_sync entered
    # through an ExitStack for the first microbatches and left before the last one.
    optimizer.zero_grad(set_to_none=True)
    mine = torch.tensor([objective.count(mb) for mb in window]).sum()
    everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    total = int(sum(everyone))
    if not total:
        return float("nan")
    sums = []
    with contextlib.ExitStack() as stack:
        stack.enter_context(model.no_sync())
        for mb in window[:-1]:
            part = objective.loss_sum(model(input_ids=mb["input_ids"]).logits, mb)
            (part * len(everyone) / total).backward()
            sums.append(part.detach())
    part = objective.loss_sum(model(input_ids=window[-1]["input_ids"]).logits, window[-1])
    (part * len(everyone) / total).backward()
    sums.append(part.detach())
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    mine_sum = torch.stack(sums).sum()
    all_sums = [torch.zeros_like(mine_sum) for _ in everyone]
    dist.all_gather(all_sums, mine_sum)
    return float(sum(all_sums)) / total


DDP_ANSWERS = {
    right_window: None,
    forward_only_no_sync: None,
    exit_stack_window: None,
    logs_local_mean: "this rank's own mean",
    ex04.reference_uneven_window: None,
    without_d: "1/2 of the full batch",
    local_count: "average of averages",
    steps_without_targets: "no targets on any rank, yet optimizer.step() ran",
    backward_only_no_sync: "2 gradient synchronizations in a window of 2",
    step_per_microbatch: "optimizer.step() ran 2 times",
    never_clears: "still holds the previous window's",
    all_inside_no_sync: "no gradient synchronization at all",
    returns_nothing: "return the window's mean loss per target over all ranks",
}


@pytest.fixture(scope="module")
def ddp_verdicts():
    answers = list(DDP_ANSWERS)
    return dict(zip(answers, ex04.diagnose_uneven_windows(answers), strict=True))


@pytest.mark.distributed
@pytest.mark.parametrize("answer", list(DDP_ANSWERS), ids=lambda f: f.__name__)
def test_uneven_window_checker(answer, ddp_verdicts):
    expected, verdict = DDP_ANSWERS[answer], ddp_verdicts[answer]
    if expected is None:
        assert verdict is None, verdict
    else:
        assert verdict is not None and expected in verdict, verdict


def skips_empty_rank(model, window, optimizer, objective):
    optimizer.zero_grad(set_to_none=True)
    count = torch.tensor(sum(objective.count(mb) for mb in window))
    mine = int(count)
    dist.all_reduce(count)
    if int(count) == 0:
        return False
    if mine > 0:  # the mistake: a rank without targets runs nothing
        for i, mb in enumerate(window):
            with contextlib.nullcontext() if i == len(window) - 1 else model.no_sync():
                logits = model(input_ids=mb["input_ids"]).logits
                (objective.loss_sum(logits, mb) * dist.get_world_size() / count).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return True


@pytest.mark.distributed
def test_uneven_window_names_a_rank_that_skips_its_backward():
    # its ranks' collectives no longer pair up, so it gets a launch of its own
    verdict = ex04.diagnose_uneven_windows([skips_empty_rank])[0]
    assert verdict is not None
    assert "ran no backward" in verdict or "did not pair up" in verdict, verdict


def test_uneven_window_needs_source_it_can_send():
    assert ex04.diagnose_uneven_windows.__doc__  # documented entry point for several answers
    assert "def in a cell" in ex04._run([print])[0]  # a builtin has no Python source


# ---------------------------------------------------------------- the committed notebooks


EXERCISES = {
    "03_amp_gradscaler.ipynb": {
        "window_boundary": "ex03",
        "scale_schedule": "ex03",
        "cpu_softmax_dtype": "ex03",
        "fp16_of_4e_8": "ex03",
        "adamw_steps_after_skip": "ex03",
    },
    "04_ddp_no_sync.ipynb": {
        "padding_plan": "ex04",
        "uneven_window": "ex04",
        "local_count_mean": "ex04",
        "syncs_forward_only": "ex04",
    },
}


@pytest.mark.parametrize("notebook", list(EXERCISES))
def test_committed_notebook_ships_every_exercise_unsolved(notebook):
    from helpers.notebook_exercises import assert_unsolved

    assert_unsolved(notebook, EXERCISES[notebook])
