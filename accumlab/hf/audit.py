"""``audit_trainer``: run a Trainer's own training path for a few windows, measure, restore.

The Trainer's pieces run as its training loop calls them: ``get_train_dataloader`` (its
sampler, collator and, under data parallelism, Accelerate's sharding),
``get_batch_samples`` (its ``num_items_in_batch``), and ``training_step`` under
``accelerator.no_sync`` for every microbatch but a window's last (its ``compute_loss``,
``compute_loss_func``, division by the accumulation steps, autocast and the DDP gradient
sync). A subclass's overrides of any of them run. The optimizer, the scheduler, clipping
and callbacks are never called; the weights stay at their starting values for every
audited window.
"""

from __future__ import annotations

from typing import Any

from torch.utils.data import IterableDataset

from ..objectives import Objective
from .capture import CapturedWindow, TrainerCapture, unwrapped_model
from .diagnose import diagnose, tolerances
from .invariance import split_invariance
from .logged import logged_numbers
from .report import TrainerAuditReport
from .state import preserved_trainer
from .steps import batch_samples, train_window

#: The transformers releases the tests run the audit under, exactly: 4.46.3 (the first with
#: num_items_in_batch), 4.50.3 and 4.57.6 (tests/hf/test_hf_audit_versions.py, each in a
#: folder of its own, in a subprocess) and 5.24.0 (the environment's, every other test).
#: Under any other release, reports carry a note.
TESTED_TRANSFORMERS: tuple[str, ...] = ("4.46.3", "4.50.3", "4.57.6", "5.24.0")


def _version_note() -> str | None:
    """A note when the imported transformers is not one of :data:`TESTED_TRANSFORMERS`."""
    import transformers

    if transformers.__version__ in TESTED_TRANSFORMERS:
        return None
    return (
        f"transformers {transformers.__version__} is not a release the audit is tested with "
        f"({', '.join(TESTED_TRANSFORMERS)}): the verdict is measured, but the fix may not "
        "apply as written"
    )


def _check_arguments(trainer: Any, steps: int, objective: Any) -> None:
    """Raise a one-line ``TypeError``/``ValueError`` for input the audit cannot run on."""
    from transformers import Trainer

    if not isinstance(trainer, Trainer):
        raise TypeError(
            f"trainer must be a transformers.Trainer (or a subclass), got {type(trainer).__name__}"
        )
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive int (optimizer steps to audit), got {steps!r}")
    if objective is not None and not (
        callable(getattr(objective, "count", None))
        and callable(getattr(objective, "loss_sum", None))
    ):
        raise TypeError(
            "objective must be None (inferred from the model) or an accumlab Objective with "
            "count(batch) and loss_sum(output, batch), e.g. accumlab.NextTokenLoss(); got "
            f"{type(objective).__name__}"
        )
    if trainer.train_dataset is None:
        raise ValueError(
            "trainer has no train_dataset: pass train_dataset= to the Trainer; the audit runs "
            "the Trainer's own training data"
        )
    if trainer.args.max_steps == 0:
        raise ValueError(
            "trainer.args.max_steps is 0: the Trainer would take no optimizer step, so there is "
            "nothing to audit; set max_steps to -1 (epochs decide) or a positive number"
        )


def _checkpointing(model: Any) -> bool:
    """Whether activation (gradient) checkpointing is on, under either attribute name."""
    if hasattr(model, "is_activation_checkpointing"):  # transformers 5.x; the old name warns
        return bool(model.is_activation_checkpointing)
    return bool(getattr(model, "is_gradient_checkpointing", False))


def _checkpointing_note(trainer: Any) -> str | None:
    """What the report says about activation checkpointing, when it is asked for."""
    if _checkpointing(trainer.model):
        return (
            "activation checkpointing is on: its backward recomputes each forward pass with "
            "the same RNG state, so the replayed reference still matches"
        )
    args = trainer.args
    asked = getattr(args, "activation_checkpointing", None)  # transformers 5's name
    if asked if asked is not None else getattr(args, "gradient_checkpointing", False):
        return (
            "activation checkpointing is asked for in args: the Trainer turns it on inside "
            "train(), so the audited windows ran without it (it changes memory, not the gradient)"
        )
    return None


#: Why a DeepSpeed job is not checked (found out with DeepSpeed 0.19.8 at ZeRO 0-2 on CPU:
#: the Trainer runs; the engine steps inside ``accelerator.backward`` at the window's last
#: microbatch, and ZeRO 1-2 keep the gradient in their partitions).
DEEPSPEED = (
    "DeepSpeed steps the optimizer inside accelerator.backward at the window's last "
    "microbatch (ZeRO 1-2 keep the gradient in their partitions), so there is no window "
    "gradient to read: audit the same Trainer built without the deepspeed argument; "
    "DeepSpeed's own gradient_clipping (1.0 unless its config sets it) is then not checked"
)


def unmeasurable(trainer: Any, *, in_run: bool = False) -> str | None:
    """Why the audit cannot measure this job, or None when it can; the one list
    :func:`audit_trainer` and the callback (``in_run``: inside ``trainer.train()``, whose
    own data the callback reads, so an iterable dataset is fine there) both use."""
    model = trainer.model
    params = list(model.parameters())
    if any(p.device.type == "meta" for p in params):
        return (
            "the model has parameters on the meta device (no values to train): "
            "load its weights first"
        )
    if not any(p.requires_grad for p in params):
        return (
            "the model has no trainable parameter (every requires_grad is False): "
            "nothing to accumulate"
        )
    if getattr(trainer, "is_deepspeed_enabled", False):
        return DEEPSPEED
    if getattr(trainer, "is_fsdp_enabled", False) or getattr(trainer, "is_fsdp_xla_enabled", False):
        return "FSDP shards the gradient inside Accelerate's plugin: the audit cannot read it"
    if not in_run and isinstance(trainer.train_dataset, IterableDataset):
        return (
            "the training set is an iterable dataset: the examples the audit would read cannot be "
            "put back, so the run after it would miss them"
        )
    if getattr(trainer.args, "n_gpu", 1) > 1:
        return (
            "torch.nn.DataParallel (several GPUs in one process) is not audited: "
            "launch with torchrun"
        )
    return None


def _training_model(trainer: Any) -> Any:
    """The model ``training_step`` gets: the wrapped one when train() already ran, else the
    model prepared by Accelerate (DDP under torchrun, autocast under bf16/fp16); the
    caller's :func:`preserved_trainer` undoes what preparing changes."""
    if trainer.model_wrapped is not trainer.model:
        return trainer.model_wrapped
    return trainer.accelerator.prepare_model(trainer.model)


def trainer_grad_norm(trainer: Any, model: Any) -> None:
    """Compute the window's gradient norm the way the Trainer's loop does for its log (the
    capture notes it): ``_get_grad_norm`` after any clip where the release has it, else
    the clip's total when ``max_grad_norm`` > 0 (older releases log none without a clip).
    Not under a GradScaler: outside a run there is no optimizer to unscale with."""
    scaler = getattr(trainer.accelerator, "scaler", None)
    if scaler is not None and scaler.is_enabled():  # unscaled by the optimizer a run has
        return
    max_norm = trainer.args.max_grad_norm
    clips = max_norm is not None and max_norm > 0
    try:
        if hasattr(trainer, "_get_grad_norm"):
            total = (
                trainer._clip_grad_norm(model)
                if clips and hasattr(trainer, "_clip_grad_norm")
                else None
            )
            trainer._get_grad_norm(model, grad_norm=total)
        elif clips:
            trainer.accelerator.clip_grad_norm_(model.parameters(), max_norm)
    except Exception:  # noqa: BLE001 - the logged norm is then not checked; the update still is
        return


def run_windows(trainer: Any, steps: int) -> list[CapturedWindow]:
    """Run the first ``steps`` windows of the Trainer's training path and capture them.

    Call it inside :func:`accumlab.hf.state.preserved_trainer`: it changes the model's
    gradients, modes and the Trainer's attributes, and reads the RNG.
    """
    model = _training_model(trainer)
    accumulation = trainer.args.gradient_accumulation_steps
    loader = trainer.get_train_dataloader()
    iterator = iter(loader)
    capture = TrainerCapture()
    try:
        with capture.install(trainer):
            for _ in range(steps):
                batches, num_items = batch_samples(
                    trainer, iterator, accumulation, trainer.args.device
                )
                if not batches:
                    break
                capture.open_window()
                train_window(trainer, model, batches, num_items)
                trainer_grad_norm(trainer, model)  # closes the window before any clip
                capture.close_window(trainer.model)
                trainer.model.zero_grad(set_to_none=True)  # the window holds its .grad tensors
    finally:
        close = getattr(iterator, "close", None)
        if callable(close):
            close()
        del iterator
    if capture.broken:
        raise RuntimeError(capture.broken)
    return capture.windows


def invariance_report(
    trainer: Any, windows: list[CapturedWindow], unknown: TrainerAuditReport
) -> TrainerAuditReport:
    """The report for a job whose objective the audit does not know, or whose reference
    cannot run: split invariance of each window (:mod:`accumlab.hf.invariance`), run
    inside :func:`preserved_trainer`."""
    ok_tol, _ = tolerances(trainer)
    model = _training_model(trainer)
    results = [split_invariance(trainer, model, w, ok_tol) for w in windows if w.microbatches]
    return TrainerAuditReport.from_invariance(
        results, unknown.reason, ok_tol, trainer, unwrapped_model(trainer)
    )


def measured_report(
    trainer: Any, windows: list[CapturedWindow], objective: Objective | None = None
) -> TrainerAuditReport:
    """Captured windows to a report, shared by :func:`audit_trainer` and the callback:
    against the objective the job means (:func:`~accumlab.hf.diagnose.diagnose`), else
    by split invariance on the job's own path; then the numbers the Trainer logs
    (:mod:`accumlab.hf.logged`). The model must still hold the windows' weights."""
    report = diagnose(windows, trainer, objective=objective)
    if report.unknown_objective:
        with preserved_trainer(trainer):
            report = invariance_report(trainer, windows, report)
    if report.checked:
        report.logged = logged_numbers(report, windows, trainer)
    return report


def audit_trainer(
    trainer: Any, *, steps: int = 1, objective: Objective | None = None
) -> TrainerAuditReport:
    """Check that ``trainer``'s accumulation gives the full-batch gradient, as configured.

    Runs the Trainer's own training path (see the module docstring) for the first
    ``steps`` windows (optimizer steps) of its training data, takes each window's gradient
    after the data-parallel sync and before clipping, and compares it with the reference:
    the same examples, all ranks' together, as one batch under the objective the job means
    (token mean over shifted targets for a causal LM, example mean for one label per
    example; ``objective=`` to say it). A loss the audit does not know (a subclass's own,
    TRL's preference and RL losses), or a job whose reference cannot run (a model that
    needs its labels, a collator of its own), is checked by split invariance on the job's
    own path instead. The numbers the Trainer logs for the window (``loss``,
    ``grad_norm``) are checked too. Returns a
    :class:`~accumlab.hf.report.TrainerAuditReport`: ``ok``, ``mistakes``, ``scale``,
    ``relative_error``, ``fix``, ``logged`` and a readable ``str()``.

    Afterwards the trainer, model, optimizer, scheduler, RNG states (Python, NumPy, torch)
    and data position are as before the call, so it can run at the top of a training
    script. Under ``torchrun`` every rank must call it; every rank gets the same report.

    Cost: ``steps`` windows of the Trainer's forward and backward passes, then one more
    forward and backward pass per microbatch for the reference; memory: the recorded
    microbatches and, per window, five float64 copies of the trainable gradient on the CPU
    (the captured one and four weighting patterns), so about 40 bytes per trainable
    parameter beside the model.

    Raises ``TypeError``/``ValueError`` for a non-Trainer, a wrong ``objective``, ``steps`` < 1, no
    ``train_dataset`` or ``max_steps=0``. Anything else it cannot measure (a meta or frozen
    model, an iterable dataset, DeepSpeed, FSDP, DataParallel, an error while running the
    job's own steps) gets a report that says "not checked" and why, never ``ok``.
    """
    _check_arguments(trainer, steps, objective)
    reason = unmeasurable(trainer)
    if reason is not None:
        return TrainerAuditReport.unchecked(reason)
    asked = steps
    if trainer.args.max_steps > 0:  # the run itself takes no more updates than this
        steps = min(steps, trainer.args.max_steps)
    try:
        with preserved_trainer(trainer):
            windows = run_windows(trainer, steps)
            report = measured_report(trainer, windows, objective)
            del windows
    except Exception as err:  # noqa: BLE001 - a report, never an error out of the audit
        return TrainerAuditReport.unchecked(
            f"the audit could not run {type(trainer).__name__}'s training step: "
            f"{type(err).__name__}: {err}"
        )
    for note in (_version_note(), _checkpointing_note(trainer)):
        if note is not None:
            report.notes.append(note)
    audited = len(report.invariance or report.windows)
    if report.checked and audited < asked:
        held = "the run takes" if steps < asked else "the first epoch holds"
        report.notes.append(f"{held} {audited} windows; {asked} were asked for")
    return report


__all__ = ["TESTED_TRANSFORMERS", "audit_trainer", "measured_report", "run_windows"]
