"""The shipped data set, its character vocabulary and the collate function.

Token ids: ``PAD_ID = 0`` (padding), ``EOS_ID = 1`` (end of sequence), then one id
per character of :data:`VOCAB_CHARS`. An example is ``prompt + response + EOS``.

Labels follow the Hugging Face convention: ``labels`` is aligned with ``input_ids``
(no shift); the loss shifts, scoring ``logits[:, t]`` against ``labels[:, t + 1]``.
Ignored positions hold ``ignore_index`` (-100). With the prompt masked, the
supervised targets of an example, ``labels[:, 1:] != -100``, are its response
characters plus the EOS token.

The data set file, ``instructions.jsonl``, is package data next to this module, so an
installed wheel carries it; ``data/make_dataset.py`` in the repository regenerates it.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

if TYPE_CHECKING:  # importlib.resources.abc is new in Python 3.11
    from importlib.resources.abc import Traversable

PAD_ID = 0
EOS_ID = 1
#: Characters the vocabulary knows, in id order starting at 2: newline, then
#: printable ASCII from space (32) to tilde (126).
VOCAB_CHARS = (
    "\n"
    " !\"#$%&'()*+,-./0123456789:;<=>?@"
    "ABCDEFGHIJKLMNOPQRSTUVWXYZ[\\]^_`"
    "abcdefghijklmnopqrstuvwxyz{|}~"
)
_CHAR_TO_ID = {ch: i + 2 for i, ch in enumerate(VOCAB_CHARS)}
#: Number of token ids: PAD, EOS and one per character.
VOCAB_SIZE: int = 2 + len(VOCAB_CHARS)

#: The shipped data set, read through ``importlib.resources`` so it is found wherever the
#: package is installed (for an ordinary install this is a ``pathlib.Path``).
DATA_PATH: Traversable = resources.files(__package__).joinpath("instructions.jsonl")


def encode(text: str) -> list[int]:
    """Map each character of ``text`` to its token id (no EOS is added)."""
    ids = []
    for pos, ch in enumerate(text):
        try:
            ids.append(_CHAR_TO_ID[ch])
        except KeyError:
            raise ValueError(
                f"character {ch!r} at position {pos} is not in the accumlab vocabulary "
                "(newline and printable ASCII only)"
            ) from None
    return ids


def decode(ids: Iterable[int] | Tensor) -> str:
    """Map token ids back to text; PAD and EOS produce no character."""
    if isinstance(ids, Tensor):
        ids = ids.tolist()
    chars = []
    for i in ids:
        i = int(i)
        if i in (PAD_ID, EOS_ID):
            continue
        if not 2 <= i < VOCAB_SIZE:
            raise ValueError(f"token id {i} is outside the vocabulary (0..{VOCAB_SIZE - 1})")
        chars.append(VOCAB_CHARS[i - 2])
    return "".join(chars)


@dataclass(frozen=True)
class Example:
    """One tokenized example.

    ``input_ids`` is ``prompt + response + [EOS_ID]``; its first ``prompt_len`` ids
    are the prompt. Response length in tokens = ``len(input_ids) - prompt_len - 1``.
    """

    id: int
    input_ids: list[int]
    prompt_len: int

    def __post_init__(self) -> None:
        if not self.input_ids:
            raise ValueError(f"example {self.id} has no tokens")
        if not 0 <= self.prompt_len <= len(self.input_ids):
            raise ValueError(
                f"example {self.id}: prompt_len {self.prompt_len} is outside "
                f"0..{len(self.input_ids)}"
            )


def load_examples(
    path: str | Path | Traversable | None = None, limit: int | None = None
) -> list[Example]:
    """Read and tokenize a JSON-lines file of ``{"id", "prompt", "response"}`` records.

    ``path`` defaults to :data:`DATA_PATH`, the data set shipped inside the package;
    ``limit`` keeps only the first ``limit`` examples (in file order). Returns examples
    in file order.
    """
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0 or None, got {limit}")
    if path is None:
        source: Traversable = DATA_PATH
        if not source.is_file():
            raise FileNotFoundError(
                f"the shipped data set is missing at {source}; reinstall accumlab, or in a "
                "repository checkout regenerate it with `python data/make_dataset.py`"
            )
    else:
        source = Path(path) if isinstance(path, str) else path
        if not source.is_file():
            raise FileNotFoundError(
                f"data set not found at {source}; pass the path of a JSON-lines file, or "
                "path=None for the shipped one (`python data/make_dataset.py` writes it)"
            )
    examples = []
    with source.open("r", encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if limit is not None and len(examples) >= limit:
                break
            if not line.strip():
                continue
            record = json.loads(line)
            try:
                prompt, response = encode(record["prompt"]), encode(record["response"])
                examples.append(
                    Example(
                        id=int(record["id"]),
                        input_ids=prompt + response + [EOS_ID],
                        prompt_len=len(prompt),
                    )
                )
            except (KeyError, ValueError) as e:
                raise ValueError(f"{source}:{line_no}: bad record: {e}") from e
    return examples


def collate(
    examples: Sequence[Example],
    *,
    mask_prompt: bool = True,
    ignore_index: int = -100,
    pad_id: int = PAD_ID,
) -> dict[str, Tensor]:
    """Pad examples on the right into one batch of long tensors.

    Returns ``input_ids`` and ``attention_mask`` (1 on real tokens, 0 on padding),
    both (batch, longest); ``labels``, a copy of ``input_ids`` with padding -- and the
    prompt when ``mask_prompt`` -- set to ``ignore_index`` (not shifted: the loss
    shifts); and ``example_ids`` (batch,).

    With the prompt masked an example has ``response length + 1`` supervised targets
    (``labels[:, 1:] != ignore_index``); without, ``len(input_ids) - 1``.
    """
    if len(examples) == 0:
        raise ValueError("collate needs at least one example, got an empty sequence")
    longest = max(len(ex.input_ids) for ex in examples)
    input_ids = torch.full((len(examples), longest), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(examples), longest), dtype=torch.long)
    labels = torch.full((len(examples), longest), ignore_index, dtype=torch.long)
    for row, ex in enumerate(examples):
        n = len(ex.input_ids)
        input_ids[row, :n] = torch.tensor(ex.input_ids, dtype=torch.long)
        attention_mask[row, :n] = 1
        start = ex.prompt_len if mask_prompt else 0
        labels[row, start:n] = input_ids[row, start:n]
    example_ids = torch.tensor([ex.id for ex in examples], dtype=torch.long)
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "labels": labels,
        "example_ids": example_ids,
    }


def microbatches(
    examples: Sequence[Example],
    micro_batch_size: int,
    *,
    shuffle: bool = False,
    seed: int = 0,
    **collate_kwargs: Any,
) -> list[dict[str, Tensor]]:
    """Split examples into consecutive microbatches of ``micro_batch_size`` examples.

    The last microbatch holds the remainder and may be smaller. With ``shuffle`` the
    order is first permuted by ``random.Random(seed)`` (the input is not modified).
    Each microbatch is passed through :func:`collate` with ``collate_kwargs``.
    """
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    if len(examples) == 0:
        raise ValueError("microbatches needs at least one example, got an empty sequence")
    order = list(examples)
    if shuffle:
        random.Random(seed).shuffle(order)
    return [
        collate(order[i : i + micro_batch_size], **collate_kwargs)
        for i in range(0, len(order), micro_batch_size)
    ]


def make_classification(
    n: int, in_features: int = 8, out_features: int = 3, seed: int = 0
) -> tuple[Tensor, Tensor]:
    """A small synthetic *classification* set for :class:`accumlab_course.models.MLP`.

    Returns ``x`` (n, in_features) float32 standard-normal features and ``labels``
    (n,) long in ``0..out_features-1``: the argmax of a fixed random linear map of
    ``x`` plus a little noise. Deterministic for a given ``seed``.
    """
    if n < 1 or in_features < 1 or out_features < 2:
        raise ValueError("need n >= 1, in_features >= 1 and out_features >= 2")
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, in_features, generator=g)
    weight = torch.randn(in_features, out_features, generator=g)
    scores = x @ weight + 0.1 * torch.randn(n, out_features, generator=g)
    return x, scores.argmax(dim=1)
