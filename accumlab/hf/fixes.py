"""The fix for each cause, as Python a user pastes.

Every fix runs as it stands in a script where ``model``, ``trainer``, ``args``,
``train_dataset`` and ``data_collator`` are defined (the Trainer's usual names). A fix
that changes what the Trainer reads only when it is built starts with a comment saying
so, and :func:`fix_for` then returns ``needs_new_trainer=True``: run it, build the
Trainer again, and the same audit comes out ok.
"""

from __future__ import annotations

from typing import Any

from torch import nn

REBUILD = "# Run this before the Trainer is built: the Trainer reads it when it is created.\n"

_TOKEN_MEAN = '''import torch.nn.functional as F

def token_mean_loss(outputs, labels, num_items_in_batch=None):
    """Summed cross-entropy over the shifted targets / the window's target count."""
    logits = outputs["logits"] if isinstance(outputs, dict) else outputs.logits
    targets = labels[:, 1:].to(logits.device)
    loss_sum = F.cross_entropy(
        logits[:, :-1].flatten(0, 1).float(), targets.flatten(),
        ignore_index=-100, reduction="sum",
    )
    return loss_sum / num_items_in_batch

trainer.compute_loss_func = token_mean_loss
'''

_EXAMPLE_MEAN = '''import torch.nn.functional as F

def example_mean_loss(outputs, labels, num_items_in_batch=None):
    """Summed cross-entropy over the examples / the window's example count."""
    logits = outputs["logits"] if isinstance(outputs, dict) else outputs.logits
    labels = labels.to(logits.device)
    loss_sum = F.cross_entropy(logits.float(), labels, reduction="sum")
    return loss_sum / num_items_in_batch

trainer.compute_loss_func = example_mean_loss
'''

_CUSTOM_MEAN = '''# `objective` is the Objective you passed to audit_trainer: sum its losses over
# each microbatch and divide once by the window's count.
def objective_mean_loss(outputs, labels, num_items_in_batch=None):
    return objective.loss_sum(outputs, {"labels": labels}) / num_items_in_batch

trainer.compute_loss_func = objective_mean_loss
'''

_MASK_FIRST_LABEL = '''# Position 0 of a causal LM's labels is never a target: mask it, so the
# Trainer's num_items_in_batch (counted over the labels) is the number of
# targets the loss scores.
_collate = trainer.data_collator

def collate_masking_first_label(features):
    batch = _collate(features)
    batch["labels"] = batch["labels"].clone()
    batch["labels"][:, 0] = -100
    return batch

trainer.data_collator = collate_masking_first_label
'''

_LOSS_TYPE = '''model.loss_type = "ForCausalLM"  # tells the Trainer the loss shifts the labels
'''

_GLOBAL_COUNT = '''args.average_tokens_across_devices = True  # one count over all ranks
'''

_DROP_OVERRIDE = '''import types
from transformers import Trainer

# drop the compute_loss override: the Trainer's own calls compute_loss_func
trainer.compute_loss = types.MethodType(Trainer.compute_loss, trainer)
'''


_DROP_COUNT_OVERRIDE = '''import types
from transformers import Trainer

# drop the override of the count: the Trainer's own counts the labels
trainer.get_batch_samples = types.MethodType(Trainer.get_batch_samples, trainer)
'''


def _count_overridden(trainer: Any) -> bool:
    from transformers import Trainer

    return any(
        name in vars(trainer) or getattr(type(trainer), name, None) is not getattr(Trainer, name, None)
        for name in ("get_batch_samples", "_get_num_items_in_batch")
    )


def _counts_shifted(trainer: Any) -> bool:
    """True when this Trainer counts ``num_items_in_batch`` over ``labels[:, 1:]``."""
    return bool(getattr(trainer, "_loss_shifts_labels", False))


def _compute_loss_overridden(trainer: Any) -> bool:
    from transformers import Trainer

    own = vars(trainer).get("compute_loss")
    return own is not None or type(trainer).compute_loss is not Trainer.compute_loss


def _objective_loss(kind: str, trainer: Any) -> str:
    """The correct ``compute_loss_func`` for objective ``kind`` (``"causal"``,
    ``"example"``, ``"custom"``), with the count fix a causal LM needs here."""
    parts = []
    if _compute_loss_overridden(trainer):
        parts.append(_DROP_OVERRIDE)
    if getattr(trainer, "loss_is_scaled_for_ga", None) is not None:
        parts.append("trainer.loss_is_scaled_for_ga = None  # compute_loss_func divides\n")
    parts.append({"causal": _TOKEN_MEAN, "example": _EXAMPLE_MEAN}.get(kind, _CUSTOM_MEAN))
    if kind == "causal" and not _counts_shifted(trainer):
        parts.append(_MASK_FIRST_LABEL)
    return "\n".join(parts)


def fix_for(
    mistakes: list[str], trainer: Any, model: nn.Module, kind: str, ranks: int = 1
) -> tuple[str, bool]:
    """``(code, needs_new_trainer)`` for the named ``mistakes`` of this Trainer's job,
    run on ``ranks`` data-parallel ranks, audited against objective ``kind``
    (``"causal"``: token mean over shifted targets, ``"example"``: example mean of
    cross-entropy, ``"custom"``: an Objective the user passed, named ``objective`` in the
    fix)."""
    if not mistakes:
        return "", False
    names = set(mistakes)
    loss_fix = {
        "num_items_ignored",
        "average_of_averages",
        "double_division",
        "no_division",
        "wrong_normalization",
        "not_token_mean",
        "scored_targets_missed",
    }
    parts: list[str] = []
    needs_new = False
    count_overridden = _count_overridden(trainer)
    over_counted = {"count_before_shift", "ignored_tokens_counted"}
    if names & (over_counted | {"scored_targets_missed"}) and count_overridden:
        parts.append(_DROP_COUNT_OVERRIDE)
    if names & loss_fix:
        parts.append(_objective_loss(kind, trainer))
    elif names & over_counted:
        plain_model = hasattr(trainer, "_loss_shifts_labels") and trainer.compute_loss_func is None
        if plain_model and hasattr(model, "loss_type") and not count_overridden:
            parts.append(REBUILD + _LOSS_TYPE)
            needs_new = True
        else:
            parts.append(_MASK_FIRST_LABEL)
    per_rank_count = ranks > 1 and not getattr(trainer.args, "average_tokens_across_devices", False)
    if "per_rank_mean" in names or (names & loss_fix and per_rank_count):
        parts.append(_GLOBAL_COUNT)
    if "ranks_disagree" in names:
        parts.append(
            "# The ranks' gradients differ after the sync: launch with torchrun so the\n"
            "# Trainer wraps the model in DistributedDataParallel, and do not train a\n"
            "# copy of the model.\n"
        )
    return "\n".join(parts), needs_new


__all__ = ["REBUILD", "fix_for"]
