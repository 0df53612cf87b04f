"""What ``accumlab.train`` costs over a hand-written accumulation loop doing the same work.

Both loops train the tiny GPT on the same shipped examples, cut into the same
microbatches and windows, from the same initial weights with the same AdamW settings.
The hand-written loop does, per window: count the targets on the CPU
(``labels[:, 1:] != -100``) before any forward pass; for each microbatch, forward, sum the
token cross-entropies, divide by the window's target count, backward, and keep the loss
sum for the report; then at the window boundary compute the combined gradient norm, check
it is finite, ``optimizer.step()`` and ``optimizer.zero_grad()``. ``accumlab.train`` does
the same plus its bookkeeping (ledger, per-update reports, finiteness check per gradient
tensor, phase hooks, a disabled progress bar).

Paired runs in one process, alternating which loop goes first (AB, BA, AB, ...), each
run on a fresh copy of the same model, after warm-up runs of both. Printed, for wall-clock
time and for the process's CPU time: the median time of each loop and the median over
pairs of the per-pair ratio accumlab / hand-written (each ratio taken from two runs
seconds apart, so slow drifts of a shared machine hit both terms alike). With one thread
the CPU-time ratio is the steadier figure on a busy machine: time spent waiting for a
core does not count. The ratio of the two fastest runs ("best run / best run") is shown
too: on a shared machine the fastest run is the one least disturbed by others. Both loops
must end at the same weights; the script checks this and exits non-zero otherwise.
Target: median wall-time ratio ≤ 1.02.

    python benchmarks/loop_overhead.py           # 15 pairs
    python benchmarks/loop_overhead.py --quick   # 5 pairs on fewer examples, a smoke run
"""

from __future__ import annotations

import argparse
import copy
import gc
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

import accumlab as al
from accumlab_course.data import VOCAB_SIZE, load_examples, microbatches
from accumlab_course.models import TinyGPT

IGNORE = -100
Batch = dict[str, Tensor]


def hand_written(
    model: TinyGPT, batches: Sequence[Batch], optimizer: torch.optim.Optimizer, steps: int
) -> list[float]:
    """The reference loop written out by hand; returns each window's mean loss per target."""
    losses = []
    for start in range(0, len(batches), steps):
        window = batches[start : start + steps]
        total = sum(int((mb["labels"][:, 1:] != IGNORE).sum()) for mb in window)  # on CPU
        if total == 0:
            continue
        optimizer.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), dtype=torch.float64)
        for mb in window:
            logits = model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"]).logits
            part = F.cross_entropy(
                logits[:, :-1].reshape(-1, logits.size(-1)),
                mb["labels"][:, 1:].reshape(-1),
                ignore_index=IGNORE,
                reduction="sum",
            )
            (part / total).backward()
            loss_sum += part.detach().double()
            del logits, part
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        norm = float(
            torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
        )
        if math.isfinite(norm):
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss_sum) / total)
    return losses


def with_accumlab(
    model: TinyGPT, batches: Sequence[Batch], optimizer: torch.optim.Optimizer, steps: int
) -> list[float]:
    """The same run through ``accumlab.train``; returns each window's mean loss per target."""
    plan = al.AccumulationPlan(int(batches[0]["labels"].shape[0]), steps)
    ledger = al.train(model, batches, optimizer, plan, al.NextTokenLoss(), progress=False)
    return [r.loss for r in ledger.reports if r.applied]


Loop = Callable[[TinyGPT, Sequence[Batch], torch.optim.Optimizer, int], list[float]]


class Run(NamedTuple):
    wall_s: float  # wall-clock seconds
    cpu_s: float  # CPU seconds of this process (all its threads)
    model: TinyGPT
    losses: list[float]


def timed(loop: Loop, start: TinyGPT, batches: Sequence[Batch], steps: int) -> Run:
    """One run of ``loop`` on a fresh copy of ``start`` (the copy is not timed)."""
    model = copy.deepcopy(start)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    gc.collect()  # start both loops from the same heap state
    wall, cpu = time.perf_counter(), time.process_time()
    losses = loop(model, batches, optimizer, steps)
    return Run(time.perf_counter() - wall, time.process_time() - cpu, model, losses)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=15, help="timed pairs of runs")
    parser.add_argument("--examples", type=int, default=96, help="examples per run")
    parser.add_argument(
        "--micro-batch-size", type=int, default=4, help="m, examples per microbatch"
    )
    parser.add_argument(
        "--accumulation-steps", type=int, default=4, help="A, microbatches per window"
    )
    parser.add_argument("--warmup", type=int, default=2, help="untimed runs of each loop first")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    parser.add_argument("--quick", action="store_true", help="5 pairs on 32 examples (smoke run)")
    args = parser.parse_args(argv)
    if args.quick:
        args.pairs, args.examples, args.warmup = 5, 32, 1
    if args.pairs < 1 or args.examples < 1:
        parser.error("--pairs and --examples must be at least 1")

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    start = TinyGPT(VOCAB_SIZE)
    batches = microbatches(load_examples(limit=args.examples), args.micro_batch_size)
    steps = args.accumulation_steps
    windows = -(-len(batches) // steps)
    print(
        f"tiny GPT, {args.examples} examples in {len(batches)} microbatches of "
        f"{args.micro_batch_size}, A={steps}: {windows} update attempts per run; "
        f"{args.threads} thread(s), {args.pairs} pairs after {args.warmup} warm-up runs each"
    )

    # Same work, same result: both loops must reach the same weights and losses.
    _, _, ours, our_losses = timed(with_accumlab, start, batches, steps)
    _, _, theirs, their_losses = timed(hand_written, start, batches, steps)
    drift = max(
        float((a - b).detach().abs().max())
        for a, b in zip(ours.parameters(), theirs.parameters(), strict=True)
    )
    loss_gap = max(abs(a - b) for a, b in zip(our_losses, their_losses, strict=True))
    print(
        f"same result: max weight difference {drift:.1e}, max window-loss difference {loss_gap:.1e}"
    )
    if len(our_losses) != len(their_losses) or drift > 1e-5 or loss_gap > 1e-5:
        print("the two loops disagree: the timing would compare different work", file=sys.stderr)
        return 1

    for _ in range(args.warmup):
        timed(with_accumlab, start, batches, steps)
        timed(hand_written, start, batches, steps)

    ours: list[Run] = []
    theirs: list[Run] = []
    for i in range(args.pairs):
        if i % 2 == 0:
            ours.append(timed(with_accumlab, start, batches, steps))
            theirs.append(timed(hand_written, start, batches, steps))
        else:
            theirs.append(timed(hand_written, start, batches, steps))
            ours.append(timed(with_accumlab, start, batches, steps))

    for clock in ("wall_s", "cpu_s"):
        a = [getattr(r, clock) for r in ours]
        b = [getattr(r, clock) for r in theirs]
        ratios = [x / y for x, y in zip(a, b, strict=True)]
        name = "wall" if clock == "wall_s" else "CPU "
        print(
            f"{name} time: hand-written median {statistics.median(b) * 1e3:.1f} ms, accumlab "
            f"median {statistics.median(a) * 1e3:.1f} ms per run; ratio accumlab / "
            f"hand-written: median {statistics.median(ratios):.3f} over {args.pairs} pairs "
            f"(min {min(ratios):.3f}, max {max(ratios):.3f}); best run / best run "
            f"{min(a) / min(b):.3f}"
        )
    print("target: median wall-time ratio <= 1.02")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
