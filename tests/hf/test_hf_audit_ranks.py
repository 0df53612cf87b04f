"""accumlab.hf.audit_trainer under two gloo ranks (the Trainer's own DDP path).

One launch runs every case of ``hf_workers.DDP_CASES`` on both ranks (importing
transformers in a fresh process costs seconds, so the cases share it). Each rank's data
differ (the Trainer's sampler shards 16 examples of uneven length); the reference is the
token mean over the union of both ranks' examples, and the audit's scale is compared with
an independent measurement: one real DDP update at SGD learning rate 1 against that
reference written directly.
"""

from __future__ import annotations

import pytest
from helpers import hf_workers as hw

pytest.importorskip("transformers")

from accumlab import distributed as ald  # noqa: E402


@pytest.fixture(scope="module")
def ranks():
    return ald.launch(hw.ddp_cases, 2, timeout_s=60, deadline_s=400)


@pytest.mark.distributed
@pytest.mark.slow  # two gloo ranks, five jobs each: about 35 s
@pytest.mark.parametrize("case", range(len(hw.DDP_CASES)))
def test_every_rank_gets_the_same_measured_verdict(ranks, case):
    kind, average, causes = hw.DDP_CASES[case]
    rank0, rank1 = ranks[0][case], ranks[1][case]
    assert (rank0["kind"], rank0["average"]) == (kind, average)
    if kind == "unsynced":  # the audit sees ranks holding different gradients
        assert rank0["mistakes"] == rank1["mistakes"] == causes and not rank0["ok"]
        assert rank0["text"] == rank1["text"]
        assert "not synchronised across ranks" in " ".join(rank0["text"].split())
        return
    for r in (rank0, rank1):
        assert r["mistakes"] == causes, r["text"]
        assert r["ok"] is (not causes)
        assert r["ranks"] == 2
        # the reference counts both ranks' targets: the union of their examples
        assert r["targets"] == r["union_targets"] == sum(r["rank_targets"])
        assert r["scale"] == pytest.approx(r["independent_scale"], abs=1e-3)
        assert r["fixed_ok"], "the pasted fix leaves the job wrong"
    assert rank0["scale"] == rank1["scale"] and rank0["text"] == rank1["text"]
    # the ranks hold different numbers of targets, so a per-rank mean shows
    assert len(set(rank0["rank_targets"])) == 2
