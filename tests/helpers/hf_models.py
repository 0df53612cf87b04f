"""The one builder of the tests' tiny GPT-2: every test and worker that needs a GPT-2 gets
it here, built from a config (nothing is downloaded).

It imports transformers only when called, so the workers that run under an older
transformers release (``tests/helpers/hf_workers.py``, in a subprocess with that release
first on ``PYTHONPATH``) build the same model from the release they import.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

#: head -> the transformers class that puts it on GPT-2
HEADS = {"lm": "GPT2LMHeadModel", "sequence": "GPT2ForSequenceClassification",
         "token": "GPT2ForTokenClassification"}


def gpt2(head: str = "lm", *, vocab: int = 64, positions: int = 16, width: int = 16, layers: int = 1,
         heads: int = 2, dropout: float = 0.0, seed: int = 0, dtype: torch.dtype | None = None,
         **config: Any) -> nn.Module:
    """A GPT-2 with ``head`` (``"lm"``, ``"sequence"`` or ``"token"`` classification) from
    a tiny config: ``vocab`` tokens, ``positions`` positions, ``layers`` layers of
    ``width`` channels and ``heads`` heads, every dropout probability ``dropout``, weights
    drawn after ``torch.manual_seed(seed)``; ``config`` adds or overrides ``GPT2Config``
    fields (``num_labels``, ``pad_token_id``, ``bos_token_id``, ...). Its ``loss_type`` is
    left as transformers sets it."""
    import transformers

    if head not in HEADS:
        raise ValueError(f"head must be one of {sorted(HEADS)}, got {head!r}")
    settings: dict[str, Any] = dict(vocab_size=vocab, n_positions=positions, n_embd=width, n_layer=layers,
                                    n_head=heads, resid_pdrop=dropout, embd_pdrop=dropout,
                                    attn_pdrop=dropout)
    settings.update(config)
    torch.manual_seed(seed)
    model = getattr(transformers, HEADS[head])(transformers.GPT2Config(**settings))
    return model if dtype is None else model.to(dtype)


__all__ = ["HEADS", "gpt2"]
