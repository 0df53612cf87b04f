"""Shared models, batch builders and gradient helpers for accumlab's tests.

The helpers here compute reference gradients *without* going through accumlab (plain
``F.cross_entropy(..., reduction="mean")`` on the whole batch), so a test that compares
the package against them checks the package, not the package against itself.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable, Mapping, Sequence

import pytest
import torch
import torch.nn.functional as F
from hypothesis import settings
from torch import Tensor, nn

from accumlab.course.data import VOCAB_SIZE
from accumlab.course.models import TinyGPT

# CI runs the property tests with a fixed seed: a red build must be reproducible, and
# exploring fresh random cases is for local runs.
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")

torch.set_num_threads(1)

IGNORE = -100
TOY_VOCAB = 13


# --------------------------------------------------------------------------- models


class CausalToy(nn.Module):
    """A small causal language model: embedding, running mean over the prefix, MLP head.

    Position ``t`` sees tokens ``0..t`` only (the prefix mean), so right padding never
    changes the logits of real positions, exactly like a causal transformer. Returns a
    plain tensor of logits (batch, seq, vocab), which also exercises that output form.
    """

    def __init__(self, vocab_size: int = TOY_VOCAB, width: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, width)
        self.mix = nn.Linear(2 * width, width)
        self.head = nn.Linear(width, vocab_size)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        x = self.embed(input_ids)
        steps = torch.arange(1, x.shape[1] + 1, device=x.device, dtype=x.dtype)
        prefix_mean = x.cumsum(dim=1) / steps[None, :, None]
        return self.head(torch.tanh(self.mix(torch.cat([x, prefix_mean], dim=-1))))


class OneWeight(nn.Module):
    """``output = w · x`` with a single weight ``w`` (starts at ``init``).

    With ``ExampleLoss(loss_is_output)`` an example's loss is ``w · x_i``, so its
    gradient with respect to ``w`` is exactly ``x_i``: the worked numbers of the course
    can be planted in ``x`` and read back from ``w.grad``.
    """

    def __init__(self, init: float = 1.0, dtype: torch.dtype = torch.float64) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor(init, dtype=dtype))

    def forward(self, x: Tensor) -> Tensor:
        return self.w * x


def loss_is_output(output: Tensor, labels: Tensor) -> Tensor:
    """Per-example loss equal to the model output (shape (batch,)); labels unused."""
    return output


class LevelLM(nn.Module):
    """A two-token language model whose per-target loss is ``w · level``, exactly.

    The input id at position ``t`` is the *level* of the target at ``t + 1``: the model
    scores class 0 with logit 0 and class 1 with ``log(expm1(w · level))``, so the
    cross-entropy of target 0 is ``log(1 + expm1(w · level)) = w · level`` nats and its
    derivative with respect to ``w`` is ``level``. Levels must be positive (pad with 1).
    """

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor(1.0, dtype=torch.float64))

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        other = torch.log(torch.expm1(self.w * input_ids.to(torch.float64)))
        return torch.stack([torch.zeros_like(other), other], dim=-1)


def level_batch(levels: Sequence[Sequence[int]], supervised: Sequence[Sequence[bool]]) -> dict:
    """A batch for :class:`LevelLM`: row ``r`` has target ``t + 1`` at level ``levels[r][t]``.

    ``supervised[r][t]`` says whether the target at ``t + 1`` counts; unsupervised ones
    get label ``-100``. Position 0's label is always ``-100`` (it is never a target).
    """
    ids = torch.tensor([list(row) + [1] for row in levels], dtype=torch.long)
    labels = torch.full_like(ids, IGNORE)
    for r, row in enumerate(supervised):
        for t, on in enumerate(row):
            if on:
                labels[r, t + 1] = 0
    return {"input_ids": ids, "labels": labels}


def small_gpt(dtype: torch.dtype = torch.float32, seed: int = 0, **kwargs: int) -> TinyGPT:
    """A one-layer TinyGPT over the course vocabulary, fast enough for many tests."""
    torch.manual_seed(seed)
    config = {"block_size": 32, "n_layer": 1, "n_head": 2, "n_embd": 16, **kwargs}
    return TinyGPT(VOCAB_SIZE, **config).to(dtype)


@pytest.fixture
def toy64() -> CausalToy:
    """A float64 :class:`CausalToy` with fixed weights."""
    torch.manual_seed(0)
    return CausalToy().double()


@pytest.fixture
def gpt64() -> TinyGPT:
    """A float64 one-layer TinyGPT with fixed weights."""
    return small_gpt(torch.float64)


# --------------------------------------------------------------------------- batches


def token_batch(
    rows: Sequence[tuple[int, int]],
    *,
    vocab: int = TOY_VOCAB,
    seed: int = 0,
    pad_to: int | None = None,
) -> dict[str, Tensor]:
    """Right-padded token batch; ``rows`` holds ``(length, prompt_len)`` per example.

    Labels copy the ids from ``prompt_len`` to ``length`` and are ``-100`` on the prompt
    and the padding, as a collate function with prompt masking produces them.
    """
    g = torch.Generator().manual_seed(seed)
    width = max(pad_to or 0, max(length for length, _ in rows))
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE, dtype=torch.long)
    for r, (length, prompt) in enumerate(rows):
        ids[r, :length] = torch.randint(1, vocab, (length,), generator=g)
        mask[r, :length] = 1
        labels[r, prompt:length] = ids[r, prompt:length]
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def targets_of(batch: Mapping[str, Tensor]) -> int:
    """Supervised targets after the shift, counted by hand."""
    return int((batch["labels"][:, 1:] != IGNORE).sum())


def trim(batch: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Cut trailing columns that are padding in every row (each microbatch padded to its
    own longest example, as a real collate does)."""
    width = int(batch["attention_mask"].sum(dim=1).max())
    return {k: v[:, : max(width, 1)] for k, v in batch.items()}


def rows(batch: Mapping[str, Tensor], start: int, stop: int) -> dict[str, Tensor]:
    """Examples ``start..stop-1`` of a batch."""
    return {k: v[start:stop] for k, v in batch.items()}


# --------------------------------------------------------------------------- gradients


def grads(model: nn.Module) -> dict[str, Tensor]:
    """A copy of every parameter's ``.grad`` (zeros where there is none)."""
    return {
        n: p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
        for n, p in model.named_parameters()
    }


def params(model: nn.Module) -> dict[str, Tensor]:
    """A copy of every parameter's value."""
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def rel_error(reference: Mapping[str, Tensor], candidate: Mapping[str, Tensor]) -> float:
    """Largest over parameters of ``max |candidate - reference| / max |reference|``."""
    assert reference.keys() == candidate.keys()
    worst = 0.0
    for name, ref in reference.items():
        err = float((candidate[name].double() - ref.double()).abs().max())
        scale = float(ref.double().abs().max())
        worst = max(worst, err / scale if scale > 0 else (0.0 if err == 0 else math.inf))
    return worst


def reference_gradient(
    model: nn.Module, loss_fn: Callable[[nn.Module], Tensor]
) -> dict[str, Tensor]:
    """The gradient of ``loss_fn(model)`` in one backward pass; ``.grad`` cleared after."""
    model.zero_grad(set_to_none=True)
    loss_fn(model).backward()
    out = grads(model)
    model.zero_grad(set_to_none=True)
    return out


def token_mean_gradient(model: nn.Module, batches: Iterable[Mapping[str, Tensor]]) -> dict:
    """Gradient of the token-mean cross-entropy over all examples of ``batches`` taken as
    one batch (padded to a common width), computed with plain ``F.cross_entropy``."""
    parts = list(batches)
    width = max(int(b["input_ids"].shape[1]) for b in parts)

    def pad(t: Tensor, value: int) -> Tensor:
        return F.pad(t, (0, width - t.shape[1]), value=value)

    ids = torch.cat([pad(b["input_ids"], 0) for b in parts])
    labels = torch.cat([pad(b["labels"], IGNORE) for b in parts])

    def loss(m: nn.Module) -> Tensor:
        out = m(input_ids=ids)
        logits = out if isinstance(out, Tensor) else out.logits
        return F.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]),
            labels[:, 1:].reshape(-1),
            ignore_index=IGNORE,
            reduction="mean",
        )

    return reference_gradient(model, loss)


class CaptureOptimizer(torch.optim.Optimizer):
    """An optimizer whose ``step`` records the gradients it is given and changes nothing.

    Lets a test see the exact gradient ``train_window`` hands to the optimizer (after
    accumulation, unscaling and clipping), with no round trip through the weights.
    """

    def __init__(self, parameters: Iterable[nn.Parameter], names: Sequence[str]) -> None:
        super().__init__(list(parameters), {"lr": 1.0})
        self.names = list(names)
        self.seen: list[dict[str, Tensor]] = []

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        flat = [p for group in self.param_groups for p in group["params"]]
        self.seen.append(
            {
                n: p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
                for n, p in zip(self.names, flat, strict=True)
            }
        )


def capture(model: nn.Module) -> CaptureOptimizer:
    """A :class:`CaptureOptimizer` over ``model``'s parameters, keyed by name."""
    named = list(model.named_parameters())
    return CaptureOptimizer([p for _, p in named], [n for n, _ in named])


# --------------------------------------------------------------------------- exercises


@pytest.fixture(autouse=True)
def _exercise_messages_on_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """Checkers print their verdicts and hints wrapped at 88 characters for the notebooks;
    tests read them on one line, so a phrase they look for is never cut by a line break.
    ``tests/test_exercise_messages.py`` checks the wrapping itself."""
    import accumlab.course.exercises as exercises

    monkeypatch.setattr(exercises, "WIDTH", None)
