"""Notebook 04's whole window (``workers.amp_ddp_window``: fp16 autocast, one GradScaler, the
global count, × D, ``no_sync``, the boundary) on two gloo ranks against one float32 process
over the same examples: the ranks may run different numbers of microbatches per window."""

from __future__ import annotations

import pytest

import accumlab as al
from accumlab_course import workers
from accumlab_course.ranks import Ranks

FP16_BOUND = 5e-3  # notebook 03's bound for fp16 + GradScaler against float32


@pytest.mark.slow
@pytest.mark.distributed
def test_the_whole_window_matches_one_process_whatever_the_microbatches_per_rank():
    with Ranks(2, timeout_s=20) as ranks:
        for microbatches in ((1, 3), (3, 2)):
            runs = ranks.run(workers.composed_run, (1.0, 0.1, microbatches))
            examples = workers.composed_examples(2, microbatches)
            applied = [w["applied"] for w in runs[0]["windows"]]
            union = [examples[0][i] + examples[1][i] for i in range(len(applied))]
            single = workers.full_batch_run(union, applied, 1.0, 0.1)
            assert applied == [i not in workers.COMPOSED_POISONED for i in range(len(applied))]
            per_window = zip(runs[0]["windows"], runs[1]["windows"], strict=True)
            for i, (w0, w1) in enumerate(per_window):
                assert (w0["microbatches"], w1["microbatches"]) == microbatches
                assert w0["syncs"] == w1["syncs"] == 1  # one sync per window, poisoned or not
                assert w0["applied"] == w1["applied"]  # an inf on rank 0 skips both
                if w0["applied"]:
                    assert al.compare(single["gradients"][i], w0["gradient"]).ok(FP16_BOUND)
                else:
                    assert w0["scale_after"] == w0["scale_before"] / 2 and w0["lr"] is None
            assert al.compare(runs[0]["weights"], runs[1]["weights"]).max_rel_error == 0
            assert al.compare(single["weights"], runs[0]["weights"]).ok(FP16_BOUND)


def test_composed_examples_needs_one_count_per_rank():
    with pytest.raises(ValueError, match="one count of at least 1 per rank"):
        workers.composed_examples(2, (3,))
    with pytest.raises(ValueError, match="one count of at least 1 per rank"):
        workers.composed_examples(2, (0, 2))
