"""Audit a Hugging Face ``Trainer``'s gradient accumulation: does the job, as configured,
give the full-batch gradient? (``pip install 'accumlab[hf]'``)

``audit_trainer(trainer, steps=1)`` runs the Trainer's own training path for ``steps``
windows and returns a :class:`TrainerAuditReport` (``ok``, ``mistakes``, ``scale``,
``relative_error``, ``fix``, ``logged``); ``AuditCallback`` checks a real run's first
updates. The pieces under them: :class:`~accumlab.hf.capture.TrainerCapture` (the
microbatches a Trainer trains on and a window's pre-clip gradient),
:func:`~accumlab.hf.audit.measured_report` (windows -> report),
:func:`~accumlab.hf.state.preserved_model` / ``preserved_trainer`` (leave things as they
were).

Modules, one idea each: ``capture`` (recording), ``objectives`` (the objectives the audit
knows, each microbatch cut into its examples), ``reference`` (the objective's gradient and
the weighting fits), ``verdict`` (names and evidence), ``diagnose`` (windows against the
reference), ``rows`` (a window's examples cut and joined), ``steps`` (the Trainer's own
steps at a split), ``generated`` (online RL's frozen buffer), ``invariance`` (the Trainer
adapter of the split-invariance engine, :mod:`accumlab.invariance`), ``logged`` (the
numbers the Trainer logs), ``fixes`` (pasteable fixes), ``report``, ``state`` (snapshot
and restore), ``audit`` (``audit_trainer``), ``callback`` (``AuditCallback``).
"""

from __future__ import annotations

try:
    import transformers as _transformers
except ImportError as _missing:
    if _missing.name != "transformers":  # installed, but it fails to import: say why
        raise ImportError(
            f"accumlab.hf: transformers is installed but fails to import ({_missing}); "
            "reinstall it with pip install 'accumlab[hf]'"
        ) from _missing
    raise ImportError(
        "accumlab.hf needs Hugging Face transformers: pip install 'accumlab[hf]'"
    ) from None

#: The oldest transformers the audit runs on: the first whose Trainer passes
#: num_items_in_batch (before it, every loss was a mean per microbatch divided by A).
OLDEST_TRANSFORMERS = "4.46"


def _too_old(version: str) -> bool:
    from packaging.version import Version

    return Version(Version(version).base_version) < Version(OLDEST_TRANSFORMERS)


if _too_old(_transformers.__version__):
    raise ImportError(
        f"accumlab.hf needs transformers >= {OLDEST_TRANSFORMERS} (the first Trainer with "
        f"num_items_in_batch), found {_transformers.__version__}: pip install -U 'accumlab[hf]'"
    )

from .audit import TESTED_TRANSFORMERS, audit_trainer, run_windows  # noqa: E402 (after the version check)
from .capture import CapturedWindow, Microbatch, TrainerCapture  # noqa: E402 (after the version check)
from .diagnose import diagnose  # noqa: E402 (after the version check)
from .objectives import TokenLoss  # noqa: E402 (after the version check)
from .report import TrainerAuditReport  # noqa: E402 (after the version check)
from .state import preserved_model, preserved_trainer  # noqa: E402 (after the version check)
from .verdict import CAUSES, TRAINER_MISTAKES  # noqa: E402 (after the version check)

TRANSFORMERS_VERSION: str = _transformers.__version__


def __getattr__(name: str) -> object:
    if name == "AuditCallback":  # lives in its own module, imported on first use
        from .callback import AuditCallback

        return AuditCallback
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "CAUSES",
    "TESTED_TRANSFORMERS",
    "TRAINER_MISTAKES",
    "TRANSFORMERS_VERSION",
    "AuditCallback",
    "CapturedWindow",
    "Microbatch",
    "OLDEST_TRANSFORMERS",
    "TokenLoss",
    "TrainerAuditReport",
    "TrainerCapture",
    "audit_trainer",
    "diagnose",
    "preserved_model",
    "preserved_trainer",
    "run_windows",
]
