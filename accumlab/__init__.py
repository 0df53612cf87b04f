"""accumlab: gradient accumulation in PyTorch, exact and counted.

The rule every microbatch follows, and the loop that keeps it, are in :mod:`accumlab.loop`;
docs/ARCHITECTURE.md maps the package.
"""

from ._torch_version import check_torch_version

# Before the submodules: on an older torch they would fail on a missing API instead.
check_torch_version()

from . import distributed, parallel
from .checkpoint import (
    CheckpointDirectoryInUseError,
    CheckpointFormatError,
    CorruptCheckpointError,
    ResumeMismatchError,
)
from .checks import (
    GradientComparison,
    compare,
    compare_gradients,
    gradients,
    gradients_finite,
    inject_nonfinite,
    split_batch,
)
from .chunked_loss import ChunkedNextTokenLoss
from .distributed import ExampleIdCheck, check_example_ids, launch
from .driver import train
from .invariance import InvarianceReport, Split, split_invariance
from .ledger import Ledger
from .loop import accumulate, train_window
from .loop_audit.report import AuditReport
from .loop_audit.run import audit
from .memory import MemoryMeter
from .objectives import ExampleLoss, NextTokenLoss, Objective
from .oom import CannotShrinkError
from .plan import AccumulationPlan, Window, data_parallel_size
from .precision import (
    PRECISIONS,
    PrecisionPolicy,
    precision_policy,
    resolve_scaler,
    scaler_settings,
)
from .record import RunRecord
from .report import UpdateReport

__version__ = "0.1.0"

__all__ = [
    "AccumulationPlan",
    "AuditReport",
    "CannotShrinkError",
    "CheckpointDirectoryInUseError",
    "CheckpointFormatError",
    "ChunkedNextTokenLoss",
    "CorruptCheckpointError",
    "ExampleIdCheck",
    "ExampleLoss",
    "GradientComparison",
    "InvarianceReport",
    "Ledger",
    "MemoryMeter",
    "NextTokenLoss",
    "Objective",
    "PRECISIONS",
    "PrecisionPolicy",
    "ResumeMismatchError",
    "RunRecord",
    "Split",
    "UpdateReport",
    "Window",
    "accumulate",
    "audit",
    "check_example_ids",
    "compare",
    "compare_gradients",
    "data_parallel_size",
    "distributed",
    "gradients",
    "gradients_finite",
    "inject_nonfinite",
    "launch",
    "parallel",
    "precision_policy",
    "resolve_scaler",
    "scaler_settings",
    "split_batch",
    "split_invariance",
    "train",
    "train_window",
]
