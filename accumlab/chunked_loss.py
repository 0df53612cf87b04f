"""The next-token loss without the logits: ``ChunkedNextTokenLoss``.

At a real vocabulary the logits are the largest activation of a microbatch: ``m × T × V``
numbers (4 × 2,048 × 128k × 4 bytes = 4 GiB in float32), and a loss that materializes them
keeps them, their log-softmax and their gradient. This objective takes the last hidden
states ``[m, T, H]`` and the model's output layer instead, and works through the target
tokens a chunk at a time: for each chunk it computes the chunk's logits, its loss and, in
the same pass, the chunk's gradient with respect to the hidden states and the head's
weight and bias. Only those gradients (hidden-sized and head-sized) are kept for the
backward pass, which multiplies them by the loss's incoming gradient (the loop's factor,
the rule of ``accumlab.loop``, and the GradScaler's scale). So neither the forward nor the
backward ever holds more than one chunk of logits (in float32, and under autocast
briefly also in half precision).

It is an ``Objective`` like ``NextTokenLoss``, with the same ``count``; ``loss_sum`` is
equal to ``NextTokenLoss().loss_sum(head(hidden_states), batch)`` (up to rounding). The
loop needs nothing else: pass ``forward=`` so the model returns its last hidden state
(for a Hugging Face GPT-2: ``model.transformer(...).last_hidden_state``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .objectives import NextTokenLoss
from .validate import check_positive_int

#: Bytes of one chunk's float32 logits when ``chunk_size`` is not given, per device type:
#: 8 MiB on a CPU (65 tokens at V = 32,000, 16 at V = 128,256), where a small chunk costs
#: no speed (benchmarks/chunked_loss.py); 64 MiB elsewhere (a GPU; reasoned, not measured
#: here), since a matmul of a few dozen rows against a
#: ``[V, H]`` weight reads the whole weight for little arithmetic, and a few hundred rows
#: keep the accelerator busy (524 tokens at V = 32,000, 130 at V = 128,256). Either way
#: the extra memory is fixed, whatever the vocabulary and the microbatch.
DEFAULT_CHUNK_BYTES: dict[str, int] = {"cpu": 8 * 2**20, "other": 64 * 2**20}


def default_chunk_size(vocab_size: int, device_type: str = "cpu") -> int:
    """Tokens per chunk for a vocabulary of ``vocab_size`` on ``device_type``: a float32
    chunk of logits takes at most ``DEFAULT_CHUNK_BYTES[device]`` (at least one token)."""
    budget = DEFAULT_CHUNK_BYTES["cpu" if device_type == "cpu" else "other"]
    return max(1, budget // (4 * int(vocab_size)))


def hidden_states_of(output: Any) -> Tensor:
    """The hidden states in a model's output: a tensor, an object with
    ``.last_hidden_state`` (a Hugging Face base model's output), or a mapping holding it."""
    if isinstance(output, Tensor):
        return output
    hidden = getattr(output, "last_hidden_state", None)
    if hidden is None and isinstance(output, Mapping):
        hidden = output.get("last_hidden_state")
    if not isinstance(hidden, Tensor):
        raise TypeError(
            f"model output of type {type(output).__name__} is neither a tensor nor has a "
            "tensor .last_hidden_state; ChunkedNextTokenLoss needs the last hidden states "
            "(batch, sequence, hidden): pass forward=... returning them, e.g. "
            "lambda model, batch: model.transformer(input_ids=batch['input_ids']).last_hidden_state"
        )
    return hidden


def _compute_dtype(hidden: Tensor, weight: Tensor) -> torch.dtype:
    """The dtype of the chunk's logits: autocast's for this device type when it is on
    (float64 stays float64, as autocast leaves it), else the inputs' common dtype."""
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type) and hidden.dtype != torch.float64:
        return torch.get_autocast_dtype(device_type)
    if hidden.dtype != weight.dtype:
        raise TypeError(
            f"hidden_states are {hidden.dtype} but the head's weight is {weight.dtype}; "
            "outside autocast they must have the same dtype (as for head(hidden_states)): "
            "cast one of them, or run the forward under the precision policy's autocast"
        )
    return hidden.dtype


def _chunked_pass(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    rows: Tensor,
    targets: Tensor,
    chunk_size: int,
    needs: tuple[bool, bool, bool],
) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor | None]:
    """Summed cross-entropy of the ``rows`` of ``hidden`` ([N, H]) against ``targets``,
    a chunk of rows at a time, and (where ``needs`` asks) its gradients with respect to
    ``hidden`` ([N, H], zero on rows without a target), ``weight`` ([V, H]) and ``bias``
    ([V]). Logits in the compute dtype, softmax and sums in float32 (float64 for float64)."""
    cdt = _compute_dtype(hidden, weight)
    wide = torch.float64 if cdt == torch.float64 else torch.float32
    device_type = hidden.device.type
    need_h, need_w, need_b = needs
    grad_h = torch.zeros_like(hidden) if need_h else None
    grad_w = torch.zeros(weight.shape, dtype=wide, device=weight.device) if need_w else None
    grad_b = (
        torch.zeros(bias.shape, dtype=wide, device=bias.device)
        if need_b and bias is not None
        else None
    )
    total = torch.zeros((), dtype=wide, device=hidden.device)
    with torch.autocast(device_type, enabled=False):  # every cast below is explicit
        w = weight.to(cdt)
        b = bias.to(cdt) if bias is not None else None
        for start in range(0, rows.numel(), chunk_size):
            index = rows[start : start + chunk_size]
            total += _one_chunk(
                hidden,
                w,
                b,
                index,
                targets[start : start + chunk_size],
                wide,
                grad_h,
                grad_w,
                grad_b,
            )
    return total, grad_h, grad_w, grad_b


def _one_chunk(
    hidden: Tensor,
    w: Tensor,
    b: Tensor | None,
    index: Tensor,
    target: Tensor,
    wide: torch.dtype,
    grad_h: Tensor | None,
    grad_w: Tensor | None,
    grad_b: Tensor | None,
) -> Tensor:
    """One chunk: the summed cross-entropy of rows ``index`` of ``hidden``, its gradients
    added into ``grad_h``/``grad_w``/``grad_b`` (those that are not None). Every
    vocabulary-sized buffer is local, so it is freed before the next chunk starts."""
    h = hidden.index_select(0, index).to(w.dtype)
    z = F.linear(h, w, b).to(wide)  # (chunk, V); .to(wide) copies half-precision logits only
    picked = z.gather(1, target[:, None])
    top = z.amax(dim=1, keepdim=True)
    z.sub_(top).exp_()
    norm = z.sum(dim=1, keepdim=True)
    loss = (top + norm.log() - picked).sum()
    if grad_h is None and grad_w is None and grad_b is None:
        return loss
    # d(sum of CE)/d(logits) = softmax - one_hot(target), handed to the head's matmuls in
    # the compute dtype, as autograd does under autocast
    z.div_(norm)
    z.scatter_add_(1, target[:, None], torch.full_like(picked, -1.0))
    d = z.to(w.dtype)
    del z  # d is z itself unless the logits are half precision
    if grad_h is not None:
        grad_h.index_copy_(0, index, (d @ w).to(grad_h.dtype))
    if grad_w is not None and d.dtype == wide:
        grad_w.addmm_(d.t(), h)
    elif grad_w is not None:  # a half-precision product, summed in float32
        grad_w += (d.t() @ h).to(wide)
    if grad_b is not None:
        grad_b += d.sum(dim=0, dtype=wide)
    return loss


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Forward: the loss and its gradients, chunk by chunk. Backward: the kept gradients
    times the incoming gradient of the loss (a scalar), once."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        rows: Tensor,
        targets: Tensor,
        chunk_size: int,
    ) -> Tensor:
        needs = (
            ctx.needs_input_grad[0],
            ctx.needs_input_grad[1],
            bias is not None and ctx.needs_input_grad[2],
        )
        total, grad_h, grad_w, grad_b = _chunked_pass(
            hidden, weight, bias, rows, targets, chunk_size, needs
        )
        ctx.save_for_backward(grad_h, grad_w, grad_b)
        ctx.used = False
        ctx.dtypes = (weight.dtype, bias.dtype if bias is not None else None)
        return total

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        if torch.is_grad_enabled():  # create_graph=True: autograd records this backward
            raise RuntimeError(
                "ChunkedNextTokenLoss does not support a double backward (create_graph=True, "
                "e.g. a gradient penalty or a Hessian-vector product): its gradients are "
                "computed in the forward without a graph, so a gradient of them would be "
                "silently zero. Use NextTokenLoss on head(hidden_states) for a double "
                "backward; an ordinary backward through this loss still works"
            )
        if ctx.used:
            raise RuntimeError(
                "ChunkedNextTokenLoss: a second backward pass through the same loss "
                "(retain_graph=True); its gradients were computed in the forward and are "
                "scaled in place by the first one, so call loss_sum again instead"
            )
        ctx.used = True
        weight_dtype, bias_dtype = ctx.dtypes
        # scaled in place: no second hidden- or head-sized buffer at the backward
        grads = [None if t is None else t.mul_(grad_output.to(t.dtype)) for t in ctx.saved_tensors]
        grad_h, grad_w, grad_b = grads
        return (
            grad_h,
            grad_w.to(weight_dtype) if grad_w is not None else None,
            grad_b.to(bias_dtype) if grad_b is not None else None,
            None,
            None,
            None,
        )


class ChunkedNextTokenLoss:
    """Causal language-model cross-entropy from the last hidden states and the output
    layer, without ever holding the full logits. Counted per supervised target token.

    ``head`` is the model's output layer, an ``nn.Linear(H, V)`` (weight ``[V, H]``, bias
    optional; the weight may be tied to the input embedding). ``loss_sum(hidden_states,
    batch)`` takes the last hidden states ``[m, T, H]`` (a tensor, or an output with
    ``.last_hidden_state``) and returns the summed cross-entropy over the targets
    ``labels[:, 1:]`` that are not ``ignore_index``, in nats: a 0-d float32 tensor
    (float64 for float64 inputs), equal to ``NextTokenLoss().loss_sum(head(hidden_states),
    batch)``. ``count(batch)`` is ``NextTokenLoss``'s, so the loop's rule is unchanged.

    The targets are taken ``chunk_size`` tokens at a time (positions without a target are
    skipped); per chunk the forward computes the chunk's logits (in autocast's dtype under
    autocast, as the head would), the loss (softmax and sum in float32) and the gradients
    with respect to ``hidden_states``, the weight and the bias, and keeps only those. Extra
    memory: one chunk of logits in float32 (plus one in the compute dtype under autocast),
    one hidden-sized and one head-sized gradient. ``chunk_size=None`` takes
    ``default_chunk_size(V, device)``: a fixed number of bytes of float32 logits per chunk
    (8 MiB on a CPU, 64 MiB on a GPU) at any vocabulary.

    One backward per ``loss_sum``, and no double backward: a backward with
    ``create_graph=True`` (a gradient penalty) raises ``RuntimeError``, since the kept
    gradients have no graph; use ``NextTokenLoss`` for that.

    With data parallelism the hidden states must come out of the wrapped model's forward
    (a module whose ``forward`` returns them, wrapped whole), so the wrapper sees the
    forward of every parameter, the head's included. Under FSDP2 leave the head's weight
    to the root ``fully_shard`` (as for a tied GPT-2), whose parameters stay unsharded from
    the forward to the backward by default: the loss reads the full weight.
    """

    unit = "target"

    def __init__(
        self, head: nn.Module, chunk_size: int | None = None, ignore_index: int = -100
    ) -> None:
        if not isinstance(head, nn.Linear):
            raise TypeError(
                f"head must be the model's output layer as an nn.Linear(hidden, vocab) (e.g. "
                f"model.lm_head), got {type(head).__name__}; the chunked loss computes "
                "hidden_states @ head.weight.T + head.bias itself, so it needs a linear map"
            )
        by_vocabulary = "default_chunk_size(vocabulary size, device)"
        check_positive_int("chunk_size", chunk_size, none_means=by_vocabulary)
        self.head = head
        self.chunk_size = chunk_size
        self._tokens = NextTokenLoss(ignore_index)  # the counting, shared with NextTokenLoss
        self.ignore_index = ignore_index

    def __repr__(self) -> str:
        return (
            f"ChunkedNextTokenLoss(head=Linear({self.head.in_features}, "
            f"{self.head.out_features}), chunk_size={self.chunk_size}, "
            f"ignore_index={self.ignore_index})"
        )

    @property
    def effective_chunk_size(self) -> int:
        """Tokens per chunk: ``chunk_size``, or ``default_chunk_size(V, device)`` for the
        head's device when it is None."""
        device_type = self.head.weight.device.type
        return self.chunk_size or default_chunk_size(self.head.out_features, device_type)

    def count(self, batch: Mapping[str, Tensor]) -> int:
        """Supervised targets after the shift: ``(labels[:, 1:] != ignore_index).sum()``."""
        return self._tokens.count(batch)

    def loss_sum(self, output: Any, batch: Mapping[str, Tensor]) -> Tensor:
        """Sum of token cross-entropies over the counted targets (0-d float tensor).

        ``output``: the last hidden states ``[m, T, H]`` (or an object with
        ``.last_hidden_state``), ``H`` the head's ``in_features``. Gradients reach the
        hidden states and the head's weight and bias; a microbatch without targets gives
        a zero loss and zero gradients.
        """
        labels = self._tokens._labels(batch)
        hidden = hidden_states_of(output)
        size, vocab = self.head.in_features, self.head.out_features
        if hidden.dim() != 3 or hidden.shape[:2] != labels.shape or hidden.shape[2] != size:
            hint = (
                f"; its last dimension is the vocabulary size ({vocab}): pass the hidden "
                "states that go into the head, not the logits"
                if hidden.dim() and hidden.shape[-1] == vocab != size
                else ""
            )
            raise ValueError(
                f"hidden_states of shape {tuple(hidden.shape)} do not match labels of shape "
                f"{tuple(labels.shape)} and the head's input size {size}; expected (batch, "
                f"sequence, {size}) with the labels' batch and sequence sizes{hint}"
            )
        if not hidden.is_floating_point():
            raise TypeError(f"hidden_states must be floating point, got dtype {hidden.dtype}")
        # targets[:, t] = labels[:, t + 1]; the last position predicts nothing
        shifted = F.pad(labels[:, 1:], (0, 1), value=self.ignore_index).reshape(-1)
        rows = (shifted != self.ignore_index).nonzero().squeeze(1)
        targets = shifted[rows]
        if targets.numel() and not bool(((targets >= 0) & (targets < vocab)).all()):
            raise ValueError(
                f"labels hold target ids outside [0, {vocab}) (the head's vocabulary) that "
                f"are not ignore_index={self.ignore_index}; mask them with {self.ignore_index}"
            )
        device = hidden.device
        flat = hidden.reshape(-1, size)
        weight, bias = self.head.weight, self.head.bias
        args = (flat, weight, bias, rows.to(device), targets.to(device), self.effective_chunk_size)
        wants_grad = torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (flat, weight, bias)
        )
        if wants_grad:
            return _ChunkedCrossEntropy.apply(*args)
        return _chunked_pass(*args, needs=(False, False, False))[0]
