"""accumlab.hf.audit_trainer under older transformers releases beside the installed one.

Each release counts ``num_items_in_batch`` its own way, and the audit must measure each
right and its fixes must work on each:

* 4.46.3 (the first with ``num_items_in_batch``) passes a count only to a model whose
  forward takes ``**loss_kwargs`` (GPT-2's does not), and then no longer divides by the
  accumulation steps even when it passed none: every GPT-2 job sums A microbatch means.
* 4.50.3 and 4.57.6 pass the count to any forward with ``**kwargs`` and count every label
  that is not -100, before the causal shift, whatever the model.
* 5.x (the environment's, tested everywhere else) counts after the shift when it
  recognises the model's loss as a causal-LM loss (``model.loss_type``).

``make slow`` installs each release into its own folder (``tests/helpers/hf_releases.py``
finds it; a missing one fails the test); this test runs ``tests/helpers/hf_workers.py``
once per release in a subprocess with that folder first on ``PYTHONPATH``.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers import hf_releases

pytestmark = pytest.mark.slow  # make slow installs the releases

#: release -> case -> the causes the audit names (measured on each release; the scale is
#: checked against an independent one below, so a name here cannot hide a wrong number)
EXPECTED = {
    "4.46.3": {
        "plain": ["num_items_ignored"],  # no **loss_kwargs: no count, and no division by A
        "loss_type": ["num_items_ignored"],
        "kwargs": ["num_items_ignored"],  # **kwargs is not **loss_kwargs on this release
        "nokw": ["num_items_ignored"],
        "classes": ["num_items_ignored"],  # its fix counts the examples (it crashed on [:, 1:])
        # correct_func is left out: 4.46 passes compute_loss_func num_items_in_batch=None for
        # GPT-2 (no **loss_kwargs), so "sum / num_items_in_batch" is no valid job there.
    },
    "4.50.3": {
        "plain": ["count_before_shift"],
        "loss_type": ["count_before_shift"],  # loss_type is not read when it counts
        "kwargs": ["num_items_ignored"],
        "nokw": ["average_of_averages"],
        "correct_func": ["count_before_shift"],
        "classes": ["average_of_averages"],  # no **kwargs: a mean per microbatch, divided by A
    },
    "4.57.6": {
        "plain": ["count_before_shift"],
        "loss_type": ["count_before_shift"],  # 4.57 ignores loss_type when it counts
        "kwargs": ["num_items_ignored"],
        "nokw": ["average_of_averages"],
        "correct_func": ["count_before_shift"],
        "classes": ["average_of_averages"],  # no **kwargs: a mean per microbatch, divided by A
    },
}

#: 47 shifted targets where the Trainer divides by 55 labels (tests/helpers/hf_workers.py)
BEFORE_SHIFT = 47 / 55


@pytest.fixture(scope="module", params=sorted(EXPECTED))
def measured(request):
    """One subprocess per release: every case's verdict, scale, independent scale, fix."""
    release = request.param
    env = hf_releases.subprocess_env(release)
    done = subprocess.run([sys.executable, "-m", "helpers.hf_workers", *EXPECTED[release]], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return release, json.loads(done.stdout.strip().splitlines()[-1])


def test_verdict_scale_and_fix_under_each_release(measured):
    release, out = measured
    assert out["version"] == release
    assert set(out) - {"version"} == set(EXPECTED[release])
    for case, mistakes in EXPECTED[release].items():
        result = out[case]
        assert result["mistakes"] == mistakes, (release, case, result)
        assert not result["ok"], (release, case)
        assert result["scale"] == pytest.approx(result["independent_scale"], abs=1e-3), (release, case)
        assert result["fixed_ok"], (release, case)
        assert result["fixed_error"] < 1e-5, (release, case)  # the fixed job's real update
        text = " ".join(result["text"].split())
        if mistakes == ["num_items_ignored"] and "Trainer's count none" in text:
            # 4.46.3 never passed the count: the report must not say the model ignored one
            assert "the Trainer passed no num_items_in_batch" in text, (release, case, text)
            assert "having passed it" not in text, (release, case, text)
        if mistakes == ["count_before_shift"]:
            assert result["scale"] == pytest.approx(BEFORE_SHIFT, abs=1e-6), (release, case)
        # the logged loss the audit predicts is the one the Trainer logged for the update
        finding, apart, predicted = result["audit_logged"]["loss"]
        assert predicted == pytest.approx(result["trainer_logged"]["loss"], rel=1e-3), (release, case)
        if release == "4.46.3" and case in ("plain", "classes"):
            # the update sums A microbatch means, the log divides them by A: a right-looking
            # loss over a wrong update, named apart from it
            assert (finding, apart) == ("average of averages", True), (release, case, result)
