"""Plot helpers: the pure layout functions and the drawn Axes, under the Agg backend."""

from __future__ import annotations

import math

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from accumlab_course.plots import (  # noqa: E402
    EVENT_KINDS,
    RunCurve,
    TimelineRecorder,
    WindowEvent,
    curve_points,
    plot_loss_curves,
    plot_updates_and_examples,
    plot_weights,
    plot_window_timeline,
    record_window,
    run_curve,
    timeline_boxes,
    weight_bars,
)


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def test_curve_points_default_x_is_the_index():
    points = curve_points({"a": [3.0, 2.0, 1.5], "b": (4, 1)})
    assert points == {"a": ([0.0, 1.0, 2.0], [3.0, 2.0, 1.5]), "b": ([0.0, 1.0], [4.0, 1.0])}


def test_curve_points_shared_x_and_nan_gaps():
    points = curve_points({"run": [1.0, float("nan"), 0.5]}, x=[0, 10, 20])
    xs, ys = points["run"]
    assert xs == [0.0, 10.0, 20.0]
    assert ys[0] == 1.0 and math.isnan(ys[1]) and ys[2] == 0.5


@pytest.mark.parametrize(
    ("curves", "x", "error", "match"),
    [
        ({}, None, ValueError, "curves is empty"),
        ([1.0, 2.0], None, TypeError, "mapping"),
        ({"a": []}, None, ValueError, "needs at least one value"),
        ({"a": [1.0, 2.0]}, [0.0], ValueError, "has 2 values but x has 1"),
        ({"a": "12"}, None, TypeError, "sequence of numbers"),
        ({"a": [1.0, True]}, None, TypeError, r"curves\['a'\]\[1\] must be a number"),
    ],
)
def test_curve_points_rejects_bad_input(curves, x, error, match):
    with pytest.raises(error, match=match):
        curve_points(curves, x)


def test_plot_loss_curves_draws_each_series_with_labels():
    curves = {"token mean": [4.0, 3.0, 2.5], "average of averages": [4.0, 3.5, 3.2]}
    ax = plot_loss_curves(
        curves, xlabel="applied updates", ylabel="loss (nats)", x=[0, 5, 10], title="t"
    )
    lines = ax.get_lines()
    assert [line.get_label() for line in lines] == list(curves)
    for line, ys in zip(lines, curves.values(), strict=True):
        assert list(line.get_xdata()) == [0.0, 5.0, 10.0]
        assert list(line.get_ydata()) == ys
    assert ax.get_xlabel() == "applied updates" and ax.get_ylabel() == "loss (nats)"
    assert ax.get_title() == "t"
    assert [t.get_text() for t in ax.get_legend().get_texts()] == list(curves)


def test_plot_loss_curves_draws_on_the_given_axes():
    fig, (left, right) = plt.subplots(1, 2)
    ax = plot_loss_curves({"a": [1.0, 0.5]}, xlabel="x", ylabel="y", ax=right)
    assert ax is right
    assert len(right.get_lines()) == 1 and len(left.get_lines()) == 0
    assert len(fig.axes) == 2


def test_plot_loss_curves_applies_styles_per_label():
    ax = plot_loss_curves(
        {"a": [1.0, 0.5], "b": [2.0, 1.0]},
        xlabel="x",
        ylabel="y",
        styles={"b": {"color": "red", "linestyle": "--"}},
    )
    a, b = ax.get_lines()
    assert b.get_linestyle() == "--" and b.get_color() == "red"
    assert a.get_linestyle() == "-"
    with pytest.raises(ValueError, match=r"styles names \['c'\]"):
        plot_loss_curves({"a": [1.0]}, xlabel="x", ylabel="y", styles={"c": {}})


def test_weight_bars_layout_centres_groups_on_microbatches():
    groups = weight_bars({"token mean": [0.25, 0.75], "average of averages": [0.5, 0.5]})
    assert [g.label for g in groups] == ["token mean", "average of averages"]
    assert all(g.width == pytest.approx(0.4) for g in groups)
    assert groups[0].positions == pytest.approx([-0.2, 0.8])
    assert groups[1].positions == pytest.approx([0.2, 1.2])
    assert groups[0].heights == [0.25, 0.75] and groups[1].heights == [0.5, 0.5]
    # each group of bars is centred on its microbatch index
    for i in range(2):
        assert (groups[0].positions[i] + groups[1].positions[i]) / 2 == pytest.approx(i)


@pytest.mark.parametrize(
    ("weights", "match"),
    [
        ({}, "non-empty mapping"),
        ({"a": [0.5, 0.5], "b": [1.0]}, "same, non-zero number"),
        ({"a": []}, "same, non-zero number"),
        ({"a": [0.5, float("inf")]}, "non-finite"),
    ],
)
def test_weight_bars_rejects_bad_input(weights, match):
    with pytest.raises(ValueError, match=match):
        weight_bars(weights)


def test_weight_bars_rejects_bad_group_width():
    with pytest.raises(ValueError, match="group_width"):
        weight_bars({"a": [1.0]}, group_width=0)


def test_plot_weights_draws_one_container_per_scheme():
    weights = {"token mean": [0.25, 0.75], "average of averages": [0.5, 0.5]}
    ax = plot_weights(weights, labels=["512 targets", "1536 targets"], title="shares")
    assert len(ax.containers) == 2
    for container, heights in zip(ax.containers, weights.values(), strict=True):
        assert [bar.get_height() for bar in container] == pytest.approx(heights)
    assert [t.get_text() for t in ax.get_xticklabels()] == ["512 targets", "1536 targets"]
    assert ax.get_ylabel() == "share of the window" and ax.get_title() == "shares"
    assert [t.get_text() for t in ax.get_legend().get_texts()] == list(weights)


def test_plot_weights_checks_label_count():
    with pytest.raises(ValueError, match="labels has 1 names but there are 2 microbatches"):
        plot_weights({"a": [0.5, 0.5]}, labels=["only one"])


# --- run curves on two axes -------------------------------------------------------------

def test_run_curve_converts_and_keeps_the_counts():
    curve = run_curve([4.0, float("nan"), 3], updates=[0, 2, 4], seen=(0, 64, 128))
    assert curve.updates == [0.0, 2.0, 4.0] and curve.seen == [0.0, 64.0, 128.0]
    assert curve.values[0] == 4.0 and math.isnan(curve.values[1]) and curve.values[2] == 3.0


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"values": [], "updates": [], "seen": []}, ValueError, "values is empty"),
        ({"values": [1.0, 2.0], "updates": [0], "seen": [0, 1]}, ValueError, "updates has 1"),
        ({"values": [1.0, 2.0], "updates": [0, 1], "seen": [8, 4]}, ValueError, "never decrease"),
        ({"values": [1.0], "updates": [-1], "seen": [0]}, ValueError, "finite counts >= 0"),
        ({"values": [1.0], "updates": [0], "seen": [float("inf")]}, ValueError, "finite counts"),
        ({"values": "1", "updates": [0], "seen": [0]}, TypeError, "sequence of numbers"),
    ],
)
def test_run_curve_rejects_bad_input(kwargs, error, match):
    values = kwargs.pop("values")
    with pytest.raises(error, match=match):
        run_curve(values, **kwargs)


def test_plot_updates_and_examples_draws_each_run_on_both_axes():
    runs = {
        "A=1": run_curve([4.0, 3.0, 2.5], updates=[0, 8, 16], seen=[0, 64, 128]),
        "A=4": run_curve([4.0, 3.5, 3.2], updates=[0, 2, 4], seen=[0, 64, 128]),
    }
    left, right = plot_updates_and_examples(runs, ylabel="held-out loss (nats)")
    for ax, field in ((left, "updates"), (right, "seen")):
        lines = ax.get_lines()
        assert [line.get_label() for line in lines] == list(runs)
        for line, curve in zip(lines, runs.values(), strict=True):
            assert list(line.get_xdata()) == getattr(curve, field)
            assert list(line.get_ydata()) == curve.values
    # a run keeps its colour in both panels
    assert [ln.get_color() for ln in left.get_lines()] == [ln.get_color() for ln in right.get_lines()]
    assert left.get_xlabel() == "applied updates" and right.get_xlabel() == "examples seen"
    assert left.get_ylabel() == "held-out loss (nats)"


def test_plot_updates_and_examples_uses_given_axes_and_unit():
    fig, pair = plt.subplots(1, 2)
    curve = run_curve([1.0, 0.5], updates=[0, 1], seen=[0, 500])
    got = plot_updates_and_examples({"r": curve}, ylabel="y", seen_label="tokens seen", axes=pair)
    assert got == (pair[0], pair[1]) and len(fig.axes) == 2
    assert pair[1].get_xlabel() == "tokens seen"


def test_plot_updates_and_examples_rejects_bad_runs():
    with pytest.raises(ValueError, match="non-empty mapping"):
        plot_updates_and_examples({}, ylabel="y")
    with pytest.raises(TypeError, match="must be a RunCurve"):
        plot_updates_and_examples({"r": [1.0, 2.0]}, ylabel="y")
    with pytest.raises(ValueError, match="pair of Axes"):
        curve = RunCurve([1.0], [0.0], [0.0])
        plot_updates_and_examples({"r": curve}, ylabel="y", axes=[plt.gca()])


# ----------------------------------------------------------------------------- the window timeline


def _mlp_window(a=3, seed=0):
    import torch

    from accumlab_course.models import MLP

    torch.manual_seed(seed)
    model = MLP(6, 12, 3)
    g = torch.Generator().manual_seed(seed)
    window = [
        {"x": torch.randn(2, 6, generator=g), "labels": torch.randint(0, 3, (2,), generator=g)}
        for _ in range(a)
    ]
    return model, window, torch.optim.SGD(model.parameters(), lr=0.1)


def _kinds(events):
    return [(e.kind, e.microbatch) for e in events]


def test_record_window_single_device_order():
    import accumlab as al

    model, window, optimizer = _mlp_window(a=3)
    events = record_window(model, window, optimizer, al.ExampleLoss(), clip_grad_norm=0.01)
    micro = [x for i in range(3) for x in (("forward", i), ("backward", i))]
    boundary = [("check", None), ("clip", None), ("step", None), ("clear", None)]
    assert _kinds(events) == [("clear", None), *micro, *boundary]
    starts = [e.start for e in events]
    assert starts == sorted(starts) and all(e.end >= e.start for e in events)
    assert {e.rank for e in events} == {0} and all(e.kind in EVENT_KINDS for e in events)
    assert [e.label for e in events[1:5]] == ["F0", "B0", "F1", "B1"]


def test_record_window_fp16_skipped_update_has_no_step():
    import torch

    import accumlab as al

    model, window, optimizer = _mlp_window(a=2)
    scaler = torch.amp.GradScaler("cpu")
    with al.inject_nonfinite(model.net[0].weight):
        events = record_window(
            model,
            window,
            optimizer,
            al.ExampleLoss(),
            precision="fp16",
            scaler=scaler,
            clip_grad_norm=1.0,
        )
    kinds = [e.kind for e in events]
    assert kinds[-4:] == ["unscale", "check", "update scale", "clear"]
    assert "step" not in kinds and "clip" not in kinds
    check = events[kinds.index("check")]
    assert check.detail == "non-finite" and check.label == "check\ninf!"
    # the next window, finite: unscale, check, clip, step, update the scale, clear
    events = record_window(
        model,
        window,
        optimizer,
        al.ExampleLoss(),
        precision="fp16",
        scaler=scaler,
        clip_grad_norm=1.0,
    )
    tail = ["unscale", "check", "clip", "step", "update scale", "clear"]
    assert [e.kind for e in events][-6:] == tail


def test_recorder_sees_a_hand_written_skip_and_restores_everything():
    import torch

    import accumlab as al
    import accumlab.loop as loop

    model, window, optimizer = _mlp_window(a=2)
    scaler = torch.amp.GradScaler("cpu")
    originals = (loop.total_grad_norm, torch.nn.utils.clip_grad_norm_)
    with TimelineRecorder(model, optimizer, scaler) as rec:
        with al.inject_nonfinite(model.net[0].weight):
            for mb in window:
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = torch.nn.functional.cross_entropy(model(mb["x"]), mb["labels"])
                scaler.scale(loss / 2).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)  # an inf: no optimizer.step()
        scaler.update()
        optimizer.zero_grad()
        with pytest.raises(RuntimeError, match="already recording"):
            TimelineRecorder(model, optimizer).__enter__()
    kinds = [e.kind for e in rec.events]
    assert kinds == [
        "forward",
        "backward",
        "forward",
        "backward",
        "unscale",
        "clip",
        "skip",
        "update scale",
        "clear",
    ]
    assert rec.count("forward") == 2 and rec.count("step") == 0
    assert (loop.total_grad_norm, torch.nn.utils.clip_grad_norm_) == originals
    assert "zero_grad" not in vars(optimizer) and "step" not in vars(scaler)
    assert not model._forward_hooks and not model._forward_pre_hooks
    n = len(rec.events)
    model(window[0]["x"]).sum().backward()  # nothing is recorded any more
    optimizer.zero_grad()
    assert len(rec.events) == n


def test_recorder_undoes_a_failed_start(monkeypatch):
    import torch

    import accumlab.loop as loop

    model, _, optimizer = _mlp_window()
    original = loop.total_grad_norm

    def refuse(*args, **kwargs):
        raise RuntimeError("no hooks today")

    monkeypatch.setattr(torch.nn.utils, "clip_grads_with_norm_", refuse)  # wrapped, not called
    monkeypatch.setattr(type(optimizer), "register_step_post_hook", refuse)
    with pytest.raises(RuntimeError, match="no hooks today"):
        TimelineRecorder(model, optimizer).__enter__()
    assert not model._forward_hooks and not model._forward_pre_hooks
    assert loop.total_grad_norm is original and "zero_grad" not in vars(optimizer)
    monkeypatch.undo()
    with TimelineRecorder(model, optimizer) as rec:  # a failed start leaves no recorder active
        model(torch.ones(1, 6)).sum().backward()
    assert [e.kind for e in rec.events] == ["forward", "backward"]


def test_recorder_rejects_bad_arguments():
    import torch

    model, _, optimizer = _mlp_window()
    with pytest.raises(TypeError, match="optimizer must be"):
        TimelineRecorder(model, model)
    with pytest.raises(TypeError, match="model must be"):
        TimelineRecorder(optimizer, optimizer)
    with pytest.raises(TypeError, match="scaler must be"):
        TimelineRecorder(model, optimizer, scaler=torch.ones(1))


def _event(kind, t, rank=0, microbatch=None, detail=""):
    return WindowEvent(rank, kind, t, t + 0.5, microbatch, detail)


def test_timeline_boxes_one_lane_per_rank_in_order():
    run = [_event("forward", 0.0, 0, 0), _event("backward", 1.0, 0, 0), _event("sync", 2.0, 0, 0)]
    other = [_event("forward", 0.2, 1, 0), _event("backward", 1.1, 1, 0), _event("sync", 2.5, 1, 0)]
    lanes, boxes = timeline_boxes({"DDP": list(reversed(run)) + other, "one": run[:2]})
    assert lanes == ["DDP · rank 0", "DDP · rank 1", "one"]
    assert [(b.lane, b.x, b.label) for b in boxes] == [
        (0, 0.0, "F0"),
        (0, 1.0, "B0"),
        (0, 2.0, "sync"),
        (1, 0.0, "F0"),
        (1, 1.0, "B0"),
        (1, 2.0, "sync"),
        (2, 0.0, "F0"),
        (2, 1.0, "B0"),
    ]
    _, timed = timeline_boxes({"one": run}, order=False)
    assert [b.x for b in timed] == [0.0, 1000.0, 2000.0] and timed[0].width == 500.0


@pytest.mark.parametrize(
    ("runs", "error", "match"),
    [
        ({}, ValueError, "non-empty mapping"),
        ([], ValueError, "non-empty mapping"),
        ({"a": []}, ValueError, "holds no events"),
        ({"a": [("forward", 0.0)]}, TypeError, "WindowEvent"),
    ],
)
def test_timeline_boxes_rejects_bad_input(runs, error, match):
    with pytest.raises(error, match=match):
        timeline_boxes(runs)


def test_plot_window_timeline_draws_a_labelled_box_per_event():
    events = [
        _event("clear", 0),
        _event("forward", 1, microbatch=0),
        _event("check", 2, detail="non-finite"),
        _event("update scale", 3),
    ]
    ax = plot_window_timeline({"fp16": events}, title="one window")
    assert len(ax.patches) == 4
    assert [t.get_text() for t in ax.texts] == ["clear", "F0", "check\ninf!", "update\nscale"]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["fp16"]
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == ["forward", "check", "update scale", "clear"]
    assert ax.get_title() == "one window"


@pytest.mark.distributed
def test_ddp_window_timeline_syncs_once_with_no_sync_and_a_times_without():
    from helpers.shared_launch import SharedLaunch

    from accumlab_course import workers

    a = 3
    syncs = {"window": 1, "microbatch": a}  # the expected syncs per window
    # both timelines from one launch of two ranks
    timelines = SharedLaunch(
        2, {sync: (workers.window_timeline, (a, sync)) for sync in syncs}, deadline_s=None
    )
    for sync, expected in syncs.items():
        per_rank = timelines[sync]
        for rank, events in enumerate(per_rank):
            kinds = [e.kind for e in events]
            assert {e.rank for e in events} == {rank}
            assert kinds.count("sync") == expected and kinds.count("backward") == a
            # every sync follows its microbatch's backward; the boundary follows the last sync
            for i, kind in enumerate(kinds):
                if kind == "sync":
                    assert kinds[i - 1] == "backward"
                    assert events[i].microbatch == events[i - 1].microbatch
            last_sync = len(kinds) - 1 - kinds[::-1].index("sync")
            assert kinds[last_sync + 1 :] == ["check", "clip", "step", "clear"]
            if sync == "window":
                assert events[last_sync].microbatch == a - 1


def test_the_memory_plots_draw_a_bar_per_phase_and_part() -> None:
    from accumlab.memory_records import PhaseRecord, WindowRecord
    from accumlab_course.plots import plot_memory_breakdown, plot_memory_window

    phases = [PhaseRecord(0, "forward", 0, 10, 30, 20), PhaseRecord(0, "backward", 0, 30, 40, 12)]
    window = WindowRecord(index=0, baseline_bytes=10, phases=phases)
    ax = plot_memory_window(window)
    assert len(ax.patches) == 2 * (1 + len(phases))  # entry and peak bars, baseline first
    assert [t.get_text() for t in ax.get_xticklabels()] == ["baseline", "f0", "b0"]
    rows = [{"label": "a", "weights": 1, "gradients": 1, "optimizer_state": 2, "activations": 3}]
    assert len(plot_memory_breakdown(rows).patches) == 4
