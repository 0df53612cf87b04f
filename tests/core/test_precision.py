"""Mixed precision in the loop: autocast, the GradScaler's order, skipped-update accounting.

Tolerances (stated once, used everywhere below). Gradients are compared per parameter as
``max |candidate - fp32| / max |fp32|`` (``conftest.rel_error``) on a one-layer TinyGPT,
one window of 4 microbatches:

- fp16 autocast + GradScaler, after unscaling: at most ``FP16_RTOL = 5e-3`` (measured
  about 1e-3 on CPU, seeds 0-4): fp16 keeps 11 significant bits, ~5e-4 per rounding.
- bf16 autocast: at most ``BF16_RTOL = 3e-2`` (measured about 6e-3 to 9e-3): bf16 keeps
  8 significant bits, ~4e-3 per rounding.

Every test that touches a device runs on the CPU here and again on CUDA where there is
one (``@pytest.mark.cuda``, skipped without a GPU).
"""

from __future__ import annotations

import contextlib
import json
import math
import warnings
from collections.abc import Iterator

import pytest
import torch
from helpers.batches import rows, token_batch, trim
from helpers.gradients import capture, params, rel_error
from helpers.models import small_gpt
from torch import Tensor, nn

import accumlab as al
from accumlab.checks import parameters_of

FP16_RTOL = 5e-3
BF16_RTOL = 3e-2

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, CUDA])]
OBJECTIVE = al.NextTokenLoss()


def gpt_window(seed: int = 0, device: str = "cpu") -> list[dict[str, Tensor]]:
    """One window: 8 examples of different lengths in 4 microbatches of 2."""
    batch = token_batch(
        [(20, 5), (14, 3), (30, 10), (9, 2), (25, 0), (17, 6), (12, 4), (28, 8)],
        seed=seed,
        vocab=90,
    )
    return [
        {k: v.to(device) for k, v in trim(rows(batch, i, i + 2)).items()} for i in range(0, 8, 2)
    ]


def gpt(device: str = "cpu", seed: int = 0) -> nn.Module:
    return small_gpt(seed=seed).to(device)


def optimizer_state(opt: torch.optim.Optimizer) -> dict[int, dict[str, Tensor]]:
    """A deep copy of every parameter's optimizer state (step count, moments)."""
    return {
        i: {k: (v.detach().clone() if isinstance(v, Tensor) else v) for k, v in s.items()}
        for i, s in enumerate(opt.state.values())
    }


def assert_same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for i in a:
        assert a[i].keys() == b[i].keys()
        for k in a[i]:
            assert torch.equal(torch.as_tensor(a[i][k]), torch.as_tensor(b[i][k])), (i, k)


def assert_same_params(a: dict[str, Tensor], b: dict[str, Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


# --------------------------------------------------------------- agreement with fp32


@pytest.mark.parametrize("device", DEVICES)
def test_fp16_scaled_accumulation_matches_fp32_after_unscaling(device: str) -> None:
    window = gpt_window(device=device)
    ref_model, fp16_model = gpt(device), gpt(device)
    ref_opt, fp16_opt = capture(ref_model), capture(fp16_model)
    al.train_window(ref_model, window, ref_opt, OBJECTIVE, precision="fp32")
    scaler = torch.amp.GradScaler(device)
    report = al.train_window(
        fp16_model, window, fp16_opt, OBJECTIVE, precision="fp16", scaler=scaler
    )
    # The loss really was scaled by 2**16 and the optimizer really got the unscaled,
    # accumulated gradient: a scaled one would be off by a factor 65536.
    assert report.scale_before == 2.0**16
    assert report.applied and report.backward_passes == 4
    error = rel_error(ref_opt.seen[0], fp16_opt.seen[0])
    assert 0 < error <= FP16_RTOL  # > 0: fp16 really ran (bit-equal would mean fp32)
    assert math.isclose(report.grad_norm, _norm(ref_opt.seen[0]), rel_tol=FP16_RTOL)


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_accumulated_gradient_matches_fp32(device: str) -> None:
    window = gpt_window(device=device)
    ref_model, bf16_model = gpt(device), gpt(device)
    ref_opt, bf16_opt = capture(ref_model), capture(bf16_model)
    al.train_window(ref_model, window, ref_opt, OBJECTIVE, precision="fp32")
    report = al.train_window(bf16_model, window, bf16_opt, OBJECTIVE, precision="bf16")
    assert report.scale_before is None and report.scale_after is None  # no scaler for bf16
    assert 0 < rel_error(ref_opt.seen[0], bf16_opt.seen[0]) <= BF16_RTOL


def _norm(grads: dict[str, Tensor]) -> float:
    return float(torch.linalg.vector_norm(torch.stack([g.double().norm() for g in grads.values()])))


class TinyGradients(nn.Module):
    """A linear layer whose loss is ``1e-8 × output``: per-output gradients of about 1e-9,
    below fp16's smallest subnormal (6e-8), as happens late in training."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(8, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear(x)


def tiny_loss(output: Tensor, labels: Tensor) -> Tensor:
    return 1e-8 * output.float().sum(dim=1)


def test_fp16_without_scaling_underflows_and_the_scaler_recovers_the_gradient() -> None:
    torch.manual_seed(1)
    window = [{"x": torch.randn(4, 8), "labels": torch.zeros(4)} for _ in range(3)]
    objective = al.ExampleLoss(tiny_loss)
    seen = {}
    for name, precision, scaler in [
        ("fp32", "fp32", None),
        ("fp16+scaler", "fp16", torch.amp.GradScaler("cpu")),
        ("fp16 unscaled", "fp16", torch.amp.GradScaler("cpu", enabled=False)),
    ]:
        model = TinyGradients()
        opt = capture(model)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # the disabled-scaler warning
            al.train_window(model, window, opt, objective, precision=precision, scaler=scaler)
        seen[name] = opt.seen[0]
    assert float(seen["fp32"]["linear.weight"].abs().max()) > 0
    assert torch.count_nonzero(seen["fp16 unscaled"]["linear.weight"]) == 0  # underflowed
    assert rel_error(seen["fp32"], seen["fp16+scaler"]) <= FP16_RTOL


# --------------------------------------------------------------- the order in a window


class SpyScaler(torch.amp.GradScaler):
    """A GradScaler that logs each call with the scale it saw."""

    def __init__(self, device: str, log: list, **kwargs: float) -> None:
        super().__init__(device, **kwargs)
        self.log = log

    def scale(self, outputs):  # type: ignore[override]
        self.log.append(("scale", float(self.get_scale())))
        return super().scale(outputs)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        self.log.append(("unscale_", float(self.get_scale())))
        super().unscale_(optimizer)

    def step(self, optimizer, *args, **kwargs):  # type: ignore[override]
        self.log.append(("step", float(self.get_scale())))
        return super().step(optimizer, *args, **kwargs)

    def update(self, new_scale=None) -> None:  # type: ignore[override]
        super().update(new_scale)
        self.log.append(("update", float(self.get_scale())))


class SpySGD(torch.optim.SGD):
    def __init__(self, parameters, log: list, **kwargs: float) -> None:
        super().__init__(parameters, **kwargs)
        self.log = log

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.log.append(("zero_grad", None))
        super().zero_grad(set_to_none=set_to_none)


@pytest.mark.parametrize("device", DEVICES)
def test_scale_is_constant_within_a_window_and_the_boundary_order_is_exact(
    device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    log: list[tuple[str, float | None]] = []
    model = gpt(device)
    # A hook on a parameter used once per forward marks the end of each backward pass.
    model.ln_f.weight.register_hook(lambda g: log.append(("backward", None)))
    clip_seen: list[float] = []
    real_clip = torch.nn.utils.clip_grads_with_norm_

    def spy_clip(parameters, max_norm, *args, **kwargs):  # type: ignore[no-untyped-def]
        parameters = list(parameters)
        clip_seen.append(_norm({str(i): p.grad for i, p in enumerate(parameters)}))
        log.append(("clip", None))
        return real_clip(parameters, max_norm, *args, **kwargs)

    monkeypatch.setattr(torch.nn.utils, "clip_grads_with_norm_", spy_clip)
    # growth_interval=1 doubles the scale after every applied update, so a scale that
    # leaked from one window into the next, or changed inside one, would show.
    scaler = SpyScaler(device, log, init_scale=2.0**10, growth_interval=1)
    opt = SpySGD(model.parameters(), log, lr=0.01)
    windows = [gpt_window(seed=s, device=device) for s in range(3)]
    batches = [mb for w in windows for mb in w]
    plan = al.AccumulationPlan(micro_batch_size=2, accumulation_steps=4)
    reference = _fp32_grad_norm(gpt(device), windows[0])

    ledger = al.train(
        model,
        batches,
        opt,
        plan,
        OBJECTIVE,
        precision="fp16",
        scaler=scaler,
        clip_grad_norm=1e6,
        progress=False,
    )

    assert ledger.update_attempts == ledger.updates_applied == 3
    one_window = (
        ["zero_grad"]
        + ["scale", "backward"] * 4
        + ["unscale_", "clip", "step", "update"]
        + ["zero_grad"]
    )
    assert [name for name, _ in log] == one_window * 3
    per_window = len(one_window)
    for w, report in enumerate(ledger.reports):
        events = log[w * per_window : (w + 1) * per_window]
        scales = {value for name, value in events if name == "scale"}
        assert scales == {report.scale_before} == {2.0 ** (10 + w)}  # one scale per window
        assert events[-2] == ("update", report.scale_after)
        assert report.scale_after == 2 * report.scale_before
    # Clipping saw the unscaled gradient: the fp32 norm, not 1024 times it.
    assert math.isclose(clip_seen[0], reference, rel_tol=FP16_RTOL)


def _fp32_grad_norm(model: nn.Module, window: list[dict[str, Tensor]]) -> float:
    opt = capture(model)
    al.train_window(model, window, opt, OBJECTIVE)
    return _norm(opt.seen[0])


# --------------------------------------------------------------- skipped updates


def _scheduled_adam(model: nn.Module) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda u: 1.0 / (u + 1))


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("value", [math.inf, math.nan])
def test_injected_nonfinite_gradient_skips_the_update_and_the_next_window_applies(
    device: str, precision: str, value: float
) -> None:
    model = gpt(device)
    opt, scheduler = _scheduled_adam(model)
    scaler = torch.amp.GradScaler(device) if precision == "fp16" else None
    ledger = al.Ledger()

    def window(i: int) -> al.UpdateReport:
        return al.train_window(
            model,
            gpt_window(seed=i, device=device),
            opt,
            OBJECTIVE,
            precision=precision,
            scaler=scaler,
            scheduler=scheduler,
            index=i,
        )

    ledger.record(window(0))
    weights, state = params(model), optimizer_state(opt)
    lr, epoch = opt.param_groups[0]["lr"], scheduler.last_epoch
    with al.inject_nonfinite(model.ln_f.weight, value):
        skipped = window(1)
    ledger.record(skipped)

    assert not skipped.applied and skipped.skipped_reason == "non-finite gradient"
    assert_same_params(weights, params(model))
    assert_same_state(state, optimizer_state(opt))
    assert all(int(s["step"]) == 1 for s in opt.state.values())
    assert opt.param_groups[0]["lr"] == lr and scheduler.last_epoch == epoch
    assert all(p.grad is None for p in model.parameters())  # nothing left for the next window
    if precision == "fp16":
        assert skipped.scale_after == skipped.scale_before * 0.5 == 2.0**15
    else:
        assert skipped.scale_before is None and skipped.scale_after is None

    applied = window(2)
    ledger.record(applied)
    assert applied.applied and applied.skipped_reason is None
    assert math.isfinite(applied.grad_norm) and applied.lr == lr
    assert any(not torch.equal(weights[n], p) for n, p in model.named_parameters())
    assert all(int(s["step"]) == 2 for s in opt.state.values())
    assert scheduler.last_epoch == epoch + 1
    if precision == "fp16":
        assert applied.scale_before == skipped.scale_after  # the same scaler carried on
    assert (ledger.update_attempts, ledger.updates_applied, ledger.updates_skipped) == (3, 2, 1)
    assert ledger.losses == [ledger.reports[0].loss, ledger.reports[2].loss]


@pytest.mark.parametrize("device", DEVICES)
def test_train_uses_one_scaler_for_the_run_and_counts_skips(device: str) -> None:
    model = gpt(device)
    opt, scheduler = _scheduled_adam(model)
    batches = [mb for s in range(3) for mb in gpt_window(seed=s, device=device)]
    plan = al.AccumulationPlan(micro_batch_size=2, accumulation_steps=4)
    injection = contextlib.ExitStack()

    def arm(report: al.UpdateReport) -> None:  # poison window 1 only
        if report.index == 0:
            injection.enter_context(al.inject_nonfinite(model.ln_f.weight))
        else:
            injection.close()

    ledger = al.train(
        model,
        batches,
        opt,
        plan,
        OBJECTIVE,
        precision="fp16",
        scheduler=scheduler,
        on_update=arm,
        progress=False,
    )
    injection.close()
    applied = [r.applied for r in ledger.reports]
    assert applied == [True, False, True]
    assert (ledger.update_attempts, ledger.updates_applied, ledger.updates_skipped) == (3, 2, 1)
    # One scaler for the whole run: window 2 starts from the scale window 1 backed off to
    # (a scaler per window would start every window at 2**16 again).
    scales = [(r.scale_before, r.scale_after) for r in ledger.reports]
    assert scales == [(2.0**16, 2.0**16), (2.0**16, 2.0**15), (2.0**15, 2.0**15)]
    assert scheduler.last_epoch == 2  # two applied updates
    assert [r.lr for r in ledger.reports] == [1e-2, 5e-3, 5e-3]

    record = al.RunRecord.from_run(plan, ledger, precision="fp16")
    assert (record.updates_skipped, record.skipped_nonfinite, record.skipped_no_targets) == (1, 1, 0)


def test_scheduler_per_attempt_advances_on_a_skipped_update() -> None:
    model = gpt()
    opt, scheduler = _scheduled_adam(model)
    al.train_window(model, gpt_window(0), opt, OBJECTIVE, scheduler=scheduler)
    weights = params(model)
    with al.inject_nonfinite(model.ln_f.weight):
        report = al.train_window(
            model, gpt_window(1), opt, OBJECTIVE, scheduler=scheduler, scheduler_per="attempt"
        )
    assert not report.applied
    assert_same_params(weights, params(model))
    assert scheduler.last_epoch == 2 and opt.param_groups[0]["lr"] == pytest.approx(1e-2 / 3)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_nonfinite_raise_stops_without_touching_the_weights(precision: str) -> None:
    model = gpt()
    opt, scheduler = _scheduled_adam(model)
    al.train_window(model, gpt_window(0), opt, OBJECTIVE, scheduler=scheduler)
    weights, state = params(model), optimizer_state(opt)
    with (
        al.inject_nonfinite(model.ln_f.weight),
        pytest.raises(FloatingPointError, match="window 1"),
    ):
        al.train_window(
            model,
            gpt_window(1),
            opt,
            OBJECTIVE,
            precision=precision,
            scheduler=scheduler,
            nonfinite="raise",
            index=1,
        )
    assert_same_params(weights, params(model))
    assert_same_state(state, optimizer_state(opt))
    assert scheduler.last_epoch == 1
    assert all(p.grad is None for p in model.parameters())


def test_with_a_scaler_a_skip_is_normal_even_when_nonfinite_is_raise() -> None:
    model = gpt()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with al.inject_nonfinite(model.ln_f.weight):
        report = al.train_window(
            model, gpt_window(0), opt, OBJECTIVE, precision="fp16", nonfinite="raise"
        )
    assert not report.applied and report.scale_after == 2.0**15


class Huge(nn.Module):
    """``output = x · w`` with four weights: the gradient is the inputs' mean."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(4))

    def forward(self, x: Tensor) -> Tensor:
        return x @ self.w


@pytest.mark.parametrize("with_scaler", [False, True])
def test_a_large_finite_gradient_is_applied_and_reported_as_applied(with_scaler: bool) -> None:
    # Each gradient entry is 1e20: finite in float32, but the sum of their squares (4e40)
    # overflows float32, so a float32 gradient *norm* is inf. The loop's norm falls back to
    # float64 there: it is finite (2e20), the window is applied and the weights agree.
    model = Huge()
    window = [{"x": torch.full((2, 4), 1e20), "labels": torch.zeros(2)}]
    opt = torch.optim.SGD(model.parameters(), lr=1e-20)
    scaler = torch.amp.GradScaler("cpu", init_scale=1.0) if with_scaler else None
    report = al.train_window(
        model, window, opt, al.ExampleLoss(lambda out, y: out), scaler=scaler
    )
    assert math.isclose(report.grad_norm, 2e20, rel_tol=1e-6)  # sqrt(4) x 1e20, no overflow
    assert report.applied and report.skipped_reason is None
    torch.testing.assert_close(model.w.detach(), torch.full((4,), -1.0))
    if with_scaler:
        assert report.scale_after == report.scale_before == 1.0


def test_overflow_while_unscaling_is_skipped_although_the_scaler_saw_none() -> None:
    # With a scale below 1, the scaled gradient (1.2e36) is finite, so the GradScaler's own
    # check passes and scaler.step would apply it; unscaling (x 1024) overflows it to inf.
    # The loop must skip the update anyway and say that the scale was not reduced.
    model = Huge()
    window = [{"x": torch.full((1, 4), 3e38), "labels": torch.zeros(1)}]
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**-10)
    with pytest.warns(RuntimeWarning, match="non-finite only after unscaling"):
        report = al.train_window(
            model, window, opt, al.ExampleLoss(lambda out, y: 4 * out), scaler=scaler
        )
    assert not report.applied and report.skipped_reason == "non-finite gradient"
    assert report.scale_after == report.scale_before == 2.0**-10  # the scaler saw no inf
    assert torch.equal(model.w.detach(), torch.zeros(4))


def test_a_window_without_targets_is_skipped_and_leaves_the_scale_alone() -> None:
    model = gpt()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    empty = [dict(mb, labels=torch.full_like(mb["labels"], -100)) for mb in gpt_window(0)]
    weights = params(model)
    with pytest.warns(UserWarning, match="for this window alone"):
        report = al.train_window(model, empty, opt, OBJECTIVE, precision="fp16")
    assert not report.applied and report.skipped_reason == "no targets"
    assert report.scale_before == report.scale_after == 2.0**16
    assert_same_params(weights, params(model))


def test_train_window_fp16_without_a_scaler_warns_that_the_scale_cannot_adapt() -> None:
    model = gpt()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.warns(UserWarning, match="pass it to every window"):
        report = al.train_window(model, gpt_window(0), opt, OBJECTIVE, precision="fp16")
    assert report.applied and report.scale_before == 2.0**16
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # train() makes one scaler for the run: no warning
        plan = al.AccumulationPlan(micro_batch_size=2, accumulation_steps=2)
        ledger = al.train(model, gpt_window(0), opt, plan, OBJECTIVE, precision="fp16",
                          progress=False)
    assert ledger.updates_applied == 2  # 4 microbatches, A = 2


# --------------------------------------------------------------- helpers


def test_gradients_finite_checks_each_tensor() -> None:
    a, b = torch.zeros(3, requires_grad=True), torch.zeros(2, requires_grad=True)
    assert al.gradients_finite([a, b])  # no gradients at all
    a.grad = torch.full((3,), 3e38)  # finite, though its norm overflows float32
    assert al.gradients_finite([a, b])
    assert not math.isfinite(float(torch.linalg.vector_norm(a.grad)))
    b.grad = torch.tensor([1.0, math.nan])
    assert not al.gradients_finite([a, b])
    b.grad = torch.tensor([-math.inf, 0.0])
    assert not al.gradients_finite([a, b])
    assert al.gradients_finite([a])


def test_parameters_of_adds_optimizer_parameters_outside_the_model_once() -> None:
    model = nn.Linear(2, 1)
    extra = nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([*model.parameters(), extra], lr=0.1)
    found = parameters_of(model, opt)
    assert [id(p) for p in found] == [id(p) for p in [*model.parameters(), extra]]


def test_inject_nonfinite_is_removed_on_exit_and_checks_its_arguments() -> None:
    w = nn.Parameter(torch.ones(2))
    with al.inject_nonfinite(w):
        (w * 2).sum().backward()
    assert torch.isinf(w.grad).all()
    w.grad = None
    (w * 2).sum().backward()
    assert torch.equal(w.grad, torch.full((2,), 2.0))
    with pytest.raises(ValueError, match="value"):
        with al.inject_nonfinite(w, 1e30):
            pass
    with pytest.raises(TypeError, match="requires grad"):
        with al.inject_nonfinite(torch.ones(2)):
            pass


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("precision", "dtype"),
    [("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)],
)
def test_policy_autocasts_the_forward_and_keeps_float32_weights(
    device: str, precision: str, dtype: torch.dtype
) -> None:
    policy = al.precision_policy(precision, device)
    layer = nn.Linear(4, 4).to(device)
    with policy.autocast():
        out = layer(torch.ones(2, 4, device=device))
    assert out.dtype == dtype
    assert policy.needs_scaler == (precision == "fp16")
    model = gpt(device)
    al.train_window(
        model,
        gpt_window(device=device),
        torch.optim.SGD(model.parameters(), lr=0.1),
        OBJECTIVE,
        precision=precision,
    )
    assert all(p.dtype == torch.float32 for p in model.parameters())


# --------------------------------------------------------------- bad input


class _Untouchable:
    """An iterable that fails the test if anything reads it."""

    def __iter__(self) -> Iterator[dict]:
        raise AssertionError("train read data before checking its arguments")


@pytest.mark.parametrize("bad", ["float16", "FP16", "half", "int8", ""])
def test_unknown_precision_is_a_clear_error(bad: str) -> None:
    model = gpt()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    plan = al.AccumulationPlan(micro_batch_size=2, accumulation_steps=4)
    with pytest.raises(ValueError, match=r"precision must be one of \['fp32', 'bf16', 'fp16'\]"):
        al.train_window(model, gpt_window(0), opt, OBJECTIVE, precision=bad)
    with pytest.raises(ValueError, match="precision must be one of"):
        al.train(model, _Untouchable(), opt, plan, OBJECTIVE, precision=bad, progress=False)


def test_unknown_precision_suggests_the_course_name() -> None:
    with pytest.raises(ValueError, match=r"did you mean precision='fp16'"):
        al.precision_policy("float16", "cpu")
    with pytest.raises(ValueError, match=r"did you mean precision='bf16'"):
        al.precision_policy("bfloat16", "cpu")
    with pytest.raises(TypeError, match="precision must be a string"):
        al.precision_policy(torch.float16, "cpu")  # type: ignore[arg-type]


def test_precision_on_a_device_without_autocast_is_rejected() -> None:
    assert al.precision_policy("fp32", "meta").autocast_dtype is None
    with pytest.raises(ValueError, match="device type 'meta'"):
        al.precision_policy("bf16", "meta")


def _wrong_device_scaler(model_device: str) -> torch.amp.GradScaler:
    other = "cuda" if model_device == "cpu" else "cpu"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch: "CUDA is not available. Disabling"
        return torch.amp.GradScaler(other)


@pytest.mark.parametrize("device", DEVICES)
def test_scaler_for_the_wrong_device_is_a_clear_error(device: str) -> None:
    model = gpt(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = _wrong_device_scaler(device)
    plan = al.AccumulationPlan(micro_batch_size=2, accumulation_steps=4)
    expected = rf"GradScaler was built for device .* model is on '{device}'.*GradScaler\('{device}'\)"
    with pytest.raises(ValueError, match=expected):
        al.train_window(
            model, gpt_window(device=device), opt, OBJECTIVE, precision="fp16", scaler=scaler
        )
    with pytest.raises(ValueError, match=expected):
        al.train(model, _Untouchable(), opt, plan, OBJECTIVE, precision="fp16", scaler=scaler)


def test_scaler_of_the_wrong_type_is_a_clear_error() -> None:
    model = gpt()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="scaler must be a torch.amp.GradScaler"):
        al.train_window(
            model, gpt_window(0), opt, OBJECTIVE, precision="fp16", scaler=object()  # type: ignore[arg-type]
        )


def test_disabled_scaler_with_fp16_warns_once_and_still_trains() -> None:
    model = gpt()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    batches = [mb for s in range(3) for mb in gpt_window(seed=s)]
    plan = al.AccumulationPlan(micro_batch_size=2, accumulation_steps=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ledger = al.train(
            model, batches, opt, plan, OBJECTIVE, precision="fp16", scaler=scaler, progress=False
        )
    messages = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    assert len(messages) == 1 and "disabled GradScaler" in messages[0]
    assert "underflow" in messages[0]
    assert ledger.updates_applied == 3
    assert all(r.scale_before is None for r in ledger.reports)  # no loss scaling happened


def test_a_disabled_scaler_under_bf16_is_silent() -> None:
    model = gpt()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        report = al.train_window(
            model,
            gpt_window(0),
            opt,
            OBJECTIVE,
            precision="bf16",
            scaler=torch.amp.GradScaler("cpu", enabled=False),
        )
    assert report.applied


# --------------------------------------------------------------- the run record


def test_run_record_carries_precision_scaler_settings_and_skip_counts() -> None:
    model = gpt()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=50)
    ledger = al.Ledger()
    ledger.record(
        al.train_window(model, gpt_window(0), opt, OBJECTIVE, precision="fp16", scaler=scaler)
    )
    with al.inject_nonfinite(model.ln_f.weight):
        ledger.record(
            al.train_window(model, gpt_window(1), opt, OBJECTIVE, precision="fp16", scaler=scaler)
        )
    empty = [dict(mb, labels=torch.full_like(mb["labels"], -100)) for mb in gpt_window(2)]
    ledger.record(al.train_window(model, empty, opt, OBJECTIVE, precision="fp16", scaler=scaler))
    plan = al.AccumulationPlan(micro_batch_size=2, accumulation_steps=4)

    record = al.RunRecord.from_run(plan, ledger, precision="fp16", scaler=scaler)
    assert record.precision == "fp16"
    assert record.scaler == {
        "enabled": True,
        "device": "cpu",
        "init_scale": 4096.0,
        "scale": 2048.0,
        "growth_factor": 2.0,
        "backoff_factor": 0.5,
        "growth_interval": 50,
    }
    assert (record.update_attempts, record.updates_applied, record.updates_skipped) == (3, 1, 2)
    assert (record.skipped_nonfinite, record.skipped_no_targets) == (1, 1)
    parsed = json.loads(record.to_json())
    assert parsed["scaler"]["init_scale"] == 4096.0 and parsed["skipped_nonfinite"] == 1
    markdown = record.to_markdown()
    assert "| scaler.backoff_factor | 0.5 |" in markdown
    assert "| skipped_no_targets | 1 |" in markdown

    plain = al.RunRecord.from_run(plan, ledger)
    assert plain.scaler is None and plain.precision == "fp32"
    disabled = al.RunRecord.from_run(
        plan, ledger, precision="fp16", scaler=torch.amp.GradScaler("cpu", enabled=False)
    )
    assert disabled.scaler == {"enabled": False}


def test_run_record_rejects_bad_precision_and_scaler() -> None:
    plan = al.AccumulationPlan(micro_batch_size=2, accumulation_steps=4)
    with pytest.raises(ValueError, match="precision must be one of"):
        al.RunRecord.from_run(plan, al.Ledger(), precision="float16")
    with pytest.raises(TypeError, match="scaler must be a torch.amp.GradScaler"):
        al.RunRecord.from_run(plan, al.Ledger(), scaler="fp16")  # type: ignore[arg-type]


def test_a_caller_scaler_is_used_as_given() -> None:
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    policy = al.precision_policy("fp16", "cpu")
    assert al.resolve_scaler(policy, scaler) is scaler
    assert al.resolve_scaler(al.precision_policy("bf16", "cpu"), None) is None
    created = al.resolve_scaler(policy, None)
    assert isinstance(created, torch.amp.GradScaler) and created.is_enabled()
    model = gpt()
    report = al.train_window(
        model,
        gpt_window(0),
        torch.optim.SGD(model.parameters(), lr=0.1),
        OBJECTIVE,
        precision="fp16",
        scaler=scaler,
    )
    assert report.scale_before == 8.0 and scaler.get_scale() == 8.0
