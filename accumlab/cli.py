"""The ``accumlab`` command: check the environment, size a plan, run a small training job.

    accumlab env [--check]                         # versions, threads, devices (+ smoke check)
    accumlab plan --effective 64 --micro 4 --dp 2  # A for a target effective batch
    accumlab train --micro 4 --steps 8 --updates 20 --record runs/run.json
    accumlab train --updates 20 --checkpoint-dir runs/ckpt --checkpoint-every 5 --resume

Exit codes: 0 success, 1 a failed check or a file that cannot be written (one line on
stderr, never a traceback), 2 bad arguments.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import os
import platform
import sys
import tempfile
import time
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

#: Where records go when ``--record`` is given without a path (relative to the current
#: directory; ignored by git in the repository).
RUNS_DIR = Path("runs")

#: The PyTorch release the course and its saved notebook outputs were made with.
TESTED_TORCH = "2.13"


#: What ``--record`` given alone parses to: write to :func:`default_record_path`.
AUTO_RECORD = object()


class CommandError(Exception):
    """A failure to report as one line with exit code 1 (no traceback)."""


# --- env ----------------------------------------------------------------------------------


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment() -> dict[str, Any]:
    """Versions, CPU threads and devices, as printed by ``accumlab env``."""
    import torch

    cuda = torch.cuda.is_available()
    mps = getattr(torch.backends, "mps", None)
    return {
        "python": platform.python_version(),
        "platform": f"{platform.system()} {platform.machine()}",
        "torch": torch.__version__,
        "accumlab": _version("accumlab") or "not installed (run from a checkout)",
        "threads": torch.get_num_threads(),
        "cuda": cuda,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        if cuda
        else [],
        "mps": bool(mps is not None and mps.is_available()),
        "distributed": torch.distributed.is_available(),
        "gloo": torch.distributed.is_available() and torch.distributed.is_gloo_available(),
        "matplotlib": _version("matplotlib"),
        "ipywidgets": _version("ipywidgets"),
        "jupyterlab": _version("jupyterlab") or "not installed (`make lab` installs it)",
    }


def check_devices(info: dict[str, Any]) -> list[str]:
    """The devices the smoke check runs on: ``cpu``, then each CUDA GPU, then ``mps``."""
    devices = ["cpu"] + [f"cuda:{i}" for i in range(len(info["gpus"]))]
    return devices + (["mps"] if info["mps"] else [])


def accumulation_check(device: str, splits: Sequence[int] = (2, 1, 3)) -> tuple[float, float]:
    """One accumulation window against the full batch on ``device``.

    A 1-layer tiny GPT (seeded) on the first ``sum(splits)`` examples of the shipped data
    set: the gradient of the full batch against the one accumulated over microbatches of
    ``splits`` examples. Returns ``(max relative error, tolerance)``; the tolerance is
    1e-5 on the CPU and 1e-4 on accelerators, whose kernels may reorder float sums.
    """
    import torch

    from .checks import compare_gradients
    from .course import data
    from .course.models import TinyGPT
    from .objectives import NextTokenLoss

    examples = data.load_examples(limit=sum(splits))
    batch = {key: value.to(device) for key, value in data.collate(examples).items()}
    torch.manual_seed(0)
    model = TinyGPT(data.VOCAB_SIZE, n_layer=1, n_head=2, n_embd=32).to(device)
    comparison = compare_gradients(model, batch, NextTokenLoss(), splits=list(splits))
    return comparison.max_rel_error, (1e-5 if device == "cpu" else 1e-4)


def smoke_check(info: dict[str, Any]) -> list[str]:
    """Run the checks of ``accumlab env --check``, printing one line per check.

    Returns the problems found (empty when everything passed), each a sentence that
    says what is wrong and what to do.
    """
    problems = []
    for name in ("matplotlib", "ipywidgets"):
        if info[name] is None:
            problems.append(f"{name} is missing; reinstall with `pip install -e .` (or `make lab`)")
    if not info["gloo"]:
        problems.append("torch.distributed with gloo is unavailable; notebook 04 needs it")
    if not str(info["torch"]).startswith(TESTED_TORCH + "."):
        print(f"note: the course was made with torch {TESTED_TORCH}; other versions may print "
              "slightly different numbers")
    for device in check_devices(info):
        try:
            error, tolerance = accumulation_check(device)
        except Exception as exc:  # any failure here is the finding to report
            problems.append(f"the accumulation check on {device} raised "
                            f"{type(exc).__name__}: {exc}")
            continue
        verdict = "ok" if error <= tolerance else "FAILED"
        print(f"accumulation window on {device}: microbatches of 2+1+3 examples vs the full "
              f"batch of 6: max relative gradient error {error:.1e} (tolerance {tolerance:.0e}) "
              f"{verdict}")
        if error > tolerance:
            problems.append(f"on {device} the accumulated gradient differs from the full "
                            f"batch by {error:.1e} (relative), above {tolerance:.0e}")
    return problems


def _env(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    info = environment()
    for key, value in info.items():
        if isinstance(value, list):
            value = ", ".join(value) or "none"
        print(f"{key:12s} {value}")
    if not args.check:
        return 0
    problems = smoke_check(info)
    for problem in problems:
        print(f"accumlab: check failed: {problem}", file=sys.stderr)
    if problems:
        return 1
    print(f"all checks passed in {time.perf_counter() - start:.1f} s")
    return 0


# --- plan ---------------------------------------------------------------------------------


def _plan(args: argparse.Namespace) -> int:
    from .plan import AccumulationPlan, describe

    plan = AccumulationPlan.from_effective_batch(args.effective, args.micro, args.dp)
    print(describe(plan))
    return 0


# --- train --------------------------------------------------------------------------------


def default_record_path(now: datetime | None = None) -> Path:
    """``runs/train-YYYYMMDD-HHMMSS.json`` for the UTC time ``now`` (default: the present)."""
    now = now or datetime.now(timezone.utc)
    return RUNS_DIR / f"train-{now:%Y%m%d-%H%M%S}.json"


def prepare_record_path(path: str | os.PathLike[str], *, force: bool) -> Path:
    """Check, before any training, that a record can be written at ``path``.

    Creates the parent directories and a throw-away file beside ``path`` (proof that the
    directory takes new files). Raises ``ValueError`` for an empty path,
    :class:`CommandError` when ``path`` is a directory, already exists and ``force`` is
    false, or its directory cannot be created or written.
    """
    if not str(path).strip():
        raise ValueError("--record needs a file path such as runs/run.json, got an empty one")
    target = Path(path)
    if target.is_dir():
        raise CommandError(f"--record {target} is a directory; give a file path such as "
                           f"{target / 'run.json'}")
    if target.exists() and not force:
        raise CommandError(f"{target} already exists; pass --force to overwrite it, or "
                           "choose another --record path")
    blocker = next((p for p in target.parents if p.exists()), None)
    if blocker is not None and not blocker.is_dir():
        raise CommandError(f"cannot write the run record to {target}: {blocker} is a file, "
                           "not a directory")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=target.parent, prefix=f".{target.name}.",
                                         suffix=".tmp"):
            pass
    except OSError as exc:
        raise CommandError(f"cannot write the run record to {target}: "
                           f"{exc.strerror or exc}") from exc
    return target


def write_atomically(path: Path, text: str, *, force: bool) -> None:
    """Write ``text`` to ``path`` so that ``path`` is either absent/old or complete.

    The text goes to a temporary file in the same directory, is flushed to disk, then
    renamed over ``path`` (``os.replace``, atomic on POSIX and Windows). Without
    ``force``, a file that appeared at ``path`` meanwhile is left alone
    (:class:`CommandError`). The temporary file is removed on any failure.
    """
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes it owner-only; a record is not secret
        if path.exists() and not force:
            raise CommandError(f"{path} appeared during training; pass --force to overwrite "
                               "it, or choose another --record path")
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _train(args: argparse.Namespace) -> int:
    import torch

    from . import checkpoint
    from .course import data
    from .course.models import TinyGPT
    from .driver import train
    from .ledger import RunRecord
    from .objectives import NextTokenLoss
    from .plan import AccumulationPlan

    plan = AccumulationPlan(args.micro, args.steps, last_window=args.last_window)
    if args.checkpoint_dir is None and (args.checkpoint_every is not None or args.resume):
        raise ValueError("--checkpoint-every and --resume need --checkpoint-dir DIR (e.g. runs/ckpt)")
    checkpoint.check_arguments(args.checkpoint_dir, args.checkpoint_every, args.resume)
    if args.checkpoint_dir and not args.resume and checkpoint.list_checkpoints(args.checkpoint_dir):
        raise ValueError(f"--checkpoint-dir {args.checkpoint_dir} already holds checkpoints; add "
                         "--resume to continue that run, or choose another directory")
    record_path = None
    if args.record is not None:
        path = default_record_path() if args.record is AUTO_RECORD else args.record
        record_path = prepare_record_path(path, force=args.force)

    if args.resume:
        done = checkpoint.list_checkpoints(args.checkpoint_dir)
        print(f"resuming from {checkpoint.checkpoint_path(args.checkpoint_dir, done[0])}" if done
              else f"no checkpoint in {args.checkpoint_dir} yet: starting fresh")  # fmt: skip
    torch.manual_seed(args.seed)
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
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every,
        resume=args.resume,
    )
    # precision, unit and the optimizer come from the ledger (train() notes what it used)
    extra = {"seed": args.seed, "learning_rate": args.lr, "data_examples": len(examples),
             "model": "TinyGPT"}
    record = RunRecord.from_run(plan, ledger, extra=extra)
    print(ledger.summary())
    print(record.to_markdown())
    if record_path is not None:
        text = record.to_json() + "\n"
        try:
            write_atomically(record_path, text, force=args.force)
        except (OSError, CommandError) as exc:
            print(text, end="")  # the run is not lost: its record goes to stdout instead
            raise CommandError(f"could not write the run record to {record_path} ({exc}); "
                               "its JSON is printed above") from exc
        print(f"run record written to {record_path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="accumlab", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    e = sub.add_parser("env", help="print versions, threads and devices")
    e.add_argument("--check", action="store_true",
                   help="also run a smoke check: one accumulation window against the full "
                        "batch on every device; exit 1 when something is wrong")
    e.set_defaults(run=_env)

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
    t.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    t.add_argument("--clip", type=float, default=None, help="clip the window's gradient norm")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--record", nargs="?", const=AUTO_RECORD, default=None, metavar="PATH",
                   help=f"write the run record as JSON to PATH (alone: "
                        f"{RUNS_DIR}/train-YYYYMMDD-HHMMSS.json); checked before training")
    t.add_argument("--force", action="store_true", help="overwrite an existing record")
    t.add_argument("--quiet", action="store_true", help="no progress bar")
    t.add_argument("--checkpoint-dir", default=None, metavar="DIR",
                   help=f"write checkpoints to DIR (e.g. {RUNS_DIR}/ckpt): after every "
                        "--checkpoint-every update attempts and after the last one")
    t.add_argument("--checkpoint-every", type=int, default=None, metavar="N",
                   help="update attempts between checkpoints (needs --checkpoint-dir)")
    t.add_argument("--resume", action="store_true",
                   help="continue from the newest checkpoint in --checkpoint-dir (fresh start "
                        "when there is none); --updates then counts the whole run")
    t.set_defaults(run=_train)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.run(args))
    except (ValueError, TypeError) as exc:
        print(f"accumlab: error: {exc}", file=sys.stderr)
        return 2
    except (CommandError, OSError) as exc:
        print(f"accumlab: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
