"""Tests for accumlab_course.widgets: the pure functions and the widgets built on them."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from accumlab import AccumulationPlan
from accumlab_course.widgets import (
    EFFECTIVE_BATCH_LABELS,
    effective_batch_html,
    effective_batch_table,
    effective_batch_widget,
)

sizes = st.integers(min_value=1, max_value=64)


def test_effective_batch_table_worked_example() -> None:
    # 8 GPUs as 2 replicas of a model split 2-way by tensor and 2-way by pipeline parallelism
    table = effective_batch_table(4, 8, data_parallel_size=2, tensor_parallel_size=2,
                                  pipeline_parallel_size=2)
    assert table == {
        "gpus": 8,
        "gpus_per_replica": 4,
        "replicas": 2,
        "micro_batch_size": 4,
        "accumulation_steps": 8,
        "examples_per_replica_per_update": 32,
        "effective_batch_size": 64,
        "forward_passes_per_update_per_replica": 8,
        "forward_passes_per_update": 16,
    }


def test_defaults_are_one_gpu() -> None:
    table = effective_batch_table(2, 3)
    assert table["gpus"] == table["replicas"] == table["gpus_per_replica"] == 1
    assert table["effective_batch_size"] == 6


@given(m=sizes, a=sizes, d=sizes, t=st.integers(1, 8), p=st.integers(1, 8))
def test_table_agrees_with_plan_and_ignores_model_parallel_gpus(
    m: int, a: int, d: int, t: int, p: int
) -> None:
    table = effective_batch_table(m, a, d, t, p)
    plan = AccumulationPlan(m, a, d)
    assert table["effective_batch_size"] == plan.effective_batch_size
    # tensor/pipeline parallel GPUs add GPUs, never examples
    assert table["effective_batch_size"] == effective_batch_table(m, a, d)["effective_batch_size"]
    assert table["gpus"] == d * t * p
    assert table["gpus"] == table["replicas"] * table["gpus_per_replica"]
    assert table["examples_per_replica_per_update"] * d == table["effective_batch_size"]
    assert table["forward_passes_per_update"] == a * d
    assert set(table) == set(EFFECTIVE_BATCH_LABELS)


@pytest.mark.parametrize(
    ("kwargs", "error", "name"),
    [
        ({"micro_batch_size": 0, "accumulation_steps": 1}, ValueError, "micro_batch_size"),
        ({"micro_batch_size": 1, "accumulation_steps": -2}, ValueError, "accumulation_steps"),
        ({"micro_batch_size": 1, "accumulation_steps": 1, "data_parallel_size": 0},
         ValueError, "data_parallel_size"),
        ({"micro_batch_size": 1, "accumulation_steps": 1, "tensor_parallel_size": 1.5},
         TypeError, "tensor_parallel_size"),
        ({"micro_batch_size": True, "accumulation_steps": 1}, TypeError, "micro_batch_size"),
        ({"micro_batch_size": 1, "accumulation_steps": 1, "pipeline_parallel_size": "2"},
         TypeError, "pipeline_parallel_size"),
    ],
)
def test_bad_sizes_name_the_argument(kwargs: dict, error: type, name: str) -> None:
    with pytest.raises(error, match=name):
        effective_batch_table(**kwargs)


def test_html_shows_every_row_with_its_value() -> None:
    table = effective_batch_table(3, 5, 7)
    text = effective_batch_html(table)
    assert text.count("<tr>") == len(EFFECTIVE_BATCH_LABELS)
    assert "<b>105</b>" in text  # 3 × 5 × 7
    assert "m × A × D" in text
    with pytest.raises(ValueError, match="effective_batch_table"):
        effective_batch_html({"gpus": 1})


def test_widget_starts_on_its_arguments_and_follows_the_sliders() -> None:
    pytest.importorskip("ipywidgets")
    widget = effective_batch_widget(micro_batch_size=2, accumulation_steps=4, data_parallel_size=1)
    *sliders, output = widget.children
    assert output.value == effective_batch_html(effective_batch_table(2, 4, 1))
    by_label = {s.description.split(" ")[0]: s for s in sliders}
    by_label["D"].value = 4
    by_label["T"].value = 2
    assert output.value == effective_batch_html(effective_batch_table(2, 4, 4, 2, 1))
    assert "<b>32</b>" in output.value  # 2 × 4 × 4 examples per update
    by_label["m"].value = 8
    assert output.value == effective_batch_html(effective_batch_table(8, 4, 4, 2, 1))


def test_widget_rejects_bad_start_values() -> None:
    pytest.importorskip("ipywidgets")
    with pytest.raises(ValueError, match="accumulation_steps"):
        effective_batch_widget(accumulation_steps=0)


def test_sliders_keep_a_track_wide_enough_for_a_mouse() -> None:
    """Each slider's width less its label column and readout leaves >= 200 px of track,
    with one label column for all (tools/check_widgets.py measures it in JupyterLab)."""
    pytest.importorskip("ipywidgets")
    from accumlab_course.widgets import READOUT_PX

    *sliders, _ = effective_batch_widget().children
    widths = set()
    for slider in sliders:
        width = int(slider.layout.width.removesuffix("px"))
        label = int(slider.style.description_width.removesuffix("px"))
        assert width - label - READOUT_PX >= 200, slider.description
        widths.add((width, label))
    assert len(widths) == 1  # the tracks line up under one another


def test_table_cells_are_padded_apart() -> None:
    from accumlab_course.widgets import CELL_STYLE

    text = effective_batch_html(effective_batch_table(1, 1))
    assert text.count("<td ") == 2 * len(EFFECTIVE_BATCH_LABELS) == text.count(CELL_STYLE)


def test_a_saved_calculator_is_a_drawing_at_its_settings() -> None:
    """The notebook keeps the widget's drawing (text/html), not its live state: JupyterLab
    shows restored state with a red "disconnected" icon on every part until the cell runs."""
    pytest.importorskip("ipywidgets")
    from accumlab_course.widgets import SAVED_NOTE, SCROLL_HINT

    widget = effective_batch_widget(micro_batch_size=3, accumulation_steps=5, data_parallel_size=7)
    bundle = widget._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle  # live where a kernel runs
    drawing, plain = bundle["text/html"], bundle["text/plain"]
    assert SAVED_NOTE in drawing and SAVED_NOTE in plain and "VBox" not in plain
    for slider, value in zip(widget.children[:5], (3, 5, 7, 1, 1), strict=True):
        assert f'aria-label="{slider.description}"><output class="sw-readout">{value}</output>' in drawing
    assert "<b>105</b>" in drawing  # the table at these settings: 3 × 5 × 7
    assert SCROLL_HINT in drawing and "overflow-x:auto" in drawing
    widget.children[0].value = 4  # the drawing follows the settings when displayed again
    assert "<b>140</b>" in widget._repr_mimebundle_()["text/html"]
