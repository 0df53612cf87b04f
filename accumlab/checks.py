"""Checks that accumulation is exact: the accumulated gradient against the full-batch one.

Floating-point addition is not associative, so the two gradients agree to a tolerance,
never bit for bit: about 1e-6 relative in float32, 1e-12 in float64 for the small models
of this course.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import inspect
import math
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from .loop import Forward, accumulate
from .objectives import NextTokenLoss, Objective, check_batch, take_rows


def split_batch(batch: Mapping[str, Tensor], sizes: Sequence[int]) -> list[dict[str, Tensor]]:
    """Cut a batch into consecutive microbatches of ``sizes`` examples (rows of dim 0).

    ``sizes`` must be positive and sum to the batch size: no example is left out or reused.
    """
    batch = check_batch(batch)
    n = int(batch["labels"].shape[0])
    sizes = list(sizes)
    if not sizes or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in sizes):
        raise ValueError(f"splits must be a non-empty list of positive ints, got {sizes!r}")
    if sum(sizes) != n:
        raise ValueError(
            f"splits {sizes} add up to {sum(sizes)} examples but the batch has {n}; every "
            "example must land in exactly one microbatch"
        )
    for key, value in batch.items():
        if isinstance(value, Tensor) and (value.dim() == 0 or value.shape[0] != n):
            raise ValueError(
                f"batch[{key!r}] has shape {tuple(value.shape)}; every tensor needs the "
                f"batch size {n} as its first dimension"
            )
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [take_rows(batch, start, start + size) for start, size in zip(starts, sizes, strict=True)]


def gradients(model: nn.Module) -> dict[str, Tensor]:
    """A detached copy of every parameter's ``.grad`` (zeros where it is None)."""
    return {
        name: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
        for name, p in model.named_parameters()
        if p.requires_grad
    }


@dataclass
class GradientComparison:
    """Per-parameter and overall errors of ``candidate`` against ``reference`` gradients.

    ``max_abs[name]`` is ``max |candidate - reference|``; ``relative[name]`` divides it by
    ``max |reference|`` of that parameter (0 where both are zero). ``max_abs_error`` and
    ``max_rel_error`` are the largest over all parameters.
    """

    max_abs: dict[str, float]
    relative: dict[str, float]

    @property
    def max_abs_error(self) -> float:
        return max(self.max_abs.values(), default=0.0)

    @property
    def max_rel_error(self) -> float:
        return max(self.relative.values(), default=0.0)

    def ok(self, rtol: float = 1e-5) -> bool:
        """True when every parameter's relative error is at most ``rtol``."""
        return self.max_rel_error <= rtol

    def __str__(self) -> str:
        worst = max(self.relative, key=self.relative.__getitem__, default="-")
        return (
            f"max abs error {self.max_abs_error:.2e}, max relative error "
            f"{self.max_rel_error:.2e} (worst parameter: {worst})"
        )


def compare(reference: Mapping[str, Tensor], candidate: Mapping[str, Tensor]) -> GradientComparison:
    """Compare two gradient dictionaries with the same names and shapes."""
    if reference.keys() != candidate.keys():
        raise ValueError(
            f"gradient names differ: {sorted(set(reference) ^ set(candidate))}"
        )
    max_abs, relative = {}, {}
    for name, ref in reference.items():
        cand = candidate[name]
        if cand.shape != ref.shape:
            raise ValueError(f"{name}: shapes {tuple(cand.shape)} and {tuple(ref.shape)} differ")
        err = float((cand.double() - ref.double()).abs().max()) if ref.numel() else 0.0
        scale = float(ref.double().abs().max()) if ref.numel() else 0.0
        max_abs[name] = err
        relative[name] = err / scale if scale > 0 else (0.0 if err == 0 else float("inf"))
    return GradientComparison(max_abs, relative)


# -- finiteness: checks and a fault injector for tests and notebooks -------------------


def gradients_finite(parameters: Iterable[Tensor]) -> bool:
    """True when every existing ``.grad`` among ``parameters`` is free of inf and nan.

    Checks each gradient tensor element-wise (``torch.isfinite(grad).all()``), so it never
    reports a finite gradient as non-finite the way ``isfinite(total norm)`` can: the sum
    of squares of finite float32 values above about 1.8e19 overflows to ``inf``. Parameters
    without a gradient are ignored; with none at all the answer is True. One device
    synchronization per call.
    """
    flags = [
        torch.isfinite(p.grad.detach()).all()
        for p in parameters
        if p.grad is not None and p.grad.numel()
    ]
    if not flags:
        return True
    devices = {f.device for f in flags}
    if len(devices) > 1:  # a model split over devices: gather the flags on the CPU
        flags = [f.cpu() for f in flags]
    return bool(torch.stack(flags).all())


def parameters_of(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[Tensor]:
    """The model's parameters followed by any parameter the optimizer holds beyond them,
    each once: the set whose gradients decide whether an update attempt may be applied."""
    seen: set[int] = set()
    out: list[Tensor] = []
    candidates = [*model.parameters(), *(p for g in optimizer.param_groups for p in g["params"])]
    for p in candidates:
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


@contextlib.contextmanager
def inject_nonfinite(parameter: Tensor, value: float = math.inf) -> Iterator[None]:
    """Make every gradient that reaches ``parameter`` inside the block non-finite.

    Registers a tensor hook that multiplies each incoming gradient contribution by
    ``value`` (``inf`` by default; entries that were zero become ``nan``), and removes it
    on exit. A fault injector for tests and demonstrations: wrap one window in it and that
    window's update attempt must be skipped while every other window applies normally.
    """
    if not isinstance(parameter, Tensor) or not parameter.requires_grad:
        raise TypeError(
            "parameter must be a tensor that requires grad (e.g. a model parameter), got "
            f"{type(parameter).__name__}"
        )
    if math.isfinite(value):
        raise ValueError(f"value must be inf, -inf or nan, got {value!r}")
    handle = parameter.register_hook(lambda grad: grad * value)
    try:
        yield
    finally:
        handle.remove()


def accumulated_gradient(
    model: nn.Module,
    batch: Mapping[str, Tensor],
    objective: Objective,
    splits: Sequence[int] | None = None,
    *,
    forward: Forward | None = None,
) -> dict[str, Tensor]:
    """The gradient the loop accumulates from ``batch`` cut into microbatches of
    ``splits`` examples; ``splits=None`` is the whole batch in one backward pass, the
    gradient of ``loss_sum(batch) / count(batch)``.

    Works on the model in place (its ``.grad`` is cleared before and after).
    """
    window = [batch] if splits is None else split_batch(batch, splits)
    model.zero_grad(set_to_none=True)
    accumulate(model, window, objective, forward=forward)
    grads = gradients(model)
    model.zero_grad(set_to_none=True)
    return grads


#: The full-batch reference: ``accumulated_gradient`` without ``splits``.
full_batch_gradient = accumulated_gradient


def compare_gradients(
    model: nn.Module,
    batch: Mapping[str, Tensor],
    objective: Objective,
    splits: Sequence[int],
    *,
    forward: Forward | None = None,
) -> GradientComparison:
    """Full-batch gradient against the accumulated one for the split ``splits``.

    Runs on two deep copies of ``model`` (the original's weights and ``.grad`` are left
    alone), each seeded the same so dropout, if active, draws the same way at the start.
    Returns the per-parameter errors of the accumulated gradient relative to the full one.
    """
    rng = torch.get_rng_state()
    reference = accumulated_gradient(copy.deepcopy(model), batch, objective, forward=forward)
    torch.set_rng_state(rng)
    candidate = accumulated_gradient(
        copy.deepcopy(model), batch, objective, splits, forward=forward
    )
    return compare(reference, candidate)


# ---------------------------------------------------------------------------------------
# audit: run a user's window loop on a controlled set whose correct updates are known
# ---------------------------------------------------------------------------------------

#: Every name ``AuditReport.mistakes`` can hold, in the order they are reported.
MISTAKES: tuple[str, ...] = (
    "double_division",
    "average_of_averages",
    "ignored_tokens_counted",
    "zero_grad_in_window",
    "no_update",
    "step_per_microbatch",
    "scheduler_per_microbatch",
    "kept_references",
)

#: For each mistake: the symptom a user sees in a real run, and the fix.
ADVICE: dict[str, tuple[str, str]] = {
    "double_division": (
        "an abnormally small loss and updates A times too small (with SGD the run looks like "
        "one with a learning rate A times lower; Adam's normalization mostly hides the scale)",
        "divide each microbatch's loss sum once, by the window's target count; no extra / A "
        "(and none on top of a framework that already normalizes)",
    ),
    "average_of_averages": (
        "a result that depends on how the examples are split into microbatches: a target in "
        "a short microbatch weighs more than one in a long microbatch",
        "sum the token losses (reduction='sum') and divide by the target count of the whole "
        "window, counted before the forward passes; never average the microbatch means",
    ),
    "ignored_tokens_counted": (
        "a result that depends on padding and prompt length, and a loss that looks too small: "
        "the denominator counts positions that have no target",
        "count only supervised targets after the shift: (labels[:, 1:] != -100).sum()",
    ),
    "zero_grad_in_window": (
        "accumulation with no effect: only the last microbatch's gradient reaches the update, "
        "as if A were 1",
        "clear the gradients once per window: before its first microbatch or right after "
        "optimizer.step(), never between two backward passes of the same window",
    ),
    "no_update": (
        "accumulation with no effect: the weights and the loss do not move",
        "call optimizer.step() once per window, after the window's last backward pass",
    ),
    "step_per_microbatch": (
        "A small updates per window instead of one: the effective batch is the microbatch, "
        "the update count is A times too high, and later gradients are taken at moved weights",
        "call optimizer.step() (and zero_grad) once per window, after the last backward pass",
    ),
    "scheduler_per_microbatch": (
        "a shifted schedule: warmup and decay run A times too fast, counted in backward "
        "passes instead of updates",
        "call scheduler.step() once per update, right after optimizer.step()",
    ),
    "kept_references": (
        "growing memory: live memory rises window after window until the run is out of memory",
        "log loss.item() (a Python float); do not keep outputs, logits or loss tensors across "
        "windows (del them at the end of each microbatch)",
    ),
}

# The controlled set: windows of microbatches, each microbatch a list of rows
# (real tokens, prompt tokens). Rows are right-padded to the longest row of their
# microbatch; prompt and padding labels are -100. Every microbatch has targets, target
# counts differ inside each window, and the candidate denominators (targets, positions,
# attention-mask tokens; per window or per microbatch; times 1, A or A²) differ from one
# another on every microbatch, so each weighting mistake has its own fingerprint.
AUDIT_WINDOWS: tuple[tuple[tuple[tuple[int, int], ...], ...], ...] = (
    (((9, 3), (6, 2)), ((12, 4),), ((5, 1), (7, 3), (10, 5)), ((8, 2), (4, 3))),
    (((11, 2),), ((6, 3), (9, 1)), ((7, 4), (12, 2), (5, 2)), ((10, 6), (3, 1))),
    (((8, 1), (8, 4)), ((12, 3), (4, 1)), ((6, 2),), ((9, 2), (11, 7), (5, 1))),
    (((10, 4), (7, 3), (5, 1)), ((9, 2),)),  # a short last window
)
AUDIT_VOCAB = 13
AUDIT_LR = 0.1
_TOL = 1e-6  # relative: every measurement below is float64 and exact up to rounding


@dataclass
class AuditOutput:
    """What the audit's model returns: ``logits`` (batch, seq, vocab) and, when called
    with ``labels``, ``loss`` computed the way a Hugging Face causal LM does (mean over the
    microbatch's targets, or their sum over ``num_items_in_batch`` when that is given)."""

    logits: Tensor
    loss: Tensor | None = None


class AuditLM(nn.Module):
    """A tiny causal language model (the audit runs it in float64), called like a Hugging
    Face model.

    Position ``t`` sees the tokens at positions ``<= t`` only (its own embedding and the
    mean of the prefix), so right padding never changes a real token's logits and every
    row is computed independently of the others.
    """

    def __init__(self, vocab_size: int = AUDIT_VOCAB, width: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, width)
        self.mix = nn.Linear(2 * width, width)
        self.head = nn.Linear(width, vocab_size)

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        labels: Tensor | None = None,
        num_items_in_batch: int | Tensor | None = None,
        use_cache: bool | None = None,
    ) -> AuditOutput:
        x = self.embed(input_ids)
        steps = torch.arange(1, x.shape[1] + 1, device=x.device, dtype=x.dtype)
        prefix = x.cumsum(dim=1) / steps[:, None]  # mean of positions <= t: causal
        logits = self.head(torch.tanh(self.mix(torch.cat([x, prefix], dim=-1))))
        loss = None
        if labels is not None:
            flat = logits[:, :-1].reshape(-1, logits.size(-1))
            targets = labels[:, 1:].reshape(-1).to(logits.device)
            if num_items_in_batch is None:
                loss = nn.functional.cross_entropy(flat, targets, ignore_index=-100)
            else:
                loss = nn.functional.cross_entropy(
                    flat, targets, ignore_index=-100, reduction="sum"
                ) / num_items_in_batch
        return AuditOutput(logits=logits, loss=loss)


def audit_windows(seed: int = 0) -> list[list[dict[str, Tensor]]]:
    """The controlled set: ``AUDIT_WINDOWS`` as microbatch dicts (``input_ids``,
    ``attention_mask``, ``labels``), token ids drawn with ``seed``."""
    g = torch.Generator().manual_seed(seed)
    windows = []
    for spec in AUDIT_WINDOWS:
        window = []
        for rows in spec:
            width = max(n for n, _ in rows)
            ids = torch.zeros(len(rows), width, dtype=torch.long)
            mask = torch.zeros_like(ids)
            labels = torch.full_like(ids, -100)
            for r, (n, prompt) in enumerate(rows):
                ids[r, :n] = torch.randint(1, AUDIT_VOCAB, (n,), generator=g)
                mask[r, :n] = 1
                labels[r, prompt:n] = ids[r, prompt:n]
            window.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
        windows.append(window)
    return windows


@dataclass(frozen=True)
class _Weighting:
    """A way to weight a window's microbatches: what each loss sum is divided by."""

    key: str
    mistakes: tuple[str, ...]
    note: str | None = None


def _weightings(window: Sequence[Mapping[str, Tensor]]) -> list[tuple[_Weighting, list[float]]]:
    """Each candidate weighting with the divisor it gives every microbatch of ``window``.

    The right one divides every loss sum by the window's targets. The others are the
    mistakes: an extra ``/ A`` (double division), per-microbatch means averaged over the
    window (average of averages), counts that include ignored positions, and combinations.
    """
    a = len(window)
    counts = {
        "targets": [int((mb["labels"][:, 1:] != -100).sum()) for mb in window],
        "label positions": [int(mb["labels"][:, 1:].numel()) for mb in window],
        "attention-mask tokens": [int(mb["attention_mask"].sum()) for mb in window],
    }
    out: list[tuple[_Weighting, list[float]]] = [
        (
            _Weighting("nothing", (), "the loss sums are not divided at all: every update is "
                       "as many times too large as the window has targets"),
            [1.0] * a,
        )
    ]
    for unit, c in counts.items():
        ignored = () if unit == "targets" else ("ignored_tokens_counted",)
        total = float(sum(c))
        out.append((_Weighting(f"{unit} in the window", ignored), [total] * a))
        out.append(
            (_Weighting(f"A × {unit} in the window", (*ignored, "double_division")), [a * total] * a)
        )
        if a == 1:
            continue  # one microbatch: per-microbatch and per-window weightings coincide
        aoa = ("average_of_averages", *ignored)
        out.append(
            (
                _Weighting(
                    f"{unit} in the microbatch",
                    aoa,
                    "the microbatch means are added without dividing by A: every update is "
                    "A times too large",
                ),
                [float(x) for x in c],
            )
        )
        out.append((_Weighting(f"A × {unit} in the microbatch", aoa), [a * float(x) for x in c]))
        out.append(
            (
                _Weighting(f"A² × {unit} in the microbatch", (*aoa, "double_division")),
                [a * a * float(x) for x in c],
            )
        )
    return out


def _flat(tensors: Sequence[Tensor]) -> Tensor:
    return torch.cat([t.detach().reshape(-1).to(torch.float64) for t in tensors])


def _flat_grad(params: Sequence[nn.Parameter]) -> Tensor:
    return _flat([p.grad if p.grad is not None else torch.zeros_like(p) for p in params])


@dataclass
class _Forward:
    window: int
    microbatch: int | None  # index in the window, None when the input matches none
    theta: Tensor  # the weights the forward pass ran at
    backward: bool = False


@dataclass
class _Step:
    window: int
    theta: Tensor
    grad: Tensor  # the gradient optimizer.step found (zeros where .grad is None)


class _Created(TorchDispatchMode):
    """Keeps a weak reference to every tensor an operator creates while it is on."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: list[weakref.ReferenceType[Tensor]] = []
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if not self.paused:
            for t in tree_leaves(out):
                if isinstance(t, Tensor):
                    self.refs.append(weakref.ref(t))
        return out


class _Watch:
    """Hooks on the audit's model, optimizer and scheduler: what happened, in order."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any) -> None:
        self.params = list(model.parameters())
        self.window = -1
        self.microbatches: Sequence[Mapping[str, Tensor]] = []
        self.events: list[tuple[int, str, int]] = []  # (window, kind, index)
        self.forwards: list[_Forward] = []
        self.steps: list[_Step] = []
        self.created: list[_Created] = []
        model.register_forward_pre_hook(self._pre_forward, with_kwargs=True)
        model.register_forward_hook(self._post_forward)
        optimizer.register_step_pre_hook(self._pre_step)
        for owner in (model, optimizer):
            owner.zero_grad = self._counting(owner.zero_grad, "zero_grad")  # type: ignore[method-assign]
        scheduler.step = self._counting(scheduler.step, "scheduler")

    @property
    def mode(self) -> _Created:
        return self.created[-1]

    def begin(self, index: int, window: Sequence[Mapping[str, Tensor]]) -> _Created:
        self.window, self.microbatches = index, window
        self.created.append(_Created())
        return self.mode

    def _event(self, kind: str, index: int = -1) -> None:
        self.events.append((self.window, kind, index))

    def _counting(self, fn: Callable[..., Any], kind: str) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            self._event(kind)
            return fn(*args, **kwargs)

        return counted

    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        match = None
        self.mode.paused = True
        try:
            for i, mb in enumerate(self.microbatches):
                ref = mb["input_ids"]
                if isinstance(ids, Tensor) and ids.shape == ref.shape and torch.equal(ids.cpu(), ref):
                    match = i
                    break
            theta = _flat(self.params)
        finally:
            self.mode.paused = False
        self.forwards.append(_Forward(self.window, match, theta))
        self._event("forward", len(self.forwards) - 1)

    def _post_forward(self, module: nn.Module, args: tuple, output: Any) -> None:
        logits = getattr(output, "logits", None)
        index = len(self.forwards) - 1
        if isinstance(logits, Tensor) and logits.requires_grad:

            def backward_seen(grad: Tensor) -> None:
                if not self.forwards[index].backward:
                    self.forwards[index].backward = True
                    self._event("backward", index)

            logits.register_hook(backward_seen)

    def _pre_step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        self.mode.paused = True
        try:
            self.steps.append(_Step(self.window, _flat(self.params), _flat_grad(self.params)))
        finally:
            self.mode.paused = False
        self._event("step", len(self.steps) - 1)


@dataclass
class WindowAudit:
    """What the audit measured on one window of the controlled set.

    ``weights[i]``: how much of microbatch ``i``'s correct contribution (its loss sum over
    the window's targets) reached this window's updates, summed over its optimizer steps
    (1.0 each for a correct loop; ``None`` when no step could be analysed).
    ``update_error``: ``|sum of step gradients - reference gradient| / |reference|``.
    ``carried``: the largest share of a previous window's gradient found in this one.
    """

    index: int
    microbatches: int
    targets: int
    forwards: int
    backward_passes: int
    optimizer_steps: int
    scheduler_steps: int
    zero_grad_calls: int
    weights: list[float] | None
    update_error: float | None
    carried: float
    residual: float
    cleared_gradients: int
    kept_tensors: int


@dataclass
class AuditReport:
    """The verdict of :func:`audit`.

    ``mistakes``: names from :data:`MISTAKES`, in that order; ``evidence[name]``: what was
    measured for it. ``other``: findings outside that vocabulary (gradients carried over
    from an earlier window, a scheduler that never advances, an update nothing explains).
    ``ok`` is True when both are empty. ``str(report)`` gives, per mistake, the evidence,
    the symptom a user would see in a real run, and the fix.
    """

    mistakes: list[str]
    evidence: dict[str, str]
    other: list[str]
    windows: list[WindowAudit]

    @property
    def ok(self) -> bool:
        return not self.mistakes and not self.other

    def __str__(self) -> str:
        n_mb = sum(w.microbatches for w in self.windows)
        head = f"{len(self.windows)} windows, {n_mb} microbatches of a controlled set"
        if self.ok:
            worst = max((w.update_error or 0.0) for w in self.windows)
            error = "below 1e-12" if worst < 1e-12 else f"{worst:.1e}"  # float64 rounding only
            return (
                f"audit: ok ({head}). Every update matches the reference (largest relative "
                f"error {error}); one optimizer.step and one scheduler.step per window; no "
                "tensor outlived its window."
            )
        count = len(self.mistakes)
        lines = [f"audit: {count} mistake{'s' if count != 1 else ''} found ({head})"]
        for name in self.mistakes:
            symptom, fix = ADVICE[name]
            lines += [
                f"- {name}",
                f"    evidence: {self.evidence[name]}",
                f"    symptom:  {symptom}",
                f"    fix:      {fix}",
            ]
        for note in self.other:
            lines.append(f"- also: {note}")
        return "\n".join(lines)


def _check_loop(fn: object) -> None:
    if not callable(fn):
        raise TypeError(
            f"audit needs your window function, train_one_window(model, optimizer, scheduler, "
            f"window), got a {type(fn).__name__}"
        )
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # a callable whose signature Python cannot read: let the call decide
    try:
        signature.bind(None, None, None, None)
    except TypeError:
        raise TypeError(
            f"train_one_window must accept four arguments (model, optimizer, scheduler, "
            f"window); {getattr(fn, '__name__', fn)!r} has the signature {signature}"
        ) from None


def _contribution(
    reference: nn.Module, theta: Tensor, microbatch: Mapping[str, Tensor], total: int
) -> Tensor:
    """The correct contribution of one microbatch at weights ``theta``: the gradient of
    its loss sum divided by the window's target count ``total``."""
    torch.nn.utils.vector_to_parameters(theta, reference.parameters())
    reference.zero_grad(set_to_none=True)
    part = NextTokenLoss().loss_sum(reference(microbatch["input_ids"]), microbatch)
    (part / total).backward()
    return _flat_grad(list(reference.parameters()))


def _fraction(x: float) -> str:
    """``0.25`` as ``1/4``, ``2.0`` as ``2``: the ratios the report quotes."""
    if x > 0 and abs(1 / x - round(1 / x)) < 1e-6 and round(1 / x) > 1:
        return f"1/{round(1 / x)}"
    return f"{x:.3g}"


def _windows_text(indices: Sequence[int]) -> str:
    return "window " + str(indices[0]) if len(indices) == 1 else "windows " + ", ".join(
        str(i) for i in indices
    )


def audit(train_one_window: Callable[..., Any], *, seed: int = 0) -> AuditReport:
    """Check a training loop's window on a controlled set whose correct updates are known.

    ``train_one_window(model, optimizer, scheduler, window)`` is your code for one window:
    ``window`` is a list of microbatch dicts (``input_ids``, ``attention_mask``, ``labels``,
    right-padded, prompt and padding labels -100, labels not shifted) and ``model`` is
    called like a Hugging Face causal LM (it returns an object with ``.logits``; with
    ``labels=`` it also gives ``.loss``). The audit calls it on four windows (4, 4, 4 and 2
    microbatches, unequal target counts) with a tiny float64 model, ``SGD`` without
    momentum (so an update is ``-lr × the gradient found by optimizer.step()``) and a
    ``LambdaLR`` scheduler with a constant factor, and measures:

    - the gradient each ``optimizer.step()`` finds, written as a combination of the
      correct per-microbatch contributions (each taken at the weights its forward pass
      ran at): the weight of each microbatch names double division (all ``1/A``), average
      of averages (weights proportional to ``1/targets`` of the microbatch), ignored tokens
      (a denominator of positions or mask tokens instead of targets), lost microbatches
      (zero_grad inside the window);
    - ``optimizer.step`` and ``scheduler.step`` calls per window (no update, step or
      scheduler per microbatch) and ``zero_grad`` calls between a backward pass and the
      step that should use it;
    - tensors created during a window that are still alive (after ``gc.collect()``) once
      the last window is done (kept references).

    The comparison is exact up to float64 rounding, so run the loop in full precision (no
    autocast) and without clipping below the gradient norm: either shows up in
    ``report.other`` as an update the microbatch gradients do not explain.

    Returns an :class:`AuditReport`; ``report.ok`` is True for a correct loop. The global
    random state is left as it was. Exceptions from ``train_one_window`` propagate.
    """
    _check_loop(train_one_window)
    windows = audit_windows(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AuditLM().double()
        reference = copy.deepcopy(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=AUDIT_LR, momentum=0.0)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda update: 1.0)
        watch = _Watch(model, optimizer, scheduler)
        starts = []
        for k, window in enumerate(windows):
            starts.append(_flat(watch.params))
            given = [{key: v.clone() for key, v in mb.items()} for mb in window]
            with watch.begin(k, window), warnings.catch_warnings():
                # The report says more about a misplaced scheduler.step() than this warning.
                warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step")
                try:
                    train_one_window(model, optimizer, scheduler, given)
                except Exception as exc:
                    if hasattr(exc, "add_note"):  # Python 3.11+
                        exc.add_note(f"(raised by train_one_window on audit window {k})")
                    raise
            del given
        final = _flat(watch.params)
        gc.collect()
        return _verdict(watch, windows, starts, final, reference, optimizer)


def _cleared_before_step(kinds: Sequence[str]) -> int:
    """How often ``zero_grad`` cleared a backward pass's gradient before any step used it
    (only counted when a later step of the window then ran on what was left)."""
    pending, cleared, lost = False, 0, 0
    for kind in kinds:
        if kind == "backward":
            pending = True
        elif kind == "zero_grad":
            cleared, pending = cleared + pending, False
        elif kind == "step":
            lost, cleared, pending = lost + cleared, 0, False
    return lost


def _fit(grad: Tensor, basis: Sequence[Tensor]) -> tuple[list[float], float]:
    """Least-squares ``grad ≈ Σ shares[j] × basis[j]``: the shares and the relative residual
    (0 for a zero gradient, 1 when there is nothing to explain it with)."""
    if float(grad.norm()) == 0.0:
        return [0.0] * len(basis), 0.0
    if not basis:
        return [], 1.0
    matrix = torch.stack(list(basis), dim=1)
    shares = torch.linalg.lstsq(matrix, grad[:, None]).solution[:, 0]
    return shares.tolist(), float((matrix @ shares - grad).norm() / grad.norm())


def _near(x: float, y: float) -> bool:
    return abs(x - y) <= _TOL * max(abs(x), abs(y), 1e-12)


def _verdict(
    watch: _Watch,
    windows: list[list[dict[str, Tensor]]],
    starts: list[Tensor],
    final: Tensor,
    reference: nn.Module,
    optimizer: torch.optim.Optimizer,
) -> AuditReport:
    objective = NextTokenLoss()
    totals = [sum(objective.count(mb) for mb in w) for w in windows]
    contributions: dict[int, Tensor] = {}

    def contribution(f: int) -> Tensor:
        if f not in contributions:
            fwd = watch.forwards[f]
            mb = windows[fwd.window][fwd.microbatch]  # type: ignore[index]
            contributions[f] = _contribution(reference, fwd.theta, mb, totals[fwd.window])
        return contributions[f]

    found: dict[str, list[int]] = {name: [] for name in MISTAKES}  # windows showing each
    other: list[str] = []
    audits: list[WindowAudit] = []
    matches: list[set[str] | None] = []
    notes: dict[str, list[int]] = {"carried": [], "unexplained": [], "unmatched": []}
    weightings = [dict((w.key, (w, d)) for w, d in _weightings(window)) for window in windows]
    ends = [*starts[1:], final]
    for k, window in enumerate(windows):
        a = len(window)
        events = [(kind, i) for (w, kind, i) in watch.events if w == k]
        kinds = [kind for kind, _ in events]
        forwards = [i for kind, i in events if kind == "forward"]
        steps = [i for kind, i in events if kind == "step"]

        lost_clears = _cleared_before_step(kinds)
        # The gradient each step found, as a combination of correct contributions: of this
        # window's forward passes, and of earlier windows' (gradients never cleared).
        previous = [i for (w, kind, i) in watch.events if w < k and kind == "forward"]
        candidates = [f for f in forwards + previous if watch.forwards[f].microbatch is not None]
        weights = [0.0] * a
        carried, residual = 0.0, 0.0
        for s in steps:
            shares, r = _fit(watch.steps[s].grad, [contribution(f) for f in candidates])
            residual = max(residual, r)
            for f, x in zip(candidates, shares, strict=True):
                if watch.forwards[f].window == k:
                    weights[watch.forwards[f].microbatch] += x  # type: ignore[index]
                else:
                    carried = max(carried, abs(x))
        at_start = {  # forwards that ran at the window's starting weights, by microbatch
            watch.forwards[f].microbatch: f
            for f in reversed(forwards)
            if watch.forwards[f].microbatch is not None
            and torch.equal(watch.forwards[f].theta, starts[k])
        }
        reference_grad = sum(
            (
                contribution(at_start[i])
                if i in at_start
                else _contribution(reference, starts[k], mb, totals[k])
                for i, mb in enumerate(window)
            ),
            torch.zeros_like(starts[k]),
        )
        stepped = sum((watch.steps[s].grad for s in steps), torch.zeros_like(starts[k]))
        error = float((stepped - reference_grad).norm() / reference_grad.norm())

        if not steps:
            found["no_update"].append(k)
        if len(steps) > 1:
            found["step_per_microbatch"].append(k)
        schedules = kinds.count("scheduler")
        if schedules > 1:
            found["scheduler_per_microbatch"].append(k)
        # microbatches whose backward ran before the window's last step but did not reach it
        last_step = max((p for p, kind in enumerate(kinds) if kind == "step"), default=-1)
        backed = {
            watch.forwards[i].microbatch
            for p, (kind, i) in enumerate(events)
            if kind == "backward" and p < last_step
        }
        lost = [i for i in range(a) if i in backed and abs(weights[i]) <= _TOL]
        if lost_clears or (lost and residual <= _TOL):
            found["zero_grad_in_window"].append(k)
        if carried > _TOL:
            notes["carried"].append(k)
        if residual > _TOL:
            notes["unexplained"].append(k)
        if any(watch.forwards[i].microbatch is None for i in forwards):
            notes["unmatched"].append(k)
        used = [i for i in range(a) if abs(weights[i]) > _TOL]
        if steps and used and residual <= _TOL:
            matches.append(
                {
                    key
                    for key, (_, d) in weightings[k].items()
                    if all(_near(weights[i], totals[k] / d[i]) for i in used)
                }
            )
        else:
            matches.append(None)
        audits.append(
            WindowAudit(
                index=k,
                microbatches=a,
                targets=totals[k],
                forwards=len(forwards),
                backward_passes=kinds.count("backward"),
                optimizer_steps=len(steps),
                scheduler_steps=schedules,
                zero_grad_calls=kinds.count("zero_grad"),
                weights=[round(x, 12) for x in weights] if steps else None,
                update_error=error if steps else None,
                carried=carried,
                residual=residual,
                cleared_gradients=lost_clears,
                kept_tensors=0,
            )
        )

    if notes["carried"]:
        other.append(
            f"{_windows_text(notes['carried'])}: gradients of earlier windows were still in "
            ".grad at optimizer.step() (largest share "
            f"{max(audits[k].carried for k in notes['carried']):.3g}); clear the gradients "
            "once per window with optimizer.zero_grad()"
        )
    if notes["unexplained"]:
        other.append(
            f"{_windows_text(notes['unexplained'])}: the gradient at optimizer.step() is not a "
            "combination of the microbatch gradients (largest relative residual "
            f"{max(audits[k].residual for k in notes['unexplained']):.2g}): something else "
            "changed it (clipping below the gradient norm, another loss, other inputs)"
        )
    if notes["unmatched"]:
        other.append(
            f"{_windows_text(notes['unmatched'])}: forward passes on inputs that are not one of "
            "the window's microbatches; the audit cannot attribute them"
        )
    if not any(w.scheduler_steps for w in audits):
        other.append(
            "scheduler.step() was never called: a schedule defined in updates needs one call "
            "per update, after optimizer.step()"
        )
    moved = [k for k in found["no_update"] if float((ends[k] - starts[k]).abs().max()) > 0]
    if moved:
        other.append(
            f"{_windows_text(moved)}: the weights changed without optimizer.step(); the audit "
            "can only check updates made by the optimizer"
        )

    weighting = _choose_weighting(matches, weightings)
    evidence: dict[str, str] = {}
    constrained = [k for k, m in enumerate(matches) if m is not None]
    if constrained and weighting is None:
        shown = ", ".join(
            f"window {k}: " + ", ".join(f"{x:.3g}" for x in audits[k].weights or [])
            for k in constrained[:2]
        )
        other.append(
            "the updates weight the microbatches in a way no known mistake explains "
            f"(share of each microbatch's correct contribution, {shown})"
        )
    elif weighting is not None:
        for name in weighting.mistakes:
            found[name].extend(constrained)
            evidence[name] = _weighting_evidence(name, weighting, audits, weightings, constrained)
        if weighting.note:
            other.append(weighting.note)

    _kept_evidence(watch, optimizer, audits, found, evidence)
    _count_evidence(audits, found, evidence)
    mistakes = [name for name in MISTAKES if found[name]]
    return AuditReport(mistakes, {n: evidence[n] for n in mistakes}, other, audits)


def _choose_weighting(
    matches: list[set[str] | None],
    weightings: list[dict[str, tuple[_Weighting, list[float]]]],
) -> _Weighting | None:
    """The weighting every analysed window agrees with (the simplest if several do)."""
    sets = [(k, m) for k, m in enumerate(matches) if m is not None]
    if not sets:
        return None
    common = set.intersection(*(m for _, m in sets))
    if not common:
        return None
    options = [weightings[sets[0][0]][key][0] for key in common]
    return min(options, key=lambda w: (len(w.mistakes), w.note is not None, w.key))


def _numbers(values: Sequence[float], digits: int = 3) -> str:
    return ", ".join(f"{v + 0.0:.{digits}g}" for v in values)  # + 0.0: no "-0"


def _weighting_evidence(
    name: str,
    weighting: _Weighting,
    audits: list[WindowAudit],
    weightings: list[dict[str, tuple[_Weighting, list[float]]]],
    constrained: list[int],
) -> str:
    k = constrained[0]
    first = audits[k]
    weights = first.weights or []
    used = [i for i, w in enumerate(weights) if abs(w) > _TOL]
    if name == "double_division":
        ratios = []
        for j in constrained:
            d = weightings[j][weighting.key][1]
            a = audits[j].microbatches
            w = audits[j].weights or []
            ratios.append((a, sum(w[i] * d[i] / (audits[j].targets * a) for i in used if i < a)
                           / max(1, len([i for i in used if i < a]))))
        sizes = sorted({a for a, _ in ratios}, reverse=True)
        base = (
            "the reference update"
            if weighting.key == "A × targets in the window"
            else "what the rest of the loop's weighting gives"
        )
        parts = []
        for j, a in enumerate(sizes):
            plural = "s" if sum(size == a for size, _ in ratios) > 1 else ""
            of = f" of {base}" if j == 0 else ""
            parts.append(f"{_fraction(1 / a)}{of} in the window{plural} of {a} microbatches")
        return (
            "each contribution is divided by A once more than the loss needs: the update is "
            f"{', '.join(parts)} (measured ratios {_numbers([r for _, r in ratios], 4)})"
        )
    if name == "average_of_averages":
        per_mb = _microbatch_counts(weightings[k], "targets")
        text = (
            f"in window {k} the microbatches hold {_numbers(per_mb)} targets and reached the "
            f"update with weights {_numbers(weights)} (1 = correct), equal to {first.targets} / "
            f"({weighting.key}): each microbatch's mean counts the same whatever its size"
        )
        w = [weights[i] for i in used]
        if len(w) > 1 and min(w) > 0:
            text += (
                f"; a target in the smallest microbatch weighs {max(w) / min(w):.3g} × one in "
                "the largest, and another split of the same examples gives another update"
            )
        return text
    if name == "ignored_tokens_counted":
        unit = "label positions" if "label positions" in weighting.key else "attention-mask tokens"
        described = (
            "label positions after the shift, -100 included"
            if unit == "label positions"
            else "attention-mask tokens (prompt included, no shift)"
        )
        return (
            f"the denominator counts {described}, not supervised targets: in window {k} the "
            f"microbatches hold {_numbers(_microbatch_counts(weightings[k], 'targets'))} targets "
            f"but {_numbers(_microbatch_counts(weightings[k], unit))} {unit}, and the measured "
            f"weights {_numbers(weights)} (1 = correct) equal {first.targets} / "
            f"({weighting.key})"
        )
    raise AssertionError(name)


def _microbatch_counts(weighting: dict[str, tuple[_Weighting, list[float]]], unit: str) -> list[int]:
    return [int(x) for x in weighting[f"{unit} in the microbatch"][1]]


def _count_evidence(
    audits: list[WindowAudit], found: dict[str, list[int]], evidence: dict[str, str]
) -> None:
    sizes = ", ".join(str(w.microbatches) for w in audits)
    if found["no_update"]:
        idle = found["no_update"]
        evidence["no_update"] = (
            f"optimizer.step() was not called in {_windows_text(idle)} (of {len(audits)}), "
            f"after {sum(audits[k].backward_passes for k in idle)} backward passes"
        )
    if found["step_per_microbatch"]:
        steps = ", ".join(str(w.optimizer_steps) for w in audits)
        evidence["step_per_microbatch"] = (
            f"optimizer.step() ran {steps} times in windows of {sizes} microbatches (expected "
            f"once each): {sum(w.optimizer_steps for w in audits)} updates instead of "
            f"{len(audits)}"
        )
    if found["scheduler_per_microbatch"]:
        calls = [w.scheduler_steps for w in audits]
        evidence["scheduler_per_microbatch"] = (
            f"scheduler.step() ran {', '.join(map(str, calls))} times in windows of {sizes} "
            f"microbatches: {sum(calls)} schedule steps for {len(audits)} windows, so a "
            f"schedule counted in updates runs {sum(calls) / len(audits):.3g} × too fast"
        )
    if found["zero_grad_in_window"]:
        bad = sorted(set(found["zero_grad_in_window"]))
        w = audits[bad[0]]
        cleared = sum(audits[k].cleared_gradients for k in bad)
        how = (
            f"zero_grad ran {cleared} times between a backward pass and the optimizer.step() "
            "that should use it; "
            if cleared
            else ""
        )
        shares = f"weights {_numbers(w.weights)}" if w.weights else "no gradient at all"
        evidence["zero_grad_in_window"] = (
            f"{how}in window {w.index} the update received {shares} of the "
            f"{w.microbatches} microbatches' contributions (1 = correct): the earlier "
            "microbatches' gradients were cleared before the step"
        )


def _kept_evidence(
    watch: _Watch,
    optimizer: torch.optim.Optimizer,
    audits: list[WindowAudit],
    found: dict[str, list[int]],
    evidence: dict[str, str],
) -> None:
    """Tensors created during a window and alive after the last one (after gc.collect())."""
    owned = {id(p) for p in watch.params} | {id(p.grad) for p in watch.params if p.grad is not None}
    owned |= {id(t) for t in tree_leaves(list(optimizer.state.values())) if isinstance(t, Tensor)}
    graph, nbytes, storages = 0, 0, set()
    for k, mode in enumerate(watch.created):
        alive = {}
        for ref in mode.refs:
            t = ref()
            if t is None or id(t) in owned or (t.dim() == 0 and t.grad_fn is None):
                continue  # a detached scalar (a logged loss value) holds no activations
            alive[id(t)] = t
        audits[k].kept_tensors = len(alive)
        if k < len(watch.created) - 1 and alive:
            found["kept_references"].append(k)
            for t in alive.values():
                graph += t.grad_fn is not None
                key = t.untyped_storage().data_ptr()
                if key not in storages:
                    storages.add(key)
                    nbytes += t.untyped_storage().nbytes()
    if found["kept_references"]:
        left = ", ".join(str(w.kept_tensors) for w in audits)
        total = sum(audits[k].kept_tensors for k in found["kept_references"])
        evidence["kept_references"] = (
            f"{total} tensors created in earlier windows were still alive after the last "
            f"window and gc.collect() ({graph} attached to an autograd graph, {nbytes} bytes "
            f"of storage); tensors left alive per window: {left}"
        )
