"""Tiny Hugging Face jobs for the Trainer audit's tests, and its 2-rank workers.

Imported by ``tests/test_hf_audit*.py`` and by the spawned ranks of
``accumlab.distributed.launch`` (pytest puts ``tests/`` on ``sys.path``; spawn copies it).
Everything is built locally from tiny configs: no download.

The data: 8 examples of uneven length (3 to 11 tokens, 55 in all), labels equal to the
inputs and -100 on padding only, so a causal LM scores 55 - 8 = 47 targets while a count
taken before the shift finds 55: a Trainer dividing by 55 scales the gradient by 47/55.
"""

from __future__ import annotations

import tempfile
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from helpers import hf_models

LENGTHS = (3, 11, 5, 9, 4, 10, 6, 7)  # 55 labels, 47 targets after the shift
VOCAB = 64


def examples(lengths: tuple[int, ...] = LENGTHS, seed: int = 0) -> list[dict[str, list[int]]]:
    """One example per length: random token ids in 1..VOCAB-1 (0 is the padding id)."""
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(1, VOCAB, (n,), generator=g).tolist()} for n in lengths]


def collate(features: list[dict[str, Any]]) -> dict[str, Tensor]:
    """Right-pad to the longest example: attention mask 0 and labels -100 on padding."""
    width = max(len(f["input_ids"]) for f in features)
    ids = torch.zeros(len(features), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for i, f in enumerate(features):
        x = torch.tensor(f["input_ids"])
        ids[i, : len(x)], mask[i, : len(x)], labels[i, : len(x)] = x, 1, x
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def collate_classes(features: list[dict[str, Any]]) -> dict[str, Tensor]:
    """Sequence classification: the padded inputs and one class per example (its length % 3)."""
    batch = collate(features)
    batch["labels"] = torch.tensor([len(f["input_ids"]) % 3 for f in features])
    return batch


def gpt2(dropout: float = 0.0, seed: int = 0) -> nn.Module:
    """A GPT2LMHeadModel as built from a tiny config (1 layer, width 16): its loss_type unset."""
    return hf_models.gpt2(vocab=VOCAB, dropout=dropout, seed=seed)


def gpt2_classifier(seed: int = 0) -> nn.Module:
    """GPT-2 with a sequence-classification head of 3 classes (padding id 0)."""
    return hf_models.gpt2("sequence", vocab=VOCAB, seed=seed, num_labels=3, pad_token_id=0)


class KwargsWrapper(nn.Module):
    """Accepts ``**kwargs`` (so the Trainer passes num_items_in_batch) but returns the inner
    model's own mean loss, ignoring the count."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None,
                labels: Tensor | None = None, **kwargs: Any) -> Any:
        return self.inner(input_ids=input_ids, attention_mask=attention_mask, labels=labels)


class PlainWrapper(nn.Module):
    """A forward without ``**kwargs``: the Trainer cannot pass the count, divides by A."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None,
                labels: Tensor | None = None) -> Any:
        return self.inner(input_ids=input_ids, attention_mask=attention_mask, labels=labels)


def model_for(kind: str, dropout: float = 0.0) -> nn.Module:
    """``plain`` (as built), ``loss_type`` (ForCausalLM set), ``kwargs``/``nokw`` wrappers."""
    model = gpt2(dropout)
    if kind == "loss_type":
        model.loss_type = "ForCausalLM"
    elif kind == "kwargs":
        model = KwargsWrapper(model)
    elif kind == "nokw":
        model = PlainWrapper(model)
    elif kind != "plain":
        raise ValueError(kind)
    return model


def shifted_sum(outputs: Any, labels: Tensor) -> Tensor:
    logits = outputs["logits"] if isinstance(outputs, dict) else outputs.logits
    return F.cross_entropy(
        logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100, reduction="sum"
    )


def correct_loss_func(outputs: Any, labels: Tensor, num_items_in_batch: Any = None) -> Tensor:
    """The right compute_loss_func: summed shifted cross-entropy / num_items_in_batch."""
    return shifted_sum(outputs, labels) / num_items_in_batch


def twice_loss_func(outputs: Any, labels: Tensor, num_items_in_batch: Any = None) -> Tensor:
    """Divides by the count and again by the accumulation steps (4)."""
    return shifted_sum(outputs, labels) / num_items_in_batch / 4


def never_loss_func(outputs: Any, labels: Tensor, num_items_in_batch: Any = None) -> Tensor:
    """Never divides: the loss sum itself."""
    return shifted_sum(outputs, labels)


def weighted_loss_func(outputs: Any, labels: Tensor, num_items_in_batch: Any = None) -> Tensor:
    """A custom weighting: targets at even positions count twice (not a token mean)."""
    logits = outputs["logits"] if isinstance(outputs, dict) else outputs.logits
    per_token = F.cross_entropy(
        logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100,
        reduction="none",
    ).view(labels.shape[0], -1)
    weight = 1.0 + (torch.arange(per_token.shape[1]) % 2 == 0).float()
    return (per_token * weight).sum() / num_items_in_batch


def tenth_loss_func(outputs: Any, labels: Tensor, num_items_in_batch: Any = None) -> Tensor:
    """Divides by a constant (10) instead of the window's count."""
    return shifted_sum(outputs, labels) / 10


def make_args(out: str | None = None, **overrides: Any) -> Any:
    from transformers import TrainingArguments

    settings: dict[str, Any] = dict(
        per_device_train_batch_size=2, gradient_accumulation_steps=4, use_cpu=True,
        report_to=[], save_strategy="no", logging_strategy="no", disable_tqdm=True,
        dataloader_num_workers=0, seed=0,
    )
    settings.update(overrides)
    return TrainingArguments(out or tempfile.mkdtemp(prefix="hf_audit_"), **settings)


def make_trainer(model: nn.Module, args: Any = None, trainer_class: Any = None, **kw: Any) -> Any:
    from transformers import Trainer

    kw.setdefault("train_dataset", examples())
    kw.setdefault("data_collator", collate)
    return (trainer_class or Trainer)(model=model, args=args or make_args(), **kw)


# -- independent measurements: what a real step applies, what the reference is -----------


def flat(tensors: Any) -> Tensor:
    return torch.cat([t.detach().double().reshape(-1) for t in tensors])


#: one update whose ``w0 - w1`` is the applied gradient (SGD at lr 1, nothing else)
SGD_STEP: dict[str, Any] = dict(optim="sgd", learning_rate=1.0, lr_scheduler_type="constant",
                                weight_decay=0.0, max_grad_norm=0.0, max_steps=1)


def applied_gradient(model: nn.Module, args_overrides: dict[str, Any] | None = None,
                     trainer_class: Any = None, **trainer_kw: Any) -> Tensor:
    """The gradient one real ``trainer.train()`` update applies, read off the weights:
    SGD at learning rate 1, constant schedule, no clipping, no weight decay, so
    ``w0 - w1`` is that gradient."""
    settings = {**SGD_STEP, **(args_overrides or {})}
    trainer = make_trainer(model, make_args(**settings), trainer_class, **trainer_kw)
    params = [p for p in model.parameters() if p.requires_grad]
    before = flat(params)
    trainer.train()
    return before - flat(params)


def applied_and_logged(model: nn.Module, args_overrides: dict[str, Any] | None = None,
                       trainer_class: Any = None, **trainer_kw: Any) -> tuple[Tensor, dict[str, float]]:
    """:func:`applied_gradient`, and what the Trainer logged for that update (its
    ``loss``, and its ``grad_norm`` where the release logs one), read from its log."""
    settings = {**SGD_STEP, "logging_strategy": "steps", "logging_steps": 1, **(args_overrides or {})}
    trainer = make_trainer(model, make_args(**settings), trainer_class, **trainer_kw)
    params = [p for p in model.parameters() if p.requires_grad]
    before = flat(params)
    trainer.train()
    (log,) = [h for h in trainer.state.log_history if "loss" in h]
    return before - flat(params), {k: float(v) for k, v in log.items() if k in ("loss", "grad_norm")}


def reference_gradient(model: nn.Module, batches: list[dict[str, Tensor]]) -> Tensor:
    """Token mean over the shifted targets of all ``batches``' examples, written directly
    (each batch's summed cross-entropy, one division by the total target count)."""
    inner = getattr(model, "inner", model)
    total = sum(int((b["labels"][:, 1:] != -100).sum()) for b in batches)
    loss = sum(
        shifted_sum(inner(input_ids=b["input_ids"], attention_mask=b["attention_mask"]), b["labels"])
        for b in batches
    ) / total
    params = [p for p in model.parameters() if p.requires_grad]
    return flat(torch.autograd.grad(loss, params))


def class_reference(model: nn.Module, batches: list[dict[str, Tensor]]) -> Tensor:
    """Example mean of the cross-entropy of one class per example over all ``batches``'
    examples, written directly (each batch's summed cross-entropy, one division)."""
    total = sum(int(b["labels"].numel()) for b in batches)
    loss = sum(F.cross_entropy(model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits,
                               b["labels"], reduction="sum") for b in batches) / total
    params = [p for p in model.parameters() if p.requires_grad]
    return flat(torch.autograd.grad(loss, params))


def least_squares_scale(g: Tensor, ref: Tensor) -> float:
    return float(g.dot(ref) / ref.dot(ref))


def apply_fix(report: Any, model: nn.Module, trainer: Any, trainer_class: Any = None,
              **trainer_kw: Any) -> Any:
    """Run ``report.fix`` as a user would, in a script's namespace, on the Trainer as
    built. Returns the Trainer to audit."""
    namespace = {"model": model, "trainer": trainer, "args": trainer.args,
                 "train_dataset": trainer.train_dataset, "data_collator": trainer.data_collator}
    exec(compile(report.fix, "<report.fix>", "exec"), namespace)
    return trainer


# -- 2-rank workers (run under accumlab.distributed.launch) ----------------------------

SIXTEEN = LENGTHS + (12, 2, 8, 5, 9, 3, 11, 4)  # 16 examples: 2 ranks x 2 microbatches x 2, twice

#: (model kind, average_tokens_across_devices, expected causes)
DDP_CASES = (
    ("loss_type", True, []),
    ("loss_type", False, ["per_rank_mean"]),
    ("plain", True, ["count_before_shift"]),
    ("kwargs", False, ["num_items_ignored"]),
    ("unsynced", True, ["ranks_disagree"]),  # never wrapped in DDP: each rank keeps its own
)


def _window_batches(trainer: Any) -> list[dict[str, Tensor]]:
    """The first window's microbatches on this rank, read from the Trainer's own loader
    with the RNG put back, so the run that follows reads the same ones."""
    state = torch.get_rng_state()
    iterator = iter(trainer.get_train_dataloader())
    batches = [next(iterator) for _ in range(trainer.args.gradient_accumulation_steps)]
    torch.set_rng_state(state)
    return [{k: v.clone() for k, v in b.items()} for b in batches]


def ddp_cases() -> list[dict[str, Any]]:
    """Every case of :data:`DDP_CASES` on this rank: the audit's verdict and scale, an
    independent scale (one real DDP update at SGD lr 1 against the token mean over the
    union of both ranks' examples, gathered), and the verdict after the fix."""
    import torch.distributed as dist
    import transformers

    import accumlab.hf as ah

    transformers.logging.set_verbosity_error()
    out = []
    for case, average, _ in DDP_CASES:
        kind = "loss_type" if case == "unsynced" else case
        args = dict(average_tokens_across_devices=average, gradient_accumulation_steps=2)
        model = model_for(kind)
        trainer = make_trainer(model, make_args(**args), train_dataset=examples(SIXTEEN))
        if case == "unsynced":  # a model Accelerate never wraps: no gradient all-reduce
            trainer.accelerator.prepare_model = lambda model, *a, **k: model
            report = ah.audit_trainer(trainer)
            out.append({"kind": case, "average": average, "ok": report.ok,
                        "mistakes": report.mistakes, "text": str(report)})
            continue
        report = ah.audit_trainer(trainer)
        fixed = ah.audit_trainer(apply_fix(report, model, trainer)) if report.fix else report
        mine = _window_batches(make_trainer(model_for(kind), make_args(**args),
                                            train_dataset=examples(SIXTEEN)))
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        union = [b for rank in gathered for b in rank]
        ref = reference_gradient(model_for(kind), union)
        g = applied_gradient(model_for(kind), args, train_dataset=examples(SIXTEEN))
        w = report.windows[0]
        out.append({
            "kind": kind, "average": average, "ok": report.ok, "mistakes": report.mistakes,
            "scale": report.scale, "independent_scale": least_squares_scale(g, ref),
            "targets": w.targets, "rank_targets": w.rank_targets, "ranks": w.ranks,
            "union_targets": sum(int((b["labels"][:, 1:] != -100).sum()) for b in union),
            "fixed_ok": fixed.ok, "text": str(report),
        })
    return out


# -- the audit under another transformers release (run in a subprocess) ------------------

VERSION_CASES = ("plain", "loss_type", "kwargs", "nokw", "correct_func", "classes")

#: the sequence-classification case: 7 examples, so the last microbatch holds one
CLASSES = 7


def version_cases(cases: tuple[str, ...] = VERSION_CASES) -> None:
    """Print, as one JSON line, each of ``cases`` (names from :data:`VERSION_CASES`) under
    the transformers this interpreter imports: the audit's verdict and scale, the
    independent scale (one real update against the token mean of the 8 examples), whether
    the audit calls the fixed job ok and the fixed job's real update's relative error."""
    import copy
    import functools
    import json

    import transformers

    import accumlab.hf as ah

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    out: dict[str, Any] = {"version": transformers.__version__}
    for case in cases:
        kind = "plain" if case == "correct_func" else case
        extra: dict[str, Any] = {"compute_loss_func": correct_loss_func} if case == "correct_func" else {}
        if case == "classes":  # one class per example; the printed fix counts the examples
            build = gpt2_classifier
            extra = {"data_collator": collate_classes, "train_dataset": examples()[:CLASSES]}
            ref = class_reference(build(), [collate_classes(examples()[:CLASSES])])
        else:
            build = functools.partial(model_for, kind)
            ref = reference_gradient(copy.deepcopy(build()), [collate(examples())])
        g, logged = applied_and_logged(build(), **extra)
        model = build()
        trainer = make_trainer(model, make_args(**SGD_STEP), **extra)
        report = ah.audit_trainer(trainer)
        fixed = ah.audit_trainer(apply_fix(report, model, trainer, **extra)) if report.fix else report
        params = [p for p in model.parameters() if p.requires_grad]
        before = flat(params)
        trainer.train()  # the fixed job's real update
        g_fixed = before - flat(params)
        out[case] = {
            "ok": report.ok, "mistakes": report.mistakes, "scale": report.scale,
            "independent_scale": least_squares_scale(g, ref), "fixed_ok": fixed.ok,
            "fixed_error": float((g_fixed - ref).norm() / ref.norm()), "text": str(report),
            "audit_logged": {n.name: [n.finding, n.apart, n.logged] for n in report.logged},
            "trainer_logged": logged,
        }
    print(json.dumps(out))


if __name__ == "__main__":
    import sys

    version_cases(tuple(sys.argv[1:]) or VERSION_CASES)
