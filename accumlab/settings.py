"""What ``train`` is asked to do: :class:`TrainSettings`, its keyword arguments in one
frozen dataclass, each checked once when it is built, and
:meth:`TrainSettings.check_objects`, the five objects it trains with checked against each
other and against the settings, which returns what every window of the run shares (the
run's ``loop.WindowSetup``).

Each check is a helper of :mod:`accumlab.validate`; the modes of one window are named in
:mod:`accumlab.loop`, the precisions in :mod:`accumlab.precision`. The ``Checkpointer``
(:mod:`accumlab.checkpoint`) and the ``Ledger`` read what they need from the settings. The
plan is checked against the setup's replicas and the other ranks by
``distributed.alignment.check_plan``, a collective, which ``train`` calls after these
local checks.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from .loop import (
    NONFINITE,
    SCHEDULER_FIX,
    SCHEDULER_PER,
    SYNC,
    Forward,
    WindowSetup,
    check_clip_grad_norm,
    window_setup,
)
from .objectives import Objective
from .plan import AccumulationPlan
from .precision import check_precision
from .report import UpdateReport
from .validate import (
    check_bool,
    check_callable_or_none,
    check_choice,
    check_hyperparameters,
    check_instance,
    check_methods,
    check_positive_int,
)

#: What ``train`` does when a window runs out of memory (``accumlab.oom``).
ON_OOM = ("raise", "shrink")


@dataclass(frozen=True)
class TrainSettings:
    """``train``'s keyword arguments, with ``train``'s defaults; building one checks them.

    Units: ``clip_grad_norm`` is the largest L2 norm of the combined, unscaled gradient
    (kept as a float; ``None``: no clipping); ``max_updates`` and ``checkpoint_every`` count
    update attempts of the whole run (resumed ones included; ``None``: no limit, a
    checkpoint after the last attempt only). ``checkpoint_dir`` is ``None`` (no
    checkpoints) or a non-empty path that is not an existing file; ``checkpoint_every``
    and ``resume=True`` need it. A bad value is a ``TypeError`` or ``ValueError`` naming
    it, before ``train`` reads any data.
    """

    scheduler: Any = None
    clip_grad_norm: float | None = None
    max_updates: int | None = None
    progress: bool = True
    forward: Forward | None = None
    precision: str = "fp32"
    scaler: torch.amp.GradScaler | None = None
    meter: Any = None
    nonfinite: Literal["skip", "raise"] = "skip"
    scheduler_per: Literal["applied", "attempt"] = "applied"
    on_update: Callable[[UpdateReport], None] | None = None
    on_oom: Literal["raise", "shrink"] = "raise"
    sync: Literal["window", "microbatch"] = "window"
    checkpoint_dir: str | os.PathLike[str] | None = None
    checkpoint_every: int | None = None
    resume: bool = False

    def __post_init__(self) -> None:
        check_methods(
            "scheduler",
            self.scheduler,
            ("step()",),
            example="a torch.optim.lr_scheduler scheduler",
            none_ok=True,
            fix=SCHEDULER_FIX,
        )
        clip = check_clip_grad_norm(self.clip_grad_norm)
        object.__setattr__(self, "clip_grad_norm", clip)  # frozen: set once, as a float
        check_positive_int("max_updates", self.max_updates, none_means="no limit")
        check_bool("progress", self.progress)
        check_callable_or_none("forward", self.forward)
        check_precision(self.precision)
        check_instance(
            "scaler", self.scaler, torch.amp.GradScaler, "a torch.amp.GradScaler", none_ok=True
        )
        check_methods(
            "meter",
            self.meter,
            ("phase(name, microbatch)",),
            example="accumlab.MemoryMeter('cpu')",
            none_ok=True,
        )
        check_choice("nonfinite", self.nonfinite, NONFINITE)
        check_choice("scheduler_per", self.scheduler_per, SCHEDULER_PER)
        check_callable_or_none("on_update", self.on_update)
        check_choice("on_oom", self.on_oom, ON_OOM)
        check_choice("sync", self.sync, SYNC)
        self._check_checkpoint_keywords()

    @classmethod
    def of_call(cls, arguments: Mapping[str, Any]) -> TrainSettings:
        """The settings among ``arguments``, a call's arguments by name (``train`` passes
        its ``locals()``): one field per keyword argument of ``train``, the same names,
        order and defaults (tests/driver/test_train_args.py holds them equal)."""
        return cls(**{f.name: arguments[f.name] for f in fields(cls)})

    def _check_checkpoint_keywords(self) -> None:
        directory = self.checkpoint_dir
        if directory is not None:
            path = "a path (str or os.PathLike)"
            check_instance("checkpoint_dir", directory, (str, os.PathLike), path, none_ok=True)
            if not os.fspath(directory):
                raise ValueError(
                    "checkpoint_dir is an empty path; give a directory such as 'runs/x'"
                )
            if Path(directory).exists() and not Path(directory).is_dir():
                shown = os.fspath(directory)
                raise ValueError(f"checkpoint_dir {shown!r} is a file, not a directory")
        last_only = "a checkpoint after the last update attempt only"
        every = check_positive_int("checkpoint_every", self.checkpoint_every, none_means=last_only)
        if every is not None and directory is None:
            raise ValueError(
                "checkpoint_every needs checkpoint_dir: where should the checkpoints go?"
            )
        if check_bool("resume", self.resume) and directory is None:
            raise ValueError(
                "resume=True needs checkpoint_dir, the directory of the run to continue"
            )

    def check_objects(
        self,
        model: nn.Module,
        batches: Iterable[Any],
        optimizer: torch.optim.Optimizer,
        plan: AccumulationPlan,
        objective: Objective,
    ) -> WindowSetup:
        """Check ``train``'s five objects, against each other and these settings, before
        any data is read, and return what every window of the run shares
        (``loop.window_setup``): the model's replicas, the precision policy, the
        parameters an update steps, these settings' modes, and the scaler the windows
        use: the one given, or under fp16 a new ``torch.amp.GradScaler`` for the model's
        device that serves the whole run (so the scale and its growth count carry across
        windows)."""
        check_instance("model", model, nn.Module, "a torch.nn.Module")
        if isinstance(batches, Mapping) or not isinstance(batches, Iterable):
            raise TypeError(
                "batches must be an iterable of microbatches (a list, a DataLoader, a "
                f"generator), got {type(batches).__name__}; to train on one batch, pass [batch]"
            )
        check_instance("optimizer", optimizer, torch.optim.Optimizer, "a torch.optim.Optimizer")
        check_hyperparameters(optimizer)
        check_instance("plan", plan, AccumulationPlan, "an AccumulationPlan")
        check_methods(
            "objective",
            objective,
            ("count(batch)", "loss_sum(output, batch)"),
            example="accumlab.NextTokenLoss() or accumlab.ExampleLoss()",
        )
        # A given scaler of the wrong type or device raises; a disabled one under fp16
        # warns, and the windows run without it.
        return window_setup(
            model,
            optimizer,
            precision=self.precision,
            scaler=self.scaler,
            clip_grad_norm=self.clip_grad_norm,
            nonfinite=self.nonfinite,
            scheduler_per=self.scheduler_per,
            sync=self.sync,
        )

    def window_options(self) -> dict[str, Any]:
        """The keyword arguments of ``train_window`` these settings give that the run's
        ``WindowSetup`` does not hold (``check_objects`` returns it): the same in every
        window (``index`` counts the windows)."""
        return {"scheduler": self.scheduler, "meter": self.meter, "forward": self.forward}
