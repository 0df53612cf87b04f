"""Small models for the course: a tiny causal GPT and an MLP.

Both are deliberately plain. ``TinyGPT`` returns an object with ``.logits`` the way
Hugging Face causal language models do, so the loss code in accumlab works the same
on it and on a real model. Every row of a batch is computed independently of the
other rows, so the gradient of a batch equals the sum of the gradients of its parts
(within floating-point tolerance) -- the property gradient accumulation relies on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint as _checkpoint


@dataclass
class CausalLMOutput:
    """What :class:`TinyGPT` returns; mimics Hugging Face's ``.logits`` attribute.

    ``logits`` has shape (batch, seq, vocab): unnormalized scores, where position
    ``t`` scores the token at position ``t + 1``.
    """

    logits: Tensor


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention in which position ``t`` sees positions ``<= t``."""

    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        self.dropout = dropout
        self.resid_drop = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        # (b, t, c) -> (b, n_head, t, head_dim)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        return self.resid_drop(self.proj(y))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: attention then a 4x-wide GELU MLP, each residual."""

    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(n_embd, 4 * n_embd),
            nn.GELU(),
            nn.Linear(4 * n_embd, n_embd),
            nn.Dropout(dropout),
        )

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TinyGPT(nn.Module):
    """A small decoder-only transformer over token ids (character level in the course).

    Token and learned position embeddings, ``n_layer`` pre-LayerNorm blocks, a final
    LayerNorm and a language-model head tied to the token embedding. Weights start
    from a normal distribution with std 0.02 (biases at zero), so a model is fully
    determined by ``torch.manual_seed`` before construction.

    Padding is expected on the right. Causal attention then never lets a real token
    attend to a padding token, so ``attention_mask`` is accepted (for Hugging Face
    call compatibility) but only checked for shape. Logits at padding positions are
    meaningless and must be ignored by the loss (labels ``-100``).

    ``checkpoint=True`` recomputes each block's activations during backward instead
    of storing them (activation checkpointing, only while training with gradients
    enabled). It trades compute for memory and leaves the gradient unchanged.
    """

    def __init__(
        self,
        vocab_size: int,
        block_size: int = 128,
        n_layer: int = 2,
        n_head: int = 2,
        n_embd: int = 64,
        dropout: float = 0.0,
        checkpoint: bool = False,
    ) -> None:
        super().__init__()
        if vocab_size < 1 or block_size < 1 or n_layer < 1 or n_head < 1:
            raise ValueError("vocab_size, block_size, n_layer and n_head must all be >= 1")
        if n_embd % n_head != 0:
            raise ValueError(f"n_embd ({n_embd}) must be divisible by n_head ({n_head})")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.checkpoint = checkpoint
        self.tok_emb = nn.Embedding(vocab_size, n_embd)
        self.pos_emb = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.apply(self._init_weights)
        self.lm_head.weight = self.tok_emb.weight  # weight tying, as in GPT-2

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> CausalLMOutput:
        """Score the next token at every position.

        ``input_ids``: integer tensor (batch, seq) with ``1 <= seq <= block_size``.
        ``attention_mask``: optional tensor of the same shape (1 = real token); ignored
        beyond the shape check, see the class docstring.
        Returns :class:`CausalLMOutput` with ``logits`` of shape (batch, seq, vocab).
        """
        if not isinstance(input_ids, Tensor):
            raise ValueError(f"input_ids must be a torch.Tensor, got {type(input_ids).__name__}")
        if input_ids.dim() != 2:
            raise ValueError(
                f"input_ids must be 2-D (batch, seq), got shape {tuple(input_ids.shape)}"
            )
        if (
            input_ids.dtype.is_floating_point
            or input_ids.dtype.is_complex
            or input_ids.dtype == torch.bool
        ):
            raise ValueError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
        seq = input_ids.shape[1]
        if not 1 <= seq <= self.block_size:
            raise ValueError(
                f"input_ids has sequence length {seq}; it must be in 1..block_size={self.block_size}"
            )
        if attention_mask is not None and attention_mask.shape != input_ids.shape:
            raise ValueError(
                f"attention_mask has shape {tuple(attention_mask.shape)}, "
                f"expected the shape of input_ids {tuple(input_ids.shape)}"
            )

        pos = torch.arange(seq, device=input_ids.device)
        x = self.drop(self.tok_emb(input_ids) + self.pos_emb(pos))
        use_checkpoint = self.checkpoint and self.training and torch.is_grad_enabled()
        for block in self.blocks:
            x = _checkpoint(block, x, use_reentrant=False) if use_checkpoint else block(x)
        return CausalLMOutput(logits=self.lm_head(self.ln_f(x)))


class MLP(nn.Module):
    """Two-layer classifier: Linear -> (BatchNorm1d) -> ReLU -> (Dropout) -> Linear.

    ``forward(x)`` maps float features (batch, in_features) to logits
    (batch, out_features).

    With ``batchnorm=True`` the model is *not* row-independent in training mode:
    BatchNorm normalizes with the statistics of the rows it is given, so the
    gradient depends on how a batch is split into microbatches and accumulated
    gradients no longer match the full batch (notebook 06 shows this). Dropout
    (``dropout > 0``) also changes results, through its random masks.
    """

    def __init__(
        self,
        in_features: int,
        hidden: int,
        out_features: int,
        batchnorm: bool = False,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        layers: list[nn.Module] = [nn.Linear(in_features, hidden)]
        if batchnorm:
            layers.append(nn.BatchNorm1d(hidden))
        layers.append(nn.ReLU())
        if dropout > 0:
            layers.append(nn.Dropout(dropout))
        layers.append(nn.Linear(hidden, out_features))
        self.net = nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        """Return logits (batch, out_features) for features ``x`` (batch, in_features)."""
        return self.net(x)


def count_parameters(model: nn.Module) -> int:
    """Number of scalar parameters in ``model``; a tied (shared) weight counts once."""
    return sum(p.numel() for p in model.parameters())
