"""Checkpoints for ``train``: everything the next update depends on, and exact resume.

What a checkpoint holds (this is the one description; the other modules point here). A
checkpoint is one file per rank, ``checkpoint-<attempts>-rank<r>.pt`` in the checkpoint
directory, where ``<attempts>`` is the run's update attempts so far (8 digits); the newest
two of each rank are kept. Each is a dict of tensors and plain data only, so
``torch.load(weights_only=True)`` reads it:

- ``format`` (:data:`FORMAT`; a checkpoint of another format is refused,
  :class:`CheckpointFormatError`), ``update_attempts``, ``rank``, ``world_size``;
- ``plan`` (``AccumulationPlan.to_dict()``), ``precision``, and ``settings``
  (:func:`run_settings`: the optimizer's class, its parameter groups' sizes, each
  parameter's shape and name in order, the hyper-parameters as started, the scheduler's
  class, torch's seed, ``clip_grad_norm``, ``scheduler_per``, ``nonfinite``);
- the ``state_dict()`` of the ``model``, the ``optimizer``, the ``scheduler`` and the
  GradScaler (``scaler``; ``None`` without one);
- ``ledger`` (``Ledger.state_dict()``, its OOM shrinks included; ``oom_halvings`` repeats
  their number, how many times every loader microbatch is cut in half, for a reader of
  the file) and ``rng`` (the states of torch's CPU generator, of every CUDA device and of
  Python's ``random``);
- ``data``: the position in the data (``windows`` and loader ``microbatches`` consumed,
  and ``loader``, the loader's own ``state_dict()`` when it has one, else ``None``), and
  ``data_history``: per window a digest of what it held (``digests``,
  :func:`window_digest`), the RNG states at which reading a window drew random numbers
  (``rng_draws``, ``rng_draws_full_at``: :class:`DataDraws`), and per update attempt
  every parameter group's learning rate (``lrs``, the scheduler's replay);
- ``sha256``: the checksum of all of the above (:func:`payload_checksum`).

The package is cut by idea:

- :mod:`.files`: names, the atomic write and its checksum, rotation, reading back the
  newest intact checkpoint every rank has;
- :mod:`.lock`: the directory lock: a run owns its checkpoint directory for its lifetime;
- :mod:`.lock_record`: what the lock file holds (the holder's pid, host and start), read,
  judged and described;
- :mod:`.compare`: what a resume compares before it loads anything (plan, model, settings,
  optimizer parameters in order, scheduler, data digests), :class:`ResumeMismatchError`;
- :mod:`.replay`: the RNG states, and their replay while a resume reads the data again;
- :mod:`.resume`: :class:`Checkpointer`, which ``train`` drives.

The one-window core (``train_window``, ``accumulate``) knows nothing of checkpoints.
"""

from .compare import (
    ABSENT,
    IMPLEMENTATION_SWITCHES,
    RESUMED_SETTINGS,
    Difference,
    ResumeMismatchError,
    check_compatible,
    recorded_lrs,
    run_settings,
    scheduler_differences,
    scheduler_hyperparameters,
    started_with,
    window_digest,
)
from .files import (
    FORMAT,
    KEEP,
    CheckpointFormatError,
    CorruptCheckpointError,
    check_writable,
    checkpoint_path,
    common_checkpoints,
    list_checkpoints,
    load_checkpoint,
    load_newest_intact,
    newest_common,
    payload_checksum,
    save_checkpoint,
)
from .lock import LOCK_NAME, CheckpointDirectoryInUseError, DirectoryLock, lock_run_directory
from .replay import MAX_RNG_DRAWS, DataDraws, changed_generators, rng_state, set_rng_state
from .resume import Checkpointer

__all__ = [
    "ABSENT",
    "FORMAT",
    "IMPLEMENTATION_SWITCHES",
    "RESUMED_SETTINGS",
    "KEEP",
    "LOCK_NAME",
    "MAX_RNG_DRAWS",
    "CheckpointDirectoryInUseError",
    "CheckpointFormatError",
    "Checkpointer",
    "CorruptCheckpointError",
    "DataDraws",
    "Difference",
    "DirectoryLock",
    "ResumeMismatchError",
    "changed_generators",
    "check_compatible",
    "check_writable",
    "checkpoint_path",
    "common_checkpoints",
    "list_checkpoints",
    "load_checkpoint",
    "load_newest_intact",
    "lock_run_directory",
    "newest_common",
    "payload_checksum",
    "recorded_lrs",
    "rng_state",
    "run_settings",
    "save_checkpoint",
    "scheduler_differences",
    "scheduler_hyperparameters",
    "set_rng_state",
    "started_with",
    "window_digest",
]
