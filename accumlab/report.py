"""What one window did: the ``UpdateReport`` that ``train_window`` returns."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class UpdateReport:
    """One window's update attempt. Counts are this replica's; ``global_targets`` is the
    window's denominator, its unit count summed over all ``data_parallel_size`` replicas.

    ``loss`` is the window's mean loss per unit on this replica (``loss_sum / targets``,
    ``nan`` when it had none). ``grad_norm`` is the L2 norm of the combined, unscaled
    gradient before clipping. ``skipped_reason`` is ``None`` for an applied update,
    ``"no targets"`` or ``"non-finite gradient"`` otherwise. ``scale_before`` and
    ``scale_after`` are the GradScaler's scale (``None`` without one). ``lr`` is the first
    parameter group's learning rate during the update. ``padding_microbatches`` counts the
    zero-target microbatches (included in ``microbatches``) a data-parallel rank ran so
    that it synchronizes at the same index as its peers.
    """

    index: int
    applied: bool
    examples: int
    targets: int
    global_targets: int
    microbatches: int
    backward_passes: int
    loss: float
    loss_sum: float
    grad_norm: float
    lr: float | None = None
    scale_before: float | None = None
    scale_after: float | None = None
    skipped_reason: str | None = None
    data_parallel_size: int = 1
    padding_microbatches: int = 0
