"""Precision policy: the autocast dtype of the forward, the GradScaler, and non-finite checks.

- ``"fp32"``: no autocast, no scaler.
- ``"bf16"``: forward under ``torch.autocast(device_type, dtype=torch.bfloat16)``. bf16 has
  fp32's exponent range, so gradients do not underflow and no scaler is needed.
- ``"fp16"``: forward under autocast with ``torch.float16`` and a ``torch.amp.GradScaler``
  for the model's device type, created when the caller passes none (a caller's scaler is
  used as given). fp16's narrow range (smallest subnormal about 6e-8, largest value 65504)
  makes small gradients underflow to zero unless the loss is multiplied by a scale first.

The device type comes from the model's parameters, so the same code runs on CPU and CUDA.
The weights and the gradients the optimizer sees stay float32 in every policy: autocast
only changes the dtype of the operations inside the forward.

Within one accumulation window the scale is constant: it changes only in
``scaler.update()``, which the loop calls once, at the window boundary. Whether an update
attempt was skipped is decided by :func:`total_grad_norm` of the unscaled gradients, which
is finite exactly when every entry is (float32's norm of large finite gradients overflows
to ``inf``, so it falls back to float64 there), not by the return value of
``scaler.step`` (the optimizer's own return value, ``None`` for built-in optimizers
whether or not they ran). :func:`gradients_finite` checks tensor by tensor instead.
"""

from __future__ import annotations

import contextlib
import math
import warnings
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor, nn

Precision = Literal["fp32", "bf16", "fp16"]
PRECISIONS: tuple[str, ...] = ("fp32", "bf16", "fp16")
_DTYPES: dict[str, torch.dtype | None] = {
    "fp32": None,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}
# Names other libraries use for the same policies; only used to suggest the right name.
_ALIASES = {
    "float32": "fp32", "float": "fp32", "32": "fp32", "full": "fp32",
    "bfloat16": "bf16", "bf16-mixed": "bf16", "bf16_mixed": "bf16",
    "float16": "fp16", "half": "fp16", "16": "fp16", "16-mixed": "fp16", "fp16-mixed": "fp16",
    "amp": "fp16", "mixed": "fp16",
}  # fmt: skip


@dataclass(frozen=True)
class PrecisionPolicy:
    """A validated precision for one device type.

    ``name`` is ``"fp32"``, ``"bf16"`` or ``"fp16"``; ``device_type`` is a
    ``torch.device`` type such as ``"cpu"`` or ``"cuda"``. Build it with
    :func:`precision_policy`, which checks both.
    """

    name: str
    device_type: str

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        """``torch.bfloat16``, ``torch.float16``, or ``None`` for fp32 (no autocast)."""
        return _DTYPES[self.name]

    @property
    def needs_scaler(self) -> bool:
        """True for fp16, the only policy whose gradients underflow without loss scaling."""
        return self.name == "fp16"

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        """Autocast for the forward pass and the loss, or nothing for fp32.

        Run only the forward (and the loss) inside it; the backward pass runs outside and
        follows the dtypes the forward chose.
        """
        if self.autocast_dtype is None:
            yield
        else:
            with torch.autocast(device_type=self.device_type, dtype=self.autocast_dtype):
                yield


def precision_policy(precision: str, device: torch.device | str) -> PrecisionPolicy:
    """Validate ``precision`` and tie it to the device type of ``device``.

    Raises ``TypeError`` when ``precision`` is not a string and ``ValueError`` for an
    unknown name (suggesting the course's name for a common alias such as ``"float16"``)
    or for a device type on which this PyTorch build has no autocast.
    """
    if not isinstance(precision, str):
        raise TypeError(
            f"precision must be a string, one of {list(PRECISIONS)}, got "
            f"{type(precision).__name__} {precision!r}"
        )
    if precision not in _DTYPES:
        alias = _ALIASES.get(precision.strip().lower())
        hint = f"; did you mean precision={alias!r}?" if alias else ""
        raise ValueError(f"precision must be one of {list(PRECISIONS)}, got {precision!r}{hint}")
    device_type = torch.device(device).type
    if _DTYPES[precision] is not None and not torch.amp.is_autocast_available(device_type):
        raise ValueError(
            f"precision={precision!r} needs torch.autocast, which this PyTorch build does not "
            f"support on device type {device_type!r}; use precision='fp32' there"
        )
    return PrecisionPolicy(precision, device_type)


# Scalers already warned about being disabled under fp16: ``train`` passes the same scaler
# to every window, and the warning is worth reading once, not once per window.
_WARNED_DISABLED: weakref.WeakSet[torch.amp.GradScaler] = weakref.WeakSet()


def resolve_scaler(
    policy: PrecisionPolicy, scaler: torch.amp.GradScaler | None
) -> torch.amp.GradScaler | None:
    """The scaler the loop should use for one window.

    - ``None`` under fp16: a new ``torch.amp.GradScaler(policy.device_type)`` with
      PyTorch's defaults (initial scale 2**16, growth ×2 every 2000 applied updates,
      backoff ×0.5 on a skipped one). A caller who runs many windows should create one
      scaler and pass it to every window (``train`` does), so the scale carries over.
    - ``None`` under fp32/bf16: ``None`` (no loss scaling).
    - A caller's enabled scaler: returned as it is, under any policy (loss scaling is not
      needed in fp32 or bf16, but it is harmless and the caller asked for it).
    - A caller's disabled scaler: ``None``; under fp16 this warns (once per scaler) that
      small gradients may underflow to zero.

    Raises ``TypeError`` for anything but a ``torch.amp.GradScaler`` and ``ValueError`` for
    a scaler built for another device type than the model's.
    """
    if scaler is None:
        if policy.needs_scaler:
            return torch.amp.GradScaler(policy.device_type)
        return None
    if not isinstance(scaler, torch.amp.GradScaler):
        raise TypeError(
            f"scaler must be a torch.amp.GradScaler or None, got {type(scaler).__name__}"
        )
    scaler_device = getattr(scaler, "_device", policy.device_type)
    if torch.device(scaler_device).type != policy.device_type:
        raise ValueError(
            f"scaler: the GradScaler was built for device {scaler_device!r} but the model is on "
            f"{policy.device_type!r}; create it with torch.amp.GradScaler({policy.device_type!r})"
        )
    if not scaler.is_enabled():
        if policy.needs_scaler and scaler not in _WARNED_DISABLED:
            _WARNED_DISABLED.add(scaler)
            warnings.warn(
                "precision='fp16' with a disabled GradScaler: the loss is not scaled, so "
                "gradients below fp16's range underflow to zero and non-finite gradients are "
                "handled by nonfinite= instead of the scaler; pass an enabled "
                f"torch.amp.GradScaler({policy.device_type!r}) or use precision='bf16'",
                UserWarning,
                stacklevel=3,
            )
        return None
    return scaler


def gradients_finite(parameters: Iterable[Tensor]) -> bool:
    """True when every existing ``.grad`` among ``parameters`` is free of inf and nan.

    Checks each gradient tensor element-wise (``torch.isfinite(grad).all()``), so it never
    reports a finite gradient as non-finite the way ``isfinite(total norm)`` can: the sum
    of squares of finite float32 values above about 1.8e19 overflows to ``inf``. Parameters
    without a gradient are ignored; with none at all the answer is True. One device
    synchronization per call.
    """
    flags = [
        torch.isfinite(p.grad.detach()).all()
        for p in parameters
        if p.grad is not None and p.grad.numel()
    ]
    if not flags:
        return True
    devices = {f.device for f in flags}
    if len(devices) > 1:  # a model split over devices: gather the flags on the CPU
        flags = [f.cpu() for f in flags]
    return bool(torch.stack(flags).all())


def parameters_of(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[Tensor]:
    """The model's parameters followed by any parameter the optimizer holds beyond them,
    each once: the set whose gradients decide whether an update attempt may be applied."""
    seen: set[int] = set()
    out: list[Tensor] = []
    candidates = [*model.parameters(), *(p for g in optimizer.param_groups for p in g["params"])]
    for p in candidates:
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


# Optimizers already warned about holding only some of the model's trainable parameters.
_WARNED_PARTIAL: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()


def update_parameters(
    model: nn.Module, optimizer: torch.optim.Optimizer
) -> tuple[list[Tensor], list[Tensor]]:
    """``(stepped, orphans)``: the parameters one update attempt works on, and the rest.

    ``stepped`` is every parameter the optimizer holds, each once: their gradients are
    checked for inf/nan, measured, clipped and stepped. ``orphans`` are the model's
    trainable parameters the optimizer does not hold: their gradients would never be
    cleared by ``optimizer.zero_grad`` and would grow window after window, so the loop
    clears them every window and leaves them out of the norm and the checks. The first
    time an optimizer holds only some of them, a ``UserWarning`` names the others.

    Raises ``ValueError`` when the model has no trainable parameter (nothing to train)
    and when the optimizer holds none of them (every update would change nothing).
    """
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not named:
        raise ValueError(
            f"the model ({type(model).__name__}) has no trainable parameters (none with "
            "requires_grad=True), so there is nothing to train; unfreeze some with "
            "p.requires_grad_(True)"
        )
    stepped: list[Tensor] = []
    held: set[int] = set()
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in held:
                held.add(id(p))
                stepped.append(p)
    orphans = [(n, p) for n, p in named if id(p) not in held]
    if len(orphans) == len(named):
        raise ValueError(
            f"the optimizer holds none of the model's {len(named)} trainable parameters, so "
            "no update would change the model; build it from this model, e.g. "
            "torch.optim.AdamW(model.parameters()), after wrapping the model"
        )
    if orphans and optimizer not in _WARNED_PARTIAL:
        _WARNED_PARTIAL.add(optimizer)
        names = ", ".join(n for n, _ in orphans[:8]) + (" ..." if len(orphans) > 8 else "")
        warnings.warn(
            f"the optimizer does not hold {len(orphans)} of the model's trainable parameters "
            f"({names}); their gradients are cleared every window and left out of the norm, "
            "the clipping and the finite check. Freeze them (requires_grad_(False)) or add "
            "them to the optimizer",
            UserWarning,
            stacklevel=3,
        )
    return stepped, [p for _, p in orphans]


def _plain(t: Tensor) -> Tensor:
    """A DTensor's full value (its total norm is already replicated), else ``t`` itself."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def total_grad_norm(parameters: Iterable[Tensor]) -> Tensor:
    """The L2 norm of all existing gradients together, a 0-d tensor that is finite exactly
    when every gradient entry is finite.

    Computed once with ``torch.nn.utils.get_total_norm`` in the gradients' dtype (one
    kernel per device and dtype). When that overflows (the squares of finite float32
    entries above about 1.8e19 sum to ``inf``) or is nan, it is recomputed in float64,
    one tensor at a time, which no float32 or bf16 gradient can overflow: the result is
    then ``inf``/``nan`` only if an entry is. Sharded gradients (FSDP2 DTensors) give the
    norm over all shards, the same on every rank; computing it is then a collective, so
    every rank of the group must call it. Zero when no parameter has a gradient.
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.zeros(())
    norm = _plain(torch.nn.utils.get_total_norm(grads))
    if bool(torch.isfinite(norm)):
        return norm
    device = norm.device
    parts = [
        _plain(torch.linalg.vector_norm(g.detach(), dtype=torch.float64)).to(device) for g in grads
    ]
    return torch.linalg.vector_norm(torch.stack(parts))


def mark_skipped(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> None:
    """Make ``scaler.update()`` back off as after an inf, when the skip was decided elsewhere.

    ``scaler.unscale_`` records inf/nan only in this rank's gradients. Under FSDP2 another
    rank's shard can hold the nan: every rank skips the step, and each must also back off
    its scale, or the ranks' scales part. Call after ``unscale_`` and before ``update``.
    """
    # GradScaler keeps its per-optimizer inf flags in a private dict; its update() reads
    # them, and torch's own sharded scaler all-reduces the same entries.
    state = scaler._per_optimizer_states.get(id(optimizer), {})
    for found_inf in state.get("found_inf_per_device", {}).values():
        found_inf.fill_(1.0)


@contextlib.contextmanager
def inject_nonfinite(parameter: Tensor, value: float = math.inf) -> Iterator[None]:
    """Make every gradient that reaches ``parameter`` inside the block non-finite.

    Registers a tensor hook that multiplies each incoming gradient contribution by
    ``value`` (``inf`` by default; entries that were zero become ``nan``), and removes it
    on exit. A fault injector for tests and demonstrations: wrap one window in it and that
    window's update attempt must be skipped while every other window applies normally.
    """
    if not isinstance(parameter, Tensor) or not parameter.requires_grad:
        raise TypeError(
            "parameter must be a tensor that requires grad (e.g. a model parameter), got "
            f"{type(parameter).__name__}"
        )
    if math.isfinite(value):
        raise ValueError(f"value must be inf, -inf or nan, got {value!r}")
    handle = parameter.register_hook(lambda grad: grad * value)
    try:
        yield
    finally:
        handle.remove()


def scaler_settings(scaler: torch.amp.GradScaler | None) -> dict[str, Any] | None:
    """A GradScaler's configuration and current scale, for the run record.

    Returns ``None`` for no scaler, ``{"enabled": False}`` for a disabled one, else
    ``enabled``, ``device``, ``init_scale``, ``scale`` (now), ``growth_factor``, ``backoff_factor`` and
    ``growth_interval`` (in applied updates). Raises ``TypeError`` for anything else.
    """
    if scaler is None:
        return None
    if not isinstance(scaler, torch.amp.GradScaler):
        raise TypeError(
            f"scaler must be a torch.amp.GradScaler or None, got {type(scaler).__name__}"
        )
    if not scaler.is_enabled():
        return {"enabled": False}
    init_scale = getattr(scaler, "_init_scale", None)  # no public getter in torch.amp
    return {
        "enabled": True,
        "device": str(getattr(scaler, "_device", "")),
        "init_scale": None if init_scale is None else float(init_scale),
        "scale": float(scaler.get_scale()),
        "growth_factor": float(scaler.get_growth_factor()),
        "backoff_factor": float(scaler.get_backoff_factor()),
        "growth_interval": int(scaler.get_growth_interval()),
    }
