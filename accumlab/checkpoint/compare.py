"""What a resume compares before it loads anything: the plan, the model, the world size,
the precision, the settings (optimizer, its parameters in order, its hyper-parameters,
clipping, seed), the scheduler (its own hyper-parameters and the learning rates it gives
over the updates already trained) and the data (a digest of each window).

A difference is a :class:`ResumeMismatchError` naming it, with the checkpoint's value and
the given one. What no comparison can see is listed in docs/RESUME.md.
"""

from __future__ import annotations

import copy
import hashlib
import math
import types
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..plan import AccumulationPlan

if TYPE_CHECKING:
    from ..settings import TrainSettings

_FIX = "Pass the values of the run that wrote it, or start a new run in another checkpoint_dir"


#: The value of a :class:`Difference` where one side has no such setting.
ABSENT = "absent"


@dataclass(frozen=True)
class Difference:
    """One thing a resume found changed. ``what`` names it: ``"plan.<field>"`` (e.g.
    ``"plan.micro_batch_size"``), ``"world_size"``, ``"precision"``, ``"scaler"``, a
    setting of :func:`run_settings` (``"seed"``, ``"clip_grad_norm"``, ``"optimizer"``,
    ...), ``"optimizer.param_groups[<i>].<key>"`` (e.g. ``"optimizer.param_groups[0].lr"``),
    ``"optimizer.params"`` (their number or order), ``"scheduler"``, ``"model"`` or
    ``"data"`` (a window read again holds other data). ``saved`` and ``now`` are the
    checkpoint's value and the given one (:data:`ABSENT` where a side has none; ``None``
    for what has no single value: the scheduler's replay, the model, the data). ``text``
    is the sentence the error gives for it."""

    what: str
    text: str
    saved: Any = None
    now: Any = None


class ResumeMismatchError(ValueError):
    """Resume refused: the run differs from the one that wrote the checkpoint. The
    message names each setting (or the first window of data) that differs, with the
    checkpoint's value and the given one, and the fix; ``differences`` holds each as a
    :class:`Difference` (empty for a refusal another rank made), for a caller that names
    them in its own words (the ``accumlab`` command names its flags)."""

    def __init__(self, message: str, differences: Iterable[Difference] = ()) -> None:
        super().__init__(message)
        self.differences = tuple(differences)


def _refused(found: list[Difference]) -> ResumeMismatchError:
    return ResumeMismatchError(
        "cannot resume from this checkpoint, the run differs from the one that wrote it: "
        + "; ".join(d.text for d in found) + f". {_FIX}",
        found,
    )


def _changed(saved: Mapping[str, Any], now: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    """``(key, saved value, given value)`` per key whose value differs (:data:`ABSENT`
    where a side lacks it), in the order of ``saved`` then ``now``."""
    keys = list(saved) + [k for k in now if k not in saved]
    return [
        (k, saved.get(k, ABSENT), now.get(k, ABSENT))
        for k in keys
        if k not in saved or k not in now or saved[k] != now[k]
    ]


def _shown(value: Any) -> str:
    return value if value is ABSENT else repr(value)


def _differences(saved: Mapping[str, Any], now: Mapping[str, Any], prefix: str = "") -> list[str]:
    """One line per key whose value differs, in the order of ``saved`` then ``now``."""
    return [f"{prefix}{k} {_shown(a)} in the checkpoint, {_shown(b)} now" for k, a, b in _changed(saved, now)]


def _shapes(state_dict: dict[str, Any]) -> dict[str, Any]:
    """Each entry's shape and dtype (the type name for a non-tensor entry)."""
    return {
        k: f"{list(v.shape)} {v.dtype}" if isinstance(v, torch.Tensor) else type(v).__name__
        for k, v in state_dict.items()
    }


def _plain(value: Any) -> Any:
    """A hyper-parameter as plain data: a tensor as its number(s), a tuple as a list."""
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def _class_name(obj: object) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def _parameter_names(model: nn.Module | None) -> dict[int, str]:
    return {} if model is None else {id(p): name for name, p in model.named_parameters()}


#: What of ``train``'s settings a resume must find unchanged, besides the plan, the model
#: and the precision (compared apart): the rest (``sync``, ``on_oom``, ``progress``, ...)
#: does not change what an update computes.
RESUMED_SETTINGS = ("clip_grad_norm", "scheduler_per", "nonfinite")


def run_settings(
    optimizer: torch.optim.Optimizer,
    settings: TrainSettings | None = None,
    *,
    model: nn.Module | None = None,
) -> dict[str, Any]:
    """What a checkpoint fixes besides the plan, model and precision, as plain data, read
    when ``train`` starts (before anything is loaded): the optimizer's class, its
    parameter groups' sizes, each parameter's shape in order (``param_shapes``) and, where
    ``model`` names it, its name (``param_names``, ``None`` for a tensor the model does not
    hold), the groups' hyper-parameters (everything but ``params``), the scheduler's class,
    the seed of torch's generator (``torch.initial_seed()``) and the
    :data:`RESUMED_SETTINGS` of ``settings`` (none without settings)."""
    names = _parameter_names(model)
    scheduler = None if settings is None else settings.scheduler
    return {
        "optimizer": _class_name(optimizer),
        "param_group_sizes": [len(g["params"]) for g in optimizer.param_groups],
        "param_shapes": [[list(p.shape) for p in g["params"]] for g in optimizer.param_groups],
        "param_names": [[names.get(id(p)) for p in g["params"]] for g in optimizer.param_groups],
        "hyperparameters": [
            {k: _plain(v) for k, v in g.items() if k != "params"} for g in optimizer.param_groups
        ],
        "scheduler": None if scheduler is None else _class_name(scheduler),
        "seed": torch.initial_seed(),
        **({} if settings is None else {k: getattr(settings, k) for k in RESUMED_SETTINGS}),
    }


_GROUP_DETAILS = ("hyperparameters", "param_group_sizes", "param_shapes", "param_names")
#: Optimizer switches that choose how the update is computed (a loop over the parameters,
#: one kernel over all of them), not what it is: a resume does not compare them.
IMPLEMENTATION_SWITCHES = frozenset({"foreach", "fused"})


def started_with(hyperparameters: Mapping[str, Any], moved: bool = True) -> dict[str, Any]:
    """A parameter group's hyper-parameters as the run started them, whatever a scheduler
    made of them since (``moved``: the scheduler given has stepped since it was built, as
    when the same objects are passed again in one process): ``lr`` is the
    ``initial_lr`` a torch scheduler keeps in the group (the lr it scales), and under a
    momentum-cycling scheduler (``OneCycleLR``, ``CyclicLR``: ``max_momentum`` in the
    group) ``momentum`` and the first of ``betas`` are its to move; its ``base_momentum``
    and ``max_momentum`` stay compared. Unmoved, the values are compared as they are
    (and the scheduler's replay compares the learning rates it gives). The
    :data:`IMPLEMENTATION_SWITCHES` (``foreach``, ``fused``) are left out either way."""
    started = {k: v for k, v in hyperparameters.items() if k not in IMPLEMENTATION_SWITCHES}
    if not moved:
        return started
    if "initial_lr" in started:
        started["lr"] = started.pop("initial_lr")
    if "max_momentum" in started:
        started.pop("momentum", None)
        if isinstance(started.get("betas"), list):
            started["betas"] = ["cycled by the scheduler", *started["betas"][1:]]
    return started


def _order_differences(saved: dict[str, Any], now: dict[str, Any]) -> list[Difference]:
    """The parameters whose shape or name differs at the same place of the same group
    (an optimizer over the same parameters in another order), the first three named.
    The group sizes are equal here."""
    found = []
    for i, group in enumerate(saved["param_shapes"]):
        for j, shape_then in enumerate(group):
            then = (saved["param_names"][i][j], shape_then)
            given = (now["param_names"][i][j], now["param_shapes"][i][j])
            named = then[0] is not None and given[0] is not None
            if then[1] != given[1] or (named and then[0] != given[0]):
                found.append(f"optimizer param_groups[{i}] params[{j}]: {_param(*then)} in the "
                             f"checkpoint, {_param(*given)} now")
    if not found:
        return []
    more = f" (and {len(found) - 3} more)" if len(found) > 3 else ""
    return [Difference("optimizer.params", text) for text in found[:3]] + [Difference(
        "optimizer.params",
        f"the optimizer holds the parameters in another order than the run that wrote the "
        f"checkpoint{more}: its state would land on other parameters; build it over them in "
        "the same order",
    )]


def _param(name: str | None, shape: list[int]) -> str:
    return f"{shape}" if name is None else f"{name!r} {shape}"


def scheduler_moved(scheduler: Any) -> bool:
    """Whether a torch scheduler has stepped since it was built (``last_epoch`` past 0,
    its own or that of a scheduler it chains, as ``ChainedScheduler`` does)."""
    last = getattr(scheduler, "last_epoch", None)
    nested = getattr(scheduler, "_schedulers", None) or []
    return (isinstance(last, int) and last > 0) or any(map(scheduler_moved, nested))


def _setting_differences(saved: dict[str, Any], now: dict[str, Any], moved: bool = False) -> list[Difference]:
    names = {"seed": "seed (torch.initial_seed())"}
    problems = [
        Difference(k, f"{names.get(k, k)}: {saved.get(k)!r} in the checkpoint, {now.get(k)!r} now",
                   saved.get(k, ABSENT), now.get(k, ABSENT))
        for k in list(saved) + [k for k in now if k not in saved]
        if k not in _GROUP_DETAILS and saved.get(k) != now.get(k)
    ]
    if saved["optimizer"] != now["optimizer"]:
        return problems  # other hyper-parameters of another optimizer say nothing more
    if saved["param_group_sizes"] != now["param_group_sizes"]:
        problems.append(Difference(
            "optimizer.params",
            f"optimizer parameters per group: {saved['param_group_sizes']} in the checkpoint, "
            f"{now['param_group_sizes']} now",
            saved["param_group_sizes"], now["param_group_sizes"],
        ))
        return problems
    problems += _order_differences(saved, now)
    for i, (before, after) in enumerate(zip(saved["hyperparameters"], now["hyperparameters"], strict=True)):
        problems += [
            Difference(f"optimizer.param_groups[{i}].{k}", f"optimizer param_groups[{i}]['{k}']: "
                       f"{_shown(a)} in the checkpoint, {_shown(b)} now", a, b)
            for k, a, b in _changed(started_with(before, moved), started_with(after, moved))
        ]
    return problems


# ---------------------------------------------------------------------------- the scheduler

#: Entries of a scheduler's ``state_dict()`` that move as it steps; the rest are its
#: hyper-parameters (``_schedulers``, those of the schedulers it chains, compared alike).
_MOVING = frozenset({
    "last_epoch", "_step_count", "_last_lr", "_get_lr_called_within_step", "_is_initial",
    "verbose", "T_cur", "T_i", "best", "num_bad_epochs", "cooldown_counter",
})


def scheduler_hyperparameters(state: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """A scheduler's ``state_dict()`` without what moves as it steps (``last_epoch``,
    ``_last_lr``, ...), as plain data: what it was built with (``T_max``, ``gamma``,
    ``milestones``, ``base_lrs``, a callable object's attributes, ...). A plain function
    (a ``LambdaLR`` lambda) is stored as ``None``: only the replay can see it."""
    if state is None:
        return None
    return {
        k: [scheduler_hyperparameters(s) for s in v] if k == "_schedulers" and isinstance(v, list)
        else _plain_deep(v)
        for k, v in state.items()
        if k not in _MOVING
    }


def _plain_deep(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _plain_deep(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and not isinstance(value, torch.Size):
        return [_plain_deep(v) for v in value]
    return _plain(value)


def recorded_lrs(state: Mapping[str, Any]) -> list[list[float]]:
    """The learning rate of every parameter group at each update attempt the checkpoint's
    run made (the ``lr`` each ``optimizer.step`` used): ``data_history["lrs"]``."""
    return [[float(v) for v in row] for row in state["data_history"]["lrs"].tolist()]


def _replayable(scheduler: Any) -> bool:
    """A torch scheduler as built (not stepped since), whose ``step()`` needs no metric."""
    base = getattr(torch.optim.lr_scheduler, "LRScheduler", None)
    return (
        base is not None
        and isinstance(scheduler, base)
        and getattr(scheduler, "last_epoch", None) == 0
    )


def _replayed_lrs(scheduler: Any, optimizer: torch.optim.Optimizer, steps: list[bool]) -> list[list[float]]:
    """The lr of each group at each attempt when a copy of ``scheduler`` (driving a copy
    of the optimizer's hyper-parameters, never the optimizer) steps after the attempts
    ``steps`` marks. The scheduler and optimizer given are left as they were."""
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    standin = types.SimpleNamespace(
        param_groups=[{**copy.deepcopy(g), "params": []} for g in groups],
        defaults=dict(optimizer.defaults),
        step=lambda *args, **kwargs: None,
        _opt_called=True,
    )
    replay = copy.deepcopy(scheduler, memo={id(optimizer): standin})
    lrs = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # step() before optimizer.step(): the stand-in has none
        for stepped in steps:
            lrs.append([float(_plain(g["lr"])) for g in standin.param_groups])
            if stepped:
                replay.step()
    return lrs


def _lrs_text(lrs: list[float]) -> str:
    shown = [f"{lr:.6g}" for lr in lrs]
    return shown[0] if len(shown) == 1 else f"[{', '.join(shown)}]"


def _same_lr(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=0.0)


def scheduler_differences(state: Mapping[str, Any], scheduler: Any, optimizer: torch.optim.Optimizer) -> list[str]:
    """How ``scheduler`` differs from the one of the checkpoint's run (same class): its
    hyper-parameters (:func:`scheduler_hyperparameters`), then, replayed over the update
    attempts already trained (when it is a torch scheduler as built), the first attempt
    where it gives another learning rate than the run used."""
    if scheduler is None or state.get("scheduler") is None:
        return []
    problems = [
        f"scheduler {d}" for d in _differences(
            scheduler_hyperparameters(state["scheduler"]) or {},
            scheduler_hyperparameters(scheduler.state_dict()) or {},
        )
    ]
    used = recorded_lrs(state)
    if problems or not used or not _replayable(scheduler):
        return problems
    per_attempt = state["settings"].get("scheduler_per") == "attempt"
    steps = [per_attempt or bool(r["applied"]) for r in state["ledger"]["reports"]][: len(used)]
    try:
        given = _replayed_lrs(scheduler, optimizer, steps)
    except Exception:  # a scheduler that cannot be copied or stepped apart: not replayed
        return problems
    for attempt, (then, now) in enumerate(zip(used, given, strict=True)):
        if not all(map(_same_lr, then, now)):
            problems.append(
                f"scheduler: replayed over the {len(used)} update attempts already trained, it "
                f"gives lr {_lrs_text(now)} at update attempt {attempt}, where the run "
                f"used {_lrs_text(then)} (another schedule: its "
                "lambda, T_max, milestones, warm-up?)"
            )
            break
    return problems


# ---------------------------------------------------------------------------- all of it


def check_compatible(
    state: dict[str, Any],
    *,
    plan: AccumulationPlan,
    model: nn.Module,
    world_size: int,
    precision: str,
    scaler: torch.amp.GradScaler | None,
    settings: dict[str, Any],
    scheduler: Any = None,
    optimizer: torch.optim.Optimizer | None = None,
) -> None:
    """Refuse a checkpoint the run cannot continue from exactly: :class:`ResumeMismatchError`
    naming each difference in the plan, the world size, the precision and scaler, the
    model's parameter and buffer names, shapes and dtypes, the ``settings``
    (:func:`run_settings`: the optimizer, its parameters in order, ...) and, given the
    ``scheduler`` and ``optimizer`` of the same classes, the scheduler
    (:func:`scheduler_differences`), each with the checkpoint's value and the given one."""
    found = [
        Difference(f"plan.{k}", f"plan: {k} {_shown(a)} in the checkpoint, {_shown(b)} now", a, b)
        for k, a, b in _changed(state["plan"], plan.to_dict())
    ]
    if state["world_size"] != world_size:
        found.append(Difference("world_size", f"world size: {state['world_size']} in the checkpoint, "
                                f"{world_size} now", state["world_size"], world_size))
    if state["precision"] != precision:
        found.append(Difference("precision", f"precision: {state['precision']!r} in the checkpoint, "
                                f"{precision!r} now", state["precision"], precision))
    scaling = scaler is not None and scaler.is_enabled()
    if bool(state["scaler"]) != scaling:
        found.append(Difference(
            "scaler",
            f"GradScaler: {'an enabled' if state['scaler'] else 'none'} in the checkpoint, "
            f"{'an enabled' if scaling else 'none'} now",
            bool(state["scaler"]), scaling,
        ))
    found += _setting_differences(state["settings"], settings, scheduler_moved(scheduler))
    same = state["settings"]["scheduler"] == settings["scheduler"] and (
        state["settings"]["optimizer"] == settings["optimizer"]
    )
    if optimizer is not None and same:
        found += [Difference("scheduler", text) for text in scheduler_differences(state, scheduler, optimizer)]
    model_diff = _differences(_shapes(state["model"]), _shapes(model.state_dict()))
    found += [Difference("model", f"model: {d}") for d in model_diff[:5]]
    if len(model_diff) > 5:
        found.append(Difference("model", f"model: and {len(model_diff) - 5} more differences"))
    if found:
        raise _refused(found)


# ---------------------------------------------------------------------------- the data


_DIGEST_BYTES = 1 << 16  # of each CPU tensor, for data without example ids


def window_digest(microbatches: Iterable[Any]) -> int:
    """A 64-bit digest (signed, to fit an int64 tensor) of what a window's microbatches
    hold: their ``example_ids`` when they have them, else each tensor's dtype and shape
    and the first 64 KiB of its bytes when it is on the CPU (only dtype and shape when
    it is not). Two windows with the same digest hold the same examples in the same order
    (same ids), or, without ids, start with the same bytes."""
    digest = hashlib.blake2b(digest_size=8)

    def feed(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            digest.update(f"T{value.dtype}{list(value.shape)}:".encode())
            if value.device.type == "cpu":
                flat = value.detach().contiguous().reshape(-1).view(torch.uint8)
                digest.update(flat[:_DIGEST_BYTES].numpy().data)
        elif isinstance(value, Mapping):
            ids = value.get("example_ids")
            items = [("example_ids", ids)] if isinstance(ids, torch.Tensor) else sorted(value.items(), key=lambda kv: str(kv[0]))
            for key, item in items:
                digest.update(f"k{key}:".encode())
                feed(item)
        elif isinstance(value, (list, tuple)):
            digest.update(f"l{len(value)}:".encode())
            for item in value:
                feed(item)
        elif value is None or isinstance(value, (bool, int, float, str)):
            digest.update(f"v{value!r};".encode())
        else:
            digest.update(f"o{type(value).__qualname__};".encode())  # never an address

    for microbatch in microbatches:
        digest.update(b"|")
        feed(microbatch)
    return int.from_bytes(digest.digest(), "little", signed=True)


def _real_microbatches(window: Any) -> list[Any]:
    """The loader microbatches of an aligned window: trained ones (no padding) and dropped ones."""
    return [*window.microbatches[: len(window.microbatches) - window.padding], *window.dropped]


def _ids_hint(window: Any) -> str:
    ids = [
        int(i)
        for mb in _real_microbatches(window)
        if isinstance(mb, Mapping) and isinstance(mb.get("example_ids"), torch.Tensor)
        for i in mb["example_ids"].reshape(-1)[:8]
    ]
    return f" (its example ids now begin {ids[:8]})" if ids else ""


def _loader_state(batches: object) -> Any:
    """The loader's own position (``state_dict()``) when it has one, else ``None``."""
    if callable(getattr(batches, "state_dict", None)) and callable(
        getattr(batches, "load_state_dict", None)
    ):
        return batches.state_dict()  # type: ignore[attr-defined]
    return None


