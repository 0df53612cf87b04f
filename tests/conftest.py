"""Fixtures shared by every test folder; the helpers tests import live in ``helpers/``.

pytest puts this folder on ``sys.path`` (it has no ``__init__.py``), so tests and spawned
ranks import ``helpers.<module>``.
"""

from __future__ import annotations

import os

import pytest
import torch
from helpers.models import CausalToy, small_gpt
from hypothesis import settings

from accumlab_course.models import TinyGPT

# CI runs the property tests with a fixed seed: a red build must be reproducible, and
# exploring fresh random cases is for local runs.
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")

torch.set_num_threads(1)


@pytest.fixture
def toy64() -> CausalToy:
    """A float64 :class:`CausalToy` with fixed weights."""
    torch.manual_seed(0)
    return CausalToy().double()


@pytest.fixture
def gpt64() -> TinyGPT:
    """A float64 one-layer TinyGPT with fixed weights."""
    return small_gpt(torch.float64)


@pytest.fixture(autouse=True)
def _exercise_messages_on_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """Checkers print their verdicts and hints wrapped at 88 characters for the notebooks;
    tests read them on one line, so a phrase they look for is never cut by a line break.
    ``tests/course/test_exercise_messages.py`` checks the wrapping itself."""
    import accumlab_course.exercises as exercises

    monkeypatch.setattr(exercises, "WIDTH", None)
