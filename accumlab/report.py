"""What one window did: the ``UpdateReport`` that ``train_window`` returns."""

from __future__ import annotations

from dataclasses import dataclass

#: ``UpdateReport.skipped_reason`` of an attempt skipped for a window without targets, and
#: for a non-finite gradient; that of an attempt skipped for a hyper-parameter the update
#: could not use starts with ``UNUSABLE_HYPERPARAMETER`` and names it, its value and the
#: update (``accumlab.validate.unusable_hyperparameter``).
NO_TARGETS = "no targets"
NONFINITE_GRADIENT = "non-finite gradient"
UNUSABLE_HYPERPARAMETER = "unusable hyper-parameter"


@dataclass
class UpdateReport:
    """One window's update attempt. Counts are this replica's; ``global_targets`` is the
    window's denominator, its unit count summed over all ``data_parallel_size`` replicas.

    ``backward_passes`` counts the microbatches the window ran, one forward and one
    backward pass each (0 for a window without targets on any replica, which runs none);
    ``padding_microbatches`` counts the zero-target ones among them that a data-parallel
    rank ran so that it synchronizes at the same index as its peers. ``loss`` is the
    window's mean loss per unit on this replica (``loss_sum / targets``, ``nan`` when it
    had none). ``grad_norm`` is the L2 norm of the combined, unscaled gradient before
    clipping. ``skipped_reason`` is ``None`` for an applied update, else ``NO_TARGETS``,
    ``NONFINITE_GRADIENT`` or a sentence that starts with ``UNUSABLE_HYPERPARAMETER``.
    ``scale_before`` and ``scale_after`` are the GradScaler's scale (``None`` without
    one). ``lr`` is the first parameter group's learning rate during the update.
    """

    index: int
    applied: bool
    examples: int
    targets: int
    global_targets: int
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
