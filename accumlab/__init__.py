"""accumlab: gradient accumulation in PyTorch, exact and counted.

The core rule: every microbatch backpropagates ``loss_sum × D / count(window, all
replicas)`` and the optimizer steps once per window.
"""

from .checks import GradientComparison, compare, compare_gradients, gradients, split_batch
from .ledger import Ledger, RunRecord, UpdateReport
from .loop import accumulate, train, train_window
from .objectives import ExampleLoss, NextTokenLoss, Objective
from .plan import AccumulationPlan, Window
from .precision import PrecisionPolicy, precision_policy

__version__ = "0.1.0"

__all__ = [
    "AccumulationPlan",
    "ExampleLoss",
    "GradientComparison",
    "Ledger",
    "NextTokenLoss",
    "Objective",
    "PrecisionPolicy",
    "RunRecord",
    "UpdateReport",
    "Window",
    "accumulate",
    "compare",
    "compare_gradients",
    "gradients",
    "precision_policy",
    "split_batch",
    "train",
    "train_window",
]
