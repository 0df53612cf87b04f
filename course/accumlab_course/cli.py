"""The accumlab command: check the environment, size a plan, run a small training job.

    accumlab env [--check]                         # versions, threads, devices (+ smoke check)
    accumlab plan --effective 64 --micro 4 --dp 2  # A for a target effective batch
    accumlab train --micro 4 --steps 8 --updates 20 --record runs/run.json
    accumlab train --updates 20 --checkpoint-dir runs/ckpt --checkpoint-every 5 --resume

Exit codes: 0 done; 1 a failed check, a file that cannot be written, a checkpoint
directory another run holds, no checkpoint this version can resume from (damaged, or of
another format), or a run that failed;
2 bad arguments, or a resume the checkpoint refuses (flags that differ from its run's,
each named); 130 interrupted. Each failure is one line on stderr, never a traceback (a bad
flag value: argparse's usage, then one line naming the flag and the values it takes).
Output never fails a run: a path is printed in a form any terminal shows (bytes that are
not UTF-8 as \\xff), and a run that finished exits 0 even when its lines cannot be
printed (a closed pipe, a full disk), saying so on stderr. docs/CLI.md says more.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import signal
import sys
import time
import warnings
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from accumlab import checkpoint, driver
from accumlab.atomic_write import (
    check_directory,
    file_kind,
    remove_empty_directories,
    write_atomically,
)
from accumlab.validate import check_positive_number

#: Where records go when ``--record`` is given without a path (relative to the current
#: directory; ignored by git in the repository).
RUNS_DIR = Path("runs")

#: What ``--record`` given alone parses to: write to :func:`default_record_path`.
AUTO_RECORD = object()

#: The largest ``--seed``: ``torch.manual_seed`` takes 0 to 2**64 - 1 as they are (and
#: -2**63 to -1 remapped onto that range, so ``--seed`` refuses those: one seed, one name).
MAX_SEED = 2**64 - 1

#: The largest count (``--micro``, ``--steps``, ``--updates``, ``--examples``,
#: ``--checkpoint-every``): the largest int64, the library's counts under data parallelism.
MAX_COUNT = 2**63 - 1

#: The largest float32 number: ``--clip`` and AdamW's steps are computed in float32.
FLOAT32_MAX = float.fromhex("0x1.fffffep+127")  # 3.4028e38

#: The largest ``--lr``: AdamW's first update computes its step size, lr / (1 - 0.9) (0.9:
#: its first beta), as a float32 number ("value cannot be converted to type float without
#: overflow" otherwise, naming no flag).
MAX_LR = 3.4e37


class CommandError(Exception):
    """A failure to report as one line with exit code 1."""


# --- output ------------------------------------------------------------------------------

#: What could not be printed since :func:`main` started (one entry per failed stream).
_lost_output: list[str] = []


def printable(text: str, stream: Any) -> str:
    """``text`` as ``stream`` can show it, so that printing it never raises: the bytes of
    a path that are not valid in the file system's encoding (which Python carries as lone
    surrogates) as ``\\xff``, and characters the stream's encoding lacks as ``\\u65e5``."""
    encoding = sys.getfilesystemencoding()
    try:
        text = text.encode(encoding, "surrogateescape").decode(encoding, "backslashreplace")
    except UnicodeError:  # a character the file system's encoding lacks: no path's
        text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    shown = getattr(stream, "encoding", None) or "utf-8"
    try:
        return text.encode(shown, "backslashreplace").decode(shown)
    except LookupError:  # a stream naming an encoding Python does not know
        return text.encode("ascii", "backslashreplace").decode("ascii")


def say(text: str, *, err: bool = False) -> None:
    """Print ``text`` on stdout (stderr with ``err``) as :func:`printable` makes it, never
    raising: a stream that fails (a closed pipe, a full disk) is noted, later lines to it
    are dropped, and :func:`main` says so on stderr once the command has ended."""
    name = "stderr" if err else "stdout"
    stream = sys.stderr if err else sys.stdout
    if any(lost.startswith(name) for lost in _lost_output):
        return
    try:
        print(printable(text, stream), file=stream, flush=True)
    except (OSError, ValueError) as exc:  # ValueError: a closed stream
        _lost_output.append(f"{name}: {exc.strerror if isinstance(exc, OSError) else exc}")


def _env(args: argparse.Namespace) -> int:
    from . import environment

    start = time.perf_counter()
    info = environment.environment()
    for key, value in info.items():
        say(f"{key:12s} {(', '.join(value) or 'none') if isinstance(value, list) else value}")
    if not args.check:
        return 0
    problems = environment.smoke_check(info)
    for problem in problems:
        say(f"accumlab: check failed: {problem}", err=True)
    if not problems:
        say(f"all checks passed in {time.perf_counter() - start:.1f} s")
    return 1 if problems else 0


def _plan(args: argparse.Namespace) -> int:
    from accumlab.plan import AccumulationPlan, describe

    say(describe(AccumulationPlan.from_effective_batch(args.effective, args.micro, args.dp)))
    return 0


# --- train --------------------------------------------------------------------------------


def default_record_path(now: datetime | None = None) -> Path:
    """``runs/train-YYYYMMDD-HHMMSS.json`` for the UTC time ``now`` (default: the present)."""
    return RUNS_DIR / f"train-{now or datetime.now(timezone.utc):%Y%m%d-%H%M%S}.json"


def prepare_record_path(path: Path, *, force: bool) -> tuple[Path, list[Path]]:
    """Check, before any training, that a record can be written at ``path``; return the
    file to write (``path``, or its target when it is a symlink: the link stays) and the
    directories created for it, outermost first (to remove again if the run fails).

    :class:`CommandError` when ``path`` is (or links to) anything but a regular file (a
    directory, a FIFO, a device: such a path is never replaced), when it exists and
    ``force`` is false, or when its directory cannot be created or take new files.
    """
    try:
        kind = file_kind(os.stat(path).st_mode)
    except (FileNotFoundError, NotADirectoryError):
        kind = "a regular file"  # absent, or a dangling symlink: its target gets the record
    except OSError as exc:  # a symlink loop, a directory we may not search, a name too long
        raise CommandError(f"cannot look up --record {path}: {exc.strerror or exc}") from exc
    if kind != "a regular file":
        kind = f"a symlink to {kind}" if path.is_symlink() else kind
        raise CommandError(f"--record {path} is {kind}, not a regular file; give a file path "
                           f"such as {RUNS_DIR / 'run.json'}")
    target = Path(os.path.realpath(path)) if path.is_symlink() else path
    if target.exists() and not force:
        raise CommandError(f"{path} already exists; pass --force to overwrite it, or choose "
                           "another --record path")
    blocker = next((p for p in target.parents if p.exists()), None)
    if blocker is not None and not blocker.is_dir():
        raise CommandError(f"cannot write the run record to {path}: {blocker} is a file, not a "
                           "directory")
    try:
        created = check_directory(target.parent)
    except OSError as exc:
        why = getattr(exc, "why", None) or exc.strerror or str(exc)
        raise CommandError(f"cannot write the run record to {path}: {why}") from exc
    return target, created


def check_record_beside_checkpoints(record: Path, checkpoint_dir: str) -> None:
    """``ValueError`` when the record and the checkpoints would take the same path: the
    record is the checkpoint directory, lies above it, or takes the name of one of its
    files (``checkpoint-*``, ``.checkpoint-*``). Another name inside it is fine."""
    rec, ckpt = Path(os.path.realpath(record)), Path(os.path.realpath(checkpoint_dir))
    why = None
    if rec == ckpt:
        why = "they are the same path"
    elif rec in ckpt.parents:
        why = "the checkpoint directory would lie inside the record file"
    elif rec.parent == ckpt and re.match(r"^\.?checkpoint-", rec.name):
        why = f"{rec.name} is a name the checkpoint directory uses for its own files"
    if why is not None:
        raise ValueError(f"--record {record} and --checkpoint-dir {checkpoint_dir} collide "
                         f"({why}); give --record a path such as {Path(checkpoint_dir) / 'run.json'} "
                         f"or {RUNS_DIR / 'run.json'}")


def _train(args: argparse.Namespace) -> int:
    from accumlab.plan import AccumulationPlan
    from accumlab.settings import TrainSettings

    plan = AccumulationPlan(args.micro, args.steps, last_window=args.last_window)
    # the library's own check of the checkpoint keywords, before anything is read or written
    TrainSettings(checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every,
                  resume=args.resume)
    record = target = None
    created: list[Path] = []  # directories made for the record: removed if the run fails
    if args.record is not None:
        if args.record is not AUTO_RECORD and not args.record.strip():
            raise ValueError("--record needs a file path such as runs/run.json, got an empty one")
        record = default_record_path() if args.record is AUTO_RECORD else Path(args.record)
        if args.checkpoint_dir:
            check_record_beside_checkpoints(record, args.checkpoint_dir)
        target, created = prepare_record_path(record, force=args.force)
    try:
        return _train_and_record(args, plan, record, target)
    except BaseException:
        remove_empty_directories(created)
        raise


def _train_and_record(args: argparse.Namespace, plan: Any, record: Path | None,
                      target: Path | None) -> int:
    import torch

    from accumlab.objectives import NextTokenLoss
    from accumlab.record import RunRecord

    from . import data
    from .models import TinyGPT

    if args.resume:
        done = checkpoint.list_checkpoints(args.checkpoint_dir)
        say(f"resuming from {checkpoint.checkpoint_path(args.checkpoint_dir, done[0])}" if done
            else f"no checkpoint in {args.checkpoint_dir} yet: starting fresh")

    torch.manual_seed(args.seed)  # the model's initialisation; the checkpoint keeps the seed
    examples = data.load_examples(limit=args.examples)
    batches = data.microbatches(examples, plan.micro_batch_size, shuffle=True, seed=args.seed)
    model = TinyGPT(data.VOCAB_SIZE)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)

    def on_update(report: Any) -> None:
        if report.index + 1 == args.updates:  # trained: only the last checkpoint is left
            _ignore_ctrl_c()

    try:
        ledger = driver.train(model, batches, optimizer, plan, NextTokenLoss(),
                              max_updates=args.updates, precision=args.precision,
                              clip_grad_norm=args.clip, progress=not args.quiet,
                              checkpoint_dir=args.checkpoint_dir,
                              checkpoint_every=args.checkpoint_every, resume=args.resume,
                              on_update=on_update)
    except checkpoint.ResumeMismatchError as exc:
        raise ValueError(resume_refused(exc, args)) from exc
    _ignore_ctrl_c()  # the run is over: Ctrl-C must not cut its record short (main restores it)

    extra = {"seed": args.seed, "learning_rate": optimizer.param_groups[0]["lr"],
             "data_examples": len(examples), "model": "TinyGPT"}
    run = RunRecord.from_run(plan, ledger, extra=extra)
    say(ledger.summary())
    say(run.to_markdown())
    if target is not None:
        text = run.to_json()
        try:
            write_atomically(target, (text + "\n").encode("utf-8"), overwrite=args.force)
        except OSError as exc:
            say(text)  # the run is not lost: its record goes to stdout instead
            why = (f"{record} appeared during training and was left alone (pass --force to "
                   "overwrite it)") if isinstance(exc, FileExistsError) else exc.strerror
            raise CommandError(f"{why}; the run record's JSON is printed above instead") from exc
        say(f"run record written to {record}")
    return 0


#: The library's name of a setting a resume compares (``checkpoint.Difference.what``) ->
#: the flag that sets it.
_FLAG_OF = {"plan.micro_batch_size": "--micro", "plan.accumulation_steps": "--steps",
            "plan.last_window": "--last-window", "seed": "--seed", "precision": "--precision",
            "optimizer.param_groups[0].lr": "--lr", "clip_grad_norm": "--clip",
            "data": "--examples"}
#: Differences that follow from another one (the effective batch from --micro or --steps,
#: the GradScaler from --precision): named only when nothing they follow from is.
_FOLLOWS = {"plan.effective_batch_size": ("plan.micro_batch_size", "plan.accumulation_steps"),
            "scaler": ("precision",)}


def _flag_value(value: Any) -> str:
    return "not given" if value is None else str(value)


def resume_refused(error: checkpoint.ResumeMismatchError, args: argparse.Namespace) -> str:
    """The line for a resume the checkpoint refused, naming each changed flag as typed,
    with the checkpoint's value and the one given now (the library's words for anything
    no flag sets)."""
    found = {d.what for d in error.differences}
    parts = []
    for difference in error.differences:
        flag = _FLAG_OF.get(difference.what)
        if any(cause in found for cause in _FOLLOWS.get(difference.what, ())):
            continue
        if flag is None:
            parts.append(difference.text)
        elif difference.what == "data":
            parts.append(f"{flag} {_flag_value(args.examples)} now, but the data is not the "
                         f"checkpoint's run's ({difference.text}); the checkpoint does not record "
                         f"{flag}: give the value that run started with")
        else:
            parts.append(f"{flag}: {_flag_value(difference.saved)} in the checkpoint, "
                         f"{_flag_value(difference.now)} now")
    if not parts:
        return str(error)
    return (f"cannot resume from the checkpoint in {args.checkpoint_dir}: the run that wrote it "
            f"had other flags: {'; '.join(parts)}. Resume with that run's flags, or start a new "
            "run in another --checkpoint-dir")


# --- the command line ---------------------------------------------------------------------


def _read_whole(text: str) -> int | float | None:
    """``text`` as ``int()`` reads it; a whole number too long for ``int()`` (Python reads
    at most 4300 digits) as ``inf`` or ``-inf``; ``None`` when it is no whole number."""
    try:
        return int(text)
    except ValueError:
        pass
    body = text.strip().replace("_", "")
    digits = body[1:] if body[:1] in ("+", "-") else body
    if digits.isdecimal() and len(digits) > 4300:
        return -math.inf if body.startswith("-") else math.inf
    return None


def _shown_argument(text: str) -> str:
    """A flag's value as an error message shows it: quoted, or described when long."""
    if len(text) <= 40:
        return repr(text)
    digits = text.strip().lstrip("+-").replace("_", "")
    if digits.isdecimal():
        return f"a number of {len(digits)} digits"
    return f"{text[:20]!r}... ({len(text)} characters)"


def _whole_number(text: str, low: int, high: int, what: str) -> int:
    """``text`` as an int in [low, high] (argparse ``type=``); anything else is a usage
    error saying what the flag takes (argparse puts the flag in front)."""
    value = _read_whole(text)
    if value is None or not low <= value <= high:
        too = "" if value is None else " (too large)" if value > high else " (too small)"
        raise argparse.ArgumentTypeError(f"must be {what}, got {_shown_argument(text)}{too}")
    return int(value)


def parse_positive_int(text: str) -> int:
    """argparse ``type=`` for a count or size: a whole number from 1 to :data:`MAX_COUNT`."""
    return _whole_number(text, 1, MAX_COUNT, "a whole number, at least 1 and at most 2**63 - 1")


def parse_seed(text: str) -> int:
    """argparse ``type=`` for a seed: a whole number from 0 to :data:`MAX_SEED`, checked
    before torch sees it (``torch.manual_seed(2**64)`` fails naming no flag)."""
    return _whole_number(text, 0, MAX_SEED, f"a whole number from 0 to {MAX_SEED} (2**64 - 1, "
                                            "the seeds torch.manual_seed takes)")


def _positive_number(text: str, largest: float, why: str) -> float:
    """``text`` as a float above 0 and at most ``largest`` (argparse ``type=``)."""
    try:
        value = check_positive_number("it", float(text))  # finite, above 0, fits float32
    except (TypeError, ValueError):
        value = math.nan
    if not value <= largest:
        raise argparse.ArgumentTypeError(
            f"must be a positive, finite number, at most {largest:.3g} ({why}), got "
            f"{_shown_argument(text)}")
    return value


def parse_lr(text: str) -> float:
    """argparse ``type=`` for ``--lr``: above 0, at most :data:`MAX_LR`."""
    return _positive_number(text, MAX_LR, "AdamW's first step, up to 10 × lr, must fit in float32")


def parse_clip(text: str) -> float:
    """argparse ``type=`` for ``--clip``: above 0, at most :data:`FLOAT32_MAX`."""
    return _positive_number(text, FLOAT32_MAX, "a float32 number, as the gradient norm it caps")


def _plain(text: str) -> str:
    """``text`` without reST markup (````x```` and ``:role:`x``` become x), for ``--help``."""
    return re.sub(r"(?::\w+:)?`+([^`]+)`+", r"\1", text)


def build_parser() -> argparse.ArgumentParser:
    from accumlab import __version__

    first, _, rest = __doc__.partition("\n")
    parser = argparse.ArgumentParser(prog="accumlab", description=_plain(first),
                                     epilog=_plain(rest.strip("\n")),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"accumlab {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    e = sub.add_parser("env", help="print versions, threads and devices")
    e.add_argument("--check", action="store_true",
                   help="also run a smoke check: one accumulation window against the full "
                        "batch on every device; exit 1 when something is wrong")
    e.set_defaults(run=_env)

    p = sub.add_parser("plan", help="accumulation steps for a target effective batch")
    p.add_argument("--effective", type=parse_positive_int, required=True, help="examples per update")
    p.add_argument("--micro", type=parse_positive_int, required=True, help="examples per microbatch (m)")
    p.add_argument("--dp", type=parse_positive_int, default=1, help="data-parallel replicas (D)")
    p.set_defaults(run=_plan)

    t = sub.add_parser("train", help="train the tiny GPT on the shipped data set")
    t.add_argument("--micro", type=parse_positive_int, default=4, help="examples per microbatch (m)")
    t.add_argument("--steps", type=parse_positive_int, default=8, help="microbatches per window (A)")
    t.add_argument("--updates", type=parse_positive_int, default=20, help="update attempts to run")
    t.add_argument("--examples", type=parse_positive_int, default=None, help="use only the first N examples")
    t.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="fp32")
    t.add_argument("--last-window", choices=["update", "drop"], default="update")
    t.add_argument("--lr", type=parse_lr, default=3e-3, help=f"AdamW learning rate (0 to {MAX_LR:.2g})")
    t.add_argument("--clip", type=parse_clip, default=None,
                   help="clip the window's gradient norm to this (positive, finite)")
    t.add_argument("--seed", type=parse_seed, default=0,
                   help=f"model initialisation and data shuffle (0 to {MAX_SEED})")
    t.add_argument("--record", nargs="?", const=AUTO_RECORD, default=None, metavar="PATH",
                   help=f"write the run record as JSON to PATH, a regular file or a symlink "
                        f"to one (alone: {RUNS_DIR}/train-YYYYMMDD-HHMMSS.json); checked "
                        "before training")
    t.add_argument("--force", action="store_true",
                   help="overwrite an existing record (through a symlink: its target)")
    t.add_argument("--quiet", action="store_true", help="no progress bar")
    t.add_argument("--checkpoint-dir", default=None, metavar="DIR",
                   help=f"write checkpoints to DIR (e.g. {RUNS_DIR}/ckpt): after every "
                        "--checkpoint-every update attempts and after the last one")
    t.add_argument("--checkpoint-every", type=parse_positive_int, default=None, metavar="N",
                   help="update attempts between checkpoints (needs --checkpoint-dir)")
    t.add_argument("--resume", action="store_true",
                   help="continue from the newest checkpoint in --checkpoint-dir (fresh start "
                        "when there is none) with the same flags as the run that wrote it; "
                        "--updates then counts the whole run")
    t.set_defaults(run=_train)
    return parser


#: The library's names for what the command calls by its flags, in its messages.
_FLAGS = [(r"\bcheckpoint_dir\b|^checkpoint directory\b", "--checkpoint-dir"),
          (r"\bcheckpoint_every\b", "--checkpoint-every"), (r"\bresume=True\b", "--resume"),
          (r"\bmax_updates=", "--updates "), (r"\bclip_grad_norm\b", "--clip")]


def _one_line(exc: BaseException | str) -> str:
    """A message on one line (its lines joined), in the command's words (its flags)."""
    if isinstance(exc, OSError) and exc.strerror:
        names = [os.fsdecode(n) for n in (exc.filename, exc.filename2) if n is not None]
        text = exc.strerror + (f": {' -> '.join(names)}" if names else "")
    else:
        text = str(exc) or type(exc).__name__
    text = " ".join(text.split())
    for pattern, flag in _FLAGS:
        text = re.sub(pattern, flag, text)
    return text


def _warning_line(message: Any, *args: Any, **kwargs: Any) -> None:
    say(f"accumlab: warning: {_one_line(str(message))}", err=True)


def _ignore_ctrl_c() -> None:
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:  # not the main thread: nothing to do there
        pass


def _interrupted(args: argparse.Namespace | None) -> str:
    """The line printed on Ctrl-C: where the run can be continued from."""
    directory = getattr(args, "checkpoint_dir", None)
    if getattr(args, "command", None) != "train":
        return "accumlab: interrupted"
    if not directory:
        return "accumlab: interrupted; no checkpoint was written (no --checkpoint-dir)"
    try:
        done = checkpoint.list_checkpoints(directory)
    except OSError as exc:
        return f"accumlab: interrupted; {exc.strerror or exc}"
    if not done:
        return f"accumlab: interrupted; no checkpoint was written to {directory} yet"
    return (f"accumlab: interrupted; the last checkpoint written is "
            f"{checkpoint.checkpoint_path(directory, done[0])}: continue with the same command "
            "and --resume")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command with ``argv`` (default: the program's arguments); returns the exit
    code. Ctrl-C is ignored from the moment a run has trained its last update attempt: it
    writes its last checkpoint and its record, and exits 0.
    Called with ``argv`` (a test, a script), Ctrl-C is handled as before once it returns;
    called as the program, it stays ignored, so that a Ctrl-C during the interpreter's
    exit (torch's clean-up) cannot end the process by the signal, with nothing said."""
    before = signal.getsignal(signal.SIGINT)
    args = None
    _lost_output.clear()
    try:
        with warnings.catch_warnings():
            warnings.showwarning = _warning_line
            args = build_parser().parse_args(argv)
            code = int(args.run(args))
        if _lost_output:
            say(f"accumlab: warning: the command finished (exit {code}), but its output could "
                f"not all be printed ({'; '.join(_lost_output)})", err=True)
        return code
    except KeyboardInterrupt:
        _ignore_ctrl_c()  # a second Ctrl-C while the line is printed: no traceback
        say(_interrupted(args), err=True)
        return 130
    except (ValueError, TypeError) as exc:
        say(f"accumlab: error: {_one_line(exc)}", err=True)
        unusable = (checkpoint.CorruptCheckpointError, checkpoint.CheckpointFormatError)
        return 1 if isinstance(exc, unusable) else 2
    except (CommandError, OSError, RuntimeError, EOFError) as exc:
        say(f"accumlab: error: {_one_line(exc)}", err=True)
        return 1
    finally:
        if argv is None:
            _ignore_ctrl_c()
        elif before is not None and signal.getsignal(signal.SIGINT) is not before:
            signal.signal(signal.SIGINT, before)


if __name__ == "__main__":
    sys.exit(main())
