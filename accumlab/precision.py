"""Precision policy: which autocast dtype the forward runs in, and whether a GradScaler is needed.

- ``"fp32"``: no autocast, no scaler.
- ``"bf16"``: forward under ``torch.autocast(device_type, dtype=torch.bfloat16)``; bf16 has
  fp32's exponent range, so gradients do not underflow and no scaler is needed.
- ``"fp16"``: forward under autocast with ``torch.float16`` and a ``torch.amp.GradScaler``
  for the model's device, created when the caller passes none. fp16's narrow range makes
  small gradients underflow to zero unless the loss is scaled up first.

The same code runs on CPU and CUDA: the device type comes from the model's parameters.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import torch

Precision = Literal["fp32", "bf16", "fp16"]
_DTYPES: dict[str, torch.dtype | None] = {
    "fp32": None,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}


@dataclass(frozen=True)
class PrecisionPolicy:
    """``name`` is ``"fp32"``, ``"bf16"`` or ``"fp16"``; ``device_type`` is ``"cpu"`` or ``"cuda"``."""

    name: str
    device_type: str

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        return _DTYPES[self.name]

    @property
    def needs_scaler(self) -> bool:
        return self.name == "fp16"

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        """Autocast for the forward pass (and the loss), or nothing for fp32."""
        if self.autocast_dtype is None:
            yield
        else:
            with torch.autocast(device_type=self.device_type, dtype=self.autocast_dtype):
                yield


def precision_policy(precision: str, device: torch.device | str) -> PrecisionPolicy:
    """Validate ``precision`` and tie it to the device type of ``device``."""
    if precision not in _DTYPES:
        raise ValueError(
            f"precision must be one of {sorted(_DTYPES)}, got {precision!r}"
        )
    return PrecisionPolicy(precision, torch.device(device).type)


def resolve_scaler(
    policy: PrecisionPolicy, scaler: torch.amp.GradScaler | None
) -> torch.amp.GradScaler | None:
    """The scaler the loop should use: the caller's one (checked), a new one for fp16, or None.

    Raises ``ValueError`` for a scaler built for another device type. Warns when fp16 runs
    with a disabled scaler (small gradients may underflow to zero).
    """
    if scaler is None:
        if policy.needs_scaler:
            return torch.amp.GradScaler(policy.device_type)
        return None
    if not isinstance(scaler, torch.amp.GradScaler):
        raise TypeError(
            f"scaler must be a torch.amp.GradScaler, got {type(scaler).__name__}"
        )
    scaler_device = getattr(scaler, "_device", policy.device_type)
    if scaler_device != policy.device_type:
        raise ValueError(
            f"the GradScaler was built for device {scaler_device!r} but the model is on "
            f"{policy.device_type!r}; create it with torch.amp.GradScaler({policy.device_type!r})"
        )
    if not scaler.is_enabled():
        if policy.needs_scaler:
            warnings.warn(
                "precision='fp16' with a disabled GradScaler: gradients smaller than fp16's "
                "range underflow to zero; pass an enabled scaler or use bf16",
                stacklevel=3,
            )
        return None
    return scaler
