"""Data parallelism: the global denominator, one sync per window, uneven ranks, FSDP2.

Tests marked ``distributed`` spawn two gloo processes through ``accumlab.distributed.launch``
(the workers live in ``accumlab_course.workers``; those only tests use in
``tests/helpers/course_workers.py``); each worker has a deadline well under a minute, so a
hang fails the test instead of stalling CI. The workers that succeed on every rank share one
launch (``helpers/shared_launch.py``); the tests of a failing rank launch their own. The others check the same logic in one process:
``aligned_windows`` with the peers' answers simulated, the padding microbatch, the
example-ID checks, the data-parallel size.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import course_workers  # tests/helpers/course_workers.py: workers only the tests launch
from helpers.shared_launch import SharedLaunch
from torch.utils.data.distributed import DistributedSampler

import accumlab as al
from accumlab import distributed as ald
from accumlab.objectives import count_examples
from accumlab_course import data, workers
from accumlab_course.models import TinyGPT

DEADLINE_S = 50  # per launch: a hang fails here, long before the CI budget
RTOL = 1e-5


def launch(fn, *args, **kwargs):
    return ald.launch(fn, 2, args, deadline_s=DEADLINE_S, **kwargs)


# ---------------------------------------------------------------- two gloo processes


@pytest.fixture(scope="module")
def ranks() -> SharedLaunch:
    """The workers of this module's tests that succeed on every rank, in one launch of two
    ranks (``helpers/shared_launch.py``; each launched alone if that one fails)."""
    return SharedLaunch(
        2,
        {
            # DDP, A=4, m=2: rank 0 has 13 short examples (7 microbatches, windows of 4
            # and 3), rank 1 has 10 long ones (5 microbatches, windows of 4 and 1).
            "ddp": (workers.gradient_agreement, ("ddp", 2, 4, (13, 10), False)),
            # FSDP2, A=3 and an iterator without len()
            "fsdp2": (workers.gradient_agreement, ("fsdp2", 2, 3, (13, 10), True)),
            "syncs": (workers.count_syncs, (4, 2)),
            "uneven": (workers.uneven_ranks, ((1, 4), 2)),
            "sampler": (course_workers.sampler_ids, (9,)),
        },
        deadline_s=DEADLINE_S,
    )


@pytest.fixture(scope="module")
def ddp_run(ranks):
    return ranks["ddp"]


@pytest.mark.distributed
def test_ddp_gradient_equals_single_process_full_batch(ddp_run):
    rank0, rank1 = ddp_run
    # the setting is what the test claims: very different counts, short windows that differ
    assert rank0["replicas"] == rank1["replicas"] == 2
    assert sum(rank1["targets_per_window"]) > 10 * sum(rank0["targets_per_window"])
    assert rank0["loader_microbatches"] == 7 and rank1["loader_microbatches"] == 5
    assert rank0["microbatches_per_window"] == rank1["microbatches_per_window"] == [4, 3]
    assert rank0["padding_per_window"] == [0, 0] and rank1["padding_per_window"] == [0, 2]
    # each window's synchronized gradient = the token-mean gradient over both ranks' data
    assert len(rank0["rel_errors"]) == 2
    assert max(rank0["rel_errors"]) <= RTOL
    assert rank0["rel_errors"] == rank1["rel_errors"]  # both ranks hold the same gradient
    assert rank0["global_targets"] == [
        a + b for a, b in zip(rank0["targets_per_window"], rank1["targets_per_window"], strict=True)
    ]


@pytest.mark.distributed
def test_ddp_ledger_counts_own_work_and_record_sums_ranks(ddp_run):
    rank0, rank1 = ddp_run
    l0, l1 = rank0["ledger"], rank1["ledger"]
    assert (l0.examples, l1.examples) == (13, 10)  # padding rows are not examples
    assert (l0.loader_batches, l1.loader_batches) == (7, 5)
    assert (l0.padding_microbatches, l1.padding_microbatches) == (0, 2)
    assert l0.microbatches == l1.microbatches == 7  # padding runs forward and backward
    assert l0.update_attempts == l1.update_attempts == 2
    record = rank0["record"]
    assert record == rank1["record"]
    assert record["data_parallel_size"] == 2
    assert record["examples"] == 23 and record["targets"] == l0.targets + l1.targets
    assert record["extra"]["examples_per_rank"] == [13, 10]
    assert record["extra"]["padding_microbatches_per_rank"] == [0, 2]
    # the window loss in the record is the mean over both ranks' targets
    first = (l0.reports[0].loss_sum + l1.reports[0].loss_sum) / l0.reports[0].global_targets
    assert math.isclose(record["first_loss"], first, rel_tol=1e-9)
    assert rank0["ids"].ok and rank0["ids"].processed == 23


@pytest.mark.distributed
def test_fsdp2_gradient_equals_single_process_full_batch(ranks):
    # A=3 and an iterator without len(): rank 0 has windows of 3, 3, 1; rank 1 of 3, 2,
    # then none, so the ranks agree window by window and rank 1 pads twice.
    rank0, rank1 = ranks["fsdp2"]
    assert rank0["replicas"] == 2
    assert rank0["microbatches_per_window"] == rank1["microbatches_per_window"] == [3, 3, 1]
    assert rank1["padding_per_window"] == [0, 1, 1]
    assert len(rank0["rel_errors"]) == 3 and max(rank0["rel_errors"]) <= RTOL
    # set_requires_gradient_sync(False): no sharded gradient until the last microbatch
    assert rank0["local_until_last"] == [True, True, False]
    assert rank0["ledger"].examples == 13 and rank1["ledger"].examples == 10


@pytest.mark.distributed
def test_one_sync_per_window_with_no_sync_and_a_without(ranks):
    a, windows = 4, 2
    rank0, _ = ranks["syncs"]  # count_syncs(a, windows)
    assert rank0["forward and backward"]["syncs"] == windows  # what accumlab.train does
    assert rank0["none"]["syncs"] == a * windows
    # DDP decides at forward time: a forward outside no_sync syncs anyway
    assert rank0["backward only"]["syncs"] == a * windows
    assert rank0["forward only"]["syncs"] == windows
    for mode in workers.SYNC_MODES:  # the gradient is the same; only the traffic differs
        assert rank0[mode]["windows"] == windows
        assert rank0[mode]["rel_error"] <= RTOL


@pytest.mark.distributed
def test_rank_with_fewer_windows_finishes_and_ranks_stay_identical(ranks):
    # rank 0 has one window, rank 1 four; without alignment rank 1 would wait forever
    rank0, rank1 = ranks["uneven"]
    assert rank0["ledger"].update_attempts == rank1["ledger"].update_attempts == 4
    assert rank0["ledger"].padding_microbatches == 6 and rank1["ledger"].padding_microbatches == 0
    assert rank0["ledger"].examples == 4 and rank1["ledger"].examples == 16
    assert rank0["optimizer_steps"] == rank1["optimizer_steps"] == [4]
    assert rank0["lr"] == rank1["lr"]
    assert rank0["weights_checksum"] == rank1["weights_checksum"]
    assert rank0["record"]["examples"] == 20 and rank0["record"]["update_attempts"] == 4


@pytest.mark.distributed
def test_gathered_ids_catch_distributed_sampler_duplicates(ranks):
    rank0, rank1 = ranks["sampler"]
    padded = rank0["DistributedSampler"]
    assert not padded.ok
    assert padded.duplicates == {0: [0, 1]}  # example 0 repeated to even out the ranks
    assert padded.processed == 10 and padded.omissions == []
    assert rank0["shard"].ok and rank0["shard"].per_rank == [5, 4]
    assert rank1["DistributedSampler"] == padded  # every rank sees the same gathered check


@pytest.mark.distributed
def test_unwrapped_model_in_a_multi_rank_group_is_an_error():
    with pytest.raises(ValueError, match="not wrapped in DistributedDataParallel") as info:
        launch(course_workers.misuse, "plain model")
    assert info.value.rank in (0, 1)
    assert str(info.value).startswith(f"rank {info.value.rank}: ")
    assert isinstance(info.value.__cause__, ald.WorkerTraceback)
    assert "train_window" in info.value.__cause__.text


@pytest.mark.distributed
def test_plan_data_parallel_size_must_match_world_size():
    with pytest.raises(ValueError, match=r"plan.data_parallel_size=1 .* 2 data-parallel"):
        launch(course_workers.misuse, "plan mismatch")


# ---------------------------------------------------------------- one process


def test_launch_rejects_functions_spawned_processes_cannot_import():
    with pytest.raises(ValueError, match="importable module"):
        ald.launch(lambda: None, 2)
    with pytest.raises(ValueError, match="nprocs"):
        ald.launch(workers.whoami, 0)


def test_plan_with_replicas_but_a_plain_model_is_an_error():
    model = torch.nn.Linear(2, 2)
    batches = [{"x": torch.ones(1, 2), "labels": torch.zeros(1, dtype=torch.long)}]
    plan = al.AccumulationPlan(1, 1, data_parallel_size=2)
    with pytest.raises(ValueError, match="data_parallel_size=2 but the model has 1"):
        al.train(
            model,
            batches,
            torch.optim.SGD(model.parameters(), lr=0.1),
            plan,
            al.ExampleLoss(),
            forward=lambda m, b: m(b["x"]),
            progress=False,
        )


def test_data_parallel_size_leaves_out_tensor_and_pipeline_parallel_ranks():
    assert al.data_parallel_size(8) == 8
    assert al.data_parallel_size(16, tensor_parallel_size=2, pipeline_parallel_size=4) == 2
    with pytest.raises(ValueError, match="not a multiple"):
        al.data_parallel_size(6, tensor_parallel_size=4)
    with pytest.raises(ValueError, match="at least 1"):
        al.data_parallel_size(0)


def test_padding_microbatch_adds_no_targets_no_examples_and_zero_gradient():
    batch = data.collate(data.load_examples(limit=3))
    objective = al.NextTokenLoss()
    pad = ald.padding_microbatch(batch, objective)
    assert pad["input_ids"].shape == batch["input_ids"].shape  # shaped like real data
    assert objective.count(pad) == 0
    assert count_examples(pad) == 0 and count_examples(batch) == 3
    assert ald.is_padding(pad) and not ald.is_padding(batch)
    assert ald.example_ids_in([batch, pad]) == batch["example_ids"].tolist()
    torch.manual_seed(0)
    model = TinyGPT(data.VOCAB_SIZE, n_layer=1, n_embd=16)
    loss = objective.loss_sum(model(input_ids=pad["input_ids"]), pad)
    assert loss.requires_grad and float(loss.detach()) == 0.0  # a graph: DDP hooks fire
    loss.backward()
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())


def test_padding_microbatch_for_per_example_losses_has_zero_rows():
    batch = {"x": torch.randn(4, 3), "labels": torch.tensor([0, 1, 0, 1])}
    pad = ald.padding_microbatch(batch, al.ExampleLoss())
    assert pad["x"].shape == (0, 3) and al.ExampleLoss().count(pad) == 0
    assert count_examples(pad) == 0


def test_padding_microbatch_refuses_an_objective_it_cannot_zero():
    class CountsAlways:
        unit = "example"

        def count(self, batch):
            return 1

        def loss_sum(self, output, batch):
            return output.sum()

    with pytest.raises(ValueError, match="zero-target microbatch"):
        ald.padding_microbatch({"labels": torch.zeros(2)}, CountsAlways())


@pytest.mark.parametrize(
    ("counts", "last_window", "expected"),
    [
        ([7, 5], "update", [3, 3, 1]),  # rank 0: 3, 3, 1; rank 1: 3, 2
        ([2, 9], "update", [3, 3, 3]),  # rank 0 runs out after one short window
        ([7, 5], "drop", [3, 3]),  # short windows dropped: rank 0 keeps 3, 3; rank 1 keeps 3
        ([2, 4], "drop", [3]),  # rank 0's only window is short and dropped; it pads
    ],
)
def test_window_lengths_take_the_most_any_rank_trains(counts, last_window, expected):
    plan = al.AccumulationPlan(1, 3, last_window=last_window)
    assert ald.window_lengths(counts, plan) == expected


def _simulate(monkeypatch, per_rank_batches, plan, objective, lazy):
    """Run aligned_windows as each rank would, with the peers' answers to gather_counts
    computed from every rank's data (the all-reduce, simulated)."""
    world = len(per_rank_batches)
    views = []
    for rank in range(world):
        calls = iter(range(10_000))

        def fake_gather(values, rank=rank, calls=calls, group=None):
            k = next(calls)
            if not lazy:
                return [[len(b)] for b in per_rank_batches]
            rows = []
            for batches in per_rank_batches:
                lengths = ald.trained_lengths(len(batches), plan)
                rows.append([lengths[k] if k < len(lengths) else 0, int(len(batches) > 0)])
            assert rows[rank] == list(values)  # this rank reported what the peers see
            return rows

        monkeypatch.setattr(ald.alignment, "is_distributed", lambda: True)
        monkeypatch.setattr(ald.alignment, "gather_counts", fake_gather)
        batches = per_rank_batches[rank]
        views.append(list(ald.aligned_windows(plan, iter(batches) if lazy else batches, objective)))
    return views


@pytest.mark.parametrize("lazy", [False, True])
@pytest.mark.parametrize("last_window", ["update", "drop"])
def test_aligned_windows_give_every_rank_the_same_shape(monkeypatch, lazy, last_window):
    examples = data.load_examples(limit=12)
    rank0 = data.microbatches(examples[:7], 1)  # 7 microbatches
    rank1 = data.microbatches(examples[7:], 1)  # 5 microbatches
    plan = al.AccumulationPlan(1, 3, data_parallel_size=2, last_window=last_window)
    objective = al.NextTokenLoss()
    views = _simulate(monkeypatch, [rank0, rank1], plan, objective, lazy)
    trained = [[w for w in view if w.microbatches] for view in views]
    shapes = [[len(w.microbatches) for w in t] for t in trained]
    assert shapes[0] == shapes[1] == ald.window_lengths([7, 5], plan)
    for view, real in zip(views, (rank0, rank1), strict=True):
        # every real microbatch is trained on or dropped exactly once, in order
        used = [mb for w in view for mb in w.microbatches if not ald.is_padding(mb)]
        dropped = [mb for w in view for mb in w.dropped]
        assert [id(mb) for mb in used + dropped] == [id(mb) for mb in real]
        assert sum(w.loader_batches for w in view) == len(real)
        for w in view:
            padding = w.microbatches[len(w.microbatches) - w.padding :]
            assert all(ald.is_padding(mb) and objective.count(mb) == 0 for mb in padding)
    if last_window == "update":
        assert [w.padding for w in trained[1]] == [0, 1, 1]
    else:  # rank 0 drops its 1, rank 1 its 2
        assert [len(w.dropped) for w in views[0]][-1] == 1
        assert sum(len(w.dropped) for w in views[1]) == 2


def test_aligned_windows_stop_when_len_lies(monkeypatch):
    class Short(list):
        def __len__(self):
            return super().__len__() + 2

    batches = Short(data.microbatches(data.load_examples(limit=3), 1))
    monkeypatch.setattr(ald.alignment, "is_distributed", lambda: True)
    monkeypatch.setattr(ald.alignment, "gather_counts", lambda values, group=None: [[5], [5]])
    plan = al.AccumulationPlan(1, 2, data_parallel_size=2)
    with pytest.raises(RuntimeError, match="len"):
        list(ald.aligned_windows(plan, batches, al.NextTokenLoss()))


def test_aligned_windows_refuse_a_rank_without_data(monkeypatch):
    monkeypatch.setattr(ald.alignment, "is_distributed", lambda: True)
    monkeypatch.setattr(ald.alignment, "gather_counts", lambda values, group=None: [[3], [0]])
    batches = data.microbatches(data.load_examples(limit=3), 1)
    with pytest.raises(ValueError, match=r"rank\(s\) \[1\] have no microbatches"):
        list(ald.aligned_windows(al.AccumulationPlan(1, 2, 2), batches, al.NextTokenLoss()))


def test_aligned_windows_without_a_group_are_the_plan_windows():
    batches = data.microbatches(data.load_examples(limit=5), 1)
    plan = al.AccumulationPlan(1, 2, last_window="drop")
    views = list(ald.aligned_windows(plan, batches, al.NextTokenLoss()))
    assert [len(w.microbatches) for w in views] == [2, 2, 0]
    assert [len(w.dropped) for w in views] == [0, 0, 1]
    assert all(w.padding == 0 for w in views)


def test_check_example_ids_reports_duplicates_and_omissions():
    check = ald.check_example_ids([[0, 1, 2, 2], [3, 0]], expected=range(6))
    assert check.duplicates == {0: [0, 1], 2: [0, 0]}
    assert check.omissions == [4, 5] and check.unexpected == []
    assert not check.ok and "duplicated" in str(check) and "omitted" in str(check)
    clean = ald.check_example_ids([[0, 2], [1]], expected=[0, 1, 2])
    assert clean.ok and clean.per_rank == [2, 1]


def test_distributed_sampler_pads_and_shard_does_not():
    ids = list(range(9))
    padded = [
        list(DistributedSampler(ids, num_replicas=2, rank=r, shuffle=False)) for r in range(2)
    ]
    assert ald.check_example_ids(padded, expected=ids).duplicates == {0: [0, 1]}
    sharded = [ald.shard(ids, r, 2) for r in range(2)]
    assert ald.check_example_ids(sharded, expected=ids).ok
    with pytest.raises(ValueError, match="rank"):
        ald.shard(ids, 2, 2)


def test_run_record_reduced_over_ranks_without_a_group_is_the_local_record():
    ledger = al.Ledger(examples=3, targets=10)
    plan = al.AccumulationPlan(1, 1)
    reduced = al.RunRecord.from_run(plan, ledger, reduce_over_ranks=True)
    assert reduced.examples == 3 and reduced.targets == 10
    assert reduced.extra["examples_per_rank"] == [3]


def test_exercise_padding_plan_checker(capsys):
    from accumlab_course.exercises import ex04

    assert ex04.padding_plan.check(ex04.reference_padding_plan)

    def stops_early(counts, a):
        own = [[a] * (n // a) + ([n % a] if n % a else []) for n in counts]
        longest = [max(ls[i] for ls in own if i < len(ls)) for i in range(max(map(len, own)))]
        return [[longest[i] - n for i, n in enumerate(ls)] for ls in own]

    def pads_to_a(counts, a):
        own = [[a] * (n // a) + ([n % a] if n % a else []) for n in counts]
        attempts = max(map(len, own))
        return [[a - (ls[i] if i < len(ls) else 0) for i in range(attempts)] for ls in own]

    assert not ex04.padding_plan.check(stops_early)
    assert "different numbers of update attempts" in capsys.readouterr().out
    assert not ex04.padding_plan.check(pads_to_a)
    assert "padded up to A" in capsys.readouterr().out
    assert not ex04.padding_plan.check(lambda counts, a: [[0] for _ in counts])
    assert "✗" in capsys.readouterr().out


@pytest.mark.distributed
def test_launch_stops_every_worker_at_the_first_failure():
    # rank 0 waits in a barrier for rank 1, which fails; launch must not wait for the
    # 60 s process-group timeout (the deadline is shorter) and must show rank 1's output
    with pytest.raises(ValueError, match="rank 1: deliberate failure") as info:
        ald.launch(course_workers.fail_on_rank, 2, (1,), timeout_s=60, deadline_s=45)
    assert info.value.rank == 1
    assert "rank 1 is about to fail" in info.value.__cause__.text  # its stderr, captured
