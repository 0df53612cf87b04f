"""The audit of a user's window loop: run it on a controlled set whose correct updates are
known, and name what differs.

``audit(train_one_window)`` gives the loop a tiny float64 causal language model, an SGD
optimizer, a constant scheduler and four windows of microbatches, watches every forward
pass, backward pass, ``zero_grad``, ``optimizer.step`` and ``scheduler.step``, and writes
the gradient each ``optimizer.step`` found as a combination of the correct per-example
contributions (each example's summed next-token loss over its window's target count, at
the weights its forward pass ran at). The shares of that combination name the mistake:
all ``1/A`` is a double division, ``1/targets of the microbatch`` an average of
averages, 0 for an example never trained a lost microbatch, 2 for one trained twice a
duplicated microbatch, and so on. Everything is float64, so a correct loop matches to
about 1e-12 and the verdict's tolerance, :data:`AUDIT_TOLERANCE`, is 1e-6 relative.

The subpackage holds one idea per module:

- :mod:`.controlled_set`: the windows whose correct updates are known, the audit's model
  (:class:`AuditLM`) and the examples' counts (``_rows``);
- :mod:`.watch`: the hooks that record what the user's loop did, in order;
- :mod:`.shares`: the per-example contributions and the least-squares fit of each update
  as a combination of them, and the weightings a loop can give the examples;
- :mod:`.mistakes`: the vocabulary (:data:`MISTAKES`), each mistake's symptom and fix
  (:data:`ADVICE`), and what the audit does not check;
- :mod:`.verdict` and :mod:`.evidence`: the measurements turned into names, and the
  evidence each name quotes;
- :mod:`.report`: :class:`AuditReport` and :class:`WindowAudit`;
- :mod:`.run`: :func:`audit`, which runs the user's loop and returns the report.

Every name here is also re-exported by :mod:`accumlab.checks`.
"""

from .controlled_set import (
    AUDIT_LR,
    AUDIT_TOLERANCE,
    AUDIT_VOCAB,
    AUDIT_WINDOWS,
    AuditLM,
    AuditOutput,
    audit_windows,
)
from .mistakes import ADVICE, MISTAKES, NOT_CHECKED
from .report import AuditReport, WindowAudit
from .run import audit

__all__ = [
    "ADVICE",
    "AUDIT_LR",
    "AUDIT_TOLERANCE",
    "AUDIT_VOCAB",
    "AUDIT_WINDOWS",
    "MISTAKES",
    "NOT_CHECKED",
    "AuditLM",
    "AuditOutput",
    "AuditReport",
    "WindowAudit",
    "audit",
    "audit_windows",
]
