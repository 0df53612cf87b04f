"""accumlab.hf.audit_trainer under a 2025 transformers release beside the installed one.

transformers 4.57 counts ``num_items_in_batch`` over every label that is not -100 (before
the causal shift) whatever the model; 5.x counts after the shift when it recognises the
model's loss as a causal-LM loss (``model.loss_type``). The audit must measure both right
and its fixes must work on both. ``make unit`` (and so ``make test``) installs
transformers 4.57.6 into its own folder, ``$(VENV)/hf-transformers-4.57.6`` (never into
the virtual environment), and this test runs ``tests/helpers/hf_workers.py`` in a subprocess with
that folder first on ``PYTHONPATH``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]  # on PYTHONPATH: the subprocess imports helpers.*
OLD = "4.57.6"
FOLDER = Path(os.environ.get("ACCUMLAB_HF_OLD", Path(sys.prefix) / f"hf-transformers-{OLD}"))

#: case -> the causes the audit names under transformers 4.57
EXPECTED_457 = {
    "plain": ["count_before_shift"],
    "loss_type": ["count_before_shift"],  # 4.57 ignores loss_type when it counts
    "kwargs": ["num_items_ignored"],
    "nokw": ["average_of_averages"],
    "correct_func": ["count_before_shift"],
}


@pytest.fixture(scope="module")
def old_release():
    if not (FOLDER / "transformers").is_dir():
        pytest.skip(f"transformers {OLD} is not installed in {FOLDER}: run make unit (it installs it)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(FOLDER), str(TESTS)]),
               TQDM_DISABLE="1", OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-m", "helpers.hf_workers"], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_subprocess_runs_the_old_release(old_release):
    assert old_release["version"] == OLD


@pytest.mark.parametrize("case", sorted(EXPECTED_457))
def test_verdict_scale_and_fix_under_transformers_4_57(old_release, case):
    result = old_release[case]
    assert result["mistakes"] == EXPECTED_457[case]
    assert not result["ok"]
    assert result["scale"] == pytest.approx(result["independent_scale"], abs=1e-3)
    assert result["fixed_ok"]
    if case in ("plain", "loss_type", "correct_func"):
        assert result["scale"] == pytest.approx(47 / 55, abs=1e-6)
