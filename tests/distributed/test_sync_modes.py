"""``sync="window"`` against ``sync="microbatch"``: the same update, different traffic and
gradient memory.

One launch of two gloo ranks (``sync_workers.sync_modes``) trains the same MLP under DDP
and under FSDP2 (``fully_shard`` on each Linear and the root) in both modes, on windows
of A = 3 microbatches of uneven sizes. Checked: both modes give the gradient of the rule
(the mean per-example loss over every example of both ranks, computed in one process
without accumlab) and the same weights after two SGD windows; "window" synchronizes
once per window and "microbatch" A times; under FSDP2, after a non-final microbatch,
"window" holds the full unsharded gradient and "microbatch" only its DTensor shard.
"""

from __future__ import annotations

import pytest
import torch
from helpers import sync_workers  # tests/helpers/sync_workers.py

import accumlab as al
from accumlab import distributed as ald
from accumlab_course.models import TinyGPT

TOL = 1e-6
WINDOWS = 2
CASES = [(w, s) for w in ("ddp", "fsdp2") for s in ("window", "microbatch")]


@pytest.fixture(scope="module")
def ranks():
    return ald.launch(sync_workers.sync_modes, 2, (CASES, WINDOWS), deadline_s=90)


def close(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(
        torch.allclose(x, y, rtol=0, atol=TOL) for x, y in zip(a, b, strict=True)
    )


@pytest.mark.distributed
@pytest.mark.parametrize("wrapper", ["ddp", "fsdp2"])
def test_both_modes_give_the_rule_and_the_same_weights(ranks, wrapper):
    for rank in ranks:
        ref = rank["reference"]
        for sync in ("window", "microbatch"):
            case = rank["cases"][f"{wrapper}/{sync}"]
            assert len(case["gradients"]) == WINDOWS
            for got, want in zip(case["gradients"], ref["gradients"], strict=True):
                assert close(got, want), f"{wrapper}/{sync}: gradient differs from the rule"
            assert close(case["weights"], ref["weights"]), f"{wrapper}/{sync}: weights differ"
        window, micro = (rank["cases"][f"{wrapper}/{s}"] for s in ("window", "microbatch"))
        assert close(window["weights"], micro["weights"])


@pytest.mark.distributed
def test_ddp_syncs_once_per_window_or_once_per_microbatch(ranks):
    a = ranks[0]["accumulation_steps"]
    for rank in ranks:
        assert rank["cases"]["ddp/window"]["syncs"] == [1] * WINDOWS
        assert rank["cases"]["ddp/microbatch"]["syncs"] == [a] * WINDOWS


@pytest.mark.distributed
def test_fsdp2_reduce_scatters_once_per_window_or_once_per_microbatch(ranks):
    a = ranks[0]["accumulation_steps"]
    groups = 2  # one reduce-scatter per fully_shard parameter group (the two Linears)
    for rank in ranks:
        assert rank["cases"]["fsdp2/window"]["syncs"] == [groups] * WINDOWS
        assert rank["cases"]["fsdp2/microbatch"]["syncs"] == [groups * a] * WINDOWS


@pytest.mark.distributed
def test_fsdp2_window_holds_full_gradients_microbatch_holds_shards(ranks):
    a = ranks[0]["accumulation_steps"]
    for rank in ranks:
        window, micro = rank["cases"]["fsdp2/window"], rank["cases"]["fsdp2/microbatch"]
        full = window["full_bytes"]
        # the MLP's dim-0 sizes (8, 8, 2, 2) split evenly over 2 ranks: a shard is half
        shard = full // 2
        assert window["held"][: a - 1] == [full] * (a - 1)
        assert window["sharded"][: a - 1] == [False] * (a - 1)
        assert micro["held"] == [shard] * a
        assert micro["sharded"] == [True] * a
        # after the window's one reduce-scatter "window" is down to the shard as well
        assert window["held"][-1] == shard and window["sharded"][-1]


@pytest.mark.distributed
def test_ddp_holds_full_gradients_in_both_modes(ranks):
    for rank in ranks:
        for sync in ("window", "microbatch"):
            case = rank["cases"][f"ddp/{sync}"]
            assert case["held"] == [case["full_bytes"]] * len(case["held"])


def _gpt_window() -> tuple[TinyGPT, list[dict[str, torch.Tensor]]]:
    torch.manual_seed(0)
    model = TinyGPT(vocab_size=13, n_embd=8, n_layer=1, n_head=2, block_size=6)
    ids = torch.randint(0, 13, (2, 6))
    return model, [{"input_ids": ids, "labels": ids}]


@pytest.mark.parametrize(
    ("bad", "error", "match"),
    [
        ("micro", ValueError, r"sync must be 'window' or 'microbatch', got 'micro'"),
        ("Window", ValueError, r"sync must be 'window' or 'microbatch', got 'Window'"),
        (None, TypeError, r"sync must be a string, 'window' or 'microbatch', got NoneType"),
        (1, TypeError, r"sync must be a string, 'window' or 'microbatch', got int"),
    ],
)
def test_train_window_and_accumulate_name_a_bad_sync(bad, error, match):
    model, window = _gpt_window()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(error, match=match):
        al.train_window(model, window, optimizer, al.NextTokenLoss(), sync=bad)
    with pytest.raises(error, match=match):
        al.accumulate(model, window, al.NextTokenLoss(), sync=bad)
    assert all(p.grad is None for p in model.parameters())  # no backward ran


def test_train_names_a_bad_sync_before_reading_data():
    model, window = _gpt_window()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    plan = al.AccumulationPlan(micro_batch_size=2, accumulation_steps=1)

    def loader():
        raise AssertionError("train read data before checking sync")
        yield window[0]

    with pytest.raises(ValueError, match=r"sync must be 'window' or 'microbatch', got 'all'"):
        al.train(model, loader(), optimizer, plan, al.NextTokenLoss(), sync="all", progress=False)


def test_the_modes_agree_on_a_single_process():
    # without data parallelism there is nothing to synchronize: the same update either way
    weights = {}
    for sync in ("window", "microbatch"):
        model, window = _gpt_window()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        al.train_window(model, window * 3, optimizer, al.NextTokenLoss(), sync=sync)
        weights[sync] = [p.detach().clone() for p in model.parameters()]
    assert all(
        torch.equal(a, b) for a, b in zip(weights["window"], weights["microbatch"], strict=True)
    )
