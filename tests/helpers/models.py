"""Small models with known gradients, for tests that check accumlab against numbers
computed without it: a causal toy LM, one-weight models, and a one-layer TinyGPT."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from accumlab_course.data import VOCAB_SIZE
from accumlab_course.models import TinyGPT

IGNORE = -100
TOY_VOCAB = 13

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


def small_gpt(dtype: torch.dtype = torch.float32, seed: int = 0, **kwargs: int) -> TinyGPT:
    """A one-layer TinyGPT over the course vocabulary, fast enough for many tests."""
    torch.manual_seed(seed)
    config = {"block_size": 32, "n_layer": 1, "n_head": 2, "n_embd": 16, **kwargs}
    return TinyGPT(VOCAB_SIZE, **config).to(dtype)
