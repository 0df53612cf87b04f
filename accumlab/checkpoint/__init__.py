"""Checkpoints for ``train``: everything the next update depends on, and exact resume.

A checkpoint is one file per rank, ``checkpoint-<attempts>-rank<r>.pt`` in the checkpoint
directory, where ``<attempts>`` is the run's update attempts so far (8 digits). It holds
the model, optimizer, scheduler and GradScaler state, the ledger (as plain data), the OOM
shrink state (how many times every loader microbatch is cut in half), the RNG states
(torch CPU, every CUDA device when there is one, Python's ``random``), the settings the
run started with (optimizer class, parameters and hyper-parameters, scheduler class,
clipping, seed), the position in the data (windows and loader microbatches consumed, a
digest of what each window held, the RNG states at which reading the data drew random
numbers, each update attempt's learning rates, and the loader's own ``state_dict()``
when it has one) and a SHA-256 checksum of all of it. ``torch.load(weights_only=True)``
reads it, so it stores tensors and plain data only.

The package is cut by idea:

- :mod:`.files`: names, the atomic write and its checksum, rotation (the newest ``keep``
  of a rank), reading back the newest intact checkpoint every rank has;
- :mod:`.lock`: the directory lock: a run owns its checkpoint directory for its lifetime;
- :mod:`.compare`: what a resume compares before it loads anything (plan, model, settings,
  optimizer parameters in order, scheduler, data digests), :class:`ResumeMismatchError`;
- :mod:`.replay`: the RNG states, and their replay while a resume reads the data again;
- :mod:`.resume`: :class:`Checkpointer`, which ``train`` drives.

``train(..., checkpoint_dir=..., checkpoint_every=..., resume=...)`` drives it through
:class:`Checkpointer`; the one-window core (``train_window``, ``accumulate``) knows
nothing of checkpoints.
"""

from .compare import (
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
    CorruptCheckpointError,
    check_arguments,
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
    "FORMAT",
    "KEEP",
    "LOCK_NAME",
    "MAX_RNG_DRAWS",
    "CheckpointDirectoryInUseError",
    "Checkpointer",
    "CorruptCheckpointError",
    "DataDraws",
    "DirectoryLock",
    "ResumeMismatchError",
    "changed_generators",
    "check_arguments",
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
