"""The reference the loop's updates are measured against: each example's correct
contribution to its window's update.

An example's contribution is its summed next-token loss over its window's target count
(the rule every microbatch follows, with D = 1), differentiated at a set of weights the
loop's forward passes ran at, so an update taken at moved weights is still explained.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..objectives import NextTokenLoss
from .controlled_set import Row, RowKey
from .trace import flat_grad


class Contributions:
    """Each example's correct contribution at any weights of ``thetas``, computed on
    demand with one forward and backward pass of ``reference`` (a copy of the audit's
    model) over that example alone, and kept.

    ``totals[k]``: window ``k``'s target count (after the shift, -100 excluded);
    ``by_key``: every example (:class:`Row`) by its key; ``computed``: how many
    contributions were computed (the audit's own forward passes).
    """

    def __init__(
        self,
        reference: nn.Module,
        windows: Sequence[Sequence[dict[str, Tensor]]],
        rows: Sequence[Sequence[Row]],
        thetas: Sequence[Tensor],
    ) -> None:
        self.reference, self.windows, self.thetas = reference, windows, thetas
        objective = NextTokenLoss()
        self.totals = [sum(objective.count(mb) for mb in window) for window in windows]
        self.by_key = {row.key: row for window in rows for row in window}
        self._cache: dict[tuple[RowKey, int, int], Tensor] = {}

    @property
    def computed(self) -> int:
        return len(self._cache)

    def of(self, key: RowKey, theta: int, shift: int = 1) -> Tensor:
        """Example ``key``'s loss sum over its window's targets, differentiated at weights
        ``thetas[theta]``, with position ``t`` predicting ``labels[t + shift]`` (1 is the
        next token; the audit tries 0 and 2 when the updates need them)."""
        if (key, theta, shift) not in self._cache:
            k, i, r = key
            n = self.by_key[key].tokens.numel()
            mb = self.windows[k][i]
            torch.nn.utils.vector_to_parameters(self.thetas[theta], self.reference.parameters())
            self.reference.zero_grad(set_to_none=True)
            logits = self.reference(mb["input_ids"][r : r + 1, :n]).logits[0]
            part = F.cross_entropy(
                logits[: n - shift], mb["labels"][r, shift:n], ignore_index=-100, reduction="sum"
            )
            (part / self.totals[k]).backward()
            self._cache[(key, theta, shift)] = flat_grad(list(self.reference.parameters()))
        return self._cache[(key, theta, shift)]
