"""Launching ranks: run a function in N local processes, or join ``torchrun``'s group.

:func:`launch` spawns the processes (a fresh interpreter each, so it works from a
notebook cell), joins them in one process group at a free local port (gloo on CPU, nccl
with a GPU per rank), sends every rank's stdout and stderr to a log file of its own, and
re-raises the first worker's exception in the caller with the worker's traceback and the
end of its log. :func:`init_from_env` joins the group that ``torchrun`` describes, so the
same worker code runs under both.
"""

from __future__ import annotations

import io
import os
import pickle
import queue as queue_module
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..validate import check_positive_int, check_positive_number

T = TypeVar("T")

#: Seconds a rank waits in a collective before the process group gives up (a peer that
#: never calls it fails the run in seconds instead of hanging it).
DEFAULT_TIMEOUT_S = 30.0


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def default_backend(nprocs: int = 1) -> str:
    """``"nccl"`` when CUDA has at least ``nprocs`` GPUs (one per rank), else ``"gloo"``."""
    if torch.cuda.is_available() and torch.cuda.device_count() >= nprocs:
        return "nccl"
    return "gloo"


def init_from_env(backend: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> bool:
    """Join the process group ``torchrun`` describes in the environment.

    Reads ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``
    (``torchrun``/``python -m torch.distributed.run`` set them, on one machine or many).
    Under nccl, binds this process to GPU ``LOCAL_RANK``. Returns True when it joined a
    group, False when the variables are absent (a plain ``python script.py``), so a script
    can run single-process too. ``backend=None`` picks nccl when there is a GPU per local
    rank, else gloo. Does nothing (returns True) when a group is already initialised.
    """
    if dist.is_initialized():
        return True
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return False
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
    backend = backend or default_backend(local_world)
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    return True


class WorkerTraceback(Exception):
    """The formatted traceback of a worker's exception, attached as ``__cause__`` of the
    exception :func:`launch` re-raises in the caller."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return "\n" + self.text


def _dumps(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _loads(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=False)


def _pack_exception(exc: BaseException) -> tuple[bytes, str]:
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    try:
        payload = pickle.dumps(exc)
        pickle.loads(payload)  # some exceptions pickle but cannot be rebuilt
    except Exception:
        payload = pickle.dumps(RuntimeError(f"{type(exc).__name__}: {exc}"))
    return payload, text


def _worker(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    timeout_s: float,
    args: tuple[Any, ...],
    results: Any,
    log_path: str,
) -> None:
    """Body of one spawned rank: join the group, run ``fn(*args)``, send back the result.

    Everything the process writes to its stdout and stderr (prints, Python warnings, C++
    library logs) goes to ``log_path``, not to the terminal or notebook it was started
    from; :func:`launch` shows the end of it when the rank fails.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    torch.set_num_threads(1)
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
        )
        result = fn(*args)
        payload = _dumps(result)
        dist.barrier()  # nobody tears the group down while a peer still uses it
        dist.destroy_process_group()
        results.put(("ok", rank, payload))
    except BaseException as exc:  # report anything, including KeyboardInterrupt
        results.put(("error", rank, _pack_exception(exc)))
    finally:
        results.close()
        results.join_thread()  # the message is in the pipe before this process exits


def _log_tail(path: str, chars: int = 3000) -> str:
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return ""
    text = text.strip()
    return text if len(text) <= chars else "..." + text[-chars:]


def _check_importable(fn: Callable[..., Any]) -> None:
    if not callable(fn):
        raise TypeError(f"fn must be a function, got {type(fn).__name__}")
    name = getattr(fn, "__qualname__", "")
    module = getattr(fn, "__module__", None)
    main = sys.modules.get("__main__")
    in_notebook = module == "__main__" and not getattr(main, "__file__", None)
    if "<lambda>" in name or "<locals>" in name or in_notebook:
        raise ValueError(
            f"launch needs a function defined at the top level of an importable module "
            f"(such as accumlab_course.workers), got {module}.{name}: spawned processes start "
            "a fresh interpreter and cannot see lambdas, nested functions or notebook cells"
        )


def _stop(processes: Sequence[Any]) -> None:
    processes = [p for p in processes if p.pid is not None]  # started ones only
    for p in processes:
        if p.is_alive():
            p.terminate()
    for p in processes:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)


#: Seconds ``launch`` waits, after a worker reports an error, for a peer's process to show
#: that it died (killed or crashed) first: a survivor's "Connection reset by peer" is the
#: consequence of that death, not its cause.
DEATH_GRACE_S = 0.5


def _how_it_ended(exitcode: int) -> str:
    """``killed by signal SIGKILL (exit code -9)`` or ``exited with code 3``."""
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = str(-exitcode)
        return f"was killed by signal {name} (exit code {exitcode})"
    return f"exited with code {exitcode}"


def _died(processes: Sequence[Any], alive_or_reported: set[int], grace_s: float) -> int | None:
    """The first rank, not in ``alive_or_reported``, whose process ended with a nonzero exit
    code (a worker that reports an error still exits with 0), waiting up to ``grace_s``
    seconds for one to show; ``None`` if none did."""
    deadline = time.monotonic() + grace_s
    while True:
        for rank, p in enumerate(processes):
            if rank not in alive_or_reported and p.exitcode not in (None, 0):
                return rank
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.02)


def _death_error(rank: int, exitcode: int, log_path: str, after: str = "") -> RuntimeError:
    output = _log_tail(log_path) or "(no output)"
    exc = RuntimeError(
        f"launch: rank {rank} {_how_it_ended(exitcode)} before returning a result (crashed or "
        f"killed){after}. Its output:\n{output}"
    )
    exc.rank = rank  # type: ignore[attr-defined]
    return exc


def launch(
    fn: Callable[..., T],
    nprocs: int = 2,
    args: Sequence[Any] = (),
    *,
    backend: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    deadline_s: float | None = None,
) -> list[T]:
    """Run ``fn(*args)`` in ``nprocs`` local processes joined in one process group.

    Each process is spawned (a fresh interpreter, so it works from a notebook cell), sets
    one CPU thread, joins the group at ``tcp://127.0.0.1:<free port>`` with the backend
    (``None``: nccl when there is a GPU per rank, else gloo) and a process-group timeout
    of ``timeout_s`` seconds, so a rank waiting for a collective its peer never calls fails
    in seconds. ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``
    are set as ``torchrun`` sets them. ``fn`` must live in an importable module and
    return something picklable (tensors are fine). A worker's stdout and stderr go to a
    log file per rank, never to the caller's terminal or notebook: return data, do not
    print it; the end of a failed rank's log is shown with its traceback.

    Returns the results in rank order. On the first failure every worker is stopped and
    the worker's exception is re-raised here, same type, its message prefixed with
    ``rank r:``, its ``.rank`` set and the worker's traceback as ``__cause__``. A rank
    whose process died (killed by a signal, or crashed) is the failure reported, as a
    ``RuntimeError`` naming the rank and the signal or exit code, with its ``.rank`` set,
    even when a peer reported its own error first (a survivor's "Connection reset by
    peer" follows from the death; its traceback is the ``__cause__``).
    ``deadline_s`` bounds the whole run's wall time (``TimeoutError`` after stopping the
    workers); ``None`` waits for as long as the workers run.
    """
    _check_importable(fn)
    check_positive_int("nprocs", nprocs)
    check_positive_number("timeout_s", timeout_s, meaning="seconds", dtype=torch.float64)
    backend = backend or default_backend(nprocs)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    logs = tempfile.mkdtemp(prefix="accumlab-launch-")
    log_paths = [os.path.join(logs, f"rank{rank}.log") for rank in range(nprocs)]
    processes = [
        ctx.Process(
            target=_worker,
            args=(
                fn,
                rank,
                nprocs,
                port,
                backend,
                timeout_s,
                tuple(args),
                results,
                log_paths[rank],
            ),
            daemon=True,
        )
        for rank in range(nprocs)
    ]
    start = time.monotonic()
    received: dict[int, bytes] = {}
    try:
        for p in processes:
            p.start()
        silent_since: dict[int, float] = {}
        while len(received) < nprocs:
            if deadline_s is not None and time.monotonic() - start > deadline_s:
                raise TimeoutError(
                    f"launch: ranks {sorted(set(range(nprocs)) - set(received))} did not "
                    f"finish within deadline_s={deadline_s} s; the workers were stopped"
                )
            try:
                kind, rank, payload = results.get(timeout=0.1)
            except queue_module.Empty:
                now = time.monotonic()
                for rank, p in enumerate(processes):
                    if rank in received or p.exitcode is None:
                        continue
                    # a result may still be in the pipe: give it a moment before concluding
                    if now - silent_since.setdefault(rank, now) > 2.0:
                        raise _death_error(rank, p.exitcode, log_paths[rank]) from None
                continue
            if kind == "error":
                exc_payload, text = payload
                dead = _died(processes, {rank, *received}, DEATH_GRACE_S)
                if dead is not None:
                    first = (text.strip().splitlines() or ["an error"])[-1]
                    raise _death_error(
                        dead, processes[dead].exitcode, log_paths[dead],
                        f"; rank {rank} failed after it: {first}",
                    ) from WorkerTraceback(text)
                try:
                    exc = pickle.loads(exc_payload)
                except Exception:
                    exc = RuntimeError(text.strip().splitlines()[-1])
                if exc.args and isinstance(exc.args[0], str):
                    exc.args = (f"rank {rank}: {exc.args[0]}", *exc.args[1:])
                else:
                    exc.args = (f"rank {rank}", *exc.args)
                exc.rank = rank  # type: ignore[attr-defined]
                output = _log_tail(log_paths[rank])
                if output:
                    text += f"\nrank {rank}'s output (stdout and stderr):\n{output}\n"
                raise exc from WorkerTraceback(text)
            received[rank] = payload
        for p in processes:
            p.join(timeout=10)
    finally:
        _stop(processes)
        results.close()
        results.join_thread()
        shutil.rmtree(logs, ignore_errors=True)
    return [_loads(received[rank]) for rank in range(nprocs)]
