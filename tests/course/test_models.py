"""Tests for accumlab_course.models: shapes, causality, row independence, checkpointing."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from accumlab_course.data import VOCAB_SIZE, collate, load_examples, microbatches
from accumlab_course.models import MLP, CausalLMOutput, TinyGPT, count_parameters


def small_gpt(**kwargs: object) -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(VOCAB_SIZE, block_size=32, **kwargs)  # type: ignore[arg-type]


def random_ids(batch: int, seq: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB_SIZE, (batch, seq), generator=g)


def shifted_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over the valid targets ``labels[:, 1:] != -100``."""
    return F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1), ignore_index=-100
    )


def test_output_shape_and_type() -> None:
    model = small_gpt()
    ids = random_ids(3, 7)
    out = model(ids, attention_mask=torch.ones_like(ids))
    assert isinstance(out, CausalLMOutput)
    assert out.logits.shape == (3, 7, VOCAB_SIZE)
    assert out.logits.dtype == torch.float32


def test_same_seed_same_model() -> None:
    a, b = small_gpt(), small_gpt()
    ids = random_ids(2, 5)
    torch.testing.assert_close(a(ids).logits, b(ids).logits, rtol=0, atol=0)


def test_weights_start_small_and_tied() -> None:
    model = small_gpt()
    std = model.tok_emb.weight.std().item()
    assert 0.015 < std < 0.025
    assert model.blocks[0].attn.qkv.bias.abs().max().item() == 0.0
    assert model.lm_head.weight is model.tok_emb.weight


def test_count_parameters_counts_the_tied_weight_once() -> None:
    v, b, c, n_layer = VOCAB_SIZE, 32, 64, 2
    per_block = (
        2 * (2 * c) + (3 * c * c + 3 * c) + (c * c + c) + (4 * c * c + 4 * c) + (4 * c * c + c)
    )
    expected = v * c + b * c + n_layer * per_block + 2 * c
    assert count_parameters(small_gpt()) == expected


def test_causal_later_tokens_do_not_change_earlier_logits() -> None:
    model = small_gpt().eval()
    ids = random_ids(2, 10)
    changed = ids.clone()
    changed[:, 6:] = (changed[:, 6:] + 5) % VOCAB_SIZE
    with torch.no_grad():
        a, b = model(ids).logits, model(changed).logits
    torch.testing.assert_close(a[:, :6], b[:, :6], rtol=0, atol=1e-6)
    assert not torch.allclose(a[:, 6:], b[:, 6:])


def test_rows_are_independent_of_the_batch() -> None:
    model = small_gpt().eval()
    ids = random_ids(5, 12)
    with torch.no_grad():
        batched = model(ids).logits
        for row in range(ids.shape[0]):
            alone = model(ids[row : row + 1]).logits
            torch.testing.assert_close(alone[0], batched[row], rtol=0, atol=1e-5)


def test_right_padding_does_not_change_real_positions() -> None:
    model = small_gpt().eval()
    ids = random_ids(1, 6)
    padded = torch.cat([ids, torch.zeros(1, 4, dtype=torch.long)], dim=1)
    with torch.no_grad():
        torch.testing.assert_close(
            model(padded).logits[:, :6], model(ids).logits, rtol=0, atol=1e-5
        )


def test_batch_gradient_equals_sum_of_part_gradients() -> None:
    """Row independence in gradient form: the property accumulation relies on."""
    torch.manual_seed(0)
    model = TinyGPT(VOCAB_SIZE)
    examples = load_examples(limit=6)
    batch = collate(examples)

    def loss_sum(b: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = model(b["input_ids"]).logits
        return F.cross_entropy(
            logits[:, :-1].reshape(-1, logits.size(-1)),
            b["labels"][:, 1:].reshape(-1),
            ignore_index=-100,
            reduction="sum",
        )

    full = torch.autograd.grad(loss_sum(batch), list(model.parameters()))
    parts = [torch.zeros_like(p) for p in model.parameters()]
    for mb in microbatches(examples, 4):
        for acc, g in zip(
            parts, torch.autograd.grad(loss_sum(mb), list(model.parameters())), strict=True
        ):
            acc += g
    for f, p in zip(full, parts, strict=True):
        torch.testing.assert_close(p, f, rtol=1e-4, atol=1e-5)


def test_checkpoint_gives_the_same_gradient() -> None:
    ids = random_ids(3, 16)
    grads = []
    for flag in (False, True):
        model = small_gpt(checkpoint=flag).train()
        loss = shifted_loss(model(ids).logits, ids)
        loss.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_checkpoint_saves_fewer_tensors_for_backward() -> None:
    """Checkpointing is really in effect while training: less is kept for backward."""
    ids = random_ids(2, 16)
    saved = {}
    for flag in (False, True):
        model = small_gpt(checkpoint=flag).train()
        count = 0

        def pack(t: torch.Tensor) -> torch.Tensor:
            nonlocal count
            count += 1
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(ids)
        saved[flag] = count
    assert saved[True] < saved[False]


def test_checkpoint_with_dropout_matches_too() -> None:
    """Non-reentrant checkpointing replays the RNG, so dropout masks match."""
    ids = random_ids(2, 8)
    grads = []
    for flag in (False, True):
        model = small_gpt(checkpoint=flag, dropout=0.1).train()
        torch.manual_seed(123)
        shifted_loss(model(ids).logits, ids).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    "bad, match",
    [
        (torch.zeros(4, dtype=torch.long), "2-D"),
        (torch.zeros(1, 2, 3, dtype=torch.long), "2-D"),
        (torch.zeros(1, 4), "integer"),
        (torch.zeros(1, 33, dtype=torch.long), "block_size"),
        (torch.zeros(1, 0, dtype=torch.long), "block_size"),
        ([[1, 2, 3]], "torch.Tensor"),
    ],
)
def test_bad_input_ids_raise(bad: object, match: str) -> None:
    model = small_gpt()
    with pytest.raises(ValueError, match="input_ids") as info:
        model(bad)
    assert match in str(info.value)


def test_bad_attention_mask_shape_raises() -> None:
    model = small_gpt()
    with pytest.raises(ValueError, match="attention_mask"):
        model(random_ids(2, 5), attention_mask=torch.ones(2, 4, dtype=torch.long))


def test_bad_config_raises() -> None:
    with pytest.raises(ValueError, match="divisible"):
        TinyGPT(VOCAB_SIZE, n_embd=10, n_head=3)


def test_mlp_shapes_and_layers() -> None:
    torch.manual_seed(0)
    plain = MLP(8, 16, 3)
    assert plain(torch.randn(5, 8)).shape == (5, 3)
    assert not any(isinstance(m, torch.nn.BatchNorm1d) for m in plain.modules())
    full = MLP(8, 16, 3, batchnorm=True, dropout=0.5)
    kinds = [type(m) for m in full.net]
    assert kinds == [
        torch.nn.Linear,
        torch.nn.BatchNorm1d,
        torch.nn.ReLU,
        torch.nn.Dropout,
        torch.nn.Linear,
    ]
    assert count_parameters(plain) == 8 * 16 + 16 + 16 * 3 + 3


def test_mlp_batchnorm_couples_rows_but_plain_mlp_does_not() -> None:
    """Splitting the batch changes BatchNorm's output in training mode, not the plain MLP's."""
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(0))
    for batchnorm, coupled in ((False, False), (True, True)):
        torch.manual_seed(0)
        model = MLP(8, 16, 3, batchnorm=batchnorm).train()
        whole = model(x)
        halves = torch.cat([model(x[:4]), model(x[4:])])
        assert torch.allclose(whole, halves, atol=1e-6) is not coupled


def test_short_training_run_reduces_masked_loss() -> None:
    """TinyGPT learns something from 64 examples in 60 updates of 16 (well under 15 s)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        before, after = _train_64_examples()
    finally:
        torch.set_num_threads(threads)
    assert after < 0.7 * before, (before, after)


def _train_64_examples() -> tuple[float, float]:
    """Masked next-token loss on 64 examples before and after 60 AdamW updates of 16."""
    torch.manual_seed(0)
    examples = load_examples(limit=64)
    model = TinyGPT(VOCAB_SIZE)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    everything = collate(examples)

    def eval_loss() -> float:
        model.eval()
        with torch.no_grad():
            value = shifted_loss(model(everything["input_ids"]).logits, everything["labels"])
        model.train()
        return value.item()

    before = eval_loss()
    batches = microbatches(examples, 16, shuffle=True, seed=0)
    for update in range(60):
        batch = batches[update % len(batches)]
        logits = model(batch["input_ids"], batch["attention_mask"]).logits
        loss = shifted_loss(logits, batch["labels"])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return before, eval_loss()
