"""The audit of a user's window loop: run it on a controlled set whose correct updates are
known, and name what differs.

``audit(train_one_window)`` gives the loop a tiny float64 causal language model, an SGD
optimizer, a constant scheduler and four windows of microbatches, watches every forward
pass, backward pass, ``zero_grad``, ``optimizer.step`` and ``scheduler.step``, and writes
the gradient each ``optimizer.step`` found as a combination of the correct per-example
contributions (each example's summed next-token loss over its window's target count, at
the weights its forward pass ran at). The shares of that combination name the mistake:
all ``1/A`` is a double division, ``1/targets of the microbatch`` an average of
averages, 0 for an example never trained a lost microbatch, 2 for one trained twice a
duplicated microbatch, and so on. Everything is float64, so a correct loop matches to
about 1e-12 and the verdict's tolerance, :data:`AUDIT_TOLERANCE`, is 1e-6 relative.
"""

from __future__ import annotations

import copy
import gc
import inspect
import warnings
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from .objectives import NextTokenLoss

#: Every name ``AuditReport.mistakes`` can hold, in the order they are reported.
MISTAKES: tuple[str, ...] = (
    "double_division",
    "average_of_averages",
    "ignored_tokens_counted",
    "labels_not_shifted",
    "labels_shifted_twice",
    "lost_microbatches",
    "duplicated_microbatch",
    "zero_grad_in_window",
    "no_update",
    "step_per_microbatch",
    "scheduler_per_microbatch",
    "kept_references",
    "window_modified_in_place",
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
    "labels_not_shifted": (
        "a training loss that drops fast towards zero while the model learns nothing useful: "
        "each position is trained to repeat the token it already sees",
        "predict the next token: compare logits[:, :-1] with labels[:, 1:] (a Hugging Face "
        "model given labels= shifts them itself)",
    ),
    "labels_shifted_twice": (
        "a loss that stays high: each position is trained to predict the token two places "
        "ahead, because the labels were shifted before a model that shifts them again",
        "shift once: either compare logits[:, :-1] with labels[:, 1:] yourself, or pass the "
        "unshifted labels= to a model that shifts them; never both",
    ),
    "lost_microbatches": (
        "fewer examples reach the gradient than the loader delivers: the skipped microbatches "
        "(or rows) never train, and every update is taken from part of its window",
        "train on every microbatch of the window, every row of it, once: iterate over the "
        "whole list (no slice such as window[1:] or window[:-1], no pop while iterating, no "
        "loss outside the loop body)",
    ),
    "duplicated_microbatch": (
        "some examples weigh two (or more) times as much as the others in the update, and "
        "the result depends on which ones were repeated",
        "run each microbatch through forward and backward exactly once per window",
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
    "window_modified_in_place": (
        "data that changes each time it is read: the next epoch, a retried window or a "
        "resumed run trains on labels (or inputs) the loop already edited, e.g. shifted again",
        "never write into the window's tensors: shift or edit a copy (labels[:, 1:] is a "
        "view of the same memory; .clone() before editing)",
    ),
}

#: What the audit does not check, said in every report.
NOT_CHECKED = (
    "Not checked by the audit: non-finite gradients and loss scaling, mixed precision, "
    "clipping, data-parallel averaging and no_sync, and your own model, data and optimizer "
    "(it runs the loop on its float64 model, SGD and controlled set)."
)

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
#: Relative tolerance of every comparison the audit makes (float64 measurements agree to
#: about 1e-12; a real mistake differs by far more than this).
AUDIT_TOLERANCE = 1e-6
_TOL = AUDIT_TOLERANCE


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
                loss = F.cross_entropy(flat, targets, ignore_index=-100)
            else:
                loss = (
                    F.cross_entropy(flat, targets, ignore_index=-100, reduction="sum")
                    / num_items_in_batch
                )
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


# -- the examples of the controlled set and the weightings a loop can give them ----------

RowKey = tuple[int, int, int]  # (window, microbatch, row)


@dataclass(frozen=True)
class _Row:
    """One example of the controlled set and its counts."""

    key: RowKey
    tokens: Tensor  # its real tokens (attention mask 1), 1-D
    targets: int  # supervised targets after the shift
    positions: int  # label positions after the shift in its padded microbatch
    mask: int  # attention-mask tokens

    @property
    def microbatch(self) -> int:
        return self.key[1]


def _rows(windows: Sequence[Sequence[Mapping[str, Tensor]]]) -> list[list[_Row]]:
    """Every example of every window, in order (microbatch by microbatch, row by row)."""
    out = []
    for k, window in enumerate(windows):
        rows = []
        for i, mb in enumerate(window):
            width = int(mb["input_ids"].shape[1])
            for r in range(int(mb["input_ids"].shape[0])):
                n = int(mb["attention_mask"][r].sum())
                rows.append(
                    _Row(
                        key=(k, i, r),
                        tokens=mb["input_ids"][r, :n].clone(),
                        targets=int((mb["labels"][r, 1:] != -100).sum()),
                        positions=width - 1,
                        mask=n,
                    )
                )
        out.append(rows)
    return out


@dataclass(frozen=True)
class _Weighting:
    """A way to weight a window's examples: what each loss sum is divided by."""

    key: str
    mistakes: tuple[str, ...]
    note: str | None = None


_UNITS = {"targets": "targets", "label positions": "positions", "attention-mask tokens": "mask"}


def _weightings(
    rows: Sequence[_Row], keep: Sequence[bool] | None = None
) -> list[tuple[_Weighting, list[float]]]:
    """Each candidate weighting with the divisor it gives every example (row) of a window.

    The right one divides every loss sum by the window's targets. The others are the
    mistakes: an extra ``/ A`` (double division), per-microbatch or per-example means
    averaged (average of averages), counts that include ignored positions, and
    combinations. With ``keep``, the window is the kept rows only (a loop that lost some
    and normalizes over what it trained); the other rows get an infinite divisor.
    """
    keep = [True] * len(rows) if keep is None else list(keep)
    kept = [row for row, k in zip(rows, keep, strict=True) if k]
    microbatches = sorted({row.microbatch for row in kept})
    a, n_examples = len(microbatches), len(kept)

    def per_row(values: Callable[[_Row], float]) -> list[float]:
        return [
            float(values(row)) if k else float("inf") for row, k in zip(rows, keep, strict=True)
        ]

    out: list[tuple[_Weighting, list[float]]] = [
        (
            _Weighting(
                "nothing",
                (),
                "the loss sums are not divided at all: every update is "
                "as many times too large as the window has targets",
            ),
            per_row(lambda row: 1.0),
        )
    ]
    for unit, attr in _UNITS.items():
        ignored = () if unit == "targets" else ("ignored_tokens_counted",)
        total = sum(getattr(row, attr) for row in kept)
        in_mb = {
            i: sum(getattr(row, attr) for row in kept if row.microbatch == i) for i in microbatches
        }
        out.append(
            (_Weighting(f"{unit} in the window", ignored), per_row(lambda row, total=total: total))
        )
        out.append(
            (
                _Weighting(f"A × {unit} in the window", (*ignored, "double_division")),
                per_row(lambda row, total=total: a * total),
            )
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
                per_row(lambda row, in_mb=in_mb: in_mb[row.microbatch]),
            )
        )
        out.append(
            (
                _Weighting(f"A × {unit} in the microbatch", aoa),
                per_row(lambda row, in_mb=in_mb: a * in_mb[row.microbatch]),
            )
        )
        out.append(
            (
                _Weighting(f"A² × {unit} in the microbatch", (*aoa, "double_division")),
                per_row(lambda row, in_mb=in_mb: a * a * in_mb[row.microbatch]),
            )
        )
    if n_examples > a:  # else per-example means are the per-microbatch ones
        out.append(
            (
                _Weighting(
                    "targets in the example × examples in the window", ("average_of_averages",)
                ),
                per_row(lambda row: row.targets * n_examples),
            )
        )
    return out


# -- watching the loop -------------------------------------------------------------------


def _flat(tensors: Sequence[Tensor]) -> Tensor:
    return torch.cat([t.detach().reshape(-1).to(torch.float64) for t in tensors])


def _flat_grad(params: Sequence[nn.Parameter]) -> Tensor:
    return _flat([p.grad if p.grad is not None else torch.zeros_like(p) for p in params])


@dataclass
class _Forward:
    window: int
    rows: tuple[RowKey | None, ...]  # per input row: the example it is, None when none
    theta: int  # index in _Watch.thetas of the weights the forward pass ran at
    backward: int = 0  # backward passes that went through its output


@dataclass
class _Step:
    window: int
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

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        rows: list[list[_Row]],
    ) -> None:
        self.params = list(model.parameters())
        self.rows = rows
        self.window = -1
        self.events: list[tuple[int, str, int]] = []  # (window, kind, index)
        self.forwards: list[_Forward] = []
        self.steps: list[_Step] = []
        self.thetas: list[Tensor] = []
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

    def begin(self, index: int) -> _Created:
        self.window = index
        self.created.append(_Created())
        return self.mode

    def theta_index(self, theta: Tensor) -> int:
        """The index of weights ``theta`` in ``thetas`` (appended when new)."""
        for j in range(len(self.thetas) - 1, -1, -1):
            if torch.equal(self.thetas[j], theta):
                return j
        self.thetas.append(theta)
        return len(self.thetas) - 1

    def _event(self, kind: str, index: int = -1) -> None:
        self.events.append((self.window, kind, index))

    def _counting(self, fn: Callable[..., Any], kind: str) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            self._event(kind)
            return fn(*args, **kwargs)

        return counted

    def _match(self, ids: object) -> tuple[RowKey | None, ...]:
        """Which example of the current window each input row is: its real tokens first,
        then anything (padding); the longest such example wins."""
        if not isinstance(ids, Tensor) or ids.dim() != 2:
            return (None,)
        ids = ids.detach().cpu()
        found: list[RowKey | None] = []
        for row in ids:
            best: _Row | None = None
            for example in self.rows[self.window]:
                n = example.tokens.numel()
                if n <= row.numel() and torch.equal(row[:n], example.tokens):
                    if best is None or n > best.tokens.numel():
                        best = example
            found.append(best.key if best is not None else None)
        return tuple(found)

    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self.mode.paused = True
        try:
            rows = self._match(kwargs.get("input_ids", args[0] if args else None))
            theta = self.theta_index(_flat(self.params))
        finally:
            self.mode.paused = False
        self.forwards.append(_Forward(self.window, rows, theta))
        self._event("forward", len(self.forwards) - 1)

    def _post_forward(self, module: nn.Module, args: tuple, output: Any) -> None:
        logits = getattr(output, "logits", output)
        index = len(self.forwards) - 1
        if isinstance(logits, Tensor) and logits.requires_grad:

            def backward_seen(grad: Tensor) -> None:
                self.forwards[index].backward += 1
                self._event("backward", index)

            logits.register_hook(backward_seen)

    def _pre_step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        self.mode.paused = True
        try:
            self.steps.append(_Step(self.window, _flat_grad(self.params)))
        finally:
            self.mode.paused = False
        self._event("step", len(self.steps) - 1)


# -- the report ----------------------------------------------------------------------------


@dataclass
class WindowAudit:
    """What the audit measured on one window of the controlled set.

    ``weights[i]``: how much of microbatch ``i``'s correct contribution (its loss sum over
    the window's targets) reached this window's updates, summed over its optimizer steps
    (1.0 each for a correct loop; 0 for a lost microbatch; ``None`` when no step could be
    analysed); ``example_weights[i][r]`` the same per example (row ``r`` of microbatch
    ``i``), of which ``weights[i]`` is the target-weighted mean.
    ``example_backward_passes[i][r]``: backward passes that went through that example.
    ``update_error``: ``|sum of step gradients - reference gradient| / |reference|``.
    ``carried``: the largest share of a previous window's gradient found in this one.
    ``label_shift``: the shift between positions and targets the updates match (1, the
    next token, is correct; 0 or 2 is a mistake; None when none matches).
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
    example_weights: list[list[float]] | None = None
    example_backward_passes: list[list[int]] = field(default_factory=list)
    label_shift: int | None = 1


@dataclass
class AuditReport:
    """The verdict of :func:`audit`.

    ``mistakes``: names from :data:`MISTAKES`, in that order; ``evidence[name]``: what was
    measured for it. ``other``: findings outside that vocabulary (gradients carried over
    from an earlier window, a scheduler that never advances, an update nothing explains).
    ``ok`` is True when both are empty and every window's update matches the correct one
    within :data:`AUDIT_TOLERANCE`. ``str(report)`` gives, per mistake, the evidence, the
    symptom a user would see in a real run, and the fix, then what the audit does not check.
    """

    mistakes: list[str]
    evidence: dict[str, str]
    other: list[str]
    windows: list[WindowAudit]

    @property
    def ok(self) -> bool:
        return (
            not self.mistakes
            and not self.other
            and all(
                w.update_error is not None and w.update_error <= AUDIT_TOLERANCE
                for w in self.windows
            )
        )

    def __str__(self) -> str:
        n_mb = sum(w.microbatches for w in self.windows)
        head = f"{len(self.windows)} windows, {n_mb} microbatches of a controlled set"
        if self.ok:
            worst = max((w.update_error or 0.0) for w in self.windows)
            error = "below 1e-12" if worst < 1e-12 else f"{worst:.1e}"  # float64 rounding only
            once = self.windows[0].kept_tensors if len(self.windows) > 1 else 0
            kept = f" but {once} made once in the first window" if once else ""
            return (
                f"audit: ok ({head}). Every update matches the reference (largest relative "
                f"error {error}); one optimizer.step and one scheduler.step per window; no "
                f"tensor outlived its window{kept}.\n{NOT_CHECKED}"
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
        lines.append(NOT_CHECKED)
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


def _changes(
    k: int, window: Sequence[Mapping[str, Tensor]], held: Sequence[Mapping[str, Any]]
) -> list[str]:
    """What the loop changed in the window it was given (tensors edited in place or
    entries replaced), one phrase each."""
    out = []
    for i, (original, given) in enumerate(zip(window, held, strict=True)):
        for key, before in original.items():
            after = given.get(key)
            if (
                isinstance(after, Tensor)
                and after.shape == before.shape
                and torch.equal(after, before)
            ):
                continue
            how = "replaced or removed"
            if isinstance(after, Tensor) and after.shape == before.shape:
                how = "edited in place"
                if before.dim() == 2 and torch.equal(after[:, :-1], before[:, 1:]):
                    how = "shifted one position left in place"
            out.append(f"{key} of microbatch {i} of window {k} ({how})")
    return out


def audit(train_one_window: Callable[..., Any], *, seed: int = 0) -> AuditReport:
    """Check a training loop's window on a controlled set whose correct updates are known.

    ``train_one_window(model, optimizer, scheduler, window)`` is your code for one window:
    ``window`` is a list of microbatch dicts (``input_ids``, ``attention_mask``, ``labels``,
    right-padded, prompt and padding labels -100, labels not shifted) and ``model`` is
    called like a Hugging Face causal LM (it returns an object with ``.logits``; with
    ``labels=`` it also gives ``.loss``, a mean, or a sum over ``num_items_in_batch``).
    The audit calls it on four windows (4, 4, 4 and 2 microbatches, 28 examples, unequal
    target counts) with a tiny float64 model, ``SGD`` without momentum (so an update is
    ``-lr × the gradient found by optimizer.step()``) and a ``LambdaLR`` scheduler with a
    constant factor. The loop may run the microbatches whole, row by row (padding kept or
    trimmed) or all in one forward pass, and may run extra forward passes without a
    backward pass (no-grad logging, an eval-mode pass). What it checks:

    - the gradient each ``optimizer.step()`` finds, written as a combination of the
      correct per-example contributions (each taken at the weights its forward pass ran
      at); the weight of each example names double division (all ``1/A``), average of
      averages (``1/targets`` of the microbatch or of the example), ignored tokens (a
      denominator of positions or mask tokens instead of targets), lost microbatches (an
      example never trained), duplicated microbatches (trained twice), zero_grad inside
      the window (trained, then cleared), gradients carried over from earlier windows;
      when it is no combination of them, the same with targets not shifted or shifted
      twice names those;
    - ``optimizer.step`` and ``scheduler.step`` calls per window (no update, step or
      scheduler per microbatch) and ``zero_grad`` calls between a backward pass and the
      step that should use it;
    - tensors created during a window that are still alive (after ``gc.collect()``) once
      the last window is done (kept references: from a window after the first, since the
      first may create what is made once, such as a cache), and tensors of the window the
      loop changed (labels shifted in place).

    ``report.ok`` is True only when nothing was found *and* every window's applied
    gradient matches the correct one within :data:`AUDIT_TOLERANCE` (1e-6 relative).

    What it does not check: non-finite gradients, loss scaling and skipped updates
    (GradScaler), mixed precision, clipping, data-parallel averaging (``× D``) and
    ``no_sync``, dropout or BatchNorm, and your own model, data loader, optimizer and
    learning rate: the loop runs on the audit's model, optimizer and data. Autocast leaves
    the float64 model alone, so a loop's mixed precision is not even exercised; clipping
    below the gradient norm shows up in ``report.other`` as updates scaled by a factor.

    Returns an :class:`AuditReport`. The global random state is left as it was.
    Exceptions from ``train_one_window`` propagate, with a note naming the window.
    """
    _check_loop(train_one_window)
    # Only objects created from here on are scanned by the gc.collect() below (a full
    # collection of a process that imported torch costs about 0.1 s); a caller's own
    # frozen objects are left alone.
    freeze = gc.get_freeze_count() == 0
    if freeze:
        gc.freeze()
    try:
        return _audit(train_one_window, seed)
    finally:
        if freeze:
            gc.unfreeze()


def _audit(train_one_window: Callable[..., Any], seed: int) -> AuditReport:
    windows = audit_windows(seed)
    rows = _rows(windows)
    changed: list[str] = []
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AuditLM().double()
        reference = copy.deepcopy(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=AUDIT_LR, momentum=0.0)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda update: 1.0)
        watch = _Watch(model, optimizer, scheduler, rows)
        starts = []
        for k, window in enumerate(windows):
            starts.append(watch.theta_index(_flat(watch.params)))
            given = [{key: v.clone() for key, v in mb.items()} for mb in window]
            held = list(given)  # the dicts, even if the loop pops them from its list
            with watch.begin(k), warnings.catch_warnings():
                # The report says more about a misplaced scheduler.step() than this warning.
                warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step")
                try:
                    train_one_window(model, optimizer, scheduler, given)
                except Exception as exc:
                    if hasattr(exc, "add_note"):  # Python 3.11+
                        exc.add_note(f"(raised by train_one_window on audit window {k})")
                    raise
            changed += _changes(k, window, held)
            del given, held
        final = _flat(watch.params)
        gc.collect()
        return _Verdict(watch, windows, rows, starts, final, reference).report(optimizer, changed)


# -- the verdict ---------------------------------------------------------------------------


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
    shares = torch.linalg.lstsq(matrix, grad[:, None], driver="gelsd").solution[:, 0]
    return shares.tolist(), float((matrix @ shares - grad).norm() / grad.norm())


def _near(x: float, y: float) -> bool:
    return abs(x - y) <= _TOL * max(abs(x), abs(y), 1e-12)


def _fraction(x: float) -> str:
    """``0.25`` as ``1/4``, ``2.0`` as ``2``: the ratios the report quotes."""
    if x > 0 and abs(1 / x - round(1 / x)) < 1e-6 and round(1 / x) > 1:
        return f"1/{round(1 / x)}"
    return f"{x:.3g}"


def _windows_text(indices: Sequence[int]) -> str:
    return (
        "window " + str(indices[0])
        if len(indices) == 1
        else "windows " + ", ".join(str(i) for i in indices)
    )


def _numbers(values: Sequence[float], digits: int = 3) -> str:
    return ", ".join(f"{v + 0.0:.{digits}g}" for v in values)  # + 0.0: no "-0"


_SHIFTS = {0: "labels_not_shifted", 2: "labels_shifted_twice"}


@dataclass
class _Fit:
    weights: list[float]  # per example of the window
    carried: float
    residual: float


class _Verdict:
    """Everything measured on the watched run, turned into an :class:`AuditReport`."""

    def __init__(
        self,
        watch: _Watch,
        windows: list[list[dict[str, Tensor]]],
        rows: list[list[_Row]],
        starts: list[int],
        final: Tensor,
        reference: nn.Module,
    ) -> None:
        self.watch, self.windows, self.rows, self.starts = watch, windows, rows, starts
        self.final, self.reference = final, reference
        objective = NextTokenLoss()
        self.totals = [sum(objective.count(mb) for mb in w) for w in windows]
        self.by_key = {row.key: row for window in rows for row in window}
        self._cache: dict[tuple[RowKey, int, int], Tensor] = {}
        self.late: set[RowKey] = set()  # examples trained after their window's last step

    def contribution(self, key: RowKey, theta: int, shift: int = 1) -> Tensor:
        """One example's loss sum over its window's targets, differentiated at weights
        ``thetas[theta]``, with position ``t`` predicting ``labels[t + shift]``."""
        if (key, theta, shift) not in self._cache:
            k, i, r = key
            n = self.by_key[key].tokens.numel()
            mb = self.windows[k][i]
            torch.nn.utils.vector_to_parameters(
                self.watch.thetas[theta], self.reference.parameters()
            )
            self.reference.zero_grad(set_to_none=True)
            logits = self.reference(mb["input_ids"][r : r + 1, :n]).logits[0]
            part = F.cross_entropy(
                logits[: n - shift], mb["labels"][r, shift:n], ignore_index=-100, reduction="sum"
            )
            (part / self.totals[k]).backward()
            self._cache[(key, theta, shift)] = _flat_grad(list(self.reference.parameters()))
        return self._cache[(key, theta, shift)]

    def _columns(self, k: int) -> list[tuple[RowKey, int]]:
        """The (example, weights) pairs that can have reached window ``k``'s steps: every
        trained forward pass of this window and the earlier ones, each pair once."""
        seen: dict[tuple[RowKey, int], None] = {}
        for f in self.watch.forwards:
            if f.window <= k and f.backward:
                for key in f.rows:
                    if key is not None:
                        seen[(key, f.theta)] = None
        return list(seen)

    def _fit_window(self, k: int, steps: list[int], shift: int) -> _Fit:
        columns = self._columns(k)
        index = {row.key: j for j, row in enumerate(self.rows[k])}
        basis = [self.contribution(key, theta, shift) for key, theta in columns]
        weights = [0.0] * len(self.rows[k])
        carried, residual = 0.0, 0.0
        for s in steps:
            shares, r = _fit(self.watch.steps[s].grad, basis)
            residual = max(residual, r)
            for (key, _), x in zip(columns, shares, strict=True):
                if key[0] == k:
                    weights[index[key]] += x
                else:
                    carried = max(carried, abs(x))
        return _Fit(weights, carried, residual)

    def _window(
        self,
        k: int,
        found: dict[str, list[int]],
        notes: dict[str, list[int]],
        residual_at_1: dict[int, float],
    ) -> tuple[WindowAudit, dict[str, tuple[_Weighting, list[float]]] | None]:
        """Window ``k``'s measurements, the mistakes and notes they show (added to
        ``found`` and ``notes``), and the weightings its example shares agree with."""
        watch, rows, a = self.watch, self.rows[k], len(self.windows[k])
        events = [(kind, i) for (w, kind, i) in watch.events if w == k]
        kinds = [kind for kind, _ in events]
        forwards = [i for kind, i in events if kind == "forward"]
        steps = [i for kind, i in events if kind == "step"]
        index = {row.key: j for j, row in enumerate(rows)}
        trained = [0] * len(rows)  # backward passes through each example
        for f in forwards:
            for key in watch.forwards[f].rows:
                if key is not None:
                    trained[index[key]] += watch.forwards[f].backward

        fit, shift = self._fit_window(k, steps, 1), 1
        residual_at_1[k] = fit.residual
        if steps and fit.residual > _TOL:  # is it the targets that are misaligned?
            for other_shift in _SHIFTS:
                alt = self._fit_window(k, steps, other_shift)
                if alt.residual <= _TOL:
                    fit, shift = alt, other_shift
                    found[_SHIFTS[shift]].append(k)
                    break
        weights = fit.weights
        reference_grad = sum(
            (self.contribution(row.key, self.starts[k]) for row in rows),
            torch.zeros_like(self.final),
        )
        stepped = sum((watch.steps[s].grad for s in steps), torch.zeros_like(self.final))
        error = float((stepped - reference_grad).norm() / reference_grad.norm())

        if not steps:
            found["no_update"].append(k)
        if len(steps) > 1:
            found["step_per_microbatch"].append(k)
        if kinds.count("scheduler") > 1:
            found["scheduler_per_microbatch"].append(k)
        lost = [j for j in range(len(rows)) if trained[j] == 0]
        if lost:
            found["lost_microbatches"].append(k)
        used = [j for j in range(len(rows)) if abs(weights[j]) > _TOL]
        if steps and any(trained[j] > 1 for j in used):
            found["duplicated_microbatch"].append(k)
        # examples whose backward ran before the window's last step but did not reach it
        lost_clears = _cleared_before_step(kinds)
        last_step = max((p for p, kind in enumerate(kinds) if kind == "step"), default=-1)
        backed = {
            index[key]
            for p, (kind, f) in enumerate(events)
            if kind == "backward" and p < last_step
            for key in watch.forwards[f].rows
            if key is not None and key[0] == k  # (a delayed backward of an earlier window)
        }
        cleared = [j for j in backed if abs(weights[j]) <= _TOL]
        if lost_clears or (cleared and fit.residual <= _TOL):
            found["zero_grad_in_window"].append(k)
        late = [  # trained only after the window's last step: no update of it used them
            j for j in range(len(rows)) if steps and trained[j] and j not in backed
        ]
        if late and fit.residual <= _TOL and all(abs(weights[j]) <= _TOL for j in late):
            found["lost_microbatches"].append(k)
            self.late.update(rows[j].key for j in late)
        if fit.carried > _TOL and fit.residual <= _TOL:  # else the shares mean nothing
            notes["stale" if steps and not used else "carried"].append(k)
        if fit.residual > _TOL:
            notes["unexplained"].append(k)
        if any(None in watch.forwards[f].rows for f in forwards if watch.forwards[f].backward):
            notes["unmatched"].append(k)
        audit = WindowAudit(
            index=k,
            microbatches=a,
            targets=self.totals[k],
            forwards=len(forwards),
            backward_passes=kinds.count("backward"),
            optimizer_steps=len(steps),
            scheduler_steps=kinds.count("scheduler"),
            zero_grad_calls=kinds.count("zero_grad"),
            weights=self._per_microbatch(rows, weights, a) if steps else None,
            update_error=error if steps else None,
            carried=fit.carried,
            residual=fit.residual,
            cleared_gradients=lost_clears,
            kept_tensors=0,
            example_weights=self._nested(rows, [round(x, 12) for x in weights], a)
            if steps
            else None,
            example_backward_passes=self._nested(rows, trained, a),
            label_shift=shift if fit.residual <= _TOL else None,
        )
        constrained = steps and used and fit.residual <= _TOL
        return audit, self._matching(k, weights, trained, used, lost) if constrained else None

    def report(self, optimizer: torch.optim.Optimizer, changed: list[str]) -> AuditReport:
        found: dict[str, list[int]] = {name: [] for name in MISTAKES}  # windows showing each
        evidence: dict[str, str] = {}
        other: list[str] = []
        notes: dict[str, list[int]] = {
            "carried": [],
            "stale": [],
            "unexplained": [],
            "unmatched": [],
        }
        residual_at_1: dict[int, float] = {}
        audits: list[WindowAudit] = []
        matches: list[dict[str, tuple[_Weighting, list[float]]] | None] = []
        for k in range(len(self.windows)):
            audit, match = self._window(k, found, notes, residual_at_1)
            audits.append(audit)
            matches.append(match)

        self._notes(notes, audits, other)
        self._weighting_findings(matches, audits, found, evidence, other)
        for shift, name in _SHIFTS.items():
            if found[name]:
                evidence[name] = self._shift_evidence(shift, found[name], audits, residual_at_1)
        if changed:
            found["window_modified_in_place"].append(0)
            shown = "; ".join(changed[:3]) + (
                f"; and {len(changed) - 3} more" if len(changed) > 3 else ""
            )
            evidence["window_modified_in_place"] = (
                f"the loop changed {len(changed)} tensors of the windows it was given: {shown}. "
                "A data set that is read again (the next epoch, a retried window) then trains "
                "on the changed data"
            )
        self._lost_evidence(found, audits, evidence)
        _kept_evidence(self.watch, optimizer, audits, found, evidence)
        _count_evidence(audits, found, evidence)
        mistakes = [name for name in MISTAKES if found[name]]
        off = [w.index for w in audits if w.update_error is not None and w.update_error > _TOL]
        if not mistakes and not other and off:
            other.append(  # never an ok text quoting a large error
                f"{_windows_text(off)}: the update differs from the correct one (largest "
                f"relative error {max(audits[k].update_error or 0.0 for k in off):.2g}, "
                f"tolerance {_TOL:.0e}) in a way the audit cannot attribute"
            )
        return AuditReport(mistakes, {n: evidence[n] for n in mistakes}, other, audits)

    def _weighting_findings(
        self,
        matches: list[dict[str, tuple[_Weighting, list[float]]] | None],
        audits: list[WindowAudit],
        found: dict[str, list[int]],
        evidence: dict[str, str],
        other: list[str],
    ) -> None:
        """The weighting every analysed window agrees with names its mistakes; none is a
        finding outside the vocabulary, described as a factor when it is one."""
        weighting = _choose_weighting(matches)
        constrained = [k for k, m in enumerate(matches) if m is not None]
        if constrained and weighting is None:
            shown = ", ".join(
                f"window {k}: " + _numbers(audits[k].weights or []) for k in constrained[:2]
            )
            other.append(
                "the updates weight the microbatches in a way no known mistake explains "
                f"(share of each microbatch's correct contribution, {shown})"
            )
            flat = [[x for mb in audits[k].example_weights or [] for x in mb] for k in constrained]
            if all(all(_near(x, w[0]) for x in w) for w in flat):
                implied = [audits[k].targets / w[0] for k, w in zip(constrained, flat, strict=True)]
                other.append(
                    "every example's share is the same within each window: each update is the "
                    "correct one times a factor, as if the loss sums were divided by "
                    f"{_numbers(implied)} in {_windows_text(constrained)} instead of their "
                    f"{_numbers([audits[k].targets for k in constrained])} targets (a count of "
                    "something else, a constant factor, or clipping below the gradient norm)"
                )
        elif weighting is not None:
            for name in weighting.mistakes:
                found[name].extend(constrained)
                evidence[name] = self._weighting_evidence(
                    name, weighting, audits, matches, constrained
                )
            if weighting.note:
                other.append(weighting.note)

    @staticmethod
    def _nested(rows: Sequence[_Row], values: Sequence[Any], a: int) -> list[list[Any]]:
        out: list[list[Any]] = [[] for _ in range(a)]
        for row, v in zip(rows, values, strict=True):
            out[row.microbatch].append(v)
        return out

    @staticmethod
    def _per_microbatch(rows: Sequence[_Row], weights: Sequence[float], a: int) -> list[float]:
        """Each microbatch's share: the target-weighted mean of its examples' shares."""
        num, den = [0.0] * a, [0] * a
        for row, w in zip(rows, weights, strict=True):
            num[row.microbatch] += w * row.targets
            den[row.microbatch] += row.targets
        return [round(x / d, 12) if d else 0.0 for x, d in zip(num, den, strict=True)]

    def _matching(
        self, k: int, weights: list[float], trained: list[int], used: list[int], lost: list[int]
    ) -> dict[str, tuple[_Weighting, list[float]]]:
        """The weightings window ``k``'s example shares agree with (each trained example
        counted as often as it was trained), over the whole window and, when examples
        were lost, over the examples the loop trained."""
        total = self.totals[k]
        rows = self.rows[k]
        options = _weightings(rows)
        if lost:
            options += _weightings(rows, [t > 0 for t in trained])
        out: dict[str, tuple[_Weighting, list[float]]] = {}
        for w, d in options:
            if w.key not in out and all(
                _near(weights[j], max(1, trained[j]) * total / d[j]) for j in used
            ):
                out[w.key] = (w, d)
        return out

    def _notes(
        self, notes: dict[str, list[int]], audits: list[WindowAudit], other: list[str]
    ) -> None:
        if notes["carried"]:
            other.append(
                f"{_windows_text(notes['carried'])}: gradients of earlier windows were still in "
                ".grad at optimizer.step() (largest share "
                f"{max(audits[k].carried for k in notes['carried']):.3g}); clear the gradients "
                "once per window with optimizer.zero_grad()"
            )
        if notes["stale"]:
            other.append(
                f"{_windows_text(notes['stale'])}: optimizer.step() applied only gradients of "
                "earlier windows: it ran before this window's backward passes; call it after "
                "the window's last backward pass"
            )
        if notes["unexplained"]:
            other.append(
                f"{_windows_text(notes['unexplained'])}: the gradient at optimizer.step() is not "
                "a combination of the microbatch gradients (largest relative residual "
                f"{max(audits[k].residual for k in notes['unexplained']):.2g}): something else "
                "changed it (clipping below the gradient norm, another loss, other inputs)"
            )
        if notes["unmatched"]:
            other.append(
                f"{_windows_text(notes['unmatched'])}: backward passes through inputs that are "
                "not rows of the window's microbatches; the audit cannot attribute them"
            )
        if not any(w.scheduler_steps for w in audits):
            other.append(
                "scheduler.step() was never called: a schedule defined in updates needs one "
                "call per update, after optimizer.step()"
            )
        elif skipped := [w.index for w in audits if not w.scheduler_steps and w.optimizer_steps]:
            other.append(
                f"{_windows_text(skipped)}: an update without scheduler.step(); the schedule "
                "falls behind the updates (call it once per update, after optimizer.step())"
            )
        moved = [
            w.index
            for w in audits
            if not w.optimizer_steps
            and w.index + 1 < len(audits)
            and self.starts[w.index + 1] != self.starts[w.index]
        ]
        if not audits[-1].optimizer_steps and not torch.equal(
            self.final, self.watch.thetas[self.starts[-1]]
        ):
            moved.append(audits[-1].index)
        if moved:
            other.append(
                f"{_windows_text(moved)}: the weights changed without optimizer.step(); the "
                "audit can only check updates made by the optimizer"
            )

    def _weighting_evidence(
        self,
        name: str,
        weighting: _Weighting,
        audits: list[WindowAudit],
        matches: list[dict[str, tuple[_Weighting, list[float]]] | None],
        constrained: list[int],
    ) -> str:
        k = constrained[0]
        first = audits[k]
        weights = first.weights or []
        rows = self.rows[k]
        per_mb = _microbatch_counts(rows, "targets", first.microbatches)
        if name == "double_division":
            ratios = []
            for j in constrained:
                d = matches[j][weighting.key][1]  # type: ignore[index]
                a = audits[j].microbatches
                flat = [x for mb in audits[j].example_weights or [] for x in mb]
                used = [i for i, x in enumerate(flat) if abs(x) > _TOL]
                ratios.append(
                    (
                        a,
                        sum(flat[i] * d[i] / (audits[j].targets * a) for i in used)
                        / max(1, len(used)),
                    )
                )
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
            if "example" in weighting.key:
                flat = [x for mb in first.example_weights or [] for x in mb]
                return (
                    f"in window {k} the examples hold {_numbers([r.targets for r in rows])} "
                    f"targets and reached the update with weights {_numbers(flat)} (1 = "
                    f"correct), equal to {first.targets} / ({weighting.key}): each example's "
                    f"mean counts the same whatever its length; a target in the shortest "
                    f"example weighs {max(flat) / min(flat):.3g} × one in the longest"
                )
            text = (
                f"in window {k} the microbatches hold {_numbers(per_mb)} targets and reached the "
                f"update with weights {_numbers(weights)} (1 = correct), equal to {first.targets} "
                f"/ ({weighting.key}): each microbatch's mean counts the same whatever its size"
            )
            w = [x for x in weights if abs(x) > _TOL]
            if len(w) > 1 and min(w) > 0:
                text += (
                    f"; a target in the smallest microbatch weighs {max(w) / min(w):.3g} × one "
                    "in the largest, and another split of the same examples gives another update"
                )
            return text
        if name == "ignored_tokens_counted":
            unit = (
                "label positions" if "label positions" in weighting.key else "attention-mask tokens"
            )
            described = (
                "label positions after the shift, -100 included"
                if unit == "label positions"
                else "attention-mask tokens (prompt included, no shift)"
            )
            return (
                f"the denominator counts {described}, not supervised targets: in window {k} the "
                f"microbatches hold {_numbers(per_mb)} targets but "
                f"{_numbers(_microbatch_counts(rows, _UNITS[unit], first.microbatches))} {unit}, "
                f"and the measured weights {_numbers(weights)} (1 = correct) equal "
                f"{first.targets} / ({weighting.key})"
            )
        raise AssertionError(name)

    def _shift_evidence(
        self, shift: int, bad: list[int], audits: list[WindowAudit], residual_at_1: dict[int, float]
    ) -> str:
        what = (
            "its own input token (labels[:, t], no shift)"
            if shift == 0
            else "the token two places ahead (labels[:, t + 2], shifted twice)"
        )
        return (
            f"in {_windows_text(bad)} the updates are exact combinations of the gradients of "
            f"each position predicting {what} (relative residual "
            f"{max(audits[k].residual for k in bad):.1g}), not of the next token "
            f"(labels[:, t + 1]: residual {max(residual_at_1[k] for k in bad):.2g})"
        )

    def _lost_evidence(
        self, found: dict[str, list[int]], audits: list[WindowAudit], evidence: dict[str, str]
    ) -> None:
        groups: dict[str, list[tuple[str, Callable[[RowKey, int], bool]]]] = {
            "lost_microbatches": [
                ("never reached a backward pass whole", lambda key, n: n == 0),
                (
                    "reached a backward pass only after the window's last optimizer.step()",
                    lambda key, n: key in self.late,
                ),
            ],
            "duplicated_microbatch": [
                ("went through more than one backward pass", lambda key, n: n > 1)
            ],
        }
        for name, tests in groups.items():
            if not found[name]:
                continue
            windows, sentences, targets = sorted(set(found[name])), [], 0
            for verb, test in tests:
                parts = []
                for k in windows:
                    items = []
                    for i, passes in enumerate(audits[k].example_backward_passes):
                        hit = [r for r, n in enumerate(passes) if test((k, i, r), n)]
                        if not hit:
                            continue
                        targets += sum(self.by_key[(k, i, r)].targets for r in hit)
                        times = "" if name == "lost_microbatches" else f" ({max(passes)} ×)"
                        if len(hit) == len(passes):
                            items.append(f"microbatch {i}{times}")
                        else:
                            ex = ", ".join(map(str, hit))
                            plural = "s" if len(hit) > 1 else ""
                            items.append(f"example{plural} {ex} of microbatch {i}{times}")
                    if items:
                        parts.append(f"window {k}: {', '.join(items)}")
                if parts:
                    sentences.append(f"{'; '.join(parts)} {verb}")
            weights = audits[windows[0]].weights
            shares = (
                f"; weights in window {windows[0]}: {_numbers(weights)} (1 = correct)"
                if weights
                else ""
            )
            evidence[name] = (
                f"{'; and '.join(sentences)} ({targets} of the controlled set's "
                f"{sum(self.totals)} targets){shares}"
            )


def _microbatch_counts(rows: Sequence[_Row], attr: str, a: int) -> list[int]:
    out = [0] * a
    for row in rows:
        out[row.microbatch] += getattr(row, attr)
    return out


def _choose_weighting(
    matches: list[dict[str, tuple[_Weighting, list[float]]] | None],
) -> _Weighting | None:
    """The weighting every analysed window agrees with (the simplest if several do)."""
    sets = [m for m in matches if m is not None]
    if not sets:
        return None
    common = set.intersection(*(set(m) for m in sets))
    if not common:
        return None
    options = [sets[0][key][0] for key in common]
    return min(options, key=lambda w: (len(w.mistakes), w.note is not None, w.key))


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
    graph, nbytes, storages, earlier = 0, 0, set(), []
    last = len(watch.created) - 1
    for k, mode in enumerate(watch.created):
        alive = {}
        for ref in mode.refs:
            t = ref()
            if t is None or id(t) in owned or (t.dim() == 0 and t.grad_fn is None):
                continue  # a detached scalar (a logged loss value) holds no activations
            alive[id(t)] = t
        audits[k].kept_tensors = len(alive)
        if k < last and alive:
            earlier.append(k)
            for t in alive.values():
                graph += t.grad_fn is not None
                key = t.untyped_storage().data_ptr()
                if key not in storages:
                    storages.add(key)
                    nbytes += t.untyped_storage().nbytes()
    # The first window may make what lives on once (a cache, a scaler's state); a leak
    # leaves tensors behind window after window, so it shows in the middle ones too.
    if any(0 < k < last for k in earlier):
        found["kept_references"].extend(earlier)
        left = ", ".join(str(w.kept_tensors) for w in audits)
        total = sum(audits[k].kept_tensors for k in earlier)
        evidence["kept_references"] = (
            f"{total} tensors created in earlier windows were still alive after the last "
            f"window and gc.collect() ({graph} attached to an autograd graph, {nbytes} bytes "
            f"of storage); tensors left alive per window: {left}"
        )
