"""What ``no_sync`` saves: gradient synchronizations and wall time per update, with and
without it, for A=8 microbatches per window on two data-parallel ranks.

Two processes (gloo on CPU, nccl with two GPUs) train the same tiny GPT with DDP. Per
window, "no_sync" runs the forward and backward of microbatches 1..A-1 inside
``no_sync()`` and only the last one outside (what ``accumlab.train`` does); "sync every
microbatch" leaves ``no_sync`` out, so DDP all-reduces after every backward pass. Both
give the same gradient. The two modes alternate window by window on two models in the
same processes, after one warm-up window each; a DDP communication hook counts the
synchronizations. Printed: syncs and bucket all-reduces per update, median seconds per
update for each mode, and the median over windows of the paired ratio
(sync every microbatch / no_sync). Expected: 1 sync per update with no_sync, A without;
the time ratio is above 1 and grows with the model's size relative to its compute.

    python benchmarks/ddp_no_sync.py                 # A=8, 2 ranks, 10 windows
    python benchmarks/ddp_no_sync.py --windows 4     # a quicker run
"""

from __future__ import annotations

import argparse
import sys

from accumlab.distributed import launch
from accumlab_course import workers


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help="microbatches per window (A)")
    parser.add_argument("--windows", type=int, default=10, help="timed windows per mode")
    parser.add_argument("--n-embd", type=int, default=128, help="model width")
    parser.add_argument("--n-layer", type=int, default=2, help="transformer blocks")
    args = parser.parse_args(argv)
    results = launch(
        workers.no_sync_timing,
        2,
        (args.steps, args.windows, args.n_embd, args.n_layer),
        deadline_s=600,
    )
    r = results[0]
    print(
        f"DDP on 2 ranks, A={r['accumulation_steps']} microbatches per update, "
        f"{r['parameters']:,} parameters, {r['windows']} windows per mode (1 warm-up)"
    )
    print(f"{'mode':24s} {'syncs/update':>13s} {'all-reduces/update':>19s} {'ms/update':>10s}")
    for mode in ("no_sync", "sync every microbatch"):
        print(
            f"{mode:24s} {r['syncs_per_window'][mode]:13.1f} "
            f"{r['allreduce_calls_per_window'][mode]:19.1f} "
            f"{1000 * r['seconds_per_window'][mode]:10.1f}"
        )
    syncs = r["syncs_per_window"]
    ok = syncs["no_sync"] == 1 and syncs["sync every microbatch"] == r["accumulation_steps"]
    print(
        f"sync ratio (without / with no_sync): "
        f"{syncs['sync every microbatch'] / syncs['no_sync']:.1f}x; "
        f"wall-time ratio, median of paired windows: {r['paired_ratio']:.2f}x"
    )
    if not ok:
        print("unexpected synchronization counts", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
