"""Ranks that stay up between cells: local processes joined in one process group, which run
one worker function after another.

:func:`accumlab.distributed.launch` starts fresh processes for every call. Each spends
about 3 s of CPU importing PyTorch, joining the group and warming up before the worker's
first line, while the course's workers then run in a fraction of a second: a lesson that
launches a dozen of them pays mostly for starting processes. :class:`Ranks` launches the
processes once, through :func:`~accumlab.distributed.launch` itself (so every rank's
output goes to its log, and a worker's error comes back with its rank and traceback), and
sends them one worker after another:

    ranks = Ranks(2)
    per_rank = ranks.run(workers.one_ddp_window)    # results in rank order
    per_rank = ranks.run(workers.count_syncs, (4, 2))
    ranks.close()                                   # or leave it to the end of the process

Between two calls the group stays as the last worker left it; workers that build their own
model, optimizer and data (the course's do) see no difference from a fresh launch. A
worker that raises, on any rank, ends the group: :meth:`Ranks.run` re-raises the error as
``launch`` does (same type, ``rank r:`` in front of the message, ``.rank`` set) and the
next call starts new processes, since a peer may be left waiting in a collective.
"""

from __future__ import annotations

import atexit
import io
import multiprocessing
import queue as queue_module
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from accumlab.distributed import launch
from accumlab.distributed.launch import DEFAULT_TIMEOUT_S

#: What :func:`serve` reads to stop: the group is torn down and ``launch`` returns.
STOP = None


def _dumps(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)  # tensors as bytes: nothing shared through file descriptors
    return buffer.getvalue()


def serve(inboxes: Sequence[Any], outbox: Any) -> None:
    """The body each rank runs under ``launch``: take ``(number, fn, args)`` from this
    rank's inbox, run ``fn(*args)`` and put ``(rank, number, result as bytes)`` in the
    outbox, until :data:`STOP`. An exception leaves the loop, so ``launch`` reports it and
    stops every rank."""
    rank = dist.get_rank()
    while True:
        task = inboxes[rank].get()
        if task is STOP:
            return
        number, fn, args = task
        outbox.put((rank, number, _dumps(fn(*args))))


def _check_worker(fn: Callable[..., Any]) -> None:
    if not callable(fn):
        raise TypeError(f"fn must be a function, got {type(fn).__name__}")
    name, module = getattr(fn, "__qualname__", ""), getattr(fn, "__module__", None)
    if "<lambda>" in name or "<locals>" in name or module in (None, "__main__"):
        raise ValueError(
            f"Ranks.run needs a function defined at the top level of an importable module "
            f"(such as accumlab_course.workers), got {module}.{name}: the ranks are other "
            "processes and cannot see lambdas, nested functions or notebook cells"
        )


class Ranks:
    """``nprocs`` local processes in one process group (gloo on CPU, nccl with a GPU per
    rank), started at the first :meth:`run` and kept until :meth:`close`, an error, or the
    end of this process. ``timeout_s`` is the group's collective timeout (seconds a rank
    waits for a peer before failing), as in :func:`~accumlab.distributed.launch`."""

    def __init__(self, nprocs: int = 2, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
            raise ValueError(f"nprocs must be a positive int (the number of ranks), got {nprocs!r}")
        self.nprocs = nprocs
        self.timeout_s = timeout_s
        self._thread: threading.Thread | None = None
        self._inboxes: list[Any] = []
        self._outbox: Any = None
        self._failure: BaseException | None = None
        self._number = 0
        #: How many times the processes were started (1 while one group served every call).
        self.starts = 0

    @property
    def running(self) -> bool:
        """Whether the processes are up and serving."""
        return self._thread is not None and self._thread.is_alive() and self._failure is None

    def _start(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._inboxes = [ctx.Queue() for _ in range(self.nprocs)]
        self._outbox = ctx.Queue()
        self._failure = None
        self._thread = threading.Thread(
            target=self._launch, args=(self._inboxes, self._outbox), daemon=True
        )
        self._thread.start()
        self.starts += 1
        atexit.register(self.close)  # the ranks leave the group before this process ends

    def _launch(self, inboxes: list[Any], outbox: Any) -> None:
        try:
            launch(serve, self.nprocs, (inboxes, outbox), timeout_s=self.timeout_s)
        except BaseException as exc:  # a worker's error, or a rank that died
            self._failure = exc
        finally:
            outbox.put(STOP)  # wakes a run() waiting for results that will not come

    def run(self, fn: Callable[..., Any], args: Sequence[Any] = ()) -> list[Any]:
        """``fn(*args)`` on every rank; the results in rank order. ``fn`` must live in an
        importable module and return something picklable. A rank waiting for a peer in a
        collective fails after ``timeout_s``, which ends the wait here too."""
        _check_worker(fn)
        if not self.running:
            self._start()
        self._number += 1
        number, outbox = self._number, self._outbox
        for inbox in self._inboxes:
            inbox.put((number, fn, tuple(args)))
        received: dict[int, bytes] = {}
        while len(received) < self.nprocs:
            try:
                reply = outbox.get(timeout=0.1)
            except queue_module.Empty:
                continue
            if reply is STOP:  # launch returned or raised: the group is gone
                failure = self._failure
                self.close()
                if failure is None:
                    raise RuntimeError("Ranks.run: the ranks stopped before returning a result")
                raise failure
            rank, replied_to, payload = reply
            if replied_to == number:
                received[rank] = payload
        return [torch.load(io.BytesIO(received[r]), weights_only=False) for r in range(self.nprocs)]

    def close(self) -> None:
        """Stop the processes (they leave the group together); a later :meth:`run` starts
        new ones."""
        atexit.unregister(self.close)
        if self._thread is None:
            return
        if self._thread.is_alive():
            for inbox in self._inboxes:
                inbox.put(STOP)
            self._thread.join(timeout=max(30.0, self.timeout_s))
        self._thread = None
        for q in [*self._inboxes, self._outbox]:
            q.cancel_join_thread()  # a dead rank leaves its inbox unread: do not wait for it
            q.close()
        self._inboxes, self._outbox = [], None  # frees the queues' semaphores now

    def __enter__(self) -> Ranks:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "running" if self.running else "not started"
        return f"Ranks(nprocs={self.nprocs}, {state})"
