"""The ``accumlab`` command: check the environment, size a plan, run a small training job.

    accumlab env [--check]                         # versions, threads, devices (+ smoke check)
    accumlab plan --effective 64 --micro 4 --dp 2  # A for a target effective batch
    accumlab train --micro 4 --steps 8 --updates 20 --record runs/run.json
    accumlab train --updates 20 --checkpoint-dir runs/ckpt --checkpoint-every 5 --resume

Exit codes: 0 success; 1 a failed check, a file that cannot be written, a checkpoint
directory another run holds, no intact checkpoint to resume from, or a run that failed;
2 bad arguments, or settings that differ from the checkpoint's on resume; 130
interrupted (Ctrl-C, also while it starts). Each failure is one line on stderr, never a
traceback (a bad flag value: argparse's usage, then one line naming the flag and the
values it takes).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import math
import os
import pickle
import platform
import re
import signal
import stat
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from . import _startup

#: Where records go when ``--record`` is given without a path (relative to the current
#: directory; ignored by git in the repository).
RUNS_DIR = Path("runs")

#: The PyTorch release the course and its saved notebook outputs were made with.
TESTED_TORCH = "2.13"


#: What ``--record`` given alone parses to: write to :func:`default_record_path`.
AUTO_RECORD = object()


#: The file in a checkpoint directory that holds the ``train`` flags its run started with
#: (JSON, flag -> value); ``train --resume`` refuses other values for them. Only the run
#: that holds the directory's lock (``accumlab.checkpoint.lock``) writes it.
SETTINGS_FILE = "accumlab-train-settings.json"

#: Names a record must not take inside the checkpoint directory: checkpoints (final and
#: temporary) and the settings file.
_CHECKPOINT_FILE = re.compile(r"^\.?checkpoint-.*|^" + re.escape(SETTINGS_FILE) + "$")


class CommandError(Exception):
    """A failure to report as one line with exit code 1 (no traceback)."""


# --- env ----------------------------------------------------------------------------------


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def in_checkout() -> bool:
    """Whether accumlab runs from the course's repository (its Makefile beside the package),
    so `make lab` exists; a standalone install (pip, a wheel) has no Makefile."""
    return (Path(__file__).resolve().parents[1] / "Makefile").is_file()


def _install_hint(what: str) -> str:
    """How to get ``what`` (a pip requirement) here: `make lab` in a checkout, pip elsewhere."""
    return "`make lab` installs it" if in_checkout() else f"`pip install {what}` installs it"


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
        "jupyterlab": _version("jupyterlab") or f"not installed ({_install_hint('jupyterlab')})",
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
            fix = "`pip install -e .` (or `make lab`)" if in_checkout() else f"`pip install {name}`"
            problems.append(f"{name} is missing; install it with {fix}")
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


def _file_kind(mode: int) -> str:
    """What a ``stat`` mode that is not a regular file is, in words."""
    for test, kind in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):  # fmt: skip
        if test(mode):
            return kind
    return "not a regular file"


def _not_a_regular_file(path: Path) -> str | None:
    """Why ``path`` (following symlinks) cannot take a record, or ``None`` when it is a
    regular file or absent (a dangling symlink included)."""
    try:
        mode = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return None
    if stat.S_ISREG(mode):
        return None
    kind = _file_kind(mode)
    return f"a symlink to {kind}" if path.is_symlink() else kind


def prepare_record_path(path: str | os.PathLike[str], *, force: bool) -> Path:
    """Check, before any training, that a record can be written at ``path``; return the
    file to write: ``path`` itself, or the target of ``path`` when it is a symlink (the
    link stays, its target gets the record).

    Creates the parent directories and a throw-away file beside the file to write (proof
    that the directory takes new files). Raises ``ValueError`` for an empty path and
    :class:`CommandError` when ``path`` is (or links to) anything but a regular file (a
    directory, a FIFO, a device: such a path is never replaced), when it already exists
    and ``force`` is false, or when its directory cannot be created or written.
    """
    if not str(path).strip():
        raise ValueError("--record needs a file path such as runs/run.json, got an empty one")
    given = Path(path)
    kind = _not_a_regular_file(given)
    if kind is not None:
        raise CommandError(f"--record {given} is {kind}, not a regular file; give a file path "
                           f"such as {RUNS_DIR / 'run.json'}")
    target = Path(os.path.realpath(given)) if given.is_symlink() else given
    if target.exists() and not force:
        raise CommandError(f"{given} already exists; pass --force to overwrite it, or "
                           "choose another --record path")
    blocker = next((p for p in target.parents if p.exists()), None)
    if blocker is not None and not blocker.is_dir():
        raise CommandError(f"cannot write the run record to {given}: {blocker} is a file, "
                           "not a directory")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=target.parent, prefix=f".{target.name}.",
                                         suffix=".tmp"):
            pass
    except OSError as exc:
        raise CommandError(f"cannot write the run record to {given}: "
                           f"{exc.strerror or exc}") from exc
    return target


def write_atomically(path: Path, text: str, *, force: bool) -> None:
    """Write ``text`` to the regular file ``path`` so that it is either absent/old or
    complete.

    The text goes to a temporary file in the same directory, is flushed to disk, then
    renamed over ``path`` (``os.replace``, atomic on POSIX and Windows); a file replaced
    keeps its permission bits. Without ``force``, a file that appeared at ``path``
    meanwhile is left alone (:class:`CommandError`); so is anything at ``path`` that is
    not a regular file, even with ``force`` (resolve a symlink first, as
    :func:`prepare_record_path` does). The temporary file is removed on any failure.
    """
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        try:
            old = os.lstat(path).st_mode
        except FileNotFoundError:
            old = None
        if old is not None and not stat.S_ISREG(old):
            raise CommandError(f"{path} is {_file_kind(old)} now, not a regular file; it was "
                               "left alone")
        if old is not None and not force:
            raise CommandError(f"{path} appeared during training; pass --force to overwrite "
                               "it, or choose another --record path")
        if old is None:
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes it owner-only; a record is not secret
        else:
            os.chmod(tmp, stat.S_IMODE(old))
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def check_record_beside_checkpoints(record: Path, checkpoint_dir: str | os.PathLike[str]) -> None:
    """``ValueError`` when the record and the checkpoints would take the same path: the
    record is the checkpoint directory, lies above it, or takes the name of a checkpoint
    or of the settings file inside it. A record with another name inside it is fine."""
    rec = Path(os.path.realpath(record))
    ckpt = Path(os.path.realpath(checkpoint_dir))
    why = None
    if rec == ckpt:
        why = "they are the same path"
    elif rec in ckpt.parents:
        why = "the checkpoint directory would lie inside the record file"
    elif rec.parent == ckpt and _CHECKPOINT_FILE.match(rec.name):
        why = f"{rec.name} is a name the checkpoint directory uses for its own files"
    if why is not None:
        raise ValueError(f"--record {record} and --checkpoint-dir {os.fspath(checkpoint_dir)} "
                         f"collide ({why}); give --record a path such as "
                         f"{Path(os.fspath(checkpoint_dir)) / 'run.json'} or {RUNS_DIR / 'run.json'}")


def check_hyper_parameters(args: argparse.Namespace) -> None:
    """``ValueError`` naming ``--lr`` or ``--clip`` when it is not a positive, finite number."""
    for flag, value in (("--lr", args.lr), ("--clip", args.clip)):
        if value is not None and not (math.isfinite(value) and value > 0):
            raise ValueError(f"{flag} must be a positive, finite number, got {value}")


def run_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The ``train`` flags a checkpoint fixes, flag -> value: the plan (``--micro``,
    ``--steps``, ``--last-window``), the data (``--examples``, ``--seed``: the shuffle),
    ``--precision``, ``--lr`` and ``--clip``. ``--updates`` and ``--checkpoint-every``
    may change on resume."""
    return {"--micro": args.micro, "--steps": args.steps, "--last-window": args.last_window,
            "--examples": args.examples, "--seed": args.seed, "--precision": args.precision,
            "--lr": args.lr, "--clip": args.clip}  # fmt: skip


def _shown(flag: str, value: Any) -> str:
    if value is None:
        return f"{flag} {'all' if flag == '--examples' else 'none'}"
    return f"{flag} {value}"


def _settings_in_checkpoint(directory: Path) -> dict[str, Any]:
    """What the newest readable checkpoint in ``directory`` stores of :func:`run_settings`
    (for a directory written without a settings file): the plan, the precision, the
    learning rate and the clipping. Empty when no checkpoint can be read (resume itself
    then reports why)."""
    from . import checkpoint

    for attempts in checkpoint.list_checkpoints(directory):
        try:
            state = checkpoint.load_checkpoint(checkpoint.checkpoint_path(directory, attempts))
            plan = state["plan"]
            return {"--micro": plan["micro_batch_size"], "--steps": plan["accumulation_steps"],
                    "--last-window": plan["last_window"], "--precision": state["precision"],
                    "--lr": state["optimizer"]["param_groups"][0]["lr"],
                    "--clip": state["ledger"]["settings"].get("clip_grad_norm")}  # fmt: skip
        except Exception:  # a damaged or foreign file: resume reports it
            continue
    return {}


def check_resume_settings(directory: Path, settings: dict[str, Any]) -> None:
    """Refuse to resume the run in ``directory`` with flags other than its own.

    The flags come from the directory's :data:`SETTINGS_FILE` (written when the run
    started), else from what its newest checkpoint stores. Raises ``ValueError`` naming
    every flag that differs, with the value given and the run's, and the two ways out.
    """
    try:
        saved = json.loads((directory / SETTINGS_FILE).read_text(encoding="utf-8"))
        if not isinstance(saved, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError):
        saved = _settings_in_checkpoint(directory)
    changed = [flag for flag in settings if flag in saved and saved[flag] != settings[flag]]
    if changed:
        given = ", ".join(_shown(f, settings[f]) for f in changed)
        used = ", ".join(_shown(f, saved[f]) for f in changed)
        raise ValueError(
            f"cannot resume the run in --checkpoint-dir {directory} with {given}: it ran with "
            f"{used}, and a resumed run must keep them (a record would state values that were "
            f"not used). Resume with {used}, or start a new run with another --checkpoint-dir"
        )


def _train(args: argparse.Namespace) -> int:
    """``accumlab train``; the run owns its --checkpoint-dir (its lock) until it returns."""
    with contextlib.ExitStack() as owned:
        return _train_run(args, owned)


def _train_run(args: argparse.Namespace, owned: contextlib.ExitStack) -> int:
    import torch

    from . import checkpoint
    from .course import data
    from .course.models import TinyGPT
    from .driver import train
    from .objectives import NextTokenLoss
    from .plan import AccumulationPlan
    from .record import RunRecord
    from .settings import TrainSettings

    check_hyper_parameters(args)
    plan = AccumulationPlan(args.micro, args.steps, last_window=args.last_window)
    if args.checkpoint_dir is None and (args.checkpoint_every is not None or args.resume):
        raise ValueError("--checkpoint-every and --resume need --checkpoint-dir DIR (e.g. runs/ckpt)")
    TrainSettings(checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every, resume=args.resume)
    path = None
    if args.record is not None:
        path = default_record_path() if args.record is AUTO_RECORD else args.record
        if args.checkpoint_dir and str(path).strip():
            check_record_beside_checkpoints(Path(path), args.checkpoint_dir)
    if args.checkpoint_dir:  # before anything is read or written there: a second run is refused
        try:
            owned.enter_context(checkpoint.DirectoryLock(args.checkpoint_dir))
        except checkpoint.CheckpointDirectoryInUseError as exc:
            raise CommandError(str(exc).replace("checkpoint directory", "--checkpoint-dir", 1)) from exc
        except OSError as exc:
            raise CommandError(f"cannot write to --checkpoint-dir {args.checkpoint_dir}: "
                               f"{exc.strerror or exc}") from exc
    done = checkpoint.list_checkpoints(args.checkpoint_dir) if args.checkpoint_dir else []
    if done and not args.resume:
        raise ValueError(f"--checkpoint-dir {args.checkpoint_dir} already holds checkpoints; add "
                         "--resume to continue that run, or choose another directory")
    if done:
        check_resume_settings(Path(args.checkpoint_dir), run_settings(args))
    record_path = shown_path = None
    if path is not None:
        record_path, shown_path = prepare_record_path(path, force=args.force), Path(path)

    if args.checkpoint_dir:
        directory = Path(args.checkpoint_dir)
        if done:
            print(f"resuming from {checkpoint.checkpoint_path(directory, done[0])}")
        else:
            if args.resume:
                print(f"no checkpoint in {directory} yet: starting fresh")
            try:  # also proves, before training, that the directory takes files
                directory.mkdir(parents=True, exist_ok=True)
                write_atomically(directory / SETTINGS_FILE, json.dumps(run_settings(args)) + "\n",
                                 force=True)
            except OSError as exc:
                raise CommandError(f"cannot write to --checkpoint-dir {directory}: "
                                   f"{exc.strerror or exc}") from exc
    torch.manual_seed(args.seed)
    examples = data.load_examples(limit=args.examples)
    batches = data.microbatches(examples, plan.micro_batch_size, shuffle=True, seed=args.seed)
    model = TinyGPT(data.VOCAB_SIZE)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    objective = NextTokenLoss()
    attempts = {"n": 0}
    lines = getattr(args, "warning_lines", None) or WarningLines()

    def on_update(report: Any) -> None:
        attempts["n"] += 1
        lines.flush()  # resumed: what resume warned about goes out with the first update

    lines.hold()
    try:
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
            on_update=on_update,
        )
    except (RuntimeError, OSError, EOFError, pickle.UnpicklingError) as exc:
        lines.flush(_one_line(exc))
        if not (done and attempts["n"] == 0):
            raise
        raise CommandError(f"resuming from {args.checkpoint_dir} (newest checkpoint "
                           f"{checkpoint.checkpoint_path(args.checkpoint_dir, done[0]).name}) "
                           f"failed before the first update attempt: {_one_line(exc)}") from exc
    except BaseException as exc:
        lines.flush(_one_line(exc) if isinstance(exc, Exception) else "")
        raise
    lines.flush()
    # Precision, unit and the optimizer come from the ledger (train() notes what it used);
    # the learning rate is the optimizer's own after the run, the one every update used.
    extra = {"seed": args.seed, "learning_rate": optimizer.param_groups[0]["lr"],
             "data_examples": len(examples), "model": "TinyGPT"}  # fmt: skip
    record = RunRecord.from_run(plan, ledger, extra=extra)
    print(ledger.summary())
    print(record.to_markdown())
    if record_path is not None:
        text = record.to_json() + "\n"
        try:
            write_atomically(record_path, text, force=args.force)
        except (OSError, CommandError) as exc:
            print(text, end="")  # the run is not lost: its record goes to stdout instead
            raise CommandError(f"could not write the run record to {shown_path} ({exc}); "
                               "its JSON is printed above") from exc
        print(f"run record written to {shown_path}")
    return 0


def _plain(text: str) -> str:
    """``text`` without reST markup (````x```` and ``:role:`x``` become x), for ``--help``."""
    return re.sub(r"(?::\w+:)?`+([^`]+)`+", r"\1", text)


#: The largest ``--seed``: ``torch.manual_seed`` takes 0 to 2**64 - 1 as they are (and
#: -2**63 to -1 remapped onto that range, so ``--seed`` refuses those: one seed, one name).
MAX_SEED = 2**64 - 1


def _whole_number(text: str, low: int, high: int | None, what: str) -> int:
    """``text`` as an int in [low, high] (argparse ``type=``); anything else is a usage
    error naming ``what`` may be (argparse puts the flag in front)."""
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < low or (high is not None and value > high):
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
    return value


def parse_positive_int(text: str) -> int:
    """argparse ``type=`` for a count or size: a whole number, at least 1."""
    return _whole_number(text, 1, None, "a whole number, at least 1")


def parse_seed(text: str) -> int:
    """argparse ``type=`` for a seed: a whole number from 0 to :data:`MAX_SEED`, checked
    before torch sees it (``torch.manual_seed(2**64)`` fails with "Overflow when unpacking
    long long", naming no flag)."""
    return _whole_number(text, 0, MAX_SEED, f"a whole number from 0 to {MAX_SEED} (2**64 - 1, "
                                            "the seeds torch.manual_seed takes)")


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

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
    t.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (positive, finite)")
    t.add_argument("--clip", type=float, default=None,
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


def _one_line(exc: BaseException) -> str:
    """An exception's message on one line (its lines joined), or its type's name."""
    return " ".join(str(exc).split()) or type(exc).__name__


class WarningLines:
    """Shows every warning as ``accumlab: warning: <message>`` on one stderr line.

    Between :meth:`hold` and :meth:`flush` the lines wait, so that an error which already
    says what they say (e.g. "no intact checkpoint: <file> is not intact ...", after one
    warning per file skipped) is the only line printed.
    """

    def __init__(self) -> None:
        self.held: list[str] | None = None

    def show(self, message: Any, category: Any, filename: str, lineno: int, file: Any = None,
             line: Any = None) -> None:  # fmt: skip
        text = " ".join(str(message).split())
        if self.held is not None:
            self.held.append(text)
        else:
            print(f"accumlab: warning: {text}", file=sys.stderr)

    def hold(self) -> None:
        self.held = []

    def flush(self, error: str = "") -> None:
        """Print the held lines, but those whose first clause the ``error`` repeats."""
        held, self.held = self.held or [], None
        for text in held:
            if not (error and text.split("; ")[0] in error):
                print(f"accumlab: warning: {text}", file=sys.stderr)


@contextlib.contextmanager
def _one_line_warnings() -> Iterator[WarningLines]:
    lines = WarningLines()
    with warnings.catch_warnings():
        warnings.showwarning = lines.show
        yield lines


@contextlib.contextmanager
def _ignoring_sigint() -> Iterator[None]:
    """Ignore SIGINT inside the block (where the process can: in its main thread)."""
    try:
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _interrupted(args: argparse.Namespace | None) -> str:
    """The line printed on Ctrl-C: where the run can be continued from."""
    directory = getattr(args, "checkpoint_dir", None)
    if getattr(args, "command", None) != "train":
        return "accumlab: interrupted"
    if not directory:
        return "accumlab: interrupted; no checkpoint was written (no --checkpoint-dir)"
    from . import checkpoint

    done = checkpoint.list_checkpoints(directory)
    if not done:
        return f"accumlab: interrupted; no checkpoint was written to {directory} yet"
    return (f"accumlab: interrupted; the last checkpoint written is "
            f"{checkpoint.checkpoint_path(directory, done[0])}: continue with the same command "
            "and --resume")


def main(argv: Sequence[str] | None = None) -> int:
    args = None
    with _one_line_warnings() as lines:
        try:
            _startup.command_started()  # Ctrl-C now raises KeyboardInterrupt, reported below
            args = build_parser().parse_args(argv)
            args.warning_lines = lines
            return int(args.run(args))
        except KeyboardInterrupt:
            with _ignoring_sigint():  # a second Ctrl-C while the line is printed: no traceback
                print(_interrupted(args), file=sys.stderr)
            return 130
        except (ValueError, TypeError) as exc:
            print(f"accumlab: error: {_one_line(exc)}", file=sys.stderr)
            return 1 if type(exc).__name__ == "CorruptCheckpointError" else 2
        except (CommandError, OSError, RuntimeError, EOFError, pickle.UnpicklingError) as exc:
            print(f"accumlab: error: {_one_line(exc)}", file=sys.stderr)
            return 1


if __name__ == "__main__":
    sys.exit(main())
