"""Decisions of the layers above the core that span ranks: a ledger summed over ranks
(counts add up, the largest microbatch is the largest on any rank, a run record reduces
over the data-parallel group it is given), and the driver's microbatch-size check, which
every rank takes together.

One launch of two gloo processes runs every worker (``tests/helpers/layer_rank_workers.py``,
in turn through ``helpers/shared_launch.py``; each alone if that launch fails) with a short
process-group timeout, so a rank left alone in a collective fails in seconds.
"""

from __future__ import annotations

import pytest
from helpers import layer_rank_workers as workers
from helpers.shared_launch import SharedLaunch

TIMEOUT_S = 10
DEADLINE_S = 60  # per worker


@pytest.fixture(scope="module")
def ranks() -> SharedLaunch:
    return SharedLaunch(
        2,
        {
            "ledger": (workers.reduced_over_world, ()),
            "record": (workers.record_over_own_group, ()),
            "oversized": (workers.oversized_microbatch_on_one_rank, ()),
        },
        timeout_s=TIMEOUT_S,
        deadline_s=DEADLINE_S,
    )


@pytest.mark.distributed
def test_reduce_ledger_takes_the_largest_microbatch_over_ranks(ranks):
    rank0, rank1 = ranks["ledger"]
    assert rank0 == rank1
    assert rank0["largest_microbatch"] == 5  # rank 1's 5, not rank 0's own 3
    assert rank0["examples"] == 10 + 11 and rank0["targets"] == 20 + 21
    assert rank0["update_attempts"] == 1  # the same on every rank: kept, not summed


@pytest.mark.distributed
def test_run_record_reduces_over_the_group_it_is_given(ranks):
    rank0, rank1 = ranks["record"]
    assert rank0 == {"examples": 10, "ranks": 1}
    assert rank1 == {"examples": 11, "ranks": 1}


@pytest.mark.distributed
def test_an_oversized_microbatch_on_one_rank_stops_every_rank(ranks):
    rank0, rank1 = ranks["oversized"]
    # rank 1 names its own microbatch; rank 0 raises too (not a process-group timeout)
    assert rank1.startswith("microbatch 3 has 3 examples, more than the plan's micro_batch_size=2")
    assert rank0.startswith("a microbatch of data-parallel rank 1 has 3 examples, more than")
