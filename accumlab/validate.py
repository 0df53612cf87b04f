"""Argument checks, one helper per kind of check, so every public function words the same
mistake the same way.

Each helper returns the value it accepted and raises a ``TypeError`` (the wrong kind of
value) or a ``ValueError`` (the right kind, a wrong value) whose message starts with the
argument's name, says what is accepted and shows what was given. Where ``None`` is
accepted, ``none_means`` says what it stands for ("no clipping"). Imports torch only:
the core uses it.
"""

from __future__ import annotations

import inspect
import math
import numbers
import os
import sys
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, TypeVar, overload

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
    fix: str = "",
) -> T:
    """``value`` if it has every one of ``methods`` as a callable attribute that can be
    called as written (``"step()"``: with no argument; ``"count(batch)"``: with one), or is
    ``None`` with ``none_ok``. ``example`` names an object that has them; ``fix`` says
    what to do with an object whose method needs other arguments (``ReduceLROnPlateau``'s
    ``step(metrics)`` for ``"step()"``). A method whose signature Python cannot read is
    taken as it is."""
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
    for method, attribute in zip(methods, names, strict=True):
        given = method.split("(", 1)[1].rstrip(")").strip()
        arguments = len(given.split(",")) if given else 0
        problem = _call_problem(getattr(value, attribute), arguments)
        if problem is not None:
            raise TypeError(
                f"{name}.{method} cannot be called that way: {type(value).__name__}."
                f"{attribute}() {problem}{'. ' + fix if fix else ''}"
            )
    return value


def _call_problem(method: Callable[..., Any], arguments: int) -> str | None:
    """Why ``method`` cannot be called with ``arguments`` positional arguments (its
    missing parameters, or too many given), or ``None`` when it can or when its signature
    cannot be read."""
    try:
        signature = inspect.signature(method)
    except (TypeError, ValueError):  # a builtin or an extension method: nothing to read
        return None
    try:
        signature.bind(*range(arguments))
    except TypeError:
        params = list(signature.parameters.values())
        positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        required = [p.name for p in positional[arguments:] if p.default is p.empty] + [
            p.name for p in params if p.kind is p.KEYWORD_ONLY and p.default is p.empty
        ]
        if required:
            return f"also needs {', '.join(required)}"
        return f"takes {len(positional)} argument(s), not {arguments}"
    return None


def unusable_hyperparameter(optimizer: torch.optim.Optimizer) -> str | None:
    """The first of the optimizer's hyper-parameters an update cannot use, described
    (``"optimizer.param_groups[0]['lr'] is nan; a learning rate must be a finite
    number"``), or ``None``: a number among them (``lr``, ``betas``, ``weight_decay``,
    ...; a one-element tensor counts as its number) that is not finite (every update
    would turn the weights into ``nan``), or a learning rate below 0 (each update would
    climb the loss). Reads the groups' values only, never a parameter: cheap enough for
    every update attempt (``train_window`` calls it before each step)."""
    for i, group in enumerate(optimizer.param_groups):
        for key, value in group.items():
            if key == "params":
                continue
            where = f"optimizer.param_groups[{i}][{key!r}] is {value!r}"
            for v in _numbers(value):
                if not math.isfinite(v) and key == "lr":
                    return f"{where}; a learning rate must be a finite number"
                if not math.isfinite(v):
                    return f"{where}; hyper-parameters must be finite numbers"
                if v < 0 and key == "lr":
                    return f"{where}; a learning rate must be 0 or more"
    return None


def _numbers(value: object) -> list[float]:
    """The real numbers in a hyper-parameter's value: itself, a one-element tensor's
    number, or those of a list or tuple (``betas``); bools and anything else are not."""
    found = []
    for v in value if isinstance(value, (list, tuple)) else [value]:
        if isinstance(v, torch.Tensor) and v.numel() == 1:
            v = v.item()
        if isinstance(v, numbers.Real) and not isinstance(v, bool):
            found.append(float(v))
    return found


def check_hyperparameters(optimizer: torch.optim.Optimizer) -> None:
    """``ValueError`` naming the group and key of a hyper-parameter an update cannot use
    (:func:`unusable_hyperparameter`: not finite, or a learning rate below 0) or of one
    larger than the dtype of the group's parameters holds (``lr=1e300`` with float32
    weights: the step cannot even be computed)."""
    problem = unusable_hyperparameter(optimizer)
    if problem is not None:
        raise ValueError(f"{problem}: build the optimizer with a usable value")
    for i, group in enumerate(optimizer.param_groups):
        dtypes = {p.dtype for p in group["params"] if p.is_floating_point()}
        largest = min((torch.finfo(d).max for d in dtypes), default=math.inf)
        for key, value in group.items():
            if key != "params" and any(abs(v) > largest for v in _numbers(value)):
                kind = " or ".join(sorted(str(d) for d in dtypes))
                raise ValueError(
                    f"optimizer.param_groups[{i}][{key!r}] is {value!r}, more than {kind} (its "
                    f"parameters' dtype) holds (at most {largest:.4g}): build the optimizer "
                    "with a smaller value"
                )


_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def outside_stacklevel() -> int:
    """The ``stacklevel`` for ``warnings.warn`` that names the first line outside accumlab
    (the user's call), however deep in the package the warning is raised; call it from
    the function that warns."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    return level
