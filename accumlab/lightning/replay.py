"""A Lightning window run again at another split: the engine's ``run``.

The callback holds the first window's microbatches as Lightning gave them to
``training_step`` (cloned). :class:`Replay` cuts them into rows and joins the rows of each
microbatch of a split (:func:`accumlab.invariance.join_rows`), sets
``trainer.accumulate_grad_batches`` to the split's ``A`` (a module may read it), and runs
what Lightning's automatic optimization runs per microbatch: the strategy's
``training_step`` (under the precision plugin's context), the loss it returns divided by
``accumulate_grad_batches``, and the module's ``backward``. Callback hooks around the
backward pass (``on_before_backward``, ``on_after_backward``) are not called: the replay
must not reach other callbacks. ``self.log`` is silenced while it runs. Every run starts
from the random state the window started from (:class:`accumlab.invariance.ModelState`).

:func:`hf_causal_lm` finds a Hugging Face causal LM inside the module, and
:meth:`Replay.returns_hf_loss` whether ``training_step`` returns its ``.loss``: then
:meth:`Replay.token_mean` is the engine's ``objective``, the window's token mean
(:class:`accumlab.NextTokenLoss` over the window's targets after the shift).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from ..invariance import (
    CannotJoin,
    Gradient,
    ModelState,
    NotChecked,
    Split,
    join_rows,
    rows_in,
    take_rows,
)
from ..objectives import NextTokenLoss


def hf_causal_lm(module: nn.Module) -> nn.Module | None:
    """The outermost Hugging Face causal language model inside ``module`` (None when
    transformers is not imported or there is none)."""
    transformers = sys.modules.get("transformers")
    if transformers is None:
        return None
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError:  # pragma: no cover - a transformers without the auto mapping
        return None
    names = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    for m in module.modules():
        if isinstance(m, transformers.PreTrainedModel) and type(m).__name__ in names:
            return m
    return None


def loss_of(output: Any) -> Tensor | None:
    """The loss a ``training_step`` returned: a tensor, a mapping's ``"loss"``, or None
    (Lightning skips the microbatch)."""
    if isinstance(output, Tensor):
        return output
    if isinstance(output, Mapping):
        return output.get("loss")
    return None


@contextlib.contextmanager
def _silenced_logging(module: Any) -> Iterator[None]:
    """``module.log`` and ``module.log_dict`` do nothing inside (instance attributes that
    shadow the methods, removed after)."""
    had = {k: vars(module)[k] for k in ("log", "log_dict") if k in vars(module)}
    module.log = lambda *args, **kwargs: None
    module.log_dict = lambda *args, **kwargs: None
    try:
        yield
    finally:
        for k in ("log", "log_dict"):
            vars(module).pop(k, None)
        vars(module).update(had)


class Replay:
    """``run(split)`` for the engine on a Lightning window (see the module docstring)."""

    def __init__(self, trainer: Any, module: Any, batches: list[Any], state: ModelState) -> None:
        self.trainer, self.module, self.state = trainer, module, state
        self.examples = [take_rows(b, r, r + 1) for b in batches for r in range(rows_in(b))]
        self.sizes = tuple(rows_in(b) for b in batches)
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.runs = 0

    def microbatches(self, split: Split) -> list[Any]:
        try:
            return [join_rows([self.examples[i] for i in r]) for r in split.ranges()]
        except CannotJoin as why:
            raise NotChecked(f"the window's batches cannot be split otherwise: {why}") from None

    @contextlib.contextmanager
    def _configured(self, split: Split) -> Iterator[None]:
        configured = self.trainer.accumulate_grad_batches
        self.trainer.accumulate_grad_batches = split.accumulation_steps
        try:
            with _silenced_logging(self.module), torch.enable_grad():
                yield
        finally:
            self.trainer.accumulate_grad_batches = configured

    def __call__(self, split: Split) -> Gradient:
        self.state.reset()
        microbatches = self.microbatches(split)
        with self._configured(split):
            for j, mb in enumerate(microbatches):
                loss = loss_of(self.trainer.strategy.training_step(mb, j))
                if loss is None:
                    continue  # Lightning skips a microbatch whose training_step returns None
                self.module.backward(loss / split.accumulation_steps)
        self._refuse_side_effects(split)
        self.runs += 1
        return [p.grad for p in self.params]

    def _refuse_side_effects(self, split: Split) -> None:
        drew = self.state.drew()
        if drew:
            raise NotChecked(
                f"the training_step at {split.label} drew random numbers ({', '.join(drew)} moved: "
                "dropout?), which fall differently at each split: set dropout to 0 for the check")
        if self.state.weights_written():
            raise NotChecked(f"the training_step wrote into the weights at {split.label}")

    def returns_hf_loss(self, hf: nn.Module, tolerance: float) -> tuple[bool, str]:
        """Whether ``training_step`` on the window's first microbatch returns ``hf``'s
        ``.loss`` on it (within ``tolerance``), and a sentence saying what was compared."""
        self.state.reset()
        first = self.microbatches(Split((self.sizes[0],), 1))[0]
        if not (isinstance(first, Mapping) and isinstance(first.get("labels"), Tensor)
                and isinstance(first.get("input_ids"), Tensor)
                and first["labels"].shape == first["input_ids"].shape):
            return False, "its batches hold no labels shaped like the input_ids"
        with self._configured(Split((self.sizes[0],), 1)), torch.no_grad():
            step = loss_of(self.trainer.strategy.training_step(first, 0))
            with self.trainer.precision_plugin.train_step_context():
                own = getattr(hf(**first), "loss", None)
        self.state.reset()
        if not isinstance(step, Tensor) or not isinstance(own, Tensor):
            return False, "its training_step or its model returned no loss tensor"
        a, b = float(step), float(own)
        if abs(a - b) > tolerance * max(abs(b), 1e-12):
            return False, (f"the module's loss ({a:.6g}) is not its Hugging Face model's .loss "
                           f"({b:.6g}) on the first microbatch")
        return True, f"the module returns its Hugging Face model's .loss ({type(hf).__name__})"

    def token_mean(self, hf: nn.Module) -> Any:
        """The engine's ``objective``: the token mean of ``hf`` over a split's examples."""
        objective = NextTokenLoss()

        def run(split: Split) -> Gradient:
            self.state.reset()
            microbatches = self.microbatches(split)
            total = sum(objective.count(mb) for mb in microbatches)
            if total <= 0:
                raise NotChecked("the window holds no target after the shift")
            with self._configured(split):
                for mb in microbatches:
                    with self.trainer.precision_plugin.train_step_context():
                        output = hf(**{k: v for k, v in mb.items() if k != "labels"})
                    (objective.loss_sum(output, mb) / total).backward()
            self._refuse_side_effects(split)
            return [p.grad for p in self.params]

        return run


__all__ = ["Replay", "hf_causal_lm", "loss_of"]
