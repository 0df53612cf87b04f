"""ChunkedNextTokenLoss: the next-token loss from the hidden states and the head, in
chunks of tokens, without the full logits.

The references are plain PyTorch (``head(hidden)`` then ``NextTokenLoss`` or
``F.cross_entropy``), so the tests check the chunked loss against the materialized one:
equal loss and gradients (float64 and float32; tied and untied heads; with and without
bias; rows without targets), the chunk's logits under autocast, the extra memory measured
with ``MemoryMeter``, the errors, and the loop with a Hugging Face GPT-2 (gradient,
precision, meter phases, shrink on OOM, DDP and FSDP2 on two gloo ranks,
compare_gradients).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping

import pytest
import torch
import torch.nn.functional as F
from helpers.chunked_loss_workers import (
    Capture,
    chunked_ddp,
    chunked_fsdp2,
    gpt2_batches,
    hidden_forward,
    tiny_gpt2,
)
from torch import Tensor, nn

import accumlab as al
from accumlab.chunked_loss import DEFAULT_CHUNK_BYTES, default_chunk_size
from accumlab.memory import MemoryMeter

IGNORE = -100
# The loop tests build a GPT-2 from a tiny config with Hugging Face transformers (the
# `dev` extra); without it they are skipped, the others run.
needs_transformers = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None, reason="needs transformers (dev extra)"
)


def labels_for(m: int, t: int, vocab: int, seed: int = 0) -> Tensor:
    """Labels with a masked prompt, right padding and one row without any target."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, vocab, (m, t), generator=g)
    labels[0, :3] = IGNORE  # a masked prompt
    labels[1, t - 2 :] = IGNORE  # padding on the right
    labels[m - 1, 1:] = IGNORE  # a row whose only label is position 0: no target
    return labels


class TiedLM(nn.Module):
    """Embedding -> tanh(linear) -> head, the head optionally tied to the embedding, so
    the tied weight gets gradient from both ends."""

    def __init__(self, vocab: int, width: int, tied: bool, bias: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.mix = nn.Linear(width, width)
        self.head = nn.Linear(width, vocab, bias=bias)
        if tied:
            self.head.weight = self.embed.weight

    def hidden(self, ids: Tensor) -> Tensor:
        return torch.tanh(self.mix(self.embed(ids)))


def grads_of(model: nn.Module) -> dict[str, Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def loss_and_grads(model: TiedLM, ids: Tensor, labels: Tensor, chunked: bool, chunk: int | None):
    model.zero_grad(set_to_none=True)
    hidden = model.hidden(ids)
    hidden.retain_grad()
    batch = {"labels": labels}
    if chunked:
        loss = al.ChunkedNextTokenLoss(model.head, chunk_size=chunk).loss_sum(hidden, batch)
    else:
        loss = al.NextTokenLoss().loss_sum(model.head(hidden), batch)
    (loss * 0.37).backward()  # the loop's backward is scaled: the gradients must follow
    out = grads_of(model)
    out["hidden"] = hidden.grad.detach().clone()
    return loss.detach(), out


def max_rel(reference: Mapping[str, Tensor], candidate: Mapping[str, Tensor]) -> float:
    assert reference.keys() == candidate.keys()
    return max(
        float((candidate[k] - reference[k]).abs().max() / reference[k].abs().max())
        for k in reference
    )


# ------------------------------------------------------------------------ equality


@pytest.mark.parametrize("dtype, rtol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("chunk", [1, 5, None], ids=["chunk1", "chunk5", "default"])
def test_loss_and_gradients_equal_the_materialized_loss(dtype, rtol, tied, bias, chunk):
    torch.manual_seed(0)
    vocab, width, m, t = 37, 6, 4, 9
    model = TiedLM(vocab, width, tied, bias).to(dtype)
    ids = torch.randint(0, vocab, (m, t))
    labels = labels_for(m, t, vocab)
    ref_loss, ref = loss_and_grads(model, ids, labels, chunked=False, chunk=None)
    loss, got = loss_and_grads(model, ids, labels, chunked=True, chunk=chunk)
    assert loss.dtype == ref_loss.dtype == dtype
    assert abs(float(loss) - float(ref_loss)) <= rtol * abs(float(ref_loss))
    assert set(got) == {"embed.weight", "mix.weight", "mix.bias", "hidden"} | (
        set() if tied else {"head.weight"}
    ) | ({"head.bias"} if bias else set())
    assert max_rel(ref, got) <= rtol
    # the row without targets gets no gradient, and neither do positions without one
    assert float(got["hidden"][-1].abs().max()) == 0.0
    assert float(got["hidden"][:, -1].abs().max()) == 0.0  # the last position predicts nothing


def test_loss_equals_plain_cross_entropy_on_the_shifted_targets():
    torch.manual_seed(1)
    head = nn.Linear(5, 23, dtype=torch.float64)
    hidden = torch.randn(3, 8, 5, dtype=torch.float64)
    labels = labels_for(3, 8, 23, seed=1)
    logits = head(hidden)
    expected = F.cross_entropy(
        logits[:, :-1].reshape(-1, 23),
        labels[:, 1:].reshape(-1),
        ignore_index=IGNORE,
        reduction="sum",
    )
    got = al.ChunkedNextTokenLoss(head, chunk_size=4).loss_sum(hidden, {"labels": labels})
    torch.testing.assert_close(got, expected.detach(), rtol=1e-12, atol=0)


def test_count_is_next_token_loss_count_and_ignore_index_is_honoured():
    head = nn.Linear(4, 11)
    labels = labels_for(3, 7, 11)
    batch = {"labels": labels}
    chunked = al.ChunkedNextTokenLoss(head)
    assert chunked.unit == "target" and isinstance(chunked, al.Objective)
    assert (
        chunked.count(batch)
        == al.NextTokenLoss().count(batch)
        == int((labels[:, 1:] != IGNORE).sum())
    )
    # another ignore_index: -100 is then a real (invalid) target id, 0 is ignored
    relabeled = {"labels": torch.where(labels == IGNORE, 0, labels)}
    assert al.ChunkedNextTokenLoss(head, ignore_index=0).count(relabeled) == al.NextTokenLoss(
        0
    ).count(relabeled)
    hidden = torch.randn(3, 7, 4)
    torch.testing.assert_close(
        al.ChunkedNextTokenLoss(head, chunk_size=2, ignore_index=0).loss_sum(hidden, relabeled),
        al.NextTokenLoss(0).loss_sum(head(hidden), relabeled),
    )


def test_a_microbatch_without_targets_gives_zero_loss_and_zero_gradients():
    head = nn.Linear(4, 9)
    hidden = torch.randn(2, 5, 4, requires_grad=True)
    labels = torch.full((2, 5), IGNORE)
    labels[:, 0] = 3  # position 0 is never a target
    loss = al.ChunkedNextTokenLoss(head).loss_sum(hidden, {"labels": labels})
    assert float(loss.detach()) == 0.0
    loss.backward()  # the loop calls backward on every microbatch's loss
    assert float(hidden.grad.abs().max()) == 0.0
    assert float(head.weight.grad.abs().max()) == 0.0 and float(head.bias.grad.abs().max()) == 0.0


def test_without_gradients_only_the_loss_is_computed():
    head = nn.Linear(4, 9)
    hidden = torch.randn(2, 5, 4)
    labels = labels_for(2, 5, 9)
    expected = al.NextTokenLoss().loss_sum(head(hidden), {"labels": labels})
    with torch.no_grad():
        got = al.ChunkedNextTokenLoss(head, chunk_size=3).loss_sum(hidden, {"labels": labels})
    assert got.grad_fn is None
    torch.testing.assert_close(got, expected.detach())


def test_hugging_face_style_output_with_last_hidden_state_is_accepted():
    head = nn.Linear(4, 9)
    hidden = torch.randn(2, 5, 4)
    batch = {"labels": labels_for(2, 5, 9)}

    class Output:
        last_hidden_state = hidden

    objective = al.ChunkedNextTokenLoss(head)
    torch.testing.assert_close(
        objective.loss_sum(Output(), batch), objective.loss_sum(hidden, batch)
    )
    torch.testing.assert_close(
        objective.loss_sum({"last_hidden_state": hidden}, batch), objective.loss_sum(hidden, batch)
    )


# ------------------------------------------------------------------------ precision


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_under_autocast_the_chunk_logits_follow_the_policy_and_the_sum_is_float32(dtype):
    torch.manual_seed(2)
    vocab, width = 301, 32
    model = TiedLM(vocab, width, tied=True, bias=True)
    ids = torch.randint(0, vocab, (3, 16))
    labels = labels_for(3, 16, vocab, seed=2)
    fp32_loss, fp32 = loss_and_grads(model, ids, labels, chunked=False, chunk=None)
    with torch.autocast("cpu", dtype=dtype):
        ref_loss, ref = loss_and_grads(model, ids, labels, chunked=False, chunk=None)
        loss, got = loss_and_grads(model, ids, labels, chunked=True, chunk=7)
    assert loss.dtype == ref_loss.dtype == torch.float32
    # the chunked loss rounds like the materialized one under the same autocast (half
    # precision logits), much closer to it than either is to the float32 loss
    policy_gap = abs(float(ref_loss) - float(fp32_loss))
    assert policy_gap > 0
    assert abs(float(loss) - float(ref_loss)) <= 0.05 * policy_gap
    assert max_rel(ref, got) <= 2e-2
    assert max_rel(fp32, got) <= 5e-2
    assert {k: g.dtype for k, g in got.items()} == {k: g.dtype for k, g in ref.items()}


def test_a_float32_loss_scaled_as_by_a_grad_scaler_gives_the_scaled_gradient():
    torch.manual_seed(3)
    head = nn.Linear(8, 50)
    hidden = torch.randn(2, 6, 8, requires_grad=True)
    batch = {"labels": labels_for(2, 6, 50, seed=3)}
    objective = al.ChunkedNextTokenLoss(head, chunk_size=4)
    objective.loss_sum(hidden, batch).backward()
    once = (hidden.grad.clone(), head.weight.grad.clone(), head.bias.grad.clone())
    hidden.grad = head.weight.grad = head.bias.grad = None
    (objective.loss_sum(hidden, batch) * 65536.0).backward()
    for a, b in zip(once, (hidden.grad, head.weight.grad, head.bias.grad), strict=True):
        torch.testing.assert_close(b, a * 65536.0)


# ------------------------------------------------------------------------ memory


def _extra_peak(fn, *watched: Tensor | nn.Module) -> tuple[int, Tensor]:
    """Bytes above the live level at the start that ``fn`` (forward and backward of a loss)
    held at its peak, measured with the meter."""
    meter = MemoryMeter("cpu")
    meter.watch(*watched)  # live before the loss, not part of what it adds
    with meter.track():
        meter.reset()
        start = meter.live_bytes
        out = fn()
        return meter.peak_bytes - start, out


def test_extra_peak_of_forward_and_backward_is_a_small_fraction_of_the_logits():
    torch.manual_seed(4)
    m, t, width, vocab = 2, 512, 16, 32_768
    head = nn.Linear(width, vocab, bias=False)
    hidden = torch.randn(m, t, width, requires_grad=True)
    batch = {"labels": torch.randint(0, vocab, (m, t))}
    logits_bytes = m * t * vocab * 4  # 128 MiB in float32
    objective = al.ChunkedNextTokenLoss(head)  # the default chunk size
    assert (
        objective.effective_chunk_size
        == default_chunk_size(vocab)
        == DEFAULT_CHUNK_BYTES["cpu"] // (4 * vocab)
    )

    def chunked() -> Tensor:
        loss = objective.loss_sum(hidden, batch)
        loss.backward()
        return loss.detach()

    def materialized() -> Tensor:
        loss = al.NextTokenLoss().loss_sum(head(hidden), batch)
        loss.backward()
        return loss.detach()

    chunked_peak, chunked_loss = _extra_peak(chunked, head, hidden)
    hidden.grad = head.weight.grad = None
    materialized_peak, materialized_loss = _extra_peak(materialized, head, hidden)
    torch.testing.assert_close(chunked_loss, materialized_loss, rtol=1e-5, atol=0)
    # the measurement sees the logits: the materialized loss holds at least them
    assert materialized_peak >= logits_bytes
    assert chunked_peak < 0.15 * logits_bytes
    # what it holds at most: one float32 chunk of logits, the head-sized and the
    # hidden-sized gradient (and small per-chunk vectors)
    chunk_bytes = objective.effective_chunk_size * vocab * 4
    assert chunked_peak <= chunk_bytes + head.weight.nbytes + hidden.nbytes + 2**20
    assert chunked_peak > 0  # a chunk of logits and the gradients were seen


def test_the_default_chunk_size_keeps_one_float32_chunk_within_its_budget():
    for device_type, budget in (("cpu", 8 * 2**20), ("cuda", 64 * 2**20)):
        assert DEFAULT_CHUNK_BYTES["cpu" if device_type == "cpu" else "other"] == budget
        for vocab in (1, 50_257, 128_256, 10**9):
            chunk = default_chunk_size(vocab, device_type)
            assert chunk >= 1
            assert chunk == 1 or chunk * vocab * 4 <= budget < (chunk + 1) * vocab * 4
    assert default_chunk_size(32_000) == 65 and default_chunk_size(128_256) == 16
    assert default_chunk_size(32_000, "cuda") == 524 and default_chunk_size(128_256, "cuda") == 130


# ------------------------------------------------------------------------ errors


def test_a_head_that_is_not_a_linear_map_is_refused():
    with pytest.raises(TypeError, match="nn.Linear"):
        al.ChunkedNextTokenLoss(nn.Embedding(10, 4))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="model.lm_head"):
        al.ChunkedNextTokenLoss(nn.Sequential(nn.Linear(4, 10)))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "chunk, error",
    [(0, ValueError), (-3, ValueError), (2.5, TypeError), (True, TypeError), ("64", TypeError)],
)
def test_bad_chunk_size_is_refused(chunk, error):
    with pytest.raises(error, match="chunk_size"):
        al.ChunkedNextTokenLoss(nn.Linear(4, 10), chunk_size=chunk)


def test_hidden_states_that_do_not_match_the_batch_or_the_head_are_refused():
    head = nn.Linear(4, 10)
    objective = al.ChunkedNextTokenLoss(head)
    batch = {"labels": labels_for(2, 5, 10)}
    with pytest.raises(ValueError, match=r"expected \(batch, sequence, 4\)"):
        objective.loss_sum(torch.randn(2, 5, 6), batch)  # wrong hidden size
    with pytest.raises(ValueError, match="do not match labels of shape"):
        objective.loss_sum(torch.randn(2, 4, 4), batch)  # wrong sequence length
    with pytest.raises(ValueError, match="not the logits"):
        objective.loss_sum(head(torch.randn(2, 5, 4)), batch)  # logits passed by mistake
    with pytest.raises(ValueError, match="do not match"):
        objective.loss_sum(torch.randn(10, 4), batch)  # flattened
    with pytest.raises(TypeError, match="last_hidden_state"):
        objective.loss_sum({"logits": torch.randn(2, 5, 10)}, batch)
    with pytest.raises(TypeError, match="same dtype"):
        objective.loss_sum(torch.randn(2, 5, 4, dtype=torch.float64), batch)
    with pytest.raises(ValueError, match=r"outside \[0, 10\)"):
        objective.loss_sum(torch.randn(2, 5, 4), {"labels": torch.full((2, 5), 10)})
    with pytest.raises(ValueError, match="labels"):
        objective.loss_sum(torch.randn(2, 5, 4), {"input_ids": torch.zeros(2, 5)})
    with pytest.raises(ValueError, match=r"\(batch, sequence\)"):
        objective.count({"labels": torch.zeros(10, dtype=torch.long)})


# ------------------------------------------------------------------------ the loop


def window_gradient(model: nn.Module, window, objective, **kwargs) -> list[Tensor]:
    optimizer = Capture(model)
    report = al.train_window(model, window, optimizer, objective, **kwargs)
    assert report.applied
    (seen,) = optimizer.seen
    return seen


def rel(reference: list[Tensor], candidate: list[Tensor]) -> float:
    return max(
        float((c.double() - r.double()).abs().max() / r.double().abs().max())
        for r, c in zip(reference, candidate, strict=True)
    )


@needs_transformers
@pytest.mark.parametrize("dtype, rtol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
def test_train_window_with_a_gpt2_applies_the_default_paths_gradient(dtype, rtol):
    model = tiny_gpt2(dtype=dtype)
    assert model.lm_head.weight is model.transformer.wte.weight  # tied, as in GPT-2
    window = gpt2_batches(3, 2, seed=5)
    reference = window_gradient(model, window, al.NextTokenLoss())  # logits from model(...)
    chunked = window_gradient(
        model, window, al.ChunkedNextTokenLoss(model.lm_head, chunk_size=8), forward=hidden_forward
    )
    assert rel(reference, chunked) <= rtol
    # the whole Hugging Face output (with .last_hidden_state) works as well
    whole = window_gradient(
        model,
        window,
        al.ChunkedNextTokenLoss(model.lm_head),
        forward=lambda mdl, b: mdl.transformer(input_ids=b["input_ids"], use_cache=False),
    )
    assert rel(reference, whole) <= rtol


@needs_transformers
def test_train_gives_the_same_weights_as_the_default_path():
    data = gpt2_batches(8, 2, seed=6)
    plan = al.AccumulationPlan(2, 2)
    runs = []
    for objective_of, forward in (
        (lambda m: al.NextTokenLoss(), None),
        (lambda m: al.ChunkedNextTokenLoss(m.lm_head, chunk_size=16), hidden_forward),
    ):
        model = tiny_gpt2()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
        ledger = al.train(
            model, data, optimizer, plan, objective_of(model), forward=forward, progress=False
        )
        runs.append((ledger, [p.detach().clone() for p in model.parameters()]))
    (ref_ledger, ref_weights), (ledger, weights) = runs
    assert ledger.updates_applied == ref_ledger.updates_applied == 4
    assert ledger.targets == ref_ledger.targets
    assert [r.loss for r in ledger.reports] == pytest.approx(
        [r.loss for r in ref_ledger.reports], rel=1e-5
    )
    assert (
        max(float((a - b).abs().max()) for a, b in zip(weights, ref_weights, strict=True)) <= 1e-5
    )


@needs_transformers
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_reduced_precision_in_the_loop_follows_the_default_path(precision):
    model = tiny_gpt2()
    window = gpt2_batches(2, 2, seed=7)
    kwargs = {"precision": precision}
    scalers = []
    if precision == "fp16":
        scalers = [torch.amp.GradScaler("cpu", init_scale=1024.0) for _ in range(2)]
    reference = window_gradient(
        model, window, al.NextTokenLoss(), **kwargs, **({"scaler": scalers[0]} if scalers else {})
    )
    chunked = window_gradient(
        model,
        window,
        al.ChunkedNextTokenLoss(model.lm_head, chunk_size=8),
        forward=hidden_forward,
        **kwargs,
        **({"scaler": scalers[1]} if scalers else {}),
    )
    fp32 = window_gradient(model, window, al.NextTokenLoss())
    assert all(bool(torch.isfinite(g).all()) for g in chunked)
    assert rel(reference, chunked) <= 3e-2  # half-precision rounding of two orders of work
    assert rel(fp32, chunked) <= 5e-2
    if scalers:  # the gradient the optimizer sees is unscaled, and the scale was used
        assert scalers[1].get_scale() == scalers[0].get_scale() == 1024.0


@needs_transformers
def test_meter_phases_show_the_chunked_loss_keeps_less_than_the_logits():
    vocab = 4096
    model = tiny_gpt2(vocab=vocab)
    window = gpt2_batches(2, 4, seed=8, vocab=vocab)
    logits_bytes = 4 * 24 * vocab * 4
    records = {}
    for name, objective, forward in (
        ("default", al.NextTokenLoss(), None),
        ("chunked", al.ChunkedNextTokenLoss(model.lm_head, chunk_size=16), hidden_forward),
    ):
        meter = MemoryMeter("cpu")
        al.train_window(
            model,
            window,
            torch.optim.SGD(model.parameters(), lr=0.0),
            objective,
            meter=meter,
            forward=forward,
        )
        records[name] = meter.last_window
    for record in records.values():
        assert [(p.name, p.microbatch) for p in record.phases] == [
            ("forward", 0),
            ("backward", 0),
            ("forward", 1),
            ("backward", 1),
            ("update", None),
        ]
        assert record.complete
    default, chunked = records["default"], records["chunked"]
    # the default path saves the logits (and their log-softmax) for backward; the chunked
    # loss saves a hidden-sized and a head-sized gradient instead
    assert default.saved_bytes[0] >= logits_bytes
    assert chunked.saved_bytes[0] < 0.5 * logits_bytes
    extra = {k: r.phase("forward", 0).peak_bytes - r.baseline_bytes for k, r in records.items()}
    assert extra["chunked"] < 0.5 * extra["default"]


@needs_transformers
def test_shrink_on_oom_with_the_chunked_loss_matches_a_run_that_started_small():
    def run(m: int, steps: int, budget: int | None = None):
        model = tiny_gpt2(vocab=512)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)  # no state: activations dominate
        meter = MemoryMeter("cpu", budget_bytes=budget)
        data = gpt2_batches(2, 8, seed=9, vocab=512, width=32)  # 16 examples, batches of 8
        if m == 4:  # the same examples, in the same order, in loader batches of 4
            data = [half for b in data for half in al.split_batch(b, [4, 4])]
        ledger = al.train(
            model,
            data,
            optimizer,
            al.AccumulationPlan(m, steps),
            al.ChunkedNextTokenLoss(model.lm_head, chunk_size=16),
            forward=hidden_forward,
            meter=meter,
            progress=False,
            on_oom="shrink",
        )
        return model, ledger, meter

    _, _, big = run(8, 1)
    small_model, small, small_meter = run(4, 2)
    assert small_meter.peak_bytes < big.windows[0].peak_bytes
    budget = (small_meter.peak_bytes + big.windows[0].peak_bytes) // 2
    model, ledger, meter = run(8, 1, budget=budget)
    assert [s["new_micro_batch_size"] for s in ledger.shrinks] == [4]
    assert ledger.updates_applied == small.updates_applied == 2
    assert meter.peak_bytes <= budget
    for a, b in zip(model.parameters(), small_model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@needs_transformers
def test_compare_gradients_accepts_the_chunked_loss():
    model = tiny_gpt2(dtype=torch.float64)
    (batch,) = gpt2_batches(1, 4, seed=10)
    objective = al.ChunkedNextTokenLoss(model.lm_head, chunk_size=4)
    comparison = al.compare_gradients(model, batch, objective, [1, 3], forward=hidden_forward)
    assert comparison.ok(rtol=1e-10), str(comparison)
    assert "transformer.wte.weight" in comparison.max_abs

    # and it tells a wrong loss apart: a per-microbatch mean weights short microbatches more
    class MeanOfMicrobatch(al.ChunkedNextTokenLoss):
        def loss_sum(self, output, batch):
            return super().loss_sum(output, batch) / self.count(batch) * 10

    wrong = al.compare_gradients(
        model, batch, MeanOfMicrobatch(model.lm_head), [1, 3], forward=hidden_forward
    )
    assert not wrong.ok(rtol=1e-3)


@needs_transformers
@pytest.mark.distributed
@pytest.mark.parametrize("worker", [chunked_ddp, chunked_fsdp2], ids=["ddp", "fsdp2"])
def test_two_ranks_with_the_chunked_loss_equal_the_single_process_full_batch(worker):
    windows, a, m = 2, 2, 2
    rank0, rank1 = al.launch(worker, 2, (windows, a, m), deadline_s=90)
    assert rank0["replicas"] == rank1["replicas"] == 2
    model = tiny_gpt2()
    data = [gpt2_batches(windows * a, m, seed=r) for r in (0, 1)]
    for w in range(windows):
        window = [mb for rank_data in data for mb in rank_data[w * a : (w + 1) * a]]
        expected = window_gradient(model, window, al.NextTokenLoss())
        assert rel(expected, rank0["seen"][w]) <= 1e-5
        assert rel(expected, rank1["seen"][w]) <= 1e-5
        assert rank0["global_targets"][w] == sum(al.NextTokenLoss().count(mb) for mb in window)


def test_a_second_backward_through_one_loss_is_refused():
    head = nn.Linear(4, 9)
    hidden = torch.randn(2, 5, 4, requires_grad=True)
    loss = al.ChunkedNextTokenLoss(head).loss_sum(hidden, {"labels": labels_for(2, 5, 9)})
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="call loss_sum again"):
        loss.backward()


def gradient_penalty_grads(loss_of, model: TiedLM, ids: Tensor) -> Tensor:
    """The gradient of ``loss + |d loss / d hidden|^2`` with respect to the mixing layer
    (a gradient penalty: the double backward of the loss)."""
    model.zero_grad(set_to_none=True)
    hidden = model.hidden(ids)
    loss = loss_of(hidden)
    (grad_hidden,) = torch.autograd.grad(loss, hidden, create_graph=True)
    (loss + grad_hidden.pow(2).sum()).backward()
    return model.mix.weight.grad.detach().clone()


def test_a_double_backward_is_refused_not_a_silent_zero():
    """autograd.grad(loss, hidden, create_graph=True) asks for the graph of the gradient
    (a gradient penalty, a Hessian-vector product). The chunked loss computes its gradient
    in the forward, without a graph, so the penalty's own gradient would be lost; it must
    say so and name the loss that supports it, not return a gradient with no graph."""
    torch.manual_seed(6)
    vocab, width, m, t = 29, 5, 3, 7
    model = TiedLM(vocab, width, tied=False, bias=True).to(torch.float64)
    ids = torch.randint(0, vocab, (m, t))
    batch = {"labels": labels_for(m, t, vocab, seed=6)}
    # the reference: plain cross-entropy, whose double backward is autograd's
    plain = gradient_penalty_grads(lambda h: al.NextTokenLoss().loss_sum(model.head(h), batch),
                                   model, ids)
    first_order = loss_and_grads(model, ids, batch["labels"], chunked=False, chunk=None)[1]
    penalty_part = plain - 0.37**-1 * first_order["mix.weight"]
    assert float(penalty_part.abs().max()) > 1e-3 * float(plain.abs().max())  # not nothing
    chunked = al.ChunkedNextTokenLoss(model.head, chunk_size=4)
    hidden = model.hidden(ids)
    loss = chunked.loss_sum(hidden, batch)
    with pytest.raises(RuntimeError, match=r"double backward.*NextTokenLoss"):
        torch.autograd.grad(loss, hidden, create_graph=True)
    with pytest.raises(RuntimeError, match=r"double backward.*NextTokenLoss"):
        loss.backward(create_graph=True)
    # the refusal leaves the loss usable: an ordinary backward gives plain cross-entropy's
    model.zero_grad(set_to_none=True)
    (loss * 0.37).backward()
    torch.testing.assert_close(model.mix.weight.grad, first_order["mix.weight"], rtol=1e-10,
                               atol=0)


def test_a_bfloat16_model_without_autocast_gets_bfloat16_gradients_close_to_the_materialized():
    torch.manual_seed(5)
    model = TiedLM(97, 16, tied=False, bias=True).to(torch.bfloat16)
    ids = torch.randint(0, 97, (3, 12))
    labels = labels_for(3, 12, 97, seed=5)
    ref_loss, ref = loss_and_grads(model, ids, labels, chunked=False, chunk=None)
    loss, got = loss_and_grads(model, ids, labels, chunked=True, chunk=5)
    assert loss.dtype == ref_loss.dtype == torch.float32
    assert abs(float(loss) - float(ref_loss)) <= 1e-3 * abs(float(ref_loss))
    assert {k: g.dtype for k, g in got.items()} == {k: torch.bfloat16 for k in ref}
    assert max_rel(ref, got) <= 2e-2
