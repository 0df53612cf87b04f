"""Argument checks, one helper per kind of check, so every public function words the same
mistake the same way.

Each helper returns the value it accepted and raises a ``TypeError`` (the wrong kind of
value) or a ``ValueError`` (the right kind, a wrong value) whose message starts with the
argument's name, says what is accepted and shows what was given. Where ``None`` is
accepted, ``none_means`` says what it stands for ("no clipping"). Imports torch only:
the core uses it.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Collection, Mapping, Sequence
from typing import TypeVar, overload

import torch

T = TypeVar("T")


def _or_none(none_means: str | None) -> str:
    return "" if none_means is None else f", or None for {none_means}"


@overload
def check_positive_int(name: str, value: object) -> int: ...
@overload
def check_positive_int(name: str, value: object, *, none_means: str) -> int | None: ...
def check_positive_int(name: str, value: object, *, none_means: str | None = None) -> int | None:
    """``value`` if it is an int of at least 1 (a bool is not), or ``None`` when
    ``none_means`` is given."""
    if value is None and none_means is not None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"{name} must be an int{_or_none(none_means)}, got {type(value).__name__} ({value!r})"
        )
    if value < 1:
        raise ValueError(f"{name} must be at least 1{_or_none(none_means)}, got {value}")
    return value


@overload
def check_positive_number(
    name: str, value: object, *, meaning: str = "", dtype: torch.dtype = torch.float32
) -> float: ...
@overload
def check_positive_number(
    name: str, value: object, *, meaning: str = "", none_means: str, dtype: torch.dtype = ...
) -> float | None: ...
def check_positive_number(
    name: str,
    value: object,
    *,
    meaning: str = "",
    none_means: str | None = None,
    dtype: torch.dtype = torch.float32,
) -> float | None:
    """``float(value)`` if it is a real number (a bool is not) above 0, finite, and no
    larger than the largest ``dtype`` value, the dtype it will be used in (float32: about
    3.4e38; ``1e300`` is finite as a Python float but overflows there). ``None`` when
    ``none_means`` is given. ``meaning`` says what the number is, for the message."""
    if value is None and none_means is not None:
        return None
    about = f" ({meaning})" if meaning else ""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"{name} must be a number{about}{_or_none(none_means)}, got "
            f"{type(value).__name__} ({value!r})"
        )
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be positive and finite{_or_none(none_means)}, got {value!r}")
    largest = torch.finfo(dtype).max
    if value > largest:
        raise ValueError(
            f"{name} is {value!r}, more than {dtype} holds (at most {largest:.4g}), the dtype it "
            "is used in: give a smaller value"
        )
    return float(value)


def _listed(choices: Sequence[str]) -> str:
    if len(choices) == 2:
        return f"{choices[0]!r} or {choices[1]!r}"
    return f"one of {list(choices)}"


def check_choice(
    name: str, value: object, choices: Sequence[str], *, aliases: Mapping[str, str] | None = None
) -> str:
    """``value`` if it is one of the strings ``choices`` (a mode such as ``nonfinite``).

    ``TypeError`` for a value that is not a string, ``ValueError`` for another string; a
    string found in ``aliases`` (another library's name for a choice) is named in the
    message as the choice it stands for, never accepted silently."""
    if not isinstance(value, str):
        raise TypeError(
            f"{name} must be a string, {_listed(choices)}, got {type(value).__name__} {value!r}"
        )
    if value not in choices:
        alias = (aliases or {}).get(value.strip().lower())
        hint = f"; did you mean {name}={alias!r}?" if alias else ""
        raise ValueError(f"{name} must be {_listed(choices)}, got {value!r}{hint}")
    return value


def check_bool(name: str, value: object) -> bool:
    """``value`` if it is ``True`` or ``False`` (not 0, 1 or a string)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return value


def check_callable_or_none(name: str, value: T) -> T:
    """``value`` if it is callable or ``None``."""
    if value is not None and not callable(value):
        raise TypeError(f"{name} must be callable or None, got {type(value).__name__}")
    return value


def check_instance(
    name: str, value: object, kind: type[T] | tuple[type[T], ...], what: str, *, none_ok: bool = False
) -> T:
    """``value`` if it is an instance of ``kind`` (or ``None`` with ``none_ok``); ``what``
    names the kind for the message (``"a torch.nn.Module"``)."""
    if value is None and none_ok:
        return value  # type: ignore[return-value]
    if not isinstance(value, kind):
        or_none = " or None" if none_ok else ""
        raise TypeError(f"{name} must be {what}{or_none}, got {type(value).__name__}")
    return value


def check_methods(
    name: str,
    value: T,
    methods: Collection[str],
    *,
    example: str,
    none_ok: bool = False,
) -> T:
    """``value`` if it has every one of ``methods`` (written as calls: ``"step()"``,
    ``"count(batch)"``) as a callable attribute, or is ``None`` with ``none_ok``.
    ``example`` names an object that has them."""
    if value is None and none_ok:
        return value
    names = [m.split("(", 1)[0] for m in methods]
    names_text = " and ".join(methods)
    if not all(callable(getattr(value, n, None)) for n in names):
        listed = f"a {names_text} method" if len(names) == 1 else f"{names_text} methods"
        or_none = ", or be None" if none_ok else ""
        raise TypeError(
            f"{name} must have {listed}, such as {example}{or_none}, got {type(value).__name__}"
        )
    return value


def check_finite_hyperparameters(optimizer: torch.optim.Optimizer) -> None:
    """``ValueError`` naming the group and key of a number among the optimizer's
    hyper-parameters (``lr``, ``betas``, ``weight_decay``, ...) that is not finite
    (``inf``, ``nan``: every update would turn the weights into ``nan``) or that is larger
    than the dtype of the group's parameters holds (``lr=1e300`` with float32 weights:
    the step cannot even be computed)."""
    for i, group in enumerate(optimizer.param_groups):
        dtypes = {p.dtype for p in group["params"] if p.is_floating_point()}
        largest = min((torch.finfo(d).max for d in dtypes), default=math.inf)
        for key, value in group.items():
            if key == "params":
                continue
            for v in value if isinstance(value, (list, tuple)) else [value]:
                if isinstance(v, torch.Tensor) and v.numel() == 1:
                    v = v.item()
                if not isinstance(v, numbers.Real) or isinstance(v, bool):
                    continue
                where = f"optimizer.param_groups[{i}][{key!r}] is {value!r}"
                if not math.isfinite(v):
                    raise ValueError(
                        f"{where}; hyper-parameters must be finite numbers: build the optimizer "
                        "with a finite value"
                    )
                if abs(v) > largest:
                    kind = " or ".join(sorted(str(d) for d in dtypes))
                    raise ValueError(
                        f"{where}, more than {kind} (its parameters' dtype) holds (at most "
                        f"{largest:.4g}): build the optimizer with a smaller value"
                    )
