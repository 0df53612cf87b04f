"""A run is worked out once: ``train`` derives the data-parallel group, the replicas, the
precision policy, the scaler and the parameters an update steps, and checks its settings,
at its top; no window derives or checks any of them again.

Two gloo ranks train a DDP model for 10 windows, with ``on_oom="raise"`` and ``"shrink"``,
in one launch; a profile function counts the calls of the functions that derive or check
those facts, from the start of the run to the end of each window
(``tests/helpers/setup_workers.py``). Before the run setup every window looked the group
up 4 times (41 lookups in 10 windows).
"""

from __future__ import annotations

from typing import Any

import pytest
from helpers import setup_workers

from accumlab import distributed as ald

WINDOWS = 10
ON_OOM = ["raise", "shrink"]


@pytest.fixture(scope="module")
def runs() -> list[list[dict[str, Any]]]:
    """Every rank's rows, one per ``on_oom``: a single two-rank launch."""
    return ald.launch(
        setup_workers.derivations_per_window, 2, (WINDOWS, ON_OOM), timeout_s=10, deadline_s=120
    )


@pytest.mark.distributed
def test_a_ten_window_ddp_run_looks_the_data_parallel_group_up_once(runs) -> None:
    for rank, rows in enumerate(runs):
        for row in rows:
            assert row["attempts"] == WINDOWS, row
            lookups = row["whole_run"].get("data_parallel_group", 0)
            assert lookups == 1, f"rank {rank}, on_oom={row['on_oom']}: {lookups} lookups"
            assert row["whole_run"].get("Replicas.of") == 1, row


@pytest.mark.distributed
def test_no_window_derives_or_checks_again(runs) -> None:
    """What was called by the end of window 0 is all that was called by the end of the
    run: 0 derivations and 0 checks per window."""
    for rows in runs:
        for row in rows:
            first, *rest = row["after_each_window"]
            assert len(rest) == WINDOWS - 1
            assert all(counts == first for counts in rest), row["on_oom"]
            assert row["whole_run"] == first
            assert first.get("precision_policy") == first.get("update_parameters") == 1


@pytest.mark.distributed
def test_the_ranks_trained_the_same_weights(runs) -> None:
    rank0, rank1 = runs
    assert [r["weights"] for r in rank0] == [r["weights"] for r in rank1]
