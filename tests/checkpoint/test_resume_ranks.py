"""Resume under data parallelism, two gloo ranks: exact with DDP (ranks a checkpoint
apart, uneven data, dropout) and with FSDP2 (each rank's shards checksummed), a corrupt
newest checkpoint on one rank sends both back together, and a setting changed on one rank
is refused on every rank (none left waiting in a collective).

All four cases run in one launch (``resume_workers.two_rank_cases``): two fresh
interpreters and a process group are started once for the module, not once per case
(a quarter of the CPU time). Still over 5 s, the module is in the slow tier: ``make
slow`` runs it, and CI runs ``make slow`` after ``make test``.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from helpers import resume_workers as workers  # tests/helpers/resume_workers.py

import accumlab as al

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Each rank's results of every case, in rank order."""
    started = time.monotonic()
    results = al.distributed.launch(workers.two_rank_cases, 2, (str(tmp_path_factory.mktemp("ranks")),),
                                    deadline_s=300)
    print(f"four two-rank cases in one launch: {time.monotonic() - started:.1f} s")
    return results


def assert_identical(result: dict[str, Any], case: str) -> None:
    diff = workers.max_weight_diff(result["straight"], result["resumed"])
    print(f"{case}: largest weight difference {diff}")
    assert workers.mismatches(result["straight"], result["resumed"]) == []
    assert diff == 0.0


def test_two_gloo_ranks_resume_bit_identical(ranks: list[dict[str, Any]]) -> None:
    for rank, results in enumerate(ranks):
        for mode, result in results["resume"].items():
            assert result["agreed"] == 3  # rank 0 also had checkpoint 4, rank 1 did not
            assert_identical(result, f"2 gloo ranks, rank {rank}, windows by {mode}")
            pads = [r["padding_microbatches"] for r in result["resumed"]["ledger"]["reports"]]
            assert pads == ([0, 0, 0, 0] if rank == 0 else [0, 0, 1, 1])


def test_two_ranks_fall_back_together_when_one_rank_cannot_read_its_newest(ranks: list[dict[str, Any]]) -> None:
    results = [r["fallback"] for r in ranks]
    for result in results:
        assert workers.mismatches(result["straight"], result["resumed"]) == []
        assert len(result["warnings"]) == 1
        assert result["newest"] == 4  # trained on from 3, and wrote 4 again
    assert "checkpoint-00000004-rank0.pt is not intact" in results[0]["warnings"][0]
    assert "checkpoint-00000004-rank1.pt is intact, but rank(s) [0] cannot read theirs" in results[1]["warnings"][0]


def test_two_fsdp2_ranks_resume_bit_identical(ranks: list[dict[str, Any]]) -> None:
    """The checksum covers each rank's shards (DTensors) of the weights and optimizer state."""
    for result in (r["fsdp2"] for r in ranks):
        assert workers.mismatches(result["straight"], result["resumed"]) == []
        assert result["resumed"]["ledger"]["update_attempts"] == 4


def test_a_setting_changed_on_one_rank_is_refused_on_every_rank(ranks: list[dict[str, Any]]) -> None:
    errors = [r["refusal"] for r in ranks]
    assert "rank(s) [1] differ from the run that wrote it" in errors[0]
    assert "optimizer param_groups[0]['lr']: 0.003 in the checkpoint, 0.1 now" in errors[1]
