"""Exercises of notebooks 03-04 (05's: test_exercises_05.py): every checker passes its
reference solution and names each usual wrong answer; the committed notebooks ship every exercise unsolved (a stub, and a
checker cell that prints the "not attempted yet" line instead of asserting).

``ex04.ddp_window`` is checked on two gloo ranks: all its answers go through one launch.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from accumlab.course.exercises import NOT_ATTEMPTED, ex03, ex04

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


# ---------------------------------------------------------------- 03: the boundary


def _boundary(*order):
    """A window boundary that makes the named calls in the given order."""
    calls = {
        "unscale": lambda m, o, s, n: s.unscale_(o),
        "clip": lambda m, o, s, n: torch.nn.utils.clip_grad_norm_(m.parameters(), n),
        "step": lambda m, o, s, n: s.step(o),
        "optimizer.step": lambda m, o, s, n: o.step(),
        "update": lambda m, o, s, n: s.update(),
        "zero": lambda m, o, s, n: o.zero_grad(set_to_none=True),
    }

    def boundary(model, optimizer, scaler, max_norm):
        for name in order:
            calls[name](model, optimizer, scaler, max_norm)

    return boundary


def test_window_boundary_passes_the_reference(capsys):
    assert ex03.window_boundary.check(ex03.reference_window_boundary)
    assert ex03.window_boundary.check(_boundary("unscale", "clip", "step", "update", "zero"))
    assert "✅ window_boundary: correct" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("order", "named"),
    [
        (
            ("clip", "unscale", "step", "update", "zero"),
            "clipped while still multiplied by the scale",
        ),
        (
            ("unscale", "clip", "optimizer.step", "update", "zero"),
            "scaler.step(optimizer), not optimizer.step()",
        ),
        (("unscale", "clip", "update", "step", "zero"), "scaler.update() ran before scaler.step"),
        (("zero", "unscale", "clip", "step", "update"), "zero_grad() ran before the step"),
        (("unscale", "step", "update", "zero"), "unclipped gradient"),
        (("unscale", "clip", "step", "zero"), "call scaler.update()"),
        (("unscale", "unscale", "clip", "step", "update", "zero"), "called 2 times"),
        (("clip", "step", "update", "zero"), "call scaler.unscale_(optimizer) yourself"),
        (("unscale", "step", "clip", "update", "zero"), "unclipped gradient"),
        (("unscale", "clip", "step", "update"), "finish with optimizer.zero_grad()"),
    ],
)
def test_window_boundary_names_each_mistake(order, named, capsys):
    assert not ex03.window_boundary.check(_boundary(*order))
    out = capsys.readouterr().out
    assert out.startswith("❌ window_boundary:") and named in out, out


# ---------------------------------------------------------------- 03: the microbatch


def _amp(
    *,
    autocast_dtype=torch.float16,
    scale=True,
    backward_scaled=True,
    divide="window",
    boundary_inside=False,
    clear=False,
):
    """An amp_microbatch answer with one decision changed."""

    def answer(model, microbatch, objective, window_count, scaler):
        if clear:
            model.zero_grad(set_to_none=True)
        context = (
            torch.autocast(device_type="cpu", dtype=autocast_dtype)
            if autocast_dtype is not None
            else contextlib.nullcontext()
        )
        with context:
            loss_sum = objective.loss_sum(model(microbatch["x"]), microbatch)
        loss = {
            "window": loss_sum / window_count,
            "own": loss_sum / objective.count(microbatch) / 3,
            "none": loss_sum,
        }[divide]
        scaled = scaler.scale(loss) if scale else loss
        (scaled if backward_scaled else loss).backward()
        if boundary_inside:
            scaler.unscale_(torch.optim.SGD(model.parameters(), lr=0.0))

    return answer


def test_checkers_03_leave_torch_and_the_random_state_alone():
    clip, state = torch.nn.utils.clip_grad_norm_, torch.get_rng_state()
    ex03.window_boundary.check(_boundary("clip", "unscale", "step", "update", "zero"))
    ex03.amp_microbatch.check(_amp(divide="own"))
    assert torch.nn.utils.clip_grad_norm_ is clip
    assert torch.equal(torch.get_rng_state(), state)


def test_stubs_print_the_not_attempted_line(capsys):
    def stub(*args):
        raise NotImplementedError

    for exercise in (
        ex03.amp_microbatch,
        ex03.window_boundary,
        ex04.padding_plan,
        ex04.ddp_window,
    ):
        assert exercise.check(stub) is False
        out = capsys.readouterr().out
        assert out.startswith(f"⏳ {exercise.name}: {NOT_ATTEMPTED}.") and ".solution()" in out


def test_amp_microbatch_passes_the_reference(capsys):
    assert ex03.amp_microbatch.check(ex03.reference_amp_microbatch)
    assert ex03.amp_microbatch.check(_amp())
    assert capsys.readouterr().out.count("✅ amp_microbatch: correct") == 2


@pytest.mark.parametrize(
    ("wrong", "named"),
    [
        (dict(autocast_dtype=None), "forward ran in float32"),
        (dict(autocast_dtype=torch.bfloat16), "dtype=torch.float16"),
        (dict(scale=False), "never passed through scaler.scale"),
        (dict(backward_scaled=False), "1/S of the reference"),
        (dict(divide="own"), "average of averages"),
        (dict(divide="none"), "was not divided"),
        (dict(boundary_inside=True), "inside the microbatch"),
        (dict(clear=True), "only the last microbatch"),
    ],
)
def test_amp_microbatch_names_each_mistake(wrong, named, capsys):
    assert not ex03.amp_microbatch.check(_amp(**wrong))
    out = capsys.readouterr().out
    assert out.startswith("❌ amp_microbatch:") and named in out, out


# ---------------------------------------------------------------- 04: padding plan


def test_padding_plan_passes_the_reference(capsys):
    assert ex04.padding_plan.check(ex04.reference_padding_plan)
    assert "✅ padding_plan: correct" in capsys.readouterr().out


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
    assert out.startswith("❌ padding_plan:") and named in out, out


# ---------------------------------------------------------------- 04: the DDP window
# The answers are sent to the ranks as source text, so they are plain top-level functions.


def right_window(model, window, optimizer, objective):
    optimizer.zero_grad(set_to_none=True)
    count = torch.tensor(sum(objective.count(mb) for mb in window))
    dist.all_reduce(count)
    for i, mb in enumerate(window):
        with contextlib.nullcontext() if i == len(window) - 1 else model.no_sync():
            logits = model(input_ids=mb["input_ids"]).logits
            (objective.loss_sum(logits, mb) * dist.get_world_size() / count).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def without_d(model, window, optimizer, objective):
    optimizer.zero_grad(set_to_none=True)
    count = torch.tensor(sum(objective.count(mb) for mb in window))
    dist.all_reduce(count)
    for i, mb in enumerate(window):
        with contextlib.nullcontext() if i == len(window) - 1 else model.no_sync():
            logits = model(input_ids=mb["input_ids"]).logits
            (objective.loss_sum(logits, mb) / count).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def local_count(model, window, optimizer, objective):
    optimizer.zero_grad(set_to_none=True)
    count = sum(objective.count(mb) for mb in window)
    for i, mb in enumerate(window):
        with contextlib.nullcontext() if i == len(window) - 1 else model.no_sync():
            logits = model(input_ids=mb["input_ids"]).logits
            (objective.loss_sum(logits, mb) / count).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def no_no_sync(model, window, optimizer, objective):
    optimizer.zero_grad(set_to_none=True)
    count = torch.tensor(sum(objective.count(mb) for mb in window))
    dist.all_reduce(count)
    for mb in window:
        logits = model(input_ids=mb["input_ids"]).logits
        (objective.loss_sum(logits, mb) * dist.get_world_size() / count).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def backward_only_no_sync(model, window, optimizer, objective):
    optimizer.zero_grad(set_to_none=True)
    count = torch.tensor(sum(objective.count(mb) for mb in window))
    dist.all_reduce(count)
    for i, mb in enumerate(window):
        loss = objective.loss_sum(model(input_ids=mb["input_ids"]).logits, mb)
        with contextlib.nullcontext() if i == len(window) - 1 else model.no_sync():
            (loss * dist.get_world_size() / count).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def step_per_microbatch(model, window, optimizer, objective):
    count = torch.tensor(sum(objective.count(mb) for mb in window))
    dist.all_reduce(count)
    for mb in window:
        logits = model(input_ids=mb["input_ids"]).logits
        (objective.loss_sum(logits, mb) * dist.get_world_size() / count).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def never_clears(model, window, optimizer, objective):
    count = torch.tensor(sum(objective.count(mb) for mb in window))
    dist.all_reduce(count)
    for i, mb in enumerate(window):
        with contextlib.nullcontext() if i == len(window) - 1 else model.no_sync():
            logits = model(input_ids=mb["input_ids"]).logits
            (objective.loss_sum(logits, mb) * dist.get_world_size() / count).backward()
    optimizer.step()


def all_inside_no_sync(model, window, optimizer, objective):
    optimizer.zero_grad(set_to_none=True)
    count = torch.tensor(sum(objective.count(mb) for mb in window))
    dist.all_reduce(count)
    with model.no_sync():
        for mb in window:
            logits = model(input_ids=mb["input_ids"]).logits
            (objective.loss_sum(logits, mb) * dist.get_world_size() / count).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


DDP_ANSWERS = {
    right_window: None,
    ex04.reference_ddp_window: None,
    without_d: "1/2 of the full batch",
    local_count: "average of averages",
    no_no_sync: "2 gradient synchronizations in a window of 2",
    backward_only_no_sync: "2 gradient synchronizations in a window of 2",
    step_per_microbatch: "optimizer.step() ran 2 times",
    never_clears: "still holds window 0's",
    all_inside_no_sync: "no gradient synchronization at all",
}


@pytest.fixture(scope="module")
def ddp_verdicts():
    answers = list(DDP_ANSWERS)
    return dict(zip(answers, ex04.diagnose_ddp_windows(answers), strict=True))


@pytest.mark.distributed
@pytest.mark.parametrize("answer", list(DDP_ANSWERS), ids=lambda f: f.__name__)
def test_ddp_window_checker(answer, ddp_verdicts):
    expected, verdict = DDP_ANSWERS[answer], ddp_verdicts[answer]
    if expected is None:
        assert verdict is None, verdict
    else:
        assert verdict is not None and expected in verdict, verdict


def test_ddp_window_needs_source_it_can_send():
    assert ex04.diagnose_ddp_windows.__doc__  # documented entry point for several answers
    assert "def in a cell" in ex04._run([print])[0]  # a builtin has no Python source


# ---------------------------------------------------------------- the committed notebooks


EXERCISES = {
    "03_amp_gradscaler.ipynb": {
        "ex03.amp_microbatch": "amp_microbatch",
        "ex03.window_boundary": "window_boundary",
    },
    "04_ddp_no_sync.ipynb": {"ex04.padding_plan": "padding_plan", "ex04.ddp_window": "ddp_window"},
}


def _code_cells(name):
    nb = json.loads((NOTEBOOKS / name).read_text())
    return [c for c in nb["cells"] if c["cell_type"] == "code"]


def _text(cell, key="source"):
    value = cell.get(key, "")
    return "".join(value) if isinstance(value, list) else value


@pytest.mark.parametrize("notebook", list(EXERCISES))
def test_committed_notebook_ships_every_exercise_unsolved(notebook):
    cells = _code_cells(notebook)
    for exercise, function in EXERCISES[notebook].items():
        checkers = [c for c in cells if f"{exercise}.check(" in _text(c)]
        assert checkers, f"{notebook}: no cell calls {exercise}.check"
        for cell in checkers:
            source = _text(cell)
            assert "assert" not in source, f"{notebook}: {exercise}'s checker cell asserts"
            printed = "".join(_text(o, "text") for o in cell.get("outputs", []))
            assert f"⏳ {exercise.split('.')[1]}: {NOT_ATTEMPTED}" in printed, printed
        stubs = [c for c in cells if f"def {function}(" in _text(c)]
        assert stubs, f"{notebook}: no cell defines {function}"
        assert all("raise NotImplementedError" in _text(c) for c in stubs), (
            f"{notebook}: {function} is not a stub"
        )
