"""Memory the next-token loss adds on top of the logits: the sliced formulation
(``logits[:, :-1]`` flattened, as ``NextTokenLoss`` did before) against the shifted-labels
one (``NextTokenLoss.loss_sum`` now), at a real vocabulary.

One forward pass of a tiny GPT whose ``lm_head`` makes logits of shape (m, T, V) =
(4, 512, 32,000), then the loss, measured with ``MemoryMeter`` (CPU: tracked tensor
storages; CUDA: allocator counters). Printed per formulation and precision, in units of
one float32 logits-sized buffer (m × T × V × 4 bytes):

- ``peak``: the loss's highest live bytes above what was live after the forward pass
  (the logits and activations), i.e. everything the loss allocates at once;
- ``kept``: what is still live once the loss returns, i.e. what it saves for backward.

Target: the new loss adds at most one float32 logits-sized buffer (the log-softmax) in
float32, none for a copy of the logits. In bf16 (autocast) the logits are half the size;
the float32 log-softmax is the one buffer the loss keeps, and on the CPU ``log_softmax``
first widens its input (a transient float32 copy made by the kernel; run with
``--device cuda`` to see what a GPU backend does).
Both formulations must give the same loss (checked, relative difference printed).

    python benchmarks/loss_memory.py                   # CPU
    python benchmarks/loss_memory.py --device cuda     # allocator counters on a GPU
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

import accumlab as al
from accumlab.memory import MemoryMeter, format_bytes
from accumlab_course.models import TinyGPT

TARGET = 1.0  # float32 logits-sized buffers the new loss may add in float32
LossFn = Callable[[Tensor, Mapping[str, Tensor]], Tensor]


def sliced_loss_sum(logits: Tensor, batch: Mapping[str, Tensor], ignore_index: int = -100) -> Tensor:
    """The former ``NextTokenLoss.loss_sum``: slice off the last position, flatten (a copy
    for m > 1), widen half logits to float32 (another copy), then cross-entropy."""
    targets = batch["labels"][:, 1:].to(logits.device)
    predictions = logits[:, :-1]
    flat = predictions.reshape(-1, predictions.size(-1))
    return F.cross_entropy(
        flat if flat.dtype == torch.float64 else flat.float(),
        targets.reshape(-1),
        ignore_index=ignore_index,
        reduction="sum",
    )


def shifted_loss_sum(logits: Tensor, batch: Mapping[str, Tensor]) -> Tensor:
    """Today's ``NextTokenLoss.loss_sum``: labels shifted, logits read in place."""
    return al.NextTokenLoss().loss_sum(logits, batch)


def measure(
    model: torch.nn.Module, batch: Mapping[str, Tensor], loss_fn: LossFn, precision: str
) -> dict[str, Any]:
    """Forward pass, then the loss: bytes above the post-forward level, and the loss."""
    device = next(model.parameters()).device
    meter = MemoryMeter(device)
    autocast = (
        torch.autocast(device.type, dtype=torch.bfloat16)
        if precision == "bf16"
        else contextlib.nullcontext()
    )
    with meter.track(), autocast:
        logits = model(input_ids=batch["input_ids"]).logits
        meter.reset()  # the peak starts again from what the forward pass left live
        after_forward = meter.live_bytes
        loss = loss_fn(logits, batch)
        peak = meter.peak_bytes - after_forward
        kept = meter.live_bytes - after_forward
    return {
        "logits_dtype": logits.dtype,
        "logits_bytes": logits.nbytes,
        "peak": peak,
        "kept": kept,
        "loss": float(loss.detach()),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--vocab", type=int, default=32_000)
    parser.add_argument("--tokens", type=int, default=512, help="sequence length T")
    parser.add_argument("--micro-batch-size", type=int, default=4, help="m")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    device = torch.device(args.device)
    m, seq, vocab = args.micro_batch_size, args.tokens, args.vocab

    # A one-layer GPT of width 8: almost all of its memory is the logits.
    torch.manual_seed(0)
    model = TinyGPT(vocab, block_size=seq, n_layer=1, n_head=1, n_embd=8).to(device)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (m, seq), generator=g)
    labels = ids.clone()
    labels[:, : seq // 8] = -100  # a masked prompt, as in instruction data
    batch = {"input_ids": ids.to(device), "labels": labels.to(device)}
    unit = m * seq * vocab * 4  # one float32 logits-sized buffer

    print(f"logits (m, T, V) = ({m}, {seq}, {vocab}) on {device}; "
          f"one float32 logits buffer = {format_bytes(unit)}")
    print(f"{'precision':<10}{'formulation':<14}{'logits':>10}{'peak':>8}{'kept':>8}   (× float32 logits)")
    ok = True
    for precision in ("fp32", "bf16"):
        rows = {
            name: measure(model, batch, fn, precision)
            for name, fn in (("sliced (old)", sliced_loss_sum), ("shifted (new)", shifted_loss_sum))
        }
        for name, row in rows.items():
            print(
                f"{precision:<10}{name:<14}{str(row['logits_dtype']).replace('torch.', ''):>10}"
                f"{row['peak'] / unit:>8.2f}{row['kept'] / unit:>8.2f}"
            )
        old, new = rows["sliced (old)"], rows["shifted (new)"]
        difference = abs(new["loss"] - old["loss"]) / abs(old["loss"])
        print(f"{'':<10}new/old peak {new['peak'] / old['peak']:.2f}; "
              f"loss {new['loss']:.6g} vs {old['loss']:.6g} (relative difference {difference:.1e})")
        ok &= difference <= 1e-6
        if precision == "fp32":
            met = new["peak"] <= TARGET * unit * 1.01  # labels and the target column are tiny
            ok &= met
            print(f"{'':<10}target: new fp32 peak <= {TARGET:.1f} float32 logits buffer: "
                  f"{'met' if met else 'NOT met'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
