"""MemoryMeter (phases, peaks, saved activations, budget) and OOM shrink in the loop.

Byte counts on CPU come from the meter's storage tracking, which is exact for what it
sees: the weights of a float32 model are ``4 × parameters`` bytes, Adam's state twice
that. Where a figure depends on kernels (activations), tests compare ratios.
"""

from __future__ import annotations

import gc
import json
from collections.abc import Mapping, Sequence
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

import accumlab as al
from accumlab.distributed import gather_counts, launch
from accumlab.memory import MemoryMeter, format_bytes
from accumlab.oom import CannotShrinkError
from accumlab_course.data import VOCAB_SIZE
from accumlab_course.models import TinyGPT, count_parameters

torch.set_num_threads(1)
OBJECTIVE = al.NextTokenLoss()


def gpt(seed: int = 0, **kwargs: Any) -> TinyGPT:
    torch.manual_seed(seed)
    config = {"block_size": 64, "n_layer": 2, "n_head": 2, "n_embd": 32, **kwargs}
    return TinyGPT(VOCAB_SIZE, **config)


def token_rows(n: int, seq: int, seed: int = 0, first_id: int = 0) -> dict[str, Tensor]:
    """``n`` examples of ``seq`` tokens, every position after the first a target."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, VOCAB_SIZE, (n, seq), generator=g)
    return {
        "input_ids": ids,
        "labels": ids.clone(),
        "example_ids": torch.arange(first_id, first_id + n),
    }


def loader(examples: int, m: int, seq: int = 32, seed: int = 0) -> list[dict[str, Tensor]]:
    """The same ``examples`` examples cut into microbatches of ``m``."""
    return al.split_batch(token_rows(examples, seq, seed), [m] * (examples // m))


def param_bytes(model: nn.Module) -> int:
    return 4 * count_parameters(model)


def run(
    m: int,
    steps: int,
    *,
    budget: int | None = None,
    model: nn.Module | None = None,
    examples: int = 32,
    seq: int = 32,
    on_oom: str = "shrink",
) -> tuple[nn.Module, al.Ledger, MemoryMeter]:
    model = model if model is not None else gpt()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    meter = MemoryMeter("cpu", budget_bytes=budget)
    ledger = al.train(
        model,
        loader(examples, m, seq),
        optimizer,
        al.AccumulationPlan(m, steps),
        OBJECTIVE,
        meter=meter,
        progress=False,
        on_oom=on_oom,  # type: ignore[arg-type]
    )
    return model, ledger, meter


def max_abs_diff(a: nn.Module, b: nn.Module) -> float:
    return max(
        float((p.detach() - q.detach()).abs().max())
        for p, q in zip(a.parameters(), b.parameters(), strict=True)
    )


# --------------------------------------------------------------------- the meter itself


def test_activation_bytes_saved_for_backward_scale_linearly_with_the_microbatch() -> None:
    model = gpt()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    saved = {}
    for m in (1, 2, 4, 8):
        meter = MemoryMeter("cpu")
        al.train_window(model, [token_rows(m, 32, seed=m)], optimizer, OBJECTIVE, meter=meter)
        saved[m] = meter.last_window.saved_bytes[0]
    per_example = saved[1]
    assert per_example > 50 * param_bytes(model) / 100  # activations, not a few scalars
    for m, value in saved.items():
        assert value == pytest.approx(m * per_example, rel=0.05), (m, value, per_example)


def test_weights_gradients_and_optimizer_state_appear_where_the_course_says() -> None:
    model = gpt()
    weights = param_bytes(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    meter = MemoryMeter("cpu")
    window = loader(8, 4)
    for _ in range(3):
        al.train_window(model, window, optimizer, OBJECTIVE, meter=meter)
    first, second, third = meter.windows
    # Window 0: only the weights before the first microbatch; no optimizer state until the
    # update, whose entry holds weights + gradients and which leaves 2 × weights (Adam's
    # two moments) behind.
    assert first.baseline_bytes == weights
    assert first.phase("backward", 0).kept_bytes == weights  # the gradients appear
    update = first.phase("update")
    assert update.start_bytes == 2 * weights
    assert update.kept_bytes == 2 * weights
    # From window 1 on: the state is part of the baseline, and no update creates more.
    assert second.baseline_bytes == third.baseline_bytes == 3 * weights
    assert second.phase("update").kept_bytes == third.phase("update").kept_bytes == 0
    assert all(w.complete for w in meter.windows)


def test_no_optimizer_state_before_the_first_update_with_sgd_momentum() -> None:
    model = gpt()
    weights = param_bytes(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    meter = MemoryMeter("cpu")
    al.train_window(model, loader(4, 2), optimizer, OBJECTIVE, meter=meter)
    al.train_window(model, loader(4, 2), optimizer, OBJECTIVE, meter=meter)
    first, second = meter.windows
    assert first.baseline_bytes == weights
    assert first.phase("update").kept_bytes == weights  # one momentum buffer per parameter
    assert second.baseline_bytes == 2 * weights


def _leaky_loop(model: nn.Module, windows: Sequence[Sequence[Mapping[str, Tensor]]],
                meter: MemoryMeter, keep_tensors: bool) -> list[Any]:
    """A hand-written loop that logs each microbatch loss, as a tensor or as a float."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    history: list[Any] = []
    for window in windows:
        total = sum(OBJECTIVE.count(mb) for mb in window)
        for i, mb in enumerate(window):
            with meter.phase("forward", i):
                loss = OBJECTIVE.loss_sum(model(mb["input_ids"]), mb) / total
            with meter.phase("backward", i):
                loss.backward()
            history.append(loss if keep_tensors else loss.item())
            del loss
        with meter.phase("update"):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return history


def test_list_of_loss_tensors_leak_is_detected_and_the_fixed_loop_is_flat() -> None:
    windows = [loader(4, 2, seed=k) for k in range(5)]
    leaky, fixed = MemoryMeter("cpu"), MemoryMeter("cpu")
    leaky_model, fixed_model = gpt(), gpt()
    kept = _leaky_loop(leaky_model, windows, leaky, keep_tensors=True)
    _leaky_loop(fixed_model, windows, fixed, keep_tensors=False)
    leaky_baselines = [w.baseline_bytes for w in leaky.windows]
    fixed_baselines = [w.baseline_bytes for w in fixed.windows]
    growth = [b - a for a, b in zip(leaky_baselines, leaky_baselines[1:], strict=False)]
    # Each kept loss is a float32 scalar with its graph: 4 bytes per microbatch, every window.
    assert growth == [2 * 4] * 4
    assert all(t.grad_fn is not None for t in kept)  # the graphs are still attached
    assert len(set(fixed_baselines)) == 1
    assert fixed.live_bytes == fixed_baselines[0]
    del kept
    gc.collect()
    assert leaky.live_bytes == leaky_baselines[0]  # dropping the list frees everything


def test_summing_the_window_losses_before_backward_keeps_every_microbatch_alive() -> None:
    """Backward once on the sum of the window's losses: peak grows with A."""
    window = loader(8, 2)
    meter_each, meter_sum = MemoryMeter("cpu"), MemoryMeter("cpu")
    model = gpt()
    al.train_window(model, window, torch.optim.SGD(model.parameters(), lr=0.0), OBJECTIVE,
                    meter=meter_each)
    model = gpt()
    total = sum(OBJECTIVE.count(mb) for mb in window)
    losses = []
    for i, mb in enumerate(window):
        with meter_sum.phase("forward", i):
            losses.append(OBJECTIVE.loss_sum(model(mb["input_ids"]), mb) / total)
    with meter_sum.phase("backward", None):
        torch.stack(losses).sum().backward()
    activations = meter_each.last_window.saved_bytes[0]
    extra = meter_sum.peak_bytes - meter_each.peak_bytes
    assert extra > 2.5 * activations  # the other three microbatches' activations


def test_storage_counts_until_freed_and_views_count_once() -> None:
    meter = MemoryMeter("cpu")
    with meter.track():
        x = torch.zeros(1000)
        view = x[10:20]
        y = x.view(10, 100)
    assert meter.live_bytes == 4000
    del x, y
    assert meter.live_bytes == 4000  # the view keeps the storage
    del view
    assert meter.live_bytes == 0
    assert meter.peak_bytes == 4000
    meter.reset()
    assert meter.peak_bytes == 0 and meter.windows == []


def test_watch_counts_existing_tensors_once() -> None:
    model = gpt()
    optimizer = torch.optim.Adam(model.parameters())
    model(token_rows(1, 4)["input_ids"]).logits.sum().backward()
    optimizer.step()
    meter = MemoryMeter("cpu")
    added = meter.watch(model, optimizer)
    weights = param_bytes(model)
    assert added == meter.live_bytes
    steps = 4 * len(list(model.parameters()))  # one float32 step count per parameter
    assert added == 4 * weights + steps  # weights, gradients, Adam's two moments, steps
    assert meter.watch(model) == 0


def test_budget_raises_out_of_memory_and_the_meter_records_the_failed_phase() -> None:
    model = gpt()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    meter = MemoryMeter("cpu", budget_bytes=param_bytes(model) + 1000)
    with pytest.raises(torch.OutOfMemoryError, match="budget exceeded on cpu in phase 'forward'"):
        al.train_window(model, loader(4, 4), optimizer, OBJECTIVE, meter=meter)
    window = meter.last_window
    assert not window.complete and window.phases[-1].failed
    assert meter.peak_bytes <= meter.budget_bytes  # the allocation that would exceed never counts


def test_report_and_summary_are_json_and_feed_the_run_record() -> None:
    model, ledger, meter = run(4, 2, examples=16)
    report = meter.report()
    json.dumps(report)
    assert report["device"] == "cpu" and len(report["windows"]) == 2
    assert report["peak_bytes"] == meter.peak_bytes == max(w.peak_bytes for w in meter.windows)
    record = al.RunRecord.from_run(al.AccumulationPlan(4, 2), ledger, meter=meter)
    memory = json.loads(record.to_json())["extra"]["memory"]["cpu"]
    assert memory["baseline_bytes"] == param_bytes(model)
    assert memory["steady_baseline_bytes"] == 3 * param_bytes(model)
    assert memory["peak_bytes"] == meter.peak_bytes
    assert set(memory["phases"]) == {"forward", "backward", "update"}
    assert "memory" in record.to_markdown()


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"device": "meta"}, ValueError, "'cpu' or 'cuda'"),
        ({"device": 1.5}, TypeError, "device must be"),
        ({"budget_bytes": 0}, ValueError, "budget_bytes must be at least 1, or None for no budget"),
        ({"budget_bytes": 2.5}, TypeError, r"budget_bytes must be an int, or None .*float \(2.5\)"),
        ({"track_saved": 1}, TypeError, "track_saved must be True or False, got 1"),
        ({"record_history": "yes"}, TypeError, "record_history must be True or False, got 'yes'"),
        ({"record_history": True}, ValueError, "needs a CUDA device"),
    ],
)
def test_meter_rejects_bad_arguments(kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        MemoryMeter(**{"device": "cpu", **kwargs})


def test_phases_do_not_nest_and_snapshot_needs_cuda() -> None:
    meter = MemoryMeter("cpu")
    with meter.phase("forward", 0), pytest.raises(RuntimeError, match="do not nest"):
        with meter.phase("backward", 0):
            pass
    with pytest.raises(ValueError, match="CUDA"):
        meter.export_snapshot("snapshot.pickle")
    assert format_bytes(1536) == "1.5 KiB" and format_bytes(12) == "12 B"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_meter_reads_the_allocator() -> None:
    model = gpt().cuda()
    optimizer = torch.optim.AdamW(model.parameters())
    meter = MemoryMeter("cuda", budget_bytes=None)
    window = [{k: v.cuda() for k, v in mb.items()} for mb in loader(8, 4)]
    al.train_window(model, window, optimizer, OBJECTIVE, meter=meter)
    first = meter.last_window
    assert first.baseline_bytes >= param_bytes(model)
    assert first.peak_bytes > first.baseline_bytes
    assert first.saved_bytes[0] > 0
    assert meter.peak_bytes >= first.peak_bytes


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_budget_shrinks_to_the_small_run() -> None:
    def cuda_run(m: int, steps: int, budget: int | None = None) -> tuple[list[Tensor], al.Ledger, int, int]:
        model = gpt().cuda()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        meter = MemoryMeter("cuda", budget_bytes=budget)
        data = [{k: v.cuda() for k, v in mb.items()} for mb in loader(32, m)]
        ledger = al.train(model, data, optimizer, al.AccumulationPlan(m, steps), OBJECTIVE,
                          meter=meter, progress=False, on_oom="shrink")
        weights = [p.detach().cpu() for p in model.parameters()]
        first_peak, peak = meter.windows[0].peak_bytes, meter.peak_bytes
        del model, optimizer, data
        gc.collect()
        torch.cuda.empty_cache()
        return weights, ledger, first_peak, peak

    _, _, big_first_peak, _ = cuda_run(8, 2)
    small_weights, small, _, small_peak = cuda_run(4, 4)
    assert small_peak < big_first_peak
    weights, ledger, _, _ = cuda_run(8, 2, budget=(small_peak + big_first_peak) // 2)
    assert [s["new_micro_batch_size"] for s in ledger.shrinks] == [4]
    assert ledger.updates_applied == small.updates_applied == 2
    for a, b in zip(weights, small_weights, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------- shrink on OOM


def test_shrink_on_oom_matches_a_run_that_started_small() -> None:
    _, _, big = run(8, 2)
    small_model, small, small_meter = run(4, 4)
    # A budget that window 0 at m=8 exceeds and every window at m=4 fits.
    first_big_peak = big.windows[0].peak_bytes
    assert small_meter.peak_bytes < first_big_peak
    budget = (small_meter.peak_bytes + first_big_peak) // 2
    model, ledger, meter = run(8, 2, budget=budget)

    assert ledger.shrinks == [
        {"update": 0, "old_micro_batch_size": 8, "new_micro_batch_size": 4, "microbatches": 4}
    ]
    assert ledger.update_attempts == ledger.updates_applied == small.updates_applied == 2
    assert (ledger.examples, ledger.targets) == (small.examples, small.targets) == (32, 32 * 31)
    assert ledger.microbatches == small.microbatches == 8
    assert ledger.loader_batches == 4  # four loader batches of 8, each cut in two
    # Same examples, same split, same order: the weights agree to float32 rounding.
    assert max_abs_diff(model, small_model) <= 1e-6
    # One failed attempt, then the smaller size held for the second window without failing.
    assert [w.complete for w in meter.windows] == [False, True, True]
    assert meter.peak_bytes <= budget
    record = al.RunRecord.from_run(al.AccumulationPlan(8, 2), ledger, meter=meter)
    assert [(s["update"], s["from_micro_batch_size"], s["to_micro_batch_size"])
            for s in record.shrinks] == [(0, 8, 4)]


def test_shrink_keeps_every_example_once() -> None:
    seen: list[list[int]] = []

    def forward(model: nn.Module, batch: Mapping[str, Tensor]) -> Any:
        seen.append(batch["example_ids"].tolist())
        return model(batch["input_ids"])

    _, _, big = run(8, 2)
    model = gpt()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    meter = MemoryMeter("cpu", budget_bytes=big.windows[0].phase("forward", 0).peak_bytes - 1)
    reports: list[al.UpdateReport] = []
    ledger = al.train(model, loader(32, 8), optimizer, al.AccumulationPlan(8, 2), OBJECTIVE,
                      meter=meter, progress=False, on_oom="shrink", forward=forward,
                      on_update=reports.append)
    assert ledger.shrinks and ledger.shrinks[0]["update"] == 0
    # The failed attempt saw part of window 0; the retries and later windows saw each
    # example exactly once, in order.
    failed_calls = len(seen) - ledger.microbatches
    trained = [i for ids in seen[failed_calls:] for i in ids]
    assert trained == list(range(32))
    assert [r.examples for r in reports] == [16, 16]


def test_shrink_at_one_example_raises_the_clear_error() -> None:
    model = gpt()
    with pytest.raises(CannotShrinkError) as info:
        run(2, 2, budget=param_bytes(model) + 10_000, model=model, examples=4)
    message = str(info.value)
    assert "one example still does not fit" in message
    assert "accumulation cannot help" in message
    assert "checkpointing" in message
    assert isinstance(info.value, torch.OutOfMemoryError)


def test_oom_in_the_update_is_not_shrunk() -> None:
    model = gpt(n_layer=1, n_embd=64)
    weights = param_bytes(model)
    # Forward and backward of one short example fit; Adam's two moments at the update do not.
    with pytest.raises(CannotShrinkError, match="the update itself ran out of memory"):
        run(1, 1, budget=3 * weights, model=model, examples=2, seq=4)


def test_on_oom_raise_lets_the_error_through_and_bad_values_are_rejected() -> None:
    model = gpt()
    with pytest.raises(torch.OutOfMemoryError) as info:
        run(8, 1, budget=param_bytes(model) + 10_000, model=model, examples=8, on_oom="raise")
    assert not isinstance(info.value, CannotShrinkError)
    with pytest.raises(ValueError, match="on_oom must be 'raise' or 'shrink'"):
        run(8, 1, examples=8, on_oom="retry")


def test_one_long_sequence_fits_only_with_activation_checkpointing() -> None:
    seq, long_gpt = 256, {"n_layer": 4, "block_size": 256}
    example = token_rows(1, seq)
    peaks, grads = {}, {}
    for checkpoint in (False, True):
        model = gpt(checkpoint=checkpoint, **long_gpt)
        meter = MemoryMeter("cpu")
        al.train_window(model, [example], _CaptureGrads(model), OBJECTIVE, meter=meter)
        peaks[checkpoint] = meter.peak_bytes
        grads[checkpoint] = model.captured  # type: ignore[attr-defined]
    assert peaks[True] < 0.5 * peaks[False]
    budget = (peaks[True] + peaks[False]) // 2
    with pytest.raises(CannotShrinkError, match="checkpointing"):
        run(1, 1, budget=budget, model=gpt(**long_gpt), examples=1, seq=seq)
    _, ledger, _ = run(1, 1, budget=budget, model=gpt(checkpoint=True, **long_gpt), examples=1,
                       seq=seq)
    assert ledger.updates_applied == 1 and not ledger.shrinks
    for a, b in zip(grads[False], grads[True], strict=True):  # recomputation: same gradient
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


class _CaptureGrads(torch.optim.SGD):
    """SGD with lr 0 that stores a copy of the gradients on the model when it steps."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model.parameters(), lr=0.0)
        self.model = model

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        self.model.captured = [p.grad.detach().clone() for p in self.model.parameters()]


# --------------------------------------------------------------------- two gloo ranks


def ddp_shrink_worker() -> dict[str, Any]:
    """Rank 0 holds long sequences, rank 1 short ones; with one budget for both, only rank
    0 exceeds it at m=4, and both must shrink together. Runs three trainings: a dry run at
    m=4 and a run at m=2 (both without a budget) to set the budget, then m=4 under it."""
    rank = dist.get_rank()
    seq = (48, 8)[rank]
    examples = token_rows(16, seq, seed=rank, first_id=100 * rank)

    def train(
        m: int, budget: int | None, buffer: bool = False
    ) -> tuple[nn.Module, al.Ledger, MemoryMeter]:
        model = gpt(n_layer=1, n_embd=16)
        if buffer:  # DDP then broadcasts buffers at every forward: one more agreement point
            model.register_buffer("unused", torch.zeros(3))
        ddp = DistributedDataParallel(model)
        optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
        meter = MemoryMeter("cpu", budget_bytes=budget)
        ledger = al.train(
            ddp,
            al.split_batch(examples, [m] * (16 // m)),
            optimizer,
            al.AccumulationPlan(m, 8 // m, data_parallel_size=2),
            OBJECTIVE,
            meter=meter,
            progress=False,
            on_oom="shrink",
        )
        return model, ledger, meter

    _, _, dry = train(4, None)
    small_model, small, small_meter = train(2, None)
    first_forward = dry.windows[0].phase("forward", 0).peak_bytes
    table = gather_counts([first_forward, small_meter.peak_bytes, dry.peak_bytes])
    # Below rank 0's first forward pass at m=4, above everything else.
    budget = (table[0][0] + max(table[0][1], table[1][2])) // 2
    model, ledger, meter = train(4, budget)
    buffered_model, buffered, _ = train(4, budget, buffer=True)
    return {
        "buffered": (buffered.shrinks, buffered.updates_applied,
                     max_abs_diff(buffered_model, small_model)),
        "table": table,
        "budget": budget,
        "shrinks": ledger.shrinks,
        "updates": (ledger.update_attempts, ledger.updates_applied, small.updates_applied),
        "counts": (ledger.examples, ledger.targets, small.examples, small.targets),
        "max_diff_to_small": max_abs_diff(model, small_model),
        "weights": [p.detach().clone() for p in model.parameters()],
        "failed_windows": sum(not w.complete for w in meter.windows),
        "peak": meter.peak_bytes,
    }


@pytest.mark.distributed
def test_two_gloo_ranks_shrink_together_when_only_one_exceeds_the_budget() -> None:
    rank0, rank1 = launch(ddp_shrink_worker, 2, timeout_s=60, deadline_s=240)
    table = rank0["table"]
    assert table[0][0] > max(table[0][1], table[1][2])  # the scenario is what it claims
    assert table[1][2] < rank0["budget"] < table[0][0]  # only rank 0 exceeds at m=4
    for out in (rank0, rank1):
        assert out["shrinks"] == [
            {"update": 0, "old_micro_batch_size": 4, "new_micro_batch_size": 2, "microbatches": 4}
        ]
        assert out["updates"] == (2, 2, 2)
        assert out["counts"][:2] == out["counts"][2:]
        assert out["max_diff_to_small"] <= 1e-6
        assert out["peak"] <= out["budget"]
        # The same with a buffer, which DDP broadcasts at every forward pass.
        assert out["buffered"][:2] == (out["shrinks"], 2) and out["buffered"][2] <= 1e-6
    assert rank0["failed_windows"] == 1  # rank 0 ran out of memory ...
    assert rank1["failed_windows"] == 1  # ... and rank 1 stopped at the agreement point
    for a, b in zip(rank0["weights"], rank1["weights"], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
