"""The fix for each cause, as Python a user pastes.

Every fix runs as it stands in a script where ``model``, ``trainer``, ``args``,
``train_dataset`` and ``data_collator`` are defined (the Trainer's usual names), on the
Trainer as built, under every tested release (the count's fix changes the data, not a
setting the Trainer reads when it is built, so a PEFT or otherwise wrapped model needs
nothing else). A fix keeps every loss term the job chose: label smoothing stays in the
loss it writes; a loss the audit does not know (a Trainer subclass's own, a router
balance term) gets advice on its normalization, never a replacement.
"""

from __future__ import annotations

import inspect
from typing import Any

from torch import nn

_TOKEN_MEAN = '''import torch.nn.functional as F

def token_mean_loss(outputs, labels, num_items_in_batch=None):
    """Summed cross-entropy over the shifted targets / the window's target count."""
    logits = outputs["logits"] if isinstance(outputs, dict) else outputs.logits
    targets = labels[:, 1:].to(logits.device)
    loss_sum = F.cross_entropy(
        logits[:, :-1].flatten(0, 1).float(), targets.flatten(),
        ignore_index=-100, reduction="sum"SMOOTHING,
    )
    return loss_sum / num_items_in_batch

trainer.compute_loss_func = token_mean_loss
'''

_UNSHIFTED_MEAN = '''import torch.nn.functional as F

def token_mean_loss(outputs, labels, num_items_in_batch=None):
    """Summed cross-entropy over the labelled tokens (unshifted) / the window's count."""
    logits = outputs["logits"] if isinstance(outputs, dict) else outputs.logits
    loss_sum = F.cross_entropy(
        logits.flatten(0, 1).float(), labels.to(logits.device).flatten(),
        ignore_index=-100, reduction="sum"SMOOTHING,
    )
    return loss_sum / num_items_in_batch

trainer.compute_loss_func = token_mean_loss
'''

_DECODER_INPUTS = """# compute_loss_func takes the labels away from the model's inputs: the decoder
# gets its inputs from the collator instead, made from the labels as the model would.
_collate_labels = trainer.data_collator

def collate_with_decoder_inputs(features):
    batch = _collate_labels(features)
    if "decoder_input_ids" not in batch:
        batch["decoder_input_ids"] = model.prepare_decoder_input_ids_from_labels(
            labels=batch["labels"])
    return batch

trainer.data_collator = collate_with_decoder_inputs
"""

_EXAMPLE_MEAN = '''import torch.nn.functional as F

def example_mean_loss(outputs, labels, num_items_in_batch=None):
    """Summed cross-entropy over the examples / the window's example count."""
    logits = outputs["logits"] if isinstance(outputs, dict) else outputs.logits
    labels = labels.to(logits.device)
    loss_sum = F.cross_entropy(logits.float(), labels, reduction="sum"SMOOTHING)
    return loss_sum / num_items_in_batch

trainer.compute_loss_func = example_mean_loss
'''

_OWN_COUNT = """import types

# This release passes compute_loss_func no count for this model:
# count the window's targets here (after the shift for a causal LM,
# one per labelled example for a classifier).
_get_batch_samples = trainer.get_batch_samples

def get_batch_samples_counted(self, epoch_iterator, num_batches, *device):
    batches, _ = _get_batch_samples(epoch_iterator, num_batches, *device)
    count = sum(int((LABELS != -100).sum()) for b in batches)
    return batches, count

trainer.get_batch_samples = types.MethodType(get_batch_samples_counted, trainer)
"""

_CUSTOM_MEAN = """# `objective` is the Objective you passed to audit_trainer: sum its losses over
# each microbatch and divide once by the window's count.
def objective_mean_loss(outputs, labels, num_items_in_batch=None):
    return objective.loss_sum(outputs, {"labels": labels}) / num_items_in_batch

trainer.compute_loss_func = objective_mean_loss
"""

_MASK_FIRST_LABEL = """# Position 0 of a causal LM's labels is never a target: mask it, so the
# Trainer's num_items_in_batch (counted over the labels) is the number of
# targets the loss scores.
_collate = trainer.data_collator

def collate_masking_first_label(features):
    batch = _collate(features)
    batch["labels"] = batch["labels"].clone()
    batch["labels"][:, 0] = -100
    return batch

trainer.data_collator = collate_masking_first_label
"""

_GLOBAL_COUNT = """args.average_tokens_across_devices = True  # one count over all ranks
"""

_DROP_OVERRIDE = """import types
from transformers import Trainer

# drop the compute_loss override: the Trainer's own calls compute_loss_func
trainer.compute_loss = types.MethodType(Trainer.compute_loss, trainer)
"""


_DROP_COUNT_OVERRIDE = """import types
from transformers import Trainer

# drop the override of the count: the Trainer's own counts the labels
trainer.get_batch_samples = types.MethodType(Trainer.get_batch_samples, trainer)
"""


def _count_overridden(trainer: Any) -> bool:
    from transformers import Trainer

    return any(
        name in vars(trainer)
        or getattr(type(trainer), name, None) is not getattr(Trainer, name, None)
        for name in ("get_batch_samples", "_get_num_items_in_batch")
    )


def _counts_shifted(trainer: Any) -> bool:
    """True when this Trainer counts ``num_items_in_batch`` over ``labels[:, 1:]``."""
    return bool(getattr(trainer, "_loss_shifts_labels", False))


def _compute_loss_overridden(trainer: Any) -> bool:
    from transformers import Trainer

    own = vars(trainer).get("compute_loss")
    return own is not None or type(trainer).compute_loss is not Trainer.compute_loss


def _counts_for_compute_loss_func(trainer: Any) -> bool:
    """Whether this release hands ``compute_loss_func`` a count for this model (4.46
    counts only for a model whose forward takes ``**kwargs``)."""
    if getattr(trainer, "model_accepts_loss_kwargs", True):
        return True
    from transformers import Trainer

    source = inspect.getsource(Trainer.get_batch_samples)
    return "if not self.model_accepts_loss_kwargs" not in source


def _objective_loss(kind: str, trainer: Any, model: nn.Module) -> str:
    """The correct ``compute_loss_func`` for objective ``kind`` (``"causal"``,
    ``"unshifted"``, ``"example"``, ``"custom"``), keeping the Trainer's label smoothing,
    with the count fix a causal LM needs here."""
    parts = []
    if _compute_loss_overridden(trainer):
        parts.append(_DROP_OVERRIDE)
    if getattr(trainer, "loss_is_scaled_for_ga", None) is not None:
        parts.append("trainer.loss_is_scaled_for_ga = None  # compute_loss_func divides\n")
    smoothing = float(getattr(trainer.args, "label_smoothing_factor", 0.0) or 0.0)
    code = {"causal": _TOKEN_MEAN, "unshifted": _UNSHIFTED_MEAN, "example": _EXAMPLE_MEAN}.get(
        kind, _CUSTOM_MEAN
    )
    parts.append(code.replace("SMOOTHING", f", label_smoothing={smoothing:g}" if smoothing else ""))
    if kind == "unshifted" and any(
        getattr(getattr(m, "config", None), "is_encoder_decoder", False)
        for m in (model, *model.children())
    ):
        parts.append(_DECODER_INPUTS)
    if not _counts_for_compute_loss_func(trainer):
        # a causal LM's targets are the labels after the shift; any other labels (one per
        # example, or unshifted tokens) are counted as they stand
        parts.append(
            _OWN_COUNT.replace(
                "LABELS", 'b["labels"][:, 1:]' if kind == "causal" else 'b["labels"]'
            )
        )
    elif kind == "causal" and not _counts_shifted(trainer):
        parts.append(_MASK_FIRST_LABEL)
    return "\n".join(parts)


_ROUTER = """# The router balance loss is a statistic of each microbatch, added once per microbatch;
# the Trainer passes num_items_in_batch, so it no longer divides by A: the term weighs
# A times what it weighs at A = 1. Keep it, with its coefficient divided by A:
_base = model.get_base_model() if hasattr(model, "get_base_model") else model
_base.router_aux_loss_coef = _base.config.router_aux_loss_coef / args.gradient_accumulation_steps
# No fix is known that makes a per-microbatch statistic independent of the split: its
# value still changes with how the window is cut (the cross-entropy does not).
"""


_SMOOTHER_UNSHIFTED = """\
# The Trainer's label smoother scores this model's labels unshifted: it shifts only
# for a model whose class it knows as a causal LM, and this wrapper's is not one, so
# each position is scored against its own token, not the next. Keep the smoothing and
# score the shifted targets with compute_loss_func (which the Trainer calls instead):
"""


def smoother_scores_unshifted(trainer: Any, model: nn.Module) -> bool:
    """True when the Trainer's label smoother computes this causal LM's loss over the
    labels unshifted: the Trainer shifts only for a class in its causal-LM mapping (the
    model, or a PEFT model's base), and a user's wrapper around a causal LM is not one."""
    from .objectives import is_causal_lm

    if (
        getattr(trainer, "label_smoother", None) is None
        or getattr(trainer, "compute_loss_func", None) is not None
    ):
        return False
    if _compute_loss_overridden(trainer) or not is_causal_lm(model):
        return False
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    base = model.base_model.model if hasattr(model, "get_base_model") else model
    return base._get_name() not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()


def invariance_fix(mistakes: list[str], trainer: Any, model: nn.Module, why: str = "") -> str:
    """What to change in a loss the audit does not know: its normalization, keeping every
    term the loss has (``why`` is the reason it is not a loss the audit knows). Code where
    one is known (the count, a router loss's weight, the smoothed causal loss a wrapped
    causal LM's label smoother misses), comments where it is not."""
    if not mistakes:
        return ""
    if smoother_scores_unshifted(trainer, model):
        return _SMOOTHER_UNSHIFTED + _objective_loss("causal", trainer, model)
    names = set(mistakes)
    parts = []
    if "count_before_shift" in names:
        parts.append(_MASK_FIRST_LABEL)
    split = names & {
        "double_division",
        "num_items_ignored",
        "average_of_averages",
        "depends_on_split",
        "short_window_divided_by_a",
        "wrong_normalization",
    }
    if split and "router balance loss" in why:
        parts.append(_ROUTER)
    elif split:
        lines = ["# The loss is the job's own: keep every term it has and fix how it is normalized"]
        lines.append("# over the window, the same at every split:")
        if "double_division" in names:
            lines.append(
                "# - it is divided by A once too often: drop the extra / A (the Trainer already"
            )
            lines.append(
                "#   divides a per-microbatch mean by A, or num_items_in_batch counts the window)."
            )
        if "short_window_divided_by_a" in names:
            lines.append("# - a short last window still divides by the configured A: divide by the")
            lines.append(
                "#   window's own count (num_items_in_batch) or "
                "current_gradient_accumulation_steps."
            )
        if "wrong_normalization" in names:
            lines.append(
                "# - it is divided by a count of another window (a generation batch spanning"
            )
            lines.append("#   several updates): divide by this window's share of it.")
        if names & {"num_items_ignored", "average_of_averages", "depends_on_split"}:
            lines.append(
                "# - return the SUM of the per-example (or per-token) loss terms divided by the"
            )
            lines.append(
                "#   window's count, num_items_in_batch (passed to compute_loss), not a mean per"
            )
            lines.append(
                "#   microbatch; a term that is a statistic of the microbatch (a batch-level KL"
            )
            lines.append(
                "#   estimate, a router balance loss) has no such form: no fix is known that"
            )
            lines.append("#   makes it independent of the split.")
        parts.append("\n".join(lines) + "\n")
    return "\n".join(parts)


def has_code(fix: str) -> bool:
    """True when ``fix`` holds a line of Python that is not a comment."""
    return any(line.strip() and not line.lstrip().startswith("#") for line in fix.splitlines())


def fix_for(mistakes: list[str], trainer: Any, model: nn.Module, kind: str, ranks: int = 1) -> str:
    """The code to paste for the named ``mistakes`` of this Trainer's job, run on
    ``ranks`` data-parallel ranks, audited against objective ``kind`` (``"causal"``: token
    mean over shifted targets, ``"unshifted"``: token mean over unshifted labels,
    ``"example"``: example mean of cross-entropy, ``"custom"``: an Objective the user
    passed, named ``objective`` in the fix)."""
    if not mistakes:
        return ""
    names = set(mistakes)
    collation = names & {"pad_predicts_target", "attention_crosses_examples"}
    if collation:
        return _collation_fix(collation)
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
    count_overridden = _count_overridden(trainer)
    over_counted = {"count_before_shift", "ignored_tokens_counted"}
    if names & (over_counted | {"scored_targets_missed"}) and count_overridden:
        parts.append(_DROP_COUNT_OVERRIDE)
    if names & loss_fix:
        parts.append(_objective_loss(kind, trainer, model))
    elif names & over_counted and not count_overridden:
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
    return "\n".join(parts)


_PAD_RIGHT = """import torch

# With left padding the pad before each row's first token predicts it: move every row's
# tokens to its start (padding on the right), the same examples, labels and targets.
# (Or set tokenizer.padding_side = "right" before the collator pads.)
_collate_left_padded = trainer.data_collator

def collate_padding_right(features):
    batch = _collate_left_padded(features)
    pads = (batch["attention_mask"] == 0).sum(dim=1).tolist()
    for key in ("input_ids", "attention_mask", "labels"):
        batch[key] = torch.stack([row.roll(-n) for row, n in zip(batch[key], pads)])
    batch.pop("position_ids", None)
    return batch

trainer.data_collator = collate_padding_right
"""

_NO_CROSSING = """import torch

# Packed rows let each example attend to the ones before it in its row: give every
# example a row of its own (padded on the right), the same examples and targets.
# (Or keep packing with an attention that reads the example boundaries from
# position_ids, e.g. attn_implementation="flash_attention_2" on a GPU.)
_collate_packed = trainer.data_collator

def collate_one_example_per_row(features):
    packed = _collate_packed(features)
    rows = []
    for ids, labels, pos in zip(packed["input_ids"], packed["labels"], packed["position_ids"]):
        cuts = [0] + [t for t in range(1, len(pos)) if pos[t] != pos[t - 1] + 1] + [len(pos)]
        rows += [(ids[a:b], labels[a:b]) for a, b in zip(cuts, cuts[1:])
                 if (labels[a + 1:b] != -100).any()]
    width = max(len(ids) for ids, _ in rows)
    batch = {"input_ids": torch.zeros(len(rows), width, dtype=torch.long),
             "attention_mask": torch.zeros(len(rows), width, dtype=torch.long),
             "labels": torch.full((len(rows), width), -100)}
    for r, (ids, labels) in enumerate(rows):
        batch["input_ids"][r, :len(ids)] = ids
        batch["attention_mask"][r, :len(ids)] = 1
        batch["labels"][r, :len(ids)] = labels
    return batch

trainer.data_collator = collate_one_example_per_row
"""


def _collation_fix(names: set[str]) -> str:
    """Advice for padding or packing that changes what the model sees or scores."""
    parts = []
    if "pad_predicts_target" in names:
        parts.append(_PAD_RIGHT)
    if "attention_crosses_examples" in names:
        parts.append(_NO_CROSSING)
    return "\n".join(parts)


__all__ = ["fix_for", "has_code", "invariance_fix"]
