"""``audit``: run the user's window loop on the controlled set under an
:class:`~accumlab.loop_audit.trace.UpdateTrace`, and return the verdict."""

from __future__ import annotations

import copy
import gc
import inspect
import warnings
from collections.abc import Callable
from typing import Any

import torch

from .contributions import Contributions
from .controlled_set import AUDIT_LR, AuditLM, audit_windows, window_rows
from .report import AuditReport
from .trace import UpdateTrace, flat, window_changes
from .verdict import verdict


def _check_loop(fn: object) -> None:
    if not callable(fn):
        raise TypeError(
            f"audit needs your window function, train_one_window(model, optimizer, scheduler, "
            f"window), got a {type(fn).__name__}"
        )
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # a callable whose signature Python cannot read: let the call decide
    try:
        signature.bind(None, None, None, None)
    except TypeError:
        raise TypeError(
            f"train_one_window must accept four arguments (model, optimizer, scheduler, "
            f"window); {getattr(fn, '__name__', fn)!r} has the signature {signature}"
        ) from None


def audit(train_one_window: Callable[..., Any], *, seed: int = 0) -> AuditReport:
    """Check a training loop's window on a controlled set whose correct updates are known.

    ``train_one_window(model, optimizer, scheduler, window)`` is your code for one window:
    ``window`` is a list of microbatch dicts (``input_ids``, ``attention_mask``, ``labels``,
    right-padded, prompt and padding labels -100, labels not shifted) and ``model`` is
    called like a Hugging Face causal LM (it returns an object with ``.logits``; with
    ``labels=`` it also gives ``.loss``, a mean, or a sum over ``num_items_in_batch``).
    The audit calls it on four windows (4, 4, 4 and 3 microbatches, 30 examples, unequal
    target counts, some rows without a prompt so that their first label is a target) with
    a tiny float64 model, ``SGD`` without momentum (so an update is ``-lr × the gradient
    found by optimizer.step()``) and a ``LambdaLR`` scheduler with a constant factor. The
    loop may run the microbatches whole, row by row (padding kept or trimmed) or all in one
    forward pass, and may run extra forward passes without a backward pass (no-grad
    logging, an eval-mode pass). To measure, the audit then runs one forward and backward
    pass of its own per example (and per other set of weights or label shift the loop's
    updates need), so a correct loop costs 45 forward passes over 60 rows: the report
    counts them (``report.forward_passes``, ``report.rows_forwarded``). What it checks:

    - the gradient each ``optimizer.step()`` applies (read after its closure has run, when
      it is given one: Lightning runs a window's last microbatch there, an LBFGS loop its
      whole window), written as a combination of the correct per-example contributions
      (each taken at the weights its forward pass ran at); the weight of each example names
      double division (all ``1/A``), average of averages (``1/targets`` of the microbatch or
      of the example, or microbatch means weighted by their examples), a short window divided
      by the full ``A`` (the last window's microbatch means over the ``A`` of the full
      windows, as Lightning and Accelerate divide), ignored tokens (a denominator of
      positions or mask tokens, shifted or not, instead of targets), a count taken before
      the shift (a row's first label counted, as the window's divisor or as torchtune's
      factor on each microbatch's mean), lost microbatches (an example never trained, as when pairs of
      microbatches drop the last of an odd window), duplicated microbatches (trained
      twice), zero_grad inside the window (trained, then cleared), gradients carried over
      from earlier windows; when it is no combination of them, the same with targets not
      shifted or shifted twice names those;
    - ``optimizer.step`` and ``scheduler.step`` calls per window and their order (no
      update, step or scheduler per microbatch, scheduler stepped before the optimizer),
      ``zero_grad`` calls between a backward pass and the step that should use it, and a
      gradient that shrank between two backward passes of a window (a clip of a partial
      sum: ``clip_per_microbatch``; the window's weighting is then not read);
    - tensors created during a window that are still alive (after ``gc.collect()``) once
      the last window is done (kept references: from a window after the first, since the
      first may create what is made once, such as a cache), and tensors of the window the
      loop changed (labels shifted in place).

    ``report.ok`` is True only when nothing was found *and* every window's applied
    gradient matches the correct one within :data:`AUDIT_TOLERANCE` (1e-6 relative).

    What it does not check: non-finite gradients, loss scaling and skipped updates
    (GradScaler), mixed precision, the clipping threshold, data-parallel averaging
    (``× D``) and ``no_sync``, dropout or BatchNorm, and your own model, data loader,
    optimizer and learning rate: the loop runs on the audit's model, optimizer and data.
    Autocast leaves the float64 model alone, so a loop's mixed precision is not even
    exercised. A clip is seen only where it changes the controlled set's gradients: per
    microbatch it is named, once below the gradient norm it shows up in ``report.other``
    as updates scaled by a factor.

    Returns an :class:`AuditReport`. The global random state is left as it was.
    Exceptions from ``train_one_window`` propagate, with a note naming the window.
    """
    _check_loop(train_one_window)
    # Only objects created from here on are scanned by the gc.collect() below (a full
    # collection of a process that imported torch costs about 0.1 s); a caller's own
    # frozen objects are left alone.
    freeze = gc.get_freeze_count() == 0
    if freeze:
        gc.freeze()
    try:
        return _audit(train_one_window, seed)
    finally:
        if freeze:
            gc.unfreeze()


def _audit(train_one_window: Callable[..., Any], seed: int) -> AuditReport:
    windows = audit_windows(seed)
    rows = window_rows(windows)
    changed: list[str] = []
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AuditLM().double()
        reference = copy.deepcopy(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=AUDIT_LR, momentum=0.0)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda update: 1.0)
        trace = UpdateTrace(model, optimizer, scheduler, rows)
        starts = []
        for k, window in enumerate(windows):
            starts.append(trace.theta_index(flat(trace.params)))
            given = [{key: v.clone() for key, v in mb.items()} for mb in window]
            held = list(given)  # the dicts, even if the loop pops them from its list
            with trace.begin(k), warnings.catch_warnings():
                # The report names a scheduler.step() before optimizer.step()
                # (scheduler_before_optimizer) with the counts; the warning would repeat it.
                warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step")
                try:
                    train_one_window(model, optimizer, scheduler, given)
                except Exception as exc:
                    if hasattr(exc, "add_note"):  # Python 3.11+
                        exc.add_note(f"(raised by train_one_window on audit window {k})")
                    raise
            changed += window_changes(k, window, held)
            del given, held
        final = flat(trace.params)
        gc.collect()
        contributions = Contributions(reference, windows, rows, trace.thetas)
        return verdict(trace, contributions, starts, final, optimizer, changed)
