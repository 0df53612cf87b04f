"""Peak memory of one window: many small microbatches (m=1 × A=8) against one large one
(m=8 × A=1), same 8 examples, same update, on the tiny GPT.

Both plans run side by side on fresh copies of the same model with AdamW, each for two
windows of the same examples; the second window is measured, so the optimizer state is
part of both baselines. Printed per plan, from ``MemoryMeter`` (CPU: tracked tensor
storages; CUDA: allocator counters), in bytes:

- ``activations``: the largest bytes one forward pass saved for its backward pass;
- ``above baseline``: the window's peak minus its baseline (weights + optimizer state),
  i.e. activations, gradients and temporaries together;
- ``total``: the window's peak.

and the ratios small/large. Target: activations at m=1 at most 0.2 of those at m=8
(the ideal is 1/8 = 0.125). The total ratio is higher because weights, gradients and
optimizer state do not shrink with the microbatch.

    python benchmarks/memory_peak.py                 # CPU
    python benchmarks/memory_peak.py --device cuda   # allocator counters on a GPU
"""

from __future__ import annotations

import argparse
import copy
import sys

import torch

import accumlab as al
from accumlab.memory import MemoryMeter, format_bytes
from accumlab_course.data import VOCAB_SIZE, collate, load_examples
from accumlab_course.models import TinyGPT

TARGET = 0.2


def measure(model: torch.nn.Module, window: list[dict[str, torch.Tensor]]) -> dict[str, int]:
    """Train two windows on the same examples; return the second window's figures."""
    device = next(model.parameters()).device
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    meter = MemoryMeter(device)
    for _ in range(2):
        al.train_window(model, window, optimizer, al.NextTokenLoss(), meter=meter)
    steady = meter.windows[-1]
    return {
        "activations": max(steady.saved_bytes),
        "above baseline": steady.peak_bytes - steady.baseline_bytes,
        "total": steady.peak_bytes,
        "baseline": steady.baseline_bytes,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--examples", type=int, default=8, help="effective batch (examples)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    device = torch.device(args.device)

    # The shipped data, padded to one common length so every microbatch has the same width.
    batch = collate(load_examples(limit=args.examples))
    batch = {k: v.to(device) for k, v in batch.items()}
    n = args.examples
    plans = {
        f"m=1 × A={n}": al.split_batch(batch, [1] * n),
        f"m={n} × A=1": al.split_batch(batch, [n]),
    }
    torch.manual_seed(0)
    base = TinyGPT(VOCAB_SIZE).to(device)
    print(f"tiny GPT, {n} examples of {batch['input_ids'].shape[1]} tokens per window, {device}")
    results = {name: measure(copy.deepcopy(base), window) for name, window in plans.items()}
    small, large = results.values()
    print(f"{'':14s}" + "".join(f"{name:>18s}" for name in results) + f"{'ratio':>10s}")
    for key in ("activations", "above baseline", "total", "baseline"):
        ratio = small[key] / large[key]
        cells = "".join(f"{format_bytes(r[key]):>18s}" for r in results.values())
        print(f"{key:14s}{cells}{ratio:10.3f}")
    ratio = small["activations"] / large["activations"]
    verdict = "meets" if ratio <= TARGET else "MISSES"
    print(f"activations ratio {ratio:.3f} {verdict} the target <= {TARGET}")
    return 0 if ratio <= TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
