"""FSDP2: traffic or memory. ``sync="window"`` against ``sync="microbatch"`` on two ranks.

Two processes (gloo on CPU, nccl with two GPUs) train the same tiny GPT under FSDP2
(``fully_shard`` on each block and the root) with ``accumlab.train``, SGD with momentum,
A microbatches per window, once with ``sync="window"`` (reduce-scatter on the last
microbatch only) and once with ``sync="microbatch"`` (reduce-scatter after every backward
pass), on the same data. Measured per rank, for each mode:

- gradient bytes held after each non-final microbatch's backward pass (the largest):
  the ``.grad`` of the model's parameters (FSDP2's DTensor shards) plus the unsharded
  gradients FSDP2 keeps between backward passes that did not reduce-scatter (read from
  FSDP2's parameter groups: torch 2.13 internals, measurement only);
- reduce-scatter calls per window (``torch.distributed``'s reduce-scatter functions,
  wrapped while training);
- the full gradient of every window and the final weights (gathered), which must agree
  within 1e-6 between the modes. (SGD, because Adam divides by ``sqrt(v) + eps``: for a
  gradient entry near zero that magnifies the last-bit differences two summation orders
  leave, and the weights would differ by more than the gradients do.)

Printed: both modes side by side, the ratios window / microbatch for bytes held and
microbatch / window for reduce-scatters. Expected: "window" holds the full gradient
(about D times the shard) and reduce-scatters once per parameter group per window;
"microbatch" holds only the shard and reduce-scatters A times as often. Wall time is not
compared here: gloo on a shared CPU says little about a GPU interconnect.

    python benchmarks/fsdp2_sync.py                  # A=4, 3 windows, 2 ranks
    python benchmarks/fsdp2_sync.py --steps 8        # more microbatches per window
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule, fully_shard

import accumlab as al
from accumlab.distributed import launch, shard
from accumlab.loop import SYNC
from accumlab_course import data, workers

TOLERANCE = 1e-6


def _nbytes(t: Tensor | None) -> int:
    if t is None:
        return 0
    if hasattr(t, "to_local"):  # a DTensor: this rank's shard
        t = t.to_local()
    return t.numel() * t.element_size()


def held_gradient_bytes(model: nn.Module) -> int:
    """Gradient bytes this rank holds now: ``.grad`` of the parameters (shards under FSDP2)
    and FSDP2's unsharded gradients kept between backward passes without a reduce-scatter."""
    total = sum(_nbytes(p.grad) for p in model.parameters())
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        group = fully_shard.state(module)._fsdp_param_group
        for fsdp_param in group.fsdp_params if group is not None else ():
            unsharded = getattr(fsdp_param, "_unsharded_param", None)
            total += _nbytes(None if unsharded is None else unsharded.grad)
            total += _nbytes(fsdp_param.unsharded_accumulated_grad)
    return total


class HeldAfterBackward:
    """A ``meter`` for ``accumlab.train``: records ``(microbatch, held_gradient_bytes)``
    after every backward pass."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.records: list[tuple[int, int]] = []

    @contextlib.contextmanager
    def phase(self, name: str, microbatch: int | None = None) -> Iterator[None]:
        yield
        if name == "backward" and microbatch is not None:
            self.records.append((microbatch, held_gradient_bytes(self.model)))


@contextlib.contextmanager
def counting_reduce_scatters(counter: list[int]) -> Iterator[None]:
    """Count calls of ``torch.distributed``'s reduce-scatter functions in ``counter[0]``
    (a call made inside another counts once)."""
    names = [n for n in ("reduce_scatter_single", "reduce_scatter_tensor") if hasattr(dist, n)]
    originals = {n: getattr(dist, n) for n in names}
    depth = [0]

    def wrapped(fn: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            counter[0] += depth[0] == 0
            depth[0] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1

        return call

    for n in names:
        setattr(dist, n, wrapped(originals[n]))
    try:
        yield
    finally:
        for n in names:
            setattr(dist, n, originals[n])


def run_mode(sync: str, steps: int, windows: int, n_embd: int, n_layer: int) -> dict[str, Any]:
    """Train ``windows`` windows with ``sync``; what this rank held, counted and ended at."""
    rank, world = dist.get_rank(), dist.get_world_size()
    micro_batch_size = 2
    examples = shard(data.load_examples(limit=micro_batch_size * steps * windows * world))
    batches = data.microbatches(examples, micro_batch_size)
    model = workers.wrap(workers.small_model(n_embd=n_embd, n_layer=n_layer), "fsdp2")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    gradients: list[list[Tensor]] = []
    optimizer.register_step_pre_hook(  # full_tensor is a collective: every rank steps
        lambda opt, args, kwargs: gradients.append(
            [p.grad.full_tensor().detach().cpu() for p in model.parameters()]
        )
    )
    plan = al.AccumulationPlan(
        micro_batch_size=micro_batch_size, accumulation_steps=steps, data_parallel_size=world
    )
    probe = HeldAfterBackward(model)
    calls = [0]
    with counting_reduce_scatters(calls):
        ledger = al.train(
            model,
            batches,
            optimizer,
            plan,
            al.NextTokenLoss(),
            sync=sync,
            meter=probe,
            progress=False,
        )
    non_final = [b for i, b in probe.records if i < steps - 1]
    return {
        "rank": rank,
        "windows": ledger.update_attempts,
        "applied": ledger.updates_applied,
        "held_non_final": max(non_final),
        "held_after_last": max(b for i, b in probe.records if i == steps - 1),
        "reduce_scatters_per_window": calls[0] / ledger.update_attempts,
        "full_gradient_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "parameters": sum(p.numel() for p in model.parameters()),
        "gradients": gradients,
        "weights": [p.full_tensor().detach().cpu() for p in model.parameters()],
    }


def worker(steps: int, windows: int, n_embd: int, n_layer: int) -> dict[str, Any]:
    """Both modes in the same two processes, one after the other, from the same seed."""
    out = {
        sync: run_mode(sync, steps, windows, n_embd, n_layer) for sync in SYNC
    }
    a, b = out["window"].pop("weights"), out["microbatch"].pop("weights")
    out["max_weight_difference"] = max(
        float((x - y).abs().max()) for x, y in zip(a, b, strict=True)
    )
    ga, gb = out["window"].pop("gradients"), out["microbatch"].pop("gradients")
    pairs = [(x, y) for wa, wb in zip(ga, gb, strict=True) for x, y in zip(wa, wb, strict=True)]
    out["max_gradient_difference"] = max(float((x - y).abs().max()) for x, y in pairs)
    out["max_gradient"] = max(float(x.abs().max()) for x, _ in pairs)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4, help="microbatches per window (A)")
    parser.add_argument("--windows", type=int, default=3, help="windows per mode")
    parser.add_argument("--n-embd", type=int, default=64, help="model width")
    parser.add_argument("--n-layer", type=int, default=2, help="transformer blocks")
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error("--steps must be at least 2: a window needs a non-final microbatch")
    ranks = launch(worker, 2, (args.steps, args.windows, args.n_embd, args.n_layer), deadline_s=600)
    w0, m0 = ranks[0]["window"], ranks[0]["microbatch"]
    print(
        f"FSDP2 on 2 ranks, A={args.steps} microbatches per window, {w0['windows']} windows, "
        f"{w0['parameters']:,} parameters ({w0['full_gradient_bytes'] / 2**20:.2f} MiB of "
        "full fp32 gradient)"
    )
    print(
        f"{'sync':12s} {'rank':>4s} {'held mid-window (MiB)':>22s} "
        f"{'held after last (MiB)':>22s} {'reduce-scatters/window':>23s}"
    )
    for sync in SYNC:
        for r in ranks:
            s = r[sync]
            print(
                f"{sync:12s} {s['rank']:4d} {s['held_non_final'] / 2**20:22.3f} "
                f"{s['held_after_last'] / 2**20:22.3f} {s['reduce_scatters_per_window']:23.1f}"
            )
    held = max(r["window"]["held_non_final"] / r["microbatch"]["held_non_final"] for r in ranks)
    calls = m0["reduce_scatters_per_window"] / w0["reduce_scatters_per_window"]
    diff = max(r["max_weight_difference"] for r in ranks)
    grad_diff = max(r["max_gradient_difference"] for r in ranks)
    print(
        f"gradient bytes held mid-window, window / microbatch: {held:.2f}x; "
        f"reduce-scatters per window, microbatch / window: {calls:.1f}x"
    )
    print(
        f"largest difference between the modes: gradient {grad_diff:.2e} (largest entry "
        f"{ranks[0]['max_gradient']:.2e}), final weights {diff:.2e} (tolerance {TOLERANCE:g})"
    )
    applied = all(
        r[s]["applied"] == r[s]["windows"] for r in ranks for s in SYNC
    )
    if not max(diff, grad_diff) <= TOLERANCE or calls != args.steps or not applied:
        print(
            "the modes disagree, an update was skipped, or the reduce-scatter counts are not 1 : A",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
