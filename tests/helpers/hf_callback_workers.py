"""The 2-rank worker of ``tests/hf/test_hf_callback.py``: ``AuditCallback`` in a real DDP run.

Run on each rank by ``accumlab.distributed.launch`` (gloo, CPU). The jobs are those of
``hf_workers`` (tiny GPT-2, 16 examples of uneven length sharded over the two ranks).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from helpers import hf_workers as hw


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def callback_ranks() -> dict[str, Any]:
    """On this rank: the callback's verdict on a correct and a wrong job (the first of three
    updates audited, dropout 0.1), whether it warned, whether the run then matched a run
    without the callback bit for bit; and whether on_mistake="raise" stopped the wrong job
    before its first update."""
    import transformers

    from accumlab.hf import AuditCallback
    from accumlab.hf.callback import AccumulationError, AccumulationWarning

    transformers.logging.set_verbosity_error()
    settings = dict(gradient_accumulation_steps=2, max_steps=3, learning_rate=1e-2)
    out: dict[str, Any] = {}
    for kind in ("loss_type", "plain"):
        callback = AuditCallback(steps=1)
        trainer = hw.make_trainer(
            hw.model_for(kind, dropout=0.1),
            hw.make_args(**settings),
            train_dataset=hw.examples(hw.SIXTEEN),
            callbacks=[callback],
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.train()
        plain = hw.make_trainer(
            hw.model_for(kind, dropout=0.1),
            hw.make_args(**settings),
            train_dataset=hw.examples(hw.SIXTEEN),
        )
        plain.train()
        (report,) = callback.reports
        out[kind] = {
            "ok": report.ok,
            "mistakes": report.mistakes,
            "text": str(report),
            "ranks": report.windows[0].ranks,
            "warned": sum(issubclass(w.category, AccumulationWarning) for w in caught),
            "same_as_plain": _same(_weights(trainer.model), _weights(plain.model)),
            "wrapped_after": "training_step" in vars(trainer),
        }
    model = hw.model_for("plain")
    before = _weights(model)
    trainer = hw.make_trainer(
        model,
        hw.make_args(**settings),
        train_dataset=hw.examples(hw.SIXTEEN),
        callbacks=[AuditCallback(on_mistake="raise")],
    )
    try:
        trainer.train()
        raised = False
    except AccumulationError:
        raised = True
    out["raise"] = {
        "raised": raised,
        "untouched": _same(_weights(model), before),
        "updates": trainer.state.global_step,
    }
    return out


# -- the callback under another transformers release (run in a subprocess) ----------------


def version_cases() -> dict[str, Any]:
    """Under the transformers this interpreter imports: GPT-2 (dropout 0.1) with the prompt
    masked (position 0 never labelled, so every release counts right) and labelled on every
    token (a release that counts before the shift is off), each with the first of three
    updates audited: the verdict, the warnings, whether the run then matched a run without
    the callback bit for bit; and whether "raise" stopped the wrong job with no update."""
    import transformers

    from accumlab.hf import AuditCallback
    from accumlab.hf.callback import AccumulationError, AccumulationWarning

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)

    def collate_for(mask_first: bool) -> Any:
        def collate(features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
            batch = hw.collate(features)
            if mask_first:
                batch["labels"][:, 0] = -100  # a prompt token: never a target
            return batch

        return collate

    out: dict[str, Any] = {"version": transformers.__version__}
    for name, mask_first in (("masked", True), ("every_token", False)):
        runs = []
        for callbacks in ([AuditCallback()], []):
            trainer = hw.make_trainer(
                hw.model_for("plain", dropout=0.1),
                hw.make_args(max_steps=3),
                data_collator=collate_for(mask_first),
                train_dataset=hw.examples(hw.SIXTEEN),
                callbacks=callbacks,
            )
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                trainer.train()
            runs.append((trainer, caught, callbacks))
        (audited, caught, (callback,)), (plain, _, _) = runs
        (report,) = callback.reports
        out[name] = {
            "ok": report.ok,
            "mistakes": report.mistakes,
            "warned": sum(issubclass(w.category, AccumulationWarning) for w in caught),
            "same_as_plain": _same(_weights(audited.model), _weights(plain.model)),
            "wrapped_after": "training_step" in vars(audited),
        }
    model = hw.model_for("plain")
    before = _weights(model)
    trainer = hw.make_trainer(
        model,
        hw.make_args(max_steps=3),
        train_dataset=hw.examples(hw.SIXTEEN),
        callbacks=[AuditCallback(on_mistake="raise")],
    )
    try:
        trainer.train()
        raised = False
    except AccumulationError:
        raised = True
    out["raise"] = {
        "raised": raised,
        "untouched": _same(_weights(model), before),
        "updates": trainer.state.global_step,
    }
    return out


if __name__ == "__main__":
    import json

    print(json.dumps(version_cases()))
