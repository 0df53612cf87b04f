"""``accumlab.train`` beside the tools a user would pick instead, on the same work.

Three loops train the tiny GPT on the same shipped examples, cut into the same
microbatches and windows, from the same initial weights with the same AdamW settings and
thread count, each normalising every window by its supervised-target count:

- **hand-written**: the plain token-weighted loop of ``loop_overhead.py`` (count on the
  CPU, ``loss_sum / count`` per microbatch, one step per window);
- **accumlab**: ``accumlab.train`` with its ledger, reports and checks;
- **Accelerate**: Hugging Face Accelerate's ``accelerator.accumulate(model)`` context with
  the token-count recipe of its gradient-accumulation guide: the window's item count is
  gathered over processes before the window, each microbatch's summed loss is multiplied
  by ``gradient_accumulation_steps × num_processes / count`` (``accelerator.backward``
  divides by ``gradient_accumulation_steps`` again), and the prepared optimizer only
  steps when Accelerate says the window is complete. Building the ``Accelerator`` and
  ``prepare`` (about 0.5 ms on the 2-core machine) count inside its runs.

All three must end at the same weights (checked first; the script exits non-zero
otherwise). Then the loops run in rotating order (ABC, BCA, CAB, ...) on fresh copies of
the model, and the script prints each loop's median wall time per update attempt and the
median, min and max over rounds of the per-round ratio to the hand-written loop.

Accelerate is optional: ``pip install -e ".[peers]"`` or ``make bench-peers``.

    python benchmarks/peers.py             # 15 rounds
    python benchmarks/peers.py --quick     # 5 rounds on fewer examples, a smoke run
"""

from __future__ import annotations

import argparse
import copy
import gc
import statistics
import sys
import time
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from loop_overhead import IGNORE, Batch, hand_written, with_accumlab

from accumlab_course.data import VOCAB_SIZE, load_examples, microbatches
from accumlab_course.models import TinyGPT

Loop = Callable[[TinyGPT, Sequence[Batch], torch.optim.Optimizer, int], object]


def with_accelerate(
    model: TinyGPT, batches: Sequence[Batch], optimizer: torch.optim.Optimizer, steps: int
) -> None:
    """Accelerate's ``accumulate`` with its token-count normalisation, one window at a time."""
    from accelerate import Accelerator

    accelerator = Accelerator(gradient_accumulation_steps=steps, cpu=True)
    model, optimizer = accelerator.prepare(model, optimizer)
    for start in range(0, len(batches), steps):
        window = batches[start : start + steps]
        local = sum(int((mb["labels"][:, 1:] != IGNORE).sum()) for mb in window)
        count = int(accelerator.gather(torch.tensor([local])).sum())
        for mb in window:
            with accelerator.accumulate(model):
                logits = model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"]).logits
                loss = F.cross_entropy(
                    logits[:, :-1].reshape(-1, logits.size(-1)),
                    mb["labels"][:, 1:].reshape(-1),
                    ignore_index=IGNORE,
                    reduction="sum",
                )
                accelerator.backward(loss * steps * accelerator.num_processes / count)
                optimizer.step()  # a no-op until Accelerate's window is complete
                optimizer.zero_grad()


LOOPS: dict[str, Loop] = {
    "hand-written": hand_written,
    "accumlab": with_accumlab,
    "Accelerate": with_accelerate,
}


def run(loop: Loop, start: TinyGPT, batches: Sequence[Batch], steps: int) -> tuple[float, TinyGPT]:
    """Wall seconds of one run of ``loop`` on a fresh copy of ``start`` (copy not timed)."""
    model = copy.deepcopy(start)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    gc.collect()
    t = time.perf_counter()
    loop(model, batches, optimizer, steps)
    return time.perf_counter() - t, model


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15, help="timed rounds of all three loops")
    parser.add_argument("--examples", type=int, default=96, help="examples per run")
    parser.add_argument("--micro-batch-size", type=int, default=4, help="m, examples per microbatch")
    parser.add_argument("--accumulation-steps", type=int, default=4, help="A, microbatches per window")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    parser.add_argument("--quick", action="store_true", help="5 rounds on 32 examples (smoke run)")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.examples = 5, 32
    try:
        import accelerate
    except ImportError:
        print("Accelerate is not installed: pip install -e '.[peers]'", file=sys.stderr)
        return 2
    steps, m = args.accumulation_steps, args.micro_batch_size
    if args.examples % (m * steps):
        parser.error("--examples must be a multiple of m × A: Accelerate counts whole windows")

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    start = TinyGPT(VOCAB_SIZE)
    batches = microbatches(load_examples(limit=args.examples), m)
    windows = len(batches) // steps
    print(
        f"tiny GPT, {args.examples} examples in {len(batches)} microbatches of {m}, A={steps}: "
        f"{windows} update attempts per run; AdamW; {args.threads} thread(s); "
        f"torch {torch.__version__}, accelerate {accelerate.__version__}"
    )

    # Same work, same result, before any timing.
    finals = {name: run(loop, start, batches, steps)[1] for name, loop in LOOPS.items()}
    reference = finals["hand-written"]
    for name, model in finals.items():
        drift = max(
            float((a - b).detach().abs().max())
            for a, b in zip(model.parameters(), reference.parameters(), strict=True)
        )
        print(f"{name:>12}: max weight difference to hand-written {drift:.1e}")
        if drift > 1e-5:
            print(f"{name} ends elsewhere: the timing would compare different work", file=sys.stderr)
            return 1

    names = list(LOOPS)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(args.rounds):
        for name in names[r % 3 :] + names[: r % 3]:  # rotate who goes first
            times[name].append(run(LOOPS[name], start, batches, steps)[0] / windows)

    base = times["hand-written"]
    for name in names:
        ratios = [t / b for t, b in zip(times[name], base, strict=True)]
        print(
            f"{name:>12}: median {statistics.median(times[name]) * 1e3:.2f} ms per update; "
            f"ratio to hand-written median {statistics.median(ratios):.3f} "
            f"(min {min(ratios):.3f}, max {max(ratios):.3f}) over {args.rounds} rounds"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
