"""Decisions of the layers above the core that span ranks: a ledger summed over ranks
(counts add up, the largest microbatch is the largest on any rank, a run record reduces
over the data-parallel group it is given), and the driver's microbatch-size check, which
every rank takes together.

Spawns two gloo processes (workers in ``tests/helpers/layer_rank_workers.py``) with a short
process-group timeout, so a rank left alone in a collective fails in seconds.
"""

from __future__ import annotations

import pytest
from helpers import layer_rank_workers as workers

from accumlab import distributed as ald

TIMEOUT_S = 10
DEADLINE_S = 60


@pytest.mark.distributed
def test_reduce_ledger_takes_the_largest_microbatch_over_ranks():
    rank0, rank1 = ald.launch(
        workers.reduced_over_world, 2, timeout_s=TIMEOUT_S, deadline_s=DEADLINE_S
    )
    assert rank0 == rank1
    assert rank0["largest_microbatch"] == 5  # rank 1's 5, not rank 0's own 3
    assert rank0["examples"] == 10 + 11 and rank0["targets"] == 20 + 21
    assert rank0["update_attempts"] == 1  # the same on every rank: kept, not summed


@pytest.mark.distributed
def test_run_record_reduces_over_the_group_it_is_given():
    rank0, rank1 = ald.launch(
        workers.record_over_own_group, 2, timeout_s=TIMEOUT_S, deadline_s=DEADLINE_S
    )
    assert rank0 == {"examples": 10, "ranks": 1}
    assert rank1 == {"examples": 11, "ranks": 1}


@pytest.mark.distributed
def test_an_oversized_microbatch_on_one_rank_stops_every_rank():
    rank0, rank1 = ald.launch(
        workers.oversized_microbatch_on_one_rank, 2, timeout_s=TIMEOUT_S, deadline_s=DEADLINE_S
    )
    # rank 1 names its own microbatch; rank 0 raises too (not a process-group timeout)
    assert rank1.startswith("microbatch 3 has 3 examples, more than the plan's micro_batch_size=2")
    assert rank0.startswith("a microbatch of data-parallel rank 1 has 3 examples, more than")
