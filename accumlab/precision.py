"""Precision policy: the autocast dtype of the forward, the GradScaler, the finite check.

- ``"fp32"``: no autocast, no scaler.
- ``"bf16"``: forward under ``torch.autocast(device_type, dtype=torch.bfloat16)``; bf16
  has fp32's exponent range, so gradients do not underflow and no scaler is needed.
- ``"fp16"``: forward under autocast with ``torch.float16`` and a ``torch.amp.GradScaler``
  for the model's device type: fp16's narrow range (smallest subnormal about 6e-8,
  largest value 65504) makes small gradients underflow unless the loss is scaled first.

The weights and the gradients the optimizer sees stay float32 in every policy. Within a
window the scale is constant: it changes only in ``scaler.update()``, once per window.
Whether an attempt is skipped is decided by :func:`total_grad_norm` of the unscaled
gradients, finite exactly when every entry is, never by ``scaler.step``'s return value.
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

from .validate import check_choice, check_instance, outside_stacklevel

Precision = Literal["fp32", "bf16", "fp16"]
PRECISIONS: tuple[str, ...] = ("fp32", "bf16", "fp16")
_DTYPES: dict[str, torch.dtype | None] = {
    "fp32": None,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}
# Names other libraries use for the same policies; only used to suggest the right name.
_ALIASES = {
    **dict.fromkeys(("float32", "float", "32", "full"), "fp32"),
    **dict.fromkeys(("bfloat16", "bf16-mixed", "bf16_mixed"), "bf16"),
    **dict.fromkeys(("float16", "half", "16", "16-mixed", "fp16-mixed", "amp", "mixed"), "fp16"),
}


@dataclass(frozen=True)
class PrecisionPolicy:
    """A validated precision (``"fp32"``, ``"bf16"`` or ``"fp16"``) for one device type
    (``"cpu"``, ``"cuda"``, ...); build it with :func:`precision_policy`, which checks both."""

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
        """Autocast for the forward pass and the loss, or nothing for fp32; the backward
        runs outside it and follows the dtypes the forward chose."""
        if self.autocast_dtype is None:
            yield
        else:
            with torch.autocast(device_type=self.device_type, dtype=self.autocast_dtype):
                yield


def check_precision(precision: object) -> str:
    """``precision`` if it is ``"fp32"``, ``"bf16"`` or ``"fp16"``: ``TypeError`` for a
    value that is not a string, ``ValueError`` for another name (suggesting the course's
    name for a common alias such as ``"float16"``)."""
    return check_choice("precision", precision, PRECISIONS, aliases=_ALIASES)


def precision_policy(precision: str, device: torch.device | str) -> PrecisionPolicy:
    """Validate ``precision`` (:func:`check_precision`) and tie it to the device type of
    ``device``: ``ValueError`` for a device type on which this PyTorch build has no
    autocast."""
    check_precision(precision)
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

    ``None`` under fp16 gives a new ``torch.amp.GradScaler(policy.device_type)`` with
    PyTorch's defaults (scale 2**16, ×2 every 2000 applied updates, ×0.5 on a skip): to
    carry the scale over, make one and pass it to every window (``train`` does). ``None``
    under fp32/bf16 stays ``None``. A caller's enabled scaler is used under any policy; a
    disabled one gives ``None`` (under fp16 with a warning, once per scaler: small
    gradients may underflow). ``TypeError`` for anything but a ``torch.amp.GradScaler``,
    ``ValueError`` for a scaler built for another device type than the model's.
    """
    if scaler is None:
        if policy.needs_scaler:
            return torch.amp.GradScaler(policy.device_type)
        return None
    check_instance("scaler", scaler, torch.amp.GradScaler, "a torch.amp.GradScaler", none_ok=True)
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
                stacklevel=outside_stacklevel(),
            )
        return None
    return scaler


def scaler_settings(scaler: torch.amp.GradScaler | None) -> dict[str, Any] | None:
    """A GradScaler's configuration and current scale as plain data, for the run record.

    Returns ``None`` for no scaler, ``{"enabled": False}`` for a disabled one, else
    ``enabled``, ``device``, ``init_scale``, ``scale`` (now), ``growth_factor``,
    ``backoff_factor`` and ``growth_interval`` (in applied updates). Raises ``TypeError``
    for anything else.
    """
    if scaler is None:
        return None
    check_instance("scaler", scaler, torch.amp.GradScaler, "a torch.amp.GradScaler", none_ok=True)
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


# Optimizers already warned about holding only some of the model's trainable parameters.
_WARNED_PARTIAL: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()


def update_parameters(
    model: nn.Module, optimizer: torch.optim.Optimizer
) -> tuple[list[Tensor], list[Tensor]]:
    """``(stepped, orphans)``: the parameters one update attempt works on, and the rest.

    ``stepped``: every parameter the optimizer holds, once; their gradients are checked,
    measured, clipped and stepped. ``orphans``: the model's trainable parameters it does
    not hold, whose gradients ``optimizer.zero_grad`` would never clear; the loop clears
    them every window (a ``UserWarning`` names them, once per optimizer). ``ValueError``
    when the model has no trainable parameter or the optimizer holds none of them.
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
            stacklevel=outside_stacklevel(),
        )
    return stepped, [p for _, p in orphans]


def _plain(t: Tensor) -> Tensor:
    """A DTensor's full value (its total norm is already replicated), else ``t`` itself."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def total_grad_norm(parameters: Iterable[Tensor]) -> tuple[Tensor, float]:
    """The L2 norm of all existing gradients together, finite exactly when every gradient
    entry is: as a 0-d tensor (for clipping) and as a float, read back from the device
    once (one host sync in the common, finite case).

    ``torch.nn.utils.get_total_norm`` in the gradients' dtype; when that overflows (squares
    of finite float32 entries above about 1.8e19 sum to ``inf``) or is nan, recomputed in
    float64, which no float32 or bf16 gradient overflows. FSDP2's sharded gradients give
    the norm over all shards (a collective: every rank calls it). Zero without gradients.
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.zeros(()), 0.0
    norm = _plain(torch.nn.utils.get_total_norm(grads))
    value = float(norm)
    if math.isfinite(value):
        return norm, value
    device = norm.device
    parts = [
        _plain(torch.linalg.vector_norm(g.detach(), dtype=torch.float64)).to(device) for g in grads
    ]
    norm = torch.linalg.vector_norm(torch.stack(parts))
    return norm, float(norm)
