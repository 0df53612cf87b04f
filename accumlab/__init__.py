"""accumlab: gradient accumulation in PyTorch, exact and counted.

The core rule: every microbatch backpropagates ``loss_sum × D / count(window, all
replicas)`` and the optimizer steps once per window.
"""

from ._startup import guard_command_start

# First: in the `accumlab` command, Ctrl-C while torch imports is one line, exit 130.
guard_command_start()

from ._torch_version import check_torch_version

# Before the submodules: on an older torch they would fail on a missing API instead.
check_torch_version()

from . import distributed
from .checkpoint import (
    CheckpointDirectoryInUseError,
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
from .ledger import Ledger, RunRecord, scaler_settings
from .loop import accumulate, train_window
from .loop_audit.report import AuditReport
from .loop_audit.run import audit
from .memory import MemoryMeter
from .objectives import ExampleLoss, NextTokenLoss, Objective
from .oom import CannotShrinkError
from .plan import AccumulationPlan, Window, data_parallel_size
from .precision import PRECISIONS, PrecisionPolicy, precision_policy, resolve_scaler
from .report import UpdateReport

__version__ = "0.1.0"

__all__ = [
    "AccumulationPlan",
    "AuditReport",
    "CannotShrinkError",
    "CheckpointDirectoryInUseError",
    "ChunkedNextTokenLoss",
    "CorruptCheckpointError",
    "ExampleIdCheck",
    "ExampleLoss",
    "GradientComparison",
    "Ledger",
    "MemoryMeter",
    "NextTokenLoss",
    "Objective",
    "PRECISIONS",
    "PrecisionPolicy",
    "ResumeMismatchError",
    "RunRecord",
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
    "precision_policy",
    "resolve_scaler",
    "scaler_settings",
    "split_batch",
    "train",
    "train_window",
]
