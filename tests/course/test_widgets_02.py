"""The token-weighting explorer of notebook 02: the pure function and the widget on it."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import accumlab as al
from accumlab_course.widgets import token_weighting, token_weighting_html, token_weighting_widget


def test_the_512_1536_example():
    result = token_weighting([512, 1536], [2.0, 4.0])
    assert result["targets"] == 2048
    assert result["token_mean"] == 3.5
    assert result["average_of_averages"] == 3.0
    assert result["token_mean_weights"] == (0.25, 0.75)
    assert result["average_of_averages_weights"] == (0.5, 0.5)
    # a target of the small microbatch counts twice as much, one of the big one 2/3 as much
    assert result["target_weight_ratio"] == pytest.approx((2.0, 2 / 3))


def test_sums_2_and_18_over_8_targets():
    # 2 targets summing to 2 (mean 1) and 6 summing to 18 (mean 3): 20 / 8 = 2.5
    result = token_weighting([2, 6], [1.0, 3.0])
    assert result["token_mean"] == 2.5
    assert result["average_of_averages"] == 2.0


def test_token_mean_matches_the_package_objective_on_real_tensors():
    """The pure arithmetic agrees with NextTokenLoss's sums and counts on random logits."""
    g = torch.Generator().manual_seed(0)
    objective = al.NextTokenLoss()
    counts, means, sums = [], [], []
    for rows, width, keep in ((2, 7, 0.9), (5, 4, 0.4), (1, 12, 1.0)):
        labels = torch.randint(0, 9, (rows, width), generator=g)
        labels[torch.rand(rows, width, generator=g) >= keep] = -100
        labels[0, 1] = 3  # at least one target per microbatch
        batch = {"labels": labels}
        logits = torch.randn(rows, width, 9, generator=g, dtype=torch.float64)
        n, s = objective.count(batch), float(objective.loss_sum(logits, batch))
        counts.append(n)
        sums.append(s)
        means.append(s / n)
    result = token_weighting(counts, means)
    assert result["token_mean"] == pytest.approx(sum(sums) / sum(counts), rel=1e-12)
    assert result["average_of_averages"] == pytest.approx(sum(means) / 3, rel=1e-12)


counts_st = st.lists(st.integers(min_value=1, max_value=10_000), min_size=1, max_size=8)


@given(counts_st, st.data())
def test_weights_are_shares_of_the_window(counts, data):
    losses = data.draw(
        st.lists(
            st.floats(min_value=0, max_value=20, allow_nan=False),
            min_size=len(counts), max_size=len(counts),
        )
    )
    result = token_weighting(counts, losses)
    assert math.isclose(sum(result["token_mean_weights"]), 1.0, rel_tol=1e-12)
    assert math.isclose(sum(result["average_of_averages_weights"]), 1.0, rel_tol=1e-12)
    # each loss is its microbatch's mean weighted by its share, under either scheme
    for key, weights in (("token_mean", "token_mean_weights"),
                         ("average_of_averages", "average_of_averages_weights")):
        combined = sum(w * x for w, x in zip(result[weights], losses, strict=True))
        assert result[key] == pytest.approx(combined, rel=1e-9, abs=1e-12)
    # the ratio is the per-target weight under the average of averages over 1/N
    for n, ratio in zip(counts, result["target_weight_ratio"], strict=True):
        assert ratio == pytest.approx((1 / len(counts) / n) * result["targets"], rel=1e-12)
    # both losses lie between the smallest and the largest microbatch mean
    for key in ("token_mean", "average_of_averages"):
        assert min(losses) - 1e-9 <= result[key] <= max(losses) + 1e-9


@given(st.integers(min_value=1, max_value=5000), st.integers(min_value=1, max_value=6), st.data())
def test_equal_counts_make_the_schemes_agree(n, a, data):
    losses = data.draw(st.lists(st.floats(0, 10), min_size=a, max_size=a))
    result = token_weighting([n] * a, losses)
    assert result["token_mean"] == pytest.approx(
        result["average_of_averages"], rel=1e-12, abs=1e-12
    )
    assert result["target_weight_ratio"] == pytest.approx((1.0,) * a)


@pytest.mark.parametrize(
    ("counts", "losses", "error", "match"),
    [
        ([], [], ValueError, "at least one"),
        ([1, 2], [1.0], ValueError, "one entry per microbatch"),
        ([0, 2], [1.0, 1.0], ValueError, r"target_counts\[0\] must be at least 1"),
        ([1.5, 2], [1.0, 1.0], TypeError, r"target_counts\[0\] must be an int"),
        ([True], [1.0], TypeError, r"target_counts\[0\] must be an int"),
        ([3], [float("nan")], ValueError, r"mean_losses\[0\] must be finite"),
        ([3], ["2"], TypeError, r"mean_losses\[0\] must be a number"),
        (5, [1.0], TypeError, "target_counts must be a sequence"),
    ],
)
def test_bad_input_is_named(counts, losses, error, match):
    with pytest.raises(error, match=match):
        token_weighting(counts, losses)


def test_html_shows_both_losses_and_every_microbatch():
    text = token_weighting_html(token_weighting([512, 1536], [2.0, 4.0]))
    assert "token mean <b>3.5000</b>" in text and "average of averages <b>3.0000</b>" in text
    assert ">512</td>" in text and ">1536</td>" in text
    assert "0.250" in text and "0.750" in text and "2.00" in text and "0.67" in text
    with pytest.raises(ValueError, match="missing"):
        token_weighting_html({"token_mean": 1.0})


def test_widget_recomputes_with_the_pure_function():
    widget = token_weighting_widget([512, 1536, 64], [2.0, 4.0, 3.0])
    rows, html_out = widget.children[:-1], widget.children[-1]
    assert len(rows) == 3
    assert html_out.value == token_weighting_html(token_weighting([512, 1536, 64], [2.0, 4.0, 3.0]))
    (count_label, count_slider), (loss_label, loss_slider) = (c.children for c in rows[2].children)
    assert count_label.value == "microbatch 2: targets"
    assert loss_label.value == "microbatch 2: mean loss (nats)"
    count_slider.value = 1536
    loss_slider.value = 4.0
    expected = token_weighting([512, 1536, 1536], [2.0, 4.0, 4.0])
    assert html_out.value == token_weighting_html(expected)
    assert f"{expected['token_mean']:.4f}" in html_out.value


def test_widget_rejects_bad_start_values():
    with pytest.raises(ValueError, match="one entry per microbatch"):
        token_weighting_widget([1, 2], [1.0])


def _px(value: str) -> int:
    assert value.endswith("px"), value
    return int(value[:-2])


def test_sliders_keep_a_track_wide_enough_for_a_mouse():
    """Each slider's width less its label column and readout leaves >= 200 px of track
    (tools/check_widgets.py measures the real track in JupyterLab); labels sit above."""
    from accumlab_course.widgets import READOUT_PX

    widget = token_weighting_widget([512, 1536, 64], [2.0, 4.0, 3.0])
    columns = [column for row in widget.children[:-1] for column in row.children]
    assert len(columns) == 6
    for label, slider in (column.children for column in columns):
        assert label.value.startswith("microbatch ") and slider.description == ""
        track = _px(slider.layout.width) - _px(slider.style.description_width) - READOUT_PX
        assert track >= 200, (label.value, track)


def test_table_cells_are_padded_apart():
    from accumlab_course.widgets import CELL_STYLE, HEADER_STYLE

    text = token_weighting_html(token_weighting([512, 1536], [2.0, 4.0]))
    assert text.count("<th ") == 6 and text.count(f"<th style='{CELL_STYLE};{HEADER_STYLE}'>") == 6
    assert text.count("<td ") == text.count(CELL_STYLE) - 6  # every data cell too
    assert "padding" in CELL_STYLE


def test_headers_never_wrap_leaving_a_lone_symbol():
    """In JupyterLab the header "one target counts ×" wrapped and left "×" alone on
    a line. Headers break only where the table says (<br>), never at a space, and "×" shares
    its line with the words before it."""
    import re

    text = token_weighting_html(token_weighting([512, 1536, 64], [2.0, 4.0, 3.0]))
    headers = re.findall(r"<th style='([^']*)'>(.*?)</th>", text)
    assert len(headers) == 6
    for style, content in headers:
        assert "white-space:nowrap" in style.replace(" ", ""), content
        for line in content.split("<br>"):
            assert line.strip() not in {"×", ""}, content
            if "×" in line:
                assert re.search(r"\w[ \u00a0]?×", line), content


def test_a_saved_explorer_is_a_drawing_with_labelled_sliders():
    from accumlab_course.widgets import SAVED_NOTE

    widget = token_weighting_widget([512, 1536], [2.0, 4.0])
    drawing = widget._repr_mimebundle_()["text/html"]
    assert SAVED_NOTE in drawing
    # each slider is named by the label above it, and shows its value
    assert 'aria-label="microbatch 1: targets"><output class="sw-readout">1536</output>' in drawing
    assert 'aria-label="microbatch 0: mean loss (nats)"><output class="sw-readout">2.00</output>' in drawing
    assert "token mean <b>3.5000</b>" in drawing
