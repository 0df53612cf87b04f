"""Split invariance: the one engine every job is checked by, whatever runs it.

A correct window-level objective gives the same gradient for the same examples however
they are split into microbatches: the window's loss is a sum over its examples (tokens,
pairs) divided once by the window's count. The engine checks that property on the job's
own code, with no reference forward pass and no knowledge of the loss: it runs the same
examples at several :class:`Split` s (``(N, 1)``, ``(m, A)``, ``(1, N)`` and a short last
window) from the same weights and random state, fits each gradient to the reference's by
least squares, and names what differs from the one table, :mod:`accumlab.mistakes`
(``double_division``, ``sum_of_means``, ``average_of_averages``,
``short_window_divided_by_a``, ``depends_on_split``; against an intended objective
``wrong_normalization`` and ``not_token_mean``).

**How an adapter plugs in.** An adapter provides one callable,
``run(split) -> gradient``: "run the window at this split from the same weights and
random state, without a step, and give me the gradient" (one tensor or ``None`` per
trainable parameter, always in the same order; the engine reads it before the next call,
so it may be the parameters' own ``.grad``). Optionally ``objective(split) -> gradient``,
the intended objective's gradient over the split's examples. The adapter calls
:func:`check_splits` ``(run, configured_split, objective=...)`` and gets an
:class:`InvarianceReport`; when its job cannot be checked it raises :class:`NotChecked`
from ``run`` (its message becomes the report's reason). :class:`ModelState` gives an
adapter the state handling every one needs (gradients set aside and put back, buffers,
modes and random states restored between runs, random draws and weight writes seen).
The adapters: :func:`accumlab.split_invariance` (plain PyTorch, Accelerate, torchtune- and
torchtitan-style window code: :mod:`.plain`), :mod:`accumlab.lightning` (a callback),
and the Trainer audit and RL trainers in :mod:`accumlab.hf`.

One idea per module, each importing only those listed before it (and the layers'
:mod:`accumlab.mistakes`, :mod:`accumlab.least_squares`, and the core's
:mod:`accumlab.objectives` and :mod:`accumlab.validate`):

- :mod:`.split`: :class:`Split` (microbatch sizes and the ``A`` the job divides by) and
  :func:`default_splits`;
- :mod:`.batches`: collated microbatches cut into rows and joined again
  (:func:`take_rows`, :func:`join_rows`, :class:`CannotJoin`), for adapters that see
  only what a data loader collated;
- :mod:`.gradients`: :class:`HeldGradient`, the one gradient copy, and the comparison
  (factor, relative error, residual), read in float64 chunks;
- :mod:`.report`: :class:`SplitMeasure` and :class:`InvarianceReport` with its text;
- :mod:`.names`: the name each comparison gives, and its evidence;
- :mod:`.engine`: :func:`check_splits`, the check's order of runs, :class:`NotChecked`;
- :mod:`.state`: :class:`ModelState`, the model put back between runs and after them;
- :mod:`.plain`: :func:`split_invariance`, the adapter for the user's own window code.
"""

from .batches import CannotJoin, join_rows, rows_in, take_rows
from .engine import TOLERANCES, NotChecked, Run, check_splits, default_tolerance
from .gradients import Comparison, Gradient, HeldGradient, compare
from .plain import split_invariance
from .report import NOT_CHECKED, InvarianceReport, SplitMeasure
from .split import Split, default_splits
from .state import ModelState, RandomState

__all__ = [
    "NOT_CHECKED",
    "TOLERANCES",
    "CannotJoin",
    "Comparison",
    "Gradient",
    "HeldGradient",
    "InvarianceReport",
    "ModelState",
    "NotChecked",
    "RandomState",
    "Run",
    "Split",
    "SplitMeasure",
    "check_splits",
    "compare",
    "default_splits",
    "default_tolerance",
    "join_rows",
    "rows_in",
    "split_invariance",
    "take_rows",
]
