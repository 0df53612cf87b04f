"""Where the memory of a window goes, measured per device, and an optional budget.

A window's memory has four parts (notebook 05): the **weights** (live before the first
microbatch), the **activations** a microbatch's forward pass saves for its backward pass
(they grow with the microbatch size ``m``), the **gradients** (created by the first backward
pass, kept until the update clears them) and the **optimizer state** (created at the first
update, kept from then on). ``MemoryMeter`` measures them phase by phase:

- on CUDA it reads the caching allocator's counters (``torch.cuda.memory_allocated`` and the
  peak since ``torch.cuda.reset_peak_memory_stats``), and can export an allocator snapshot;
- on CPU, which has no allocator counters, it counts the bytes of live tensor *storages*: a
  ``TorchDispatchMode`` sees every storage an operator creates or reads while a phase runs,
  and a ``weakref.finalize`` on each storage removes its bytes when it is really freed (views
  share a storage and count once).

On both devices a ``saved_tensors_hooks`` pair measures the bytes each forward pass saves
for backward, deduplicated by storage. With ``budget_bytes`` the meter raises
``torch.OutOfMemoryError`` when an operator would take the tracked live bytes above the
budget, so out-of-memory handling (``train(..., on_oom="shrink")``) is real code that runs
and is tested on a CPU.

All sizes are in bytes. What the meter measured, phase by phase and window by window, is
held by :mod:`accumlab.memory_records`.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from .memory_records import PhaseRecord, WindowRecord
from .validate import check_bool, check_positive_int

__all__ = ["MemoryMeter", "format_bytes"]

def format_bytes(n: int | float) -> str:
    """``n`` bytes in binary units with 1 decimal, e.g. ``format_bytes(1536) == '1.5 KiB'``."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _device_of(device: torch.device | str | int) -> torch.device:
    if isinstance(device, bool) or not isinstance(device, (torch.device, str, int)):
        raise TypeError(
            f"device must be a torch.device, a string such as 'cpu' or 'cuda:0', or a CUDA "
            f"index, got {type(device).__name__}"
        )
    dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"MemoryMeter measures 'cpu' or 'cuda' devices, got {dev.type!r}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"device {dev} requested but CUDA is not available; use MemoryMeter('cpu')"
            )
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def _storage_of(t: Tensor) -> tuple[int, Any] | None:
    """``(key, storage)``: the key is the address of the C++ StorageImpl, unique among live
    storages; None for tensors without a plain storage (sparse, nested, wrappers)."""
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):
        return None
    return storage._cdata, storage


def _is_trainable_weight(t: Tensor) -> bool:
    """True for a trainable parameter or a view of one (``weight.t()`` saved by a linear)."""
    base = t._base if t._base is not None else t
    return bool(base.is_leaf and base.requires_grad)


class _Tracker(TorchDispatchMode):
    """Sees every operator while active and hands inputs and outputs to the meter."""

    def __init__(self, meter: MemoryMeter) -> None:
        super().__init__()
        self.meter = meter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        meter = self.meter
        inputs: set[int] = set()
        if meter._counts_storages:
            found = meter._keys(tree_leaves((args, kwargs)), with_weight_flag=True)
            inputs = {key for key, _, _ in found}
            meter._discover_found([(k, s) for k, s, weight in found if weight])
        out = func(*args, **kwargs)
        meter._after_op(tree_leaves(out), inputs)
        return out


def _release(meter_ref: weakref.ReferenceType[MemoryMeter], key: int) -> None:
    meter = meter_ref()
    if meter is not None:
        meter._forget(key)


class MemoryMeter:
    """Memory of a window, phase by phase, on one device (``"cpu"`` or ``"cuda:N"``).

    Pass it to ``train(..., meter=meter)`` or ``train_window(..., meter=meter)``; the loop
    enters ``meter.phase("forward", i)`` and ``meter.phase("backward", i)`` for every
    microbatch ``i`` and ``meter.phase("update")`` once per window. Each window gets a
    :class:`WindowRecord`: its baseline (live bytes before the first microbatch) and one
    :class:`PhaseRecord` per phase (live bytes at entry and exit, peak, bytes saved for
    backward).

    What "live bytes" means depends on the device:

    - **CUDA**: ``torch.cuda.memory_allocated(device)``, every tensor the process holds on
      that GPU; the peak of a phase is ``torch.cuda.max_memory_allocated`` after a
      ``reset_peak_memory_stats`` at its entry (this resets the process-wide peak counter).
    - **CPU**: the bytes of the tensor storages the meter has seen and that are still alive.
      While a phase runs (or inside ``meter.track()``) a dispatch mode registers every storage
      an operator creates and every trainable parameter an operator reads; a storage stops
      counting when it is freed, whenever that happens. Parameters first read during a window
      count toward that window's baseline (they existed before it). Tensors created outside
      tracking that are not trainable parameters (the input batches a loader made, frozen
      weights, buffers) are not counted unless you ``watch()`` them. Process RSS is not used:
      it is too noisy (the allocator keeps freed pages, the interpreter allocates too).

    ``budget_bytes``: when an operator would take the live bytes above it, the meter raises
    ``torch.OutOfMemoryError`` (on CPU before registering the operator's outputs, which are
    then freed; on CUDA right after the operator, whose outputs are freed as the error
    unwinds). ``peak_bytes`` is the highest live bytes since creation or ``reset()``.
    """

    def __init__(
        self,
        device: torch.device | str | int = "cpu",
        budget_bytes: int | None = None,
        *,
        track_saved: bool = True,
        record_history: bool = False,
    ) -> None:
        self.device = _device_of(device)
        self.budget_bytes = check_positive_int("budget_bytes", budget_bytes, none_means="no budget")
        self.track_saved = check_bool("track_saved", track_saved)
        self._cuda = self.device.type == "cuda"
        self._counts_storages = not self._cuda
        self._lock = threading.RLock()
        self._sizes: dict[int, int] = {}  # storage key -> bytes, CPU only
        self._live = 0
        self._peak = 0
        self._windows: list[WindowRecord] = []
        self._open: WindowRecord | None = None  # the window whose update has not finished
        self._phase: PhaseRecord | None = None
        self._phase_new: set[int] = set()
        self._saved_keys: set[int] = set()
        self._depth = 0
        self._mode: _Tracker | None = None
        self._self_ref = weakref.ref(self)
        if check_bool("record_history", record_history):
            if not self._cuda:
                raise ValueError(
                    "record_history=True needs a CUDA device: allocator snapshots exist only "
                    "for the CUDA caching allocator; on CPU read meter.report() instead"
                )
            torch.cuda.memory._record_memory_history(max_entries=100_000)
        self.reset()

    # -- public reading ----------------------------------------------------------------

    def __repr__(self) -> str:
        budget = "None" if self.budget_bytes is None else format_bytes(self.budget_bytes)
        return (
            f"MemoryMeter(device={str(self.device)!r}, live={format_bytes(self.live_bytes)}, "
            f"peak={format_bytes(self.peak_bytes)}, budget={budget}, "
            f"windows={len(self._windows)})"
        )

    @property
    def live_bytes(self) -> int:
        """Bytes live now (CUDA: allocated on the device; CPU: tracked storages alive)."""
        if self._cuda:
            return int(torch.cuda.memory_allocated(self.device))
        return self._live

    @property
    def peak_bytes(self) -> int:
        """The highest live bytes seen since creation or the last ``reset()`` (an int)."""
        if self._cuda:
            return max(self._peak, int(torch.cuda.max_memory_allocated(self.device)))
        return self._peak

    @property
    def windows(self) -> list[WindowRecord]:
        """One record per window seen since the last ``reset()``, failed attempts included."""
        return list(self._windows)

    @property
    def last_window(self) -> WindowRecord:
        """The most recent window record (``LookupError`` before any)."""
        if not self._windows:
            raise LookupError("the meter has not seen a window yet; run a phase first")
        return self._windows[-1]

    def reset(self) -> None:
        """Forget windows and start the peak again from the bytes live now.

        Storages already tracked keep counting until they are freed.
        """
        with self._lock:
            self._windows = []
            self._open = None
            if self._cuda:
                torch.cuda.reset_peak_memory_stats(self.device)
            self._peak = self.live_bytes

    # -- tracking ------------------------------------------------------------------------

    @contextlib.contextmanager
    def track(self) -> Iterator[MemoryMeter]:
        """Track allocations (and enforce the budget) in this block, outside any phase."""
        self._enter_mode()
        try:
            yield self
        finally:
            self._exit_mode()

    def watch(self, *objects: nn.Module | torch.optim.Optimizer | Tensor) -> int:
        """Count storages that already exist: a module's parameters, buffers and gradients,
        an optimizer's state, or tensors. Returns the bytes added (already tracked ones are
        not added twice). Trainable parameters are found anyway when an operator reads them;
        watch frozen weights, buffers, optimizer state created before the meter, or input
        data you want counted. No-op on CUDA, where the allocator sees everything."""
        if self._cuda:
            return 0
        tensors: list[Tensor] = []
        for obj in objects:
            if isinstance(obj, nn.Module):
                for p in obj.parameters():
                    tensors.append(p)
                    if p.grad is not None:
                        tensors.append(p.grad)
                tensors.extend(obj.buffers())
            elif isinstance(obj, torch.optim.Optimizer):
                tensors.extend(
                    t for state in obj.state.values() for t in tree_leaves(state)
                    if isinstance(t, Tensor)
                )
            elif isinstance(obj, Tensor):
                tensors.append(obj)
            else:
                raise TypeError(
                    f"watch() takes modules, optimizers or tensors, got {type(obj).__name__}"
                )
        before = self._live
        self._discover(tensors)
        return self._live - before

    @contextlib.contextmanager
    def phase(self, name: str, microbatch: int | None = None) -> Iterator[PhaseRecord]:
        """Measure one phase; the loop's phases are ``"forward"``/``"backward"`` (with the
        microbatch index) and ``"update"``. A window starts at ``("forward", 0)`` or at the
        first phase after an update; its baseline is the live bytes at that moment.
        An exception inside the phase is recorded (``failed=True``) and re-raised."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"phase name must be a non-empty string, got {name!r}")
        if self._phase is not None:
            raise RuntimeError(
                f"phase {name!r} entered while phase {self._phase.name!r} is still open; "
                "phases of one meter do not nest"
            )
        with self._lock:
            if self._open is None or (name == "forward" and microbatch == 0):
                self._open = WindowRecord(len(self._windows), self.live_bytes)
                self._windows.append(self._open)
            if self._cuda:
                torch.cuda.reset_peak_memory_stats(self.device)
            live = self.live_bytes
            record = PhaseRecord(self._open.index, name, microbatch, live, live, live)
            self._phase = record
            self._phase_new = set()
            self._saved_keys = set()
            if name == "forward" and self.track_saved:
                record.saved_bytes = 0
        hooks = (
            torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
            if record.saved_bytes is not None
            else contextlib.nullcontext()
        )
        self._enter_mode()
        try:
            with hooks:
                yield record
        except BaseException:
            record.failed = True
            raise
        finally:
            self._exit_mode()
            with self._lock:
                self._close_phase(record)

    def _close_phase(self, record: PhaseRecord) -> None:
        window = self._open
        if self._cuda:
            record.peak_bytes = max(record.peak_bytes, int(torch.cuda.max_memory_allocated(self.device)))
        record.end_bytes = self.live_bytes
        record.peak_bytes = max(record.peak_bytes, record.end_bytes)
        if not self._cuda:
            record.kept_bytes = sum(self._sizes.get(k, 0) for k in self._phase_new)
        self._peak = max(self._peak, record.peak_bytes)
        self._phase = None
        self._phase_new = set()
        self._saved_keys = set()
        if window is not None:
            window.phases.append(record)
            if record.name == "update":
                window.complete = not record.failed
                self._open = None

    def _enter_mode(self) -> None:
        needs_mode = self._counts_storages or self.budget_bytes is not None
        self._depth += 1
        if self._depth == 1 and needs_mode:
            self._mode = _Tracker(self)
            self._mode.__enter__()

    def _exit_mode(self) -> None:
        self._depth -= 1
        if self._depth == 0 and self._mode is not None:
            mode, self._mode = self._mode, None
            mode.__exit__(None, None, None)

    # -- called by the dispatch mode -----------------------------------------------------------

    def _keys(self, leaves: Sequence[Any], with_weight_flag: bool = False) -> list[Any]:
        """``(key, storage)`` of each plain tensor on this device, or ``(key, storage,
        is_trainable_weight)`` with ``with_weight_flag``."""
        found: list[Any] = []
        for t in leaves:
            if isinstance(t, Tensor) and t.device == self.device and t.layout == torch.strided:
                key = _storage_of(t)
                if key is not None:
                    found.append((*key, _is_trainable_weight(t)) if with_weight_flag else key)
        return found

    def _register(self, key: int, storage: Any, nbytes: int) -> None:
        self._sizes[key] = nbytes
        self._live += nbytes
        weakref.finalize(storage, _release, self._self_ref, key).atexit = False

    def _discover(self, leaves: Sequence[Any]) -> None:
        self._discover_found(self._keys(leaves))

    def _discover_found(self, found: Sequence[tuple[int, Any]]) -> None:
        """Count storages that existed before tracking saw them (``watch``, or trainable
        parameters an operator reads)."""
        if not found:
            return
        with self._lock:
            added = 0
            for key, storage in found:
                if key not in self._sizes:
                    nbytes = int(storage.nbytes())
                    self._register(key, storage, nbytes)
                    added += nbytes
            if added:
                # They were live before this window began: shift its records up.
                window = self._open
                if window is not None:
                    window.baseline_bytes += added
                    for p in window.phases:
                        p.start_bytes += added
                        p.end_bytes += added
                        p.peak_bytes += added
                if self._phase is not None:
                    self._phase.start_bytes += added
                    self._phase.peak_bytes = max(self._phase.peak_bytes + added, self._live)
                self._peak = max(self._peak, self._live)

    def _after_op(self, leaves: Sequence[Any], inputs: set[int]) -> None:
        """Register an operator's new output storages; an output that shares an input's
        storage (a view, an in-place result) is not new, tracked or not."""
        if self._cuda:
            used = int(torch.cuda.memory_allocated(self.device))
            if self.budget_bytes is not None and used > self.budget_bytes:
                self._raise_oom(used)
            return
        with self._lock:
            new: dict[int, tuple[Any, int]] = {}
            grown = 0
            for key, storage in self._keys(leaves):
                nbytes = int(storage.nbytes())
                if key in self._sizes:
                    grown += nbytes - self._sizes[key]  # resized in place
                    if nbytes != self._sizes[key]:
                        self._sizes[key] = nbytes
                elif key not in new and key not in inputs:
                    new[key] = (storage, nbytes)
            total = self._live + grown + sum(n for _, n in new.values())
            if self.budget_bytes is not None and total > self.budget_bytes and new:
                self._live += grown
                self._raise_oom(total)
            self._live += grown
            for key, (storage, nbytes) in new.items():
                self._register(key, storage, nbytes)
                self._phase_new.add(key)
            if self._phase is not None and self._live > self._phase.peak_bytes:
                self._phase.peak_bytes = self._live
            if self._live > self._peak:
                self._peak = self._live

    def _raise_oom(self, would_be: int) -> None:
        where = "" if self._phase is None else f" in phase {self._phase.name!r}" + (
            "" if self._phase.microbatch is None else f" of microbatch {self._phase.microbatch}"
        )
        raise torch.OutOfMemoryError(
            f"MemoryMeter budget exceeded on {self.device}{where}: the live bytes would be "
            f"{would_be} ({format_bytes(would_be)}), above budget_bytes={self.budget_bytes} "
            f"({format_bytes(self.budget_bytes or 0)})"
        )

    def _forget(self, key: int) -> None:
        with self._lock:
            nbytes = self._sizes.pop(key, None)
            if nbytes is not None:
                self._live -= nbytes

    def _pack(self, t: Tensor) -> Tensor:
        record = self._phase
        if record is not None and record.saved_bytes is not None and t.device == self.device:
            found = _storage_of(t)
            if found is not None and not _is_trainable_weight(t):
                key, storage = found
                if key not in self._saved_keys:
                    self._saved_keys.add(key)
                    record.saved_bytes += int(storage.nbytes())
        # A detached alias, not ``t`` itself: a saved *output* handed back as-is would form
        # a tensor -> grad_fn -> saved tensor cycle that keeps an abandoned graph alive.
        return t.detach()

    # -- reports ---------------------------------------------------------------------------

    def report(self) -> dict[str, Any]:
        """Everything measured, as plain JSON-ready values (bytes): device, method, budget,
        peak and live bytes, and every window with its phases."""
        return {
            "device": str(self.device),
            "method": "cuda caching allocator counters"
            if self._cuda
            else "tracked tensor storages (TorchDispatchMode + weakref.finalize)",
            "budget_bytes": self.budget_bytes,
            "peak_bytes": self.peak_bytes,
            "live_bytes": self.live_bytes,
            "windows": [w.to_dict() for w in self._windows],
        }

    def summary(self) -> dict[str, Any]:
        """The compact form a ``RunRecord`` keeps: the first window's baseline, the last
        complete window's baseline (``steady_baseline_bytes``, optimizer state included),
        the overall peak, and per phase name the highest bytes at entry and the peak."""
        phases: dict[str, dict[str, int]] = {}
        for w in self._windows:
            for p in w.phases:
                row = phases.setdefault(p.name, {"start_bytes": 0, "peak_bytes": 0})
                row["start_bytes"] = max(row["start_bytes"], p.start_bytes)
                row["peak_bytes"] = max(row["peak_bytes"], p.peak_bytes)
        complete = [w for w in self._windows if w.complete]
        return {
            "device": str(self.device),
            "baseline_bytes": self._windows[0].baseline_bytes if self._windows else None,
            "steady_baseline_bytes": complete[-1].baseline_bytes if complete else None,
            "peak_bytes": self.peak_bytes,
            "budget_bytes": self.budget_bytes,
            "phases": phases,
        }

    def export_snapshot(self, path: str) -> str:
        """Write the CUDA allocator's snapshot (needs ``record_history=True``) to ``path``
        for https://pytorch.org/memory_viz; returns ``path``. CPU meters raise ValueError."""
        if not self._cuda:
            raise ValueError(
                "export_snapshot() needs a CUDA meter: allocator snapshots exist only for "
                "the CUDA caching allocator; on CPU use meter.report()"
            )
        torch.cuda.memory._dump_snapshot(path)
        return path


def _unpack(t: Tensor) -> Tensor:
    return t
