"""Multi-rank decisions are global: every rank skips or applies together, every
data-parallel collective runs on the model's data-parallel group, a compiled DDP model
is accepted, and ranks whose plans disagree are told which field differs.

The tests spawn gloo processes through ``accumlab.distributed.launch`` with a short
process-group timeout, so a rank left alone in a collective fails in seconds, and a
deadline well under a minute per worker. The two-rank workers share one launch
(``helpers/shared_launch.py``); the four-rank one has its own. The workers live in
``tests/helpers/rank_workers.py``.
"""

from __future__ import annotations

import pytest
import torch
from helpers import rank_workers
from helpers.shared_launch import SharedLaunch

from accumlab import distributed as ald

TIMEOUT_S = 10  # process-group timeout: a rank waiting alone in a collective fails fast
DEADLINE_S = 60  # whole launch


FIELDS = ["accumulation_steps", "micro_batch_size", "last_window"]


def launch(fn, nprocs, *args):
    return ald.launch(fn, nprocs, args, timeout_s=TIMEOUT_S, deadline_s=DEADLINE_S)


@pytest.fixture(scope="module")
def two_ranks() -> SharedLaunch:
    combos = [(None, "fp32"), (1.0, "fp32"), (None, "fp16"), (0.5, "fp16")]
    return SharedLaunch(
        2,
        {
            "fsdp2 nonfinite": (rank_workers.fsdp2_nonfinite_shard, (combos,)),
            "compiled ddp": (rank_workers.compiled_ddp, (3,)),
            "plans": (rank_workers.disagreeing_plans, (FIELDS,)),
        },
        timeout_s=TIMEOUT_S,
        deadline_s=DEADLINE_S,
    )


@pytest.mark.distributed
def test_fsdp2_nonfinite_shard_skips_on_every_rank(two_ranks):
    rank0, rank1 = two_ranks["fsdp2 nonfinite"]  # one run per (clip, precision) combination
    assert len(rank0) == len(rank1) == 4
    for run0, run1 in zip(rank0, rank1, strict=True):
        assert run0 == run1, f"ranks disagree for {run0['clip']}, {run0['precision']}"
        applied = [w["applied"] for w in run0["windows"]]
        assert applied == [True, False, True]
        assert run0["windows"][1]["reason"] == "non-finite gradient"
        assert not run0["windows"][1]["changed"]  # the skipped window left the weights
        assert run0["windows"][0]["changed"] and run0["windows"][2]["changed"]
        assert all(w["finite_weights"] for w in run0["windows"])
        # the schedule follows applied updates, the same on both ranks: 1/(u+1)
        assert [w["scheduler_steps"] for w in run0["windows"]] == [1, 1, 2]
        assert [round(w["lr"], 6) for w in run0["windows"]] == [0.05, 0.05, 0.033333]
        if run0["precision"] == "fp16":  # the scale backed off after the skip, on both ranks
            scales = [w["scale"] for w in run0["windows"]]
            assert scales[1] == scales[0] / 2 and scales[2] == scales[1]


@pytest.mark.distributed
def test_data_parallel_collectives_use_the_models_group_not_world():
    windows, a = 2, 2
    results = launch(rank_workers.dp_subgroups, 4, windows, a)
    for rank, result in enumerate(results):
        assert result["attempts"] == windows
        assert len(result["seen"]) == windows
        for seen, expected in zip(result["seen"], result["expected"], strict=True):
            for got, want in zip(seen, expected, strict=True):
                torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=f"rank {rank}")
        # 2 replicas x (windows*a - shard) microbatches of 2 examples; peers not counted twice
        assert result["examples"] == 2 * (2 * windows * a - 1)
        assert result["global_targets"] == [8, 6]


@pytest.mark.distributed
def test_compiled_ddp_model_is_accepted_and_gets_the_rules_gradient(two_ranks):
    rank0, rank1 = two_ranks["compiled ddp"]  # A = 3
    for result in (rank0, rank1):
        assert result["replicas"] == 2
        (seen,) = result["seen"]
        for got, want in zip(seen, result["expected"], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.distributed
def test_ranks_whose_plans_differ_are_told_which_field(two_ranks):
    for messages in two_ranks["plans"]:
        for field in FIELDS:
            assert field in messages[field] and "rank 0" in messages[field], messages[field]
            assert "rank 1" in messages[field]
