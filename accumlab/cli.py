"""The ``accumlab`` command: check the environment, size a plan, run a small training job.

    accumlab env                                   # versions, threads, devices
    accumlab plan --effective 64 --micro 4 --dp 2  # A for a target effective batch
    accumlab train --micro 4 --steps 8 --updates 20 --record run.json
"""

from __future__ import annotations

import argparse
import platform
import sys
from collections.abc import Sequence
from pathlib import Path


def _env(_: argparse.Namespace) -> int:
    import torch

    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cuda": torch.cuda.is_available(),
        "gpus": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "distributed": torch.distributed.is_available(),
    }
    for key, value in info.items():
        print(f"{key:12s} {value}")
    return 0


def _plan(args: argparse.Namespace) -> int:
    from .plan import AccumulationPlan, describe

    plan = AccumulationPlan.from_effective_batch(args.effective, args.micro, args.dp)
    print(describe(plan))
    return 0


def _train(args: argparse.Namespace) -> int:
    import torch

    from .course import data
    from .course.models import TinyGPT
    from .ledger import RunRecord
    from .loop import train
    from .objectives import NextTokenLoss
    from .plan import AccumulationPlan

    torch.manual_seed(args.seed)
    plan = AccumulationPlan(args.micro, args.steps, last_window=args.last_window)
    examples = data.load_examples(limit=args.examples)
    batches = data.microbatches(examples, plan.micro_batch_size, shuffle=True, seed=args.seed)
    model = TinyGPT(data.VOCAB_SIZE)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    objective = NextTokenLoss()
    ledger = train(
        model,
        batches,
        optimizer,
        plan,
        objective,
        max_updates=args.updates,
        precision=args.precision,
        clip_grad_norm=args.clip,
        progress=not args.quiet,
    )
    record = RunRecord.from_run(plan, ledger, unit=objective.unit, precision=args.precision)
    print(ledger.summary())
    print(record.to_markdown())
    if args.record:
        Path(args.record).write_text(record.to_json() + "\n")
        print(f"run record written to {args.record}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="accumlab", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    sub.add_parser("env", help="print versions, threads and devices").set_defaults(run=_env)

    p = sub.add_parser("plan", help="accumulation steps for a target effective batch")
    p.add_argument("--effective", type=int, required=True, help="examples per update")
    p.add_argument("--micro", type=int, required=True, help="examples per microbatch (m)")
    p.add_argument("--dp", type=int, default=1, help="data-parallel replicas (D)")
    p.set_defaults(run=_plan)

    t = sub.add_parser("train", help="train the tiny GPT on the shipped data set")
    t.add_argument("--micro", type=int, default=4, help="examples per microbatch (m)")
    t.add_argument("--steps", type=int, default=8, help="microbatches per window (A)")
    t.add_argument("--updates", type=int, default=20, help="update attempts to run")
    t.add_argument("--examples", type=int, default=None, help="use only the first N examples")
    t.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="fp32")
    t.add_argument("--last-window", choices=["update", "drop"], default="update")
    t.add_argument("--lr", type=float, default=3e-3)
    t.add_argument("--clip", type=float, default=None, help="clip the window's gradient norm")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--record", default=None, help="write the run record as JSON here")
    t.add_argument("--quiet", action="store_true", help="no progress bar")
    t.set_defaults(run=_train)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.run(args))
    except (ValueError, TypeError) as exc:
        print(f"accumlab: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

