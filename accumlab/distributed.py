"""Data parallelism for the accumulation loop: launching ranks, the global denominator,
one gradient synchronization per window, ranks with uneven data, and example-ID checks.

DDP averages gradients over its ``D`` replicas. The loop wants the gradient of
``sum of all replicas' losses / all replicas' targets``, so each replica backpropagates
``loss_sum × D / global_count``: DDP's average (÷ D) then cancels the ``× D``. FSDP2
(``fully_shard``) averages in its reduce-scatter the same way.

The pieces, in the order the course meets them:

- process groups: :func:`launch` runs a function in N local processes (gloo on CPU, nccl
  on CUDA) from a script or a notebook cell; :func:`init_from_env` joins the group that
  ``torchrun`` describes, so the same worker code runs under both.
- the window: :func:`replicas_of` (``D``), :func:`global_count` (one all-reduce of the
  window's targets, counted on CPU before the forward), :func:`gradient_sync` (``no_sync``
  / ``set_requires_gradient_sync(False)`` around the forward *and* backward of all but the
  last microbatch), :class:`SyncCounter` (counts DDP's gradient all-reduces).
- uneven ranks: :func:`aligned_windows` gives every rank the same number of update
  attempts and the same number of microbatches in each, padding the short side with
  zero-target microbatches (:func:`padding_microbatch`). Every rank then meets the same
  collectives in the same order, and optimizer and scheduler state stay identical.
- bookkeeping: :func:`check_example_ids` (duplicates and omissions across ranks),
  :func:`shard` (a split without the padding of ``DistributedSampler``),
  :func:`reduce_ledger` (a ledger summed over ranks for the run record).

Padding microbatches. A padding microbatch is a copy of a real microbatch of this rank
whose targets are all ignored: for an objective with an ``ignore_index`` (``NextTokenLoss``)
it keeps the shape and sets every label to ``ignore_index``; for any other objective
(``ExampleLoss``) it keeps zero rows. Either way ``objective.count`` is 0, its
``loss_sum`` is 0 *with* a graph, so its backward adds exactly zero to every gradient
while DDP/FSDP2 see the backward they expect. Its ``example_ids`` are all
:data:`PADDING_ID` (-1), which is how the ledger (:func:`count_examples`) and the ID
checks know not to count it as examples; a real example must never have the id -1.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import queue as queue_module
import shutil
import socket
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from .ledger import Ledger
from .objectives import Objective, check_batch
from .plan import AccumulationPlan, Window

T = TypeVar("T")

#: The ``example_ids`` value of a padding row; real examples must use ids >= 0.
PADDING_ID = -1
#: Process-group timeout used by :func:`launch` and :func:`init_from_env`, in seconds:
#: short, so a rank waiting on a collective its peer never calls fails fast.
DEFAULT_TIMEOUT_S = 30.0


# --------------------------------------------------------------------------------------
# Process groups: a local launcher and torchrun
# --------------------------------------------------------------------------------------


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


def local_device() -> torch.device:
    """This rank's device: its CUDA device under nccl, the CPU otherwise."""
    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


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
            f"(such as accumlab.course.workers), got {module}.{name}: spawned processes start "
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
    ``rank r:``, its ``.rank`` set and the worker's traceback as ``__cause__``.
    ``deadline_s`` bounds the whole run's wall time (``TimeoutError`` after stopping the
    workers); ``None`` waits for as long as the workers run.
    """
    _check_importable(fn)
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"nprocs must be a positive int, got {nprocs!r}")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s!r}")
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
                        output = _log_tail(log_paths[rank]) or "(no output)"
                        raise RuntimeError(
                            f"launch: rank {rank} exited with code {p.exitcode} before "
                            f"returning a result (crashed or killed). Its output:\n{output}"
                        ) from None
                continue
            if kind == "error":
                exc_payload, text = payload
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


# --------------------------------------------------------------------------------------
# One window: replicas, the global count, gradient synchronization
# --------------------------------------------------------------------------------------


def is_distributed() -> bool:
    """True inside an initialised process group with more than one rank."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def unwrap(model: nn.Module) -> nn.Module:
    """The module under any ``torch.compile`` wrappers (``OptimizedModule._orig_mod``), so
    that ``torch.compile(DistributedDataParallel(model))`` is seen as the DDP model it is."""
    while isinstance(getattr(model, "_orig_mod", None), nn.Module):
        model = model._orig_mod
    return model


def _is_fsdp2(model: nn.Module) -> bool:
    return hasattr(unwrap(model), "set_requires_gradient_sync")


def _fsdp2_group(model: nn.Module) -> Any:
    """The process group over every rank of the device mesh given to ``fully_shard``.

    A 1-D mesh is plain FSDP; a 2-D mesh is HSDP (replicate × shard), and both of its
    dimensions hold data-parallel replicas. The mesh is read from FSDP2's state (no public
    getter in torch 2.13); without it, from the first parameter's DTensor mesh when it is
    1-D, else the whole world.
    """
    mesh = None
    try:
        from torch.distributed.fsdp import fully_shard

        mesh = fully_shard.state(unwrap(model))._fsdp_param_group.mesh_info.mesh  # type: ignore[attr-defined]
    except (AttributeError, ImportError, RuntimeError):
        first = next(iter(model.parameters()), None)
        candidate = getattr(first, "device_mesh", None)
        mesh = candidate if candidate is not None and candidate.ndim == 1 else None
    if mesh is None:
        return dist.group.WORLD
    if mesh.ndim == 1:
        return mesh.get_group()
    return mesh._flatten().get_group()  # HSDP: replicas along both dimensions


def data_parallel_group(model: nn.Module) -> Any:
    """The process group of the model's data-parallel replicas: DDP's ``process_group``,
    or the ranks of FSDP2's device mesh. ``None`` for a model that is not data parallel.

    Every data-parallel collective of the loop (the global count, rank alignment, the
    skip decision, ledger sums) runs on this group: ranks outside it that share the same
    data (tensor- or pipeline-parallel peers) must not be counted as replicas.
    """
    inner = unwrap(model)
    if isinstance(inner, DistributedDataParallel):
        return inner.process_group
    if _is_fsdp2(inner) and is_distributed():
        return _fsdp2_group(inner)
    return None


def replicas_of(model: nn.Module) -> int:
    """``D`` for this model: the size of its data-parallel group (DDP's ``process_group``,
    FSDP2's device mesh) when it is DDP- or FSDP2-wrapped, under ``torch.compile`` or not;
    else 1."""
    group = data_parallel_group(model)
    return 1 if group is None else dist.get_world_size(group)


def check_replicas(model: nn.Module, plan: AccumulationPlan | None = None) -> int:
    """Return ``D`` for ``model`` after checking it against the process group and ``plan``.

    Raises ``ValueError`` when a process group with more than one rank is active but the
    model is not wrapped (each rank would step its own copy on its own data and the
    copies drift apart), and when ``plan.data_parallel_size`` is not the model's ``D``
    (the plan's effective batch, and the run record, would be wrong).
    """
    replicas = replicas_of(model)
    if replicas == 1 and is_distributed():
        raise ValueError(
            f"the model is not wrapped in DistributedDataParallel or fully_shard, but a "
            f"process group of {dist.get_world_size()} ranks is active: each rank would "
            "update its own copy from its own data and the copies would drift apart. Wrap "
            "it (DistributedDataParallel(model) or fully_shard(model)), or run "
            "single-process code outside the process group"
        )
    if plan is not None and replicas > 1:  # first, so that every rank raises the same error
        check_plans_agree(plan, data_parallel_group(model))
    if plan is not None and plan.data_parallel_size != replicas:
        raise ValueError(
            f"plan.data_parallel_size={plan.data_parallel_size} but the model has "
            f"{replicas} data-parallel replica(s); build the plan with "
            f"data_parallel_size={replicas} (al.data_parallel_size(world_size, "
            "tensor_parallel_size=..., pipeline_parallel_size=...) for hybrid jobs)"
        )
    return replicas


def check_plans_agree(plan: AccumulationPlan, group: Any = None) -> None:
    """Raise ``ValueError`` (on every rank) naming the first field in which the ranks of
    ``group`` (``None``: the world) hold different plans. Collective: one all-gather.

    Ranks with different plans would meet different collectives (different numbers of
    microbatches per window) and fail deep inside the backend, or train on different
    effective batches; checking once, before any data is read, says which field differs.
    """
    if not is_distributed():
        return
    fields = plan.to_dict()
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, fields, group=group)
    for name in fields:
        values = [g[name] for g in gathered]
        if any(v != values[0] for v in values):
            shown = ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(values))
            raise ValueError(
                f"the ranks' plans differ in {name} ({shown}; ranks numbered within the "
                "data-parallel group); build the same AccumulationPlan on every rank"
            )


def global_count(local: int, replicas: int, device: torch.device, group: Any = None) -> int:
    """The window's unit count summed over the ``replicas`` ranks of the data-parallel
    ``group`` (``None``: the world); one all-reduce, none (``local``) when D is 1."""
    if replicas == 1:
        return local
    total = torch.tensor([local], dtype=torch.int64, device=device)
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    return int(total.item())


def any_rank(flag: bool, group: Any) -> bool:
    """True when ``flag`` is True on any rank of ``group`` (one all-reduce, MAX);
    ``flag`` itself for ``group=None`` or outside a multi-rank process group. Every rank
    of the group must call it."""
    if group is None or not is_distributed():
        return flag
    value = torch.tensor([int(flag)], dtype=torch.int64, device=_collective_device())
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return bool(value.item())


@contextlib.contextmanager
def gradient_sync(model: nn.Module, enabled: bool) -> Iterator[None]:
    """Synchronize gradients in this block only when ``enabled``.

    Wrap the forward *and* the backward of a microbatch: DDP decides at forward time
    whether the following backward will all-reduce. For a plain module this does nothing.
    """
    model = unwrap(model)
    if enabled:
        yield
    elif isinstance(model, DistributedDataParallel):
        with model.no_sync():
            yield
    elif _is_fsdp2(model):
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        yield


class SyncCounter:
    """Counts a DDP model's gradient synchronizations with a communication hook.

    ``attach(ddp_model)`` registers a hook that all-reduces (and averages) each gradient
    bucket exactly as DDP's default does, and counts: ``calls`` (bucket all-reduces) and
    ``syncs`` (backward passes that synchronized: one per sync, however many buckets).
    Attach before the model's first forward; a DDP model takes one hook.
    """

    def __init__(self) -> None:
        self.calls = 0
        self.syncs = 0
        self._group: Any = None

    def attach(self, model: DistributedDataParallel) -> SyncCounter:
        if not isinstance(model, DistributedDataParallel):
            raise TypeError(
                f"SyncCounter counts DistributedDataParallel's all-reduces, got "
                f"{type(model).__name__}; wrap the model in DistributedDataParallel first"
            )
        self._group = model.process_group
        model.register_comm_hook(self, SyncCounter._hook)
        return self

    @staticmethod
    def _hook(state, bucket):  # type: ignore[no-untyped-def]
        # No annotations: DDP checks them at run time and would reject the string
        # annotations that ``from __future__ import annotations`` makes of them.
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        state.calls += 1
        if bucket.is_last():
            state.syncs += 1
        return allreduce_hook(state._group, bucket)

    def reset(self) -> None:
        self.calls = 0
        self.syncs = 0


# --------------------------------------------------------------------------------------
# Uneven ranks: aligned windows with zero-target padding
# --------------------------------------------------------------------------------------


def _collective_device() -> torch.device:
    return local_device()


def gather_counts(values: Sequence[int], group: Any = None) -> list[list[int]]:
    """Every rank's ``values`` (same length on every rank), in the order of the ranks of
    ``group`` (``None``: the world): one all-reduce.

    Without a process group of more than one rank, returns ``[list(values)]``.
    """
    values = [int(v) for v in values]
    if not is_distributed():
        return [values]
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    table = torch.zeros((world, len(values)), dtype=torch.int64, device=_collective_device())
    table[rank] = torch.tensor(values, dtype=torch.int64)
    dist.all_reduce(table, op=dist.ReduceOp.SUM, group=group)
    return table.cpu().tolist()


def padding_microbatch(template: Mapping[str, Any], objective: Objective) -> dict[str, Any]:
    """A microbatch with zero targets, built from a real one of this rank (see module doc).

    With ``objective.ignore_index`` (``NextTokenLoss``): the same tensors, every label set
    to ``ignore_index``. Otherwise: every tensor cut to zero rows. ``example_ids`` are all
    ``PADDING_ID``. Raises ``ValueError`` if ``objective.count`` of the result is not 0.
    """
    batch = check_batch(template, "template")
    labels: Tensor = batch["labels"]
    rows = int(labels.shape[0]) if labels.dim() else 0
    ignore_index = getattr(objective, "ignore_index", None)
    if isinstance(ignore_index, int):
        pad = dict(batch)
        pad["labels"] = torch.full_like(labels, ignore_index)
    else:
        pad = {
            k: v[:0] if isinstance(v, Tensor) and v.dim() and v.shape[0] == rows else v
            for k, v in batch.items()
        }
    pad["example_ids"] = torch.full((int(pad["labels"].shape[0]),), PADDING_ID, dtype=torch.long)
    if objective.count(pad) != 0:
        raise ValueError(
            f"cannot build a zero-target microbatch for {objective!r}: its count() is "
            f"{objective.count(pad)} for a batch with every label ignored or no rows; give "
            "the objective an int ignore_index attribute, or make count() 0 for zero rows"
        )
    return pad


def is_padding(batch: Mapping[str, Any]) -> bool:
    """True for a microbatch made by :func:`padding_microbatch` (every id is PADDING_ID)."""
    ids = batch.get("example_ids")
    return isinstance(ids, Tensor) and bool((ids == PADDING_ID).all())


def count_examples(batch: Mapping[str, Any]) -> int:
    """Examples in a microbatch: rows whose ``example_ids`` is not ``PADDING_ID`` (all rows
    of ``labels`` when there are no ``example_ids``)."""
    ids = batch.get("example_ids")
    if isinstance(ids, Tensor) and ids.dim() == 1:
        return int((ids != PADDING_ID).sum())
    labels = batch["labels"]
    return int(labels.shape[0]) if labels.dim() else 0


def trained_lengths(microbatches: int, plan: AccumulationPlan) -> list[int]:
    """Microbatches in each window one rank trains on, for ``microbatches`` in its loader:
    ``A`` for each full window, then the short last window unless ``last_window="drop"``."""
    full, rest = divmod(int(microbatches), plan.accumulation_steps)
    short = [rest] if rest and plan.last_window == "update" else []
    return [plan.accumulation_steps] * full + short


def window_lengths(microbatches_per_rank: Sequence[int], plan: AccumulationPlan) -> list[int]:
    """Microbatches in each update attempt once the ranks are aligned.

    Every rank makes ``len(result)`` update attempts (the most any rank has) and window
    ``i`` holds ``result[i]`` microbatches on every rank (the most any rank trains on in
    window ``i``); a rank with fewer fills up with zero-target padding microbatches.
    """
    per_rank = [trained_lengths(n, plan) for n in microbatches_per_rank]
    attempts = max((len(lengths) for lengths in per_rank), default=0)
    return [
        max(lengths[i] if i < len(lengths) else 0 for lengths in per_rank) for i in range(attempts)
    ]


@dataclass(frozen=True)
class AlignedWindow:
    """One window of this rank, aligned with its peers.

    ``microbatches``: what to train on, this rank's real microbatches followed by
    ``padding`` zero-target ones; the same length on every rank. Empty when no rank
    trains in this window (only a short last window under ``last_window="drop"``).
    ``loader_batches``: microbatches read from this rank's loader for it. ``dropped``:
    real microbatches read but not trained on (a short last window under ``"drop"``).
    ``index``: position in the sequence of windows, from 0.
    """

    microbatches: list[Any]
    index: int
    loader_batches: int
    padding: int = 0
    dropped: list[Any] = field(default_factory=list)


def _split(window: Window | None, plan: AccumulationPlan) -> tuple[list[Any], list[Any]]:
    """(trained, dropped) microbatches of one loader window."""
    if window is None:
        return [], []
    if not window.complete and plan.last_window == "drop":
        return [], list(window)
    return list(window), []


def _padded(
    window: Window | None,
    trained: list[Any],
    dropped: list[Any],
    pad: dict[str, Any],
    target: int,
    index: int,
) -> AlignedWindow:
    """This rank's trained microbatches followed by padding up to ``target`` microbatches."""
    padding = target - len(trained)
    loader_batches = len(window) if window is not None else 0
    return AlignedWindow(trained + [pad] * padding, index, loader_batches, padding, dropped)


def _no_data_error(microbatches_per_rank: Sequence[int]) -> ValueError:
    empty = [r for r, n in enumerate(microbatches_per_rank) if n == 0]
    return ValueError(
        f"rank(s) {empty} have no microbatches at all; every rank needs at least one (a "
        "padding microbatch is built from the rank's own data). Give each rank a shard, "
        "e.g. accumlab.distributed.shard(examples)"
    )


def aligned_windows(
    plan: AccumulationPlan, batches: Iterable[Any], objective: Objective, group: Any = None
) -> Iterator[AlignedWindow]:
    """This rank's windows, padded so that every rank runs the same number of update
    attempts with the same number of microbatches in each.

    Outside a multi-rank process group this is ``plan.windows(batches)`` with the
    ``last_window`` policy applied. Inside one, when ``len(batches)`` exists the ranks
    exchange their microbatch counts once (one small all-reduce) and each derives every
    window's length from :func:`window_lengths`; for an iterable without ``len`` they
    agree window by window (one small all-reduce per window). A rank with fewer
    microbatches in a window, or with no window left, trains on zero-target padding
    microbatches (:func:`padding_microbatch`): they add nothing to the gradient or to the
    global target count, and make every rank synchronize at the same microbatch index.
    Raises ``RuntimeError`` if ``batches`` yields a different number of microbatches than
    its ``len``, and ``ValueError`` (on every rank) if a rank has no microbatch at all.
    The ranks that align are those of ``group``, the model's data-parallel group
    (:func:`data_parallel_group`; ``None``: the world).
    """
    windows = plan.windows(batches)
    if not is_distributed():
        for window in windows:
            trained, dropped = _split(window, plan)
            yield AlignedWindow(trained, window.index, len(window), 0, dropped)
        return
    try:
        local = len(batches)  # type: ignore[arg-type]
    except TypeError:
        yield from _aligned_lazily(plan, windows, objective, group)
        return
    yield from _aligned_by_length(plan, windows, objective, int(local), group)


def _aligned_by_length(
    plan: AccumulationPlan, windows: Iterator[Window], objective: Objective, local: int, group: Any
) -> Iterator[AlignedWindow]:
    counts = [row[0] for row in gather_counts([local], group=group)]
    if min(counts) == 0:
        raise _no_data_error(counts)
    lengths = window_lengths(counts, plan)
    pad: dict[str, Any] | None = None
    read = 0
    index = 0
    for index, target in enumerate(lengths):
        window = next(windows, None)
        trained, dropped = _split(window, plan)
        read += len(window) if window is not None else 0
        if window is None and read < local:
            raise RuntimeError(_length_lied(local, read))
        if pad is None:  # window 0 always has data on every rank
            pad = padding_microbatch((trained or dropped)[0], objective)
        yield _padded(window, trained, dropped, pad, target, index)
    for window in windows:  # only a short window dropped on every rank can be left
        trained, dropped = _split(window, plan)
        read += len(window)
        if trained:
            raise RuntimeError(_length_lied(local, read))
        yield AlignedWindow([], window.index, len(window), 0, dropped)
    if read != local:
        raise RuntimeError(_length_lied(local, read))


def _length_lied(local: int, read: int) -> str:
    return (
        f"the microbatch iterable has len() {local} but yielded {'only' if read < local else 'at least'} {read} "
        "microbatches; the ranks planned their windows from len(), so it must be exact "
        "(or pass an iterable without __len__ to align window by window)"
    )


def _aligned_lazily(
    plan: AccumulationPlan, windows: Iterator[Window], objective: Objective, group: Any
) -> Iterator[AlignedWindow]:
    pad: dict[str, Any] | None = None
    template: Any = None
    index = 0
    while True:
        window = next(windows, None)
        trained, dropped = _split(window, plan)
        if template is None and window is not None:
            template = window[0]
        rows = gather_counts([len(trained), int(template is not None)], group=group)
        target = max(row[0] for row in rows)
        if target == 0:  # no rank trains any more; report a dropped short window, if any
            if window is not None:
                yield AlignedWindow([], index, len(window), 0, dropped)
            return
        if min(row[1] for row in rows) == 0:
            raise _no_data_error([row[1] for row in rows])
        if pad is None:
            pad = padding_microbatch(template, objective)
        yield _padded(window, trained, dropped, pad, target, index)
        index += 1


# --------------------------------------------------------------------------------------
# Example IDs: who processed what
# --------------------------------------------------------------------------------------


def shard(items: Sequence[T], rank: int | None = None, world_size: int | None = None) -> list[T]:
    """Every ``world_size``-th item starting at ``rank``: each item on exactly one rank.

    Unlike ``DistributedSampler`` (which repeats items so every rank gets the same number),
    nothing is repeated or dropped; ranks differ by at most one item, and
    :func:`aligned_windows` absorbs the difference. ``rank``/``world_size`` default to the
    process group's (0 and 1 without one).
    """
    if rank is None:
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    if world_size is None:
        world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
    return list(items[rank::world_size])


def example_ids_in(batches: Iterable[Mapping[str, Any]]) -> list[int]:
    """The example IDs of a rank's microbatches, in order, padding rows left out."""
    ids: list[int] = []
    for i, batch in enumerate(batches):
        if "example_ids" not in batch:
            raise ValueError(
                f"microbatch {i} has no 'example_ids' entry (keys: {sorted(batch)}); add one "
                "tensor of ids per row (accumlab.course.data.collate does) to check coverage"
            )
        ids.extend(int(x) for x in batch["example_ids"].reshape(-1).tolist() if x != PADDING_ID)
    return ids


def gather_example_ids(ids: Iterable[int]) -> list[list[int]]:
    """Every rank's list of example IDs, in rank order (``[ids]`` without a process group).

    Collective: every rank of the group must call it."""
    mine = [int(i) for i in ids]
    if not is_distributed():
        return [mine]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return [list(x) for x in gathered]


@dataclass(frozen=True)
class ExampleIdCheck:
    """Coverage of the example IDs processed over all ranks.

    ``duplicates``: id -> the ranks that processed it, one entry per time (so
    ``{0: [0, 1]}`` means example 0 ran once on rank 0 and once on rank 1).
    ``omissions``: expected ids no rank processed. ``unexpected``: processed ids that
    were not expected. ``processed``: ids over all ranks, repeats included.
    """

    processed: int
    unique: int
    duplicates: dict[int, list[int]]
    omissions: list[int]
    unexpected: list[int]
    per_rank: list[int]

    @property
    def ok(self) -> bool:
        """True when every example was processed exactly once (and only expected ones)."""
        return not (self.duplicates or self.omissions or self.unexpected)

    def __str__(self) -> str:
        def some(xs: Sequence[Any]) -> str:
            return ", ".join(map(str, xs[:8])) + (" ..." if len(xs) > 8 else "")

        parts = [
            f"{self.processed} examples processed over {len(self.per_rank)} rank(s) "
            f"({self.per_rank}), {self.unique} distinct"
        ]
        if self.duplicates:
            shown = [f"{k} on ranks {v}" for k, v in list(self.duplicates.items())[:8]]
            parts.append(f"{len(self.duplicates)} duplicated: {some(shown)}")
        if self.omissions:
            parts.append(f"{len(self.omissions)} omitted: {some(self.omissions)}")
        if self.unexpected:
            parts.append(f"{len(self.unexpected)} unexpected: {some(self.unexpected)}")
        if self.ok:
            parts.append("each exactly once")
        return "; ".join(parts)


def check_example_ids(
    ids_per_rank: Sequence[Iterable[int]], expected: Iterable[int] | None = None
) -> ExampleIdCheck:
    """Find duplicates (an id processed more than once, on one rank or several) and, given
    ``expected``, omissions and unexpected ids. Pure: pass what
    :func:`gather_example_ids` returned, or any per-rank lists."""
    lists = [[int(i) for i in ids] for ids in ids_per_rank]
    where: dict[int, list[int]] = {}
    for rank, ids in enumerate(lists):
        for i in ids:
            where.setdefault(i, []).append(rank)
    counts = Counter({i: len(ranks) for i, ranks in where.items()})
    duplicates = {i: where[i] for i in sorted(where) if counts[i] > 1}
    omissions: list[int] = []
    unexpected: list[int] = []
    if expected is not None:
        wanted = {int(i) for i in expected}
        omissions = sorted(wanted - where.keys())
        unexpected = sorted(where.keys() - wanted)
    return ExampleIdCheck(
        processed=sum(len(ids) for ids in lists),
        unique=len(where),
        duplicates=duplicates,
        omissions=omissions,
        unexpected=unexpected,
        per_rank=[len(ids) for ids in lists],
    )


# --------------------------------------------------------------------------------------
# The run over all ranks
# --------------------------------------------------------------------------------------

_LEDGER_COUNTS = (
    "microbatches",
    "backward_passes",
    "examples",
    "targets",
    "loader_batches",
    "dropped_windows",
    "dropped_examples",
    "dropped_targets",
    "padding_microbatches",
)
_REPORT_COUNTS = ("examples", "targets", "microbatches", "backward_passes", "padding_microbatches")


def reduce_ledger(ledger: Ledger, group: Any = None) -> Ledger:
    """The ledger summed over the ranks of ``group``, the model's data-parallel group
    (:func:`data_parallel_group`; ``None``: the world) (collective).

    Examples, targets, microbatches, backward passes, loader batches, padding and dropped
    counts are summed; update attempts/applied/skipped are the same on every aligned
    rank and kept. Each report's counts and ``loss_sum`` are summed too, so its ``loss``
    becomes the window's mean over all ranks. Without a multi-rank group, returns
    ``ledger`` itself. Raises ``ValueError`` (on every rank) when the ranks made different
    numbers of update attempts (they were not aligned).
    """
    if not isinstance(ledger, Ledger):
        raise TypeError(f"ledger must be a Ledger, got {type(ledger).__name__}")
    if not is_distributed():
        return ledger
    attempts = [row[0] for row in gather_counts([len(ledger.reports)], group)]
    if len(set(attempts)) > 1:
        raise ValueError(
            f"ranks made different numbers of update attempts {attempts}; train with "
            "accumlab.train (it aligns ranks) before summing their ledgers"
        )
    values = [float(getattr(ledger, name)) for name in _LEDGER_COUNTS]
    for report in ledger.reports:
        values.extend(float(getattr(report, name)) for name in _REPORT_COUNTS)
        values.append(report.loss_sum)
    summed = torch.tensor(values, dtype=torch.float64, device=_collective_device())
    dist.all_reduce(summed, op=dist.ReduceOp.SUM, group=group)
    totals = summed.cpu().tolist()
    head, rest = totals[: len(_LEDGER_COUNTS)], totals[len(_LEDGER_COUNTS) :]
    width = len(_REPORT_COUNTS) + 1
    reports = []
    for k, report in enumerate(ledger.reports):
        row = rest[k * width : (k + 1) * width]
        counts = {name: int(round(v)) for name, v in zip(_REPORT_COUNTS, row, strict=False)}
        loss_sum = row[-1]
        loss = loss_sum / counts["targets"] if counts["targets"] else float("nan")
        reports.append(replace(report, loss_sum=loss_sum, loss=loss, **counts))
    return replace(
        ledger,
        reports=reports,
        shrinks=list(ledger.shrinks),
        **{name: int(round(v)) for name, v in zip(_LEDGER_COUNTS, head, strict=True)},
    )


def rank_totals(ledger: Ledger, group: Any = None) -> tuple[Ledger, dict[str, Any]]:
    """``(reduce_ledger(ledger, group), per-rank fields)`` for ``RunRecord.from_run(...,
    reduce_over_ranks=True)`` (collective). The fields: ``ranks``, ``examples_per_rank``,
    ``targets_per_rank`` and ``padding_microbatches_per_rank``, in rank order."""
    rows = gather_counts([ledger.examples, ledger.targets, ledger.padding_microbatches], group)
    totals = {
        "ranks": len(rows),
        "examples_per_rank": [row[0] for row in rows],
        "targets_per_rank": [row[1] for row in rows],
        "padding_microbatches_per_rank": [row[2] for row in rows],
    }
    return reduce_ledger(ledger, group), totals
