"""Online RL jobs for the audit's tests: TRL's GRPO and RLOO on a tiny Llama.

Everything is local: a one-layer Llama from its config, the character tokenizer of
``hf_jobs``, two prompts, four generations each, completions of 0 to 11 characters (the
model stops at <eos> or at ``max_completion_length``), a reward written here, ``beta``
0 (no reference model), one iteration per generation. The truth of a job is measured
without the audit: its real first update read off the weights (SGD at learning rate 1,
no clipping) at one split against another, with the completions checked identical
(:func:`real_update` returns them): the generation batch holds the same rows in the
same order at both, so the same random state samples the same completions.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from helpers import hf_jobs as hj

PROMPTS = ("the cat", "a dog ran")
GENERATIONS = 4


def reward(completions: list[Any], **_: Any) -> list[float]:
    """Vowels minus a third of the length: completions of one prompt score differently (a
    conversational completion, a list of messages, by their contents)."""
    texts = [c if isinstance(c, str) else " ".join(m["content"] for m in c) for c in completions]
    return [float(sum(ch in "aeiou" for ch in text)) - len(text) / 3.0 for text in texts]


def build(kind: str = "grpo", loss_type: str | None = "dapo", *, m: int = 2, a: int = 4,
          steps_per_generation: int | None = None, **args: Any) -> Any:
    """A fresh ``GRPOTrainer`` (``kind="grpo"``, with ``loss_type``) or ``RLOOTrainer``
    (``"rloo"``): ``m`` completions per microbatch, ``A`` = ``a``; the generation batch is
    the two prompts' eight completions unless ``steps_per_generation`` says otherwise."""
    import datasets
    import trl

    config_cls, trainer_cls = {"grpo": (trl.GRPOConfig, trl.GRPOTrainer),
                               "rloo": (trl.RLOOConfig, trl.RLOOTrainer)}[kind]
    settings: dict[str, Any] = dict(per_device_train_batch_size=m, gradient_accumulation_steps=a,
                                    num_generations=GENERATIONS, max_completion_length=11, beta=0.0,
                                    bf16=False, seed=0)
    if kind == "grpo":
        settings["loss_type"] = loss_type
    if steps_per_generation is not None:
        settings["steps_per_generation"] = steps_per_generation
    settings.update(args)
    config = hj.training_args(config_cls, **settings)
    return trainer_cls(model=hj.causal_lm("llama"), reward_funcs=reward, args=config,
                       train_dataset=datasets.Dataset.from_list([{"prompt": p} for p in PROMPTS]),
                       processing_class=hj.tokenizer(padding_side="left"))


def before_6024(trainer: Any) -> Any:
    """TRL's DAPO normalizer before its PR #6024, put back by a monkeypatch: each
    microbatch divided by the generation batch's completion tokens (``num_items_in_batch``
    over the processes) without the rescale by ``current_gradient_accumulation_steps /
    steps_per_generation`` that the PR added. Returns the trainer."""
    own = trainer._compute_loss

    def _compute_loss(model: torch.nn.Module, inputs: dict[str, Any]) -> Tensor:
        loss = own(model, inputs)
        if trainer.loss_type in ("dapo", "cispo", "vespo") and model.training:
            loss = loss * trainer.current_gradient_accumulation_steps / trainer.args.steps_per_generation
        return loss

    trainer._compute_loss = _compute_loss
    return trainer


def completions(trainer: Any) -> list[list[int]]:
    """The completions of the trainer's generation batch, each as its token ids (masked
    tokens dropped), in the buffer's order."""
    out = []
    for part in trainer._buffered_inputs:
        for ids, mask in zip(part["completion_ids"], part["completion_mask"], strict=True):
            out.append(ids[mask.bool()].tolist())
    return out


def real_update(trainer: Any) -> tuple[Tensor, list[list[int]]]:
    """One real update (the trainer built with ``hj.SGD``): the gradient it applied, read
    off the weights, and the completions it trained on."""
    g, _ = hj.applied(trainer)
    return g, completions(trainer)


__all__ = ["GENERATIONS", "PROMPTS", "before_6024", "build", "completions", "real_update", "reward"]
