"""Test-only helpers for ``ChunkedNextTokenLoss`` with a Hugging Face GPT-2, and the
worker ``accumlab.distributed.launch`` runs on two gloo ranks (imported by spawned ranks:
pytest puts ``tests/`` on ``sys.path`` and spawn copies it into each child).

The GPT-2 is built from a tiny ``GPT2Config`` (no weights are downloaded): 1 layer,
width 16, dropout off, its ``lm_head`` tied to the token embedding as in GPT-2.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

import accumlab as al

GPT2_VOCAB = 257
IGNORE = -100


def tiny_gpt2(
    seed: int = 0, vocab: int = GPT2_VOCAB, dtype: torch.dtype = torch.float32
) -> nn.Module:
    """A ``GPT2LMHeadModel`` from a tiny config (seeded): vocabulary ``vocab``, 32
    positions, 1 layer, width 16, 2 heads, no dropout (:func:`helpers.hf_models.gpt2`)."""
    from helpers.hf_models import gpt2

    return gpt2(vocab=vocab, positions=32, seed=seed, dtype=dtype, bos_token_id=0, eos_token_id=0,
                use_cache=False)


def hidden_forward(model: nn.Module, batch: Mapping[str, Tensor]) -> Tensor:
    """``forward=`` for a GPT-2: the transformer's last hidden state, no logits."""
    return model.transformer(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False
    ).last_hidden_state


class HiddenStates(nn.Module):
    """A causal LM whose ``forward`` returns its last hidden state: the module to wrap
    in DDP whole (the head's parameters included), so the wrapper sees every forward."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        return self.lm.transformer(
            input_ids=input_ids, attention_mask=attention_mask, use_cache=False
        ).last_hidden_state


def gpt2_batches(
    n: int, m: int, seed: int, vocab: int = GPT2_VOCAB, width: int = 24
) -> list[dict[str, Tensor]]:
    """``n`` right-padded microbatches of ``m`` rows: random lengths in ``[4, width]``,
    a masked prompt of 0-3 tokens, labels -100 on the prompt and the padding."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.zeros((m, width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        labels = torch.full_like(ids, IGNORE)
        for r in range(m):
            length = int(torch.randint(4, width + 1, (), generator=g))
            prompt = int(torch.randint(0, 4, (), generator=g))
            ids[r, :length] = torch.randint(1, vocab, (length,), generator=g)
            mask[r, :length] = 1
            labels[r, prompt:length] = ids[r, prompt:length]
        out.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return out


def _full(t: Tensor) -> Tensor:
    """A plain copy of a gradient, gathering an FSDP2 shard (a DTensor) into the full one."""
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


class Capture(torch.optim.Optimizer):
    """Records the full gradient each ``step`` is handed, changes nothing."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__(list(model.parameters()), {"lr": 0.0})
        self.seen: list[list[Tensor]] = []

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        self.seen.append([_full(p.grad) for p in self.param_groups[0]["params"]])


def _train_chunked(model: nn.Module, lm: nn.Module, windows: int, accumulation_steps: int,
                   m: int) -> dict[str, Any]:
    """Train the wrapped ``model`` with ``al.train`` and ``ChunkedNextTokenLoss(lm.lm_head)``
    on this rank's batches; the gradients each window handed to the optimizer and the counts."""
    rank, world = dist.get_rank(), dist.get_world_size()
    optimizer = Capture(model)
    plan = al.AccumulationPlan(m, accumulation_steps, data_parallel_size=world)
    data = gpt2_batches(windows * accumulation_steps, m, seed=rank)
    objective = al.ChunkedNextTokenLoss(lm.lm_head, chunk_size=8)
    ledger = al.train(model, data, optimizer, plan, objective, progress=False)
    return {
        "seen": optimizer.seen,
        "global_targets": [r.global_targets for r in ledger.reports],
        "replicas": ledger.reports[0].data_parallel_size,
    }


def chunked_ddp(windows: int, accumulation_steps: int, m: int) -> dict[str, Any]:
    """DDP over a GPT-2 wrapped whole (``HiddenStates``), trained by ``al.train`` with
    ``ChunkedNextTokenLoss(lm.lm_head)``; rank ``r`` trains ``gpt2_batches(..., seed=r)``.
    Returns the gradients each window handed to the optimizer and the global counts."""
    lm = tiny_gpt2()
    model = DistributedDataParallel(HiddenStates(lm))
    return _train_chunked(model, lm, windows, accumulation_steps, m)


def chunked_fsdp2(windows: int, accumulation_steps: int, m: int) -> dict[str, Any]:
    """``chunked_ddp`` under FSDP2: ``fully_shard`` on each GPT-2 block and on the root
    ``HiddenStates`` module (which holds the tied head); gradients gathered in full."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    lm = tiny_gpt2()
    model = HiddenStates(lm)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in lm.transformer.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return _train_chunked(model, lm, windows, accumulation_steps, m)
