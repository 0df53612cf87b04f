"""Audit a Hugging Face ``Trainer``'s gradient accumulation: does the job, as configured,
give the full-batch gradient? (``pip install 'accumlab[hf]'``)

``audit_trainer(trainer, steps=1)`` runs the Trainer's own training path for ``steps``
windows and returns a :class:`TrainerAuditReport` (``ok``, ``mistakes``, ``scale``,
``relative_error``, ``fix``). The pieces under it, for a Trainer callback:
:class:`~accumlab.hf.capture.WindowRecorder` (record the microbatches and the pre-clip
gradient of a window), :func:`~accumlab.hf.diagnose.diagnose` (windows -> report),
:func:`~accumlab.hf.state.preserved_model` / ``preserved_trainer`` (leave things as they were).

Modules: ``capture`` (recording), ``reference`` (the objective's gradient and the weighting
fits), ``verdict`` (names and evidence), ``fixes`` (pasteable fixes), ``report``,
``diagnose``, ``state`` (snapshot and restore), ``audit`` (``audit_trainer``).
"""

from __future__ import annotations

try:
    import transformers as _transformers
except ImportError:
    raise ImportError(
        "accumlab.hf needs Hugging Face transformers: pip install 'accumlab[hf]'"
    ) from None

from .audit import TESTED_TRANSFORMERS, audit_trainer, run_windows
from .capture import CapturedWindow, Microbatch, WindowRecorder
from .diagnose import diagnose
from .report import TrainerAuditReport
from .state import preserved_model, preserved_trainer
from .verdict import CAUSES, TRAINER_MISTAKES

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
    "TrainerAuditReport",
    "WindowRecorder",
    "audit_trainer",
    "diagnose",
    "preserved_model",
    "preserved_trainer",
    "run_windows",
]
