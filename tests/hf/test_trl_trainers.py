"""AuditCallback on every trainer class TRL 1.16 exports that can run one step on the CPU.

Each trainer (``tests/helpers/hf_trl.py``: a tiny Llama, a character or byte-level BPE
tokenizer made in code, a teacher or reference model where it takes one) trains one
optimizer step with the callback and once without: the step finishes, the weights are
bit for bit the same, and a report exists, checked or not checked with its reason. Before,
a trainer whose training_step gets dataset rows (GRPO and every trainer built on it) made
trainer.train() raise through the callback. TRL 1.16 has no PRMTrainer, BCOTrainer,
XPOTrainer or NashMDTrainer (they were removed before 1.16); the classes it has that need
a server are named in ``hf_trl.NOT_RUNNABLE`` with the reason.
"""

from __future__ import annotations

import importlib
import inspect
import os
import pkgutil
import warnings

import pytest

transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")

from helpers import hf_trl  # noqa: E402

from accumlab.hf.callback import AuditCallback  # noqa: E402

pytestmark = pytest.mark.slow  # about 2 s a trainer, 21 trainers
transformers.logging.set_verbosity_error()
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

#: trainer -> what the report says on this tiny job: the names (empty: ok), or the start
#: of the "not checked" reason
VERDICTS = {
    "SFT": [], "DPO": [], "KTO": [], "Reward": [], "GRPO": [], "RLOO": [], "Distillation": [],
    "experimental KTO": [], "experimental Distillation": [], "BEMA DPO": [], "TPO": [], "A2PO": [],
    "GMPO": [], "SDFT": [],
    "CPO": ["average_of_averages"], "ORPO": ["average_of_averages"],  # NLL: a token mean per microbatch, / A
    # they sample completions inside training_step: the replay draws others
    "GKD": "replaying the window at its own split",
    "GOLD": "replaying the window at its own split",
    "IWOPD": "the job's steps draw random numbers",
    "Online DPO": "OnlineDPOTrainer hands training_step inputs without per-example tensors",
    "SDPO": "the job's gradient for this window is zero",  # every advantage 0 on this job
}


def exported_trainers() -> set[str]:
    """``module.Class`` of every public ``*Trainer`` class of ``trl`` and ``trl.experimental``."""
    found = {f"trl.{n}" for n in dir(trl) if n.endswith("Trainer") and inspect.isclass(getattr(trl, n))}
    import trl.experimental as experimental

    for info in pkgutil.iter_modules(experimental.__path__):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            module = importlib.import_module(f"trl.experimental.{info.name}")
        found |= {f"trl.experimental.{info.name}.{n}" for n in getattr(module, "__all__", dir(module))
                  if n.endswith("Trainer") and not n.startswith("_") and inspect.isclass(getattr(module, n))}
    return found


def test_every_trainer_class_is_run_or_named_with_why_not():
    assert trl.__version__ == "1.16.0"
    runnable = {build.target for build in hf_trl.TRAINERS.values()}
    assert exported_trainers() == runnable | set(hf_trl.NOT_RUNNABLE)
    assert set(VERDICTS) == set(hf_trl.TRAINERS)


@pytest.mark.parametrize("name", sorted(hf_trl.TRAINERS))
def test_one_step_with_the_callback_trains_as_without_it_and_reports(name):
    callback = AuditCallback()
    audited = hf_trl.TRAINERS[name]()
    audited.add_callback(callback)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        audited.train()
        plain = hf_trl.TRAINERS[name]()
        plain.train()
    assert audited.state.global_step == plain.state.global_step == 1
    for (key, a), (_, b) in zip(audited.model.named_parameters(), plain.model.named_parameters(), strict=True):
        assert a.detach().equal(b.detach()), key
    (report,) = callback.reports
    expected = VERDICTS[name]
    if isinstance(expected, list):
        assert report.checked and report.mistakes == expected, str(report)
    else:
        assert not report.checked and expected in report.reason, str(report)
