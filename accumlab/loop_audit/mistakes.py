"""The loop audit's names, read from the shared table (:mod:`accumlab.mistakes`), and what
the audit does not check."""

from __future__ import annotations

from ..mistakes import MISTAKES as _TABLE
from ..mistakes import reported_by

#: Every name ``AuditReport.mistakes`` can hold, in the order they are reported.
MISTAKES: tuple[str, ...] = reported_by("loop")

#: For each mistake: the symptom a user sees in a real run, and the fix.
ADVICE: dict[str, tuple[str, str]] = {
    name: (_TABLE[name].symptom, _TABLE[name].fix) for name in MISTAKES
}

#: What the audit does not check, said in every report.
NOT_CHECKED = (
    "Not checked by the audit: non-finite gradients and loss scaling, mixed precision, "
    "clipping, data-parallel averaging and no_sync, and your own model, data and optimizer "
    "(it runs the loop on its float64 model, SGD and controlled set)."
)
